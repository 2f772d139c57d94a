"""DiLoCo's family with one more setting swept: the outer rate or momentum, or MuLoCo's Muon rate.

``benchmarks.diloco --long`` ran every DiLoCo row with the outer step of the DiLoCo paper,
Nesterov momentum at learning rate 0.7 and momentum 0.9, MuLoCo's Muon at 5x the peak rate, and
swept only the inner (peak) rate. This script sweeps one of those settings too (``--setting``:
``outer_lr``, default; ``outer_momentum``, the two plain DiLoCo rows; or ``muon_lr_ratio``,
MuLoCo only), one row at a time, on the same protocol:

1. at each row's best inner rate (read from ``results/diloco_long.json``), the setting over
   its three values (:data:`SETTINGS`) at the sweep's length (1,200 steps) on seed 0, extended
   once past an edge; the runs at ``diloco_long``'s value are that study's own sweep runs, not
   trained again;
2. 6,000 steps on seeds 0-2 at the best value (``diloco_long``'s long runs if it is its own).

The claims of the DiLoCo issue are then read again with each row at its best outer rate:
DiLoCo 1-bit against DiLoCo float, and the family's best against AdamW (AdamW's runs are
``diloco_long``'s, which are ``convergence_long``'s).

Run: ``python -m benchmarks.diloco_outer [--setting S] [--rows ...] [--resume]`` (about 10
minutes on 2 cores where the study's own value wins everywhere, up to ~70 where every row moves
off it). Writes ``results/diloco_outer.{json,md}`` (other settings:
``results/diloco_<setting>.{json,md}``).
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


@dataclasses.dataclass(frozen=True)
class Setting:
    """A swept setting of ``training.Config``: its values, the study's own, one step past each
    edge, and the rows it applies to."""

    values: tuple[float, ...]
    own: float
    edge: dict[float, float]
    rows: tuple[str, ...]


# the rows diloco_long ran first, all with the paper's outer step (muloco_psum came later)
ORIGINAL_ROWS = ("diloco_float", "diloco_1bit", "muloco_1bit")
SETTINGS = {
    # DiLoCo's outer rate (Douillard et al., arXiv:2311.08105): 0.7
    "outer_lr": Setting((0.4, 0.7, 1.0), 0.7, {0.4: 0.25, 1.0: 1.4}, ORIGINAL_ROWS),
    # MuLoCo's Muon rate over the peak (AdamW's) rate, diloco_long's 5
    "muon_lr_ratio": Setting((2.5, 5.0, 10.0), 5.0, {2.5: 1.25, 10.0: 20.0}, ("muloco_1bit",)),
    # DiLoCo's outer momentum (the paper: 0.9), for the two rows of the first claim
    "outer_momentum": Setting(
        (0.8, 0.9, 0.95), 0.9, {0.8: 0.7, 0.95: 0.98}, ("diloco_float", "diloco_1bit")
    ),
}
STUDY = diloco.PRESETS["long"]


def _key(phase: str, name: str, value: float | int) -> str:
    return f"{phase}/{name}/{value}"


def _gap(a: float, b: float) -> float:
    return 100.0 * (a / b - 1.0)


def best_value(sweep: dict[float, float], own: float) -> float:
    """The value with the lowest final validation loss (ties: the study's own, then lower)."""
    return min(sweep, key=lambda v: (sweep[v], v != own, v))


class Runner:
    """Trains (or takes from ``diloco_long``) the runs of one row, saving each as it ends."""

    def __init__(
        self, source: dict[str, Any], out: pathlib.Path, resume: bool, setting: str
    ) -> None:
        self.source = source
        self.setting = setting
        self.own = SETTINGS[setting].own
        self.out = out
        saved = json.loads(out.read_text()) if resume and out.exists() else {}
        self.runs: dict[str, Any] = saved.get("runs", {})
        self.mesh = None
        self.workloads: dict[int, Any] = {}

    def config(self, name: str, steps: int, seed: int, value: float) -> training.Config:
        lr = self.source["optimizers"][name]["best_lr"]
        every = STUDY.sweep_eval_every if steps == STUDY.sweep_steps else STUDY.long_eval_every
        cfg = STUDY.config(name, steps, lr, seed, every)
        return dataclasses.replace(cfg, **{self.setting: value})

    def run(self, phase: str, name: str, value: float, seed: int) -> dict[str, Any]:
        steps = STUDY.sweep_steps if phase == "sweep" else STUDY.long_steps
        if value == self.own:  # diloco_long's own run, same settings
            lr = self.source["optimizers"][name]["best_lr"]
            return self.source["runs"][_key(phase, name, lr if phase == "sweep" else seed)]
        tag = "" if self.setting == "outer_lr" else f"{self.setting}="
        key = _key(phase, name, f"{tag}{value}@{seed}")
        if key not in self.runs:
            cfg = self.config(name, steps, seed, value)
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
    """The sweep of row ``name`` over the runner's setting and its long runs at the best value."""
    setting = SETTINGS[runner.setting]
    sweep = {v: runner.run("sweep", name, v, 0)["final_val_loss"] for v in setting.values}
    best = best_value(sweep, setting.own)
    if best in setting.edge:
        extra = setting.edge[best]
        sweep[extra] = runner.run("sweep", name, extra, 0)["final_val_loss"]
        best = best_value(sweep, setting.own)
    runs = [runner.run("long", name, best, seed) for seed in STUDY.seeds]
    finals = [run["final_val_loss"] for run in runs]
    long0 = runs[0]
    return {
        "inner_lr": runner.source["optimizers"][name]["best_lr"],
        "sweep": {str(k): v for k, v in sorted(sweep.items())},
        "best_value": best,
        "final_val_loss_per_seed": finals,
        "final_val_loss_mean": statistics.fmean(finals),
        "final_val_loss_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "bytes_per_worker": long0["bytes_per_worker"],
        "rounds": long0["rounds"],
        "own_value_mean": runner.source["optimizers"][name]["final_val_loss_mean"],
    }


def claims(rows: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """The DiLoCo issue's claims with each row at its best value (``diloco``'s own summary)."""
    return diloco.summarize({"adamw": source["optimizers"]["adamw"], **rows})


def markdown(result: dict[str, Any]) -> str:
    adamw, name_of, own = result["adamw_final_val_loss_mean"], result["setting"], result["own"]
    lines = [
        f"| row | inner LR | sweep: {name_of} (final val, 1,200 steps) | best | "
        f"final val (mean ± std, 3 seeds) | at {own:g} | gap to AdamW | MB/worker |",
        "|---|---:|---|---:|---|---:|---:|---:|",
    ]
    for name, r in result["rows"].items():
        sweep = ", ".join(f"{k} ({v:.4f})" for k, v in r["sweep"].items())
        lines.append(
            f"| {name} | {r['inner_lr']:g} | {sweep} | {r['best_value']:g} | "
            f"{r['final_val_loss_mean']:.4f} ± {r['final_val_loss_std']:.4f} | "
            f"{r['own_value_mean']:.4f} | {_gap(r['final_val_loss_mean'], adamw):+.2f}% | "
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
    parser.add_argument("--setting", choices=SETTINGS, default="outer_lr", help="the setting swept")
    parser.add_argument("--rows", nargs="+", choices=diloco.FAMILY, help="default: all it fits")
    parser.add_argument(
        "--source",
        type=pathlib.Path,
        default=common.RESULTS / "diloco_long.json",
        help="the long study's JSON (its best inner rates and settings)",
    )
    parser.add_argument("--resume", action="store_true", help="skip the runs already saved")
    parser.add_argument(
        "--out-dir", type=pathlib.Path, default=common.RESULTS, help="where to write (results/)"
    )
    args = parser.parse_args(argv)
    if not args.source.is_file():
        parser.error(
            f"--source {args.source}: no such file (the long study's JSON: "
            "python -m benchmarks.diloco --long writes results/diloco_long.json)"
        )
    source = json.loads(args.source.read_text())
    if cl._shaping(source["study"]) != cl._shaping(cl._settings(STUDY)):
        raise SystemExit(f"{args.source} was not run with diloco --long's settings")
    setting = SETTINGS[args.setting]
    rows_to_run = args.rows or list(setting.rows)
    if not set(rows_to_run) <= set(setting.rows):
        raise SystemExit(f"--setting {args.setting} applies to {setting.rows} only")
    stem = "diloco_outer" if args.setting == "outer_lr" else f"diloco_{args.setting}"
    out = args.out_dir / f"{stem}.json"
    runner = Runner(source, out, args.resume, args.setting)
    start = time.perf_counter()
    rows: dict[str, Any] = {}
    for name in rows_to_run:
        rows[name] = study_row(runner, name)
        runner.save(rows)
    result = {
        "benchmark": "diloco_outer",
        "source": str(args.source),
        "setting": args.setting,
        "values": list(setting.values),
        "own": setting.own,
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
