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
  (Adam on the 1-bit compressed gradient; local Adam with 1-bit model averaging), see ``EXTRA``.

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
``step_kind`` hint, read with :func:`optax_zero_one.parse_hlo` (``benchmarks/support/common.py``),
times the number of steps of that kind. Training runs one compiled program per step kind, the
host picking each step's (:func:`benchmarks.support.common.train_step`). The compressing
optimizers get the workload's mask of parameters whose gradient is always exactly zero
(``digits``: the constant corner pixels; ``char_lm``: none).

With ``--mesh 2x4`` the 8 workers are 2 nodes of 4 (``("node", "local")``) and the compressing
optimizers take ``fast_axis_name="local"`` (``docs/hierarchical.md``): exact means inside a node,
1-bit only across nodes. The flat 8-worker 0/1 Adam runs in the same process for comparison, and
bytes and rounds are reported per mesh axis and across nodes (:func:`across_nodes`).
``zero_one_adam_node_mean`` (``--optimizers``, with ``--mesh``) also averages the gradients inside
each node at every step, so that local steps are node-wide.

Writes ``results/convergence.json``, ``.png`` and ``.md`` (``--quick``: ``convergence_quick.*``;
``--workload digits``: ``convergence_digits*.*``; ``--mesh 2x4``: ``convergence_2x4.*``).
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_NPROC", "16")  # >= 2x the simulated devices (docs/testing.md)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from benchmarks.support import common, workloads  # noqa: E402

