"""DiLoCo (``diloco``, ``local_step_sync(..., outer=...)``, ``SyncEvery``, the float sync)
against a float64 reference written from the paper, and its limits: with one step per round,
outer SGD at rate 1, a float sync and an SGD inner optimizer it is synchronous data-parallel SGD;
with ``outer=optax.sgd(1.0)`` it is today's model averaging, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_step_kind_traffic as traffic  # its shard_map traffic helpers
from support import reference
from support.mapping import AXIS, mapped

import optax_zero_one as ozo

SHAPES = [(6, 5), (5,), (4, 3)]
INNER_LR, OUTER_LR, MOMENTUM, H = 0.02, 0.7, 0.9, 4
STEPS = 3 * H  # three outer steps


def problem(n, steps, seed=0):
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s) for s in SHAPES]
    targets = [rng.standard_normal(s) for s in SHAPES]
    curvature = rng.uniform(0.5, 2.0, size=n)  # each worker sees its own problem
    noise = [[[rng.standard_normal(s) for s in SHAPES] for _ in range(n)] for _ in range(steps)]
    return params, targets, curvature, noise


def grads_at(xs, targets, curvature, noise):
    return [
        [c * (x - t) + 0.3 * z for x, t, z in zip(xw, targets, zw, strict=True)]
        for xw, c, zw in zip(xs, curvature, noise, strict=True)
    ]


def layout(per_worker):
    n = len(per_worker)
    return [jnp.asarray(np.stack([per_worker[i][j] for i in range(n)]), jnp.float32) for j in
            range(len(SHAPES))]  # fmt: skip


def _dispatched(tx, schedule, **kwargs):
    """``ozo.dispatch_by_kind`` over vmapped workers of a step ``(p, s, g) -> (p, s)``."""

    def compile_kind(kind):
        def step(p, s, g):
            u, s = tx.update(g, s, p, step_kind=kind)
            return optax.apply_updates(p, u), s

        return jax.jit(jax.vmap(step, axis_name=AXIS))

    return ozo.dispatch_by_kind(compile_kind, schedule, **kwargs)


def test_a_float_sync_run_that_trains_apart_is_caught_where_the_params_are_named():
    """A float-sync DiLoCo keeps no error buffers, so its state records no worker count, and
    the dispatcher did not compare its workers: params built apart trained apart for good (a
    new-user trial). With params_index it knows the leading axis is the workers' and stops the
    run; given a schedule that syncs too soon it names the schedule, not a wrapper."""
    tx = ozo.diloco(optax.adamw(1e-2), optax.sgd(0.7), 4, AXIS, collective="float")
    grads = {"w": jnp.ones((2, 3))}
    apart = {"w": jnp.asarray([[0.0] * 3, [0.5] * 3])}
    run = _dispatched(tx, ozo.diloco_schedule(4), params_index=0)
    params, state = apart, jax.vmap(tx.init, axis_name=AXIS)(apart)
    with pytest.raises(ValueError, match="The workers train apart"):
        for _ in range(16):
            params, state = run(params, state, grads)
    # the same params on both workers, each its own gradient, and a schedule of H = 2 for an
    # optimizer of H = 4: the first "sync" is refused and the params are apart after it
    run = _dispatched(tx, ozo.diloco_schedule(2), params_index=0)
    params = {"w": jnp.zeros((2, 3))}
    state = jax.vmap(tx.init, axis_name=AXIS)(params)
    own = {"w": jnp.asarray([[1.0] * 3, [-2.0] * 3])}
    # (named by the params check, or, where the refused step left the params as they were, by
    # the check of the counts)
    with pytest.raises(
        ValueError,
        match="schedule given to the dispatcher is not the|The schedule is not the optimizer.s",
    ):
        for _ in range(16):
            params, state = run(params, state, own)
        run.settle()


def nesterov():
    return optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True)


def stepper(tx, n, hinted=None, lift=None):
    """A jitted step of ``tx`` over ``n`` vmapped workers (or lifted by ``lift``):
    ``(k, x, state, grads) -> (x, state)``; with ``hinted`` (a StepSchedule), one program per
    kind, chosen on the host."""
    lift = lift or (lambda fn: mapped(fn, "vmap", n))

    def step(x, s, g, kind=None):
        u, s = tx.update(g, s, x, **({} if kind is None else {"step_kind": kind}))
        return optax.apply_updates(x, u), s

    if hinted is None:
        run = lift(step)
        return lambda k, x, s, g: run(x, s, g)
    programs = {}

    def run_kind(k, x, s, g):
        kind = hinted.kind(k)
        if kind.name not in programs:
            programs[kind.name] = lift(lambda x, s, g: step(x, s, g, kind))
        return programs[kind.name](x, s, g)

    return run_kind


def worker_views(x):
    """``x`` (leaves with a leading worker axis) as ``[worker][leaf]`` host arrays."""
    return [[np.asarray(leaf[i]) for leaf in x] for i in range(len(x[0]))]


def train(run, x, state, prob, first, last, after=None):
    """Steps ``first..last`` of ``run`` (a :func:`stepper`) on ``prob``'s gradients at each
    worker's own params; ``after(k, x)`` is called after step ``k``."""
    _, targets, curvature, noise = prob
    for k in range(first, last + 1):
        grads = grads_at(worker_views(x), targets, curvature, noise[k - 1])
        x, state = run(k, x, state, layout(grads))
        if after is not None:
            after(k, x)
    return x, state


