"""DiLoCo's family with its outer learning rate swept: does the paper's 0.7 suit 1-bit syncs?

``benchmarks.diloco --long`` ran every DiLoCo row with the outer step of the DiLoCo paper,
Nesterov momentum at learning rate 0.7 and momentum 0.9, and swept only the inner (peak) rate.
This script sweeps the outer rate too, one row at a time, on the same protocol:

1. at each row's best inner rate (read from ``results/diloco_long.json``), the outer rate over
   ``OUTER_LRS`` at the sweep's length (1,200 steps) on seed 0, extended once past an edge; the
   runs at 0.7 are ``diloco_long``'s own sweep runs, not trained again;
2. 6,000 steps on seeds 0-2 at the best outer rate (``diloco_long``'s long runs if it is 0.7).

The claims of the DiLoCo issue are then read again with each row at its best outer rate:
DiLoCo 1-bit against DiLoCo float, and the family's best against AdamW (AdamW's runs are
``diloco_long``'s, which are ``convergence_long``'s).

Run: ``python -m benchmarks.diloco_outer [--rows ...] [--resume]`` (about 70 min on 2 cores when
every row moves off 0.7). Writes ``results/diloco_outer.{json,md}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported

import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from benchmarks import convergence_long as cl  # noqa: E402
from benchmarks import diloco  # noqa: E402
from benchmarks.support import common, training  # noqa: E402

OUTER_LRS = (0.4, 0.7, 1.0)
PAPER_OUTER_LR = 0.7  # DiLoCo's (Douillard et al., arXiv:2311.08105), diloco_long's setting
EDGE = {0.4: 0.25, 1.0: 1.4}  # one extension past an edge of OUTER_LRS
STUDY = diloco.PRESETS["long"]


def _key(phase: str, name: str, value: float | int) -> str:
    return f"{phase}/{name}/{value}"


def _gap(a: float, b: float) -> float:
    return 100.0 * (a / b - 1.0)


def best_outer(sweep: dict[float, float]) -> float:
    """The outer rate with the lowest final validation loss (ties: the paper's, then lower)."""
    return min(sweep, key=lambda lr: (sweep[lr], lr != PAPER_OUTER_LR, lr))


class Runner:
    """Trains (or takes from ``diloco_long``) the runs of one row, saving each as it ends."""

    def __init__(self, source: dict[str, Any], out: pathlib.Path, resume: bool) -> None:
        self.source = source
        self.out = out
        saved = json.loads(out.read_text()) if resume and out.exists() else {}
        self.runs: dict[str, Any] = saved.get("runs", {})
        self.mesh = None
        self.workloads: dict[int, Any] = {}

    def config(self, name: str, steps: int, seed: int, outer_lr: float) -> training.Config:
        lr = self.source["optimizers"][name]["best_lr"]
        every = STUDY.sweep_eval_every if steps == STUDY.sweep_steps else STUDY.long_eval_every
        cfg = STUDY.config(name, steps, lr, seed, every)
        return dataclasses.replace(cfg, outer_lr=outer_lr)

    def run(self, phase: str, name: str, outer_lr: float, seed: int) -> dict[str, Any]:
        steps = STUDY.sweep_steps if phase == "sweep" else STUDY.long_steps
        if outer_lr == PAPER_OUTER_LR:  # diloco_long's own run, same settings
            lr = self.source["optimizers"][name]["best_lr"]
            value = lr if phase == "sweep" else seed
            return self.source["runs"][_key(phase, name, value)]
        key = _key(phase, name, f"{outer_lr}@{seed}")
        if key not in self.runs:
            cfg = self.config(name, steps, seed, outer_lr)
            if self.mesh is None:
                common.setup_cpu_devices(training.NUM_WORKERS)
                self.mesh = ozo.worker_mesh(common.AXIS, training.NUM_WORKERS)
            if seed not in self.workloads:
                self.workloads[seed] = training.make_workload(cfg)
            start = time.perf_counter()
            full = training.train(name, cfg, self.workloads[seed], self.mesh, progress=False)
            run = cl._compact(full, STUDY.train_loss_block)
            run["seconds"] = round(time.perf_counter() - start, 1)
            self.runs[key] = run
            loss = run["final_val_loss"]
            print(f"{key}: final val loss {loss:.4f}", file=sys.stderr, flush=True)
            self.save({})
        return self.runs[key]

    def save(self, rows: dict[str, Any]) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps({"rows": rows, "runs": self.runs}, indent=1))


