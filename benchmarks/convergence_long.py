"""Convergence at length, fairly tuned: every optimizer at its own best learning rate, 3 seeds.

Run as ``python -m benchmarks.convergence_long [--quick] [--resume]`` (or
``python -m benchmarks.convergence --long``).

The claim under test (Lu et al., 0/1 Adam, arXiv:2202.06009): 0/1 Adam reaches Adam's accuracy
with far less traffic than 1-bit Adam (the paper: up to 87% less data, 54% fewer rounds), while
the two naive ways of making Adam communicate less converge more slowly, because Adam is not
linear in its gradients. Five optimizers train the char-level GPT of
:mod:`benchmarks.convergence` on 8 simulated workers (its model, data, schedule shape and
policies, scaled to each run's length as there):

- ``adamw``: ``optax.adamw`` on float32 ``pmean``-averaged gradients;
- ``onebit_adam``: 1-bit Adam (full-precision warm-up to the freeze step, then 1-bit momentum);
- ``zero_one_adam``: 0/1 Adam with the doubling policies;
- ``onebit_grad_adam``: AdamW on the 1-bit compressed mean gradient from step 1
  (``optax.chain(onebit_mean(...), optax.adamw(...))``; no warm-up, no frozen variance);
- ``local_adam``: local AdamW (full-precision AdamW up to 0/1 Adam's freeze step, then local
  steps averaged in 1 bit on 0/1 Adam's sync schedule; each worker keeps its own moments):
  ``local_step_sync(optax.chain(scheduled_mean(...), optax.adamw(...)), ...)``.

Protocol, fixed before any run (no seed or run is picked afterwards):

1. Sweep: each optimizer at each peak learning rate of ``lrs`` for ``sweep_steps`` steps, seed
   ``sweep_seed``; its best learning rate is the one with the lowest final validation loss
   (a non-finite loss counts as worst). Should the best be the largest (smallest) rate tried,
   the grid is extended on that side by its own ratio, up to ``max_extensions`` times, so that
   no optimizer is held at the edge of a grid chosen for another (:func:`sweep`).
2. Long runs: each optimizer at its best learning rate for ``long_steps`` steps, once per seed
   of ``seeds`` (a seed sets the initial parameters and the data order). Reported: the mean
   and sample standard deviation (``ddof=1``) of the final validation loss over the seeds, the
   bytes sent per worker and the rounds over the whole run (identical for every seed: they
   follow from the step kinds), the wall time per step kind and per run, and a projection of
   the run time on a 1 and a 10 Gbit/s link: per step, the measured time of its kind (this
   CPU, 8 simulated workers, collectives included as memory copies) plus
   ``bytes / bandwidth + collectives x latency`` (50 us each), no overlap.

Every finished run is saved at once to ``<out>/<stem>.partial.json``; ``--resume`` reads it and
runs only what is missing (same settings); after the study, ``--resume`` re-aggregates the runs
kept in ``<stem>.json`` without training. At the end it writes ``<stem>.json`` (curves
subsampled: training loss in means over ``train_loss_block`` steps, validation loss every
``long_eval_every`` steps), ``.png`` and ``.md``; stem ``convergence_long`` (``--quick``:
``convergence_long_quick``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported; run() sets PJRT_NPROC

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from benchmarks.support import common, training  # noqa: E402

OPTIMIZERS = ("adamw", "onebit_adam", "zero_one_adam", "onebit_grad_adam", "local_adam")
LINKS = (("1 Gbit/s", 1.0), ("10 Gbit/s", 10.0))  # (name, Gbit/s) for the projection
LATENCY_US = 50.0  # per collective launch, an assumption (Ethernet-class, as comm_volume)


# Each optimizer on its authors' recipe (DeepSpeed's BERT pre-training configurations, durations
# scaled to the run; docs/benchmarks/convergence_long.md):
# - 0/1 Adam freezes its variance at the end of the learning-rate warm-up (5% of the run);
#   local_step_scaler alpha = 0.22 T (DeepSpeed's 32,678 of a ~150k-step run), H = 16, kappa = 16;
#   local Adam follows 0/1 Adam's freeze and sync schedule;
# - 1-bit Adam freezes at 15% of the run (DeepSpeed: 15-25%) with a momentum mask on the
#   token-embedding rows of characters seen fewer than 100 times
#   (docs/benchmarks/onebit_divergence.md);
# - AdamW and the naive compositions take the shared schedule only.
# The text: the standard library's sources (21.8M training characters), which 10,000 steps of
# 8 x 4 windows of 65 characters do not exhaust.
RECIPES = dataclasses.replace(
    training.PRESETS[("char_lm", "full")],
    corpus="stdlib",
    freeze=0.05,
    onebit_freeze=0.15,
    onebit_rare_mask=100,
)


@dataclasses.dataclass(frozen=True)
class Study:
    """The whole study: the sweep, then the long runs at each optimizer's best learning rate."""

    base: training.Config = RECIPES
    sweep_steps: int = 2000
    long_steps: int = 10_000
    lrs: tuple[float, ...] = (2e-3, 4e-3, 8e-3)
    sweep_seed: int = 0
    seeds: tuple[int, ...] = (0, 1, 2)
    sweep_eval_every: int = 500
    long_eval_every: int = 250
    train_loss_block: int = 100
    max_extensions: int = 2
    optimizers: tuple[str, ...] = OPTIMIZERS
    # optimizers whose long runs take fewer seeds than ``seeds`` (name, seeds): e.g. the naive
    # compositions, to fit a slower machine
    fewer_seeds: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def seeds_of(self, name: str) -> tuple[int, ...]:
        return dict(self.fewer_seeds).get(name, self.seeds)

    def config(self, name: str, steps: int, lr: float, seed: int, eval_every: int) -> Any:
        return dataclasses.replace(
            self.base,
            steps=steps,
            peak_lr=lr,
            seed=seed,
            eval_every=eval_every,
            optimizers=(name,),
        )


