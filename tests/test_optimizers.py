"""zero_one_adam and onebit_adam against the float64 reference, the schedules, the traffic per
step kind, the three mappings, and the single-worker limit (Adam without bias correction)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import reference
from support.mapping import AXIS, MODES, mapped

import optax_zero_one as ozo

SHAPES = [(6, 5), (5,), (5, 3), (3,)]
N = 4
# kappa = 2, F = 20, alpha = 4, H = 4: variance steps 1, 2, 4, 6, 8, 12, 16; syncs 21..24,
# then every 2nd step to 28, then every 4th: every step kind and a growing interval in 40 steps.
SCHEDULE = dict(var_freeze_step=20, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4)
STEPS = 40


def problem(seed=0):
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s) for s in SHAPES]
    targets = [rng.standard_normal(s) for s in SHAPES]
    curvature = rng.uniform(0.5, 2.0, size=N)  # each worker sees a differently scaled problem
    noise = rng.standard_normal((STEPS, N, sum(int(np.prod(s)) for s in SHAPES)))
    return params, targets, curvature, noise


def local_grads(xs, targets, curvature, noise_k):
    """grads[worker][leaf] of worker i's loss 0.5 a_i ||x - t||^2 plus its own noise."""
    out = []
    for i in range(N):
        flat_noise, offset, leaves = noise_k[i], 0, []
        for x, t in zip(xs[i], targets):
            size = x.size
            leaves.append(
                curvature[i] * (x - t) + 0.3 * flat_noise[offset : offset + size].reshape(x.shape)
            )
            offset += size
        out.append(leaves)
    return out


def to_layout(per_worker, dtype=np.float32):
    """[worker][leaf] -> list of leaves with a leading worker axis."""
    return [
        jnp.asarray(np.stack([w[leaf] for w in per_worker]), dtype) for leaf in range(len(SHAPES))
    ]


def schedule(count):
    return 0.05 * 0.97**count


CASES = {
    "plain": dict(learning_rate=0.05, weight_decay=0.0, mask=None),
    # coordinates no gradient ever reaches (unused embedding rows, dead ReLU units): their v
    # stays 0; DeepSpeed's update divides their 1-bit momentum by eps there (an Equinox trial:
    # such rows moved 1.7e3 at 0/1 Adam's first compressed step); here they stay put
    "dead coordinates": dict(
        learning_rate=0.05,
        weight_decay=0.0,
        mask=None,
        dead=[
            np.repeat([[1.0], [1.0], [1.0], [1.0], [0.0], [0.0]], 5, axis=1),
            np.ones((5,)),
            (np.arange(15).reshape(5, 3) % 3 != 0).astype(float),
            np.ones(3),
        ],
    ),
    "wd+schedule+mask": dict(
        learning_rate=schedule,
        weight_decay=0.01,
        mask=[
            np.ones((6, 5)),
            np.zeros((5,)),
            (np.arange(15).reshape(5, 3) % 2).astype(float),
            np.ones(3),
        ],
    ),
}


def run_against_reference(kind, case, mode="vmap"):
    params, targets, curvature, noise = problem()
    lr, wd, mask = case["learning_rate"], case["weight_decay"], case["mask"]
    if kind == "zero_one":
        ref = reference.ZeroOneAdam(params, N, lr, weight_decay=wd, mask=mask, **SCHEDULE)
        tx = ozo.zero_one_adam(lr, weight_decay=wd, axis_name=AXIS, mask=mask, **SCHEDULE)
    else:
        ref = reference.OnebitAdam(params, N, lr, weight_decay=wd, freeze_step=15, mask=mask)
        tx = ozo.onebit_adam(lr, weight_decay=wd, freeze_step=15, axis_name=AXIS, mask=mask)

    def step(x, s, g):
        u, s = tx.update(g, s, x)
        return optax.apply_updates(x, u), s

    x = to_layout([params] * N)
    state = mapped(tx.init, mode, N)(x)
    run = mapped(step, mode, N)
    history = []
    for k in range(STEPS):
        grads = local_grads(ref.x, targets, curvature, noise[k])
        if case.get("dead") is not None:
            grads = [[g * d for g, d in zip(w, case["dead"], strict=True)] for w in grads]
        ref.step(grads)
        x, state = run(x, state, to_layout(grads))
        jax.block_until_ready(x)
        history.append((ref.last_kind, [np.asarray(leaf) for leaf in x], state, _copy_ref(ref)))
    return history


def _copy_ref(ref):
    return {
        name: [[np.array(a) for a in w] for w in getattr(ref, name)] for name in ("x", "m", "v")
    }