@pytest.mark.parametrize("collective", ["float", "two_phase"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_follows_the_float64_reference(n, collective):
    params, targets, curvature, noise = problem(n, STEPS)
    ref = reference.DiLoCo(
        params, n, INNER_LR, OUTER_LR, MOMENTUM, H, compressed=collective != "float"
    )
    tx = ozo.diloco(optax.adamw(INNER_LR, weight_decay=0.0), nesterov(), H, AXIS,
                    collective=collective)  # fmt: skip
    x = layout([params] * n)
    state = mapped(tx.init, "vmap", n)(x)
    run = stepper(tx, n)
    for k in range(1, STEPS + 1):
        grads = grads_at(ref.x, targets, curvature, noise[k - 1])
        ref.step(grads)
        x, state = run(k, x, state, layout(grads))
        synced = ozo.synchronized_params(x, state)
        for leaf in range(len(SHAPES)):
            where = f"step {k} ({ref.last_kind}), leaf {leaf}"
            for i in range(n):
                np.testing.assert_allclose(x[leaf][i], ref.x[i][leaf], rtol=2e-4, atol=2e-5,
                                           err_msg=f"{where}, worker {i}")  # fmt: skip
            if ref.last_kind == "sync":
                np.testing.assert_allclose(synced[leaf][0], ref.anchor[leaf], rtol=2e-4,
                                           atol=2e-5, err_msg=where)  # fmt: skip
    assert ref.last_kind == "sync" and int(state.count[0]) == STEPS
    # the outer momentum is the reference's (identical on every worker)
    trace = jax.tree.leaves(state.outer_state)
    for leaf in range(len(SHAPES)):
        np.testing.assert_allclose(trace[leaf][0], ref.trace[leaf], rtol=2e-4, atol=2e-5)
        assert np.array_equal(trace[leaf], np.broadcast_to(trace[leaf][0], trace[leaf].shape))


def test_one_step_rounds_of_sgd_with_a_float_sync_are_synchronous_sgd():
    """H = 1, outer SGD at learning rate 1, float sync, SGD inside: every step moves the
    synchronised point by ``-lr mean_i(g_i)``, as data-parallel SGD does."""
    n, steps, lr = 4, 10, 0.05
    params, targets, curvature, noise = problem(n, steps, seed=3)
    tx = ozo.diloco(optax.sgd(lr), optax.sgd(1.0), 1, AXIS, collective="float")
    sgd = optax.sgd(lr)
    x = layout([params] * n)
    state = mapped(tx.init, "vmap", n)(x)
    run = stepper(tx, n)
    plain = [jnp.asarray(p, jnp.float32) for p in params]
    plain_state = sgd.init(plain)
    for k in range(1, steps + 1):
        host = [[np.asarray(plain[j]) for j in range(len(SHAPES))]] * n
        grads = grads_at(host, targets, curvature, noise[k - 1])
        x, state = run(k, x, state, layout(grads))
        mean = [jnp.asarray(np.mean([g[j] for g in grads], 0), jnp.float32) for j in
                range(len(SHAPES))]  # fmt: skip
        u, plain_state = sgd.update(mean, plain_state, plain)
        plain = optax.apply_updates(plain, u)
        for leaf in range(len(SHAPES)):
            np.testing.assert_allclose(x[leaf], np.broadcast_to(plain[leaf], x[leaf].shape),
                                       rtol=1e-5, atol=1e-6, err_msg=f"step {k}")  # fmt: skip


@pytest.mark.parametrize("collective", ["two_phase", "psum"])
def test_outer_sgd_at_rate_one_is_plain_averaging_bit_for_bit(collective):
    n = 4
    prob = problem(n, STEPS, seed=1)
    params = prob[0]
    policy = ozo.LocalStepDoubling(scaler=3, clipper=4)
    inner = optax.adam(0.02)
    runs = []
    for outer in (None, optax.sgd(1.0)):
        tx = ozo.local_step_sync(inner, policy, AXIS, collective=collective, outer=outer)
        x = layout([params] * n)
        state = mapped(tx.init, "vmap", n)(x)
        x, state = train(stepper(tx, n), x, state, prob, 1, STEPS)
        runs.append((x, state.anchor))
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_hinted_steps_follow_the_in_graph_steps():
    """The host's kinds are the counters' kinds (a wrong hint would be refused and the state
    left behind), and the hinted programs give the in-graph numbers to float32 rounding: the
    inner optax transform fuses differently inside a conditional (measured: up to 1.2e-7
    apart at the first local step, the same for ``outer=None``), so not to the bit."""
    n = 4
    prob = problem(n, STEPS, seed=2)
    params = prob[0]
    tx = ozo.diloco(optax.adamw(INNER_LR), nesterov(), H, AXIS, collective="two_phase")
    schedule = ozo.diloco_schedule(H)
    assert [schedule.kind(k).name for k in range(1, 2 * H + 1)] == (["local"] * (H - 1) + [
        "sync"]) * 2  # fmt: skip
    finals = []
    for hinted in (None, schedule):
        x = layout([params] * n)
        state = mapped(tx.init, "vmap", n)(x)
        finals.append(train(stepper(tx, n, hinted), x, state, prob, 1, STEPS))
    assert finals[1][1].refused_hint[0].tolist() == [0, 0]
    for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_start_step_with_the_documented_warm_up_keeps_the_workers_together():
    """``start_step=s`` with docs/diloco.md's inner (a float mean up to step ``s``, then none):
    every worker holds the same params through the warm-up and after every sync, hinted or
    not. Without the mean the workers part in the warm-up and each keeps its own anchor after
    (the precondition the docs state, shown failing)."""
    n, start, steps = 4, 3, 3 + 3 * H
    prob = problem(n, steps, seed=5)
    warm_up = ozo.scheduled_mean(AXIS, ozo.FullPrecisionWarmup(start), compressed_steps=False)
    schedule = ozo.diloco_schedule(H, start)
    for inner, together in ((optax.chain(warm_up, optax.adamw(INNER_LR)), True),
                            (optax.adamw(INNER_LR), False)):  # fmt: skip
        tx = ozo.diloco(inner, nesterov(), H, AXIS, collective="two_phase", start_step=start)
        for hinted in (None, schedule):
            spread = {}

            def after(k, x, spread=spread):
                spread[k] = max(float(np.ptp(np.asarray(leaf), axis=0).max()) for leaf in x)

            x = layout([prob[0]] * n)
            state = mapped(tx.init, "vmap", n)(x)
            train(stepper(tx, n, hinted), x, state, prob, 1, steps, after)
            synced = [k for k in range(1, steps + 1) if k <= start or schedule.kind(k).sync]
            assert len(synced) == start + 3
            if together:
                assert [spread[k] for k in range(1, start + 1)] == [0.0] * start
                # after a sync every worker holds the shared anchor up to the last bit of the
                # params (x + (anchor - x) rounds per worker: docs/algorithm.md, local_step_sync)
                assert max(spread[k] for k in synced) <= 1.2e-7
                assert spread[start + 2] > 0  # local steps part the workers, syncs rejoin them
            else:
                assert min(spread[k] for k in synced) > 1e-2


def test_a_non_finite_gradient_in_the_warm_up_is_skipped_and_the_run_goes_on():
    """Before ``start_step`` the inner transform averages (docs/diloco.md's warm-up) and the
    wrapper skips a step whose update is not finite. The inner state is any optax state:
    ``optax.adamw``'s moments took the NaN, and only the counters were restored, so every later
    step was NaN and skipped: the run stopped training without an error (found while checking
    the dispatcher's counters). Now the skipped step leaves every leaf of the state as it was,
    hinted or not, and the run goes on."""
    n, start = 2, 3
    prob = problem(n, start + 2 * H, seed=6)
    warm_up = ozo.scheduled_mean(AXIS, ozo.FullPrecisionWarmup(start), compressed_steps=False)
    inner = optax.chain(warm_up, optax.adamw(INNER_LR))
    tx = ozo.diloco(inner, nesterov(), H, AXIS, start_step=start)
    for hinted in (None, ozo.diloco_schedule(H, start)):
        run = stepper(tx, n, hinted)
        x = layout([prob[0]] * n)
        x, state = train(run, x, mapped(tx.init, "vmap", n)(x), prob, 1, 1)
        bad = layout(grads_at(worker_views(x), *prob[1:3], prob[3][1]))
        bad[0] = bad[0].at[1, 0, 0].set(jnp.nan)  # one element of one worker's gradient
        x2, state2 = run(2, x, state, bad)  # the counters kept: the next step is step 2 again
        assert np.asarray(state2.skipped_updates).tolist() == [1] * n
        same = (x, state._replace(skipped_updates=0))
        kept = (x2, state2._replace(skipped_updates=0))
        for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(kept), strict=True):
            np.testing.assert_array_equal(a, b)
        x3, state3 = train(run, x2, state2, prob, 2, start + 2 * H)
        assert np.asarray(state3.count).tolist() == [start + 2 * H] * n
        assert np.asarray(state3.skipped_updates).tolist() == [1] * n
        assert all(np.isfinite(leaf).all() for leaf in x3)
        assert float(np.abs(np.asarray(x3[0]) - np.asarray(x2[0])).max()) > 1e-3  # it trains


def test_resume_from_a_saved_state_is_exact():
    """The outer momentum is part of the state: 2 rounds, save (to host), 1 more round equals
    3 rounds straight."""
    n = 2
    prob = problem(n, STEPS, seed=4)
    tx = ozo.diloco(optax.adamw(INNER_LR), nesterov(), H, AXIS, collective="two_phase")
    run = stepper(tx, n)
    x0 = layout([prob[0]] * n)
    straight = train(run, x0, mapped(tx.init, "vmap", n)(x0), prob, 1, STEPS)
    x, state = train(run, x0, mapped(tx.init, "vmap", n)(x0), prob, 1, 2 * H)
    saved = jax.tree.map(np.asarray, (x, state))  # what a checkpoint writes
    restored = jax.tree.map(jnp.asarray, saved)
    resumed = train(run, *restored, prob, 2 * H + 1, STEPS)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_non_finite_outer_step_skips_the_sync():
    """An outer optimizer whose step overflows: the sync is skipped on every worker (anchor,
    outer state and counters kept, ``skipped_updates`` counts it); the run goes on."""
    n = 2
    prob = problem(n, STEPS, seed=5)
    params = prob[0]
    blow_up = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree.map(lambda x: x * jnp.inf, u), s),
    )
    tx = ozo.diloco(optax.sgd(INNER_LR), blow_up, H, AXIS)
    x = layout([params] * n)
    state = mapped(tx.init, "vmap", n)(x)
    x, state = train(stepper(tx, n), x, state, prob, 1, H)
    assert np.asarray(state.skipped_updates).tolist() == [1, 1]
    for anchor, p in zip(state.anchor, params, strict=True):
        np.testing.assert_array_equal(anchor, np.broadcast_to(np.float32(p), anchor.shape))
    assert all(np.isfinite(leaf).all() for leaf in x)


