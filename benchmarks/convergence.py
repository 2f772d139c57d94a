"""Convergence on real data, 8 workers: AdamW vs 1-bit Adam vs 0/1 Adam, loss against bytes.

Run as ``python -m benchmarks.convergence [--quick] [--workload digits] [--steps N] [--seed S]``.

Every optimizer trains the same model from the same initialisation on the same data: 8 workers
(``jax.shard_map`` over 8 simulated CPU devices), each on its own shard of the training data
(``benchmarks/support/workloads.py``), with one learning-rate schedule (linear warm-up for 5% of the
steps, then cosine decay to 10% of the peak) and one set of Adam constants:

- ``adamw``: ``optax.adamw``, gradients averaged by a float32 ``pmean`` (what users run today);
- ``onebit_adam``: :func:`optax_zero_one.onebit_adam`, local gradients;
- ``zero_one_adam``: :func:`optax_zero_one.scale_by_zero_one_adam` with the doubling policies.
- ``zero_one_adam_psum`` (only with ``--optimizers``): the same with ``collective="psum"``;
- ``onebit_grad_adam`` and ``local_adam`` (only with ``--optimizers``): the naive compositions
  (Adam on the 1-bit compressed gradient; local Adam with 1-bit model averaging), see
  ``benchmarks.support.training.EXTRA``.

The papers' policies, scaled to the run length ``T``. DeepSpeed's BERT pre-training configs use
``var_freeze_step = freeze_step = 23,000`` (about 15% of a ~150k-step run),
``var_update_scaler kappa = 16``, ``local_step_scaler alpha = 32,678`` (about 22% of the run)
and ``local_step_clipper H = 16``. The durations scale with the run: ``F = 0.15 T`` (the freeze
of both optimizers) and ``alpha = 0.22 T``; the counts stay: ``kappa = 16`` variance updates
per interval, sync gaps up to ``H = 16``. (``kappa`` scaled like a duration would be 1. With an
earlier, untied-embedding version of this model, ``kappa = 4`` left 0/1 Adam at +48% validation
loss in a 1,000-step run and ``kappa = 16`` within 3%; much shorter runs freeze the variance
while the gradient statistics still move fast: at 300 steps, ``F = 45``, 0/1 Adam diverged right
after the freeze, so ``--quick`` runs 800.)
The variance steps then number about ``kappa log2(F / kappa)``, which does not
shrink with the run, so short runs pay relatively more float traffic than the paper's: the
summary projects the byte reduction to longer runs with the same proportions, from the
policies and the measured bytes per step kind (no training).

Recorded per optimizer: training loss each step (mean over workers), validation loss (and
accuracy for ``digits``) every ``eval_every`` steps at the synchronised parameters
(:func:`optax_zero_one.synchronized_params`), wall time, the step kinds taken, and bytes sent per
worker: for each step kind, the whole training step compiled for that kind alone through the
``step_kind`` hint and its collectives read (:func:`benchmarks.support.common.traffic_per_kind`),
times the number of steps of that kind. Training runs one compiled program per step kind, the
host picking each step's (:func:`benchmarks.support.common.train_step`). The compressing
optimizers get the workload's mask of parameters whose gradient is always exactly zero
(``digits``: the constant corner pixels; ``char_lm``: none).

With ``--mesh 2x4`` the 8 workers are 2 nodes of 4 (``("node", "local")``) and the compressing
optimizers take ``fast_axis_name="local"`` (``docs/hierarchical.md``): exact means inside a node,
1-bit only across nodes. The flat 8-worker 0/1 Adam runs in the same process for comparison, and
bytes and rounds are reported per mesh axis and across nodes
(:func:`benchmarks.support.training.across_nodes`).
``zero_one_adam_node_mean`` (``--optimizers``, with ``--mesh``) also averages the gradients inside
each node at every step, so that local steps are node-wide.

The configurations, the optimizers and the training of one optimizer are
``benchmarks/support/training.py`` (shared with ``benchmarks.convergence_long``); this script
runs them, summarises and writes the results.

Writes ``results/convergence.json``, ``.png`` and ``.md`` (``--quick``: ``convergence_quick.*``;
``--workload digits``: ``convergence_digits*.*``; ``--mesh 2x4``: ``convergence_2x4.*``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported; run() sets PJRT_NPROC

import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from benchmarks.support import common, training  # noqa: E402

PROJECT_TO = (10_000, 50_000, 150_000)


def run(cfg: training.Config, progress: bool = True) -> dict[str, Any]:
    """Trains every optimizer of ``cfg`` and returns the JSON-ready result (no files written)."""
    common.setup_cpu_devices(training.NUM_WORKERS)
    flat_mesh = ozo.worker_mesh(common.AXIS, training.NUM_WORKERS)
    mesh = common.node_mesh(*cfg.mesh) if cfg.mesh else flat_mesh
    workload = training.make_workload(cfg)
    variance, local = cfg.policies()
    start, cpu = time.perf_counter(), time.process_time()
    nodes = cfg.mesh
    runs = {
        name: training.train(name, cfg, workload, mesh, progress, nodes) for name in cfg.optimizers
    }
    if cfg.mesh:  # the flat 8-worker run of the same configuration, for comparison
        flat = dataclasses.replace(cfg, mesh=())
        runs["zero_one_adam_flat"] = training.train(
            "zero_one_adam", flat, workload, flat_mesh, progress, nodes
        )
    result = {
        "benchmark": "convergence",
        "workload": workload.description,
        "num_workers": training.NUM_WORKERS,
        "mesh": {"node": cfg.mesh[0], "local": cfg.mesh[1]} if cfg.mesh else None,
        "config": {**dataclasses.asdict(cfg), "model": dict(cfg.model)},
        "policies": {
            "freeze_step": variance.freeze_step,
            "var_update_scaler": variance.update_scaler,
            "local_step_scaler": local.scaler,
            "local_step_clipper": local.clipper,
            "variance_steps": [int(k) for k in kind_steps(cfg, "variance")],
            "scaling": (
                f"freeze = {cfg.freeze:g} T, alpha = {cfg.local_scaler:g} T, kappa = {cfg.kappa}, "
                f"H = {cfg.clipper} for T = {cfg.steps} (DeepSpeed BERT: F = 23,000, kappa = 16, "
                "alpha = 32,678, H = 16)"
            ),
        },
        "runs": runs,
        "summary": {**summarize(runs), **project(cfg, runs)},
        "wall_seconds": round(time.perf_counter() - start, 1),
        "cpu_seconds": round(time.process_time() - cpu, 1),
    }
    return result


def kind_steps(cfg: training.Config, kind: str) -> np.ndarray:
    """The 1-based steps of 0/1 Adam's ``kind`` in a run of ``cfg`` (from the policies alone,
    :func:`optax_zero_one.step_kinds`)."""
    variance, local = cfg.policies()
    kinds = ozo.step_kinds(variance, local, cfg.steps)
    return np.flatnonzero(kinds == ozo.STEP_KINDS.index(kind)) + 1


def summarize(runs: dict[str, Any]) -> dict[str, float]:
    """Gaps to AdamW (%, of the final validation loss) and communication reductions (%)."""
    out: dict[str, float] = {}
    if "zero_one_adam_flat" in runs:  # hierarchical runs against the flat 8-worker one
        base = runs["zero_one_adam_flat"]["final_val"]["loss"]
        for name, r in runs.items():
            if name != "zero_one_adam_flat":
                gap = 100 * (r["final_val"]["loss"] - base) / base
                out[f"{name}_gap_to_flat_pct"] = round(gap, 3)
    if "adamw" in runs:
        base = runs["adamw"]["final_val"]["loss"]
        for name, r in runs.items():
            r["gap_to_adamw_pct"] = round(100 * (r["final_val"]["loss"] - base) / base, 3)
            out[f"{name}_gap_to_adamw_pct"] = r["gap_to_adamw_pct"]
    if "zero_one_adam" in runs:
        mine = runs["zero_one_adam"]
        for other in ("onebit_adam", "adamw"):
            if other in runs:
                less = 1 - mine["bytes_per_worker"] / runs[other]["bytes_per_worker"]
                out[f"zero_one_adam_bytes_reduction_vs_{other}_pct"] = round(100 * less, 2)
                rounds = 1 - mine["rounds"] / runs[other]["rounds"]
                out[f"zero_one_adam_rounds_reduction_vs_{other}_pct"] = round(100 * rounds, 2)
    return out


def project(cfg: training.Config, runs: dict[str, Any]) -> dict[str, Any]:
    """0/1 Adam's byte reduction against 1-bit Adam for longer runs with the same proportions.

    Counts the step kinds of a ``T``-step run from the policies alone (as scaled by ``cfg``) and
    prices each kind at the bytes per step measured in this run.
    """
    if not {"zero_one_adam", "onebit_adam"} <= set(runs):
        return {}
    zero_one = runs["zero_one_adam"]["traffic_per_kind"]
    onebit = runs["onebit_adam"]["traffic_per_kind"]
    full = zero_one["variance"]["bytes_per_step"]
    packed = zero_one.get("sync", zero_one.get("compressed"))["bytes_per_step"]
    out = {}
    for steps in (cfg.steps, *PROJECT_TO):
        variance, local = dataclasses.replace(cfg, steps=steps).policies()
        f = variance.freeze_step
        counts = np.bincount(ozo.step_kinds(variance, local, steps), minlength=4)
        var, compressed, _, syncs = (int(c) for c in counts)
        mine = var * full + (compressed + syncs) * packed
        theirs = f * onebit["warmup"]["bytes_per_step"]
        theirs += (steps - f) * onebit["compressed"]["bytes_per_step"]
        out[str(steps)] = round(100 * (1 - mine / theirs), 2)
    return {"zero_one_adam_bytes_reduction_vs_onebit_adam_pct_projected": out}


def table(result: dict[str, Any]) -> str:
    """The results table, in Markdown."""
    runs = result["runs"]
    extra = [k for k in next(iter(runs.values()))["final_val"] if k != "loss"]
    head = ["optimizer", "final val loss", *extra, "gap to AdamW", "MB/worker", "rounds", "s/step"]
    if result.get("mesh"):  # what crosses nodes, and what stays inside them
        head += ["MB across nodes", "MB over local", "rounds across nodes"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in runs.items():
        gap = r.get("gap_to_adamw_pct")
        cells = [
            name,
            f"{r['final_val']['loss']:.4f}",
            *(f"{r['final_val'][k]:.4f}" for k in extra),
            "-" if gap is None or name == "adamw" else f"{gap:+.2f}%",
            f"{r['bytes_per_worker'] / 1e6:,.1f}",
            f"{r['rounds']:,}",
            f"{r['seconds']['per_step']:.3f}",
        ]
        if result.get("mesh"):
            axes, rounds = r["bytes_per_worker_by_axes"], r["rounds_by_axes"]
            across = r["val"]["bytes_across_nodes"][-1]
            cells += [
                f"{across / 1e6:,.1f}",
                f"{axes.get('local', 0.0) / 1e6:,.1f}" if "local" in axes else "-",
                f"{rounds.get('node', r['rounds']):,}",
            ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    """Validation loss against steps and against megabytes sent per worker."""
    plt = common.pyplot()
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in result["runs"].items():
        val = r["val"]
        (line,) = by_step.plot(val["step"], val["loss"], marker=".", label=name)
        mb = np.asarray(val.get("bytes_across_nodes", val["bytes"])[1:]) / 1e6
        by_bytes.plot(mb, val["loss"][1:], marker=".", color=line.get_color(), label=name)
    by_step.set(xlabel="step", ylabel="validation loss", title="validation loss vs steps")
    across = "across nodes " if result.get("mesh") else ""
    by_bytes.set(
        xlabel=f"MB sent per worker {across}(log)", ylabel="validation loss", xscale="log",
        title=f"validation loss vs communication {across}".strip(),
    )  # fmt: skip
    for ax in (by_step, by_bytes):
        ax.grid(alpha=0.3)
        ax.legend()
    mesh = result.get("mesh")
    shape = f" as {mesh['node']} nodes x {mesh['local']}" if mesh else ""
    fig.suptitle(
        f"{training.NUM_WORKERS} workers{shape}: {result['workload'].split(';')[0]}", fontsize=9
    )
    common.save_figure(fig, path)


def markdown(result: dict[str, Any]) -> str:
    """The table, the summary and the settings, as a short Markdown report."""
    lines = [
        f"# Convergence: {result['workload']}",
        "",
        table(result),
        "",
        *(f"- {key}: {value}" for key, value in result["summary"].items()),
        f"- policies: {result['policies']['scaling']}",
        f"- wall time {result['wall_seconds']:.0f} s, CPU {result.get('cpu_seconds', '?')} s",
    ]
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out_dir: pathlib.Path, stem: str) -> tuple[pathlib.Path, ...]:
    """Writes ``<stem>.json``, ``<stem>.png`` and ``<stem>.md`` under ``out_dir``."""
    return common.write_results(out_dir / f"{stem}.json", result, markdown(result), plot)


def main(argv: list[str] | None = None) -> None:
    parser = common.argument_parser("benchmarks.convergence", __doc__)
    parser.add_argument("--quick", action="store_true", help="the few-minute demo")
    parser.add_argument(
        "--long",
        action="store_true",
        help="the long study, each optimizer at its best LR over 3 seeds "
        "(python -m benchmarks.convergence_long; with --quick, its few-minute check)",
    )
    parser.add_argument(
        "--workload", choices=("char_lm", "digits"), default="char_lm", help="the model and data"
    )
    parser.add_argument("--steps", type=int, help="override the number of steps")
    parser.add_argument("--seed", type=int, default=0, help="of the initialisation and batches")
    parser.add_argument("--kappa", type=int, help="0/1 Adam's var_update_scaler")
    parser.add_argument("--lr", type=float, help="override the peak learning rate")
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=training.OPTIMIZERS + training.EXTRA + training.MESH_EXTRA,
        default=list(training.OPTIMIZERS),
    )
    parser.add_argument(
        "--mesh",
        help="NODESxLOCAL, e.g. 2x4: the compressing optimizers compress across nodes only "
        "(exact inside each); the flat 8-worker 0/1 Adam runs too, for comparison",
    )
    parser.add_argument(
        "--out-dir", type=pathlib.Path, default=common.RESULTS, help="where to write (results/)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.long:  # the study's own options pass on; a single run's would be ignored there
        single = ("workload", "steps", "seed", "kappa", "lr", "optimizers", "mesh")
        argv_given = sys.argv[1:] if argv is None else argv
        given = [  # a value other than the default, or the flag spelt out (even at its default)
            f"--{k}"
            for k in single
            if getattr(args, k) != parser.get_default(k)
            or any(a.split("=")[0] == f"--{k}" for a in argv_given)
        ]
        if given:
            parser.error(f"--long (benchmarks.convergence_long) takes no {', '.join(given)}")
        from benchmarks import convergence_long

        forward = ["--quick"] * args.quick + ["--no-progress"] * args.no_progress
        convergence_long.main([*forward, "--out-dir", str(args.out_dir)])
        return

    common.setup_cpu_devices(training.NUM_WORKERS)
    cfg = training.PRESETS[(args.workload, "quick" if args.quick else "full")]
    overrides = {"seed": args.seed, "optimizers": tuple(args.optimizers)}
    for flag, value, least in (("steps", args.steps, 2), ("kappa", args.kappa, 1)):
        if value is not None and value < least:
            parser.error(f"--{flag} must be at least {least}, got {value}")
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.kappa is not None:
        overrides["kappa"] = args.kappa
    if args.lr is not None:
        overrides["peak_lr"] = args.lr
    if args.mesh:
        split = common.node_split(args.mesh)
        if split is None or split[0] * split[1] != 8:
            parser.error(f"--mesh must be NODESxLOCAL with 8 workers in all, got {args.mesh}")
        overrides["mesh"] = split
    if set(args.optimizers) & set(training.MESH_EXTRA) and not args.mesh:
        parser.error(f"--optimizers {' '.join(training.MESH_EXTRA)} need --mesh NODESxLOCAL")
    cfg = dataclasses.replace(cfg, **overrides)
    variance, local = cfg.policies()
    print(training.make_workload(cfg).description)
    print(
        f"{cfg.steps} steps, peak lr {cfg.peak_lr:g}, b2 {cfg.b2}; policies: freeze step "
        f"{variance.freeze_step}, kappa {variance.update_scaler}, alpha {local.scaler}, "
        f"H {local.clipper} ({len(kind_steps(cfg, 'variance'))} variance steps, "
        f"{len(kind_steps(cfg, 'sync'))} syncs)"
    )
    result = run(cfg, progress=not args.no_progress)
    stem = "convergence" + ("" if args.workload == "char_lm" else f"_{args.workload}")
    stem += f"_{args.mesh.lower()}" if args.mesh else ""
    stem += "_quick" if args.quick else ""
    paths = write(result, args.out_dir, stem)
    print()
    print(table(result))
    print()
    for key, value in result["summary"].items():
        print(f"{key}: {value}")
    print(
        f"wall time {result['wall_seconds']:.0f} s (CPU {result['cpu_seconds']:.0f} s); "
        f"wrote {', '.join(map(str, paths))}"
    )


if __name__ == "__main__":
    main()
