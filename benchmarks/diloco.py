"""DiLoCo's family against AdamW and 0/1 Adam: validation loss against the bytes each worker sends.

Run as ``python -m benchmarks.diloco [--long [--reuse results/convergence_long.json]] [--quick]
[--resume]``.

The char-level GPT and text of :mod:`benchmarks.convergence_long` (the standard library's
sources, 8 simulated workers, warm-up then cosine decay), trained for the same number of steps
by:

- ``adamw``: ``optax.adamw`` on float32 ``pmean``-averaged gradients, every step;
- ``zero_one_adam``: 0/1 Adam on its recipe (convergence_long's);
- ``diloco_float``: DiLoCo (Douillard et al., arXiv:2311.08105): AdamW inside, a float32
  average of the workers' deltas every ``H = 50`` steps, Nesterov momentum outside (lr 0.7,
  momentum 0.9): ``ozo.diloco(optax.adamw(...), optax.sgd(0.7, momentum=0.9, nesterov=True),
  50, "w", collective="float")``;
- ``diloco_1bit``: the same with ``collective="two_phase"`` (the delta 1-bit compressed with
  error feedback): one argument apart;
- ``muloco_1bit``: MuLoCo's shape (Thérien et al., arXiv:2505.23725): ``optax.contrib.muon``
  inside (its matrices at ``5 x`` the peak rate, other leaves on Muon's AdamW at the peak rate),
  1-bit deltas (the paper: 2 bits);
- ``muloco_psum`` (``--long`` only): the same with ``collective="psum"``: every worker's delta
  still compressed to signs and a scale, the signs summed exactly as integer counts in one
  all-reduce (no server-side second compression; 4-bit counts at 8 workers).

Protocol (convergence_long's, shorter): a sweep of the peak learning rate over ``lrs`` at
``sweep_steps`` on seed 0 (no extension: the run is short); then ``long_steps`` at each best rate,
3 seeds for AdamW and the two DiLoCo rows (the headline claims), 1 for the others. Bytes per
worker are read from each step kind's compiled program. Writes ``results/diloco.{json,png,md}``
(``--quick``: ``diloco_quick``, ``--long``: ``diloco_long``).

``--long`` is convergence_long's protocol at its own length (1,200-step sweep over 2e-3, 4e-3,
8e-3 with edge extensions, 6,000-step runs on 3 seeds; MuLoCo on one). Its AdamW and 0/1 Adam
runs are the ones ``benchmarks.convergence_long`` already trains, config for config:
``--reuse results/convergence_long.json`` takes them from that file (after checking that both
studies' settings agree) instead of training them again, which saves about 45 minutes here.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from benchmarks import convergence_long as cl  # noqa: E402
from benchmarks.support import common, training  # noqa: E402

OPTIMIZERS = ("adamw", "zero_one_adam", "diloco_float", "diloco_1bit", "muloco_1bit")
FAMILY = ("diloco_float", "diloco_1bit", "muloco_1bit", "muloco_psum")
# --long also runs MuLoCo with the psum backend (the deltas' 1-bit signs summed as integer
# counts: no second compression at a server, ~4x the two-phase bytes at 8 workers)
LONG_OPTIMIZERS = (*OPTIMIZERS, "muloco_psum")

PRESETS = {
    # ~20 min on 2 cores at ~63 ms per step
    "full": cl.Study(
        sweep_steps=400,
        long_steps=800,
        lrs=(4e-3, 8e-3),
        max_extensions=0,
        sweep_eval_every=200,
        long_eval_every=80,
        train_loss_block=50,
        optimizers=OPTIMIZERS,
        fewer_seeds=(("zero_one_adam", (0,)), ("muloco_1bit", (0,))),
    ),
    # convergence_long's "long" protocol, 3 seeds each (~90 min on 2 cores with --reuse)
    "long": dataclasses.replace(cl.PRESETS["long"], optimizers=LONG_OPTIMIZERS, fewer_seeds=()),
    # a few-minute check of the pipeline, no claims
    "quick": cl.Study(
        sweep_steps=100,
        long_steps=150,
        lrs=(4e-3,),
        max_extensions=0,
        seeds=(0,),
        sweep_eval_every=50,
        long_eval_every=50,
        train_loss_block=25,
        optimizers=OPTIMIZERS,
    ),
}


def _pct(a: float, b: float) -> float:
    return round(100 * (a - b) / b, 3)


def summarize(per_opt: dict[str, Any]) -> dict[str, Any]:
    """The claims: DiLoCo 1-bit against DiLoCo float; the family's best against AdamW and
    0/1 Adam (loss gaps in % of the other's mean final loss; bytes reductions in %)."""
    out: dict[str, Any] = {}
    loss = {n: r["final_val_loss_mean"] for n, r in per_opt.items()}
    sent = {n: r["bytes_per_worker"] for n, r in per_opt.items()}
    if {"diloco_float", "diloco_1bit"} <= set(per_opt):
        out["diloco_1bit_gap_to_diloco_float_pct"] = _pct(loss["diloco_1bit"], loss["diloco_float"])
        out["diloco_1bit_bytes_reduction_vs_float_pct"] = round(
            100 * (1 - sent["diloco_1bit"] / sent["diloco_float"]), 3
        )
    family = [n for n in FAMILY if n in per_opt and math.isfinite(loss[n])]
    if family and "adamw" in per_opt:
        best = min(family, key=loss.get)
        out["best_of_family"] = best
        out["best_gap_to_adamw_pct"] = _pct(loss[best], loss["adamw"])
        out["best_bytes_reduction_vs_adamw_pct"] = round(100 * (1 - sent[best] / sent["adamw"]), 3)
        if "zero_one_adam" in per_opt:
            out["best_gap_to_zero_one_adam_pct"] = _pct(loss[best], loss["zero_one_adam"])
            out["best_bytes_vs_zero_one_adam"] = round(sent[best] / sent["zero_one_adam"], 4)
    claims = {}
    if "diloco_1bit_gap_to_diloco_float_pct" in out:
        claims["diloco_1bit_within_2pct_of_float"] = out["diloco_1bit_gap_to_diloco_float_pct"] <= 2
        claims["diloco_1bit_95pct_fewer_bytes"] = (
            out["diloco_1bit_bytes_reduction_vs_float_pct"] >= 95
        )
    if "best_gap_to_adamw_pct" in out:
        claims["best_within_2pct_of_adamw"] = out["best_gap_to_adamw_pct"] <= 2
        claims["best_99_5pct_fewer_bytes_than_adamw"] = (
            out["best_bytes_reduction_vs_adamw_pct"] >= 99.5
        )
    if claims:
        out["claims"] = claims
    return out


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    """Validation loss against MB sent per worker (log x), mean over each row's seeds."""
    plt = common.pyplot()
    fig, (bytes_ax, step_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    runs = result["runs"]
    for name, r in result["optimizers"].items():
        curves = [runs[f"long/{name}/{s}"]["val"] for s in r["seeds"]]
        loss = np.asarray([c["loss"] for c in curves], np.float64).mean(0)
        mb = np.asarray(curves[0]["bytes"]) / 1e6
        label = f"{name} ({len(r['seeds'])} seed{'s' if len(r['seeds']) > 1 else ''})"
        (line,) = bytes_ax.plot(mb[1:], loss[1:], marker=".", label=label)
        step_ax.plot(curves[0]["step"], loss, color=line.get_color(), label=label)
    bytes_ax.set(xscale="log", xlabel="MB sent per worker (log)", ylabel="validation loss",
                 title="validation loss against communication")  # fmt: skip
    step_ax.set(xlabel="step", ylabel="validation loss", title="validation loss against steps")
    low = min(r["lowest_val_loss_mean"] for r in result["optimizers"].values())
    for ax in (bytes_ax, step_ax):
        ax.set_ylim(low - 0.05, low + 0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['num_workers']} workers: {result['workload'].split(';')[0]}", fontsize=9)
    common.save_figure(fig, path)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# DiLoCo's family: {result['workload']}",
        "",
        cl.table(result),
        "",
        cl.time_table(result),
        "",
        *(f"- {k}: {v}" for k, v in result["diloco_summary"].items()),
        *cl.protocol_lines(result),
        f"- this process: wall {result['wall_seconds_this_process']:.0f} s",
    ]
    if "reused_runs" in result:
        reused = result["reused_runs"]
        lines.append(
            f"- {len(reused['keys'])} runs (AdamW's and 0/1 Adam's) taken from {reused['from']}, "
            "not trained again: same settings, same configs"
        )
    return "\n".join(lines) + "\n"


def reuse_runs(study: cl.Study, source: pathlib.Path, partial: pathlib.Path) -> list[str]:
    """Starts ``partial`` (the study's resume file) with the runs of ``source`` (another study's
    JSON) for the optimizers both studies train, after checking that the settings that make a
    run agree. Returns the keys taken. Raises if they disagree or ``partial`` already exists."""
    other = json.loads(source.read_text())
    mine = cl._settings(study)
    # the settings that shape a run (convergence_long's rule for resuming); fields the base
    # config gained after ``source`` ran (DiLoCo's: outer rate, sync interval) cannot have
    # shaped its runs, every field it has must agree
    theirs = cl._shaping(other["study"])
    shaping = cl._shaping(mine)
    shaping["base"] = {k: v for k, v in mine["base"].items() if k in theirs["base"]}
    differ = [k for k in shaping if theirs.get(k) != shaping[k]]
    if differ:
        raise SystemExit(f"{source} was run with other settings ({', '.join(differ)}): no reuse")
    if partial.exists():
        raise SystemExit(f"{partial} exists: resume it with --resume, or remove it")
    shared = set(study.optimizers) & set(other["study"]["optimizers"])
    runs = {k: r for k, r in other["runs"].items() if k.split("/")[1] in shared}
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(json.dumps({"settings": mine, "runs": runs}))
    return sorted(runs)


def probe(
    name: str,
    lr: float,
    overrides: dict[str, float] | None = None,
    long: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """One run of ``name`` as ``--long``'s sweep trains it (1,200 steps, seed 0; with ``long``,
    as its long runs do: 6,000 steps, ``seed``): a quick diagnostic between two rows, e.g. how
    much of DiLoCo 1-bit's gap the server's second compression makes (``diloco_psum`` has
    none). ``overrides`` replaces fields of the run's config (e.g. ``{"outer_momentum": 0.8}``;
    any numeric field of ``training.Config``)."""
    study = PRESETS["long"]
    steps, every = (
        (study.long_steps, study.long_eval_every)
        if long
        else (study.sweep_steps, study.sweep_eval_every)
    )
    cfg = study.config(name, steps, lr, seed, every)
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cfg)})
    if unknown:
        raise SystemExit(f"--set: no config field {', '.join(unknown)}")
    overrides = {key: _as_field(cfg, key, value) for key, value in overrides.items()}
    cfg = dataclasses.replace(cfg, **overrides)
    common.setup_cpu_devices(training.NUM_WORKERS)
    mesh = ozo.worker_mesh(common.AXIS, training.NUM_WORKERS)
    start = time.perf_counter()
    run = training.train(name, cfg, training.make_workload(cfg), mesh, progress=False)
    run = cl._compact(run, study.train_loss_block)
    keep = ("final_val_loss", "bytes_per_worker")
    return {
        "row": name,
        "lr": lr,
        "steps": steps,
        "seed": seed,
        **overrides,
        **{k: run.get(k) for k in keep},
        "seconds": round(time.perf_counter() - start, 1),
    }