NUM_WORKERS = 8
OPTIMIZERS = ("adamw", "onebit_adam", "zero_one_adam")  # the default run
# On request (--optimizers): 0/1 Adam with the psum backend, and the two naive compositions the
# 0/1 Adam paper argues against (Adam is not linear, so compressing its input, or taking local
# steps of it, hurts): Adam on the 1-bit compressed gradient from step 1 (no warm-up, no frozen
# variance), and local Adam (full-precision Adam up to the freeze step, then local steps with 1-bit
# model averaging on 0/1 Adam's sync schedule; each worker keeps its own moments).
EXTRA = ("zero_one_adam_psum", "onebit_grad_adam", "local_adam")
# On a (node, local) mesh (--mesh): 0/1 Adam whose gradients are first averaged inside each node,
# so that local steps average there too (docs/hierarchical.md, "Local steps").
MESH_EXTRA = ("zero_one_adam_node_mean",)
RESULTS = pathlib.Path(__file__).resolve().parent.parent / "results"


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark run. Fractions are of ``steps``."""

    workload: str = "char_lm"
    model: tuple[tuple[str, int], ...] = ()
    steps: int = 2000
    eval_every: int = 100
    peak_lr: float = 2e-3
    warmup: float = 0.05
    final_lr: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    freeze: float = 0.15
    local_scaler: float = 0.22
    kappa: int = 16
    clipper: int = 16
    seed: int = 0
    optimizers: tuple[str, ...] = OPTIMIZERS
    mesh: tuple[int, ...] = ()  # (nodes, local): hierarchical compression; (): 8 flat workers

    def schedule(self) -> optax.Schedule:
        return optax.warmup_cosine_decay_schedule(
            0.0,
            self.peak_lr,
            max(1, round(self.warmup * self.steps)),
            self.steps,
            self.final_lr * self.peak_lr,
        )

    def policies(self) -> tuple[ozo.VarianceDoubling, ozo.LocalStepDoubling]:
        freeze = max(1, round(self.freeze * self.steps))
        alpha = max(1, round(self.local_scaler * self.steps))
        return ozo.VarianceDoubling(freeze, self.kappa), ozo.LocalStepDoubling(alpha, self.clipper)


SMALL_GPT = (("dim", 64), ("layers", 2), ("heads", 4), ("context", 64), ("batch_per_worker", 4))
PRESETS = {
    ("char_lm", "full"): Config(model=SMALL_GPT, steps=1200, eval_every=100),
    ("char_lm", "quick"): Config(model=SMALL_GPT, steps=800, eval_every=50),
    ("digits", "full"): Config(
        workload="digits", model=(("hidden", 128),), steps=1200, eval_every=100, peak_lr=3e-3
    ),
    ("digits", "quick"): Config(
        workload="digits", model=(("hidden", 64),), steps=300, eval_every=50, peak_lr=3e-3
    ),
}
PROJECT_TO = (10_000, 50_000, 150_000)


def make_workload(cfg: Config) -> workloads.Workload:
    build = {"char_lm": workloads.char_lm, "digits": workloads.digits}[cfg.workload]
    return build(NUM_WORKERS, seed=cfg.seed, **dict(cfg.model))


def _mean_inside_node() -> optax.GradientTransformation:
    """The float mean of the updates over ``local`` (the workers of one node)."""
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda updates, state, params=None: (jax.lax.pmean(updates, "local"), state),
    )


def make_spec(name: str, cfg: Config, mask: Any = None) -> common.OptimizerSpec:
    lr, adam = cfg.schedule(), dict(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    variance, local = cfg.policies()
    # the compressing optimizers run over the nodes, exact inside each, on a (node, local) mesh
    axes = (
        dict(axis_name="node", fast_axis_name="local") if cfg.mesh else dict(axis_name=common.AXIS)
    )
    if name == "adamw":
        return common.OptimizerSpec(
            name, optax.adamw(lr, weight_decay=cfg.weight_decay, **adam), average_grads=True
        )
    if name == "onebit_adam":
        tx = ozo.onebit_adam(
            lr,
            weight_decay=cfg.weight_decay,
            freeze_step=variance.freeze_step,
            mask=mask,
            **axes,
            **adam,
        )
        return common.onebit_spec(name, tx, variance.freeze_step)
    if name in ("zero_one_adam", "zero_one_adam_psum", "zero_one_adam_node_mean"):
        tx = ozo.scale_by_zero_one_adam(
            lr,
            weight_decay=cfg.weight_decay,
            variance_policy=variance,
            local_step_policy=local,
            mask=mask,
            collective="psum" if name.endswith("_psum") else "two_phase",
            **axes,
            **adam,
        )
        if name.endswith("_node_mean"):
            if not cfg.mesh:
                raise ValueError(f"{name} needs a (node, local) mesh: pass --mesh")
            tx = optax.chain(_mean_inside_node(), tx)
        return common.zero_one_spec(name, tx, variance, local)
    if name == "onebit_grad_adam":
        inner = optax.chain(
            ozo.onebit_mean(mask=mask, **axes),
            optax.adamw(lr, weight_decay=cfg.weight_decay, **adam),
        )
        return common.OptimizerSpec(name, ozo.flatten(inner, **axes), False, ("compressed",))
    if name == "local_adam":
        warmup = ozo.FullPrecisionWarmup(variance.freeze_step)
        inner = optax.chain(
            ozo.scheduled_mean(variance_policy=warmup, compressed_steps=False, **axes),
            optax.adamw(lr, weight_decay=cfg.weight_decay, **adam),
        )
        tx = ozo.local_step_sync(inner, local, start_step=warmup.freeze_step, mask=mask, **axes)
        return common.zero_one_spec(name, ozo.flatten(tx, **axes), warmup, local)
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS + EXTRA + MESH_EXTRA}")


# Compiled programs, per configuration without its seed (the seed changes data, not programs),
# so that a second run of one configuration in the same process does not compile again.
_PROGRAMS: dict[Any, Any] = {}
_TRAFFIC: dict[Any, Any] = {}


def _programs(cfg: Config, name: str, workload: workloads.Workload, mesh: Any, args: Any) -> Any:
    key = (dataclasses.replace(cfg, seed=0, optimizers=()), name)
    if key not in _PROGRAMS:
        spec = make_spec(name, cfg, workload.mask)
        start = time.perf_counter()
        step = common.train_step(spec, workload.loss, mesh)
        # One program per step kind the run takes, compiled before it (the calls then reuse them).
        taken = [0] if spec.schedule is None else np.unique(spec.schedule.indices(cfg.steps))
        compiled = {int(k): step.program(int(k)).lower(*args).compile() for k in taken}
        axes = common.worker_axes(mesh)
        evaluate = jax.jit(
            ozo.on_workers(
                lambda p, s, b: workload.eval_sums(ozo.synchronized_params(p, s), b), mesh, axes
            )
        )
        evaluate = evaluate.lower(args[0], args[1], ozo.to_workers(workload.eval_batch, mesh, axes))
        # The bytes of each kind depend on the shapes and the kinds, not on the learning rate:
        # one traffic table per configuration without its rate.
        traffic = _TRAFFIC.setdefault((dataclasses.replace(key[0], peak_lr=0.0), name), {})
        _PROGRAMS[key] = (
            spec,
            step,
            compiled.get(0),
            evaluate.compile(),
            time.perf_counter() - start,
            traffic,
        )
    return _PROGRAMS[key]


def across_nodes(traffic: common.KindTraffic, nodes: tuple[int, ...]) -> float:
    """Bytes one worker sends across nodes in a step of this kind, on ``nodes = (S, L)``: what
    a hierarchical program sends over axes other than ``local``; for a flat program, the share
    ``(N-L)/(N-1)`` of its bytes that goes to the workers of other nodes (exact for the
    all-to-all and all-gather of a 1-bit step, an estimate for a ring all-reduce)."""
    per_axis = dict(traffic.per_axis)
    if "node" in per_axis or "local" in per_axis:
        return float(sum(v for axis, v in per_axis.items() if axis != "local"))
    n = nodes[0] * nodes[1]
    return traffic.sent_bytes * (n - nodes[1]) / (n - 1)


def train(
    name: str,
    cfg: Config,
    workload: workloads.Workload,
    mesh: Any,
    progress: bool = True,
    nodes: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Trains one optimizer; returns its curves, step kinds, traffic and timings (with
    ``nodes = (S, L)``, also the bytes across nodes of that cluster: :func:`across_nodes`)."""
    axes = common.worker_axes(mesh)
    init = jax.jit(
        ozo.on_workers(lambda p: make_spec(name, cfg, workload.mask).tx.init(p), mesh, axes)
    )
    params = ozo.replicate(workload.init_params(cfg.seed), NUM_WORKERS)
    params = ozo.to_workers(params, mesh, axes)
    state = init(params)
    batch = ozo.to_workers(workload.train_batch(0), mesh, axes)
    spec, step, compiled, evaluate, compile_s, traffic_cache = _programs(
        cfg, name, workload, mesh, (params, state, batch)
    )
    eval_batch = ozo.to_workers(workload.eval_batch, mesh, axes)

    def validate(params: Any, state: Any) -> dict[str, float]:
        sums = {
            k: np.asarray(v, np.float64).sum()
            for k, v in evaluate(params, state, eval_batch).items()
        }
        return {k: float(v / sums["count"]) for k, v in sums.items() if k != "count"}

    val_steps, val_metrics = [0], [validate(params, state)]
    losses, kinds, step_s, eval_s = [], [], [], 0.0
    bar = _progress(range(cfg.steps), name, progress)
    for i in bar:
        start = time.perf_counter()
        batch = ozo.to_workers(workload.train_batch(i), mesh, axes)
        params, state, loss, kind = common.run_step(step, params, state, batch)
        losses.append(float(np.asarray(loss).mean()))
        kinds.append(kind)  # the kind of the program that ran, chosen on the host
        step_s.append(time.perf_counter() - start)
        if (i + 1) % cfg.eval_every == 0 or i + 1 == cfg.steps:
            start = time.perf_counter()
            val_steps.append(i + 1)
            val_metrics.append(validate(params, state))
            eval_s += time.perf_counter() - start
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{losses[-1]:.3f}", val=f"{val_metrics[-1]['loss']:.3f}")

    if spec.schedule is not None and ozo.step_count(state) != cfg.steps:  # a step not applied
        raise RuntimeError(f"{name}: the state took {ozo.step_count(state)} of {cfg.steps} steps")
    start = time.perf_counter()
    first = common.first_step_of_each_kind(kinds)
    key = tuple(sorted(first.items()))
    if key not in traffic_cache:
        traffic_cache[key] = common.traffic_per_kind(
            spec, workload.loss, mesh, first, (params, state, batch), compiled=compiled
        )
    traffic = traffic_cache[key]
    account_s = time.perf_counter() - start
    sent = np.cumsum(common.bytes_per_step(kinds, traffic))
    counts = np.bincount(kinds, minlength=len(spec.kind_names))
    train_s, step_s = float(np.sum(step_s)), np.asarray(step_s)
    across = {}
    if nodes:
        cum = np.cumsum([across_nodes(traffic[k], nodes) for k in kinds])
        across = {"bytes_across_nodes": [0.0 if s == 0 else float(cum[s - 1]) for s in val_steps]}
    return {
        "final_val": val_metrics[-1],
        "bytes_per_worker": float(sent[-1]),
        "bytes_per_worker_by_axes": {
            axis: float(
                sum(counts[k] * dict(t.per_axis).get(axis, 0.0) for k, t in traffic.items())
            )
            for axis in sorted({a for t in traffic.values() for a, _ in t.per_axis})
        },
        "rounds": int(sum(counts[k] for k, t in traffic.items() if t.launches > 0)),
        "rounds_by_axes": {
            axis: int(sum(counts[k] for k, t in traffic.items() if dict(t.per_axis).get(axis)))
            for axis in sorted({a for t in traffic.values() for a, _ in t.per_axis})
        },
        "steps_per_kind": {spec.kind_names[k]: int(c) for k, c in enumerate(counts) if c},
        "traffic_per_kind": {
            t.name: {
                "bytes_per_step": t.sent_bytes,
                "launches_per_step": t.launches,
                "collectives": list(t.collectives),
            }
            for t in traffic.values()
        },
        "seconds": {
            "train": round(train_s, 2),
            "per_step": round(train_s / cfg.steps, 4),
            # Median wall time of a step of each kind (host batch, step, wait), this process.
            "per_kind": {
                spec.kind_names[k]: round(float(np.median(step_s[np.asarray(kinds) == k])), 5)
                for k in range(len(spec.kind_names))
                if counts[k]
            },
            "eval": round(eval_s, 2),
            "compile": round(compile_s, 2),
            "comm_accounting": round(account_s, 2),
        },
        "train_loss": [round(x, 5) for x in losses],
        "val": {
            "step": val_steps,
            "bytes": [0.0 if s == 0 else float(sent[s - 1]) for s in val_steps],
            **across,
            **{k: [round(m[k], 5) for m in val_metrics] for k in val_metrics[0]},
        },
    }


