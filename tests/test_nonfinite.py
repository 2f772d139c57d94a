"""Non-finite gradients: skipped together where the gradient is a mean over the workers, dropped
on the bad worker where it is its own (local steps, syncs, 1-bit Adam's compressed steps), never
entering any buffer, and counted."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.mapping import AXIS, mapped

import optax_zero_one as ozo

N = 4
SHAPES = [(5, 3), (3,), (17,)]
# variance steps 1, 2, 4, 6; compressed 3, 5, 7, 8; local/sync from 9 (intervals 1, 2, 4)
ZERO_ONE = dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
VARIANCE = ozo.VarianceDoubling(ZERO_ONE["var_freeze_step"], ZERO_ONE["var_update_scaler"])
LOCAL = ozo.LocalStepDoubling(ZERO_ONE["local_step_scaler"], ZERO_ONE["local_step_clipper"])
KINDS = [ozo.STEP_KINDS[i] for i in ozo.step_kinds(VARIANCE, LOCAL, 20)]
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


def find(state, cls):
    nodes = jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, cls))
    (node,) = [s for s in nodes if isinstance(s, cls)]
    return node


def moments(state):
    adam = find(state, ozo.FrozenVarianceAdamState)
    return adam.mu.to_tree(), adam.nu.to_tree()


def errors(state):
    return [
        leaf
        for node in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, ozo.OnebitMeanState))
        if isinstance(node, ozo.OnebitMeanState)
        for leaf in jax.tree.leaves(node)
    ]


def buffers(state):
    """Every float buffer except the compression errors."""
    error_ids = {id(e) for e in errors(state)}
    return [
        leaf
        for leaf in jax.tree.leaves(state)
        if jnp.issubdtype(leaf.dtype, jnp.floating) and id(leaf) not in error_ids
    ]


def counters(state):
    return [leaf for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.integer)]


@pytest.mark.parametrize(
    "bad_step,kind,bad_value", [(2, "variance", np.nan), (3, "compressed", np.inf)]
)
def test_zero_one_adam_skips_averaged_steps_together(bad_step, kind, bad_value):
    assert KINDS[bad_step - 1] == kind
    tx = ozo.zero_one_adam(0.05, weight_decay=0.01, axis_name=AXIS, **ZERO_ONE)
    hist = run(tx, 14, bad_value, bad_step)
    (x0, s0), (x1, s1) = hist[bad_step - 1], hist[bad_step]
    # skipped on every worker: params, moments, anchor and every counter unchanged
    for a, b in zip(jax.tree.leaves((x0, buffers(s0))), jax.tree.leaves((x1, buffers(s1)))):
        np.testing.assert_array_equal(a, b)
    sync0, sync1 = find(s0, ozo.LocalStepSyncState), find(s1, ozo.LocalStepSyncState)
    same = lambda s: counters(s._replace(skipped_updates=s.dropped_local_grads))  # noqa: E731
    for a, b in zip(same(sync0), same(sync1)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sync1.skipped_updates, sync0.skipped_updates + 1)
    # the compression errors were zeroed (they held this step's NaN), on every worker
    for e in errors(s1):
        assert np.all(np.asarray(e) == 0)
    for x, s in hist:
        assert all_finite((x, s))
    # the step is retried: the run goes on with every worker in step
    x_end, s_end = hist[-1]
    assert all(int(c) == 1 for c in np.asarray(find(s_end, ozo.LocalStepSyncState).skipped_updates))


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
@pytest.mark.parametrize("kind", ["local", "sync"])
def test_zero_one_adam_drops_a_bad_own_gradient_on_its_worker_only(kind, bad_value):
    tx = ozo.zero_one_adam(0.05, axis_name=AXIS, **ZERO_ONE)
    clean = run(tx, 16)
    bad_step = KINDS.index(kind, ZERO_ONE["var_freeze_step"]) + 1
    hist = run(tx, 16, bad_value, bad_step)
    s0, s1 = hist[bad_step - 1][1], hist[bad_step][1]
    mu0, _ = moments(s0)
    mu1, _ = moments(s1)
    mu_clean, _ = moments(clean[bad_step][1])
    others = [i for i in range(N) if i != BAD_WORKER]
    for leaf in range(len(SHAPES)):
        if kind == "local":
            # the bad worker's gradient counts as zero: its momentum only decays
            np.testing.assert_allclose(mu1[leaf][BAD_WORKER], 0.9 * mu0[leaf][BAD_WORKER])
            np.testing.assert_array_equal(
                np.asarray(mu1[leaf])[others], np.asarray(mu_clean[leaf])[others]
            )
        else:  # the sync goes on; every worker gets the same (finite) momentum
            m = np.asarray(mu1[leaf])
            np.testing.assert_array_equal(m, np.broadcast_to(m[0], m.shape))
    sync = find(s1, ozo.LocalStepSyncState)
    dropped = np.asarray(sync.dropped_local_grads)
    assert dropped[BAD_WORKER] == 1 and dropped.sum() == 1
    assert np.all(np.asarray(sync.skipped_updates) == 0)
    for x, s in hist:
        assert all_finite((x, s))
    # the next sync is clean: all workers agree again
    later = [k for k in range(bad_step, 17) if KINDS[k - 1] == "sync"][0]
    x_sync, s_sync = hist[later]
    mu, _ = moments(s_sync)
    for leaf in range(len(SHAPES)):
        m = np.asarray(mu[leaf])
        np.testing.assert_array_equal(m, np.broadcast_to(m[0], m.shape))
        np.testing.assert_allclose(
            x_sync[leaf], np.broadcast_to(x_sync[leaf][0], m.shape), atol=1e-6
        )


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_onebit_adam_skips_the_warm_up_together(bad_value):
    bad_step = 2
    tx = ozo.onebit_adam(0.05, freeze_step=4, axis_name=AXIS)
    hist = run(tx, 10, bad_value, bad_step)
    (x0, s0), (x1, s1) = hist[bad_step - 1], hist[bad_step]
    for a, b in zip(jax.tree.leaves((x0, buffers(s0))), jax.tree.leaves((x1, buffers(s1)))):
        np.testing.assert_array_equal(a, b)
    skip0, skip1 = (
        find(s0, ozo.core.wrappers.SkipNotFiniteState),
        find(s1, ozo.core.wrappers.SkipNotFiniteState),
    )
    np.testing.assert_array_equal(skip1.skipped_updates, skip0.skipped_updates + 1)
    np.testing.assert_array_equal(
        find(s1, ozo.FrozenVarianceAdamState).count, find(s0, ozo.FrozenVarianceAdamState).count
    )
    for x, s in hist:
        assert all_finite((x, s))


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_onebit_adam_drops_a_bad_gradient_after_the_warm_up(bad_value):
    bad_step = 7
    tx = ozo.onebit_adam(0.05, freeze_step=4, axis_name=AXIS)
    hist = run(tx, 10, bad_value, bad_step)
    s1 = hist[bad_step][1]
    adam = find(s1, ozo.FrozenVarianceAdamState)
    dropped = np.asarray(adam.dropped_grads)
    assert dropped[BAD_WORKER] == 1 and dropped.sum() == 1
    assert np.all(np.asarray(find(s1, ozo.core.wrappers.SkipNotFiniteState).skipped_updates) == 0)
    for x, s in hist:
        assert all_finite((x, s))
        for leaf in x:  # 1-bit Adam's workers stay identical at every step
            np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))


def test_single_worker_skips_too():
    tx = ozo.zero_one_adam(0.1, var_freeze_step=3)
    x = jnp.ones(3)
    s = tx.init(x)
    u, s2 = tx.update(jnp.array([1.0, jnp.nan, 0.0]), s, x)
    sync = find(s2, ozo.LocalStepSyncState)
    assert float(jnp.abs(u).max()) == 0.0 and int(sync.skipped_updates) == 1
    assert int(sync.count) == 0 and int(find(s2, ozo.FrozenVarianceAdamState).count) == 0
    assert all_finite(s2)


def _full_reductions(fn, *args, size):
    """How many reductions in ``fn``'s jaxpr read at least ``size`` elements."""
    found = 0

    def walk(jaxpr):
        nonlocal found
        for eqn in jaxpr.eqns:
            if eqn.primitive.name.startswith("reduce_") and eqn.invars[0].aval.size >= size:
                found += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("optimizer", ["zero_one_adam", "onebit_adam"])
