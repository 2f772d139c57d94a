"""Optimizer overhead on CPU: compile time and step time of 0/1 Adam and 1-bit Adam against Adam.

``python -m benchmarks.overhead [--quick] [--params 4e6] [--leaves 100 10] [--repeats 7]``

Four measurements, all on one CPU device with the data-parallel workers simulated by
``jax.vmap(axis_name=...)`` (so the 1-bit compression, packing and unpacking really run; the
all-to-all and all-gather become local copies of packed bytes), every program being the whole
update ``params, state <- apply_updates(params, update(grads, state, params))``:

1. **Compile time** of the *live* update (the program users run: counters traced, every step
   kind in it), shapes only (``jax.ShapeDtypeStruct``; ``jax.jit(...).lower(...).compile()``),
   ``--compile-workers`` (8) workers, for ``zero_one_adam`` and ``onebit_adam`` against
   ``optax.adam`` after a ``lax.pmean`` of the gradients, on GPT-2-like trees of 100 and 400
   leaves (``model_trees.gpt2(layers, 64, vocab=1000, positions=64)``, 8 and 33 layers). Each
   compile runs in a fresh Python process (``--compile-repeats`` processes per program, the
   median is reported), so that no compilation cache can hide it: lower + compile seconds and
   the ratio to adam + pmean.
2. **Step time** of every step kind (0/1 Adam: variance, compressed, local, sync; 1-bit Adam:
   warm-up, compressed), ``--workers`` (2) workers, ~``--params`` parameters per worker in a
   GPT-2-shaped tree of 100 leaves and the same total split into 10 equal leaves
   (``--leaves``), params and state donated. Two programs per kind:

   - **live**: one program per optimizer holding every kind, the counters traced arrays; the
     state is set to the step of the wanted kind outside ``jit`` (``ozo.pin_step``, then every
     pinned int turned back into an array), as it would be in training;
   - **pinned**: the counters pinned with ``ozo.pin_step`` inside the jitted function, so the
     program holds that kind alone (what an ideal per-kind program would cost).

   Reported as the median over rounds of the ratio to ``optax.adam`` + ``lax.pmean`` of the
   gradients, timed right before the variant in each round (same process, same load). Also
   against plain ``optax.adam`` (no pmean): under ``vmap`` the pmean is a reduction over the
   worker axis that XLA:CPU runs slowly, so it dominates the adam + pmean baseline, which then
   flatters every ratio; the plain-Adam ratio is the optimizer's own arithmetic.
3. **Memory traffic**: next to every step time, the bytes per parameter the kind must read and
   write (counted from the algorithm, see :data:`TRAFFIC`: each buffer read or written once
   per step, 4 bytes per float32 element), the GB/s that this implies, and the GB/s of a plain
   elementwise triad (``a * 2 + b`` over as many elements as all workers' parameters, ``a``
   donated; 12 bytes per element) timed in the same rounds: how close each step is to the
   memory bandwidth the machine delivers.
4. **State bytes per parameter** of one worker (``N`` = ``--workers`` and 64), from
   ``jax.eval_shape`` of the init: the error buffers of the compressed mean depend on ``N``.

Writes ``results/overhead.json``, ``.png`` and ``.md`` (``--quick``: ``overhead_quick.*``);
Default step-time trees: ``gpt2(8, 192, vocab=2009, positions=286)`` (3,999,936 parameters in
100 leaves) and the same 3,999,936 parameters as 10 leaves of ``(~2083, 192)``. ``--quick``
(1M parameters, 100 leaves, 3 rounds, compile at 100 leaves once) takes under a minute; the
default run ~2-3 min on a shared 2-core machine. Timings on a shared machine move by
10-20% between runs; ratios, taken in the same rounds, move less.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts its backend

import argparse  # noqa: E402
import dataclasses  # noqa: E402
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
# Pinned programs do not read the state's counters, whose donated buffers then go unused.
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
# Live step time as a ratio to optax.adam + pmean timed in the same round (issue "Core v2").
TARGETS = {"variance": 1.6, "compressed": 1.6, "local": 1.0, "sync": 1.6, "warmup": 1.6}
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
    """An optimizer with its step kinds and the policies that pin them."""

    name: str
    tx: optax.GradientTransformation
    kind_names: tuple[str, ...]
    first_steps: dict[str, int]  # kind -> first 1-based step of that kind
    variance_policy: Any
    local_step_policy: Any = None

    def pin(self, state: Any, step: int) -> Any:
        return ozo.pin_step(state, step, self.variance_policy, self.local_step_policy)

    def kind(self, state: Any) -> Any:
        return ozo.step_kind(state, self.variance_policy, self.local_step_policy)


def _first_steps(names: tuple[str, ...], kinds: np.ndarray) -> dict[str, int]:
    return {names[k]: step for k, step in common.first_step_of_each_kind(kinds).items()}


def zero_one_optimizer() -> Optimizer:
    tx = ozo.scale_by_zero_one_adam(
        1e-3, variance_policy=VARIANCE, local_step_policy=LOCAL, axis_name=AXIS
    )
    first = _first_steps(ozo.STEP_KINDS, ozo.step_kinds(VARIANCE, LOCAL, 64))
    return Optimizer(ZERO_ONE, tx, ozo.STEP_KINDS, first, VARIANCE, LOCAL)


def onebit_optimizer() -> Optimizer:
    tx = ozo.onebit_adam(1e-3, freeze_step=ONEBIT_FREEZE, axis_name=AXIS)
    first = _first_steps(ozo.ONEBIT_STEP_KINDS, ozo.onebit_step_kinds(ONEBIT_FREEZE, 64))
    return Optimizer(ONEBIT, tx, ozo.ONEBIT_STEP_KINDS, first, WARMUP)


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


def _update_fn(tx: optax.GradientTransformation, average_grads: bool) -> Callable[..., Any]:
    def update(params: Any, state: Any, grads: Any) -> Any:
        if average_grads:
            grads = jax.lax.pmean(grads, AXIS)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return update


def compile_once(program: str, leaves: int, workers: int) -> dict:
    """Lowers and compiles one live update (shapes only) in this process; seconds and size."""
    tree = compile_tree(leaves)
    tx, average = {
        ADAM_PMEAN: (optax.adam(1e-3), True),
        ZERO_ONE: (zero_one_optimizer().tx, False),
        ONEBIT: (onebit_optimizer().tx, False),
    }[program]
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((workers, *x.shape), x.dtype), tree)
    state = jax.eval_shape(jax.vmap(tx.init, axis_name=AXIS), stacked)
    fn = jax.jit(jax.vmap(_update_fn(tx, average), axis_name=AXIS), donate_argnums=(0, 1))
    start = time.perf_counter()
    lowered = fn.lower(stacked, state, stacked)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    return {
        "program": program,
        "leaves": model_trees.num_leaves(tree),
        "params": model_trees.numel(tree),
        "workers": workers,
        "lower_s": lowered_at - start,
        "compile_s": done - lowered_at,
        "total_s": done - start,
        "hlo_instructions": hlo_summary(compiled)["instructions"],
    }


def compile_in_fresh_process(program: str, leaves: int, workers: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.overhead", "--compile-one", program]
    cmd += ["--compile-leaves", str(leaves), "--compile-workers", str(workers)]
    # no persistent compilation cache either: every compile is a first compile
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("COMPILE ")]
    if out.returncode or not lines:
        raise RuntimeError(f"compile of {program} at {leaves} leaves failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("COMPILE ") :])


def measure_compile(leaf_counts: list[int], workers: int, repeats: int, log: Callable) -> list:
    rows = []
    for leaves in leaf_counts:
        base = None
        for program in (ADAM_PMEAN, ZERO_ONE, ONEBIT):
            runs = [compile_in_fresh_process(program, leaves, workers) for _ in range(repeats)]
            row = {
                **runs[0],
                **{
                    key: statistics.median(r[key] for r in runs)
                    for key in ("lower_s", "compile_s", "total_s")
                },
                "runs_total_s": [round(r["total_s"], 3) for r in runs],
            }
            base = base or row["total_s"]
            row["ratio_to_adam_pmean"] = row["total_s"] / base
            rows.append(row)
            log(
                f"  compile {program:<11} {row['leaves']:>4} leaves ({row['params']:,} params, "
                f"{workers} workers): lower {row['lower_s']:.2f} s + compile {row['compile_s']:.2f}"
                f" s = {row['total_s']:.2f} s, x{row['ratio_to_adam_pmean']:.2f} adam+pmean  "
                f"[{row['hlo_instructions']} HLO instructions; runs {row['runs_total_s']}]"
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


def at_step(state: Any, opt: Optimizer, step: int) -> Any:
    """A live state (arrays) whose counters are those before update ``step``: pinned with
    ``ozo.pin_step``, every pinned int turned back into an array of the leaf's shape and dtype."""
    pinned = opt.pin(state, step)
    return jax.tree.map(
        lambda p, o: jnp.array(jnp.broadcast_to(jnp.asarray(p, o.dtype), o.shape), copy=True),
        pinned,
        state,
    )


