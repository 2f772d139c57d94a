"""Property tests (Hypothesis) of the compressed mean and of 0/1 Adam's schedules.

Compressed mean: random trees (1-3 leaves of 0-3 dimensions, zero-size and scalar leaves
included), 1-8 workers, 24 calls of random values (normal, one spike, constant, sparse with exact
zeros, all zeros, and elementwise magnitudes from 1e-15 to 1e15): every worker gets the same,
finite output, one magnitude per server chunk; the error-feedback identity holds to float32
rounding; the error buffers stay bounded by the inputs.

Schedules: the built-in policies with random constants, alone (pure Python) and inside 0/1 Adam
on 3 workers: counters identical on every worker, intervals never above the clipper, the
variance never updated after the freeze (nor on any step that is not a variance step), the step
kinds exactly those the policies list.

Examples are capped (and every drawn tree compiles once), so the file runs in well under a
minute on two shared cores. ``vmap(axis_name=...)`` simulates the workers.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from support.kinds import kind_index
from support.mapping import AXIS

import optax_zero_one as ozo
from optax_zero_one.core.collective import init_errors
from optax_zero_one.core.flat import Layout, to_flat

CALLS = 24
EPS32 = float(np.finfo(np.float32).eps)
PATTERNS = ("normal", "spike", "constant", "sparse", "zeros", "mixed")
SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def values(rng, pattern, shape, magnitude):
    """One worker's input for one call: ``pattern`` at ``magnitude`` (float32)."""
    size = math.prod(shape)
    if pattern == "normal":
        x = rng.standard_normal(size)
    elif pattern == "spike":
        x = np.zeros(size)
        if size:
            x[rng.integers(size)] = rng.choice([-1.0, 1.0])
    elif pattern == "constant":
        x = np.full(size, rng.choice([-1.0, 1.0]))
    elif pattern == "sparse":
        x = rng.standard_normal(size) * (rng.random(size) < 0.2)
    elif pattern == "zeros":
        x = np.zeros(size)
    else:  # "mixed": every element its own magnitude in [1e-15, 1e15] relative to `magnitude`
        x = rng.standard_normal(size) * 10.0 ** rng.uniform(-15, 15, size) / 1e15
    return (x * magnitude).astype(np.float32).reshape(shape)


@st.composite
def compressed_mean_cases(draw):
    num_workers = draw(st.integers(1, 8))
    shapes = draw(
        st.lists(
            st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple), min_size=1, max_size=3
        )
    )
    seed = draw(st.integers(0, 2**32 - 1))
    pattern = draw(st.sampled_from(PATTERNS))
    exponent = draw(st.integers(-15, 15))  # magnitude 10**exponent, per worker up to x1000
    rng = np.random.default_rng(seed)
    inputs = []
    for shape in shapes:
        scale = 10.0**exponent * 10.0 ** rng.uniform(
            0, 3, size=(1, num_workers) + (1,) * len(shape)
        )
        leaf = np.stack(
            [
                np.stack([values(rng, pattern, shape, 1.0) for _ in range(num_workers)])
                for _ in range(CALLS)
            ]
        )
        inputs.append((leaf * scale).astype(np.float32))  # (CALLS, N, *shape)
    return num_workers, inputs


def run_compressed_mean(inputs, num_workers):
    """``CALLS`` calls of the compressed mean on ``num_workers`` vmapped workers: every call's
    outputs and error buffers (per leaf: the padded worker error and the served chunk's error),
    with a leading call axis then the worker axis."""
    layout = Layout.of([leaf[0, 0] for leaf in inputs], num_workers)

    def worker(z):  # z: list of (CALLS, *shape), this worker's inputs
        def call(errors, zt):
            out, errors, _ = ozo.core.collective.compressed_mean(to_flat(zt, layout), errors, AXIS)
            return errors, (out.to_tree(), errors)

        _, (outs, errors) = lax.scan(call, init_errors(layout), z)
        return outs, errors

    by_worker = [np.swapaxes(leaf, 0, 1) for leaf in inputs]  # (N, CALLS, ...)
    outs, errors = jax.jit(jax.vmap(worker, axis_name=AXIS))(by_worker)
    swap = lambda a: np.swapaxes(np.asarray(a), 0, 1)  # back to (CALLS, N, ...)
    if num_workers == 1 or layout.width == 0:  # no buffers (nothing to compress)
        empty = [np.zeros((CALLS, num_workers, 0))] * len(inputs)
        return [swap(o) for o in outs], (empty, empty)
    worker_error = [swap(e) for e in layout.padded_leaves(np.asarray(errors.worker_error.buffer))]
    server_error = [swap(e) for e in layout.chunk_leaves(np.asarray(errors.server_error))]
    return [swap(o) for o in outs], (worker_error, server_error)