def test_a_sync_whose_mean_overflows_keeps_the_outer_momentum():
    """Each worker's distance finite, their float sum not: the sync is skipped (the counters
    kept, so the next step is the sync again). The outer state is any optax state: Nesterov's
    momentum took the non-finite delta and every later retry of the sync was skipped, the run
    stuck (found beside the warm-up's NaN). Now the momentum is kept as it was, and the retried
    sync goes through."""
    n = 2
    tx = ozo.diloco(optax.sgd(1.0), nesterov(), H, AXIS, collective="float")
    run = stepper(tx, n)
    x = [jnp.ones((n, 1), jnp.float32)]
    state = mapped(tx.init, "vmap", n)(x)
    for k in range(1, 2 * H):  # a first round, then H - 1 local steps of the second
        x, state = run(k, x, state, [jnp.full((n, 1), 0.1 * k, jnp.float32)])
    before = state
    x, state = run(2 * H, x, state, [jnp.full((n, 1), -2e38, jnp.float32)])  # its sync: 2 x 2e38
    assert np.asarray(state.skipped_updates).tolist() == [1] * n
    for a, b in zip(jax.tree.leaves(before.outer_state), jax.tree.leaves(state.outer_state),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    assert np.asarray(state.count).tolist() == np.asarray(before.count).tolist()
    x, state = run(2 * H, x, state, [jnp.full((n, 1), 0.5, jnp.float32)])  # the sync, retried
    assert np.asarray(state.count).tolist() == [2 * H] * n
    assert np.asarray(state.skipped_updates).tolist() == [1] * n
    assert np.isfinite(np.asarray(x[0])).all()


@pytest.mark.parametrize("hinted", [False, True], ids=["in-graph", "hinted"])
def test_a_skipped_sync_keeps_an_optax_inner_state_whole(hinted):
    """A sync skipped because its mean overflowed: the step is skipped, so the inner AdamW's
    moments and count stay as they were (they took the step's gradient and kept it while the
    count went back: moments one step ahead of their bias correction). Everything but
    skipped_updates is bitwise as before the step."""
    n = 2
    sgd = optax.sgd(1.0)
    tx = ozo.diloco(optax.adam(0.1), sgd, H, AXIS, collective="float")
    run = stepper(tx, n, ozo.diloco_schedule(H) if hinted else None)
    x = [jnp.ones((n, 1), jnp.float32)]
    state = mapped(tx.init, "vmap", n)(x)
    for k in range(1, 2 * H):
        x, state = run(k, x, state, [jnp.full((n, 1), 0.1 * k, jnp.float32)])
    before = (x, state._replace(skipped_updates=0))
    # each worker's move finite, their float sum not: 3e38 apart from the anchor, twice
    far = [jnp.full((n, 1), 3e38, jnp.float32)]
    x2, state2 = run(2 * H, far, state, [jnp.full((n, 1), 0.5, jnp.float32)])
    assert np.asarray(state2.skipped_updates).tolist() == [1] * n
    after = (x, state2._replace(skipped_updates=0))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("collective", ["float", "two_phase"])
def test_what_each_step_kind_sends(collective):
    """On 8 simulated devices under shard_map: a local step sends nothing; a sync one float32
    all-reduce of the flat buffer (``"float"``) or the 1-bit mean's all-to-all and all-gather."""
    tx = ozo.diloco(optax.adamw(INNER_LR), nesterov(), H, AXIS, collective=collective)
    schedule = ozo.diloco_schedule(H)
    local = traffic.stats_at(tx, schedule.kind(1))
    assert local.count() == 0 and local.sent_bytes_per_device == 0, local.table()
    sync = traffic.stats_at(tx, schedule.kind(H))
    (traffic.assert_float_allreduce if collective == "float" else traffic.assert_one_bit)(sync)


def test_muloco_shape_muon_inside_one_bit_sync():
    """MuLoCo's shape: Muon as the inner optimizer (on the leaves' own shapes: no flattening),
    1-bit syncs with error feedback. Workers agree after every sync and the loss falls."""
    n, steps = 4, 4 * H
    prob = problem(n, steps, seed=6)
    params, targets = prob[0], prob[1]
    tx = ozo.diloco(optax.contrib.muon(0.02), nesterov(), H, AXIS, collective="two_phase")
    x = layout([params] * n)
    state = mapped(tx.init, "vmap", n)(x)

    def loss(leaves):
        return sum(float(np.sum((np.asarray(a) - t) ** 2)) for a, t in zip(leaves, targets))

    def agree_after_syncs(k, x):
        if k % H == 0:
            for leaf in x:
                ulp = float(jnp.finfo(jnp.float32).eps * jnp.max(jnp.abs(leaf)))
                assert float(jnp.max(jnp.abs(leaf - leaf[0]))) <= 2 * ulp

    start = loss(params)
    x, state = train(stepper(tx, n), x, state, prob, 1, steps, agree_after_syncs)
    assert loss(worker_views(x)[0]) < 0.8 * start  # measured: 88.5 -> 64.4 in 16 steps


@pytest.mark.parametrize("inner", ["muon", "adafactor"])
def test_flatten_refuses_an_inner_transform_that_reads_leaf_shapes(inner):
    """Muon and Adafactor on the one flat buffer compute something else: a flattened MuLoCo
    diverged without a word (a new-user trial; the docs said not to). Refused at init."""
    make = {"muon": lambda: optax.contrib.muon(0.02), "adafactor": lambda: optax.adafactor(0.01)}
    tx = ozo.flatten(ozo.diloco(make[inner](), nesterov(), H, AXIS), AXIS)
    with pytest.raises(ValueError, match="read each leaf's own shape"):
        jax.vmap(tx.init, axis_name=AXIS)({"w": jnp.zeros((2, 8, 4))})
    flat_adamw = ozo.flatten(ozo.diloco(optax.adamw(1e-3), nesterov(), H, AXIS), AXIS)
    jax.vmap(flat_adamw.init, axis_name=AXIS)({"w": jnp.zeros((2, 8, 4))})  # fine


def test_an_inner_named_chain_keeps_its_state_structure():
    """optax.named_chain's state is an OrderedDict: the restore of a skipped step made it a
    dict, and every sync failed with a pytree-structure error (a review)."""
    inner = optax.named_chain(("adam", optax.scale_by_adam()), ("lr", optax.scale(-1e-2)))
    tx = ozo.diloco(inner, optax.sgd(0.7), 3, AXIS)
    params = {"w": jnp.ones((2, 4))}
    state = jax.vmap(tx.init, axis_name=AXIS)(params)
    schedule = ozo.diloco_schedule(3)
    for kind in (None, schedule.kind(1), schedule.kind(3)):
        step = jax.vmap(lambda g, s, p, k=kind: tx.update(g, s, p, step_kind=k), axis_name=AXIS)
        _, after = jax.jit(step)(params, state, params)
        assert jax.tree.structure(after) == jax.tree.structure(state), kind


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match="outer optimizer"):
        ozo.diloco(optax.adamw(1e-3), None, 50, AXIS)
    with pytest.raises(TypeError, match="outer must be an optax.GradientTransformation"):
        ozo.local_step_sync(optax.sgd(0.1), ozo.SyncEvery(5), AXIS, outer=0.7)
    with pytest.raises(ValueError, match=r"sync_every \(SyncEvery.every\) must be an integer >= 1"):
        ozo.diloco(optax.adamw(1e-3), optax.sgd(1.0), 0, AXIS)
    with pytest.raises(ValueError, match=r"collective must be one of .*'float'"):
        ozo.diloco(optax.adamw(1e-3), optax.sgd(1.0), 50, AXIS, collective="bf16")
    with pytest.raises(TypeError, match="inner optax transformation, got None"):
        ozo.diloco(None, optax.sgd(1.0), 50, AXIS)
    with pytest.raises(ValueError, match=r"local_step_policy must be a policy.*ozo.SyncEvery"):
        ozo.local_step_sync(optax.sgd(0.1), 4, AXIS)


