"""synchronized_params: during 0/1 Adam's phase B the workers' parameters drift apart between
syncs, and ``params + u`` is where they all were at the last sync: identical on every worker to
float rounding, and equal to the parameters right after that sync."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.mapping import AXIS, mapped

import optax_zero_one as ozo

N, STEPS = 4, 36
SHAPES = [(6, 5), (7,)]
# F = 10; kappa = 2; alpha = 3, H = 4: syncs at 11..13, every 2nd step to 18, then every 4th,
# so phase B has runs of up to 3 local steps between syncs.
SCHEDULE = dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
VARIANCE, LOCAL = ozo.VarianceDoubling(10, 2), ozo.LocalStepDoubling(3, 4)


def run(mode):
    """Per step: the kind taken, each worker's params, and synchronized_params computed both
    outside the mapped context (worker layout) and inside it (one worker's tree)."""
    tx = optax.chain(
        optax.clip_by_global_norm(10.0),  # nest the state, as users do
        ozo.zero_one_adam(
            optax.linear_schedule(0.05, 0.01, STEPS), weight_decay=0.01, axis_name=AXIS, **SCHEDULE
        ),
    )
    rng = np.random.default_rng(0)
    x0 = [rng.standard_normal(s) for s in SHAPES]
    scale = jnp.asarray(rng.uniform(0.5, 2.0, N), jnp.float32)  # each worker's own curvature
    noise = rng.standard_normal((STEPS, N, sum(int(np.prod(s)) for s in SHAPES)))

    def step(x, state, a, flat_noise):
        leaves, offset = [], 0
        for leaf in x:
            size = leaf.size
            leaves.append(a * leaf + 0.3 * flat_noise[offset : offset + size].reshape(leaf.shape))
            offset += size
        updates, state = tx.update(leaves, state, x)
        x = optax.apply_updates(x, updates)
        return x, state, ozo.synchronized_params(x, state)

    x = [jnp.asarray(np.repeat(p[None], N, 0), jnp.float32) for p in x0]
    state = mapped(tx.init, mode, N)(x)
    step_fn = mapped(step, mode, N)
    history = []
    for k in range(STEPS):
        inner = jax.device_get(state[1])
        kind = ozo.step_kind(inner, ozo.StepSchedule(VARIANCE, LOCAL)).name
        x, state, synced_inside = step_fn(x, state, scale, jnp.asarray(noise[k], jnp.float32))
        jax.block_until_ready(x)
        synced_outside = ozo.synchronized_params(x, state)
        history.append((kind, *jax.device_get((x, synced_outside, synced_inside))))
    return history


@pytest.mark.parametrize("mode", ["vmap", "shard_map"])
def test_synchronized_params_identical_on_all_workers_between_syncs(mode):
    history = run(mode)
    kinds = [h[0] for h in history]
    assert kinds.count("local") >= 8 and kinds.count("sync") >= 8
    last_synced = None
    checked = 0
    for kind, x, outside, inside in history:
        if kind in ("variance", "compressed", "sync"):
            last_synced = x  # right after a sync every worker holds the synchronised point
            for leaf in x:
                np.testing.assert_allclose(leaf, np.broadcast_to(leaf[0], leaf.shape), atol=1e-6)
        for a, b in zip(outside, inside):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        if kind != "local":
            continue
        checked += 1
        # the workers really differ between syncs ...
        assert any(not np.allclose(leaf[0], leaf[i]) for leaf in x for i in range(1, N))
        for leaf, synced, reference in zip(x, outside, last_synced):
            # ... but their synchronised parameters agree, and are the last sync's parameters
            np.testing.assert_allclose(
                synced, np.broadcast_to(synced[0], synced.shape), rtol=1e-6, atol=1e-6
            )
            np.testing.assert_allclose(synced, reference, rtol=1e-5, atol=1e-6)
            assert synced.dtype == leaf.dtype
    assert checked == kinds.count("local")


def test_synchronized_params_are_the_params_outside_local_steps():
    """1-bit Adam, Adam, and 0/1 Adam in phase A: all workers hold the same params."""
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    for tx in (
        ozo.onebit_adam(0.1, freeze_step=2),
        optax.adam(0.1),
        ozo.zero_one_adam(0.1, var_freeze_step=5),
    ):
        state = tx.init(params)
        updates, state = tx.update({"w": jnp.ones((2, 3))}, state, params)
        moved = optax.apply_updates(params, updates)
        assert not np.array_equal(moved["w"], params["w"])
        out = ozo.synchronized_params(moved, state)
        np.testing.assert_array_equal(out["w"], moved["w"])


@pytest.mark.parametrize("how", ["masked", "multi_transform"])
def test_synchronized_params_of_an_optimizer_over_part_of_the_tree(how):
    """0/1 Adam on some leaves (``optax.masked``, or ``optax.multi_transform`` beside SGD):
    between syncs those leaves come from the anchor, the same on every worker; the others are
    the params as they are."""
    zero_one = ozo.zero_one_adam(0.05, axis_name=AXIS, **SCHEDULE)
    labels = {"w": "zero_one", "b": "sgd", "e": "zero_one"}
    if how == "masked":
        tx = optax.masked(zero_one, {k: v == "zero_one" for k, v in labels.items()})
    else:
        tx = optax.multi_transform({"zero_one": zero_one, "sgd": optax.sgd(0.05)}, labels)
    rng = np.random.default_rng(1)
    shapes = {"w": (6, 5), "b": (7,), "e": (3, 2)}
    x = {k: jnp.asarray(np.repeat(rng.standard_normal(s)[None], N, 0), jnp.float32)
         for k, s in shapes.items()}  # fmt: skip
    state = mapped(tx.init, "vmap", N)(x)
    step = mapped(lambda x, s, g: (lambda u, s: (optax.apply_updates(x, u), s))(
        *tx.update(g, s, x)), "vmap", N)  # fmt: skip
    schedule = ozo.StepSchedule(VARIANCE, LOCAL)
    for k in range(1, 18):
        kind = schedule.kind(k).name
        grads = {
            n: jnp.asarray(rng.standard_normal((N, *s)), jnp.float32) for n, s in shapes.items()
        }
        x, state = step(x, state, grads)
        if kind == "sync":
            synced_at = jax.tree.map(np.asarray, x)
    assert kind == "local"  # step 17: between syncs, the workers apart
    out = ozo.synchronized_params(x, state)
    for name in ("w", "e"):  # from the anchor: the last sync's point, on every worker
        assert not np.allclose(x[name][0], x[name][1])
        np.testing.assert_array_equal(out[name], np.broadcast_to(out[name][0], out[name].shape))
        # the params after a sync are x + (xbar - x) in float32: xbar to the last bit
        np.testing.assert_allclose(out[name], synced_at[name], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out["b"], x["b"])  # SGD's leaf: the params as they are


def test_helpers_refuse_a_state_copied_into_plain_mappings():
    """nnx.to_pure_dict of an nnx.Optimizer's state, or a checkpoint restored without a target,
    keeps the fields as plain mappings: synchronized_params returned the current params as if
    there were no local steps; it and the counters' readers now refuse it."""
    tx = ozo.zero_one_adam(0.1, var_freeze_step=2)
    params = {"w": jnp.zeros(3)}

    def plain(x):
        if hasattr(x, "_asdict"):
            return {k: plain(v) for k, v in x._asdict().items()}
        if isinstance(x, tuple | list):
            return [plain(v) for v in x]
        return x

    state = plain(tx.init(params))
    for helper in (lambda s: ozo.synchronized_params(params, s), ozo.step_count, ozo.check_hints):
        with pytest.raises(ValueError, match="plain mappings .*optimizer.opt_state"):
            helper(state)


def test_synchronized_params_rejects_two_zero_one_states():
    tx = optax.chain(ozo.zero_one_adam(0.1), ozo.zero_one_adam(0.1))
    params = {"w": jnp.zeros(3)}
    with pytest.raises(ValueError, match="more than one LocalStepSyncState"):
        ozo.synchronized_params(params, tx.init(params))


def test_unreplicate_refuses_a_worker_out_of_range_and_a_scalar_leaf():
    tree = ozo.replicate({"w": jnp.arange(3.0)}, 2)
    np.testing.assert_array_equal(ozo.unreplicate(tree, worker=-1)["w"], np.arange(3.0))
    with pytest.raises(ValueError, match="worker 5 is out of range: the tree holds 2 workers"):
        ozo.unreplicate(tree, worker=5)  # was NumPy's IndexError
    with pytest.raises(ValueError, match="a scalar leaf"):
        ozo.unreplicate({"w": jnp.zeros(())})
