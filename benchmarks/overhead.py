"""Optimizer overhead on CPU: compile time and step time of 0/1 Adam and 1-bit Adam against Adam.

``python -m benchmarks.overhead [--quick] [--params 4e6] [--leaves 100 10] [--repeats 9]``

Five measurements. All but the last run on one CPU device with the data-parallel workers
simulated by ``jax.vmap(axis_name=...)`` (so the 1-bit compression, packing and unpacking really
run; the all-to-all and all-gather become local copies of packed bytes), every program being the
whole update ``params, state <- apply_updates(params, update(grads, state, params))``:

1. **Compile time**, shapes only (``jax.jit(...).lower(...).compile()``), ``--compile-workers``
   (8) workers, for ``zero_one_adam`` and ``onebit_adam`` against ``optax.adam`` after a
   ``lax.pmean`` of the gradients, on GPT-2-like trees of 100 and 400 leaves
   (``model_trees.gpt2(layers, 64, vocab=1000, positions=64)``, 8 and 33 layers): the update
   without a hint (every kind in one program), the program of the first step's kind, and the
   programs of all kinds together (what a dispatched run compiles), and all kinds before a
   first step in a process of their own, in turn and by ``precompile`` (threads). Each
   measurement runs in a fresh Python process (``--compile-repeats`` processes, the median is
   reported), so that no compilation cache can hide it. Then 0/1 Adam from a cold start to the
   end of a 64-step run, its programs compiled lazily, by ``precompile`` or in the background.
2. **Step time** of every step kind (0/1 Adam: variance, compressed, local, sync; 1-bit Adam:
   warm-up, compressed), ``--workers`` (2) workers, ~``--params`` parameters per worker in a
   GPT-2-shaped tree of 100 leaves and the same total split into 10 equal leaves
   (``--leaves``), params and state donated, three ways:

   - **in-graph**: the update without a hint, every kind in one program, decided in the graph
     (what ``jax.jit(tx.update)`` gives), on the state before that kind's first step (reached
     by running the optimizer from ``init``);
   - **hinted**: the program compiled for that kind alone (``step_kind=``), same state;
   - **dispatched**: what a training loop runs: :func:`optax_zero_one.dispatch_by_kind` over a
     run of consecutive steps, each step the hinted program of its kind chosen on the host;
     beside each step, the same kind's hinted program called directly on a twin of the run
     (same states), so that dispatched / hinted is the dispatcher's own cost, step by step.

   Reported as the median over rounds of the ratio to ``optax.adam`` + ``lax.pmean`` of the
   gradients, timed right before the variant in each round (same process, same load), and
   against plain ``optax.adam`` (no pmean): under ``vmap`` the pmean is a reduction over the
   worker axis that XLA:CPU runs slowly, so it dominates the adam + pmean baseline, which then
   flatters every ratio; the plain-Adam ratio is the optimizer's own arithmetic.
3. **Memory traffic**: next to every step time, the bytes per parameter the kind must read and
   write (counted from the algorithm, see :data:`TRAFFIC`: each buffer read or written once
   per step, 4 bytes per float32 element), the GB/s that this implies, and the GB/s of a plain
   elementwise triad (``a * 2 + b`` over as many elements as all workers' parameters, ``a``
   donated; 12 bytes per element) timed in the same rounds.
4. **State bytes per parameter** of one worker (``N`` = ``--workers`` and 64), from
   ``jax.eval_shape`` of the init: the error buffers of the compressed mean depend on ``N``.
5. **Through ``dp.jit``** (``ozo.data_parallel``) on a real 2-device CPU mesh (a child process
   with 2 simulated devices, ``shard_map``, in-process collectives), 4,196,352 parameters per
   worker in 6 leaves (four 1024 x 1024, two 1024), gradients given: per kind, 0/1 Adam
   dispatched and in-graph against ``optax.adam`` and ``optax.adam`` + pmean through the same
   helper, each kept running over ``--dp-steps`` consecutive steps; and what one device holds
   while each program runs (arguments, temporaries, peak: XLA's buffer assignment read after
   compiling, through the dispatchers' ``memory_analysis``), 1-bit Adam's kinds too.

On a GPU: ``JAX_PLATFORMS=cuda python -m benchmarks.overhead --dp-here --dp-devices 1`` runs all
five there (the vmapped workers share the one GPU; ``--dp-here`` runs ``dp.jit`` on the process's
own devices instead of 2 simulated CPU devices, ``--dp-width`` scales its tree).

Writes ``results/overhead.json``, ``.png`` and ``.md`` (``--quick``: ``overhead_quick.*``);
Default step-time trees: ``gpt2(8, 192, vocab=2009, positions=286)`` (3,999,936 parameters in
100 leaves) and the same 3,999,936 parameters as 10 leaves of ``(~2083, 192)``. ``--quick``
(1M parameters, 100 leaves, 3 rounds, compile at 100 leaves once) takes a few minutes. Timings
on a shared machine move by 10-20% between runs; ratios, taken in the same rounds, move less.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts its backend

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from benchmarks.support import common, model_trees  # noqa: E402

AXIS = "w"
ROOT = pathlib.Path(__file__).resolve().parent.parent
# A hinted program need not read every donated buffer (e.g. a local step's anchor).
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

# A short schedule in which every kind occurs early (the kinds, not the schedule, are timed).
VARIANCE = ozo.VarianceDoubling(freeze_step=8, update_scaler=2)  # variance 1, 2, 4, 6, 8
LOCAL = ozo.LocalStepDoubling(scaler=1, clipper=4)  # phase B: syncs 9, 10, 12, 16, ...
ONEBIT_FREEZE = 4
WARMUP = ozo.FullPrecisionWarmup(ONEBIT_FREEZE)

ZERO_ONE, ONEBIT, ADAM, ADAM_PMEAN, TRIAD = (
    "0/1 Adam",
    "1-bit Adam",
    "adam",
    "adam+pmean",
    "triad",
)
MODES = ("in-graph", "hinted", "dispatched")
COMPILE_TARGETS = {"first": 2.0, "all": 4.0}  # x adam + pmean at 100 leaves (issue "Core v3")
# Through dp.jit on a 2-device mesh, x optax.adam through the same helper (variance: x adam +
# pmean), issue "Core v3".
DATA_PARALLEL_TARGETS = {"local": 1.2, "compressed": 2.0, "sync": 2.0, "variance": 1.1}
# The dispatched step (what a training loop runs) against the hinted program of its kind, both
# under vmap (issue "Core v3"): the host-side dispatch costs next to nothing.
DISPATCH_TARGET = 1.1
STATE_TARGET = 20.0

# Bytes per parameter each program must move, counted from the algorithm: every buffer it reads
# counted once, every buffer it writes once, 4 bytes per float32 element; e_s (the error of the
# chunk a worker serves) has 1/N of the elements. Not counted: packed signs and scales (1/8 of
# an element or less), finiteness checks (one more read of g or of the update unless fused),
# and any buffer a compiler writes out and reads back (that is what the achieved GB/s shows).
# (name, buffers read, buffers written, e_s read + written): bytes = 4 (r + w + 2 e_s / N).
TRAFFIC: dict[tuple[str, str], tuple[str, int, int, bool]] = {
    (TRIAD, "step"): ("r a, b; w out", 2, 1, False),
    (ADAM, "step"): ("r g, m, v, p; w m, v, p", 4, 3, False),
    (ADAM_PMEAN, "step"): ("r g; w gbar; r gbar, m, v, p; w m, v, p", 5, 4, False),
    (ZERO_ONE, "variance"): ("r g; w gbar; r gbar, m, v, p; w m, v, p", 5, 4, False),
    (ZERO_ONE, "compressed"): ("r g, e_w, m, v, p; w e_w, m, p; r+w e_s", 5, 3, True),
    (ZERO_ONE, "local"): ("r g, m, v, p; w m, p", 4, 2, False),
    (ZERO_ONE, "sync"): ("r g, m, v, p, anchor, e_w; w m, p, anchor, e_w; r+w e_s", 6, 4, True),
    (ONEBIT, "warmup"): ("r g; w gbar; r gbar, m, v, p; w m, v, p", 5, 4, False),
    (ONEBIT, "compressed"): ("r g, m, e_w, v, p; w m, e_w, p; r+w e_s", 5, 3, True),
}
TRAFFIC_LEGEND = (
    "B/param: bytes per parameter the step must read and write, from the algorithm: each "
    "buffer read or written once, 4 B per element (g gradient, gbar its float mean, m, v Adam's "
    "moments, p params, anchor the last synchronised point, e_w this worker's error buffer, e_s "
    "the error of the chunk it serves, 1/N of the elements); packed signs, scales and "
    "finiteness checks not counted. GB/s = B/param x params x workers / step time; the triad "
    "a * 2 + b (12 B/element, as many elements as all workers' params) is the bandwidth the "
    "machine delivers in the same rounds."
)


def traffic_bytes(optimizer: str, kind: str, num_workers: int) -> float:
    """Bytes per parameter per worker of :data:`TRAFFIC`'s count."""
    _, reads, writes, server = TRAFFIC[(optimizer, kind)]
    return 4.0 * (reads + writes + (2.0 / num_workers if server else 0.0))


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optimizer with its step kinds (its schedule) and the first step of each kind."""

    name: str
    tx: optax.GradientTransformation
    schedule: ozo.StepSchedule

    @property
    def kind_names(self) -> tuple[str, ...]:
        return self.schedule.names

    @property
    def first_steps(self) -> dict[str, int]:
        """kind -> first 1-based step of that kind (in the first 64 steps)."""
        kinds = self.schedule.indices(64)
        first = common.first_step_of_each_kind(kinds)
        return {self.kind_names[k]: step for k, step in first.items()}

    def kind(self, name: str) -> ozo.StepKind:
        return self.schedule.kinds[self.kind_names.index(name)]


def zero_one_optimizer(
    variance: Any = VARIANCE, local: Any = LOCAL, axis_name: str = AXIS
) -> Optimizer:
    tx = ozo.scale_by_zero_one_adam(
        1e-3, variance_policy=variance, local_step_policy=local, axis_name=axis_name
    )
    return Optimizer(ZERO_ONE, tx, ozo.StepSchedule(variance, local))


def onebit_optimizer(freeze: int = ONEBIT_FREEZE) -> Optimizer:
    tx = ozo.onebit_adam(1e-3, freeze_step=freeze, axis_name=AXIS)
    return Optimizer(ONEBIT, tx, ozo.onebit_schedule(freeze))


# The dispatched runs: long enough phases that every kind is timed over many steps (the kinds,
# not the schedule, are measured): 0/1 Adam variance 1, 2, 4, 6, 8, 12, 16, 24 and 16
# compressed steps, then 40 phase-B steps (syncs every 4th once the interval has grown);
# 1-bit Adam 16 warm-up and 48 compressed steps.
RUN_VARIANCE = ozo.VarianceDoubling(freeze_step=24, update_scaler=2)
RUN_STEPS = 64


def run_optimizer(opt: Optimizer, axis_name: str = AXIS) -> Optimizer:
    """``opt`` with the long-phase schedule of the dispatched runs."""
    if opt.name == ZERO_ONE:
        return zero_one_optimizer(RUN_VARIANCE, LOCAL, axis_name)
    return onebit_optimizer(16)


# ----------------------------------------------------------------------------------------------
# Trees


def compile_tree(leaves: int) -> dict:
    """The GPT-2-like tree of the compile-time measurement: ``12 layers + 4`` leaves."""
    if (leaves - 4) % 12 or leaves < 16:
        raise ValueError(
            f"compile trees have 12 * layers + 4 leaves (16, 28, ..., 100, 400), got {leaves}"
        )
    return model_trees.gpt2((leaves - 4) // 12, 64, vocab=1000, positions=64)


def _gpt2_of_size(num_params: int, layers: int) -> dict:
    """A GPT-2 tree of ``layers`` layers and about ``num_params`` parameters, the blocks ~90%
    of them (the width a multiple of 32), the embedding rows the rest."""
    per_layer = lambda h: 12 * h * h + 13 * h  # noqa: E731
    hidden = 32
    while layers * per_layer(hidden + 32) + 2 * (hidden + 32) <= 0.9 * num_params:
        hidden += 32
    rows = max((num_params - layers * per_layer(hidden) - 2 * hidden) // hidden, 2)
    positions = max(rows // 8, 1)
    return model_trees.gpt2(layers, hidden, vocab=rows - positions, positions=positions)


def step_tree(num_params: int, leaves: int, reference: dict | None = None) -> dict:
    """A tree of about ``num_params`` float32 parameters in ``leaves`` leaves.

    ``12 layers + 4`` leaves (e.g. 100): a GPT-2-shaped tree. Any other count: the same total as
    ``reference`` (or as the 100-leaf tree) split into ``leaves`` equal 2-D leaves of its width.
    """
    if leaves >= 16 and (leaves - 4) % 12 == 0:
        return _gpt2_of_size(num_params, (leaves - 4) // 12)
    reference = reference or _gpt2_of_size(num_params, 8)
    width = reference["wte"].shape[1]
    total = model_trees.numel(reference)
    rows = total // width  # every leaf of the GPT-2 tree is a multiple of its width
    split = [rows // leaves + (i < rows % leaves) for i in range(leaves)]
    return {f"w{i:03d}": jax.ShapeDtypeStruct((r, width), jnp.float32) for i, r in enumerate(split)}


# ----------------------------------------------------------------------------------------------
# 1. Compile time (one program per fresh process)


def _update_fn(
    tx: optax.GradientTransformation, average_grads: bool, kind: ozo.StepKind | None = None
) -> Callable[..., Any]:
    def update(params: Any, state: Any, grads: Any) -> Any:
        if average_grads:
            grads = jax.lax.pmean(grads, AXIS)
        if kind is None:  # optax.adam takes no hint
            updates, state = tx.update(grads, state, params)
        else:
            updates, state = tx.update(grads, state, params, step_kind=kind)
        return optax.apply_updates(params, updates), state

    return update


COMPILE_PROGRAMS = (ADAM_PMEAN, ZERO_ONE, ONEBIT)


def compile_once(program: str, leaves: int, workers: int) -> dict:
    """Lowers and compiles, shapes only, in this process: the update of ``program`` without a
    hint (decided in the graph), then its program for every step kind in turn (what the
    dispatcher compiles, in the order a run meets the kinds); seconds and size of each."""
    tree = compile_tree(leaves)
    if program == ADAM_PMEAN:
        tx, average, kinds = optax.adam(1e-3), True, ()
    else:
        opt = zero_one_optimizer() if program == ZERO_ONE else onebit_optimizer()
        tx, average = opt.tx, False
        order = sorted(opt.first_steps.items(), key=lambda item: item[1])
        kinds = tuple(opt.kind(name) for name, _ in order)
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((workers, *x.shape), x.dtype), tree)
    state = jax.eval_shape(jax.vmap(tx.init, axis_name=AXIS), stacked)

    def one(kind: ozo.StepKind | None) -> dict:
        fn = jax.jit(jax.vmap(_update_fn(tx, average, kind), axis_name=AXIS), donate_argnums=(0, 1))
        start = time.perf_counter()
        lowered = fn.lower(stacked, state, stacked)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        done = time.perf_counter()
        return {
            "lower_s": lowered_at - start,
            "compile_s": done - lowered_at,
            "total_s": done - start,
            "hlo_instructions": hlo_summary(compiled)["instructions"],
        }

    in_graph = one(None)
    per_kind = {kind.name: one(kind) for kind in kinds}
    return {
        "program": program,
        "leaves": model_trees.num_leaves(tree),
        "params": model_trees.numel(tree),
        "workers": workers,
        **in_graph,
        "per_kind": per_kind,
        "first_kind_s": per_kind[kinds[0].name]["total_s"] if kinds else in_graph["total_s"],
        "all_kinds_s": sum(r["total_s"] for r in per_kind.values()) or in_graph["total_s"],
    }


def compile_ahead(program: str, leaves: int, workers: int, threads: bool) -> dict:
    """Every kind's program compiled before the first step, shapes only, in this (fresh)
    process: with ``threads`` by ``KindDispatcher.precompile`` (lowered one after the other,
    each compiled on a thread while the next lowers), else each lowered and compiled in turn."""
    tree = compile_tree(leaves)
    opt = zero_one_optimizer() if program == ZERO_ONE else onebit_optimizer()
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((workers, *x.shape), x.dtype), tree)
    state = jax.eval_shape(jax.vmap(opt.tx.init, axis_name=AXIS), stacked)

    start = time.perf_counter()
    if threads:
        seconds = dispatcher_of(opt).precompile(stacked, state, stacked)
    else:
        seconds = {}
        for kind in opt.schedule.kinds:
            kind_program(opt, kind).lower(stacked, state, stacked).compile()
            seconds[kind.name] = time.perf_counter() - start - sum(seconds.values())
    return {"all_kinds_ahead_s": time.perf_counter() - start, "per_kind_ahead_s": seconds}


def child_result(
    flags: list[str], tag: str, what: str, timeout: int, glibc: bool = False, **env: str
) -> dict:
    """Runs ``python -m benchmarks.overhead *flags`` in a fresh process (this environment plus
    ``env``; with ``glibc``, less :data:`common.KEEP_MEMORY`: glibc's allocator as it comes) and
    returns the JSON it printed after ``tag``; ``what`` names it in an error."""
    cmd = [sys.executable, "-m", "benchmarks.overhead", *flags]
    environ = dict(os.environ, **env)
    if glibc:
        cmd.append(common.SYSTEM_ALLOCATOR)
        environ = {k: v for k, v in environ.items() if k not in common.KEEP_MEMORY}
    out = subprocess.run(
        cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(f"{tag} ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len(tag) + 1 :])


# no persistent compilation cache in the compile children: every compile is a first compile
NO_CACHE = {"JAX_ENABLE_COMPILATION_CACHE": "false"}  # on this process's platform


def compile_in_fresh_process(
    program: str, leaves: int, workers: int, ahead: str | None = None, glibc: bool = False
) -> dict:
    flags = ["--compile-one", program, "--compile-leaves", str(leaves)]
    flags += ["--compile-workers", str(workers)] + (["--compile-ahead", ahead] if ahead else [])
    what = f"compile of {program} at {leaves} leaves"
    return child_result(flags, "COMPILE", what, 900, glibc, **NO_CACHE)


COLD_MODES = ("lazy", "precompile", "in the background")


def cold_run(mode: str, leaves: int = 100, workers: int = 2) -> dict:
    """A 0/1 Adam run of ``RUN_STEPS`` steps (every kind) from a cold start, in this (fresh)
    process, the kinds' programs compiled as ``mode`` says: ``lazy`` (each at its kind's first
    step), ``precompile`` (all before the first step) or ``in the background``
    (``precompile_in_background``, beside the run). Seconds to the first step's end and to the
    run's end, from the dispatcher's creation (gradients given, compile trees' shapes)."""
    tree = compile_tree(leaves)
    opt = run_optimizer(zero_one_optimizer())
    params = jax.tree.map(lambda x: jnp.zeros((workers, *x.shape), x.dtype), tree)
    grads = jax.tree.map(lambda x: jnp.full((workers, *x.shape), 1e-2, x.dtype), tree)
    state = jax.vmap(opt.tx.init, axis_name=AXIS)(params)

    start = time.perf_counter()
    run = dispatcher_of(opt)
    if mode == "precompile":
        run.precompile(params, state, grads)
    elif mode == "in the background":
        run.precompile_in_background(params, state, grads)
    first = None
    for k in range(RUN_STEPS):
        params, state = run(params, state, grads)
        if k == 0:
            jax.block_until_ready(params)
            first = time.perf_counter() - start
    jax.block_until_ready((params, state))
    return {"mode": mode, "first_step_s": first, "run_s": time.perf_counter() - start}


def measure_cold_runs(repeats: int, log: Callable) -> list:
    """:func:`cold_run` of each mode in fresh processes, alternating, ``repeats`` rounds."""
    runs: dict[str, list[dict]] = {mode: [] for mode in COLD_MODES}
    for _ in range(repeats):
        for mode in COLD_MODES:
            what = f"the cold run ({mode})"
            runs[mode].append(child_result(["--cold-run", mode], "COLD", what, 900, **NO_CACHE))
    rows = []
    for mode, got in runs.items():
        row = {"mode": mode, "runs": len(got)}
        for key in ("first_step_s", "run_s"):
            row[key] = statistics.median(r[key] for r in got)
        rows.append(row)
        log(
            f"  cold run, {mode:<17}: first step {row['first_step_s']:.2f} s, "
            f"{RUN_STEPS} steps {row['run_s']:.2f} s"
        )
    return rows


def measure_compile(leaf_counts: list[int], workers: int, repeats: int, log: Callable) -> list:
    rows = []
    for leaves in leaf_counts:
        base = base_glibc = None
        for program in COMPILE_PROGRAMS:
            runs = [compile_in_fresh_process(program, leaves, workers) for _ in range(repeats)]
            row = {
                **runs[0],
                **{
                    key: statistics.median(r[key] for r in runs)
                    for key in ("lower_s", "compile_s", "total_s", "first_kind_s", "all_kinds_s")
                },
                "runs_total_s": [round(r["total_s"], 3) for r in runs],
            }
            # all kinds before a first step, both ways in fresh processes: in turn, and
            # precompiled (the runs above compile the in-graph update first, in the same
            # process, which warms the tracing of the kinds' programs)
            for mode in ("turn", "ahead"):
                row[f"all_kinds_{mode}_s"] = row["total_s"]
                if program == ADAM_PMEAN:
                    continue
                ahead = [
                    compile_in_fresh_process(program, leaves, workers, ahead=mode)
                    for _ in range(repeats)
                ]
                row[f"all_kinds_{mode}_s"] = statistics.median(
                    r["all_kinds_ahead_s"] for r in ahead
                )
                row[f"runs_{mode}_s"] = [round(r["all_kinds_ahead_s"], 3) for r in ahead]
            # precompiled again with glibc's allocator as it comes: one arena (KEEP_MEMORY, set
            # for the step times) makes the compile threads wait on each other's allocations
            mode = None if program == ADAM_PMEAN else "ahead"
            key = "total_s" if program == ADAM_PMEAN else "all_kinds_ahead_s"
            glibc = [
                compile_in_fresh_process(program, leaves, workers, mode, glibc=True)[key]
                for _ in range(repeats)
            ]
            row["all_kinds_ahead_glibc_s"] = statistics.median(glibc)
            row["runs_ahead_glibc_s"] = [round(t, 3) for t in glibc]
            base_glibc = base_glibc or row["all_kinds_ahead_glibc_s"]
            row["all_kinds_ahead_glibc_ratio"] = row["all_kinds_ahead_glibc_s"] / base_glibc
            base = base or row["total_s"]
            row["ratio_to_adam_pmean"] = row["total_s"] / base
            row["first_kind_ratio"] = row["first_kind_s"] / base
            row["all_kinds_ratio"] = row["all_kinds_s"] / base
            row["all_kinds_turn_ratio"] = row["all_kinds_turn_s"] / base
            row["all_kinds_ahead_ratio"] = row["all_kinds_ahead_s"] / base
            rows.append(row)
            log(
                f"  compile {program:<11} {row['leaves']:>4} leaves ({row['params']:,} params, "
                f"{workers} workers): in-graph {row['total_s']:.2f} s "
                f"x{row['ratio_to_adam_pmean']:.2f} adam+pmean; first kind's program "
                f"{row['first_kind_s']:.2f} s x{row['first_kind_ratio']:.2f}; all kinds "
                f"{row['all_kinds_s']:.2f} s x{row['all_kinds_ratio']:.2f}; fresh, in turn "
                f"{row['all_kinds_turn_s']:.2f} s x{row['all_kinds_turn_ratio']:.2f}, "
                f"precompiled {row['all_kinds_ahead_s']:.2f} s "
                f"x{row['all_kinds_ahead_ratio']:.2f}, precompiled with glibc as it comes "
                f"{row['all_kinds_ahead_glibc_s']:.2f} s "
                f"x{row['all_kinds_ahead_glibc_ratio']:.2f}  "
                f"[{row['hlo_instructions']} HLO instructions in-graph; runs {row['runs_total_s']}]"
            )
    return rows


# ----------------------------------------------------------------------------------------------
# 2./3. Step time


def hlo_summary(compiled: Any) -> dict[str, Any]:
    """Instruction counts of an optimised program: copies (and their bytes), loops."""
    text = compiled.as_text()
    copies = re.findall(r"=\s*(\w+)\[([\d,]*)\][^=]*?\scopy\(", text)
    copy_bytes = sum(
        int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        * (1 if t in ("u8", "s8", "pred") else 4)
        for t, dims in copies
    )
    return {
        "instructions": len(re.findall(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=", text, re.M)),
        "copies": len(copies),
        "copy_bytes": copy_bytes,
        "loops": len(re.findall(r"\swhile\(", text)),
    }


_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def kind_program(opt: Optimizer, kind: ozo.StepKind) -> Callable[..., Any]:
    """The vmapped, donating update of ``opt`` for ``kind`` (jitted, not compiled yet)."""
    return jax.jit(jax.vmap(_update_fn(opt.tx, False, kind), axis_name=AXIS), donate_argnums=(0, 1))


def dispatcher_of(opt: Optimizer) -> ozo.integration.dispatch.KindDispatcher:
    """The vmapped, donating update of ``opt``, one program per kind chosen on the host."""
    return ozo.dispatch_by_kind(functools.partial(kind_program, opt), opt.schedule)


def states_at(opt: Optimizer, params: Any, grads: Any, steps: dict[str, int]) -> dict[str, tuple]:
    """``{kind: (params, state)}`` as they are before the first step of each kind, reached by
    running the optimizer's own steps from ``init`` (real counters, real buffers)."""
    state = jax.jit(jax.vmap(opt.tx.init, axis_name=AXIS))(params)
    run = dispatcher_of(opt)
    wanted = {step: kind for kind, step in steps.items()}
    out = {}
    params = _copy(params)
    for k in range(1, max(steps.values()) + 1):
        if k in wanted:
            out[wanted[k]] = jax.block_until_ready(_copy((params, state)))
            if ozo.step_kind(state, opt.schedule).name != wanted[k]:
                raise RuntimeError(f"{opt.name}: the state before step {k} is not {wanted[k]}")
        params, state = jax.block_until_ready(run(params, state, grads))
    return out


@dataclasses.dataclass
class Program:
    """A compiled step and how to make its (donated) arguments afresh for every call."""

    name: str
    compiled: Any
    make_args: Callable[[], tuple]
    compile_s: float
    hlo: dict


def time_call(program: Program) -> tuple[float, Any]:
    args = jax.block_until_ready(program.make_args())
    start = time.perf_counter()
    out = jax.block_until_ready(program.compiled(*args))
    return time.perf_counter() - start, out


def _compile(name: str, fn: Callable, args: tuple, make_args: Callable, donate=(0, 1)) -> Program:
    start = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    return Program(name, compiled, make_args, time.perf_counter() - start, hlo_summary(compiled))


def measure_steps(tree: dict, workers: int, repeats: int, log: Callable) -> dict:
    """Step times of every kind, three ways, against adam + pmean, adam and the triad:

    - **in-graph**: the update without a hint, all kinds in one program, the kind decided in
      the graph (what ``jax.jit(tx.update)`` gives), on the state before that kind's step;
    - **hinted**: the program compiled for that kind alone (``step_kind=``), same state;
    - **dispatched**: what a training loop runs, :func:`optax_zero_one.dispatch_by_kind` over
      :data:`RUN_STEPS` consecutive steps from ``init`` (each step a call of the hinted program of
      its kind, chosen on the host), the median over that kind's steps after its first.
    """
    numel = model_trees.numel(tree)
    rng = np.random.default_rng(0)

    def stacked(scale: float) -> Any:
        return jax.tree.map(
            lambda x: jnp.asarray(rng.standard_normal((workers, *x.shape), np.float32) * scale),
            tree,
        )

    # the same params on every worker, as a run starts (the dispatcher checks it), own grads
    params0 = jax.tree.map(lambda x: jnp.repeat(x[:1], workers, axis=0), stacked(1.0))
    grads = stacked(1e-2)
    fresh_params = lambda: _copy(params0)  # noqa: E731

    def baseline(name: str, average: bool) -> Program:
        tx = optax.adam(1e-3)
        state0 = jax.jit(jax.vmap(tx.init))(params0)
        fn = jax.vmap(_update_fn(tx, average), axis_name=AXIS)
        make = lambda: (fresh_params(), _copy(state0), grads)  # noqa: E731
        return _compile(name, fn, make(), make)

    a0 = jnp.ones((workers * numel,), jnp.float32)
    b0 = jnp.full((workers * numel,), 0.5, jnp.float32)
    triad = _compile(TRIAD, lambda a, b: a * 2 + b, (a0, b0), lambda: (_copy(a0), b0), (0,))
    bases = {ADAM_PMEAN: baseline(ADAM_PMEAN, True), ADAM: baseline(ADAM, False), TRIAD: triad}
    for program in bases.values():
        time_call(program)  # warm-up
    rows = []
    for opt in (zero_one_optimizer(), onebit_optimizer()):
        start_of = states_at(opt, params0, grads, opt.first_steps)
        in_graph_fn = jax.vmap(_update_fn(opt.tx, False), axis_name=AXIS)
        in_graph = None
        dispatched = _dispatched_times(run_optimizer(opt), params0, grads, bases)
        for kind in opt.kind_names:
            step = opt.first_steps[kind]
            make = lambda at=start_of[kind]: _copy(at) + (grads,)  # noqa: E731
            if in_graph is None:
                in_graph = _compile(f"{opt.name} in-graph", in_graph_fn, make(), make)
            programs = {
                "in-graph": dataclasses.replace(in_graph, make_args=make),
                "hinted": _compile(
                    f"{opt.name} {kind} hinted",
                    jax.vmap(_update_fn(opt.tx, False, opt.kind(kind)), axis_name=AXIS),
                    make(),
                    make,
                ),
            }
            row = {"optimizer": opt.name, "kind": kind, "step": step}
            for mode, program in programs.items():
                _, (p_out, _) = time_call(program)  # warm-up, and a check of the result
                finite = bool(all(jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(p_out)))
                times = {name: [] for name in (ADAM_PMEAN, ADAM, TRIAD, mode)}
                for _ in range(repeats):  # rounds: the baselines right before the variant
                    for name, base in bases.items():
                        times[name].append(time_call(base)[0])
                    times[mode].append(time_call(program)[0])
                row[mode] = _summary(times, mode, opt.name, kind, numel, workers, program)
                row[mode]["finite_params"] = finite
            row["dispatched"] = _summary(
                dispatched[kind], "dispatched", opt.name, kind, numel, workers, programs["hinted"]
            )
            row["dispatched"]["steps"] = len(dispatched[kind]["dispatched"])
            pairs = zip(dispatched[kind]["dispatched"], dispatched[kind]["hinted run"])
            row["hinted_run_ms"] = 1e3 * statistics.median(dispatched[kind]["hinted run"])
            row["dispatched_over_hinted"] = statistics.median(d / h for d, h in pairs)
            rows.append(row)
            log("  " + _row_line(row))
    return {
        "params": numel,
        "leaves": model_trees.num_leaves(tree),
        "workers": workers,
        "repeats": repeats,
        "baseline_compile_s": {name: round(p.compile_s, 2) for name, p in bases.items()},
        "rows": rows,
    }


def _dispatched_times(opt: Optimizer, params: Any, grads: Any, bases: dict) -> dict:
    """``{kind: {mode: [seconds]}}`` of a dispatched run of :data:`RUN_STEPS` steps (each step
    waited for, the baselines timed right before it; a kind's first two steps, which compile
    and first touch their buffers, left out).

    Each step also runs its kind's hinted program directly, without the dispatcher, on a twin
    of the run (``"hinted run"``: the same kinds at the same steps, so the same states), the two
    calls in alternating order: their ratio step by step is what the dispatcher itself costs.
    (The hinted program's rounds in :func:`measure_steps` run from one state, the kind's first,
    at another moment: against them the dispatched median moved 0.6-1.15x with the host's drift
    between the two measurements, in both directions.)"""
    state = jax.jit(jax.vmap(opt.tx.init, axis_name=AXIS))(params)
    twin = _copy((params, state))
    params = _copy(params)
    run = dispatcher_of(opt)
    out: dict[str, dict[str, list]] = {}
    seen: dict[str, int] = {}
    for k in range(RUN_STEPS):
        kind = run.next_kind(state)
        seen[kind.name] = seen.get(kind.name, 0) + 1
        program = run.program(kind)  # the dispatcher's own executable, called directly
        times = {name: time_call(base)[0] for name, base in bases.items()}
        for first in ("dispatched", "hinted run") if k % 2 else ("hinted run", "dispatched"):
            start = time.perf_counter()
            if first == "dispatched":
                params, state = jax.block_until_ready(run(params, state, grads))
            else:
                twin = jax.block_until_ready(program(*twin, grads))
            times[first] = time.perf_counter() - start
        if seen[kind.name] > 2:
            per = out.setdefault(kind.name, {name: [] for name in times})
            for name, t in times.items():
                per[name].append(t)
    run.settle()
    if run.skipped or run.lost:
        raise RuntimeError(f"{opt.name}: the dispatched run skipped steps ({run.skipped})")
    return out


def _summary(
    times: dict, mode: str, optimizer: str, kind: str, numel: int, workers: int, program: Program
) -> dict:
    """Medians, ratios (median over rounds of variant / baseline) and bandwidths of one mode."""
    med = {name: statistics.median(ts) for name, ts in times.items()}

    def ratio(base: str) -> float:
        return statistics.median(v / b for v, b in zip(times[mode], times[base]))

    def gbs(bytes_per_param: float, seconds: float) -> float:
        return bytes_per_param * numel * workers / seconds / 1e9

    bytes_param = traffic_bytes(optimizer, kind, workers)
    return {
        "ms": 1e3 * med[mode],
        "adam_pmean_ms": 1e3 * med[ADAM_PMEAN],
        "adam_ms": 1e3 * med[ADAM],
        "triad_ms": 1e3 * med[TRIAD],
        "ratio_to_adam_pmean": ratio(ADAM_PMEAN),
        "ratio_to_adam": ratio(ADAM),
        "bytes_per_param": bytes_param,
        "gb_s": gbs(bytes_param, med[mode]),
        "adam_gb_s": gbs(traffic_bytes(ADAM, "step", workers), med[ADAM]),
        "adam_pmean_gb_s": gbs(traffic_bytes(ADAM_PMEAN, "step", workers), med[ADAM_PMEAN]),
        "triad_gb_s": gbs(12.0, med[TRIAD]),
        "compile_s": program.compile_s,
        "hlo": program.hlo,
    }


def _row_line(row: dict) -> str:
    parts = [f"{row['optimizer']:<10} {row['kind']:<10}"]
    for mode in MODES:
        r = row[mode]
        parts.append(
            f"{mode} {r['ms']:7.1f} ms x{r['ratio_to_adam_pmean']:.2f} adam+pmean "
            f"x{r['ratio_to_adam']:.2f} adam"
        )
    parts.append(f"dispatched/hinted x{row['dispatched_over_hinted']:.2f}")
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------
# 5. Through dp.jit on a real mesh (a child process with 2 simulated CPU devices, or with
#    --dp-here this process's own devices, e.g. a GPU)


def dp_tree(width: int = 1024) -> dict:
    """Four ``width x width`` matrices and two ``width`` vectors: at the default width 4,196,352
    parameters per worker in 6 leaves (the workload of issue "Core v3")."""
    return {
        **{f"w{i}": jax.ShapeDtypeStruct((width, width), jnp.float32) for i in range(4)},
        **{f"b{i}": jax.ShapeDtypeStruct((width,), jnp.float32) for i in range(2)},
    }


def quiet_plain_adam() -> None:
    """The plain ``optax.adam`` baseline exchanges nothing on purpose (the optimizer's cost
    alone): ``dp.jit``'s warning about such a step is expected here."""
    warnings.filterwarnings("ignore", message="dp.jit: the params this step returns depend on no")


def measure_data_parallel_here(steps: int, width: int = 1024, devices: int = 2) -> dict:
    """Per-kind step times through ``ozo.data_parallel(...).jit`` on ``devices`` of this
    process's devices, gradients given (the batch *is* each worker's gradient): plain
    ``optax.adam``, ``optax.adam`` + pmean, 0/1 Adam dispatched (one program per kind) and
    in-graph (one program), each kept running over ``steps`` consecutive steps, donated, every
    step waited for and timed right after the two baselines."""
    if jax.device_count() < devices:
        raise SystemExit(
            f"the dp.jit measurement wants {devices} devices and this process has "
            f"{jax.device_count()}: pass --dp-devices {jax.device_count()}"
        )
    tree = dp_tree(width)
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    dp = ozo.data_parallel(mesh, tree, "data")
    quiet_plain_adam()
    rng = np.random.default_rng(0)
    host = {k: rng.standard_normal((devices, *x.shape), np.float32) for k, x in tree.items()}
    params0 = dp.to_workers(jax.tree.map(lambda x: x[0], host))

    def fresh(tx: Any) -> list:
        """Fresh params (the run donates them) and ``tx``'s state, in the worker layout."""
        return [dp.to_workers(jax.tree.map(lambda x: x[0], host)), dp.init(tx, params0)]

    grads = jax.device_put(
        jax.tree.map(lambda x: 1e-2 * x, host),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    )
    zero_one = zero_one_optimizer(RUN_VARIANCE, LOCAL, "data")

    def step_of(tx: Any, average: bool) -> Callable[..., Any]:
        def step(params: Any, state: Any, batch: Any, step_kind: Any = None) -> Any:
            g = jax.tree.map(lambda x: x[0], batch)
            if average:
                g = jax.lax.pmean(g, "data")
            extra = {} if step_kind is None else {"step_kind": step_kind}
            updates, state = tx.update(g, state, params, **extra)
            return optax.apply_updates(params, updates), state, ()

        return step

    adam = optax.adam(1e-3)
    runs = {
        ADAM: (dp.jit(step_of(adam, False)), adam),
        ADAM_PMEAN: (dp.jit(step_of(adam, True)), adam),
        "dispatched": (dp.jit(step_of(zero_one.tx, False), schedule=zero_one.schedule), None),
        "in-graph": (dp.jit(step_of(zero_one.tx, False)), None),
    }
    live = {name: fresh(tx or zero_one.tx) for name, (_, tx) in runs.items()}
    times: dict[str, dict[str, list]] = {}
    for k in range(1, steps + 1):
        kind = zero_one.schedule.kind(k).name
        took = {}
        for name, (fn, _) in runs.items():
            p, st = live[name]
            start = time.perf_counter()
            p, st, _ = jax.block_until_ready(fn(p, st, grads))
            took[name] = time.perf_counter() - start
            live[name] = [p, st]
        earlier = sum(zero_one.schedule.kind(j).name == kind for j in range(1, k))
        if earlier >= 2:  # a kind's first two steps compile and first touch buffers: left out
            per = times.setdefault(kind, {name: [] for name in took})
            for name, t in took.items():
                per[name].append(t)
    runs["dispatched"][0].settle()
    pipelined = _pipelined_ms(runs, zero_one, fresh, grads, steps)
    states = {ADAM: fresh(adam), ZERO_ONE: fresh(zero_one.tx)}
    memory = _data_parallel_memory(dp, step_of, runs, states, grads, model_trees.numel(tree))
    out = {}
    for kind, per in times.items():
        row = {f"{name}_ms": 1e3 * statistics.median(ts) for name, ts in per.items()}
        for mode in ("dispatched", "in-graph"):
            for base in (ADAM, ADAM_PMEAN):
                ratios = [v / b for v, b in zip(per[mode], per[base])]
                row[f"{mode}_x_{base}"] = statistics.median(ratios)
        row["steps"] = len(per[ADAM])
        out[kind] = row
    return {
        "params": model_trees.numel(tree),
        "leaves": len(tree),
        "devices": f"{devices} x {jax.devices()[0].device_kind} ({jax.default_backend()})",
        "kinds": out,
        "pipelined": pipelined,
        "memory": memory,
        "plain_jit_adam_ms": _plain_jit_adam_ms(host, steps),
        "host_time": measure_host_time(devices),
    }


def _data_parallel_memory(
    dp: Any, step_of: Callable[..., Any], runs: dict, states: dict, grads: Any, per_param: int
) -> dict:
    """Bytes per parameter one device holds while each program runs (XLA's buffer assignment,
    :class:`ozo.KindMemory`; compile only, so exact for this XLA, not a timing): optax.adam with
    and without pmean, 0/1 Adam's kinds (dispatched) and its in-graph update, 1-bit Adam's
    kinds. ``states``: fresh ``[params, state]`` of optax.adam and of 0/1 Adam."""
    params, adam_state = states[ADAM]
    zero_one_state = states[ZERO_ONE][1]

    def of(stats: ozo.KindMemory) -> dict:
        fields = {f: getattr(stats, f) / per_param for f in ozo.KindMemory._fields}
        return {**fields, "peak": stats.peak / per_param}

    def compiled(fn: Any, state: Any) -> dict:
        return of(ozo.KindMemory.of(fn.lower(params, state, grads).compile()))

    out = {name: compiled(runs[name][0], adam_state) for name in (ADAM, ADAM_PMEAN)}
    for kind, m in runs["dispatched"][0].memory_analysis(params, zero_one_state, grads).items():
        out[f"{ZERO_ONE} {kind}"] = of(m)
    out[f"{ZERO_ONE} in-graph"] = compiled(runs["in-graph"][0], zero_one_state)
    onebit_tx = ozo.onebit_adam(1e-3, freeze_step=ONEBIT_FREEZE, axis_name="data")
    onebit = dp.jit(step_of(onebit_tx, False), schedule=ozo.onebit_schedule(ONEBIT_FREEZE))
    onebit_state = dp.init(onebit_tx, params)
    for kind, m in onebit.memory_analysis(params, onebit_state, grads).items():
        out[f"{ONEBIT} {kind}"] = of(m)
    return out


def _pipelined_ms(
    runs: dict, zero_one: Optimizer, fresh: Callable[[Any], list], grads: Any, steps: int
) -> dict:
    """Milliseconds per step of whole runs of ``steps`` steps from ``init`` that wait only at
    the end, as a training loop runs (the host queues step k+1 while the device runs step k):
    what a conditional that stalls the host, or host work per step, costs a real loop. Each
    run's programs are compiled already; 3 rounds, the runs alternating, the median reported.
    ``hinted`` calls the dispatcher's programs with the kind from the schedule and nothing
    else (the dispatcher's own host work is the difference to ``dispatched``). ``fresh(tx)``
    gives fresh params and state."""
    disp = runs["dispatched"][0]
    programs = {kind.name: disp.program(kind) for kind in zero_one.schedule.kinds}

    def hinted(p: Any, st: Any, g: Any, k: int) -> Any:
        return programs[zero_one.schedule.kind(k).name](p, st, g)

    calls = {name: (lambda p, st, g, k, fn=fn: fn(p, st, g)) for name, (fn, _) in runs.items()}
    calls["hinted"] = hinted
    per: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(3):
        for name, call in calls.items():
            p, st = jax.block_until_ready(fresh(runs.get(name, (None, None))[1] or zero_one.tx))
            began = time.perf_counter()
            for k in range(1, steps + 1):
                p, st, _ = call(p, st, grads, k)
            jax.block_until_ready((p, st))
            per[name].append(1e3 * (time.perf_counter() - began) / steps)
        disp.settle()
    out = {f"{name}_ms": statistics.median(ts) for name, ts in per.items()}
    for name in ("dispatched", "hinted", "in-graph"):
        out[f"{name}_x_adam"] = out[f"{name}_ms"] / out[f"{ADAM}_ms"]
    out["steps"] = steps
    return out


HOST_LEAVES = (6, 100)  # leaves of the host-time trees (8 x 8 each)


def measure_host_time(devices: int, calls: int = 200, rounds: int = 3) -> list[dict]:
    """Host time per step through ``dp.jit`` on trees of tiny leaves (``HOST_LEAVES``, 8 x 8
    each), where an accelerator's work is negligible and the host bounds the step: the calling
    thread's CPU time per call (``time.thread_time``), median over ``rounds`` x ``calls``
    0/1 Adam local steps, for ``optax.adam``, 0/1 Adam dispatched and its local program
    called alone (``dispatcher.program(kind)``: the dispatcher's own work is the difference).
    On XLA:CPU a program this small runs on the calling thread, so its run is in every
    figure; on a GPU the thread time is the host's alone."""
    quiet_plain_adam()
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    policies = dict(var_freeze_step=2, var_update_scaler=1, local_step_scaler=2)
    policies["local_step_clipper"] = 64  # syncs every 64 steps once grown: mostly local steps
    schedule = ozo.zero_one_schedule(**policies)
    rows = []
    for leaves in HOST_LEAVES:
        tree = {f"w{i:03d}": np.zeros((8, 8), np.float32) for i in range(leaves)}
        dp = ozo.data_parallel(mesh, tree, "data")
        grads = jax.device_put(
            {k: np.full((devices, 8, 8), 1e-2, np.float32) for k in tree},
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
        )

        def step_of(tx: Any, hinted: bool) -> Callable[..., Any]:
            def step(params: Any, state: Any, batch: Any, step_kind: Any = None) -> Any:
                g = jax.tree.map(lambda x: x[0], batch)
                extra = {"step_kind": step_kind} if hinted else {}
                updates, state = tx.update(g, state, params, **extra)
                return optax.apply_updates(params, updates), state, ()

            return step

        zero_one = ozo.zero_one_adam(1e-3, axis_name="data", **policies)
        adam = optax.adam(1e-3)
        dispatched = dp.jit(step_of(zero_one, True), schedule=schedule)
        local = dispatched.program(next(k for k in schedule.kinds if k.name == "local"))
        runs = {ADAM: (dp.jit(step_of(adam, False)), adam), "dispatched": (dispatched, zero_one)}
        runs["local program"] = (local, zero_one)
        live = {}
        for name, (fn, tx) in runs.items():  # to phase B's long intervals, compiled
            p = dp.to_workers(tree)
            st = dp.init(tx, p)
            for _ in range(130):
                p, st, _ = dispatched(p, st, grads) if tx is zero_one else fn(p, st, grads)
            live[name] = [p, st]
        dispatched.settle()
        per: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, (fn, _) in runs.items():
                p, st = live[name]
                for _ in range(calls):
                    if name == "dispatched" and dispatched.next_kind(st).name != "local":
                        p, st, _ = fn(p, st, grads)  # a sync step: not timed
                        continue
                    began = time.thread_time()
                    p, st, _ = fn(p, st, grads)
                    per[name].append(time.thread_time() - began)
                live[name] = [jax.block_until_ready(p), jax.block_until_ready(st)]
            dispatched.settle()
        row = {"leaves": leaves, "calls": len(per[ADAM])}
        row |= {f"{name}_us": 1e6 * statistics.median(ts) for name, ts in per.items()}
        rows.append(row)
    return rows


def _plain_jit_adam_ms(host: dict, steps: int) -> float:
    """``optax.adam`` on one worker's tree under plain ``jax.jit`` on one device (no worker
    axis, donated): the reference for what ``dp.jit``'s worker layout costs XLA:CPU."""
    adam = optax.adam(1e-3)

    def step(params: Any, state: Any, grads: Any) -> Any:
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    fn = jax.jit(step, donate_argnums=(0, 1))
    params = {k: jnp.asarray(x[0]) for k, x in host.items()}
    grads = {k: jnp.asarray(1e-2 * x[0]) for k, x in host.items()}
    state, times = adam.init(params), []
    for i in range(steps + 2):
        start = time.perf_counter()
        params, state = jax.block_until_ready(fn(params, state, grads))
        if i >= 2:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure_data_parallel(steps: int, width: int = 1024) -> dict:
    """:func:`measure_data_parallel_here` in a child process with 2 simulated CPU devices."""
    flags = ["--dp-child", "--dp-steps", str(steps), "--dp-width", str(width)]
    return child_result(
        flags,
        "DP",
        "the dp.jit measurement",
        1800,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PJRT_NPROC="4",
    )


def data_parallel_table(res: dict) -> list[str]:
    out = [
        f"Through dp.jit on a mesh of {res.get('devices', '2 x cpu')} (shard_map), "
        f"{res['params']:,} params per worker in {res['leaves']} leaves, gradients given, "
        "median per kind over a continuous run (each step timed right after optax.adam and "
        "optax.adam + pmean through the same helper). Targets: "
        + ", ".join(f"{k} <= {v}x" for k, v in DATA_PARALLEL_TARGETS.items())
        + " (variance against adam + pmean, the others against adam).",
        "",
        "| kind | steps | adam ms | adam+pmean ms | dispatched ms | x adam | x adam+pmean | "
        "target | in-graph ms | x adam |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for kind in ozo.STEP_KINDS:
        r = res["kinds"].get(kind)
        if r is None:
            continue
        base = "adam+pmean" if kind == "variance" else "adam"
        got = r[f"dispatched_x_{base}"]
        target = DATA_PARALLEL_TARGETS[kind]
        flag = "ok" if got <= target else "missed"
        out.append(
            f"| {kind} | {r['steps']} | {r['adam_ms']:.1f} | {r['adam+pmean_ms']:.1f} | "
            f"{r['dispatched_ms']:.1f} | {r['dispatched_x_adam']:.2f} | "
            f"{r['dispatched_x_adam+pmean']:.2f} | <= {target} x {base}: {flag} | "
            f"{r['in-graph_ms']:.1f} | {r['in-graph_x_adam']:.2f} |"
        )
    pipe = res.get("pipelined")
    if pipe:
        out += [
            "",
            f"Whole runs of {pipe['steps']} steps from init, waiting only at the end (as a "
            "training loop does), ms per step, median of 3 rounds: "
            + ", ".join(
                f"{name} {pipe[f'{name}_ms']:.2f}"
                for name in (ADAM, ADAM_PMEAN, "dispatched", "hinted", "in-graph")
            )
            + f"; x adam: dispatched {pipe['dispatched_x_adam']:.2f}, hinted "
            f"{pipe['hinted_x_adam']:.2f} (the same programs without the dispatcher's checks), "
            f"in-graph {pipe['in-graph_x_adam']:.2f}.",
        ]
    plain = res.get("plain_jit_adam_ms")
    if plain:
        adam = statistics.median(r["adam_ms"] for r in res["kinds"].values())
        out += [
            "",
            f"For reference, optax.adam on one worker's tree under plain jax.jit on one device: "
            f"{plain:.1f} ms; through dp.jit (one worker per core, the median of the adam "
            f"column) {adam:.1f} ms, {adam / plain:.1f}x."
            + (
                " XLA:CPU copies donated buffers when the update's inputs reach it through "
                'the worker axis (docs/jit.md, "Performance on CPU"); the ratios above compare '
                "programs that pay it alike."
                if "cpu" in res.get("devices", "cpu")
                else ""
            ),
        ]
    memory = res.get("memory")
    if memory:
        adam_peak = memory[ADAM]["peak"]
        out += [
            "",
            "Memory one device holds while each program runs, bytes per parameter (XLA's buffer "
            "assignment, `compiled.memory_analysis()`, read for 0/1 and 1-bit Adam's kinds "
            "through `memory_analysis` of dp.jit's dispatcher; compile only: exact for this "
            "XLA, not a timing). Peak = arguments + outputs - in place + temporaries.",
            "",
            "| program | arguments | outputs | in place | temporaries | peak | x adam |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, m in memory.items():
            out.append(
                f"| {name} | {m['arguments']:.2f} | {m['outputs']:.2f} | {m['aliased']:.2f} | "
                f"{m['temporaries']:.2f} | {m['peak']:.2f} | {m['peak'] / adam_peak:.2f} |"
            )
    for r in res.get("host_time", []):
        out += [
            "",
            f"Host time per step, {r['leaves']} leaves of 8 x 8 (the calling thread's CPU time, "
            f"median of {r['calls']} local steps; on CPU the program runs on that thread too): "
            f"optax.adam {r['adam_us']:.0f} us, 0/1 Adam dispatched {r['dispatched_us']:.0f} us, "
            f"its local program alone {r['local program_us']:.0f} us.",
        ]
    return [*out, ""]


# ----------------------------------------------------------------------------------------------
# 4. State bytes


def tree_bytes(tree: Any) -> int:
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def state_bytes_per_param(tx: optax.GradientTransformation, params: Any, num_workers: int) -> float:
    """Optimizer-state bytes per parameter of one worker, for ``num_workers`` workers."""
    init = jax.vmap(tx.init, axis_name=AXIS, axis_size=num_workers)
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((num_workers, *x.shape), x.dtype), params)
    state = jax.eval_shape(init, stacked)
    return tree_bytes(state) / num_workers / model_trees.numel(params)


def measure_state(tree: dict, worker_counts: tuple[int, ...]) -> dict:
    txs = {
        "optax.adam": optax.adam(1e-3),
        ONEBIT: onebit_optimizer().tx,
        ZERO_ONE: zero_one_optimizer().tx,
    }
    return {
        name: {str(n): state_bytes_per_param(tx, tree, n) for n in worker_counts}
        for name, tx in txs.items()
    }


# ----------------------------------------------------------------------------------------------
# Reports


def tables(result: dict) -> str:
    """The printed tables (also the Markdown report's body)."""
    out = []
    if result["compile"]:
        w = result["compile"][0]["workers"]
        out += [
            f"Compile time ({w} workers under vmap, shapes only, a fresh process per "
            "measurement, median of runs): the update without a hint (every kind in one "
            "program, decided in the graph), the program of the first step's kind, the "
            "programs of all kinds one after the other (what a dispatched run compiles, each "
            "at its kind's first step; in the same process, after the in-graph update), then "
            "all kinds before a first step in a fresh process: in turn, and precompiled "
            "(`precompile`: each compiled on a thread while the next lowers; wall time), the "
            "last also with glibc's allocator as it comes (each process here keeps its memory "
            "in one arena, set for the step times, in which the compile threads wait on each "
            "other's allocations; against adam+pmean compiled the same way). "
            f"Targets: first <= {COMPILE_TARGETS['first']}x, all <= {COMPILE_TARGETS['all']}x "
            "adam+pmean.",
            "",
            "| program | leaves | params | in-graph s | x adam+pmean | first kind s | x | "
            "all kinds s | x | fresh, in turn s | x | fresh, precompiled s | x | "
            "precompiled, glibc as it comes s | x |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["compile"]:
            out.append(
                f"| {r['program']} | {r['leaves']} | {r['params']:,} | {r['total_s']:.2f} | "
                f"{r['ratio_to_adam_pmean']:.2f} | {r['first_kind_s']:.2f} | "
                f"{r['first_kind_ratio']:.2f} | {r['all_kinds_s']:.2f} | "
                f"{r['all_kinds_ratio']:.2f} | "
                + " | ".join(
                    f"{r.get(f'all_kinds_{mode}_{what}', float('nan')):.2f}"
                    for mode in ("turn", "ahead", "ahead_glibc")
                    for what in ("s", "ratio")
                )
                + " |"
            )
        out.append("")
    if result.get("cold_runs"):
        out += [
            f"0/1 Adam from a cold start to the end of a {RUN_STEPS}-step run (every kind; 100 "
            "leaves, 2 workers under vmap, gradients given, a fresh process per run, median of "
            "runs): the kinds' programs compiled lazily (each at its kind's first step), all by "
            "`precompile` before the first step, or by `precompile_in_background` beside "
            "the run.",
            "",
            "| programs compiled | runs | first step done, s | run done, s |",
            "|---|---:|---:|---:|",
        ]
        for r in result["cold_runs"]:
            out.append(
                f"| {r['mode']} | {r['runs']} | {r['first_step_s']:.2f} | {r['run_s']:.2f} |"
            )
        out.append("")
    for res in result["steps"]:
        out += [
            f"Step time, {res['params']:,} params per worker in {res['leaves']} leaves, "
            f"{res['workers']} workers under vmap (median of {res['repeats']} rounds, the "
            f"dispatched column over a {RUN_STEPS}-step run; ratios to the baselines timed "
            "in the same round; dispatched / hinted: the median step-by-step ratio to the same "
            "kind's hinted program called directly on a twin of that run, in alternating "
            "order). "
            + (
                "Under vmap lax.pmean is a slow XLA:CPU reduction over the worker axis and "
                "dominates adam+pmean: 'x adam' is the optimizer's own arithmetic."
                if result["device"].startswith("cpu")
                else "The vmapped workers share one device: the collectives are local copies."
            ),
            "",
            "| optimizer | kind | in-graph ms | x adam | hinted ms | x adam+pmean | x adam | "
            "dispatched ms | x adam+pmean | x adam | dispatched / hinted | B/param | "
            "hinted GB/s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in res["rows"]:
            ig, hi, di = r["in-graph"], r["hinted"], r["dispatched"]
            met = "ok" if r["dispatched_over_hinted"] <= DISPATCH_TARGET else "missed"
            out.append(
                f"| {r['optimizer']} | {r['kind']} | {ig['ms']:.1f} | {ig['ratio_to_adam']:.2f} "
                f"| {hi['ms']:.1f} | {hi['ratio_to_adam_pmean']:.2f} | {hi['ratio_to_adam']:.2f} "
                f"| {di['ms']:.1f} | {di['ratio_to_adam_pmean']:.2f} | {di['ratio_to_adam']:.2f} "
                f"| {r['dispatched_over_hinted']:.2f} (<= {DISPATCH_TARGET}: {met}) | "
                f"{hi['bytes_per_param']:.0f} | {hi['gb_s']:.1f} |"
            )
        adam_pmean = statistics.median(r["hinted"]["adam_pmean_ms"] for r in res["rows"])
        adam = statistics.median(r["hinted"]["adam_ms"] for r in res["rows"])
        triad = statistics.median(r["hinted"]["triad_ms"] for r in res["rows"])
        out += [
            "",
            f"Baselines (medians over all rounds): adam+pmean {adam_pmean:.1f} ms "
            f"({traffic_bytes(ADAM_PMEAN, 'step', res['workers']):.0f} B/param), adam "
            f"{adam:.1f} ms ({traffic_bytes(ADAM, 'step', res['workers']):.0f} B/param), triad "
            f"{triad:.1f} ms (12 B/element).",
            "",
        ]
    if result.get("data_parallel"):
        out += data_parallel_table(result["data_parallel"])
    if result["state"]:
        ns = list(next(iter(result["state"].values())))
        out += [
            f"State bytes per parameter ({result['state_tree']}), target <= {STATE_TARGET}:",
            "",
            "| optimizer | " + " | ".join(f"N = {n}" for n in ns) + " |",
            "|---|" + "---:|" * len(ns),
        ]
        for name, per_n in result["state"].items():
            out.append(f"| {name} | " + " | ".join(f"{per_n[n]:.2f}" for n in ns) + " |")
        out.append("")
    out += [TRAFFIC_LEGEND, ""]
    out += ["Bytes per parameter by kind:", ""]
    out += [f"- {opt} {kind}: {TRAFFIC[(opt, kind)][0]}" for opt, kind in TRAFFIC]
    return "\n".join(out)


def plot(result: dict, path: pathlib.Path) -> None:
    plt = common.pyplot()
    panels = (1 if result["compile"] else 0) + len(result["steps"])
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(5.5 * max(panels, 1), 4), squeeze=False)
    axes = list(axes[0])
    if result["compile"]:
        ax = axes.pop(0)
        leaves = sorted({r["leaves"] for r in result["compile"]})
        bars = [(ADAM_PMEAN, "total_s", "adam+pmean")]
        for program in (ZERO_ONE, ONEBIT):
            bars += [(program, "total_s", f"{program} in-graph")]
            bars += [(program, "first_kind_s", f"{program} first kind")]
            bars += [(program, "all_kinds_s", f"{program} all kinds")]
            bars += [(program, "all_kinds_ahead_s", f"{program} all kinds, precompiled")]
        width = 0.8 / len(bars)
        for i, (program, key, label) in enumerate(bars):
            total = {
                r["leaves"]: r.get(key, float("nan"))
                for r in result["compile"]
                if r["program"] == program
            }
            ys = [total[n] for n in leaves]
            ax.bar(np.arange(len(leaves)) + width * (i - len(bars) / 2), ys, width, label=label)
        ax.set_xticks(np.arange(len(leaves)), [f"{n} leaves" for n in leaves])
        ax.set(ylabel="lower + compile (s)", title="compile time")
        ax.legend(fontsize=6)
    for ax, res in zip(axes, result["steps"]):
        labels = [f"{r['optimizer']}\n{r['kind']}" for r in res["rows"]]
        x = np.arange(len(labels))
        for i, mode in enumerate(MODES):
            ys = [r[mode]["ratio_to_adam"] for r in res["rows"]]
            ax.bar(x + 0.27 * (i - 1), ys, 0.27, color=f"C{i}", label=f"{mode}, x adam")
        ax.axhline(1, color="k", lw=0.8)
        ax.set_xticks(x, labels, fontsize=7)
        title = f"{res['params']:,} params, {res['leaves']} leaves"
        ax.set(ylabel="step time / adam's (log)", yscale="log", title=title)
        ax.legend(fontsize=7)
    common.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = common.argument_parser("benchmarks.overhead", __doc__)
    p.add_argument("--quick", action="store_true", help="1M params, 100 leaves, 3 rounds")
    p.add_argument("--params", type=float, default=None, help="per worker (default 4e6)")
    p.add_argument("--leaves", type=int, nargs="+", default=None, help="default 100 10")
    p.add_argument("--workers", type=int, default=2, help="vmapped workers for the step times")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 9)")
    p.add_argument("--compile-leaves", type=int, nargs="+", default=None, help="default 100 400")
    p.add_argument("--compile-workers", type=int, default=8, help="workers under vmap")
    p.add_argument("--compile-repeats", type=int, default=None, help="fresh processes (3)")
    p.add_argument("--skip-compile", action="store_true", help="no compile tables")
    p.add_argument("--skip-steps", action="store_true", help="no vmap step tables")
    p.add_argument("--compile-one", choices=[ADAM_PMEAN, ZERO_ONE, ONEBIT], help=argparse.SUPPRESS)
    p.add_argument("--compile-ahead", choices=["turn", "ahead"], help=argparse.SUPPRESS)
    p.add_argument("--cold-run", choices=COLD_MODES, help=argparse.SUPPRESS)
    p.add_argument("--dp-steps", type=int, default=None, help="dp.jit run length (default 64)")
    p.add_argument("--skip-data-parallel", action="store_true", help="no dp.jit table")
    p.add_argument("--dp-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--dp-here",
        action="store_true",
        help="dp.jit on this process's own devices (a GPU), not 2 simulated CPU devices",
    )
    p.add_argument("--dp-devices", type=int, default=2, help="with --dp-here (default 2)")
    p.add_argument("--dp-width", type=int, default=1024, help="dp.jit tree width (1024: 4.2M)")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default results/overhead.json; with --quick, overhead_quick.json)",
    )
    p.add_argument(
        common.SYSTEM_ALLOCATOR,
        action="store_true",
        help="on CPU, time with glibc as it comes (default: common.KEEP_MEMORY, docs/jit.md)",
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.compile_one:  # a child process of the compile-time measurement
        (leaves,) = args.compile_leaves
        if args.compile_ahead:
            threads = args.compile_ahead == "ahead"
            row = compile_ahead(args.compile_one, leaves, args.compile_workers, threads)
        else:
            row = compile_once(args.compile_one, leaves, args.compile_workers)
        print("COMPILE " + json.dumps(row), flush=True)
        return row
    if args.cold_run:  # a child process of the cold-start measurement
        row = cold_run(args.cold_run)
        print("COLD " + json.dumps(row), flush=True)
        return row
    if args.dp_child:  # a child process of the dp.jit measurement, on 2 simulated devices
        row = measure_data_parallel_here(args.dp_steps or RUN_STEPS, args.dp_width)
        print("DP " + json.dumps(row), flush=True)
        return row
    quick = args.quick
    num_params = int(args.params or (1e6 if quick else 4e6))
    leaf_counts = args.leaves or ([100] if quick else [100, 10])
    repeats = args.repeats or (3 if quick else 9)
    compile_leaves = args.compile_leaves or ([100] if quick else [100, 400])
    compile_repeats = args.compile_repeats or (1 if quick else 3)
    out_path = pathlib.Path(args.out or f"results/overhead{'_quick' if quick else ''}.json")
    log = lambda line: print(line, flush=True)  # noqa: E731
    started = time.perf_counter()
    result: dict[str, Any] = {
        "command": "python -m benchmarks.overhead " + " ".join(argv or sys.argv[1:]),
        "device": str(jax.devices()[0]),
        "allocator": common.allocator_settings(),
        "schedule": {
            "zero_one": {"variance_policy": repr(VARIANCE), "local_step_policy": repr(LOCAL)},
            "onebit": {"freeze_step": ONEBIT_FREEZE},
        },
        "traffic_legend": TRAFFIC_LEGEND,
        "traffic": {f"{o}/{k}": v[0] for (o, k), v in TRAFFIC.items()},
        "targets": {
            "dispatched_over_hinted": DISPATCH_TARGET,
            "compile_x_adam_pmean": COMPILE_TARGETS,
            "data_parallel": DATA_PARALLEL_TARGETS,
            "state_bytes_per_param": STATE_TARGET,
        },
        "compile": [],
        "steps": [],
        "state": {},
    }
    if not args.skip_compile:
        log(f"Compile time, {args.compile_workers} vmapped workers, fresh process per compile:")
        result["compile"] = measure_compile(
            compile_leaves, args.compile_workers, compile_repeats, log
        )
        result["cold_runs"] = measure_cold_runs(compile_repeats, log)
    reference = None
    trees = []
    for leaves in leaf_counts:
        tree = step_tree(num_params, leaves, reference)
        reference = reference or (tree if model_trees.num_leaves(tree) > 16 else None)
        trees.append(tree)
    if not args.skip_steps:
        for tree in trees:
            log(
                f"\nStep time, {model_trees.numel(tree):,} params in "
                f"{model_trees.num_leaves(tree)} leaves, {args.workers} vmapped workers:"
            )
            result["steps"].append(measure_steps(tree, args.workers, repeats, log))
    if not args.skip_data_parallel:
        steps = args.dp_steps or RUN_STEPS
        if args.dp_here:
            log(f"\nThrough dp.jit on {args.dp_devices} of this process's devices:")
            result["data_parallel"] = measure_data_parallel_here(
                steps, args.dp_width, args.dp_devices
            )
        else:
            log("\nThrough dp.jit on a 2-device mesh (child process):")
            result["data_parallel"] = measure_data_parallel(steps, args.dp_width)
        for line in data_parallel_table(result["data_parallel"]):
            log("  " + line)
    state_tree = trees[0]
    result["state_tree"] = (
        f"{model_trees.numel(state_tree):,} params in {model_trees.num_leaves(state_tree)} leaves"
    )
    result["state"] = measure_state(state_tree, (args.workers, 64))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    text = tables(result)
    print("\n" + text)
    head = f"`{result['command']}` on {result['device']}, {result['wall_s']:.0f} s."
    if result["allocator"]:
        head += " " + common.allocator_note(result["allocator"])
    report = f"# Optimizer overhead\n\n{head}\n\n{text}\n"
    paths = common.write_results(out_path, result, report, plot)
    print(f"\nwrote {', '.join(map(str, paths))} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    common.rerun_keeping_memory("benchmarks.overhead")
    main()
