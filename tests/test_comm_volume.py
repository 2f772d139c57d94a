"""benchmarks.comm_volume on a tiny tree and a short run, against counts derived by hand.

This file tests the script ``benchmarks/comm_volume.py`` itself (its accounting, classes,
limits and projections), on purpose; the programs it counts are compiled and read by
``benchmarks/support/common.py``, as in every benchmark.

The schedule (kappa = 2, F = 41, alpha = 10, H = 4, 68 steps) is small enough to list: variance
steps 1, 2, 4, 6, 8, 12, 16, 24, 32; syncs every step 42..51 (interval 1 for alpha = 10 steps),
then every 2nd step to 60, then every 4th: 64, 68. The bytes of a float and of a 1-bit step are
written out from docs/algorithm.md (ring all-reduce; padding to 8 N; 4-byte scales), not
taken from the library, so that neither the HLO reading nor the accounting can drift.
"""

import math

import numpy as np
import pytest

from benchmarks import comm_volume as cv

N = 4
SHAPES = [(40, 24), (24,), (7,)]
SIZES = [math.prod(s) for s in SHAPES]
NUMEL, LEAVES = sum(SIZES), len(SIZES)
SCHEDULE = cv.Schedule(
    steps=68,
    onebit_freeze_step=30,
    var_freeze_step=41,
    var_update_scaler=2,
    local_step_scaler=10,
    local_step_clipper=4,
)
VARIANCE_STEPS = [1, 2, 4, 6, 8, 12, 16, 24, 32]
SYNC_STEPS = [*range(42, 52), 52, 54, 56, 58, 60, 64, 68]
COUNTS = {
    cv.ADAM: {"step": 68},
    cv.ONEBIT: {"warmup": 30, "compressed": 38},
    cv.ZERO_ONE: {"variance": 9, "compressed": 32, "local": 10, "sync": 17},
}


