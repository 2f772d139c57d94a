"""Data volume, communication rounds and collective launches of Adam, 1-bit Adam and 0/1 Adam.

``python -m benchmarks.comm_volume`` (options: ``--help``). For each model (default BERT-Large;
``--models bert-base bert-large gpt2`` for the three the paper trained, see
:mod:`benchmarks.support.model_trees`) and each worker count ``N`` (default 8, 16, 32, 64, 128):

1. **What one step of each kind sends** is read from compiled programs, not estimated: one
   optimizer update per step kind is compiled (compile only, ``jax.ShapeDtypeStruct`` inputs) on
   ``N`` simulated CPU devices under ``jax.shard_map``, for that kind alone through the
   ``step_kind`` hint (so that the program holds no other), and its collectives are read
   (:func:`benchmarks.support.common.update_comm_stats`). Each program is checked against
   ``docs/algorithm.md``: variance / warm-up / Adam = float32 all-reduce only; compressed /
   sync = one u8 all-to-all + one u8 all-gather; local = nothing.
2. **How many steps of each kind a run has** comes from walking the optimizers' own policy
   objects over the whole run (no model is run): default BERT-Large seq-128 pre-training as in
   DeepSpeed's recipes (4K batch, 152,500 steps; 1-bit Adam ``freeze_step`` 23,000; 0/1 Adam
   ``var_freeze_step`` 12,500, ``var_update_scaler`` 16, ``local_step_scaler`` 32,678,
   ``local_step_clipper`` 16).
3. Per optimizer and ``N``: bytes sent per worker over the run, rounds (steps that communicate),
   collective launches, reductions against Adam and 1-bit Adam; what DeepSpeed would launch (4
   collectives per compressed buffer per communicating step; a buffer is each tensor in fp32
   mode, each parameter group's flat vector in fp16 mode); the fused collective's bytes against
   the 1-bit information limit ``2 (N-1)/N numel/8`` with padding and scale overheads; and a
   latency-bandwidth **projection** of step time on 10/40/100 Gbit/s Ethernet and 200 Gbit/s
   InfiniBand.

Compile cost. Every step kind of every optimizer is compiled at every ``N`` (a BERT-Large
program compiles in seconds since the optimizers work on flat buffers). Programs are compiled
with ``FAST_COMPILE`` (no LLVM optimisation of the generated code; ``--full-compile`` to turn it
off). Stats are cached per (model, N, optimizer, kind) within the run and in
``results/comm_volume_cache.json`` across runs, keyed by a hash of the library's source and
everything else a program depends on: an interrupted run resumes, and a rerun against an
unchanged library compiles nothing (``--cache ''`` to disable).

Writes ``results/comm_volume.json``, ``results/comm_volume.png`` (cumulative bytes per worker
over the run, log scale) and ``results/comm_volume.md`` (the tables as printed, without the
progress lines).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX is imported; main() sets PJRT_NPROC from the options
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from benchmarks.support import common, model_trees  # noqa: E402

ADAM, ONEBIT, ZERO_ONE = "Adam", "1-bit Adam", "0/1 Adam"
OPTIMIZERS = (ADAM, ONEBIT, ZERO_ONE)
KIND_NAMES = {ADAM: ("step",), ONEBIT: ozo.core.kinds.ONEBIT_STEP_KINDS, ZERO_ONE: ozo.STEP_KINDS}

# Communication classes, and the class docs/algorithm.md says each step kind must be.
FLOAT, ONE_BIT, SILENT = "float all-reduce", "1-bit", "none"
# ... and on a (node, local) mesh with fast_axis_name="local" (docs/hierarchical.md)
FLOAT_H, ONE_BIT_H = "exact in node, float across", "exact in node, 1-bit across"
EXPECTED_H = {FLOAT: FLOAT_H, ONE_BIT: ONE_BIT_H, SILENT: SILENT}
EXPECTED = {
    (ADAM, "step"): FLOAT,
    (ONEBIT, "warmup"): FLOAT,
    (ONEBIT, "compressed"): ONE_BIT,
    (ZERO_ONE, "variance"): FLOAT,
    (ZERO_ONE, "compressed"): ONE_BIT,
    (ZERO_ONE, "local"): SILENT,
    (ZERO_ONE, "sync"): ONE_BIT,
}

# DeepSpeed's engine all-reduces full-precision gradients in buckets of this many elements
# (its default ``allreduce_bucket_size``, 5e8): one launch per bucket.
DEEPSPEED_BUCKET = 500_000_000

# Compute time per step, default: BERT-Large seq-128 pre-training on V100s. NVIDIA's PyTorch
# BERT (DeepLearningExamples, PyTorch/LanguageModeling/BERT, its README: "Pre-training NVIDIA
# DGX-1 With 32G", pytorch:19.07 container) runs 171.52 sequences/s on one V100-32GB with mixed
# precision, sequence length 128, batch 64; DeepSpeed's 1-bit / 0/1 Adam BERT-Large recipes use
# a global batch of 4,096 sequences (deepspeed_bsz4k_*_config_seq128.json). Assumed: each
# worker computes global_batch / N sequences per step at that rate (gradient accumulation where
# needed), with no overlap of computation and communication.
V100_SEQ_PER_S = 171.52
GLOBAL_BATCH = 4_096

# (name, Gbit/s, per-hop latency in microseconds). Latencies are assumptions: ~50 us per message
# for NCCL over TCP sockets, ~5 us over InfiniBand verbs. Each worker is assumed to have the
# full link bandwidth to itself.
NETWORKS = (
    ("10 GbE", 10.0, 50.0),
    ("40 GbE", 40.0, 50.0),
    ("100 GbE", 100.0, 50.0),
    ("200 Gb IB", 200.0, 5.0),
)


# Links for the hierarchical projection: (name, (Gbit/s, latency us) per worker inside a node,
# the same across nodes). The first pair is set by --fast-gbit/--slow-gbit (default: 400 Gbit/s
# inside, 100 across); the others are fixed: H100 NVLink 4 (450 GB/s each way, 3,600 Gbit/s)
# with one 400 Gbit/s InfiniBand NDR or one 100 Gbit/s Ethernet NIC per GPU, and a PCIe-class
# node on 25 Gbit/s Ethernet. Latencies are assumptions, as for NETWORKS.
LINK_PAIRS = (
    ("NVLink 4 / 400 Gb IB", (3600.0, 2.0), (400.0, 5.0)),
    ("NVLink 4 / 100 GbE", (3600.0, 2.0), (100.0, 50.0)),
    ("PCIe-class / 25 GbE", (400.0, 2.0), (25.0, 50.0)),
)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The training run whose step kinds are counted (defaults: BERT-Large seq-128)."""

    steps: int = 152_500
    onebit_freeze_step: int = 23_000
    var_freeze_step: int = 12_500
    var_update_scaler: int = 16
    local_step_scaler: int = 32_678
    local_step_clipper: int = 16

    def variance_policy(self) -> ozo.VarianceDoubling:
        return ozo.VarianceDoubling(self.var_freeze_step, self.var_update_scaler)

    def local_step_policy(self) -> ozo.LocalStepDoubling:
        return ozo.LocalStepDoubling(self.local_step_scaler, self.local_step_clipper)