class Moments(NamedTuple):
    mu: list
    nu: list


def inner_state(state):
    """The optimizer's moments as per-leaf arrays (worker axis first)."""
    for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, ozo.FrozenVarianceAdamState)):
        if isinstance(s, ozo.FrozenVarianceAdamState):
            return Moments(s.mu.to_tree(), s.nu.to_tree())
    raise AssertionError("no optimizer state found")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["zero_one", "onebit"])
def test_follows_reference_step_by_step(kind, case):
    history = run_against_reference(kind, CASES[case])
    kinds = [h[0] for h in history]
    if kind == "zero_one":
        assert set(kinds) == {"variance", "compressed", "local", "sync"}
    else:
        assert set(kinds) == {"warmup", "compressed"}
    for k, (_, x, state, ref) in enumerate(history, start=1):
        s = inner_state(state)
        for leaf in range(len(SHAPES)):
            for i in range(N):
                where = f"step {k} ({kinds[k - 1]}), leaf {leaf}, worker {i}"
                np.testing.assert_allclose(
                    x[leaf][i], ref["x"][i][leaf], rtol=2e-4, atol=2e-5, err_msg=where
                )
                np.testing.assert_allclose(
                    np.asarray(s.mu[leaf])[i],
                    ref["m"][i][leaf],
                    rtol=2e-4,
                    atol=2e-5,
                    err_msg=where,
                )
                np.testing.assert_allclose(
                    np.asarray(s.nu[leaf])[i],
                    ref["v"][i][leaf],
                    rtol=2e-4,
                    atol=1e-8,
                    err_msg=where,
                )
    dead = CASES[case].get("dead")
    if dead is not None:  # never moved, bit for bit (no decay in this case)
        start = to_layout([problem()[0]] * N)
        for leaf, d in enumerate(dead):
            np.testing.assert_array_equal(
                np.asarray(history[-1][1][leaf])[:, d == 0], np.asarray(start[leaf])[:, d == 0]
            )


def test_workers_agree_after_every_sync():
    history = run_against_reference("zero_one", CASES["wd+schedule+mask"])
    for kind, x, state, _ in history:
        s = inner_state(state)
        if kind in ("variance", "compressed", "sync"):
            for leaf in range(len(SHAPES)):
                mu = np.asarray(s.mu[leaf])
                assert np.array_equal(mu, np.broadcast_to(mu[0], mu.shape)), kind
                np.testing.assert_allclose(
                    x[leaf], np.broadcast_to(x[leaf][0], x[leaf].shape), atol=1e-6
                )
        if kind == "local":  # local steps really diverge
            assert any(not np.allclose(x[leaf][0], x[leaf][1]) for leaf in range(len(SHAPES)))


@pytest.mark.parametrize("kind", ["zero_one", "onebit"])
def test_same_run_under_shard_map_pmap_vmap(kind):
    """The three mappings follow the same run: float state to rounding (XLA may associate
    reductions and contract multiply-adds differently in each), counters exactly."""
    runs = {mode: run_against_reference(kind, CASES["wd+schedule+mask"], mode) for mode in MODES}
    for (_, xa, sa, _), (_, xb, sb, _), (_, xc, sc, _) in zip(*runs.values()):
        for a, b, c in zip(*(jax.tree.leaves(t) for t in ((xa, sa), (xb, sb), (xc, sc)))):
            a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
            if jnp.issubdtype(a.dtype, jnp.floating):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_array_equal(a, b)
                np.testing.assert_array_equal(b, c)


def test_exact_schedule_from_the_spec():
    variance = ozo.VarianceDoubling(freeze_step=41, update_scaler=2)
    local = ozo.LocalStepDoubling(scaler=10, clipper=4)
    tx = ozo.scale_by_zero_one_adam(0.1, variance_policy=variance, local_step_policy=local)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    kinds = []
    for _ in range(68):
        kinds.append(ozo.step_kind(state, ozo.StepSchedule(variance, local)).name)
        _, state = update({"w": jnp.ones(3)}, state, params)
    steps = lambda name: [k for k, kind in enumerate(kinds, start=1) if kind == name]
    assert steps("variance") == [1, 2, 4, 6, 8, 12, 16, 24, 32]
    assert steps("sync") == list(range(42, 53)) + [54, 56, 58, 60, 64, 68]
    assert set(steps("compressed")) == set(range(1, 42)) - set(steps("variance"))
    assert steps("local") == [53, 55, 57, 59, 61, 62, 63, 65, 66, 67]
    # the policies alone give the same schedule, with no optimizer involved
    assert list(ozo.core.policies.variance_steps(variance, 68)) == steps("variance")
    assert list(ozo.core.policies.sync_steps(local, 41, 68)) == steps("sync")
    assert list(ozo.core.policies.variance_steps(variance, 68)) == reference.variance_steps(
        41, 2, 68
    )
    assert list(ozo.core.policies.sync_steps(local, 41, 68)) == reference.sync_steps(41, 10, 4, 68)