def study_row(runner: Runner, name: str) -> dict[str, Any]:
    """The outer-rate sweep of row ``name`` and its long runs at the best outer rate."""
    sweep = {lr: runner.run("sweep", name, lr, 0)["final_val_loss"] for lr in OUTER_LRS}
    best = best_outer(sweep)
    if best in EDGE:
        extra = EDGE[best]
        sweep[extra] = runner.run("sweep", name, extra, 0)["final_val_loss"]
        best = best_outer(sweep)
    finals = [runner.run("long", name, best, seed)["final_val_loss"] for seed in STUDY.seeds]
    long0 = runner.run("long", name, best, STUDY.seeds[0])
    return {
        "inner_lr": runner.source["optimizers"][name]["best_lr"],
        "sweep": {str(k): v for k, v in sorted(sweep.items())},
        "best_outer_lr": best,
        "final_val_loss_per_seed": finals,
        "final_val_loss_mean": statistics.fmean(finals),
        "final_val_loss_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "bytes_per_worker": long0["bytes_per_worker"],
        "rounds": long0["rounds"],
        "paper_outer_mean": runner.source["optimizers"][name]["final_val_loss_mean"],
    }


def claims(rows: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """The DiLoCo issue's claims with each row at its best outer rate."""
    adamw = source["optimizers"]["adamw"]
    out: dict[str, Any] = {}
    if {"diloco_1bit", "diloco_float"} <= rows.keys():
        one, flt = rows["diloco_1bit"], rows["diloco_float"]
        gap = _gap(one["final_val_loss_mean"], flt["final_val_loss_mean"])
        fewer = 100.0 * (1 - one["bytes_per_worker"] / flt["bytes_per_worker"])
        out["diloco_1bit_gap_to_float_pct"] = gap
        out["diloco_1bit_bytes_reduction_vs_float_pct"] = fewer
        out["diloco_1bit_within_2pct_of_float"] = gap <= 2.0
    best = min(rows, key=lambda n: rows[n]["final_val_loss_mean"])
    gap = _gap(rows[best]["final_val_loss_mean"], adamw["final_val_loss_mean"])
    fewer = 100.0 * (1 - rows[best]["bytes_per_worker"] / adamw["bytes_per_worker"])
    out.update(
        best_of_family=best,
        best_gap_to_adamw_pct=gap,
        best_bytes_reduction_vs_adamw_pct=fewer,
        best_within_2pct_of_adamw=gap <= 2.0,
        best_99_5pct_fewer_bytes_than_adamw=fewer >= 99.5,
    )
    return out


def markdown(result: dict[str, Any]) -> str:
    adamw = result["adamw_final_val_loss_mean"]
    lines = [
        "| row | inner LR | sweep: outer LR (final val, 1,200 steps) | best outer LR | "
        "final val (mean ± std, 3 seeds) | at outer 0.7 | gap to AdamW | MB/worker |",
        "|---|---:|---|---:|---|---:|---:|---:|",
    ]
    for name, r in result["rows"].items():
        sweep = ", ".join(f"{k} ({v:.4f})" for k, v in r["sweep"].items())
        lines.append(
            f"| {name} | {r['inner_lr']:g} | {sweep} | {r['best_outer_lr']:g} | "
            f"{r['final_val_loss_mean']:.4f} ± {r['final_val_loss_std']:.4f} | "
            f"{r['paper_outer_mean']:.4f} | {_gap(r['final_val_loss_mean'], adamw):+.2f}% | "
            f"{r['bytes_per_worker'] / 1e6:,.1f} |"
        )
    lines += ["", f"AdamW (diloco_long's runs): {adamw:.4f}.", ""]
    lines += [
        f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}"
        for k, v in result["claims"].items()
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = common.argument_parser("benchmarks.diloco_outer", __doc__)
    parser.add_argument("--rows", nargs="+", choices=diloco.FAMILY, default=list(diloco.FAMILY))
    parser.add_argument("--source", type=pathlib.Path, default=common.RESULTS / "diloco_long.json")
    parser.add_argument("--resume", action="store_true", help="skip the runs already saved")
    parser.add_argument("--out-dir", type=pathlib.Path, default=common.RESULTS)
    args = parser.parse_args(argv)
    source = json.loads(args.source.read_text())
    if cl._shaping(source["study"]) != cl._shaping(cl._settings(STUDY)):
        raise SystemExit(f"{args.source} was not run with diloco --long's settings")
    out = args.out_dir / "diloco_outer.json"
    runner = Runner(source, out, args.resume)
    start = time.perf_counter()
    rows: dict[str, Any] = {}
    for name in args.rows:
        rows[name] = study_row(runner, name)
        runner.save(rows)
    result = {
        "benchmark": "diloco_outer",
        "source": str(args.source),
        "outer_lrs": list(OUTER_LRS),
        "adamw_final_val_loss_mean": source["optimizers"]["adamw"]["final_val_loss_mean"],
        "rows": rows,
        "claims": claims(rows, source),
        "runs": runner.runs,
        "wall_seconds_this_process": round(time.perf_counter() - start, 1),
    }
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