@settings(max_examples=10, **SLOW)
@given(compressed_mean_cases())
def test_compressed_mean_properties(case):
    n, inputs = case
    outs, errors = run_compressed_mean(inputs, n)
    for leaf, (z, out) in enumerate(zip(inputs, outs)):
        size = z[0, 0].size
        ew = errors[0][leaf].astype(np.float64)  # (CALLS, N, P)
        es = errors[1][leaf].astype(np.float64)  # (CALLS, N, P / N)

        # identical, finite output on every worker
        assert np.all(np.isfinite(out))
        np.testing.assert_array_equal(out, np.broadcast_to(out[:, :1], out.shape))
        if n == 1:  # nothing to communicate: the identity, no error kept
            np.testing.assert_array_equal(out, z)
            assert ew.size == 0 and es.size == 0
            continue
        if size == 0:
            continue
        padded = ew.shape[-1]

        # 1 bit per element: within each server's chunk, one magnitude
        full = np.zeros((CALLS, padded))
        full[:, :size] = np.abs(out[:, 0].reshape(CALLS, -1))
        chunks = full.reshape(CALLS, n, padded // n)
        for t, j in np.ndindex(CALLS, n):
            assert (
                np.unique(chunks[t, j][: max(0, min(size - j * (padded // n), padded // n))]).size
                <= 1
            )

        # error-feedback identity: sum(out) = sum(mean z) - mean_i(e_w,i) - e_s (padded vectors)
        total_out = out[:, 0].astype(np.float64).reshape(CALLS, -1).sum(0)
        total_mean = z.astype(np.float64).reshape(CALLS, n, -1).mean(1).sum(0)
        residual = (ew[-1].mean(0) + es[-1].reshape(-1))[:size]
        scale = max(np.abs(z).max(), np.abs(ew).max(), np.abs(es).max(), np.abs(out).max(), 1e-38)
        np.testing.assert_allclose(
            total_out, total_mean - residual, rtol=0, atol=8 * CALLS * EPS32 * scale
        )

        # bounded buffers: RMS of every error vector <= 2 x the largest input magnitude so far
        peak = np.maximum.accumulate(np.abs(z).reshape(CALLS, -1).max(1))
        rms_w = np.sqrt((ew**2).mean(-1)).max(1)
        rms_s = np.sqrt((es**2).mean(-1)).max(1)
        assert np.all(rms_w <= 2 * peak + 1e-38) and np.all(rms_s <= 2 * peak + 1e-38)


# --- schedules ---------------------------------------------------------------------------------

STEPS = 48


@st.composite
def schedules(draw):
    return dict(
        freeze=draw(st.integers(0, 30)),
        kappa=draw(st.integers(1, 4)),
        alpha=draw(st.integers(1, 6)),
        clipper=draw(st.integers(1, 8)),
    )


def walk(policy, predicate, first, last):
    """(state before, fired?) for every step of ``first..last``, with Python ints."""
    state, out = policy.init(), []
    for k in range(first, last + 1):
        out.append((state, bool(predicate(state, k))))
        state = policy.next(state, k)
    return out, state


class CountingPolicy:
    """A policy that counts the steps its ``next`` is asked to walk: a user's policy, with no
    closed-form ``jump`` (the walk then steps through ``next``)."""

    def __init__(self, policy):
        self.policy, self.walked = policy, 0

    def __getattr__(self, name):
        if name == "jump":
            raise AttributeError(name)
        return getattr(self.policy, name)

    def next(self, state, k):
        self.walked += 1
        return self.policy.next(state, k)


@settings(max_examples=100, deadline=None)
@given(schedules(), st.lists(st.integers(1, 120), min_size=1, max_size=40))
def test_schedule_kind_resumes_its_walk(s, asked):
    """``StepSchedule.kind`` gives every step the kind of a fresh walk, whatever order steps
    are asked in, and asked step by step (a training loop) it walks each step once."""
    variance = ozo.VarianceDoubling(s["freeze"], s["kappa"])
    local = ozo.LocalStepDoubling(s["alpha"], s["clipper"])
    expected = ozo.StepSchedule(variance, local).indices(120)
    schedule = ozo.StepSchedule(variance, local)
    for k in asked:  # any order: an earlier step walks again from step 1
        assert schedule.kinds.index(schedule.kind(k)) == expected[k - 1]
    counting = CountingPolicy(variance), CountingPolicy(local)
    schedule = ozo.StepSchedule(*counting)
    for k in range(1, 121):
        assert schedule.kinds.index(schedule.kind(k)) == expected[k - 1]
    assert sum(c.walked for c in counting) == 119  # once per step, not once per step per call


@settings(max_examples=300, deadline=None)
@given(schedules(), st.integers(0, 300), st.integers(0, 1_500))
def test_a_policy_jump_is_its_steps_one_by_one(s, before, length):
    """Each built-in policy's closed-form ``jump(state, first, last)`` is the state its
    ``next`` gives over ``first..last`` one step at a time, from any state a walk reaches."""
    for policy in (
        ozo.VarianceDoubling(10**6, s["kappa"]),
        ozo.LocalStepDoubling(s["alpha"], s["clipper"]),
        ozo.SyncEvery(s["alpha"]),
        ozo.FullPrecisionWarmup(s["freeze"]),
    ):
        state = policy.init()
        for k in range(1, before + 1):
            state = policy.next(state, k)
        want = state
        for k in range(before + 1, before + length + 1):
            want = policy.next(want, k)
        got = policy.jump(state, before + 1, before + length)
        assert tuple(got) == tuple(int(x) for x in want)
        assert all(type(x) is int for x in got)


def test_the_kind_of_a_far_step_is_found_without_walking_every_step(monkeypatch):
    """A run resumed far into training asks its schedule for the kind of a step 10^7 or 2^31 - 1
    steps in: the built-in policies jump there (walking step by step took ~6 s per 10^7 steps).
    The kinds agree with a step-by-step walk where one is affordable (10^5 steps)."""
    schedule = ozo.zero_one_schedule(500, 16, 2_200, 16)
    counting = CountingPolicy(schedule.variance_policy), CountingPolicy(schedule.local_step_policy)
    stepped = ozo.StepSchedule(*counting).indices(100_000)
    assert sum(c.walked for c in counting) == 100_000 - 1
    rng = np.random.default_rng(0)
    for k in rng.integers(1, 100_001, 300):
        fresh = ozo.zero_one_schedule(500, 16, 2_200, 16)  # each walk from step 1
        assert fresh.kinds.index(fresh.kind(int(k))) == stepped[k - 1]

    def refused(self, state, k):
        raise AssertionError("walked step by step")

    for cls in (ozo.VarianceDoubling, ozo.LocalStepDoubling):
        monkeypatch.setattr(cls, "next", refused)
    far = ozo.zero_one_schedule(500, 16, 2_200, 16)
    # phase B at H = 16: a sync on the multiples of 16 only
    assert far.kind(10**7).name == "sync" and far.kind(2**31 - 1).name == "local"
    assert far.kind(2**31 - 16).name == "sync" and far.kind(499).name == "compressed"


def test_a_policy_that_overrides_next_alone_is_walked_with_its_own_next():
    """A subclass of a library policy that changes ``next`` inherits a ``jump`` written for
    the parent's: the walk must not take it (a trial: a tripling interval jumped as a doubling
    one, and a resume refused the optimizer's own state as saved under other arguments)."""

    class Tripling(ozo.LocalStepDoubling):
        def next(self, state, step):
            full = state.counter + 1 >= self.scaler
            interval = state.interval * 3 if full else state.interval
            return ozo.core.policies.IntervalState(interval, 0 if full else state.counter + 1)

    variance, local = ozo.VarianceDoubling(4, 2), Tripling(40, 10**6)
    in_order = ozo.StepSchedule(variance, local).indices(400)
    for k in (30, 81, 250, 400):
        fresh = ozo.StepSchedule(variance, local)
        assert fresh.kinds.index(fresh.kind(k)) == in_order[k - 1]
    sync_gaps = np.diff(np.flatnonzero(in_order == 3))
    assert sync_gaps.max() >= 27  # the interval did triple (1, 3, 9, 27, ...)

    class Offset(ozo.VarianceDoubling):  # a review: `next` inherited, its helper changed
        @staticmethod
        def _due(state, step):
            return step % state.interval == 1 % state.interval

    @dataclasses.dataclass(frozen=True)
    class Fielded:  # a field named `jump` is no closed form
        jump: int = 3
        every: int = 4

        def init(self):
            return ()

        def is_sync_step(self, state, step):
            return step % self.every == 0

        def next(self, state, step):
            return state

    cases = ((Offset(300, 2), ozo.LocalStepDoubling(5, 4)), (ozo.VarianceDoubling(4), Fielded()))
    for policies in cases:
        in_order = ozo.StepSchedule(*policies).indices(400)
        for k in (30, 81, 250, 400):
            fresh = ozo.StepSchedule(*policies)
            assert fresh.kinds.index(fresh.kind(k)) == in_order[k - 1]


@settings(max_examples=200, deadline=None)
@given(schedules(), st.integers(1, 400))
def test_policies_alone(s, num_steps):
    variance = ozo.VarianceDoubling(s["freeze"], s["kappa"])
    local = ozo.LocalStepDoubling(s["alpha"], s["clipper"])
    var_walk, _ = walk(variance, variance.is_update_step, 1, min(num_steps, s["freeze"]))
    var_steps = [k for k, (_, fired) in enumerate(var_walk, start=1) if fired]
    assert list(ozo.core.policies.variance_steps(variance, num_steps)) == var_steps
    assert all(1 <= k <= s["freeze"] for k in var_steps)
    gaps = np.diff([0, *var_steps])
    assert np.all(gaps[1:] >= gaps[:-1])  # gaps never shrink
    assert all(g & (g - 1) == 0 for g in gaps)  # and are powers of two
    # each interval serves exactly kappa variance steps before it doubles (the last one may be
    # cut short by the freeze)
    used = [state.interval for state, fired in var_walk if fired]
    for g in sorted(set(used))[:-1]:
        assert used.count(g) == s["kappa"]

    sync_walk, _ = walk(local, local.is_sync_step, s["freeze"] + 1, num_steps)
    syncs = [s["freeze"] + i for i, (_, fired) in enumerate(sync_walk, start=1) if fired]
    assert list(ozo.core.policies.sync_steps(local, s["freeze"], num_steps)) == syncs
    intervals = [state.interval for state, _ in sync_walk]
    assert all(1 <= i <= s["clipper"] for i in intervals)  # never above the clipper
    assert all(b >= a for a, b in zip(intervals, intervals[1:]))
    # no starvation: a sync at least every `clipper` phase-B steps (power-of-two clipper, e.g.
    # DeepSpeed's 16); with another clipper the test on the absolute step can skip one multiple
    # when the interval grows (4 -> 5: syncs at 4 and 10), so up to 2 * clipper - 1
    if num_steps > s["freeze"]:
        clip = s["clipper"]
        bound = clip if clip & (clip - 1) == 0 else 2 * clip - 1
        assert max(np.diff([s["freeze"], *syncs, num_steps + 1])) <= bound


@pytest.mark.parametrize("clipper", [None, 2**31 - 1, 2**30 + 7])
def test_a_doubling_interval_near_int32s_top_stays_in_int32(clipper):
    """The interval doubles up to its clipper (the variance policy: unclipped) with int32
    counters on the device and Python ints on the host. It was doubled, then clipped, so past
    2**30 it wrapped on the device (to -2**31, then 0: a sync every step there, none on the
    host; a dispatched run raised a wrong-schedule error). Host and device now agree, and the
    interval stays at the cap."""
    policy = ozo.VarianceDoubling(10, 1) if clipper is None else ozo.LocalStepDoubling(1, clipper)
    cap = 2**31 - 1 if clipper is None else clipper
    host = ozo.core.policies.IntervalState(2**29, 0)
    device = jax.tree.map(lambda x: jnp.asarray(x, jnp.int32), host)
    for _ in range(4):  # 2**30, then the cap, then the cap
        host = policy._counted(host, 1, 1, clipper)
        device = jax.jit(lambda st: policy._counted(st, 1, 1, clipper))(device)
        assert int(device.interval) == host.interval
    assert host.interval == cap


def traced(cls, **constants):
    """A built-in policy whose constants are traced arrays.

    The dataclasses validate Python ints at construction; building the instance without
    ``__init__`` keeps their methods (the code under test) while one compilation of the
    optimizer serves every drawn schedule.
    """
    policy = object.__new__(cls)
    for name, value in constants.items():
        object.__setattr__(policy, name, value)
    return policy


WORKERS = 3


def find(state, cls):
    nodes = jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, cls))
    (node,) = [s for s in nodes if isinstance(s, cls)]
    return node


@jax.jit
def run_zero_one(freeze, kappa, alpha, clipper, noise):
    """0/1 Adam on ``WORKERS`` workers for ``STEPS`` steps under the drawn schedule: per step,
    the kind before it and the counters, ``nu``, error buffers, ``u`` and the anchor after it."""
    variance = traced(ozo.VarianceDoubling, freeze_step=freeze, update_scaler=kappa)
    local = traced(ozo.LocalStepDoubling, scaler=alpha, clipper=clipper)
    tx = ozo.scale_by_zero_one_adam(
        1e-3, eps=1e-3, variance_policy=variance, local_step_policy=local, axis_name=AXIS
    )

    def worker(noise):
        params = jnp.zeros(5)

        def step(carry, g):
            x, state = carry
            kind = kind_index(state, variance, local)
            updates, state = tx.update(g, state, x)
            x = optax.apply_updates(x, updates)
            sync = find(state, ozo.LocalStepSyncState)
            scheduled = find(state, ozo.ScheduledMeanState)
            adam = find(state, ozo.FrozenVarianceAdamState)
            counters = (sync.count, *scheduled.variance_policy, *sync.local_step_policy)
            anchor = sync.anchor.to_tree()
            u = anchor - x  # the local updates since the last sync
            return (x, state), (
                kind,
                jnp.stack(counters),
                adam.nu.buffer,
                scheduled.errors,
                u,
                anchor,
            )

        return lax.scan(step, (params, tx.init(params)), noise)[1]

    return jax.vmap(worker, axis_name=AXIS)(noise)


@settings(max_examples=25, **SLOW)
@given(schedules(), st.integers(0, 2**32 - 1))
def test_zero_one_adam_follows_its_policies(s, seed):
    noise = np.random.default_rng(seed).standard_normal((WORKERS, STEPS, 5)).astype(np.float32)
    noise[:, :, 0] = 0.0  # an exact zero in every gradient
    out = run_zero_one(*(jnp.int32(s[k]) for k in ("freeze", "kappa", "alpha", "clipper")), noise)
    kinds, counters, nu, comm, acc, anchor = jax.tree.map(np.asarray, out)

    # counters and step kinds are identical on every worker
    np.testing.assert_array_equal(counters, np.broadcast_to(counters[:1], counters.shape))
    np.testing.assert_array_equal(kinds, np.broadcast_to(kinds[:1], kinds.shape))
    kinds = [ozo.STEP_KINDS[k] for k in kinds[0]]
    count, _, _, interval, _ = counters[0].T
    assert list(count) == list(range(1, STEPS + 1))
    assert np.all(interval <= s["clipper"]) and np.all(interval >= 1)

    # the kinds are exactly the policies' schedules
    variance = ozo.VarianceDoubling(s["freeze"], s["kappa"])
    local = ozo.LocalStepDoubling(s["alpha"], s["clipper"])
    steps_of = lambda name: [k for k, kind in enumerate(kinds, start=1) if kind == name]
    assert steps_of("variance") == list(ozo.core.policies.variance_steps(variance, STEPS))
    assert steps_of("sync") == list(ozo.core.policies.sync_steps(local, s["freeze"], STEPS))
    assert all(kind in ("variance", "compressed") for kind in kinds[: s["freeze"]])

    # v changes only on variance steps, and never after the freeze
    before = np.concatenate([np.zeros_like(nu[:, :1]), nu[:, :-1]], axis=1)
    for k, kind in enumerate(kinds, start=1):
        if kind != "variance":
            np.testing.assert_array_equal(nu[:, k - 1], before[:, k - 1], err_msg=f"step {k}")
    # the error buffers move only at compressed steps and syncs (the first sync after the freeze
    # starts them from zero: tests/test_reference.py follows that trajectory); u = anchor - x is
    # back to zero after every sync
    for e in jax.tree.leaves(comm):
        previous = np.concatenate([np.zeros_like(e[:, :1]), e[:, :-1]], axis=1)
        for k, kind in enumerate(kinds, start=1):
            if kind in ("variance", "local"):
                np.testing.assert_array_equal(e[:, k - 1], previous[:, k - 1], err_msg=f"{k}")
    for k in steps_of("sync"):  # every worker lands on the anchor (float32 ulps of |x| <~ 2)
        np.testing.assert_allclose(acc[:, k - 1], 0.0, atol=1e-6, err_msg=f"step {k}")
    # the anchor (the last synchronised point) is bitwise the same on every worker, always
    np.testing.assert_array_equal(anchor, np.broadcast_to(anchor[:1], anchor.shape))