def step_kinds(schedule: Schedule) -> dict[str, np.ndarray]:
    """The kind (index into :data:`KIND_NAMES`) of every step of the run, per optimizer.

    From the library: :func:`optax_zero_one.step_kinds` and :func:`optax_zero_one.onebit_schedule`'s
    ``indices``, which walk the same policy objects the optimizer is built with.
    """
    return {
        ADAM: np.zeros(schedule.steps, np.int8),
        ONEBIT: ozo.onebit_schedule(schedule.onebit_freeze_step).indices(schedule.steps),
        ZERO_ONE: ozo.step_kinds(
            schedule.variance_policy(), schedule.local_step_policy(), schedule.steps
        ),
    }


def kind_counts(kinds: dict[str, np.ndarray]) -> dict[str, dict[str, int]]:
    """``{optimizer: {kind name: number of steps}}``."""
    return {
        opt: dict(zip(KIND_NAMES[opt], np.bincount(k, minlength=len(KIND_NAMES[opt])).tolist()))
        for opt, k in kinds.items()
    }


Workers = int | tuple[int, int]  # N flat workers, or (nodes, workers per node)


def optimizer_spec(
    optimizer: str, schedule: Schedule, num_workers: Workers
) -> common.OptimizerSpec:
    """The optimizer as compiled: built for ``num_workers`` workers on axis ``common.AXIS``, or
    for ``(nodes, local)`` on ``("node", "local")`` with hierarchical compression."""
    if optimizer == ADAM:
        return common.OptimizerSpec(ADAM, optax.adam(1e-3), average_grads=True)
    axes: dict[str, Any] = dict(axis_name=common.AXIS, num_workers=num_workers)
    if isinstance(num_workers, tuple):
        axes = dict(axis_name="node", fast_axis_name="local", num_workers=num_workers)
    if optimizer == ONEBIT:
        tx = ozo.onebit_adam(1e-3, freeze_step=schedule.onebit_freeze_step, **axes)
        return common.onebit_spec(ONEBIT, tx, schedule.onebit_freeze_step)
    variance, local = schedule.variance_policy(), schedule.local_step_policy()
    tx = ozo.scale_by_zero_one_adam(1e-3, variance_policy=variance, local_step_policy=local, **axes)
    return common.zero_one_spec(ZERO_ONE, tx, variance, local)


@dataclasses.dataclass(frozen=True)
class KindStats:
    """What one step of one kind sends, per worker, read from a compiled program.

    Attributes:
      collectives: one dict per collective instruction (kind, dtypes, payload and sent bytes,
        group size).
      sent_bytes: bytes one worker sends in that step.
      launches: collective executions in that step.
      comm_class: :data:`FLOAT`, :data:`ONE_BIT`, :data:`SILENT`, or a description of anything
        else.
      source: which program the numbers were read from (``optimizer/kind@step, N=``).
      compile_s: wall seconds spent tracing and compiling it (0 when reused).
      compile_cpu_s: CPU seconds of this process (all threads) for the same.
    """

    collectives: tuple[dict, ...]
    sent_bytes: float
    launches: int
    comm_class: str
    source: str
    compile_s: float
    compile_cpu_s: float


