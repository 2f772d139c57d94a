"""The convergence benchmark end to end on a tiny model (a few steps), and its determinism.

This file tests the script ``benchmarks/convergence.py`` itself (its ``run``, ``table`` and
``write``), on purpose; the configuration and the training it runs come from
``benchmarks/support/training.py``.

The benchmark compiles each configuration's programs once per process; the reruns below reuse
them, so what they check is that data, initialisation and execution are reproducible.
"""

import dataclasses
import json
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `pytest` without `python -m`
    sys.path.insert(0, str(ROOT))

import optax_zero_one as ozo  # noqa: E402
from benchmarks import convergence as cv  # noqa: E402
from benchmarks.support import training  # noqa: E402

N = training.NUM_WORKERS
# 32 steps: LR warm-up 8 steps; F = 16 with kappa = 8 (variance steps 1-8, 10, 12, 14, 16;
# compressed 9, 11, 13, 15), then alpha = 4, H = 4: syncs at 17-20, 22, 24, 28, 32. (With
# kappa = 4 the first compressed steps, at initialisation, made this tiny model diverge.)
TINY = training.Config(
    model=(
        ("dim", 32),
        ("layers", 1),
        ("heads", 2),
        ("context", 16),
        ("batch_per_worker", 4),
        ("eval_windows", 64),
    ),
    steps=32,
    eval_every=8,
    peak_lr=2e-3,
    warmup=0.25,
    freeze=0.5,
    local_scaler=0.125,
    kappa=8,
    clipper=4,
)
RUN_FIELDS = {
    "final_val",
    "gap_to_adamw_pct",
    "bytes_per_worker",
    "bytes_per_worker_by_axes",
    "rounds",
    "rounds_by_axes",
    "steps_per_kind",
    "traffic_per_kind",
    "seconds",
    "train_loss",
    "val",
}


@pytest.fixture(scope="module")
def result():
    return cv.run(TINY, progress=False)


def test_end_to_end_loss_falls_and_json_has_the_documented_fields(result, tmp_path):
    json_path, png_path, md_path = cv.write(result, tmp_path, "convergence")
    data = json.loads(json_path.read_text())
    assert png_path.stat().st_size > 10_000
    assert "| zero_one_adam |" in md_path.read_text()
    assert set(data) == {
        "benchmark",
        "workload",
        "num_workers",
        "mesh",
        "config",
        "policies",
        "runs",
        "summary",
        "wall_seconds",
        "cpu_seconds",
    }
    assert data["num_workers"] == N and list(data["runs"]) == list(training.OPTIMIZERS)
    assert data["policies"]["variance_steps"] == [*range(1, 9), 10, 12, 14, 16]
    for name, run in data["runs"].items():
        assert set(run) == RUN_FIELDS, name
        by_axes = run["bytes_per_worker_by_axes"]  # one axis, "w": all of it
        assert sum(by_axes.values()) == pytest.approx(run["bytes_per_worker"]), name
        assert len(run["train_loss"]) == TINY.steps
        assert run["val"]["step"] == [0, 8, 16, 24, 32]
        assert set(run["val"]) == {"step", "bytes", "loss"}
        # the loss falls (from ln(vocab) ~ 4.6 at initialisation)
        assert run["val"]["loss"][-1] < run["val"]["loss"][0] - 0.3, name
        assert np.mean(run["train_loss"][-4:]) < np.mean(run["train_loss"][:4]) - 0.3, name
        assert sum(run["steps_per_kind"].values()) == TINY.steps
        # bytes = sum over kinds of (steps of that kind) x (bytes of one such step)
        traffic = run["traffic_per_kind"]
        total = sum(c * traffic[k]["bytes_per_step"] for k, c in run["steps_per_kind"].items())
        assert run["bytes_per_worker"] == pytest.approx(total)
        assert run["val"]["bytes"][-1] == pytest.approx(total)
        assert run["val"]["bytes"] == sorted(run["val"]["bytes"])

    adamw, onebit, zero_one = (data["runs"][k] for k in training.OPTIMIZERS)
    num_params = training.make_workload(TINY).num_params
    ring = 2 * 4 * num_params * (N - 1) / N  # float32 ring all-reduce of every parameter
    assert adamw["steps_per_kind"] == {"all-reduce": TINY.steps}
    assert adamw["traffic_per_kind"]["all-reduce"]["bytes_per_step"] == pytest.approx(ring)
    assert onebit["steps_per_kind"] == {"warmup": 16, "compressed": 16}
    assert zero_one["steps_per_kind"] == {"variance": 12, "compressed": 4, "local": 8, "sync": 8}
    # the optimizers average their flat buffer: each leaf padded to a multiple of N lcm(N, 8)
    layout = ozo.core.flat.Layout.of(training.make_workload(TINY).init_params(0), N)
    padded_ring = 2 * 4 * N * layout.width * (N - 1) / N
    assert ring <= padded_ring <= 1.1 * ring
    for run, kind in ((onebit, "warmup"), (zero_one, "variance")):
        assert run["traffic_per_kind"][kind]["bytes_per_step"] == pytest.approx(padded_ring)
    one_bit = 2 * (N - 1) / N * num_params / 8  # ~1 bit per element in each of two phases
    for run, kind in ((onebit, "compressed"), (zero_one, "compressed"), (zero_one, "sync")):
        traffic = run["traffic_per_kind"][kind]
        assert traffic["collectives"] == ["all-to-all[u8]", "all-gather[u8]"]
        assert one_bit <= traffic["bytes_per_step"] <= 1.6 * one_bit
    assert zero_one["traffic_per_kind"]["local"] == {
        "bytes_per_step": 0.0,
        "launches_per_step": 0,
        "collectives": [],
    }
    assert adamw["rounds"] == onebit["rounds"] == TINY.steps
    assert zero_one["rounds"] == TINY.steps - 8
    assert adamw["bytes_per_worker"] > onebit["bytes_per_worker"] > zero_one["bytes_per_worker"]
    summary = data["summary"]
    less = 1 - zero_one["bytes_per_worker"] / onebit["bytes_per_worker"]
    assert summary["zero_one_adam_bytes_reduction_vs_onebit_adam_pct"] == pytest.approx(
        100 * less, abs=0.01
    )
    assert adamw["gap_to_adamw_pct"] == 0
    assert "| zero_one_adam |" in cv.table(data)