def test_a_state_of_another_outer_optimizer_is_refused():
    """A state made with Nesterov's outer step, given to a DiLoCo with Adam's: a ValueError, as
    for a state of another optimizer (it was an AttributeError from inside optax)."""
    x = layout([problem(2, 1)[0]] * 2)
    made = ozo.diloco(optax.adamw(INNER_LR), nesterov(), H, AXIS)
    other = ozo.diloco(optax.adamw(INNER_LR), optax.adam(0.1), H, AXIS)
    state = mapped(made.init, "vmap", 2)(x)
    with pytest.raises(ValueError, match="outer_state was not made by this outer optimizer"):
        mapped(lambda g, s, p: other.update(g, s, p), "vmap", 2)(x, state, x)


def test_a_wrong_schedule_names_diloco_s_own():
    """The dispatcher's error for a schedule that is not the optimizer's names DiLoCo's
    schedule too (it named 0/1 Adam's alone)."""
    tx = ozo.diloco(optax.adamw(1e-3), optax.sgd(1.0), 5, AXIS)
    run = ozo.dispatch_by_kind(
        lambda kind: jax.jit(
            jax.vmap(
                lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
                    *tx.update(g, s, p, step_kind=kind)
                ),
                axis_name=AXIS,
            )
        ),
        ozo.diloco_schedule(3),  # not sync_every=5
    )
    params = {"w": jnp.zeros((2, 4))}
    state = jax.vmap(tx.init, axis_name=AXIS)(params)
    with pytest.raises(ValueError, match=r"ozo.diloco_schedule\(sync_every, start_step\)"):
        for _ in range(12):
            params, state = run(params, state, {"w": jnp.ones((2, 4))})
        run.settle()