PRESETS = {
    # The study as run (docs/benchmarks/convergence_long.md): 6,000-step long runs, the sweep a
    # fifth of that; 3 seeds for AdamW, 1-bit Adam and 0/1 Adam, 1 for the naive compositions.
    # About 100 min on 2 cores at today's ~63 ms per step.
    "long": Study(
        sweep_steps=1200,
        long_steps=6000,
        fewer_seeds=(("onebit_grad_adam", (0,)), ("local_adam", (0,))),
    ),
    # The protocol at full length (10,000 steps, every optimizer on 3 seeds): ~3.5 h here today.
    "full": Study(),
    # A few-minute check of the whole pipeline: not long enough for the claims.
    "quick": Study(
        sweep_steps=400,
        long_steps=800,
        lrs=(1e-3, 2e-3),
        seeds=(0, 1),
        sweep_eval_every=200,
        long_eval_every=100,
        train_loss_block=50,
    ),
}


def recipe(name: str, cfg: Any, workload: Any) -> dict[str, Any]:
    """What optimizer ``name`` was given beyond the shared schedule: its policies and mask."""
    variance, local = cfg.policies()
    zero_one = {
        "var_freeze_step": variance.freeze_step,
        "var_update_scaler": variance.update_scaler,
        "local_step_scaler": local.scaler,
        "local_step_clipper": local.clipper,
    }
    if name == "zero_one_adam":
        return zero_one
    if name == "local_adam":
        return {"full_precision_steps": variance.freeze_step, **zero_one}
    if name.startswith(("diloco", "muloco")):
        return {
            "inner": "optax.contrib.muon" if name.startswith("muloco") else "optax.adamw",
            "sync_every": cfg.sync_every,
            "outer": f"optax.sgd({cfg.outer_lr}, momentum={cfg.outer_momentum}, nesterov=True)",
            "collective": training.loco_collective(name),
            **({"muon_lr_ratio": cfg.muon_lr_ratio} if name.startswith("muloco") else {}),
        }
    if name == "onebit_adam":
        out: dict[str, Any] = {"freeze_step": cfg.onebit_freeze_step()}
        if cfg.onebit_rare_mask:
            rare = np.flatnonzero(workload.token_counts < cfg.onebit_rare_mask)
            out["masked_token_rows"] = {
                "below_count": cfg.onebit_rare_mask,
                "tokens": [[workload.vocab[i], int(workload.token_counts[i])] for i in rare],
            }
        return out
    return {}