def test_a_guard_reads_the_skip_from_the_counters_not_the_update(optimizer):
    """The frozen-variance Adam checks its averaged input and keeps its counter on a step it
    skips (``SKIP_KEEPS_COUNTER``), so the guard around it (local_step_sync before its start
    step, skip_not_finite) reads the skip from the counters: one full pass over the data per
    averaged step (the mean's check), not two. The skip itself is covered above."""
    x = jnp.ones((4, 256))
    if optimizer == "zero_one_adam":
        tx = ozo.zero_one_adam(0.1, var_freeze_step=8, axis_name=AXIS)
        kind = ozo.StepSchedule(ozo.VarianceDoubling(8), ozo.LocalStepDoubling()).kind(1)
    else:
        tx = ozo.onebit_adam(0.1, freeze_step=8, axis_name=AXIS)
        kind = ozo.onebit_schedule(8).kind(1)
    state = jax.vmap(tx.init, axis_name=AXIS)(x)

    def step(g, s, p):
        return tx.update(g, s, p, step_kind=kind)

    fn = jax.vmap(step, axis_name=AXIS)
    assert _full_reductions(fn, x, state, x, size=256) == 1


def test_a_guard_checks_the_update_of_a_transform_that_makes_no_promise():
    """Around plain optax transforms (no ``SKIP_KEEPS_COUNTER``) the guard checks every element,
    and a state that keeps its counter without promising anything is not read as a skip."""
    tx = ozo.skip_not_finite(optax.sgd(0.1))
    x = jnp.ones(3)
    s = tx.init(x)
    u, s2 = tx.update(jnp.array([1.0, jnp.inf, 0.0]), s, x)
    assert float(jnp.abs(u).max()) == 0.0 and int(s2.skipped_updates) == 1
    u, s3 = tx.update(jnp.array([1.0, 2.0, 0.0]), s2, x)
    assert int(s3.skipped_updates) == 1 and float(jnp.abs(u).max()) > 0
    assert ozo.core._graph.reported_skip(s3.inner_state, s2.inner_state) is None


