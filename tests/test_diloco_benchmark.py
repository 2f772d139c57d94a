"""The DiLoCo benchmark's bookkeeping, without training: its optimizers as the training loop
builds them, and the claims recomputed from the per-optimizer numbers."""

import numpy as np
import pytest

import optax_zero_one as ozo
from benchmarks import diloco as bench
from benchmarks.support import training


@pytest.mark.parametrize("name", training.LOCO)
def test_the_family_is_diloco_with_its_schedule(name):
    cfg = bench.PRESETS["full"].config(name, 1500, 4e-3, 0, 150)
    spec = training.make_spec(name, cfg)
    assert not spec.average_grads  # local gradients: the optimizer communicates itself
    kinds = spec.schedule.indices(cfg.steps)
    syncs = np.flatnonzero(kinds == ozo.STEP_KINDS.index("sync")) + 1
    np.testing.assert_array_equal(syncs, np.arange(cfg.sync_every, cfg.steps + 1, cfg.sync_every))
    assert set(np.unique(kinds)) == {ozo.STEP_KINDS.index("local"), ozo.STEP_KINDS.index("sync")}


def _row(loss, sent):
    return {"final_val_loss_mean": loss, "bytes_per_worker": sent}


def test_summary_recomputes_the_claims():
    per_opt = {
        "adamw": _row(1.50, 1000.0),
        "zero_one_adam": _row(1.52, 30.0),
        "diloco_float": _row(1.51, 20.0),
        "diloco_1bit": _row(1.53, 0.6),
        "muloco_1bit": _row(float("nan"), 0.6),  # diverged: never the best
    }
    s = bench.summarize(per_opt)
    assert s["diloco_1bit_gap_to_diloco_float_pct"] == pytest.approx(100 * (1.53 / 1.51 - 1), 1e-3)
    assert s["diloco_1bit_bytes_reduction_vs_float_pct"] == pytest.approx(97.0)
    assert s["best_of_family"] == "diloco_float"
    assert s["best_gap_to_adamw_pct"] == pytest.approx(100 * (1.51 / 1.50 - 1), abs=1e-3)
    assert s["best_bytes_reduction_vs_adamw_pct"] == pytest.approx(98.0)
    assert s["best_bytes_vs_zero_one_adam"] == pytest.approx(20 / 30, abs=1e-4)
    assert s["claims"] == {
        "diloco_1bit_within_2pct_of_float": True,
        "diloco_1bit_95pct_fewer_bytes": True,
        "best_within_2pct_of_adamw": True,
        "best_99_5pct_fewer_bytes_than_adamw": False,
    }