def float_step_bytes(n, padded=False):
    """A ring all-reduce of float32: of every element (Adam), or of the optimizers' flat buffer,
    each leaf padded to a multiple of 8 N (1-bit and 0/1 Adam average it as it is)."""
    unit = 8 * n
    count = sum(-(-s // unit) * unit for s in SIZES) if padded else NUMEL
    return 2 * (n - 1) / n * 4 * count


def one_bit_step_bytes(n):
    unit = 8 * n
    padded = [-(-s // unit) * unit for s in SIZES]
    all_to_all = (n - 1) / n * (sum(padded) // 8 + n * 4 * LEAVES)
    all_gather = (n - 1) * (sum(padded) // n // 8 + 4 * LEAVES)
    return all_to_all + all_gather


@pytest.fixture(scope="module")
def accountant():
    import jax
    import jax.numpy as jnp

    params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES]
    return cv.Accountant(params, SCHEDULE, progress=lambda line: None)


def test_step_kinds_follow_the_policies():
    kinds = cv.step_kinds(SCHEDULE)
    zero_one = kinds[cv.ZERO_ONE]
    names = cv.KIND_NAMES[cv.ZERO_ONE]
    assert (np.flatnonzero(zero_one == names.index("variance")) + 1).tolist() == VARIANCE_STEPS
    assert (np.flatnonzero(zero_one == names.index("sync")) + 1).tolist() == SYNC_STEPS
    assert (np.flatnonzero(zero_one == names.index("compressed")) + 1).max() == 41
    assert (np.flatnonzero(kinds[cv.ONEBIT] == 1) + 1).tolist() == list(range(31, 69))
    assert cv.kind_counts(kinds) == COUNTS


def test_volume_rounds_and_launches_match_hand_counts(accountant):
    per_kind = accountant.per_kind(N)
    for (opt, kind), stats in per_kind.items():
        assert stats.comm_class == cv.EXPECTED[(opt, kind)], (opt, kind, stats)
    f, fp, c = float_step_bytes(N), float_step_bytes(N, padded=True), one_bit_step_bytes(N)
    rows = cv.summarize(COUNTS, per_kind, LEAVES, NUMEL)

    assert rows[cv.ADAM]["bytes_per_worker"] == pytest.approx(68 * f)
    assert rows[cv.ONEBIT]["bytes_per_worker"] == pytest.approx(30 * fp + 38 * c)
    assert rows[cv.ZERO_ONE]["bytes_per_worker"] == pytest.approx(9 * fp + (32 + 17) * c)
    assert [rows[o]["rounds"] for o in cv.OPTIMIZERS] == [68, 68, 9 + 32 + 17]
    # one all-reduce per float step (3 small leaves fuse into one), two per 1-bit step
    assert [rows[o]["collective_launches"] for o in cv.OPTIMIZERS] == [68, 30 + 2 * 38, 9 + 2 * 49]
    assert rows[cv.ZERO_ONE]["deepspeed_launches"] == {
        "fp32_per_tensor": 9 + 4 * LEAVES * 49,
        "fp16_1_group": 9 + 4 * 49,
        "fp16_2_groups": 9 + 8 * 49,
    }
    expected = 1 - (9 * fp + 49 * c) / (30 * fp + 38 * c)
    assert rows[cv.ZERO_ONE]["reduction_vs_onebit"]["bytes_per_worker"] == pytest.approx(expected)
    assert rows[cv.ZERO_ONE]["reduction_vs_onebit"]["rounds"] == pytest.approx(1 - 58 / 68)

    check = cv.limit_check(per_kind[(cv.ONEBIT, "compressed")].sent_bytes, SIZES, N)
    assert check["explained"]
    assert check["limit_bytes"] == pytest.approx(2 * (N - 1) / N * NUMEL / 8)


def test_every_kind_at_a_larger_n_sends_what_the_formulas_say(accountant):
    for (opt, kind), stats in accountant.per_kind(2 * N).items():
        want = {
            cv.FLOAT: float_step_bytes(2 * N, padded=opt != cv.ADAM),
            cv.ONE_BIT: one_bit_step_bytes(2 * N),
        }
        assert stats.sent_bytes == pytest.approx(want.get(cv.EXPECTED[(opt, kind)], 0.0))


def test_fast_compile_reads_the_same_collectives(accountant):
    fast = accountant.per_kind(N)[(cv.ZERO_ONE, "sync")]
    full = cv.compile_kind(cv.ZERO_ONE, "sync", SYNC_STEPS[0], accountant.params, N, SCHEDULE, None)
    assert full.collectives == fast.collectives and full.comm_class == cv.ONE_BIT


def test_projection_is_compute_plus_bytes_over_bandwidth(accountant):
    per_kind = accountant.per_kind(N)
    network = [("1 GB/s, no latency", 8.0, 0.0)]
    proj = cv.project(COUNTS, per_kind, N, 0.25, network)["1 GB/s, no latency"]
    f, fp, c = float_step_bytes(N), float_step_bytes(N, padded=True), one_bit_step_bytes(N)
    assert proj["mean_step_s"][cv.ZERO_ONE] == pytest.approx(0.25 + (9 * fp + 49 * c) / 1e9 / 68)
    assert proj["mean_step_s"][cv.ADAM] == pytest.approx(0.25 + f / 1e9)


def test_hierarchical_programs_send_what_the_formulas_say(accountant):
    """On 2 nodes x 4 workers: the classes, and the bytes over each axis from docs/hierarchical.md
    (the layout's width C for all 8 workers; S = 2 nodes, L = 4 workers per node)."""
    s, per_node, n = 2, 4, 8
    unit = 8 * n
    width = sum(-(-size // unit) * unit for size in SIZES) // n  # C (blocks of 8 add nothing)
    reply = width // 8 + 4 * LEAVES  # one server's packed chunk and its scales
    want = {
        cv.FLOAT_H: {
            "local": (per_node - 1) / per_node * 4 * n * width + (per_node - 1) * 4 * s * width,
            "node": 2 * (s - 1) / s * 4 * s * width,
        },
        cv.ONE_BIT_H: {
            "local": (per_node - 1) / per_node * 4 * n * width + (per_node - 1) * s * reply,
            "node": (s - 1) / s * s * reply + (s - 1) * reply,
        },
    }
    per_kind = accountant.per_kind((s, per_node))
    for (opt, kind), stats in per_kind.items():
        assert stats.comm_class == cv.expected_class(opt, kind, (s, per_node)), (opt, kind)
        by_axes = {}
        for c in stats.collectives:
            by_axes[c["axes"]] = by_axes.get(c["axes"], 0.0) + c["sent_bytes"]
        if stats.comm_class in want:
            assert by_axes == pytest.approx(want[stats.comm_class]), (opt, kind)
    rows = cv.hierarchical(
        COUNTS, accountant.per_kind(n), per_kind, n, 0.0, [("x", (8, 0), (8, 0))]
    )
    zero_one = rows[cv.ZERO_ONE]
    assert zero_one["across_nodes_bytes_per_worker"] == pytest.approx(
        9 * want[cv.FLOAT_H]["node"] + 49 * want[cv.ONE_BIT_H]["node"]
    )
    assert zero_one["rounds_across_nodes"] == 9 + 49
