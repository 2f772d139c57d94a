"""The three transforms on their own, and ordinary optax usage of the optimizers built from them:
frozen-variance Adam against a float64 reference, local SGD with 1-bit model averaging,
``onebit_mean`` before ``optax.adam``, chains, ``inject_hyperparams`` and ``MultiSteps``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import reference
from support.mapping import AXIS, MODES, mapped

import optax_zero_one as ozo

SHAPES = [(4, 3), (3,), (5,)]


def _frozen_adam_reference(x0, grads, lr, b1, b2, eps, variance_steps, freeze):
    """Adam without bias correction; v moves only on the given steps (float64)."""
    x = [np.asarray(a, np.float64) for a in x0]
    m = [np.zeros_like(a) for a in x]
    v = [np.zeros_like(a) for a in x]
    for k, g in enumerate(grads, start=1):
        for i in range(len(x)):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            if k <= freeze and k in variance_steps:
                v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            x[i] = x[i] - lr(k - 1) * m[i] / (np.sqrt(v[i]) + eps)
    return x, m, v


@pytest.mark.parametrize("flat", [False, True])
def test_frozen_variance_adam_alone_matches_reference(flat):
    rng = np.random.default_rng(0)
    x0 = [rng.standard_normal(s) for s in SHAPES]
    grads = [[rng.standard_normal(s) for s in SHAPES] for _ in range(30)]
    policy = ozo.VarianceDoubling(freeze_step=12, update_scaler=2)
    lr = lambda count: 0.01 * 0.95**count  # noqa: E731
    tx = optax.chain(
        ozo.scale_by_frozen_variance_adam(0.9, 0.99, 1e-8, policy),
        optax.scale_by_learning_rate(lr),
    )
    if flat:
        tx = ozo.flatten(tx)
    x = [jnp.asarray(a, jnp.float32) for a in x0]
    state = tx.init(x)
    step = jax.jit(
        lambda x, s, g: (lambda u, s: (optax.apply_updates(x, u), s))(*tx.update(g, s, x))
    )
    for g in grads:
        x, state = step(x, state, [jnp.asarray(a, jnp.float32) for a in g])
    variance = set(ozo.core.policies.variance_steps(policy, 30).tolist())
    assert variance == {1, 2, 4, 6, 8, 12}
    ref_x, ref_m, ref_v = _frozen_adam_reference(x0, grads, lr, 0.9, 0.99, 1e-8, variance, 12)
    inner = [
        s
        for s in jax.tree.leaves(
            state, is_leaf=lambda s: isinstance(s, ozo.FrozenVarianceAdamState)
        )
        if isinstance(s, ozo.FrozenVarianceAdamState)
    ][0]
    mu, nu = (inner.mu.to_tree(), inner.nu.to_tree()) if flat else (inner.mu, inner.nu)
    for i in range(len(SHAPES)):
        np.testing.assert_allclose(x[i], ref_x[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(mu[i], ref_m[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(nu[i], ref_v[i], rtol=1e-5, atol=1e-9)


def test_frozen_variance_adam_keeps_its_state_on_a_non_finite_input():
    policy = ozo.VarianceDoubling(freeze_step=10, update_scaler=2)
    tx = ozo.scale_by_frozen_variance_adam(variance_policy=policy)
    x = [jnp.ones(s) for s in SHAPES]
    state = tx.init(x)
    _, state = tx.update([jnp.ones(s) for s in SHAPES], state)
    bad = [jnp.full(s, jnp.nan) for s in SHAPES]
    out, after = tx.update(bad, state)
    assert all(bool(jnp.all(jnp.isnan(leaf))) for leaf in out)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)


def test_local_sgd_with_onebit_averaging():
    """Around optax.sgd: workers take local steps, agree exactly after every sync, and the loss
    of a problem whose workers see different targets falls to near the shared optimum."""
    n, steps = 4, 60
    rng = np.random.default_rng(1)
    # Workers share most of their target: a data-parallel problem with different batches.
    targets = (rng.standard_normal(16) + 0.1 * rng.standard_normal((n, 16))).astype(np.float32)
    policy = ozo.LocalStepDoubling(scaler=8, clipper=4)
    tx = ozo.local_step_sync(optax.sgd(0.1), policy, AXIS)

    def step(x, s, t):
        g = jax.grad(lambda x: 0.5 * jnp.sum((x - t) ** 2))(x)
        u, s = tx.update(g, s, x)
        return optax.apply_updates(x, u), s

    x = jnp.zeros((n, 16))
    state = mapped(tx.init, "vmap", n)(x)
    run = mapped(step, "vmap", n)
    syncs = set(ozo.core.policies.sync_steps(policy, 0, steps).tolist())
    assert len(syncs) < steps  # local steps happen
    start = float(jnp.mean((x - targets.mean(0)) ** 2))
    for k in range(1, steps + 1):
        x, state = run(x, state, jnp.asarray(targets))
        spread = float(jnp.max(jnp.abs(x - x[0])))
        if k in syncs:  # every worker lands on the anchor (up to rounding x + (xbar - x))
            ulp = float(jnp.finfo(jnp.float32).eps * jnp.max(jnp.abs(x)))
            assert spread <= 2 * ulp, f"workers differ after sync step {k}"
        elif k > 1:
            assert spread > 0.0, f"workers identical at local step {k}"
    synced = ozo.synchronized_params(x, state)
    end = float(jnp.mean((synced - targets.mean(0)) ** 2))
    assert end < 0.05 * start


def test_onebit_mean_before_adam_is_adam_on_the_compressed_mean():
    n, steps = 4, 12
    rng = np.random.default_rng(2)
    x0 = [rng.standard_normal(s) for s in SHAPES]
    grads = [[[rng.standard_normal(s) for s in SHAPES] for _ in range(n)] for _ in range(steps)]
    tx = optax.chain(ozo.onebit_mean(AXIS), optax.adam(0.01))
    ref_mean = reference.CompressedMean(SHAPES, n)
    ref_adam = optax.adam(0.01)
    ref_x = [jnp.asarray(a, jnp.float32) for a in x0]
    ref_state = ref_adam.init(ref_x)

    def step(x, s, g):
        u, s = tx.update(g, s, x)
        return optax.apply_updates(x, u), s

    x = [jnp.broadcast_to(jnp.asarray(a, jnp.float32), (n, *a.shape)) for a in x0]
    state = mapped(tx.init, "vmap", n)(x)
    run = mapped(step, "vmap", n)
    for g in grads:
        layout = [jnp.asarray(np.stack([w[i] for w in g]), jnp.float32) for i in range(len(SHAPES))]
        x, state = run(x, state, layout)
        mean = [jnp.asarray(a, jnp.float32) for a in ref_mean(g)]
        u, ref_state = ref_adam.update(mean, ref_state, ref_x)
        ref_x = optax.apply_updates(ref_x, u)
        for i in range(len(SHAPES)):
            np.testing.assert_allclose(x[i], np.broadcast_to(ref_x[i], x[i].shape), atol=2e-5)


ZERO_ONE = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=2)


def _zero_one(**kw):
    return ozo.zero_one_adam(0.02, axis_name=AXIS, **ZERO_ONE, **kw)


def test_chain_with_clipping_runs_data_parallel_and_on_one_device():
    n = 4
    rng = np.random.default_rng(3)
    g = [jnp.asarray(rng.standard_normal((n, *s)) * 100, jnp.float32) for s in SHAPES]
    x = [jnp.zeros((n, *s)) for s in SHAPES]
    clipped = optax.chain(optax.clip_by_global_norm(1.0), _zero_one())
    plain = _zero_one()

    def step(tx):
        def f(x, s, g):
            u, s = tx.update(g, s, x)
            return optax.apply_updates(x, u), s

        return f

    s1 = mapped(clipped.init, "vmap", n)(x)
    s2 = mapped(plain.init, "vmap", n)(x)
    norms = jnp.sqrt(sum(jnp.sum(leaf**2, axis=tuple(range(1, leaf.ndim))) for leaf in g))
    g_clipped = [leaf / norms.reshape((n,) + (1,) * (leaf.ndim - 1)) for leaf in g]
    run_clipped, run_plain = mapped(step(clipped), "vmap", n), mapped(step(plain), "vmap", n)
    for _ in range(10):
        x1, s1 = run_clipped(x, s1, g)
        x2, s2 = run_plain(x, s2, g_clipped)
        for a, b in zip(x1, x2):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        x = x1
    # One device, no axis: the same chain is Adam without bias correction on clipped grads.
    single = optax.chain(optax.clip_by_global_norm(1.0), ozo.zero_one_adam(0.02, **ZERO_ONE))
    xs = [jnp.zeros(s) for s in SHAPES]
    state = single.init(xs)
    u, state = single.update([leaf[0] for leaf in g], state, xs)
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in u)


def test_inject_hyperparams_works_without_static_args():
    """optax.inject_hyperparams(ozo.zero_one_adam)(...) injects the structural integers as
    arrays too; they work (traced inside update) and give the same run as plain ints."""
    injected = optax.inject_hyperparams(ozo.zero_one_adam)(learning_rate=0.01, **ZERO_ONE)
    plain = ozo.zero_one_adam(0.01, **ZERO_ONE)
    rng = np.random.default_rng(5)
    x1 = x2 = [jnp.ones(3)]
    s1, s2 = injected.init(x1), plain.init(x2)
    step1 = jax.jit(lambda x, s, g: injected.update(g, s, x))
    step2 = jax.jit(lambda x, s, g: plain.update(g, s, x))
    for _ in range(12):
        g = [jnp.asarray(rng.standard_normal(3), jnp.float32)]
        u1, s1 = step1(x1, s1, g)
        u2, s2 = step2(x2, s2, g)
        x1, x2 = optax.apply_updates(x1, u1), optax.apply_updates(x2, u2)
        np.testing.assert_allclose(x1[0], x2[0], rtol=1e-5)
    assert int(s1.hyperparams["var_freeze_step"]) == ZERO_ONE["var_freeze_step"]
    with pytest.raises(ValueError, match="var_freeze_step must be an integer"):
        optax.inject_hyperparams(ozo.zero_one_adam)(learning_rate=0.01, var_freeze_step=2.5).init(
            x1
        )


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_multisteps_accumulates_inside_the_mapped_function(mode):
    """optax.MultiSteps(zero_one_adam(...), 2), state built inside the mapped function: every
    second call updates, and the result equals zero_one_adam on the averaged gradient pairs."""
    n = 4
    rng = np.random.default_rng(4)
    grads = [
        [jnp.asarray(rng.standard_normal((n, *s)), jnp.float32) for s in SHAPES] for _ in range(8)
    ]
    accumulated = optax.MultiSteps(_zero_one(), 2)
    direct = _zero_one()

    def run(tx, sequence):
        def init(x):
            return tx.init(x)

        def step(x, s, g):
            u, s = tx.update(g, s, x)
            return optax.apply_updates(x, u), s

        x = [jnp.zeros((n, *s)) for s in SHAPES]
        state = mapped(init, mode, n)(x)
        run_step = mapped(step, mode, n)
        for g in sequence:
            x, state = run_step(x, state, g)
            jax.block_until_ready(x)
        return x

    pairs = [[(a + b) / 2 for a, b in zip(grads[i], grads[i + 1])] for i in range(0, len(grads), 2)]
    got = run(accumulated, grads)
    want = run(direct, pairs)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_init_state_has_the_update_state_types(mode):
    """The state from init and after one update have the same pytree types under every mapping
    (what lax.cond-based wrappers such as MultiSteps need)."""
    n = 4
    tx = _zero_one()
    x = [jnp.zeros((n, *s)) for s in SHAPES]
    g = [jnp.ones((n, *s)) for s in SHAPES]

    def both(x, g):
        s0 = tx.init(x)
        _, s1 = tx.update(g, s0, x)
        return jax.lax.cond(g[0][0, 0] > 0, lambda: s1, lambda: s0)

    out = mapped(both, mode, n)(x, g)
    assert jax.tree.structure(out) == jax.tree.structure(mapped(tx.init, mode, n)(x))


def test_flax_nnx_optimizer_drives_zero_one_adam():
    """nnx.Optimizer inits on Param-wrapped leaves and updates with plain gradients: the same
    run as the functional optimizer on the model's arrays."""
    from flax import nnx

    def make():
        return nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    tx = ozo.zero_one_adam(0.05, **ZERO_ONE)
    model = make()
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    params = jax.tree.map(jnp.asarray, nnx.to_pure_dict(nnx.state(make(), nnx.Param)))
    state = tx.init(params)
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)

    def loss(m):
        return jnp.sum(m(x) ** 2)

    @nnx.jit
    def nnx_step(optimizer, model):
        optimizer.update(model, nnx.grad(loss)(model))

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: jnp.sum((x @ p["kernel"] + p["bias"]) ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(12):
        nnx_step(optimizer, model)
        params, state = step(params, state)
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for key in ("kernel", "bias"):
        np.testing.assert_allclose(got[key], params[key], rtol=1e-6, atol=1e-7)
    synced = ozo.synchronized_params(nnx.state(model, nnx.Param), optimizer.opt_state)
    assert jax.tree.structure(synced) == jax.tree.structure(nnx.state(model, nnx.Param))


@pytest.mark.parametrize(
    "setting",
    [
        lambda: jax.numpy_rank_promotion("raise"),
        lambda: jax.numpy_dtype_promotion("strict"),
    ],
    ids=["rank_promotion_raise", "dtype_promotion_strict"],
)
def test_the_callers_numpy_promotion_settings_change_nothing(setting):
    """Codebases that trace under jax.numpy_rank_promotion("raise") or
    jax.numpy_dtype_promotion("strict") could not use the compressed optimizers: every 1-bit
    collective broadcast ranks implicitly, and 0/1 Adam's counters added a bool to an int (a
    trial). The transforms now trace with NumPy's rules whatever the caller set, and give the
    bits of a run without the setting, through every step kind."""
    params = {"w": jnp.arange(35.0).reshape(5, 7) / 35, "b": jnp.zeros((3,))}
    built = dict(var_freeze_step=3, var_update_scaler=2, local_step_scaler=2, local_step_clipper=2)
    txs = {
        "zero_one_adam": ozo.zero_one_adam(1e-2, axis_name="w", **built),
        "zero_one_adam_psum": ozo.zero_one_adam(1e-2, axis_name="w", collective="psum", **built),
        "onebit_adam": ozo.onebit_adam(1e-2, axis_name="w", freeze_step=2),
        "diloco": ozo.diloco(optax.adam(1e-2), optax.sgd(0.7, momentum=0.9), 2, "w"),
    }
    rng = np.random.default_rng(0)
    grads = [
        jax.tree.map(lambda x: rng.standard_normal((4, *x.shape)).astype(np.float32), params)
        for _ in range(8)
    ]

    def run(tx):
        p = ozo.replicate(params, 4)
        s = jax.vmap(tx.init, axis_name="w")(p)

        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        train = jax.jit(jax.vmap(step, axis_name="w"))
        for g in grads:
            p, s = train(p, s, g)
        return p

    for name, tx in txs.items():
        want = run(tx)
        with setting():
            got = run(tx)
        jax.tree.map(lambda a, b, n=name: np.testing.assert_array_equal(a, b, err_msg=n), got, want)