def text_seen(cfg: Any, workload: Any) -> dict[str, Any]:
    """How much text a long run reads, against the training text's size."""
    batch = np.asarray(workload.train_batch(0))
    per_step = int(batch.size)  # windows of context + 1 characters, all workers
    train = workload.data.get("chars_train")
    seen = per_step * cfg.steps
    return {
        "chars_per_step": per_step,
        "chars_seen": seen,
        "chars_train": train,
        "epochs": None if not train else round(seen / train, 3),
        # windows drawn uniformly: the expected share of training characters never read
        "expected_share_unread": None if not train else round(math.exp(-seen / train), 3),
    }


def _run_key(phase: str, name: str, value: float | int) -> str:
    return f"{phase}/{name}/{value:g}"


def _compact(run: dict[str, Any], block: int) -> dict[str, Any]:
    """One run as the study keeps it: finals, traffic, timings and subsampled curves."""
    losses = np.asarray(run["train_loss"], np.float64)
    blocks = len(losses) // block
    return {
        "final_val_loss": run["final_val"]["loss"],
        "bytes_per_worker": run["bytes_per_worker"],
        "rounds": run["rounds"],
        "steps_per_kind": run["steps_per_kind"],
        "traffic_per_kind": run["traffic_per_kind"],
        "seconds": run["seconds"],
        "val": {k: run["val"][k] for k in ("step", "bytes", "loss")},
        "train_loss_block_means": [
            round(float(x), 5) for x in losses[: blocks * block].reshape(blocks, block).mean(1)
        ],
    }


def best_lr(sweep: dict[float, float]) -> float:
    """The learning rate with the lowest final validation loss (non-finite: worst)."""
    return min(sweep, key=lambda lr: sweep[lr] if math.isfinite(sweep[lr]) else math.inf)


def sweep(study: Study, train: Any) -> dict[float, float]:
    """The sweep of one optimizer: ``train(lr) -> final validation loss`` for each rate of
    ``study.lrs``, then, while the best is at an edge of the rates tried (and at most
    ``study.max_extensions`` times), for the next rate beyond that edge."""
    losses = {lr: train(lr) for lr in study.lrs}
    ratio = study.lrs[-1] / study.lrs[-2] if len(study.lrs) > 1 else 2.0
    for _ in range(study.max_extensions):
        best = best_lr(losses)
        if best == max(losses) and math.isfinite(losses[best]):
            lr = best * ratio
        elif best == min(losses) and math.isfinite(losses[best]):
            lr = best / ratio
        else:
            break
        losses[float(f"{lr:.6g}")] = train(float(f"{lr:.6g}"))
    return dict(sorted(losses.items()))


def projected_seconds(run: dict[str, Any], gbit_s: float | None) -> float:
    """The run's time: per step, its kind's measured time plus (with a link) the kind's
    ``bytes / bandwidth + launches x latency``."""
    total = 0.0
    for kind, count in run["steps_per_kind"].items():
        traffic = run["traffic_per_kind"][kind]
        step = run["seconds"]["per_kind"][kind]
        if gbit_s is not None:
            step += traffic["bytes_per_step"] * 8 / (gbit_s * 1e9)
            step += traffic["launches_per_step"] * LATENCY_US * 1e-6
        total += count * step
    return total