def _progress(steps: range, name: str, enabled: bool) -> Any:
    if not enabled:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc=f"{name:>14}", unit="step", file=sys.stderr, mininterval=1.0)


def run(cfg: Config, progress: bool = True) -> dict[str, Any]:
    """Trains every optimizer of ``cfg`` and returns the JSON-ready result (no files written)."""
    common.setup_cpu_devices(NUM_WORKERS)
    flat_mesh = ozo.worker_mesh(common.AXIS, NUM_WORKERS)
    mesh = common.node_mesh(*cfg.mesh) if cfg.mesh else flat_mesh
    workload = make_workload(cfg)
    variance, local = cfg.policies()
    start, cpu = time.perf_counter(), time.process_time()
    nodes = cfg.mesh
    runs = {name: train(name, cfg, workload, mesh, progress, nodes) for name in cfg.optimizers}
    if cfg.mesh:  # the flat 8-worker run of the same configuration, for comparison
        flat = dataclasses.replace(cfg, mesh=())
        runs["zero_one_adam_flat"] = train(
            "zero_one_adam", flat, workload, flat_mesh, progress, nodes
        )
    result = {
        "benchmark": "convergence",
        "workload": workload.description,
        "num_workers": NUM_WORKERS,
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


def kind_steps(cfg: Config, kind: str) -> np.ndarray:
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


def project(cfg: Config, runs: dict[str, Any]) -> dict[str, Any]:
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
    fig.suptitle(f"{NUM_WORKERS} workers{shape}: {result['workload'].split(';')[0]}", fontsize=9)
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
    parser.add_argument("--workload", choices=("char_lm", "digits"), default="char_lm")
    parser.add_argument("--steps", type=int, help="override the number of steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kappa", type=int, help="0/1 Adam's var_update_scaler")
    parser.add_argument("--lr", type=float, help="override the peak learning rate")
    parser.add_argument(
        "--optimizers", nargs="+", choices=OPTIMIZERS + EXTRA + MESH_EXTRA, default=list(OPTIMIZERS)
    )
    parser.add_argument(
        "--mesh",
        help="NODESxLOCAL, e.g. 2x4: the compressing optimizers compress across nodes only "
        "(exact inside each); the flat 8-worker 0/1 Adam runs too, for comparison",
    )
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.long:
        from benchmarks import convergence_long

        convergence_long.main(["--quick"] if args.quick else [])
        return

    common.setup_cpu_devices(NUM_WORKERS)
    cfg = PRESETS[(args.workload, "quick" if args.quick else "full")]
    overrides = {"seed": args.seed, "optimizers": tuple(args.optimizers)}
    if args.steps:
        overrides["steps"] = args.steps
    if args.kappa:
        overrides["kappa"] = args.kappa
    if args.lr:
        overrides["peak_lr"] = args.lr
    if args.mesh:
        overrides["mesh"] = tuple(int(v) for v in args.mesh.lower().split("x"))
        if len(overrides["mesh"]) != 2 or overrides["mesh"][0] * overrides["mesh"][1] != 8:
            parser.error(f"--mesh must be NODESxLOCAL with 8 workers in all, got {args.mesh}")
    cfg = dataclasses.replace(cfg, **overrides)
    variance, local = cfg.policies()
    print(make_workload(cfg).description)
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