def with_variance(state: Any, value: float) -> Any:
    """``state`` with Adam's second moment set to ``value`` (as after some training)."""

    def set_nu(node: Any) -> Any:
        if isinstance(node, ozo.FrozenVarianceAdamState):
            return node._replace(nu=jax.tree.map(lambda v: jnp.full_like(v, value), node.nu))
        return node

    is_node = lambda x: isinstance(x, ozo.FrozenVarianceAdamState)  # noqa: E731
    return jax.tree.map(set_nu, state, is_leaf=is_node)


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
    """Live and pinned step times of every kind against adam + pmean, adam and the triad."""
    numel = model_trees.numel(tree)
    rng = np.random.default_rng(0)

    def stacked(scale: float) -> Any:
        return jax.tree.map(
            lambda x: jnp.asarray(rng.standard_normal((workers, *x.shape), np.float32) * scale),
            tree,
        )

    params0, grads = stacked(1.0), stacked(1e-2)
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
        state0 = jax.jit(jax.vmap(opt.tx.init, axis_name=AXIS))(params0)
        state0 = with_variance(state0, 1e-4)
        live_fn = jax.vmap(_update_fn(opt.tx, False), axis_name=AXIS)
        live_compiled = None
        for kind in opt.kind_names:
            step = opt.first_steps[kind]
            state_k = at_step(state0, opt, step)
            taken = np.unique(np.asarray(opt.kind(state_k)))
            if taken.tolist() != [opt.kind_names.index(kind)]:
                raise RuntimeError(f"{opt.name}: state at step {step} is of kind {taken}")
            make_live = lambda s=state_k: (fresh_params(), _copy(s), grads)  # noqa: E731
            if live_compiled is None:
                live = _compile(f"{opt.name} live", live_fn, make_live(), make_live)
                live_compiled = live
            else:
                live = dataclasses.replace(live_compiled, make_args=make_live, compile_s=0.0)

            def pinned_fn(p: Any, s: Any, g: Any, opt: Optimizer = opt, step: int = step) -> Any:
                return _update_fn(opt.tx, False)(p, opt.pin(s, step), g)

            make_pinned = lambda s=state0: (fresh_params(), _copy(s), grads)  # noqa: E731
            pinned = _compile(
                f"{opt.name} {kind} pinned",
                jax.vmap(pinned_fn, axis_name=AXIS),
                make_pinned(),
                make_pinned,
            )
            row = {"optimizer": opt.name, "kind": kind, "step": step}
            for mode, program in (("live", live), ("pinned", pinned)):
                _, (p_out, _) = time_call(program)  # warm-up, and a check of the result
                finite = bool(all(jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(p_out)))
                times = {name: [] for name in (ADAM_PMEAN, ADAM, TRIAD, mode)}
                for _ in range(repeats):  # rounds: the baselines right before the variant
                    for name, base in bases.items():
                        times[name].append(time_call(base)[0])
                    times[mode].append(time_call(program)[0])
                row[mode] = _summary(times, mode, opt.name, kind, numel, workers, program)
                row[mode]["finite_params"] = finite
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
    live, pinned = row["live"], row["pinned"]
    return (
        f"{row['optimizer']:<10} {row['kind']:<10} live {live['ms']:7.1f} ms "
        f"x{live['ratio_to_adam_pmean']:.2f} adam+pmean x{live['ratio_to_adam']:.2f} adam "
        f"{live['gb_s']:5.1f} GB/s | pinned {pinned['ms']:7.1f} ms "
        f"x{pinned['ratio_to_adam_pmean']:.2f} x{pinned['ratio_to_adam']:.2f} "
        f"{pinned['gb_s']:5.1f} GB/s | {live['bytes_per_param']:.0f} B/param, triad "
        f"{live['triad_gb_s']:.1f} GB/s, adam+pmean {live['adam_pmean_ms']:.1f} ms, adam "
        f"{live['adam_ms']:.1f} ms"
    )


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
            f"Compile time of the live update ({w} workers under vmap, shapes only, a fresh "
            "process per compile, median of runs):",
            "",
            "| program | leaves | params | lower s | compile s | total s | x adam+pmean |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["compile"]:
            out.append(
                f"| {r['program']} | {r['leaves']} | {r['params']:,} | {r['lower_s']:.2f} | "
                f"{r['compile_s']:.2f} | {r['total_s']:.2f} | {r['ratio_to_adam_pmean']:.2f} |"
            )
        out.append("")
    for res in result["steps"]:
        out += [
            f"Step time, {res['params']:,} params per worker in {res['leaves']} leaves, "
            f"{res['workers']} workers under vmap (median of {res['repeats']} rounds; ratios to "
            "the baselines timed in the same round). Under vmap lax.pmean is a slow XLA:CPU "
            "reduction over the worker axis and dominates adam+pmean: 'x adam' is the "
            "optimizer's own arithmetic.",
            "",
            "| optimizer | kind | live ms | x adam+pmean | x adam | live GB/s | pinned ms | "
            "x adam+pmean | x adam | pinned GB/s | B/param | triad GB/s | "
            "target (live x adam+pmean) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in res["rows"]:
            lv, pn = r["live"], r["pinned"]
            target = TARGETS.get(r["kind"])
            met = target is not None and lv["ratio_to_adam_pmean"] <= target
            flag = "" if target is None else ("ok" if met else "missed")
            out.append(
                f"| {r['optimizer']} | {r['kind']} | {lv['ms']:.1f} | "
                f"{lv['ratio_to_adam_pmean']:.2f} | {lv['ratio_to_adam']:.2f} | {lv['gb_s']:.1f} | "
                f"{pn['ms']:.1f} | {pn['ratio_to_adam_pmean']:.2f} | {pn['ratio_to_adam']:.2f} | "
                f"{pn['gb_s']:.1f} | {lv['bytes_per_param']:.0f} | {lv['triad_gb_s']:.1f} | "
                + ("-" if target is None else f"<= {target} live: {flag}")
                + " |"
            )
        adam_pmean = statistics.median(r["live"]["adam_pmean_ms"] for r in res["rows"])
        adam = statistics.median(r["live"]["adam_ms"] for r in res["rows"])
        triad = statistics.median(r["live"]["triad_ms"] for r in res["rows"])
        out += [
            "",
            f"Baselines (medians over all rounds): adam+pmean {adam_pmean:.1f} ms "
            f"({traffic_bytes(ADAM_PMEAN, 'step', res['workers']):.0f} B/param), adam "
            f"{adam:.1f} ms ({traffic_bytes(ADAM, 'step', res['workers']):.0f} B/param), triad "
            f"{triad:.1f} ms (12 B/element).",
            "",
        ]
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
        programs = [ADAM_PMEAN, ZERO_ONE, ONEBIT]
        for i, program in enumerate(programs):
            total = {
                r["leaves"]: r["total_s"] for r in result["compile"] if r["program"] == program
            }
            ys = [total[n] for n in leaves]
            ax.bar(np.arange(len(leaves)) + 0.27 * (i - 1), ys, 0.27, label=program)
        ax.set_xticks(np.arange(len(leaves)), [f"{n} leaves" for n in leaves])
        ax.set(ylabel="lower + compile (s)", title="compile time of the live update")
        ax.legend()
    for ax, res in zip(axes, result["steps"]):
        labels = [f"{r['optimizer']}\n{r['kind']}" for r in res["rows"]]
        x = np.arange(len(labels))
        for i, mode in enumerate(("live", "pinned")):
            for j, (base, hatch) in enumerate(
                (("ratio_to_adam_pmean", ""), ("ratio_to_adam", "//"))
            ):
                ys = [r[mode][base] for r in res["rows"]]
                label = f"{mode}, x {'adam+pmean' if j == 0 else 'adam'}"
                alpha = 1.0 if j == 0 else 0.5
                offset = x + 0.2 * (2 * i + j) - 0.3
                ax.bar(offset, ys, 0.2, hatch=hatch, color=f"C{i}", alpha=alpha, label=label)
        ax.axhline(1, color="k", lw=0.8)
        ax.set_xticks(x, labels, fontsize=7)
        title = f"{res['params']:,} params, {res['leaves']} leaves"
        ax.set(ylabel="step time ratio (log)", yscale="log", title=title)
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
    p.add_argument("--compile-workers", type=int, default=8)
    p.add_argument("--compile-repeats", type=int, default=None, help="fresh processes (3)")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--skip-steps", action="store_true")
    p.add_argument("--compile-one", choices=[ADAM_PMEAN, ZERO_ONE, ONEBIT], help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="JSON path (default results/overhead.json)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.compile_one:  # a child process of the compile-time measurement
        (leaves,) = args.compile_leaves
        row = compile_once(args.compile_one, leaves, args.compile_workers)
        print("COMPILE " + json.dumps(row), flush=True)
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
        "schedule": {
            "zero_one": {"variance_policy": repr(VARIANCE), "local_step_policy": repr(LOCAL)},
            "onebit": {"freeze_step": ONEBIT_FREEZE},
        },
        "traffic_legend": TRAFFIC_LEGEND,
        "traffic": {f"{o}/{k}": v[0] for (o, k), v in TRAFFIC.items()},
        "targets_x_adam_pmean": {**TARGETS, "state_bytes_per_param": STATE_TARGET},
        "compile": [],
        "steps": [],
        "state": {},
    }
    if not args.skip_compile:
        log(f"Compile time, {args.compile_workers} vmapped workers, fresh process per compile:")
        result["compile"] = measure_compile(
            compile_leaves, args.compile_workers, compile_repeats, log
        )
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
    state_tree = trees[0]
    result["state_tree"] = (
        f"{model_trees.numel(state_tree):,} params in {model_trees.num_leaves(state_tree)} leaves"
    )
    result["state"] = measure_state(state_tree, (args.workers, 64))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    text = tables(result)
    print("\n" + text)
    head = f"`{result['command']}` on {result['device']}, {result['wall_s']:.0f} s."
    report = f"# Optimizer overhead\n\n{head}\n\n{text}\n"
    paths = common.write_results(out_path, result, report, plot)
    print(f"\nwrote {', '.join(map(str, paths))} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