def aggregate(study: Study, runs: dict[str, Any]) -> dict[str, Any]:
    """Per optimizer: the sweep, the best learning rate and the long runs' statistics."""
    out: dict[str, Any] = {}
    for name in study.optimizers:
        prefix = f"sweep/{name}/"
        swept = {float(k[len(prefix) :]): r for k, r in runs.items() if k.startswith(prefix)}
        losses = {lr: swept[lr]["final_val_loss"] for lr in sorted(swept)}
        lr = best_lr(losses)
        long = [runs[_run_key("long", name, seed)] for seed in study.seeds_of(name)]
        finals = np.asarray([r["final_val_loss"] for r in long], np.float64)
        sent = {r["bytes_per_worker"] for r in long}
        rounds = {r["rounds"] for r in long}
        if len(sent) != 1 or len(rounds) != 1:
            raise RuntimeError(f"{name}: seeds sent different bytes or rounds: {sent} {rounds}")
        kinds = sorted({k for r in long for k in r["seconds"]["per_kind"]})
        per_kind = {k: float(np.mean([r["seconds"]["per_kind"][k] for r in long])) for k in kinds}
        mean_run = {**long[0], "seconds": {"per_kind": per_kind}}
        out[name] = {
            # None: diverged (a non-finite loss)
            "sweep_final_val_loss": {
                f"{k:g}": v if math.isfinite(v) else None for k, v in losses.items()
            },
            "best_lr": lr,
            "seeds": list(study.seeds_of(name)),
            "steps": study.long_steps,
            "final_val_loss_per_seed": [float(x) for x in finals],
            # Where the validation loss was lowest during the run, and the training loss at its
            # end (mean of the last block): a final loss above the lowest, or far above the
            # training loss, means the model has begun to fit its training text.
            "lowest_val_loss_mean": float(
                np.mean([np.nanmin(np.asarray(r["val"]["loss"], np.float64)) for r in long])
            ),
            "final_train_loss_mean": float(
                np.mean([r["train_loss_block_means"][-1] for r in long])
            ),
            "final_val_loss_mean": float(finals.mean()),  # NaN (null) if a seed diverged
            "final_val_loss_std": float(finals.std(ddof=1)) if len(finals) > 1 else 0.0,
            "diverged_seeds": int(np.sum(~np.isfinite(finals))),
            "final_val_loss_mean_of_finite": float(np.mean(finals[np.isfinite(finals)]))
            if np.isfinite(finals).any()
            else math.nan,
            "bytes_per_worker": sent.pop(),
            "rounds": rounds.pop(),
            "steps_per_kind": long[0]["steps_per_kind"],
            "traffic_per_kind": long[0]["traffic_per_kind"],
            "seconds_per_step_by_kind": {k: round(v, 5) for k, v in per_kind.items()},
            "run_seconds_mean": round(float(np.mean([r["seconds"]["train"] for r in long])), 1),
            "projected_run_seconds": {
                "compute_only": round(projected_seconds(mean_run, None), 1),
                **{n: round(projected_seconds(mean_run, g), 1) for n, g in LINKS},
            },
        }
    return out


def summarize(per_opt: dict[str, Any]) -> dict[str, Any]:
    """The claims, measured: loss gaps to AdamW (% of its mean final loss) and 0/1 Adam's
    traffic reductions against 1-bit Adam (%)."""
    out: dict[str, Any] = {}
    if "adamw" in per_opt:
        # > 0: AdamW's validation loss rose from its lowest point (it began to overfit)
        adamw = per_opt["adamw"]
        out["adamw_final_above_lowest_val"] = round(
            adamw["final_val_loss_mean"] - adamw["lowest_val_loss_mean"], 5
        )
        base = per_opt["adamw"]["final_val_loss_mean"]
        for name, r in per_opt.items():
            r["gap_to_adamw_pct"] = round(100 * (r["final_val_loss_mean"] - base) / base, 3)
            out[f"{name}_gap_to_adamw_pct"] = r["gap_to_adamw_pct"]
    if {"zero_one_adam", "onebit_adam"} <= set(per_opt):
        mine, theirs = per_opt["zero_one_adam"], per_opt["onebit_adam"]
        less = 100 * (1 - mine["bytes_per_worker"] / theirs["bytes_per_worker"])
        fewer = 100 * (1 - mine["rounds"] / theirs["rounds"])
        out["zero_one_adam_bytes_reduction_vs_onebit_adam_pct"] = round(less, 2)
        out["zero_one_adam_rounds_reduction_vs_onebit_adam_pct"] = round(fewer, 2)
        gap = out.get("zero_one_adam_gap_to_adamw_pct")
        out["claims"] = {
            "loss_within_1pct_of_adamw": None if gap is None else bool(gap <= 1.0),
            "bytes_reduction_at_least_85pct": bool(less >= 85.0),
            "rounds_reduction_at_least_50pct": bool(fewer >= 50.0),
        }
    if "zero_one_adam" in per_opt:
        mine = per_opt["zero_one_adam"]["final_val_loss_mean"]
        for name in ("onebit_grad_adam", "local_adam"):
            if name in per_opt:
                gap = 100 * (per_opt[name]["final_val_loss_mean"] - mine) / mine
                out[f"{name}_gap_to_zero_one_adam_pct"] = round(gap, 3)
    return out