def classify(
    stats: ozo.integration.comm_stats.CommStats, mesh: jax.sharding.Mesh | None = None
) -> str:
    """The communication class of a compiled program (see :data:`EXPECTED`; with the ``(node,
    local)`` ``mesh`` of a hierarchical program, :data:`EXPECTED_H`)."""
    if any(c.conditional or c.executions != 1 for c in stats.collectives):
        return "ambiguous (collective in a branch or loop)"
    kinds = sorted(c.kind for c in stats.collectives)
    dtypes = {d for c in stats.collectives for d in c.dtypes}
    if not kinds:
        return SILENT
    if set(kinds) == {"all-reduce"} and dtypes == {"f32"}:
        return FLOAT
    if kinds == ["all-gather", "all-to-all"] and dtypes == {"u8"}:
        return ONE_BIT
    if mesh is not None:
        seen = sorted(("+".join(c.mesh_axes(mesh)), c.kind, *c.dtypes) for c in stats.collectives)
        float_h = [("local", "all-gather", "f32"), ("local", "reduce-scatter", "f32")]
        if seen == sorted([*float_h, ("node", "all-reduce", "f32")]):
            return FLOAT_H
        one_bit_h = [("local", "all-gather", "u8"), ("local", "reduce-scatter", "f32")]
        if seen == sorted([*one_bit_h, ("node", "all-gather", "u8"), ("node", "all-to-all", "u8")]):
            return ONE_BIT_H
    return "unexpected: " + ", ".join(f"{c.kind}[{','.join(c.dtypes)}]" for c in stats.collectives)


def expected_class(optimizer: str, kind: str, num_workers: Workers) -> str:
    """The class :func:`classify` must find for ``optimizer``'s ``kind`` (Adam's pmean over a
    ``(node, local)`` mesh stays one float all-reduce)."""
    flat = EXPECTED[(optimizer, kind)]
    return EXPECTED_H[flat] if isinstance(num_workers, tuple) and optimizer != ADAM else flat


def compile_kind(
    optimizer: str,
    kind: str,
    step: int,
    params: Any,
    num_workers: Workers,
    schedule: Schedule,
    compiler_options: dict[str, Any] | None,
) -> KindStats:
    """Compiles ``optimizer``'s update for the kind of ``step`` (``kind``, through the
    ``step_kind`` hint) and reads its traffic."""
    spec = optimizer_spec(optimizer, schedule, num_workers)
    start, cpu = time.perf_counter(), time.process_time()
    stats = common.update_comm_stats(
        spec, params, num_workers, None if optimizer == ADAM else step, compiler_options
    )
    mesh = common.mesh_of(num_workers)
    collectives = tuple(
        {
            "kind": c.kind,
            "dtypes": list(c.dtypes),
            "payload_bytes": c.payload_bytes,
            "sent_bytes": c.sent_bytes,
            "group_size": c.group_size,
            "axes": "+".join(c.mesh_axes(mesh)),
        }
        for c in stats.collectives
    )
    return KindStats(
        collectives,
        stats.sent_bytes_per_device,
        stats.launches,
        classify(stats, mesh if isinstance(num_workers, tuple) else None),
        f"{optimizer}/{kind}@{step}, N={num_workers}",
        time.perf_counter() - start,
        time.process_time() - cpu,
    )


class Accountant:
    """Compiles (and caches) the per-kind traffic of each optimizer for a model and ``N``.

    Args:
      params: one worker's parameter tree (``jax.ShapeDtypeStruct``).
      schedule: the run (fixes the optimizers' hyperparameters and the first step of each kind).
      compiler_options: passed to XLA (default: ``common.FAST_COMPILE``).
      progress: called with one line per compiled program.
      label: the model's name, for progress lines and cache keys.
      cache_path: a JSON file of stats from earlier runs, keyed by everything the program
        depends on (the library's source, JAX's version, compiler options, the tree's shapes,
        the schedule, N, optimizer and kind); new stats are added as they are compiled, so an
        interrupted run resumes and a rerun with an unchanged library compiles nothing.
    """

    def __init__(
        self,
        params: Any,
        schedule: Schedule,
        compiler_options: dict[str, Any] | None = common.FAST_COMPILE,
        progress: Callable[[str], None] = print,
        label: str = "",
        cache_path: str | os.PathLike | None = None,
    ) -> None:
        self.params, self.schedule = params, schedule
        self.compiler_options, self.progress, self.label = compiler_options, progress, label
        self.kinds = step_kinds(schedule)
        self.first_step = {
            (opt, KIND_NAMES[opt][kind]): step
            for opt, seq in self.kinds.items()
            for kind, step in common.first_step_of_each_kind(seq).items()
        }
        self.cache: dict[tuple[int, str, str], KindStats] = {}
        self.compiled = 0
        self.cache_path = pathlib.Path(cache_path) if cache_path else None
        self.disk: dict[str, dict] = {}
        if self.cache_path and self.cache_path.exists():
            self.disk = json.loads(self.cache_path.read_text())
        self.fingerprint = _fingerprint(params, schedule, compiler_options, label)

    def _compile(self, n: Workers, optimizer: str, kind: str) -> KindStats:
        key = (n, optimizer, kind)
        disk_key = f"{self.fingerprint}|{n}|{optimizer}|{kind}"
        if key not in self.cache and disk_key in self.disk:
            saved = self.disk[disk_key]
            saved["collectives"] = tuple(saved["collectives"])
            self.cache[key] = KindStats(**saved)
            self.progress(
                f"  {self.label} N={_workers(n):<5} {optimizer:<10} {kind:<10} from "
                f"{self.cache_path}: "
                f"{saved['comm_class']}, {saved['sent_bytes']:,.0f} B/worker"
            )
        if key not in self.cache:
            step = self.first_step[(optimizer, kind)]
            self.progress(
                f"  compiling {self.label} N={_workers(n):<5} {optimizer:<10} {kind:<10} "
                f"(step {step:,}) ..."
            )
            stats = compile_kind(
                optimizer, kind, step, self.params, n, self.schedule, self.compiler_options
            )
            self.compiled += 1
            want = expected_class(optimizer, kind, n)
            mark = "" if stats.comm_class == want else "  <-- UNEXPECTED"
            self.progress(
                f"    {stats.comm_class}: {stats.launches} launch(es), "
                f"{stats.sent_bytes:,.0f} B/worker (compiled in {stats.compile_s:.0f} s, "
                f"{stats.compile_cpu_s:.0f} CPU s){mark}"
            )
            self.cache[key] = stats
            if self.cache_path:
                self.disk[disk_key] = dataclasses.asdict(stats)
                self.cache_path.parent.mkdir(parents=True, exist_ok=True)
                self.cache_path.write_text(json.dumps(self.disk, indent=1))
        return self.cache[key]

    def per_kind(self, n: Workers) -> dict[tuple[str, str], KindStats]:
        """``{(optimizer, kind): KindStats}`` for every kind that occurs in the run, at ``N``
        workers (or ``(nodes, local)``: hierarchical)."""
        needed = sorted(self.first_step, key=lambda ok: (OPTIMIZERS.index(ok[0]), ok[1]))
        return {ok: self._compile(n, *ok) for ok in needed}