def adam_no_bias_correction(params, grads_seq, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    x, m, v = np.array(params, np.float64), 0.0, 0.0
    for k, g in enumerate(grads_seq):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        x = x - lr(k) * (m / (np.sqrt(v) + eps) + wd * x)
    return x


@pytest.mark.parametrize("kind", ["zero_one", "onebit"])
def test_single_worker_without_compression_is_adam_without_bias_correction(kind):
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((30, 7))
    x0 = rng.standard_normal(7)
    if kind == "zero_one":
        tx = ozo.zero_one_adam(
            schedule, weight_decay=0.1, var_freeze_step=10**6, var_update_scaler=10**6
        )
    else:
        tx = ozo.onebit_adam(schedule, weight_decay=0.1, freeze_step=10**6)
    x = jnp.asarray(x0, jnp.float32)
    state = tx.init(x)
    update = jax.jit(tx.update)  # eager, every op of every kind's branch would dispatch alone
    for g in grads:
        u, state = update(jnp.asarray(g, jnp.float32), state, x)
        x = optax.apply_updates(x, u)
    want = adam_no_bias_correction(x0, grads, schedule, 0.1)
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["zero_one", "onebit"])
def test_two_dimensional_mesh_reducing_over_one_axis(kind):
    """Data-parallel over "data" on a ("data", "model") mesh, params split over "model" too:
    every step kind traces (the branches' types agree over both mesh axes) and stays finite."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if kind == "zero_one":
        tx = ozo.zero_one_adam(0.05, axis_name="data", **SCHEDULE)
    else:
        tx = ozo.onebit_adam(0.05, freeze_step=5, axis_name="data")
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    spec = P("data", "model")
    lead = lambda a: a[None, None]  # noqa: E731 (one state per device: data x model)

    def body(x, s, g):
        x, g = x[0], g[0]
        s = jax.tree.map(lambda a: a[0, 0], s)
        u, s = tx.update(g, s, x)
        return optax.apply_updates(x, u)[None], jax.tree.map(lead, s)

    def init(x):
        return jax.tree.map(lead, tx.init(x[0]))

    sharding = NamedSharding(mesh, spec)
    x = jax.device_put(jnp.ones((2, 16)), sharding)
    state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=spec, out_specs=spec))(x)
    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec))
    )
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        g = jax.device_put(jnp.asarray(rng.standard_normal((2, 16)), jnp.float32), sharding)
        x, state = step(x, state, g)
        jax.block_until_ready(x)
    assert np.all(np.isfinite(np.asarray(x)))


def test_state_can_be_donated():
    """init returns distinct buffers, so a jitted step may donate the whole state."""
    for tx in (ozo.zero_one_adam(1e-3), ozo.onebit_adam(1e-3)):
        params = {"w": jnp.ones(8)}
        state = tx.init(params)
        step = jax.jit(lambda p, s, g, tx=tx: tx.update(g, s, p), donate_argnums=(1,))
        for _ in range(3):
            _, state = step(params, state, {"w": jnp.ones(8)})
        jax.block_until_ready(state)


def _decay_per_step(tx, steps, x0=1.0):
    """Per-step shrink rate of uniform params under zero gradients, over the last half of
    ``steps`` (uniform values: every compressed quantity is exact). The first gradient is 1,
    so that ``v`` is not 0 (a coordinate whose ``v`` is 0 does not move by its momentum)."""
    params = {"x": jnp.full((8,), x0, jnp.float32)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    xs = []
    for k in range(steps):
        g = jax.tree.map(lambda x, k=k: jnp.full_like(x, k == 0), params)
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
        xs.append(float(params["x"][0]))
    half = steps // 2
    return 1.0 - (xs[-1] / xs[half - 1]) ** (1.0 / (steps - half))


def test_weight_decay_also_enters_the_momentum_at_syncs():
    """docs/parameters.md, "Weight decay in phase B": a sync sets m to the interval's mean
    direction times (sqrt(v) + eps), weight decay included (as DeepSpeed's 0/1 Adam does), so
    the decay is applied again through m. With a sync at every step and no gradient, m/(s x)
    settles at mu, the smaller root of b1 lr mu^2 + (wd lr - (1 - b1)) mu + wd = 0 (from
    m' = b1 m + wd s x and x' = x / (1 + lr mu)): about 1/(1 - b1) times AdamW's decay. Before
    the freeze, and in 1-bit Adam, the decay is AdamW's, lr wd per step."""
    lr, wd, b1 = 1e-3, 0.1, 0.9
    adamw = 1.0 - (1.0 - lr * wd)
    phase_a = ozo.zero_one_adam(lr, weight_decay=wd, var_freeze_step=10**6)
    np.testing.assert_allclose(_decay_per_step(phase_a, 200), adamw, rtol=2e-3)
    onebit = ozo.onebit_adam(lr, weight_decay=wd, freeze_step=5)
    np.testing.assert_allclose(_decay_per_step(onebit, 200), adamw, rtol=2e-3)

    synced = ozo.zero_one_adam(lr, weight_decay=wd, var_freeze_step=5, local_step_clipper=1)
    mu = min(np.roots([b1 * lr, wd * lr - (1 - b1), wd]))
    expected = 1.0 - 1.0 / (1.0 + lr * mu)
    np.testing.assert_allclose(_decay_per_step(synced, 400), expected, rtol=2e-3)
    assert 9.5 < expected / adamw < 10.5  # ~1/(1 - b1)


@pytest.mark.parametrize("name", ["zero_one_adam", "onebit_adam"])
def test_weight_decay_mask_decays_the_masked_parameters_alone(name):
    """optax.adamw's mask, as weight_decay_mask: a Flax trial passed a decay mask as mask= (the
    compression's), which froze the biases after the freeze, and had no way to keep biases out
    of the optimizer's own decay. A leaf with mask 1 follows the run with the decay, a leaf
    with mask 0 the run without it, bit for bit, through both phases on 4 workers; per element
    on one worker (no compression: each element its own Adam)."""
    make = getattr(ozo, name)
    schedule = (
        dict(var_freeze_step=4, local_step_clipper=2)
        if name == "zero_one_adam"
        else dict(freeze_step=4)
    )
    params = {"b": jnp.linspace(-1, 1, 4), "w": jnp.linspace(0.5, 2, 12).reshape(3, 4)}

    def run(axis, workers, weight_decay, **kw):
        tx = make(1e-2, weight_decay=weight_decay, axis_name=axis, **schedule, **kw)

        def step(p, state, k, i):
            key = jax.random.fold_in(jax.random.key(k), i)
            g = jax.tree.map(lambda x: jax.random.normal(key, x.shape), p)
            updates, state = tx.update(g, state, p)
            return optax.apply_updates(p, updates), state

        if axis is None:
            p, init, step = params, tx.init, jax.jit(step)
            index = 0
        else:
            p, init = ozo.replicate(params, workers), jax.vmap(tx.init, axis_name=axis)
            step = jax.jit(jax.vmap(step, in_axes=(0, 0, None, 0), axis_name=axis))
            index = jnp.arange(workers)
        state = init(p)
        for k in range(12):  # variance / warm-up steps, compressed, local and sync steps
            p, state = step(p, state, k, index)
        return p

    plain, decayed = run(AXIS, N, 0.0), run(AXIS, N, 0.1)
    masked = run(AXIS, N, 0.1, weight_decay_mask={"b": False, "w": True})
    np.testing.assert_array_equal(masked["b"], plain["b"])
    np.testing.assert_array_equal(masked["w"], decayed["w"])
    assert not np.array_equal(plain["w"], decayed["w"])  # the decay moved something

    per_element = {"b": jnp.array([1, 0, 1, 0]), "w": jnp.ones((3, 4))}
    plain, decayed = run(None, 1, 0.0), run(None, 1, 0.1)
    masked = run(None, 1, 0.1, weight_decay_mask=per_element)
    np.testing.assert_array_equal(masked["b"][1::2], plain["b"][1::2])
    np.testing.assert_array_equal(masked["b"][::2], decayed["b"][::2])
    np.testing.assert_array_equal(masked["w"], decayed["w"])

    with pytest.raises(ValueError, match=r"weight_decay_mask must be a pytree of 0/1 .*not a"):
        make(1e-2, weight_decay=0.1, weight_decay_mask=lambda p: p)
    with pytest.raises(ValueError, match="weight_decay_mask must be a pytree with the structure"):
        jax.vmap(make(1e-2, weight_decay=0.1, axis_name=AXIS, weight_decay_mask={"w": 1}).init,
                 axis_name=AXIS)(ozo.replicate(params, N))  # fmt: skip