def test_float_sync_over_a_fast_axis_matches_the_flat_float_sync():
    """Hierarchical float sync on (node, local) = 2 x 2 workers: the same numbers as over 4
    flat workers (a float mean has no compression to split), to rounding."""
    n = 4
    prob = problem(n, 2 * H, seed=7)
    flat_tx = ozo.diloco(optax.adamw(INNER_LR), nesterov(), H, AXIS, collective="float")
    tree_tx = ozo.diloco(optax.adamw(INNER_LR), nesterov(), H, "node", collective="float",
                         fast_axis_name="local")  # fmt: skip

    def nested(fn):
        inner = jax.vmap(fn, axis_name="local")
        outer = jax.jit(jax.vmap(inner, axis_name="node"))

        def call(*args):
            split = jax.tree.map(lambda a: a.reshape(2, 2, *a.shape[1:]), args)
            return jax.tree.map(lambda a: a.reshape(n, *a.shape[2:]), outer(*split))

        return call

    x0 = layout([prob[0]] * n)
    results = []
    for tx, lift in ((flat_tx, lambda f: mapped(f, "vmap", n)), (tree_tx, nested)):
        x, state = train(stepper(tx, n, lift=lift), x0, lift(tx.init)(x0), prob, 1, 2 * H)
        results.append(x)
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("start", [0, 2])
def test_a_refused_hint_leaves_an_optax_inner_state_as_it_was(start):
    """A hint the state refuses (here "local" where a sync is due, or a local step where the
    warm-up's pass-through is) is not applied: every leaf but refused_hint stays as it was. An
    optax inner state (AdamW's moments) took the refused step's gradient, and, with the
    documented warm-up's mean before it (NaN on a refused step), a dispatched run that a skip
    had put one step ahead never trained again (a review of the dispatcher)."""
    n = 2
    warm_up = ozo.scheduled_mean(AXIS, ozo.FullPrecisionWarmup(start), compressed_steps=False)
    inner = optax.chain(warm_up, optax.adam(0.1)) if start else optax.adam(0.1)
    tx = ozo.diloco(inner, optax.sgd(0.7), 3, AXIS, start_step=start)
    schedule = ozo.diloco_schedule(3, start)
    run = stepper(tx, n, schedule)
    x = [jnp.ones((n, 2), jnp.float32)]
    state = mapped(tx.init, "vmap", n)(x)
    due = 3 if not start else 2  # a sync, or the warm-up's last step
    for k in range(1, due):
        x, state = run(k, x, state, [jnp.full((n, 2), 0.1 * k, jnp.float32)])
    wrong = schedule.kind(start + 1)  # a local step
    refused = mapped(lambda p, s, g: tx.update(g, s, p, step_kind=wrong), "vmap", n)
    _, after = refused(x, state, [jnp.full((n, 2), 0.5, jnp.float32)])
    assert np.asarray(after.refused_hint)[:, 0].tolist() == [1] * n
    flat = jax.tree_util.tree_flatten_with_path
    for (path, a), b in zip(flat(state)[0], jax.tree.leaves(after), strict=True):
        if "refused_hint" not in jax.tree_util.keystr(path):  # the inner mean records its own
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_a_dispatched_run_goes_on_after_a_skip_in_the_warm_up():
    """The documented warm-up (a float mean up to start_step, then AdamW), dispatched, one NaN
    a few steps before start_step: the steps dispatched past the skip are refused until the
    host learns of it, and their refusals must not reach AdamW's moments. Before, every later
    step was skipped and the run never trained again."""
    n, start = 2, 6
    warm_up = ozo.scheduled_mean(AXIS, ozo.FullPrecisionWarmup(start), compressed_steps=False)
    tx = ozo.diloco(optax.chain(warm_up, optax.adam(1e-2)), nesterov(), 3, AXIS, start_step=start)

    def compile_kind(kind):
        def step(x, s, g):
            u, s = tx.update(g, s, x, step_kind=kind)
            return optax.apply_updates(x, u), s

        return jax.jit(jax.vmap(step, axis_name=AXIS))

    run = ozo.dispatch_by_kind(compile_kind, ozo.diloco_schedule(3, start))
    x = [jnp.ones((n, 3), jnp.float32)]
    state = mapped(tx.init, "vmap", n)(x)
    rng = np.random.default_rng(0)
    for k in range(1, 41):
        g = rng.standard_normal((n, 3)).astype(np.float32)
        if k == 3:
            g[1, 0] = np.nan
        x, state = run(x, state, [jnp.asarray(g)])
    run.settle()
    assert run.skipped == 1 and run.lost <= run.check_every + 2, (run.skipped, run.lost)
    assert int(np.asarray(state.count)[0]) == 40 - run.skipped - run.lost
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves((x, state)))