def _fingerprint(params: Any, schedule: Schedule, options: Any, label: str) -> str:
    """A hash of everything a compiled program's collectives depend on."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(ozo.__file__).parent.rglob("*.py")):  # core/, integration/
        digest.update(path.read_bytes())
    shapes = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(params)]
    extra = (jax.__version__, repr(options), label, repr(shapes), repr(schedule))
    digest.update(repr(extra).encode())
    return digest.hexdigest()[:16]


def deepspeed_launches(counts_by_class: dict[str, int], leaves: int, numel: int) -> dict:
    """Collective launches DeepSpeed's 1-bit / 0/1 Adam would issue over the run.

    Full-precision steps: one all-reduce per gradient bucket of :data:`DEEPSPEED_BUCKET`
    elements. Compressed steps: 4 collectives (all-to-all of signs, all-gather of scales, twice)
    per compressed buffer: each tensor in fp32 mode, each parameter group's flat fp16 master
    copy in fp16 mode (one group, or two: with and without weight decay).
    """
    full = counts_by_class.get(FLOAT, 0) * math.ceil(numel / DEEPSPEED_BUCKET)
    compressed = counts_by_class.get(ONE_BIT, 0)
    return {
        "fp32_per_tensor": full + 4 * leaves * compressed,
        "fp16_1_group": full + 4 * compressed,
        "fp16_2_groups": full + 8 * compressed,
    }


def summarize(
    counts: dict[str, dict[str, int]],
    per_kind: dict[tuple[str, str], KindStats],
    leaves: int,
    numel: int,
) -> dict[str, dict]:
    """Per optimizer: bytes per worker, rounds, launches (ours and DeepSpeed's), reductions."""
    rows = {}
    for opt in OPTIMIZERS:
        by_class: dict[str, int] = {}
        total = {"bytes_per_worker": 0.0, "rounds": 0, "collective_launches": 0}
        for kind, count in counts[opt].items():
            if count == 0:
                continue
            s = per_kind[(opt, kind)]
            total["bytes_per_worker"] += count * s.sent_bytes
            total["rounds"] += count if s.launches > 0 else 0
            total["collective_launches"] += count * s.launches
            by_class[s.comm_class] = by_class.get(s.comm_class, 0) + count
        rows[opt] = {
            **total,
            "steps_by_kind": dict(counts[opt]),
            "steps_by_class": by_class,
            "deepspeed_launches": deepspeed_launches(by_class, leaves, numel),
        }
    for row in rows.values():
        for ref, name in ((ADAM, "vs_adam"), (ONEBIT, "vs_onebit")):
            row[f"reduction_{name}"] = {
                key: 1.0 - row[key] / rows[ref][key] if rows[ref][key] else 0.0
                for key in ("bytes_per_worker", "rounds", "collective_launches")
            }
    return rows


def one_bit_limit(
    leaf_sizes: Sequence[int], num_workers: int, layout: ozo.core.flat.Layout | None = None
) -> dict[str, float]:
    """Bytes per worker of one fused 1-bit step, split into the information limit and overheads.

    ``limit = 2 (N-1)/N numel/8`` (one bit per element in each phase); padding: each leaf is
    padded to a multiple of ``N lcm(N, 8)`` and each of its ``N`` chunks to a multiple of the
    layout's block size ``B`` (:class:`optax_zero_one.core.flat.Layout`: 8 below ~8M parameters per
    worker row, then larger), so one phase sends ``N C / 8`` bytes of signs in all (``C`` the
    layout's width); scales: 4 bytes per leaf and worker, sent to all ``N`` workers in the
    all-to-all and gathered from all in the all-gather.

    Args:
      leaf_sizes: elements of each leaf (used to build the layout when none is given).
      num_workers: ``N``.
      layout: the tree's :class:`optax_zero_one.core.flat.Layout` for ``N`` workers (default: one of
        1-D leaves of ``leaf_sizes``, which has the same columns).
    """
    n, leaves = num_workers, len(leaf_sizes)
    layout = layout or ozo.core.flat.Layout.of(
        [jax.ShapeDtypeStruct((int(s),), "f4") for s in leaf_sizes], n
    )
    numel = sum(leaf_sizes)
    padded = n * layout.width
    limit = 2 * (n - 1) / n * numel / 8
    padding = 2 * (n - 1) / n * (padded - numel) / 8
    scales = (n - 1) / n * n * 4 * leaves + (n - 1) * 4 * leaves
    return {
        "limit_bytes": limit,
        "padding_bytes": padding,
        "scale_bytes": scales,
        "expected_bytes": limit + padding + scales,
    }


def limit_check(measured: float, leaf_sizes: Sequence[int], num_workers: int) -> dict:
    """The measured compressed-step bytes against :func:`one_bit_limit`."""
    parts = one_bit_limit(leaf_sizes, num_workers)
    return {
        **parts,
        "measured_bytes": measured,
        "ratio_to_limit": measured / parts["limit_bytes"],
        "padding_fraction": parts["padding_bytes"] / parts["limit_bytes"],
        "scale_fraction": parts["scale_bytes"] / parts["limit_bytes"],
        "explained": abs(measured - parts["expected_bytes"]) <= 1e-6 * measured + 1,
        "within_2_percent": measured <= 1.02 * parts["limit_bytes"],
    }


_HOPS = {"all-reduce": lambda n: 2 * (n - 1), "all-to-all": lambda n: n - 1}


def comm_time(
    stats: KindStats,
    num_workers: int,
    gbit_s: float,
    latency_us: float,
    links: dict[str, tuple[float, float]] | None = None,
) -> float:
    """Latency-bandwidth time of one step's collectives: ``hops * latency + sent / bandwidth``.

    Hops: a ring all-reduce over a group of ``n`` takes ``2 (n-1)`` steps, an all-to-all and an
    all-gather ``n-1`` (``n`` the collective's group size, else ``num_workers``). ``links`` maps
    the mesh axes of a collective (e.g. ``"local"``) to its own ``(Gbit/s, latency us)``; the
    others use ``gbit_s`` and ``latency_us``.
    """
    total = 0.0
    for c in stats.collectives:
        gbit, latency = (links or {}).get(c.get("axes", ""), (gbit_s, latency_us))
        hops = _HOPS.get(c["kind"], lambda n: n - 1)(c.get("group_size", num_workers))
        total += hops * latency * 1e-6 + c["sent_bytes"] * 8 / (gbit * 1e9)
    return total


def hierarchical(
    counts: dict[str, dict[str, int]],
    flat: dict[tuple[str, str], KindStats],
    hier: dict[tuple[str, str], KindStats],
    num_workers: int,
    compute_s: float,
    links: Sequence[tuple[str, tuple[float, float], tuple[float, float]]],
) -> dict[str, dict]:
    """Per optimizer, over the run and per worker: bytes across nodes and inside them, rounds
    across nodes, against the same workers as one flat axis; and projected step times for each
    ``(name, fast, slow)`` of ``links`` (a model: in the flat run every collective spans nodes,
    so it goes at the ``slow`` link's ``(Gbit/s, latency us)``; in the hierarchical one the
    collectives over ``local`` go at the ``fast`` link's)."""
    rows = {}
    for opt in OPTIMIZERS:
        across = inside = flat_bytes = 0.0
        rounds = 0
        t_flat = dict.fromkeys([name for name, _, _ in links], 0.0)
        t_hier = dict(t_flat)
        for kind, count in counts[opt].items():
            if not count:
                continue
            by_axes: dict[str, float] = {}
            for c in hier[(opt, kind)].collectives:
                by_axes[c["axes"]] = by_axes.get(c["axes"], 0.0) + c["sent_bytes"]
            cross = sum(v for axes, v in by_axes.items() if axes != "local")
            across += count * cross
            inside += count * by_axes.get("local", 0.0)
            rounds += count if cross > 0 else 0
            flat_bytes += count * flat[(opt, kind)].sent_bytes
            for name, fast, slow in links:
                t_flat[name] += count * comm_time(flat[(opt, kind)], num_workers, *slow)
                hier_s = comm_time(hier[(opt, kind)], num_workers, *slow, {"local": fast})
                t_hier[name] += count * hier_s
        steps = sum(counts[opt].values())
        rows[opt] = {
            "flat_bytes_per_worker": flat_bytes,
            "across_nodes_bytes_per_worker": across,
            "inside_node_bytes_per_worker": inside,
            "rounds_across_nodes": rounds,
            "across_vs_flat": across / flat_bytes if flat_bytes else 0.0,
            "projected_step_s": {
                name: {
                    "flat": compute_s + t_flat[name] / steps,
                    "hierarchical": compute_s + t_hier[name] / steps,
                }
                for name, _, _ in links
            },
        }
    return rows


def project(
    counts: dict[str, dict[str, int]],
    per_kind: dict[tuple[str, str], KindStats],
    num_workers: int,
    compute_s: float,
    networks: Sequence[tuple[str, float, float]] = NETWORKS,
) -> dict[str, dict]:
    """Projected mean step time per optimizer and network, and the speedups (a model, not a
    measurement: compute + latency-bandwidth communication, no overlap)."""
    out = {}
    for name, gbit_s, latency_us in networks:
        times = {}
        for opt in OPTIMIZERS:
            total = sum(
                count
                * (compute_s + comm_time(per_kind[(opt, kind)], num_workers, gbit_s, latency_us))
                for kind, count in counts[opt].items()
                if count
            )
            times[opt] = total / sum(counts[opt].values())
        out[name] = {
            "mean_step_s": times,
            "speedup_zero_one_vs_adam": times[ADAM] / times[ZERO_ONE],
            "speedup_zero_one_vs_onebit": times[ONEBIT] / times[ZERO_ONE],
            "speedup_onebit_vs_adam": times[ADAM] / times[ONEBIT],
        }
    return out


def bytes_per_step(kinds: np.ndarray, optimizer: str, per_kind: dict) -> np.ndarray:
    """Bytes each worker sends at each step of the run."""
    table = np.asarray(
        [
            per_kind[(optimizer, k)].sent_bytes if (optimizer, k) in per_kind else 0.0
            for k in KIND_NAMES[optimizer]
        ]
    )
    return table[kinds]


# ----------------------------------------------------------------------------------------------
# Command line


def _bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:,.1f} {unit}"
    return f"{x:,.0f} B"