def test_same_seed_same_losses_other_seed_other_losses(result):
    again = cv.run(TINY, progress=False)
    for name in training.OPTIMIZERS:
        assert again["runs"][name]["train_loss"] == result["runs"][name]["train_loss"], name
        assert again["runs"][name]["val"] == result["runs"][name]["val"], name
    other = cv.run(dataclasses.replace(TINY, seed=1, optimizers=("zero_one_adam",)), False)
    assert (
        other["runs"]["zero_one_adam"]["train_loss"]
        != result["runs"]["zero_one_adam"]["train_loss"]
    )


def test_two_by_four_mesh_compresses_across_nodes_only():
    """--mesh 2x4: 0/1 Adam with fast_axis_name, and the flat run beside it, per-axis bytes."""
    data = cv.run(dataclasses.replace(TINY, mesh=(2, 4), optimizers=("zero_one_adam",)), False)
    hier, flat = data["runs"]["zero_one_adam"], data["runs"]["zero_one_adam_flat"]
    assert data["mesh"] == {"node": 2, "local": 4}
    assert hier["steps_per_kind"] == flat["steps_per_kind"]
    by_axes = hier["bytes_per_worker_by_axes"]
    assert set(by_axes) == {"node", "local"}
    assert sum(by_axes.values()) == pytest.approx(hier["bytes_per_worker"])
    assert hier["rounds_by_axes"] == {"node": TINY.steps - 8, "local": TINY.steps - 8}
    # across nodes: the share of a 4-worker node, ~1/4 of what the flat optimizer sends there
    across, flat_across = (
        hier["val"]["bytes_across_nodes"][-1],
        flat["val"]["bytes_across_nodes"][-1],
    )
    assert across == pytest.approx(by_axes["node"])
    assert flat_across == pytest.approx(flat["bytes_per_worker"] * 4 / 7)
    assert 0.2 * flat_across < across < 0.3 * flat_across
    # the first 8 steps are variance steps: exact means, the same course up to rounding
    assert hier["val"]["step"][1] == 8
    assert hier["val"]["loss"][1] == pytest.approx(flat["val"]["loss"][1], rel=1e-4)
    assert "zero_one_adam_gap_to_flat_pct" in data["summary"]
    assert "MB across nodes" in cv.table(data)
