"""The long convergence study end to end on a tiny model: the protocol (sweep, best learning
rate, seeds), the statistics and the traffic, checked against independent recomputations.

This file tests the script ``benchmarks/convergence_long.py`` itself, on purpose; the training
it calls is ``benchmarks/support/training.py``'s."""

import dataclasses
import json

import numpy as np
import pytest
from test_convergence import TINY

import optax_zero_one as ozo
from benchmarks import convergence_long as cl
from benchmarks.support import training

# The tiny model and schedule of test_convergence.py. The sweep and the long runs have one
# length, so that the long runs reuse the sweep's compiled programs (one per optimizer and
# learning rate), and the long run of the sweep's seed must repeat the sweep's run at the best
# learning rate exactly.
STUDY = cl.Study(
    base=TINY,
    sweep_steps=40,
    long_steps=40,
    lrs=(1e-3, 3e-3),
    seeds=(0, 1),
    sweep_eval_every=20,
    long_eval_every=20,
    train_loss_block=8,
    max_extensions=0,
)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    result = cl.run(STUDY, out, "study", progress=False)
    return result, out


@pytest.mark.slow  # the study (~110 s): make test-slow, run by CI
def test_json_holds_the_protocol_s_numbers_per_optimizer(study):
    result, out = study
    paths = cl.write(result, out, "study")
    data = json.loads(paths[0].read_text())
    assert not (out / "study.partial.json").exists()
    assert "| zero_one_adam |" in paths[2].read_text()
    assert list(data["optimizers"]) == list(cl.OPTIMIZERS)
    for name, r in data["optimizers"].items():
        for field in ("final_val_loss_mean", "final_val_loss_std", "bytes_per_worker", "rounds"):
            assert np.isfinite(r[field]), (name, field)
        assert r["steps"] == STUDY.long_steps and r["seeds"] == [0, 1]
        # best LR = the sweep's argmin, recomputed from the saved sweep runs
        sweep = {lr: data["runs"][f"sweep/{name}/{lr:g}"]["final_val_loss"] for lr in STUDY.lrs}
        assert r["best_lr"] == min(sweep, key=sweep.get)
        best = data["runs"][f"sweep/{name}/{r['best_lr']:g}"]
        assert data["runs"]["long/" + name + "/0"]["val"] == best["val"], "not deterministic"
        finals = [data["runs"][f"long/{name}/{s}"]["final_val_loss"] for s in STUDY.seeds]
        assert r["final_val_loss_mean"] == pytest.approx(np.mean(finals))
        assert r["final_val_loss_std"] == pytest.approx(np.std(finals, ddof=1))
        assert finals[0] != finals[1], f"{name}: the seeds must change the run"
        # bytes = sum over kinds of steps x bytes per step; kinds cover every step
        counts, traffic = r["steps_per_kind"], r["traffic_per_kind"]
        assert sum(counts.values()) == STUDY.long_steps
        total = sum(c * traffic[k]["bytes_per_step"] for k, c in counts.items())
        assert r["bytes_per_worker"] == pytest.approx(total)
        # the projection adds the link's time to the measured compute, and a slower link costs more
        p = r["projected_run_seconds"]
        assert p["compute_only"] <= p["10 Gbit/s"] <= p["1 Gbit/s"]


@pytest.mark.slow  # the study (~110 s): make test-slow, run by CI
def test_step_kinds_of_the_naive_compositions_follow_their_schedules(study):
    result, _ = study
    opt = result["optimizers"]
    cfg = STUDY.config("zero_one_adam", STUDY.long_steps, 1e-3, 0, 1)
    variance, local = cfg.policies()
    zero_one = np.bincount(ozo.step_kinds(variance, local, STUDY.long_steps), minlength=4)
    assert opt["zero_one_adam"]["steps_per_kind"] == {
        k: int(c) for k, c in zip(ozo.STEP_KINDS, zero_one, strict=True) if c
    }
    # local Adam: full precision up to 0/1 Adam's freeze step, then 0/1 Adam's syncs
    warm = ozo.FullPrecisionWarmup(variance.freeze_step)
    kinds = np.bincount(ozo.step_kinds(warm, local, STUDY.long_steps), minlength=4)
    assert opt["local_adam"]["steps_per_kind"] == {
        "variance": variance.freeze_step,
        "local": int(kinds[2]),
        "sync": int(kinds[3]),
    }
    # every phase-A step communicates in both, and their syncs coincide
    assert opt["local_adam"]["rounds"] == opt["zero_one_adam"]["rounds"]
    # Adam on 1-bit gradients: one compressed mean every step, as 0/1 Adam's compressed kind
    assert opt["onebit_grad_adam"]["steps_per_kind"] == {"compressed": STUDY.long_steps}
    assert (
        opt["onebit_grad_adam"]["traffic_per_kind"]["compressed"]["bytes_per_step"]
        == (opt["zero_one_adam"]["traffic_per_kind"]["compressed"]["bytes_per_step"])
    )
    assert opt["local_adam"]["traffic_per_kind"]["local"]["bytes_per_step"] == 0.0