def error_buffer_bytes(optimizer: str, schedule: Schedule, params: Any, n: Workers) -> int:
    """Bytes per worker of ``optimizer``'s error-feedback buffers (every
    :class:`optax_zero_one.OnebitMeanState` in its state), from ``init``'s shapes."""
    if optimizer == ADAM:
        return 0
    state = jax.eval_shape(optimizer_spec(optimizer, schedule, n).tx.init, params)
    buffers = jax.tree.leaves(
        [s for s in jax.tree.leaves(state, is_leaf=_is_errors) if _is_errors(s)]
    )
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in buffers))


def _is_errors(x: Any) -> bool:
    return isinstance(x, ozo.OnebitMeanState)


def _workers(n: Workers) -> str:
    return f"{n[0]}x{n[1]}" if isinstance(n, tuple) else str(n)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def print_tables(
    model: str, info: dict, schedule: Schedule, results: dict, say: Callable[[str], None] = print
) -> None:
    say(
        f"\n{model}: {info['numel']:,} parameters in {info['leaves']} leaves; run of "
        f"{schedule.steps:,} steps. Per worker over the whole run:"
    )
    say(
        f"{'N':>4}  {'optimizer':<11}{'bytes':>11}{'vs Adam':>9}{'vs 1-bit':>9}{'rounds':>9}"
        f"{'vs 1-bit':>9}{'launches':>10}{'DS fp32':>13}{'DS fp16x1':>11}{'DS fp16x2':>11}"
    )
    for n, rows in results.items():
        for opt, r in rows.items():
            ds = r["deepspeed_launches"]
            say(
                f"{n:>4}  {opt:<11}{_bytes(r['bytes_per_worker']):>11}"
                f"{_pct(r['reduction_vs_adam']['bytes_per_worker']):>9}"
                f"{_pct(r['reduction_vs_onebit']['bytes_per_worker']):>9}{r['rounds']:>9,}"
                f"{_pct(r['reduction_vs_onebit']['rounds']):>9}{r['collective_launches']:>10,}"
                f"{ds['fp32_per_tensor']:>13,}{ds['fp16_1_group']:>11,}{ds['fp16_2_groups']:>11,}"
            )


