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


def test_a_probe_changes_the_config_fields_it_names():
    assert bench._override("outer_momentum=0.8") == ("outer_momentum", 0.8)
    with pytest.raises(ValueError, match="key=value"):
        bench._override("outer_momentum")
    # a misspelt field stops the probe before it trains anything
    with pytest.raises(SystemExit, match="no config field outer_momentun"):
        bench.probe("diloco_1bit", 4e-3, {"outer_momentun": 0.8})
    # values arrive as floats: an integer field gets an int, or a clear error
    cfg = bench.PRESETS["long"].config("diloco_1bit", 1200, 4e-3, 0, 100)
    assert type(bench._as_field(cfg, "sync_every", 25.0)) is int
    assert type(bench._as_field(cfg, "outer_momentum", 1.0)) is float
    with pytest.raises(SystemExit, match="sync_every is an integer field"):
        bench._as_field(cfg, "sync_every", 2.5)


def test_the_outer_momentum_sweep_trains_the_value_it_names(tmp_path):
    from benchmarks import diloco_outer

    source = {"optimizers": {"diloco_1bit": {"best_lr": 4e-3}}}
    runner = diloco_outer.Runner(source, tmp_path / "out.json", False, "outer_momentum")
    cfg = runner.config("diloco_1bit", 1200, 0, 0.8)
    assert (cfg.outer_momentum, cfg.peak_lr, cfg.outer_lr) == (0.8, 4e-3, 0.7)
    assert diloco_outer.best_value({0.8: 2.05, 0.9: 2.12, 0.95: 2.2}, 0.9) == 0.8
    assert diloco_outer.best_value({0.8: 2.1, 0.9: 2.1}, 0.9) == 0.9  # a tie keeps the paper's
    assert training.make_spec("diloco_1bit", cfg).name == "diloco_1bit"