class _Store:
    """Finished runs, saved after each one so that an interrupted study can resume."""

    def __init__(self, path: pathlib.Path, study: Study, resume: bool) -> None:
        self.path, self.settings = path, _settings(study)
        self.runs: dict[str, Any] = {}
        final = path.with_name(path.name.replace(".partial.json", ".json"))
        if resume and not path.exists() and final.exists():  # a finished study: re-aggregate
            saved = json.loads(final.read_text())
            saved = {"settings": saved["study"], "runs": saved["runs"]}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(saved))
        if resume and path.exists():
            saved = json.loads(path.read_text())
            if _shaping(saved["settings"]) != _shaping(self.settings):
                raise SystemExit(
                    f"{path} was written with other settings: remove it, or drop --resume"
                )
            self.runs = saved["runs"]

    def save(self, key: str, run: dict[str, Any]) -> None:
        self.runs[key] = run
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"settings": self.settings, "runs": self.runs}))


def _settings(study: Study) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(study)))


# which optimizers and seeds a study runs: a resumed study may add some, its saved runs stand
_NOT_SHAPING_RUNS = ("optimizers", "seeds", "fewer_seeds")


def _shaping(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings that shape a saved run (all but which optimizers and seeds are run)."""
    return {k: v for k, v in settings.items() if k not in _NOT_SHAPING_RUNS}


def run(
    study: Study, out: pathlib.Path, stem: str, resume: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Runs (or resumes) the study; returns the JSON-ready result."""
    common.setup_cpu_devices(training.NUM_WORKERS)
    mesh = ozo.worker_mesh(common.AXIS, training.NUM_WORKERS)
    store = _Store(out / f"{stem}.partial.json", study, resume)
    workloads: dict[int, Any] = {}
    start, cpu = time.perf_counter(), time.process_time()

    def train(phase: str, name: str, value: float | int, cfg: Any) -> dict[str, Any]:
        key = _run_key(phase, name, value)
        if key not in store.runs:
            if cfg.seed not in workloads:
                workloads[cfg.seed] = training.make_workload(cfg)
            full = training.train(name, cfg, workloads[cfg.seed], mesh, progress)
            store.save(key, _compact(full, study.train_loss_block))
            loss = store.runs[key]["final_val_loss"]
            print(f"{key}: final val loss {loss:.4f}", file=sys.stderr, flush=True)
        return store.runs[key]

    best, seed, every = {}, study.sweep_seed, study.sweep_eval_every
    for name in study.optimizers:
        losses = sweep(
            study,
            lambda lr, name=name: train(
                "sweep", name, lr, study.config(name, study.sweep_steps, lr, seed, every)
            )["final_val_loss"],
        )
        best[name] = best_lr(losses)
    for seed in study.seeds:  # seeds outermost: an interrupted study has whole seeds
        for name in (n for n in study.optimizers if seed in study.seeds_of(n)):
            cfg = study.config(name, study.long_steps, best[name], seed, study.long_eval_every)
            train("long", name, seed, cfg)

    per_opt = aggregate(study, store.runs)
    cfg = study.config("", study.long_steps, 0.0, study.seeds[0], 1)
    workload = workloads.get(study.seeds[0]) or training.make_workload(cfg)
    for name, r in per_opt.items():
        r["recipe"] = recipe(name, cfg, workload)
    return {
        "benchmark": "convergence_long",
        "workload": workload.description,
        "num_workers": training.NUM_WORKERS,
        "study": _settings(study),
        "corpus": workload.data,
        "text_seen": text_seen(cfg, workload),
        "links": {"latency_us": LATENCY_US, "gbit_s": dict(LINKS)},
        "optimizers": per_opt,
        "summary": summarize(per_opt),
        "runs": store.runs,
        "wall_seconds_this_process": round(time.perf_counter() - start, 1),
        "cpu_seconds_this_process": round(time.process_time() - cpu, 1),
    }


def table(result: dict[str, Any]) -> str:
    """The main table, in Markdown."""
    head = [
        "optimizer",
        "sweep: peak LR (final val loss)",
        "best LR",
        "final val loss (mean ± std)",
        "lowest val loss",
        "final train loss",
        "gap to AdamW",
        "MB/worker",
        "rounds",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in result["optimizers"].items():
        gap = r.get("gap_to_adamw_pct")
        cells = [
            name,
            ", ".join(f"{lr} ({_number(v)})" for lr, v in r["sweep_final_val_loss"].items()),
            f"{r['best_lr']:g}",
            f"{_number(r['final_val_loss_mean'])} ± {_number(r['final_val_loss_std'])}"
            + (
                f" ({r['diverged_seeds']} of {len(r['seeds'])} seeds diverged; the others "
                f"{_number(r['final_val_loss_mean_of_finite'])})"
                if r["diverged_seeds"]
                else ""
            ),
            _number(r["lowest_val_loss_mean"]),
            _number(r["final_train_loss_mean"]),
            "-" if gap is None or name == "adamw" else f"{gap:+.2f}%",
            f"{r['bytes_per_worker'] / 1e6:,.1f}",
            f"{r['rounds']:,}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _number(x: float | None) -> str:
    return "diverged" if x is None or not math.isfinite(x) else f"{x:.4f}"


def time_table(result: dict[str, Any]) -> str:
    """Seconds per step kind and per run, measured and projected, in Markdown."""
    head = ["optimizer", "ms/step by kind", "run (s)", "compute only (s)"]
    head += [f"projected at {n} (s)" for n, _ in LINKS]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in result["optimizers"].items():
        kinds = ", ".join(
            f"{k} {1e3 * v:.1f} ({r['steps_per_kind'][k]:,})"
            for k, v in r["seconds_per_step_by_kind"].items()
        )
        p = r["projected_run_seconds"]
        cells = [name, kinds, f"{r['run_seconds_mean']:,.0f}", f"{p['compute_only']:,.0f}"]
        cells += [f"{p[n]:,.0f}" for n, _ in LINKS]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    """The sweep; validation loss against steps (mean over seeds, min-max band) and bytes."""
    plt = common.pyplot()
    fig, (sweep_ax, step_ax, bytes_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    runs, study = result["runs"], result["study"]
    for name, r in result["optimizers"].items():
        lrs = [float(k) for k in r["sweep_final_val_loss"]]
        swept = [np.nan if v is None else v for v in r["sweep_final_val_loss"].values()]
        (line,) = sweep_ax.plot(lrs, swept, marker="o")
        line.set_label(name)
        curves = [runs[_run_key("long", name, s)]["val"] for s in r["seeds"]]
        steps = np.asarray(curves[0]["step"])
        loss = np.asarray([c["loss"] for c in curves], np.float64)
        color = line.get_color()
        finite = np.isfinite(loss).all(1)  # seeds that did not diverge
        label = name if finite.all() else f"{name} ({(~finite).sum()} seed(s) diverged)"
        loss = loss[finite] if finite.any() else loss
        step_ax.plot(steps, loss.mean(0), color=color, label=label)
        step_ax.fill_between(steps, loss.min(0), loss.max(0), color=color, alpha=0.2)
        mb = np.asarray(curves[0]["bytes"]) / 1e6
        bytes_ax.plot(mb[1:], loss.mean(0)[1:], color=color, label=label)
    sweep_ax.set(
        xscale="log", xlabel="peak learning rate", ylabel="final validation loss",
        title=f"sweep: {study['sweep_steps']:,} steps, seed {study['sweep_seed']}",
    )  # fmt: skip
    step_ax.set(
        xlabel="step", ylabel="validation loss",
        title=f"{study['long_steps']:,} steps at the best LR, up to {len(study['seeds'])} seeds",
    )  # fmt: skip
    bytes_ax.set(
        xlabel="MB sent per worker (log)", ylabel="validation loss", xscale="log",
        title="validation loss vs communication",
    )  # fmt: skip
    for ax in (sweep_ax, step_ax, bytes_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    low = min(
        r["lowest_val_loss_mean"]
        for r in result["optimizers"].values()
        if r.get("lowest_val_loss_mean") is not None
    )
    for ax in (step_ax, bytes_ax):
        ax.set_ylim(low - 0.1, low + 1.0)
    fig.suptitle(f"{result['num_workers']} workers: {result['workload'].split(';')[0]}", fontsize=9)
    common.save_figure(fig, path)


def protocol_lines(result: dict[str, Any]) -> list[str]:
    """The report's lines on the protocol (sweep, long runs, seeds) and each recipe."""
    study = result["study"]
    return [
        f"- sweep: {study['sweep_steps']:,} steps at peak LR {study['lrs']}, seed "
        f"{study['sweep_seed']}; long runs: {study['long_steps']:,} steps, seeds {study['seeds']}"
        + "".join(f" ({n}: seeds {s})" for n, s in study["fewer_seeds"]),
        *(
            f"- {name}'s recipe: {r['recipe'] or 'the shared schedule only'}"
            for name, r in result["optimizers"].items()
        ),
    ]


def markdown(result: dict[str, Any]) -> str:
    """The tables, the claims and the settings, as a short Markdown report."""
    s, seen = result["summary"], result["text_seen"]
    lines = [
        f"# Convergence at length: {result['workload']}",
        "",
        table(result),
        "",
        time_table(result),
        "",
        *(f"- {key}: {value}" for key, value in s.items()),
        *protocol_lines(result),
        f"- text: {result['corpus'].get('corpus')} (sha256 {result['corpus'].get('sha256')}); a "
        f"long run reads {seen['chars_seen']:,} characters, {seen['epochs']} times the "
        f"{seen['chars_train']:,} training characters",
        f"- projection: measured ms/step of each kind + bytes / bandwidth + "
        f"{LATENCY_US:g} us per collective, no overlap",
        f"- this process: wall {result['wall_seconds_this_process']:.0f} s, CPU "
        f"{result['cpu_seconds_this_process']:.0f} s",
    ]
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out: pathlib.Path, stem: str) -> tuple[pathlib.Path, ...]:
    """Writes ``<stem>.json`` (standard JSON: a non-finite number becomes ``null``), ``.png``
    and ``.md``; removes the partial file."""
    result = _finite_or_none(result)
    paths = common.write_results(out / f"{stem}.json", result, markdown(result), plot)
    (out / f"{stem}.partial.json").unlink(missing_ok=True)
    return paths


def _finite_or_none(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _finite_or_none(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_finite_or_none(v) for v in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree


def main(argv: list[str] | None = None) -> None:
    parser = common.argument_parser("benchmarks.convergence_long", __doc__)
    parser.add_argument("--quick", action="store_true", help="a few-minute check, no claims")
    parser.add_argument("--full", action="store_true", help="10,000 steps, 3 seeds each (~3.5 h)")
    parser.add_argument("--resume", action="store_true", help="skip the runs already saved")
    parser.add_argument(
        "--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS), help="the rows"
    )
    parser.add_argument(
        "--out-dir", type=pathlib.Path, default=common.RESULTS, help="where to write (results/)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    preset = "quick" if args.quick else "full" if args.full else "long"
    study = dataclasses.replace(PRESETS[preset], optimizers=tuple(args.optimizers))
    stem = "convergence_long" + ("" if preset == "long" else f"_{preset}")
    result = run(study, args.out_dir, stem, resume=args.resume, progress=not args.no_progress)
    paths = write(result, args.out_dir, stem)
    print()
    print(table(result))
    print()
    print(time_table(result))
    print()
    for key, value in result["summary"].items():
        print(f"{key}: {value}")
    print(f"wrote {', '.join(map(str, paths))}")


if __name__ == "__main__":
    main()