def _as_field(cfg: Any, key: str, value: float) -> int | float:
    """``value`` as the type of the config's field ``key`` (an int field stays an int)."""
    current = getattr(cfg, key)
    if isinstance(current, bool) or not isinstance(current, int | float):
        raise SystemExit(f"--set {key}: not a numeric config field ({current!r})")
    if isinstance(current, int):
        if value != int(value):
            raise SystemExit(f"--set {key}={value}: {key} is an integer field")
        return int(value)
    return float(value)


def _override(text: str) -> tuple[str, float]:
    """``key=value`` of ``--set``, the value a number."""
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--set wants key=value, got {text!r}")
    return key, float(value)


def main(argv: list[str] | None = None) -> None:
    parser = common.argument_parser("benchmarks.diloco", __doc__)
    parser.add_argument("--quick", action="store_true", help="a few-minute check, no claims")
    parser.add_argument("--long", action="store_true", help="convergence_long's 6,000 steps")
    parser.add_argument(
        "--reuse",
        type=pathlib.Path,
        help="with --long: take AdamW's and 0/1 Adam's runs from this convergence_long JSON",
    )
    parser.add_argument("--resume", action="store_true", help="skip the runs already saved")
    parser.add_argument(
        "--out-dir", type=pathlib.Path, default=common.RESULTS, help="where to write (results/)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--probe",
        nargs=2,
        metavar=("ROW", "LR"),
        help="one sweep-length run of ROW (any of training.LOCO, e.g. diloco_psum) at peak rate "
        "LR on seed 0 under --long's protocol; prints its final loss and bytes, writes nothing",
    )
    parser.add_argument(
        "--set",
        type=_override,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --probe: a config field to change, e.g. outer_momentum=0.8 (repeatable)",
    )
    parser.add_argument(
        "--probe-long",
        type=int,
        metavar="SEED",
        help="with --probe: a long run (6,000 steps) on this seed instead of a sweep run",
    )
    args = parser.parse_args(argv)
    if not args.probe and (args.set or args.probe_long is not None):
        parser.error("--set and --probe-long go with --probe ROW LR")
    if args.quick and args.long:
        parser.error("--quick and --long are two presets: pick one")
    if args.probe and args.probe[0] not in training.OPTIMIZERS + training.EXTRA + training.LOCO:
        parser.error(f"--probe: no row {args.probe[0]!r} (e.g. {', '.join(training.LOCO)})")
    if args.probe:
        long, seed = args.probe_long is not None, args.probe_long or 0
        found = probe(args.probe[0], float(args.probe[1]), dict(args.set), long, seed)
        print(json.dumps(found))
        return
    preset = "quick" if args.quick else "long" if args.long else "full"
    study = PRESETS[preset]
    stem = "diloco" + ("" if preset == "full" else f"_{preset}")
    resume, reused = args.resume, None
    final = args.out_dir / f"{stem}.json"
    if resume and final.exists():  # a resumed study keeps the record of what it reused
        reused = json.loads(final.read_text()).get("reused_runs")
    if args.reuse is not None:
        taken = reuse_runs(study, args.reuse, args.out_dir / f"{stem}.partial.json")
        print(f"reused {len(taken)} runs from {args.reuse}", flush=True)
        resume, reused = True, {"from": str(args.reuse), "keys": taken}
    result = cl.run(study, args.out_dir, stem, resume=resume, progress=not args.no_progress)
    if reused is not None:
        result["reused_runs"] = reused
    result["benchmark"] = "diloco"
    result["diloco_summary"] = summarize(result["optimizers"])
    result = cl._finite_or_none(result)
    paths = common.write_results(args.out_dir / f"{stem}.json", result, markdown(result), plot)
    (args.out_dir / f"{stem}.partial.json").unlink(missing_ok=True)
    print(markdown(result))
    print(f"wrote {', '.join(map(str, paths))}")


if __name__ == "__main__":
    main()