@pytest.mark.slow  # the study (~110 s): make test-slow, run by CI
def test_summary_matches_the_per_optimizer_numbers(study):
    result, _ = study
    opt, s = result["optimizers"], result["summary"]
    base = opt["adamw"]["final_val_loss_mean"]
    gap = 100 * (opt["zero_one_adam"]["final_val_loss_mean"] - base) / base
    assert s["zero_one_adam_gap_to_adamw_pct"] == pytest.approx(gap, abs=1e-3)
    less = 1 - opt["zero_one_adam"]["bytes_per_worker"] / opt["onebit_adam"]["bytes_per_worker"]
    assert s["zero_one_adam_bytes_reduction_vs_onebit_adam_pct"] == pytest.approx(
        100 * less, abs=0.01
    )
    assert s["claims"]["bytes_reduction_at_least_85pct"] == (100 * less >= 85)


@pytest.mark.slow  # the study (~110 s): make test-slow, run by CI
def test_resume_runs_only_what_is_missing(study, tmp_path, monkeypatch):
    result, _ = study
    small = dataclasses.replace(STUDY, optimizers=("adamw",), seeds=(0,))
    saved = {
        k: v for k, v in result["runs"].items() if k.startswith(("sweep/adamw", "long/adamw/0"))
    }
    partial = tmp_path / "x.partial.json"
    partial.write_text(json.dumps({"settings": cl._settings(small), "runs": saved}))
    monkeypatch.setattr(
        training, "train", lambda *a, **k: pytest.fail("resumed study trained again")
    )
    again = cl.run(small, tmp_path, "x", resume=True, progress=False)
    assert (
        again["optimizers"]["adamw"]["final_val_loss_mean"]
        == saved["long/adamw/0"]["final_val_loss"]
    )
    # a finished study re-aggregates from its JSON, training nothing
    cl.write(again, tmp_path, "x")
    assert not partial.exists()
    again = cl.run(small, tmp_path, "x", resume=True, progress=False)
    assert set(again["runs"]) == set(saved)
    # more optimizers or seeds may join a saved study; runs of another length may not
    longer = dataclasses.replace(small, long_steps=small.long_steps + 1)
    with pytest.raises(SystemExit, match="other settings"):
        cl.run(longer, tmp_path, "x", resume=True, progress=False)


@pytest.mark.parametrize(
    ("curve", "tried"),
    [
        # a minimum inside the grid: no extension
        (lambda lr: (lr - 2e-3) ** 2, [1e-3, 2e-3, 4e-3]),
        # best at the top edge: extend upwards until the minimum is inside (here at 8e-3)
        (lambda lr: (lr - 9e-3) ** 2, [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]),
        # still at the edge after max_extensions=2: stop there
        (lambda lr: -lr, [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]),
        # best at the bottom edge: extend downwards
        (lambda lr: lr, [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]),
        # the top diverges: a non-finite loss is never best, so no extension beyond it
        (lambda lr: float("nan") if lr > 3e-3 else -lr, [1e-3, 2e-3, 4e-3]),
    ],
)
def test_sweep_extends_the_grid_while_the_best_rate_is_at_its_edge(curve, tried):
    calls = []

    def train(lr):
        calls.append(lr)
        return curve(lr)

    study = cl.Study(lrs=(1e-3, 2e-3, 4e-3), max_extensions=2)
    losses = cl.sweep(study, train)
    assert sorted(calls) == pytest.approx(tried)
    assert list(losses) == sorted(calls)
