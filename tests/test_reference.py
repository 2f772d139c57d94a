"""Tests of the NumPy reference (``tests/support/reference.py``) against facts derivable by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.reference import (
    CompressedMean,
    OnebitAdam,
    ZeroOneAdam,
    padded_size,
    sync_steps,
    variance_steps,
)

# --------------------------------------------------------------------------------------
# Helpers.


def random_grads(rng, shapes, num_workers):
    return [[rng.normal(size=s) for s in shapes] for _ in range(num_workers)]


def hand_adam(x0, grads, lr_fn, b1, b2, eps, wd, variance_update=lambda k: True):
    """Adam without bias correction, decoupled weight decay, on a single flat array.

    ``variance_update(k)`` says whether ``v`` is updated at step ``k``; ``m`` always is.
    Returns the trajectory of ``(x, m, v)`` after each step.
    """
    x = np.array(x0, dtype=np.float64)
    m = np.zeros_like(x)
    v = np.zeros_like(x)
    out = []
    for k, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        if variance_update(k):
            v = b2 * v + (1 - b2) * g * g
        x = x - lr_fn(k - 1) * (m / (np.sqrt(v) + eps) + wd * x)
        out.append((x.copy(), m.copy(), v.copy()))
    return out


def padded(a, p):
    flat = np.asarray(a, dtype=np.float64).reshape(-1)
    return np.concatenate([flat, np.zeros(p - flat.size)])


# --------------------------------------------------------------------------------------
# padded_size.


@pytest.mark.parametrize(
    ("n", "num_workers", "expected"),
    [
        (0, 1, 0),
        (0, 3, 0),
        (1, 1, 8),
        (8, 1, 8),
        (9, 1, 16),
        (1, 2, 16),
        (16, 2, 16),
        (17, 2, 32),
        (1, 3, 24),  # 8 * 3 (DeepSpeed: 3 * lcm(3, 8) = 72)
        (73, 3, 96),
        (5, 4, 32),
        (33, 4, 64),
        (1, 8, 64),
        (1, 16, 128),  # 8 * 16 (DeepSpeed: 16 * lcm(16, 8) = 256)
        (257, 16, 384),
        (1, 6, 48),  # 8 * 6 (DeepSpeed: 6 * lcm(6, 8) = 144)
    ],
)
def test_padded_size(n, num_workers, expected):
    assert padded_size(n, num_workers) == expected


# --------------------------------------------------------------------------------------
# Schedules.


def test_variance_steps_spec_example():
    assert variance_steps(41, 2, 1000) == [1, 2, 4, 6, 8, 12, 16, 24, 32]
    # Cut by num_steps, and by F.
    assert variance_steps(41, 2, 10) == [1, 2, 4, 6, 8]
    assert variance_steps(12, 2, 1000) == [1, 2, 4, 6, 8, 12]
    assert variance_steps(11, 2, 1000) == [1, 2, 4, 6, 8]


def test_variance_steps_default_scaler():
    # kappa = 16: gap 1 for 16 steps, then gap 2 for 16 more, then gap 4.
    expected = list(range(1, 17)) + list(range(18, 49, 2)) + [52, 56, 60]
    assert variance_steps(100_000, 16, 60) == expected


def test_sync_steps_spec_example():
    first = list(range(42, 53)) + [54, 56, 58, 60, 64, 68]
    assert sync_steps(41, 10, 4, 70) == first
    # The interval is clipped at H = 4 from then on.
    assert sync_steps(41, 10, 4, 100) == first + [72, 76, 80, 84, 88, 92, 96, 100]
    assert sync_steps(41, 10, 4, 41) == []


def test_sync_steps_absolute_step():
    # F = 4, alpha = 1, H = 4: interval 1 at k=5, 2 at k=6, 4 from k=7. Syncs on multiples of
    # the interval of the absolute step number: 5, 6, 8, 12, ...
    assert sync_steps(4, 1, 4, 20) == [5, 6, 8, 12, 16, 20]
    assert sync_steps(3, 1, 4, 20) == [4, 8, 12, 16, 20]


def test_zero_one_adam_step_kinds_follow_schedules():
    rng = np.random.default_rng(0)
    shapes = [(3,), (2, 2)]
    num_steps, f = 100, 41
    opt = ZeroOneAdam(
        [np.zeros(s) for s in shapes],
        num_workers=2,
        learning_rate=1e-3,
        var_freeze_step=f,
        var_update_scaler=2,
        local_step_scaler=10,
        local_step_clipper=4,
    )
    kinds = {}
    for _ in range(num_steps):
        opt.step(random_grads(rng, shapes, 2))
        kinds[opt.step_count] = opt.last_kind
    assert opt.step_count == num_steps
    variance = variance_steps(f, 2, num_steps)
    syncs = sync_steps(f, 10, 4, num_steps)
    for k in range(1, num_steps + 1):
        if k <= f:
            assert kinds[k] == ("variance" if k in variance else "compressed"), k
        else:
            assert kinds[k] == ("sync" if k in syncs else "local"), k
    # Counters, by hand: variance steps 16 (c=1), 24 (c=2 -> interval 16), 32 (c=1).
    assert (opt.var_interval, opt.var_counter) == (16, 1)
    # 59 phase-B steps: interval 1 -> 2 -> 4 -> 4 -> 4 -> 4 after 10, 20, ..., 50; 9 left.
    assert (opt.local_interval, opt.local_counter) == (4, 9)


# --------------------------------------------------------------------------------------
# The compressed mean C.


def test_compressed_mean_hand_example_padding_and_zero_sign():
    # N = 2, n = 3 -> P = 16. a = [1, 1, 1, 0 x 13]; s = sqrt(3) / sqrt(16); zeros map to +1
    # so every sign is +1. Each server chunk (8 entries) is c = s everywhere, so t = s and
    # the server error is zero. The output is s on every entry.
    comp = CompressedMean([(3,)], num_workers=2)
    z = np.ones(3)
    (out,) = comp([[z], [z]])
    s = math.sqrt(3) / 4
    np.testing.assert_allclose(out, np.full(3, s), rtol=1e-15)
    expected_e_w = np.concatenate([np.full(3, 1 - s), np.full(13, -s)])
    for i in range(2):
        np.testing.assert_allclose(comp.worker_error[i][0], expected_e_w, rtol=1e-15)
        assert comp.worker_error[i][0].shape == (16,)
        assert comp.server_error[i][0].shape == (8,)
        np.testing.assert_allclose(comp.server_error[i][0], 0.0, atol=1e-16)


def test_compressed_mean_hand_example_error():
    # N = 2, n = 16: z = [4, 0 x 15] on both workers. ||a|| = 4, s = 4 / 4 = 1, signs all
    # +1, e_w = [3, -1 x 15]. c = 1 everywhere, output = ones, e_s = 0.
    comp = CompressedMean([(16,)], num_workers=2)
    z = np.zeros(16)
    z[0] = 4.0
    (out,) = comp([[z], [z]])
    np.testing.assert_array_equal(out, np.ones(16))
    expected = -np.ones(16)
    expected[0] = 3.0
    for i in range(2):
        np.testing.assert_array_equal(comp.worker_error[i][0], expected)
        np.testing.assert_array_equal(comp.server_error[i][0], np.zeros(8))
    # Second call with zero input: a = e_w = [3, -1 x 15]; s = sqrt(24/16); the server sees
    # c = s * sign(a), chunk 0 = [s, -s x 7], chunk 1 = [-s x 8].
    (out2,) = comp([[np.zeros(16)], [np.zeros(16)]])
    s = math.sqrt(24 / 16)
    expected_out = -s * np.ones(16)
    expected_out[0] = s
    np.testing.assert_allclose(out2, expected_out, rtol=1e-15)


def test_compressed_mean_exact_on_scaled_signs():
    # Worker inputs that are scalar multiples of one full-length sign vector: every
    # compression is lossless and the output is the exact mean, with zero errors.
    rng = np.random.default_rng(1)
    n = padded_size(1, 2)
    b = np.where(rng.normal(size=n) >= 0, 1.0, -1.0)
    comp = CompressedMean([(n,)], num_workers=2)
    (out,) = comp([[2.0 * b], [-1.0 * b]])
    np.testing.assert_array_equal(out, 0.5 * b)
    for i in range(2):
        np.testing.assert_array_equal(comp.worker_error[i][0], np.zeros(n))
        np.testing.assert_array_equal(comp.server_error[i][0], np.zeros(n // 2))


def test_compressed_mean_server_chunks():
    # N = 2, P = 16. Worker 0 sends [+1 x 8, -1 x 8] * 1, worker 1 sends [+1 x 16] * 3. Chunk 0
    # mean: (1 + 3)/2 = 2 everywhere; chunk 1: (-1 + 3)/2 = 1 everywhere. Each server scale is
    # the RMS of its own chunk (sqrt(P/N)), so the output is exact: [2 x 8, 1 x 8].
    comp = CompressedMean([(16,)], num_workers=2)
    z0 = np.concatenate([np.ones(8), -np.ones(8)])
    z1 = 3.0 * np.ones(16)
    (out,) = comp([[z0], [z1]])
    np.testing.assert_array_equal(out, np.concatenate([np.full(8, 2.0), np.full(8, 1.0)]))
    np.testing.assert_array_equal(comp.server_error[0][0], np.zeros(8))
    np.testing.assert_array_equal(comp.server_error[1][0], np.zeros(8))


@pytest.mark.parametrize("num_workers", [2, 3, 4])
def test_compressed_mean_error_feedback_identity(num_workers):
    rng = np.random.default_rng(num_workers)
    shapes = [(5,), (2, 3), (), (0,), (100,), (3, 0)]
    comp = CompressedMean(shapes, num_workers)
    sizes = [math.prod(s) for s in shapes]
    ps = [padded_size(n, num_workers) for n in sizes]
    sum_out = [np.zeros(p) for p in ps]
    sum_mean = [np.zeros(p) for p in ps]
    for call in range(200):
        # Vary the scale so errors are not all of one size.
        zs = [[(1 + call % 7) * rng.normal(size=s) for s in shapes] for _ in range(num_workers)]
        outs = comp(zs)
        for leaf, (shape, n, p) in enumerate(zip(shapes, sizes, ps, strict=True)):
            assert outs[leaf].shape == shape
            assert outs[leaf].dtype == np.float64
            worker_outs = [comp.last_padded_outputs[i][leaf] for i in range(num_workers)]
            for w in worker_outs:
                assert w.shape == (p,)
                np.testing.assert_array_equal(w, worker_outs[0])
            np.testing.assert_array_equal(outs[leaf].reshape(-1), worker_outs[0][:n])
            sum_out[leaf] += worker_outs[0]
            sum_mean[leaf] += sum(padded(zs[i][leaf], p) for i in range(num_workers)) / num_workers
        for leaf, p in enumerate(ps):
            mean_e_w = sum(comp.worker_error[i][leaf] for i in range(num_workers)) / num_workers
            e_s = np.concatenate([comp.server_error[j][leaf] for j in range(num_workers)])
            assert e_s.shape == (p,)
            np.testing.assert_allclose(
                sum_out[leaf], sum_mean[leaf] - mean_e_w - e_s, rtol=0, atol=1e-11
            )
    # The identity is not vacuous: the error buffers are non-zero, and the compressed sum
    # differs from the true sum.
    assert np.abs(comp.worker_error[0][4]).max() > 1e-3
    assert np.abs(comp.server_error[0][4]).max() > 1e-3
    assert np.abs(sum_out[4] - sum_mean[4]).max() > 1e-3


def test_compressed_mean_single_worker_is_identity():
    rng = np.random.default_rng(2)
    shapes = [(5,), (2, 3), (), (0,)]
    comp = CompressedMean(shapes, 1)
    for _ in range(5):
        zs = random_grads(rng, shapes, 1)
        outs = comp(zs)
        for z, o in zip(zs[0], outs, strict=True):
            np.testing.assert_array_equal(o, z)
            assert o.shape == z.shape
    for e in comp.worker_error[0] + comp.server_error[0]:
        np.testing.assert_array_equal(e, np.zeros_like(e))


def test_compressed_mean_reset():
    rng = np.random.default_rng(3)
    comp = CompressedMean([(10,)], 3)
    comp(random_grads(rng, [(10,)], 3))
    assert np.abs(comp.worker_error[1][0]).max() > 0
    comp.reset()
    for i in range(3):
        np.testing.assert_array_equal(comp.worker_error[i][0], np.zeros(24))  # 8 * 3
        np.testing.assert_array_equal(comp.server_error[i][0], np.zeros(8))


# --------------------------------------------------------------------------------------
# Single worker: the optimizers reduce to hand-written Adam variants.

SHAPES = [(4,), (2, 3), ()]


def _params(rng):
    return [rng.normal(size=s) for s in SHAPES]


def _check_against_hand(opt, params, grads, lr_fn, variance_update, wd, b1=0.9, b2=0.999):
    for leaf in range(len(SHAPES)):
        traj = hand_adam(
            params[leaf], [g[0][leaf] for g in grads], lr_fn, b1, b2, 1e-8, wd, variance_update
        )
        x, m, v = traj[-1]
        np.testing.assert_allclose(opt.x[0][leaf], x, rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(opt.m[0][leaf], m, rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(opt.v[0][leaf], v, rtol=1e-13, atol=1e-15)


def schedule(count):
    return 1e-2 / (1 + 0.1 * count)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_zero_one_adam_single_worker_is_adam(wd):
    rng = np.random.default_rng(4)
    params = _params(rng)
    opt = ZeroOneAdam(
        params, 1, schedule, weight_decay=wd, var_freeze_step=10**9, var_update_scaler=10**9
    )
    grads = []
    for _ in range(30):
        grads.append(random_grads(rng, SHAPES, 1))
        opt.step(grads[-1])
        assert opt.last_kind == "variance"
        _check_against_hand(opt, params, grads, schedule, lambda k: True, wd)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_onebit_adam_single_worker_is_adam(wd):
    rng = np.random.default_rng(5)
    params = _params(rng)
    opt = OnebitAdam(params, 1, schedule, weight_decay=wd, freeze_step=10**9)
    grads = []
    for _ in range(30):
        grads.append(random_grads(rng, SHAPES, 1))
        opt.step(grads[-1])
        assert opt.last_kind == "warmup"
        _check_against_hand(opt, params, grads, schedule, lambda k: True, wd)


def test_zero_one_adam_single_worker_compressed_steps_use_gradient():
    # With N = 1, C is the identity: compressed steps update m with g and leave v alone.
    rng = np.random.default_rng(6)
    params = _params(rng)
    opt = ZeroOneAdam(params, 1, schedule, weight_decay=0.05, var_update_scaler=2)
    variance = {1, 2, 4, 6, 8, 12, 16, 24}
    grads = []
    for k in range(1, 26):
        grads.append(random_grads(rng, SHAPES, 1))
        opt.step(grads[-1])
        assert opt.last_kind == ("variance" if k in variance else "compressed")
        _check_against_hand(opt, params, grads, schedule, lambda j: j in variance, 0.05)


def test_onebit_adam_single_worker_frozen_variance():
    rng = np.random.default_rng(7)
    params = _params(rng)
    opt = OnebitAdam(params, 1, schedule, weight_decay=0.05, freeze_step=3)
    grads = []
    for k in range(1, 16):
        grads.append(random_grads(rng, SHAPES, 1))
        opt.step(grads[-1])
        assert opt.last_kind == ("warmup" if k <= 3 else "compressed")
        _check_against_hand(opt, params, grads, schedule, lambda j: j <= 3, 0.05)


def test_zero_one_adam_single_worker_sync_every_step_is_frozen_adam():
    # N = 1, wd = 0, interval 1 forever: each sync gives back m (= lr m / lr) and x, so
    # phase B is Adam with frozen variance (up to rounding of x + u - u).
    rng = np.random.default_rng(8)
    params = _params(rng)
    f = 5
    opt = ZeroOneAdam(
        params, 1, schedule, var_freeze_step=f, var_update_scaler=10**9, local_step_scaler=10**9
    )
    grads = []
    for k in range(1, 21):
        grads.append(random_grads(rng, SHAPES, 1))
        opt.step(grads[-1])
        assert opt.last_kind == ("variance" if k <= f else "sync")
    for leaf in range(len(SHAPES)):
        x, m, v = hand_adam(
            params[leaf],
            [g[0][leaf] for g in grads],
            schedule,
            0.9,
            0.999,
            1e-8,
            0.0,
            lambda j: j <= f,
        )[-1]
        np.testing.assert_allclose(opt.x[0][leaf], x, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(opt.m[0][leaf], m, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(opt.v[0][leaf], v, rtol=1e-15)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_zero_one_adam_single_worker_sync_averages_momentum(wd):
    # N = 1, F = 3, alpha = 1, H = 4: syncs at 4, 8, 12, 16, 20. At a sync, x is unchanged
    # (x + u - u) and m becomes the lr-weighted mean of the interval's update directions
    # times (sqrt(v) + eps); with wd = 0 that is the lr-weighted mean of the momenta.
    rng = np.random.default_rng(9)
    params = _params(rng)
    f, b1, b2, eps = 3, 0.9, 0.999, 1e-8
    opt = ZeroOneAdam(
        params,
        1,
        schedule,
        weight_decay=wd,
        var_freeze_step=f,
        local_step_scaler=1,
        local_step_clipper=4,
    )
    syncs = [4, 8, 12, 16, 20]
    assert sync_steps(f, 1, 4, 20) == syncs
    x = [np.array(p) for p in params]
    m = [np.zeros(s) for s in SHAPES]
    v = [np.zeros(s) for s in SHAPES]
    u = [np.zeros(s) for s in SHAPES]
    mom_sum = [np.zeros(s) for s in SHAPES]
    lrs = 0.0
    for k in range(1, 21):
        g = random_grads(rng, SHAPES, 1)
        opt.step(g)
        lr = schedule(k - 1)
        for leaf in range(len(SHAPES)):
            m[leaf] = b1 * m[leaf] + (1 - b1) * g[0][leaf]
            if k <= f:
                v[leaf] = b2 * v[leaf] + (1 - b2) * g[0][leaf] ** 2
            d = m[leaf] / (np.sqrt(v[leaf]) + eps) + wd * x[leaf]
            x[leaf] = x[leaf] - lr * d
            if k > f:
                u[leaf] += lr * d
                mom_sum[leaf] += lr * m[leaf]
        if k > f:
            lrs += lr
        if k in syncs:
            assert opt.last_kind == "sync"
            for leaf in range(len(SHAPES)):
                m[leaf] = u[leaf] * (np.sqrt(v[leaf]) + eps) / lrs
                if wd == 0.0:
                    np.testing.assert_allclose(m[leaf], mom_sum[leaf] / lrs, rtol=1e-9)
                u[leaf] = np.zeros_like(u[leaf])
                mom_sum[leaf] = np.zeros_like(mom_sum[leaf])
            lrs = 0.0
        else:
            assert opt.last_kind == ("variance" if k <= f else "local")
        for leaf in range(len(SHAPES)):
            np.testing.assert_allclose(opt.x[0][leaf], x[leaf], rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(opt.m[0][leaf], m[leaf], rtol=1e-9, atol=1e-14)
            np.testing.assert_allclose(opt.u[0][leaf], u[leaf], rtol=1e-12, atol=1e-14)
        assert opt.lrs[0] == pytest.approx(lrs, rel=1e-14)


def test_learning_rate_schedule_gets_count():
    counts = []

    def lr(count):
        counts.append(count)
        return 1e-3

    for opt in (
        ZeroOneAdam([np.zeros(3)], 2, lr, var_freeze_step=3, var_update_scaler=1),
        OnebitAdam([np.zeros(3)], 2, lr, freeze_step=2),
    ):
        counts.clear()
        for _ in range(6):
            opt.step([[np.ones(3)], [np.ones(3)]])
        assert counts == [0, 1, 2, 3, 4, 5]
        assert opt.step_count == 6


# --------------------------------------------------------------------------------------
# Several workers.


def test_zero_one_adam_workers_agree_after_sync_and_phase_a():
    rng = np.random.default_rng(10)
    num_workers, shapes = 4, [(7,), (3, 5), (), (0,)]
    params = [rng.normal(size=s) for s in shapes]
    opt = ZeroOneAdam(
        params,
        num_workers,
        schedule,
        weight_decay=0.01,
        var_freeze_step=12,
        var_update_scaler=2,
        local_step_scaler=3,
        local_step_clipper=4,
    )
    seen = set()
    local_differ = False
    for _ in range(40):
        opt.step(random_grads(rng, shapes, num_workers))
        kind = opt.last_kind
        seen.add(kind)
        for i in range(1, num_workers):
            for leaf in range(len(shapes)):
                np.testing.assert_array_equal(opt.v[i][leaf], opt.v[0][leaf])
                if kind in ("variance", "compressed"):
                    np.testing.assert_array_equal(opt.x[i][leaf], opt.x[0][leaf])
                    np.testing.assert_array_equal(opt.m[i][leaf], opt.m[0][leaf])
                elif kind == "sync":
                    np.testing.assert_array_equal(opt.m[i][leaf], opt.m[0][leaf])
                    np.testing.assert_allclose(opt.x[i][leaf], opt.x[0][leaf], rtol=0, atol=1e-12)
                    np.testing.assert_array_equal(opt.u[i][leaf], np.zeros(shapes[leaf]))
                elif leaf == 0 and not np.array_equal(opt.x[i][leaf], opt.x[0][leaf]):
                    local_differ = True
        if kind == "sync":
            assert opt.lrs == [0.0] * num_workers
    assert seen == {"variance", "compressed", "local", "sync"}
    assert local_differ  # local steps with different gradients do diverge


def test_zero_one_adam_local_step_uses_local_gradient():
    # F = 4, alpha = 1, H = 2: syncs at 5, 6, 8, ...; step 7 is a local step.
    rng = np.random.default_rng(11)
    shapes = [(6,)]
    wd, lr = 0.1, 0.01
    opt = ZeroOneAdam(
        [rng.normal(size=(6,))],
        2,
        lr,
        weight_decay=wd,
        var_freeze_step=4,
        local_step_scaler=1,
        local_step_clipper=2,
    )
    for _ in range(6):
        opt.step(random_grads(rng, shapes, 2))
    assert opt.last_kind == "sync"
    before_x = [np.array(opt.x[i][0]) for i in range(2)]
    before_m = [np.array(opt.m[i][0]) for i in range(2)]
    v = opt.v[0][0].copy()
    g = random_grads(rng, shapes, 2)
    opt.step(g)
    assert opt.last_kind == "local"
    for i in range(2):
        m = 0.9 * before_m[i] + 0.1 * g[i][0]
        d = m / (np.sqrt(v) + 1e-8) + wd * before_x[i]
        np.testing.assert_allclose(opt.m[i][0], m, rtol=1e-15)
        np.testing.assert_allclose(opt.x[i][0], before_x[i] - lr * d, rtol=1e-15)
        np.testing.assert_allclose(opt.u[i][0], lr * d, rtol=1e-15)
        assert opt.lrs[i] == lr
        np.testing.assert_array_equal(opt.v[i][0], v)
    assert not np.array_equal(opt.m[0][0], opt.m[1][0])


def test_zero_one_adam_error_buffers_reset_at_freeze():
    # kappa = 2, F = 5: variance steps 1, 2, 4; compressed steps 3, 5.
    rng = np.random.default_rng(12)
    shapes = [(9,)]
    opt = ZeroOneAdam(
        [np.zeros(9)], 2, 1e-3, var_freeze_step=5, var_update_scaler=2, local_step_scaler=10**9
    )

    def errors_zero():
        c = opt.compressor
        return all(not np.any(e) for i in range(2) for e in c.worker_error[i] + c.server_error[i])

    kinds = []
    for k in range(1, 7):
        opt.step(random_grads(rng, shapes, 2))
        kinds.append(opt.last_kind)
        if k in (3, 4):
            assert not errors_zero(), k
        if k == 5:
            assert errors_zero()
    assert kinds == ["variance", "variance", "compressed", "variance", "compressed", "sync"]
    assert not errors_zero()  # step 6 is a sync, which uses C again


def test_zero_one_adam_mask():
    rng = np.random.default_rng(13)
    shapes = [(8,)]
    mask = [np.array([1, 1, 0, 1, 0, 1, 1, 1], dtype=np.float64)]
    masked = mask[0] == 0
    opt = ZeroOneAdam(
        [rng.normal(size=(8,))],
        2,
        1e-2,
        var_freeze_step=6,
        var_update_scaler=2,
        local_step_scaler=2,
        local_step_clipper=4,
        mask=mask,
    )
    last_sync_x = None
    for _ in range(24):
        prev_m = opt.m[0][0].copy()
        grads = random_grads(rng, shapes, 2)
        opt.step(grads)
        m = opt.m[0][0]
        if opt.last_kind == "variance":
            # The float all-reduce is never masked.
            gbar = (grads[0][0] + grads[1][0]) / 2
            np.testing.assert_allclose(m[masked], 0.9 * prev_m[masked] + 0.1 * gbar[masked])
            assert np.all(m[masked] != 0)
        elif opt.last_kind == "compressed":
            np.testing.assert_array_equal(m[masked], 0.9 * prev_m[masked])
        elif opt.last_kind == "sync":
            np.testing.assert_array_equal(m[masked], 0.0)
            if last_sync_x is None:
                last_sync_x = opt.x[0][0].copy()  # first sync: x at the end of phase A
            else:
                # Masked entries come back to the previous synchronised point.
                np.testing.assert_allclose(opt.x[0][0][masked], last_sync_x[masked], atol=1e-14)
                assert np.any(opt.x[0][0][~masked] != last_sync_x[~masked])
                last_sync_x = opt.x[0][0].copy()
    assert opt.local_interval == 4


@pytest.mark.parametrize("num_workers", [2, 3])
def test_onebit_adam_workers_identical(num_workers):
    rng = np.random.default_rng(14)
    shapes = [(5,), (2, 2), ()]
    opt = OnebitAdam(
        [rng.normal(size=s) for s in shapes],
        num_workers,
        schedule,
        weight_decay=0.01,
        freeze_step=4,
    )
    for k in range(1, 15):
        opt.step(random_grads(rng, shapes, num_workers))
        assert opt.last_kind == ("warmup" if k <= 4 else "compressed")
        for i in range(1, num_workers):
            for leaf in range(len(shapes)):
                np.testing.assert_array_equal(opt.x[i][leaf], opt.x[0][leaf])
                np.testing.assert_array_equal(opt.m[i][leaf], opt.m[0][leaf])
                np.testing.assert_array_equal(opt.v[i][leaf], opt.v[0][leaf])


def test_onebit_adam_compressed_step_hand():
    # N = 2, T = 0, one leaf of length 16, momentum starts at zero. Worker gradients
    # 10 * [+1 x 8, -1 x 8] and 10 * [+1 x 16]: local momenta are those times (1 - b1) = 1,
    # and C of them is exactly [1 x 8, 0 x 8] (chunk 0: (1 + 1)/2, chunk 1: (-1 + 1)/2,
    # whose server scale is 0). The mask zeroes entry 0.
    mask = [np.ones(16)]
    mask[0][0] = 0.0
    x0 = np.linspace(-1, 1, 16)
    opt = OnebitAdam([x0], 2, 0.5, b1=0.9, weight_decay=0.0, freeze_step=0, mask=mask)
    g0 = 10.0 * np.concatenate([np.ones(8), -np.ones(8)])
    g1 = 10.0 * np.ones(16)
    opt.step([[g0], [g1]])
    expected_m = np.concatenate([np.ones(8), np.zeros(8)])
    expected_m[0] = 0.0
    np.testing.assert_allclose(opt.m[0][0], expected_m, rtol=1e-14, atol=1e-15)
    # v is zero (never updated): a coordinate with no variance does not move by its momentum
    # (DeepSpeed's step would be x - lr m / eps, 5e7 here: docs/algorithm.md)
    np.testing.assert_array_equal(opt.x[0][0], x0)