@pytest.mark.parametrize("collective", ["two_phase", "psum"])
def test_a_sync_skipped_for_its_outer_step_keeps_the_error_buffers(collective):
    """A finite 1-bit mean whose outer step is not finite: the sync is skipped, so its payload is
    not sent, and its residual must not stay in the error buffers. It stayed (they were kept
    once the hint was admitted), every later delta carried it, and with it every later sync
    was skipped too (a review). The run with the skipped step equals the run without it."""
    n = 4

    def guarded():  # an outer step that is not finite where the pseudo-gradient is huge
        def update(u, s, p=None):
            return jax.tree.map(lambda d: jnp.where(jnp.abs(d) > 50.0, jnp.nan, -d), u), s

        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    tx = ozo.local_step_sync(
        optax.sgd(0.1), ozo.SyncEvery(1), AXIS, collective=collective, outer=guarded()
    )
    rng = np.random.default_rng(0)
    x0 = [jnp.asarray(np.tile(rng.standard_normal((5, 3)), (n, 1, 1)), jnp.float32)]
    grads = [[jnp.asarray(rng.standard_normal((n, 5, 3)), jnp.float32)] for _ in range(6)]
    grads[2] = [g * 1e4 for g in grads[2]]  # finite, its pseudo-gradient past the guard
    run = stepper(tx, n)

    def train_on(sequence):
        x, state = x0, mapped(tx.init, "vmap", n)(x0)
        for k, g in enumerate(sequence, 1):
            x, state = run(k, x, state, g)
        return x, state

    with_skip = train_on(grads)
    without = train_on(grads[:2] + grads[3:])
    assert np.asarray(with_skip[1].skipped_updates).tolist() == [1] * n
    kept = (with_skip[0], with_skip[1]._replace(skipped_updates=0))
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(without), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_momentum_average_keeps_the_trace_in_the_params_dtype(dtype):
    """optax keeps SGD's momentum in the params' dtype; the sync set it from the float32
    anchor's mean, so with bfloat16 params the step deciding in the graph failed to trace
    (branches of other types) and a hinted run's state changed type (a review)."""
    n, rule = 2, ozo.MomentumAverage(0.01)
    tx = ozo.local_step_sync(optax.sgd(0.01, momentum=0.9), ozo.SyncEvery(2), AXIS, rule=rule)
    x = [jnp.ones((n, 4), dtype)]
    for hinted in (None, ozo.local_step_schedule(ozo.SyncEvery(2))):
        run = stepper(tx, n, hinted)
        state = mapped(tx.init, "vmap", n)(x)
        y = x
        for k in range(1, 5):
            y, state = run(k, y, state, [jnp.full((n, 4), 0.5 * k, dtype)])
            assert state.inner_state[0].trace[0].dtype == dtype
        assert y[0].dtype == dtype and np.isfinite(np.asarray(y[0], np.float32)).all()