def print_hierarchical(
    nodes: tuple[int, int],
    rows: dict[str, dict],
    links: Sequence[tuple[str, tuple[float, float], tuple[float, float]]],
    compute_s: float,
    say: Callable[[str], None] = print,
) -> None:
    n = math.prod(nodes)
    say(
        f"\nHierarchical, {nodes[0]} nodes x {nodes[1]} workers (fast_axis_name: exact inside a "
        f"node, compressed across), per worker over the run; flat = the same {n} workers on one "
        "axis, all of whose collectives span nodes:"
    )
    say(
        f"  {'optimizer':<11}{'flat':>11}{'across nodes':>14}{'vs flat':>9}{'inside node':>13}"
        f"{'rounds across':>15}"
    )
    for opt, r in rows.items():
        say(
            f"  {opt:<11}{_bytes(r['flat_bytes_per_worker']):>11}"
            f"{_bytes(r['across_nodes_bytes_per_worker']):>14}{_pct(r['across_vs_flat']):>9}"
            f"{_bytes(r['inside_node_bytes_per_worker']):>13}{r['rounds_across_nodes']:>15,}"
        )
    say("  error-feedback buffers per worker (from init's shapes), flat -> hierarchical:")
    for opt, r in rows.items():
        e = r.get("error_buffer_bytes")
        if e and e["flat"]:
            say(
                f"  {opt:<11}{_bytes(e['flat']):>11} -> {_bytes(e['hierarchical'])} "
                f"(x{e['hierarchical'] / e['flat']:.3f})"
            )
    say(
        f"PROJECTION (latency-bandwidth model, not a measurement), {compute_s:.3f} s compute per "
        "step, links per worker (Gbit/s, latency) inside a node / across nodes; mean step time "
        "flat -> hierarchical (speedup of hierarchical over flat):"
    )
    say(f"  {'optimizer':<11}" + "".join(f"{name:>30}" for name, _, _ in links))
    say(
        f"  {'':<11}"
        + "".join(f"{f'{f[0]:g}/{s[0]:g} ({f[1]:g}/{s[1]:g} us)':>30}" for _, f, s in links)
    )
    for opt, r in rows.items():
        cells = []
        for name, _, _ in links:
            t = r["projected_step_s"][name]
            ratio = t["flat"] / t["hierarchical"]
            cells.append(f"{t['flat']:.3f} -> {t['hierarchical']:.3f} s (x{ratio:.2f})")
        say(f"  {opt:<11}" + "".join(f"{c:>30}" for c in cells))


