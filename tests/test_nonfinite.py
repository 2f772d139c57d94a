"""Non-finite gradients: skipped together at communicating steps, dropped locally at local steps,
never entering any buffer, and counted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from workers_util import AXIS, mapped

import optax_zero_one as ozo

N = 4
SHAPES = [(5, 3), (3,), (17,)]
# variance steps 1, 2, 4, 6; compressed 3, 5, 7, 8; local/sync from 9 (intervals 1, 2, 4)
ZERO_ONE = dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
BAD_WORKER = 1


def grads_at(k, bad_value=None, bad_step=None):
    rng = np.random.default_rng(k)
    g = [rng.standard_normal((N, *s)).astype(np.float32) for s in SHAPES]
    if bad_value is not None and k == bad_step:
        g[2][BAD_WORKER, 4] = bad_value
    return [jnp.asarray(x) for x in g]


def run(tx, steps, bad_value=None, bad_step=None, mode="vmap"):
    def step(x, s, g):
        u, s = tx.update(g, s, x)
        return optax.apply_updates(x, u), s

    x = [jnp.ones((N, *s)) for s in SHAPES]
    state = mapped(tx.init, mode, N)(x)
    run_step = mapped(step, mode, N)
    history = [(x, state)]
    for k in range(1, steps + 1):
        x, state = run_step(x, state, grads_at(k, bad_value, bad_step))
        jax.block_until_ready(x)
        history.append((x, state))
    return history


def all_finite(tree):
    return all(
        bool(jnp.all(jnp.isfinite(leaf)))
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    )


def inner(state):
    found = [
        s
        for s in jax.tree.leaves(
            state, is_leaf=lambda s: isinstance(s, ozo.ZeroOneAdamState | ozo.OnebitAdamState)
        )
        if isinstance(s, ozo.ZeroOneAdamState | ozo.OnebitAdamState)
    ]
    return found[0]


def float_fields(state):
    return [leaf for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.floating)]


@pytest.mark.parametrize(
    "bad_step,kind,bad_value",
    [
        (2, "variance", np.nan),
        (3, "compressed", np.inf),
        (12, "sync", np.nan),
        (12, "sync", -np.inf),
    ],
)
def test_zero_one_adam_skips_communicating_steps_together(bad_step, kind, bad_value):
    tx = ozo.zero_one_adam(0.05, weight_decay=0.01, axis_name=AXIS, **ZERO_ONE)
    clean = run(tx, 14)
    kinds = [kind_of(s) for _, s in clean[:-1]]
    assert kinds[bad_step - 1] == kind
    hist = run(tx, 14, bad_value, bad_step)
    (x0, s0), (x1, s1) = hist[bad_step - 1], hist[bad_step]
    # the update is skipped on every worker: params and every buffer unchanged, count too
    for a, b in zip(
        jax.tree.leaves((x0, float_fields(inner(s0)))),
        jax.tree.leaves((x1, float_fields(inner(s1)))),
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(inner(s1).count, inner(s0).count)
    np.testing.assert_array_equal(inner(s1).skipped_updates, inner(s0).skipped_updates + 1)
    for x, s in hist:
        assert all_finite((x, s))
    # the retried step and everything after it is clean and keeps the workers in sync
    x_end, s_end = hist[-1]
    assert all(int(c) == 1 for c in np.asarray(inner(s_end).skipped_updates))


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_zero_one_adam_drops_a_bad_local_gradient_on_its_worker_only(bad_value):
    tx = ozo.zero_one_adam(0.05, axis_name=AXIS, **ZERO_ONE)
    clean = run(tx, 16)
    kinds = [kind_of(s) for _, s in clean[:-1]]
    bad_step = kinds.index("local") + 1
    hist = run(tx, 16, bad_value, bad_step)
    s0, s1 = hist[bad_step - 1][1], hist[bad_step][1]
    b1 = 0.9
    for leaf in range(len(SHAPES)):
        mu0, mu1 = np.asarray(inner(s0).mu[leaf]), np.asarray(inner(s1).mu[leaf])
        # the bad worker's gradient counts as zero: its momentum only decays
        np.testing.assert_allclose(mu1[BAD_WORKER], b1 * mu0[BAD_WORKER], rtol=1e-6)
        # the others take their step as in the clean run
        ref = np.asarray(inner(clean[bad_step][1]).mu[leaf])
        others = [i for i in range(N) if i != BAD_WORKER]
        np.testing.assert_array_equal(mu1[others], ref[others])
    dropped = np.asarray(inner(s1).dropped_local_grads)
    assert dropped[BAD_WORKER] == 1 and dropped.sum() == 1
    assert np.all(np.asarray(inner(s1).skipped_updates) == 0)
    for x, s in hist:
        assert all_finite((x, s))
    # the next sync is clean: all workers agree again
    later = [k for k in range(bad_step + 1, 17) if kinds[k - 1] == "sync"][0]
    x_sync, s_sync = hist[later]
    for leaf in range(len(SHAPES)):
        mu = np.asarray(inner(s_sync).mu[leaf])
        np.testing.assert_array_equal(mu, np.broadcast_to(mu[0], mu.shape))
        np.testing.assert_allclose(
            x_sync[leaf], np.broadcast_to(x_sync[leaf][0], mu.shape), atol=1e-6
        )


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
@pytest.mark.parametrize("bad_step", [2, 7])  # warm-up, compressed
def test_onebit_adam_skips_together(bad_step, bad_value):
    tx = ozo.onebit_adam(0.05, freeze_step=4, axis_name=AXIS)
    hist = run(tx, 10, bad_value, bad_step)
    (x0, s0), (x1, s1) = hist[bad_step - 1], hist[bad_step]
    for a, b in zip(
        jax.tree.leaves((x0, float_fields(inner(s0)))),
        jax.tree.leaves((x1, float_fields(inner(s1)))),
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(inner(s1).skipped_updates, inner(s0).skipped_updates + 1)
    for x, s in hist:
        assert all_finite((x, s))


def test_single_worker_skips_too():
    tx = ozo.zero_one_adam(0.1, var_freeze_step=3)
    x = jnp.ones(3)
    s = tx.init(x)
    u, s2 = tx.update(jnp.array([1.0, jnp.nan, 0.0]), s, x)
    assert float(jnp.abs(u).max()) == 0.0 and int(s2.skipped_updates) == 1 and int(s2.count) == 0
    assert all_finite(s2)


def _policies():
    return (
        ozo.VarianceDoubling(ZERO_ONE["var_freeze_step"], ZERO_ONE["var_update_scaler"]),
        ozo.LocalStepDoubling(ZERO_ONE["local_step_scaler"], ZERO_ONE["local_step_clipper"]),
    )


def kind_of(state):
    return ozo.STEP_KINDS[int(np.asarray(ozo.step_kind(inner(state), *_policies()))[0])]