class _OwnRule:
    """A sync rule written to the four required methods only (ParamsAverage's behaviour)."""

    def learning_rate_at(self, count):
        return 0.0

    def weight(self, inner_state):
        return None

    def after_sync(self, inner_state, mean, lr_sum, ok):
        return inner_state

    def errors(self, inner_state, start_step):
        return None


class _LendingRule(_OwnRule):
    """Lends the inner SGD's momentum as error buffers, with no way to store them back."""

    def errors(self, inner_state, start_step):
        return inner_state[0].trace


def test_a_rule_of_ones_own_needs_only_the_documented_methods():
    """A code review: local_step_sync checked four methods of a rule and then read
    inner_frozen_after_start (and with_errors) from it, so a rule written to the checked
    methods passed construction and failed with AttributeError at its first local step. It now
    runs as ParamsAverage does, bit for bit; a rule that lends buffers without with_errors is
    refused at init, by name."""
    n, policy = 2, ozo.SyncEvery(2)
    params, targets, curvature, noise = problem(n, 6)
    x0, runs = layout([params] * n), []
    for rule in (_OwnRule(), ozo.ParamsAverage()):
        tx = ozo.local_step_sync(optax.sgd(0.05), policy, AXIS, rule=rule)
        run, x = stepper(tx, n, ozo.local_step_schedule(policy)), x0
        state = mapped(tx.init, "vmap", n)(x)
        for k in range(1, 7):
            g = layout(grads_at(worker_views(x), targets, curvature, noise[k - 1]))
            x, state = run(k, x, state, g)
        runs.append(x)
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    tx = ozo.local_step_sync(optax.sgd(0.05, momentum=0.9), policy, AXIS, rule=_LendingRule())
    with pytest.raises(ValueError, match="lends error buffers .* but has no with_errors"):
        mapped(tx.init, "vmap", n)(x0)