def _library_version() -> str:
    """``optax_zero_one``'s version and the git commit of the checkout (``+dirty`` if changed)."""
    import subprocess

    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "optax_zero_one"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return ozo.__version__
    return f"{ozo.__version__} ({commit}{'+dirty' if dirty else ''})"


def build_parser() -> argparse.ArgumentParser:
    d = Schedule()
    p = common.argument_parser("benchmarks.comm_volume", __doc__)
    p.add_argument(
        "--models",
        nargs="+",
        default=["bert-large"],
        choices=list(model_trees.MODELS),
        help="parameter trees",
    )
    p.add_argument(
        "--workers", nargs="+", type=int, default=[8, 16, 32, 64, 128], help="worker counts N"
    )
    p.add_argument("--steps", type=int, default=d.steps, help="steps of the whole run")
    p.add_argument("--freeze-step", type=int, default=d.onebit_freeze_step, help="1-bit Adam")
    p.add_argument("--var-freeze-step", type=int, default=d.var_freeze_step, help="0/1 Adam's F")
    p.add_argument("--var-update-scaler", type=int, default=d.var_update_scaler, help="kappa")
    p.add_argument("--local-step-scaler", type=int, default=d.local_step_scaler, help="alpha")
    p.add_argument("--local-step-clipper", type=int, default=d.local_step_clipper, help="H")
    p.add_argument("--full-compile", action="store_true", help="XLA's default LLVM optimisation")
    p.add_argument(
        "--compute-time",
        type=float,
        default=None,
        help="seconds of computation per step (default: global batch / N / seq-per-s)",
    )
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH, help="for the time projection")
    p.add_argument("--seq-per-s", type=float, default=V100_SEQ_PER_S, help="per worker")
    p.add_argument("--eth-latency-us", type=float, default=50.0, help="per collective, Ethernet")
    p.add_argument("--ib-latency-us", type=float, default=5.0, help="per collective, InfiniBand")
    p.add_argument(
        "--plot-workers",
        type=int,
        default=64,
        help="N of the figure (if not one of --workers: the largest of them)",
    )
    p.add_argument(
        "--nodes",
        default="8x8",
        help="NODESxLOCAL for the hierarchical table (fast_axis_name; '' to skip)",
    )
    p.add_argument("--fast-gbit", type=float, default=400.0, help="per worker, inside a node")
    p.add_argument(
        "--fast-latency-us", type=float, default=2.0, help="per collective, inside a node"
    )
    p.add_argument("--slow-gbit", type=float, default=100.0, help="per worker, across nodes")
    p.add_argument(
        "--slow-latency-us", type=float, default=5.0, help="per collective, across nodes"
    )
    p.add_argument(
        "--cache",
        default="results/comm_volume_cache.json",
        help="stats of earlier runs, reused when nothing they depend on changed ('' = none)",
    )
    p.add_argument("--out", default="results/comm_volume.json", help="the JSON (.md beside it)")
    p.add_argument("--plot", default="results/comm_volume.png", help="the figure")
    return p


