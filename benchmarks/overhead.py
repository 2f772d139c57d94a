"""Optimizer overhead: time of one jitted update on one device, as a ratio to ``optax.adam``.

``python -m benchmarks.overhead [--sizes 1e6 1e7] [--workers 2] [--repeats 9] [--pinned]``

For each size (float32 parameters in as many leaves as a transformer of that size,
:func:`benchmarks.model_trees.transformer_of_size`) and each optimizer step kind, times one
training-step update ``params, state <- apply(update(grads, state, params))`` jitted with the
params, state and gradients donated, on ``--workers`` data-parallel workers simulated with
``jax.vmap(axis_name=...)`` on one CPU device (so the 1-bit compression, packing and unpacking
really run; the all-to-all and all-gather become local copies of packed bytes). The baseline is
``optax.adam`` on the same workers, timed in alternation with each variant in the same process:
ratio = median(variant) / median(adam) over ``--repeats`` pairs, after warm-up (also reported:
the ratio of process CPU times, and of the fastest calls, which are less disturbed when other
jobs share the machine). A float ``pmean`` under ``vmap`` is a reduction over the worker axis,
which XLA:CPU runs slowly (~130 ms for 2 x 10M float32, ten times Adam's update): it stands for
an all-reduce, i.e. communication, so the variance / warm-up kinds, which contain one, are also
given as a ratio to ``optax.adam`` after the same ``pmean`` ("pmean+Adam", the data-parallel
step they replace).

Step kinds are timed two ways:

- **live** (default): the user's program. One executable per optimizer holding every kind, each
  communicating kind in its loop of zero or one trip; each call gets the counters of a step of
  the wanted kind as scalars shared by the workers (as under ``shard_map``/``pmap``, where the
  trip count is a real run-time value).
- **pinned** (``--pinned``): the counters are Python ints inside the jitted function, so the
  program holds that kind alone (what an ideal per-kind program would cost). The gap between the
  two is the cost of carrying every kind in one program.

Also reports optimizer-state bytes per parameter (for the measured worker count and for 64
workers; the error buffers of the compressed mean depend on ``N``). Targets: local step
<= 1.2x Adam, compressed/sync <= 1.6x Adam, state <= 20 bytes per parameter.

100M parameters need ~6 GB and several minutes of compiling and timing on a 2-core machine:
``--sizes 1e6 1e7 1e8``.
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
from benchmarks import common, model_trees  # noqa: E402

AXIS = common.AXIS
# The gradients are donated so the optimizer may overwrite them; programs that do not are fine.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
TARGETS = {"local": 1.2, "compressed": 1.6, "sync": 1.6}
STATE_TARGET = 20.0

# A short schedule in which every kind occurs early (the kinds, not the schedule, are timed).
VARIANCE = ozo.VarianceDoubling(freeze_step=8, update_scaler=2)  # variance 1,2,4,6,8
LOCAL = ozo.LocalStepDoubling(scaler=1, clipper=4)  # phase B: syncs 9, 10, 12, 16, ...
ONEBIT_FREEZE = 4


@dataclasses.dataclass(frozen=True)
class Variant:
    """One timed program: an optimizer, a step kind and the step pinned or set."""

    optimizer: str
    kind: str
    step: int | None
    spec: common.OptimizerSpec


def variants(num_workers: int) -> list[Variant]:
    """``optax.adam`` plus every step kind of 1-bit Adam and 0/1 Adam."""
    zero_one = common.zero_one_spec(
        "0/1 Adam",
        ozo.scale_by_zero_one_adam(
            1e-3, variance_policy=VARIANCE, local_step_policy=LOCAL, axis_name=AXIS
        ),
        VARIANCE,
        LOCAL,
    )
    onebit = common.onebit_spec(
        "1-bit Adam",
        ozo.onebit_adam(1e-3, freeze_step=ONEBIT_FREEZE, axis_name=AXIS),
        ONEBIT_FREEZE,
    )
    first = common.first_step_of_each_kind(common.zero_one_kinds(VARIANCE, LOCAL, 64))
    out = [
        Variant("1-bit Adam", "warmup", 1, onebit),
        Variant("1-bit Adam", "compressed", ONEBIT_FREEZE + 1, onebit),
    ]
    for index, kind in enumerate(ozo.STEP_KINDS):
        out.append(Variant("0/1 Adam", kind, first[index], zero_one))
    return out


def adam_spec(average_grads: bool = False) -> common.OptimizerSpec:
    """``optax.adam``; with ``average_grads`` after a float32 ``pmean`` of the gradients."""
    return common.OptimizerSpec("optax.adam", optax.adam(1e-3), average_grads=average_grads)


def counter_values(spec: common.OptimizerSpec, state: Any, step: int) -> list[np.int32]:
    """The optimizer's counters before ``step``, in the order of the state's leaves."""
    return [np.int32(x) for x in jax.tree.leaves(spec.pin(state, step)) if isinstance(x, int)]


def _with_counters(state: Any, spec: common.OptimizerSpec, counters: list[Any]) -> Any:
    """``state`` with its counter leaves replaced by ``counters`` (traced scalars)."""
    pinned, treedef = jax.tree.flatten(spec.pin(state, 1))
    values = iter(counters)
    leaves = [
        next(values) if isinstance(p, int) else x for p, x in zip(pinned, jax.tree.leaves(state))
    ]
    return jax.tree.unflatten(treedef, leaves)


def make_step(spec: common.OptimizerSpec, pin_step: int | None) -> Callable[..., Any]:
    """The jitted, donating update of every worker: ``(params, state, grads, counters) ->
    (params, state)``, vmapped over the workers.

    ``counters`` (live mode, ``pin_step=None``): scalars shared by all workers that replace the
    state's counters, so the step kind is one traced value as under ``shard_map``/``pmap``
    (per-worker counters would make ``vmap`` turn the kinds' loops into selects). With
    ``pin_step`` the counters are Python ints and the program holds that kind
    alone.
    """

    def step(params: Any, state: Any, grads: Any, counters: Any) -> Any:
        if pin_step is not None and spec.pin is not None:
            state = spec.pin(state, pin_step)
        elif counters:
            state = _with_counters(state, spec, counters)
        if spec.average_grads:
            grads = jax.lax.pmean(grads, AXIS)
        updates, state = spec.tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    vmapped = jax.vmap(step, in_axes=(0, 0, 0, None), axis_name=AXIS)
    return jax.jit(vmapped, donate_argnums=(0, 1, 2))


def hlo_summary(compiled: Any) -> dict[str, Any]:
    """Instruction counts of an optimised program: copies (and their bytes), conditionals, loops."""
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
        "conditionals": len(re.findall(r"\sconditional\(", text)),
        "loops": len(re.findall(r"\swhile\(", text)),
    }


_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def _timed(
    fn: Callable[..., Any], params: Any, state: Any, grads: Any, counters: Any
) -> tuple[Any, tuple[float, float]]:
    """``fn(params, state, grads, counters)`` waited for, with its wall and process-CPU seconds.

    The step donates the gradients (in a training step they are a temporary of the backward
    pass, which the optimizer may overwrite), so it gets a fresh copy, made before the clock
    starts.
    """
    args = (params, state, jax.block_until_ready(_copy(grads)), counters)
    wall, cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn(*args))
    return out, (time.perf_counter() - wall, time.process_time() - cpu)


def tree_bytes(tree: Any) -> int:
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def state_bytes_per_param(spec: common.OptimizerSpec, params: Any, num_workers: int) -> float:
    """Optimizer-state bytes per parameter of one worker, for ``num_workers`` workers."""
    init = jax.vmap(spec.tx.init, axis_name=AXIS, axis_size=num_workers)
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((num_workers, *x.shape), x.dtype), params)
    state = jax.eval_shape(init, stacked)
    return tree_bytes(state) / num_workers / sum(x.size for x in jax.tree.leaves(params))


def measure_size(num_params: int, workers: int, repeats: int, pinned: bool, log: Callable) -> dict:
    tree = model_trees.transformer_of_size(num_params)
    numel = model_trees.numel(tree)
    rng = np.random.default_rng(0)

    def random_layout(scale: float) -> Any:
        return jax.tree.map(
            lambda x: jnp.asarray(rng.standard_normal((workers, *x.shape), np.float32) * scale),
            tree,
        )

    grads = random_layout(1e-2)
    adam, dp_adam = adam_spec(), adam_spec(average_grads=True)
    baselines = {}  # name -> [compiled step, params, state]
    for name, spec in (("adam", adam), ("dp_adam", dp_adam)):
        p = random_layout(1.0)
        s = jax.vmap(spec.tx.init)(p)
        baselines[name] = [make_step(spec, None).lower(p, s, grads, []).compile(), p, s]
    adam_hlo = hlo_summary(baselines["adam"][0])
    log(f"  optax.adam: {adam_hlo['copies']} copies {adam_hlo['copy_bytes'] / 1e6:,.0f} MB")

    def run_baseline(name: str) -> tuple[float, float]:
        step, p, s = baselines[name]
        (p, s), t = _timed(step, p, s, grads, [])
        baselines[name][1:] = [p, s]
        return t

    # pmean+Adam is timed on its own (its slow reduction would disturb the pairs' caches).
    run_baseline("dp_adam")
    dp_adam_s = statistics.median(run_baseline("dp_adam")[0] for _ in range(repeats))
    rows = []
    programs: dict[tuple[str, str], Any] = {}
    for v in variants(workers):
        for mode in ("live", "pinned") if pinned else ("live",):
            params = random_layout(1.0)
            state = jax.vmap(v.spec.tx.init, axis_name=AXIS)(params)
            counters = counter_values(v.spec, state, v.step) if mode == "live" else []
            key = (v.optimizer, v.kind if mode == "pinned" else "live")
            start = time.perf_counter()
            if key not in programs:
                jitted = make_step(v.spec, v.step if mode == "pinned" else None)
                programs[key] = jitted.lower(params, state, grads, counters).compile()
            compile_s = time.perf_counter() - start
            step = programs[key]
            (params, state), _ = _timed(step, params, state, grads, counters)  # warm-up
            t_var, t_adam = [], []
            for _ in range(repeats):  # pairs, so both see the same machine
                t_adam.append(run_baseline("adam"))
                (params, state), tv = _timed(step, params, state, grads, counters)
                t_var.append(tv)
            summary = hlo_summary(step)
            wall = [statistics.median(t[0] for t in ts) for ts in (t_var, t_adam)]
            wall.append(dp_adam_s)
            cpu = [statistics.median(t[1] for t in ts) for ts in (t_var, t_adam)]
            fastest = [min(t[0] for t in ts) for ts in (t_var, t_adam)]
            row = {
                "optimizer": v.optimizer,
                "kind": v.kind,
                "mode": mode,
                "step": v.step,
                "median_ms": 1e3 * wall[0],
                "adam_median_ms": 1e3 * wall[1],
                "ratio_to_adam": wall[0] / wall[1],
                "cpu_median_ms": 1e3 * cpu[0],
                "adam_cpu_median_ms": 1e3 * cpu[1],
                "cpu_ratio_to_adam": cpu[0] / cpu[1],
                "dp_adam_median_ms": 1e3 * wall[2],
                "ratio_to_dp_adam": wall[0] / wall[2],
                "min_ms": 1e3 * fastest[0],
                "adam_min_ms": 1e3 * fastest[1],
                "min_ratio_to_adam": fastest[0] / fastest[1],
                "compile_s": compile_s,
                "hlo": summary,
            }
            target = TARGETS.get(v.kind)
            row["target"] = target
            row["meets_target"] = None if target is None else row["ratio_to_adam"] <= target
            rows.append(row)
            log(
                f"  {v.optimizer:<10} {v.kind:<10} {mode:<6} {row['median_ms']:>9.1f} ms  "
                f"adam {row['adam_median_ms']:>8.1f} ms  x{row['ratio_to_adam']:.2f} "
                f"(cpu x{row['cpu_ratio_to_adam']:.2f}, min x{row['min_ratio_to_adam']:.2f}; "
                f"x{row['ratio_to_dp_adam']:.2f} pmean+adam)"
                + ("" if target is None else f"  target <= {target}x")
                + f"  [{summary['copies']} copies {summary['copy_bytes'] / 1e6:,.0f} MB,"
                f" {summary['loops']} loops]"
            )
            del params, state
    state_bytes = {}
    for name, spec in (("optax.adam", adam), ("1-bit Adam", variants(workers)[0].spec)):
        state_bytes[name] = {n: state_bytes_per_param(spec, tree, n) for n in (workers, 64)}
    zero_one = variants(workers)[-1].spec
    state_bytes["0/1 Adam"] = {n: state_bytes_per_param(zero_one, tree, n) for n in (workers, 64)}
    return {
        "num_params": numel,
        "leaves": model_trees.num_leaves(tree),
        "workers": workers,
        "float_buffer_bytes": 4 * numel * workers,
        "adam_hlo": adam_hlo,
        "rows": rows,
        "state_bytes_per_param": state_bytes,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__)
    p.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7])
    p.add_argument("--workers", type=int, default=2, help="vmapped workers on the one device")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--pinned", action="store_true", help="also time per-kind (pinned) programs")
    p.add_argument("--out", default="results/overhead.json")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    log = lambda line: print(line, flush=True)  # noqa: E731
    out: dict[str, Any] = {
        "command": "python -m benchmarks.overhead " + " ".join(argv or sys.argv[1:]),
        "device": str(jax.devices()[0]),
        "targets": {**TARGETS, "state_bytes_per_param": STATE_TARGET},
        "sizes": [],
    }
    for size in args.sizes:
        log(f"\n{size:,.0f} parameters, {args.workers} vmapped workers on one CPU device:")
        out["sizes"].append(measure_size(int(size), args.workers, args.repeats, args.pinned, log))
    print("\nRatio to optax.adam (median of pairs, same process); state bytes per parameter")
    head = f"{'params':>12} {'optimizer':<11}{'kind':<11}{'mode':<7}{'ms':>9}{'Adam ms':>9}"
    print(head + f"{'x Adam':>8}{'cpu x':>7}{'min x':>7}{'x pmean+Adam':>13}  target")
    for res in out["sizes"]:
        for r in res["rows"]:
            flag = "" if r["target"] is None else ("ok" if r["meets_target"] else "MISSED")
            print(
                f"{res['num_params']:>12,} {r['optimizer']:<11}{r['kind']:<11}{r['mode']:<7}"
                f"{r['median_ms']:>9.1f}{r['adam_median_ms']:>9.1f}{r['ratio_to_adam']:>8.2f}"
                f"{r['cpu_ratio_to_adam']:>7.2f}{r['min_ratio_to_adam']:>7.2f}"
                f"{r['ratio_to_dp_adam']:>13.2f}  "
                + ("" if r["target"] is None else f"<= {r['target']}x {flag}")
            )
        for name, per_n in res["state_bytes_per_param"].items():
            cells = ", ".join(f"N={n}: {b:.2f}" for n, b in per_n.items())
            print(f"{'':>12} state bytes/param {name:<11} {cells}  (target <= {STATE_TARGET})")
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {path}")
    return out


if __name__ == "__main__":
    main()