@pytest.mark.parametrize("last", ["adam", "sgd_momentum"])
def test_a_guard_restores_the_buffers_of_a_plain_optax_state(last):
    """A skipped step leaves a plain optax state (Adam's moments, SGD's momentum) as it was:
    it took the NaN into its buffers, and one NaN made every later step non-finite (a new-user
    trial: skipped 7 of 8 steps). This library's states keep their own (KEEPS_BUFFERS)."""
    inner = optax.adam(1e-2) if last == "adam" else optax.sgd(0.1, momentum=0.9)
    tx = ozo.skip_not_finite(
        optax.chain(ozo.scheduled_mean(AXIS, ozo.VarianceDoubling(100)), inner)
    )
    n = 4

    def step(p, s, t):
        bad = (t == 1) & (jax.lax.axis_index(AXIS) == 1)
        g = jax.tree.map(lambda x: jnp.where(bad, jnp.nan, 0.5 * x), p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    run = jax.jit(jax.vmap(step, axis_name=AXIS, in_axes=(0, 0, None)))
    p = {"w": jnp.ones((n, 8))}
    s = jax.vmap(tx.init, axis_name=AXIS)(p)
    states = []
    for t in range(6):
        p, s = run(p, s, t)
        states.append(s)
    assert np.asarray(s.skipped_updates).tolist() == [1] * n  # the bad step only
    for a, b in zip(jax.tree.leaves(states[1].inner_state), jax.tree.leaves(states[0].inner_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # kept as before the skip
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves((p, s)))


def test_a_guard_checks_what_a_partial_promise_does_not_cover():
    """skip_not_finite reads a skip from the counter of a state that promises to keep it on one,
    trusted only where that state sees every update (itself, or in an optax.chain). Under
    optax.multi_transform it sees a part: a NaN in the other part went through and stayed in
    Adam's moments; under optax.MultiSteps its accumulation steps read as skips, and it never
    updated (a review)."""
    params = {"a": jnp.ones(3), "b": jnp.ones(3)}
    frozen = optax.chain(
        ozo.scale_by_frozen_variance_adam(variance_policy=ozo.VarianceDoubling(10)),
        optax.scale(-0.01),
    )
    split = optax.multi_transform(
        {"ozo": frozen, "adam": optax.adam(0.01)}, {"a": "ozo", "b": "adam"}
    )
    for tx, reference in (
        (ozo.skip_not_finite(split), optax.apply_if_finite(split, 10)),
        (
            ozo.skip_not_finite(optax.MultiSteps(frozen, 2)),
            optax.apply_if_finite(optax.MultiSteps(frozen, 2), 10),
        ),
    ):
        s, r = tx.init(params), reference.init(params)
        for k in range(6):
            g = {"a": jnp.full(3, 0.5), "b": jnp.full(3, jnp.nan if k == 1 else 0.5)}
            u, s = tx.update(g, s, params)
            w, r = reference.update(g, r, params)
            for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(w), strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_guard_restores_a_plain_container_state():
    """A user's transform whose state is a dict of arrays (not a NamedTuple): only its scalars
    were restored on a skip, so it kept the NaN, and every later step was skipped (a review)."""

    def momentum(beta=0.9):
        def update(g, m, p=None):
            m = jax.tree.map(lambda m, g: beta * m + g, m, g)
            return m, m

        return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)

    params = {"w": jnp.ones(3)}
    for tx in (ozo.skip_not_finite(momentum()), ozo.flatten(ozo.skip_not_finite(momentum()))):
        s = tx.init(params)
        u, s = tx.update({"w": jnp.array([1.0, jnp.nan, 1.0])}, s, params)
        np.testing.assert_array_equal(u["w"], np.zeros(3))
        u, s = tx.update({"w": jnp.ones(3)}, s, params)
        np.testing.assert_array_equal(u["w"], np.ones(3))


def test_scheduled_mean_example_skips_a_nan_after_the_freeze():
    """scheduled_mean's docstring composition: after the freeze the frozen-variance Adam took
    the (NaN) mean as a local gradient already checked, applied it and still advanced its
    counter, so skip_not_finite, which trusts that counter, let the NaN into the params for
    good (a review). Now it refuses it and the guard skips the step."""
    policy = ozo.VarianceDoubling(freeze_step=3)
    tx = ozo.skip_not_finite(
        optax.chain(
            ozo.scheduled_mean("w", policy),
            ozo.scale_by_frozen_variance_adam(variance_policy=policy),
            optax.scale_by_learning_rate(1e-3),
        )
    )
    x = jnp.ones((2, 4))
    state = jax.vmap(tx.init, axis_name="w")(x)

    def step(x, s, g):
        u, s = tx.update(g, s, x)
        return optax.apply_updates(x, u), s

    run = jax.jit(jax.vmap(step, axis_name="w"))
    for k in range(1, 8):
        g = np.ones((2, 4), np.float32)
        g[1, 0] = np.nan if k in (2, 5) else 1.0  # before and after the freeze
        before = x
        x, state = run(x, state, jnp.asarray(g))
        assert np.all(np.isfinite(x)), k
        if k == 2:  # before the freeze: a NaN mean, skipped on every worker
            np.testing.assert_array_equal(x, before)
        if k == 5:  # after it the mean rule passes each worker's own gradient: worker 1 skips
            np.testing.assert_array_equal(x[1], before[1])
            assert np.all(x[0] != before[0])
    np.testing.assert_array_equal(np.asarray(state.skipped_updates), [1, 2])


@pytest.mark.parametrize("bad_step", [3, 25], ids=["phase A", "phase B"])  # calls: 2 an update
def test_multisteps_recovers_from_a_nan_with_the_documented_zeroing(bad_step):
    """docs/usage.md: optax.MultiSteps' accumulator never recovers from a NaN (its reset
    multiplies by 0), after which the optimizer skips or drops every later step quietly (a
    trial). Zeroing a worker's whole gradient when any of it is not finite, before MultiSteps,
    keeps every worker in step: the run takes its updates, and the workers' synchronised params
    stay equal and finite."""
    tx = optax.MultiSteps(ozo.zero_one_adam(1e-2, axis_name=AXIS, **ZERO_ONE), 2)
    poisoned = find(run(tx, 40, np.nan, bad_step)[-1][1].inner_opt_state, ozo.LocalStepSyncState)
    if bad_step < 16:  # the trap: in phase A every later update is skipped together...
        assert int(poisoned.count[0]) == 1 and int(poisoned.skipped_updates[0]) == 19
    else:  # ...in phase B the worker's gradient is dropped at every later update
        assert int(poisoned.count[0]) == 20
        assert int(poisoned.dropped_local_grads[BAD_WORKER]) == 20 - 12

    def zeroed(g):
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(g)]))
        return jax.tree.map(lambda x: jnp.where(finite, x, 0), g)

    guarded = optax.GradientTransformationExtraArgs(
        tx.init, lambda g, s, p=None, **kw: tx.update(zeroed(g), s, p, **kw)
    )
    x, state = run(guarded, 40, np.nan, bad_step)[-1]
    inner = state.inner_opt_state
    assert ozo.step_count(inner) == 20  # 40 calls, 2 per update: none skipped
    synced = jax.vmap(ozo.synchronized_params)(x, state.inner_opt_state)
    assert all_finite(synced)
    for leaf in jax.tree.leaves(synced):
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))
