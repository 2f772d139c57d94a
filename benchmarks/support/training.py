"""Training one optimizer on a convergence workload: what ``benchmarks.convergence`` and
``benchmarks.convergence_long`` share.

A run is a :class:`Config` (workload, model, schedule, the optimizers' hyperparameters and
policies scaled to the run length; :data:`PRESETS` holds the benchmarks' own). :func:`make_spec`
builds each optimizer of :data:`OPTIMIZERS`, :data:`EXTRA` and :data:`MESH_EXTRA` as an
:class:`benchmarks.support.common.OptimizerSpec`; :func:`train` trains it on
:data:`NUM_WORKERS` workers (one compiled program per step kind, chosen on the host) and returns
its curves, step kinds, timings and the bytes it sent, each step kind's bytes read from the
compiled training step (:func:`benchmarks.support.common.traffic_per_kind`).

Importing this module imports JAX: a script sets ``JAX_PLATFORMS`` before it (see
``benchmarks/support/common.py``).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import numpy as np
import optax

import optax_zero_one as ozo
from benchmarks.support import common, workloads

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
# DiLoCo's family (benchmarks.diloco): AdamW (Muon for MuLoCo) inside, Nesterov momentum
# outside (lr 0.7, momentum 0.9, Douillard et al.), a sync every ``sync_every`` steps; the
# average of the deltas exact in float32 or 1-bit with error feedback (two-phase, or for
# ``muloco_psum`` the psum backend: each worker's signs summed as integer counts).
LOCO = ("diloco_float", "diloco_1bit", "diloco_psum", "muloco_1bit", "muloco_psum")


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark run. Fractions are of ``steps``."""

    workload: str = "char_lm"
    model: tuple[tuple[str, int], ...] = ()
    corpus: str = "pydoc"  # char_lm's text: "pydoc" or "stdlib" (workloads.char_lm)
    steps: int = 2000
    eval_every: int = 100
    peak_lr: float = 2e-3
    warmup: float = 0.05
    final_lr: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    freeze: float = 0.15  # 0/1 Adam's variance freeze (and 1-bit Adam's, unless onebit_freeze)
    local_scaler: float = 0.22
    onebit_freeze: float | None = None  # 1-bit Adam's freeze, if not ``freeze``
    # 1-bit Adam's momentum mask also zeroes the token-embedding rows of tokens seen fewer than
    # this many times in the training text (workloads.rare_token_mask); 0: the workload's mask.
    onebit_rare_mask: int = 0
    kappa: int = 16
    clipper: int = 16
    sync_every: int = 50  # DiLoCo's H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    muon_lr_ratio: float = 5.0  # MuLoCo: Muon's peak rate over ``peak_lr`` (AdamW's, non-matrix)
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

    def onebit_freeze_step(self) -> int:
        """1-bit Adam's last full-precision step."""
        freeze = self.freeze if self.onebit_freeze is None else self.onebit_freeze
        return max(1, round(freeze * self.steps))


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


def loco_collective(name: str) -> str:
    """How a DiLoCo row averages at a sync: ``*_float`` exactly, ``*_psum`` with the 1-bit
    psum backend (signs summed as integer counts), the rest with the two-phase 1-bit mean."""
    if name.endswith("_float"):
        return "float"
    return "psum" if name.endswith("_psum") else "two_phase"


def make_workload(cfg: Config) -> workloads.Workload:
    """``cfg``'s workload (model and data) for :data:`NUM_WORKERS` workers."""
    if cfg.workload == "char_lm":
        return workloads.char_lm(NUM_WORKERS, seed=cfg.seed, corpus=cfg.corpus, **dict(cfg.model))
    if cfg.corpus != "pydoc":
        raise ValueError(f"corpus={cfg.corpus!r} is for char_lm, not {cfg.workload}")
    return workloads.digits(NUM_WORKERS, seed=cfg.seed, **dict(cfg.model))


def optimizer_mask(name: str, cfg: Config, workload: workloads.Workload) -> Any:
    """The mask optimizer ``name`` gets: the workload's, or for 1-bit Adam with
    ``cfg.onebit_rare_mask``, that and the rows of rare tokens."""
    if name == "onebit_adam" and cfg.onebit_rare_mask:
        return workloads.rare_token_mask(workload, cfg.onebit_rare_mask)
    return workload.mask


def _mean_inside_node() -> optax.GradientTransformation:
    """The float mean of the updates over ``local`` (the workers of one node)."""
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda updates, state, params=None: (jax.lax.pmean(updates, "local"), state),
    )


def make_spec(name: str, cfg: Config, mask: Any = None) -> common.OptimizerSpec:
    """Optimizer ``name`` (one of :data:`OPTIMIZERS`, :data:`EXTRA`, :data:`MESH_EXTRA`) as
    ``cfg`` sets it up; ``mask`` (the workload's, 0 where a gradient is always exactly zero)
    goes to the compressing optimizers."""
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
        freeze = cfg.onebit_freeze_step()
        tx = ozo.onebit_adam(
            lr, weight_decay=cfg.weight_decay, freeze_step=freeze, mask=mask, **axes, **adam
        )
        return common.onebit_spec(name, tx, freeze)
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
    if name in LOCO:
        inner = (
            optax.contrib.muon(
                lambda count: cfg.muon_lr_ratio * lr(count),
                adam_learning_rate=lr,
                weight_decay=cfg.weight_decay,
                adam_weight_decay=cfg.weight_decay,
                adam_b1=cfg.b1,
                adam_b2=cfg.b2,
            )
            if name.startswith("muloco")
            else optax.adamw(lr, weight_decay=cfg.weight_decay, **adam)
        )
        outer = optax.sgd(cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
        collective = loco_collective(name)
        tx = ozo.diloco(inner, outer, cfg.sync_every, collective=collective, mask=mask, **axes)
        if not name.startswith("muloco"):  # Muon needs the leaves' own shapes
            tx = ozo.flatten(tx, **axes)
        warmup, sync = ozo.FullPrecisionWarmup(0), ozo.SyncEvery(cfg.sync_every)
        return common.zero_one_spec(name, tx, warmup, sync)
    known = OPTIMIZERS + EXTRA + MESH_EXTRA + LOCO
    raise ValueError(f"unknown optimizer {name!r}; choose from {known}")


# Compiled programs, per configuration without its seed (the seed changes data, not programs),
# so that a second run of one configuration in the same process does not compile again.
_PROGRAMS: dict[Any, Any] = {}
_TRAFFIC: dict[Any, Any] = {}


def _programs(cfg: Config, name: str, workload: workloads.Workload, mesh: Any, args: Any) -> Any:
    key = (dataclasses.replace(cfg, seed=0, optimizers=()), name)
    if key not in _PROGRAMS:
        spec = make_spec(name, cfg, optimizer_mask(name, cfg, workload))
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
    spec_tx = make_spec(name, cfg, optimizer_mask(name, cfg, workload)).tx
    init = jax.jit(ozo.on_workers(spec_tx.init, mesh, axes))
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