def plot(path: pathlib.Path, curves: dict[str, dict[str, np.ndarray]], n: int) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4), squeeze=False)
    for ax, (model, per_opt) in zip(axes[0], curves.items()):
        for opt, per_step in per_opt.items():
            cumulative = np.cumsum(per_step)
            idx = np.unique(np.linspace(0, len(cumulative) - 1, 1500).astype(int))
            ax.plot(idx + 1, cumulative[idx], label=f"{opt} ({_bytes(cumulative[-1])})")
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("cumulative bytes sent per worker")
        ax.set_title(f"{model}, N = {n} workers")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    workers = sorted(set(args.workers))
    nodes = common.node_split(args.nodes) if args.nodes else None
    if args.nodes and nodes is None:
        raise SystemExit(
            f"--nodes must be NODESxLOCAL (e.g. 8x8) or an empty string, got {args.nodes!r}"
        )
    common.setup_cpu_devices(max(workers + ([math.prod(nodes)] if nodes else [])))
    # the figure's N: --plot-workers if it is one of --workers, else the largest of them
    plot_workers = args.plot_workers if args.plot_workers in workers else workers[-1]
    schedule = Schedule(
        args.steps,
        args.freeze_step,
        args.var_freeze_step,
        args.var_update_scaler,
        args.local_step_scaler,
        args.local_step_clipper,
    )
    options = None if args.full_compile else common.FAST_COMPILE
    networks = [
        (name, gbit, args.ib_latency_us if "IB" in name else args.eth_latency_us)
        for name, gbit, _ in NETWORKS
    ]
    started = time.perf_counter()
    report: list[str] = []  # what is printed, less the progress lines: the Markdown report

    def say(text: str = "") -> None:
        print(text, flush=True)
        report.append(text)

    kinds = step_kinds(schedule)
    counts = kind_counts(kinds)
    say(f"Step kinds over {schedule.steps:,} steps (walked from the optimizers' policies):")
    for opt, c in counts.items():
        say(f"  {opt:<11}" + ", ".join(f"{k} {v:,}" for k, v in c.items()))

    out: dict[str, Any] = {
        "command": "python -m benchmarks.comm_volume " + " ".join(argv or sys.argv[1:]),
        "library": _library_version(),
        "schedule": dataclasses.asdict(schedule),
        "step_kinds": counts,
        "compiler_options": options,
        "projection_assumptions": {
            "compute_s_per_step": args.compute_time
            or f"{args.global_batch} / N / {args.seq_per_s} (V100 BERT-Large seq-128)",
            "networks": [{"name": a, "gbit_s": b, "latency_us": c} for a, b, c in networks],
            "model": "compute + sum over collectives of hops * latency + bytes / bandwidth; "
            "no overlap; ring all-reduce 2(N-1) hops, all-to-all and all-gather N-1",
        },
        "models": {},
    }
    curves: dict[str, dict[str, np.ndarray]] = {}
    for model in args.models:
        tree = model_trees.MODELS[model]()
        sizes = [leaf.size for leaf in jax.tree.leaves(tree)]
        info = {"numel": sum(sizes), "leaves": len(sizes)}
        print(f"\n{model}: {info['numel']:,} parameters, {info['leaves']} leaves", flush=True)
        acct = Accountant(tree, schedule, options, label=model, cache_path=args.cache)
        acct.progress = lambda line: print(line, flush=True)
        per_n, limits, projections, programs = {}, {}, {}, {}
        for n in workers:
            per_kind = acct.per_kind(n)
            programs[n] = {f"{o}/{k}": dataclasses.asdict(s) for (o, k), s in per_kind.items()}
            per_n[n] = summarize(counts, per_kind, info["leaves"], info["numel"])
            compressed = per_kind.get((ONEBIT, "compressed")) or per_kind.get(
                (ZERO_ONE, "compressed")
            )
            if compressed is not None:
                limits[n] = limit_check(compressed.sent_bytes, sizes, n)
            compute = args.compute_time or args.global_batch / n / args.seq_per_s
            projections[n] = {
                "compute_s": compute,
                **project(counts, per_kind, n, compute, networks),
            }
            if n == plot_workers:
                curves[model] = {o: bytes_per_step(kinds[o], o, per_kind) for o in OPTIMIZERS}
        print_tables(model, info, schedule, per_n, say)
        say("\nFused 1-bit step vs the information limit 2(N-1)/N numel/8 (bytes per worker):")
        for n, lim in limits.items():
            ok = "ok" if lim["within_2_percent"] else "OVER 2%"
            say(
                f"  N={n:<4}measured {lim['measured_bytes']:>14,.0f}  limit "
                f"{lim['limit_bytes']:>14,.0f}  x{lim['ratio_to_limit']:.4f} ({ok}); padding "
                f"+{100 * lim['padding_fraction']:.2f}%, scales +{100 * lim['scale_fraction']:.3f}%"
                f"; measured = limit + padding + scales: {lim['explained']}"
            )
        say("\nPROJECTION (latency-bandwidth model, not a measurement): speedup of 0/1 Adam")
        say(f"{'N':>4} {'compute':>9}  " + "  ".join(f"{name:>20}" for name, _, _ in networks))
        say(f"{'':>4} {'s/step':>9}  " + "  ".join(f"{'vs Adam / vs 1-bit':>20}" for _ in networks))
        for n, proj in projections.items():
            cells = [
                f"{proj[name]['speedup_zero_one_vs_adam']:>8.2f}x / "
                f"{proj[name]['speedup_zero_one_vs_onebit']:.2f}x"
                for name, _, _ in networks
            ]
            say(f"{n:>4} {proj['compute_s']:>9.3f}  " + "  ".join(f"{c:>20}" for c in cells))
        hier_rows = None
        if nodes:
            n = math.prod(nodes)
            compute = args.compute_time or args.global_batch / n / args.seq_per_s
            first = (
                f"{args.fast_gbit:g} / {args.slow_gbit:g} Gbit/s",
                (args.fast_gbit, args.fast_latency_us),
                (args.slow_gbit, args.slow_latency_us),
            )
            links = [first, *LINK_PAIRS]
            hier_kind = acct.per_kind(nodes)
            programs[_workers(nodes)] = {
                f"{o}/{k}": dataclasses.asdict(s) for (o, k), s in hier_kind.items()
            }
            hier_rows = hierarchical(counts, acct.per_kind(n), hier_kind, n, compute, links)
            for opt, row in hier_rows.items():
                row["error_buffer_bytes"] = {
                    "flat": error_buffer_bytes(opt, schedule, tree, n),
                    "hierarchical": error_buffer_bytes(opt, schedule, tree, nodes),
                }
            print_hierarchical(nodes, hier_rows, links, compute, say)
        out["models"][model] = {
            **info,
            "hierarchical": hier_rows
            and {
                "nodes": nodes[0],
                "local": nodes[1],
                "links": [
                    {"name": name, "fast_gbit_latency_us": f, "slow_gbit_latency_us": s}
                    for name, f, s in links
                ],
                "per_optimizer": hier_rows,
            },
            "per_workers": {str(n): per_n[n] for n in workers},
            "information_limit": {str(n): v for n, v in limits.items()},
            "projection": {str(n): v for n, v in projections.items()},
            "programs": {str(n): v for n, v in programs.items()},
            "programs_compiled": acct.compiled,
        }
    out["wall_s"] = time.perf_counter() - started
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=float))
    if curves and args.plot:
        plot(pathlib.Path(args.plot), curves, plot_workers)
    md = path.with_suffix(".md")
    head = f"# `{out['command'].strip()}` (library {out['library']}, {out['wall_s']:,.0f} s)"
    md.write_text("\n".join([head, "", "```", *report, "```", ""]))
    print(f"\nwrote {path}, {md}" + (f" and {args.plot}" if curves and args.plot else ""))
    print(f"total {out['wall_s']:.0f} s")
    return out


if __name__ == "__main__":
    main()
