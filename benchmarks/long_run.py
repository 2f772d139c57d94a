"""Long runs: error buffers stay bounded, memory stays flat, results do not drift.

Three runs on 8 simulated CPU workers (``jax.shard_map``; every step waited for, see
``docs/testing.md``):

1. **Compressed mean, 20,000 calls** on random inputs (a fixed signal plus noise whose scale
   varies 100x between workers and calls, with exact zeros) over a tree of 4 leaves (~17k
   elements, scalar included). Per call: the RMS of every worker's error buffers, relative to
   the RMS of the inputs; the *drift* ``d_t = sum_s (output_s - true mean_s)``, which error
   feedback keeps equal to ``-(mean_i e_w,i + e_s)`` (bounded) instead of growing like a random
   walk; and the gap in that identity (float32 rounding).
2. **0/1 Adam, 5,000 steps** on a small problem (a 16-64-1 MLP regressing a random teacher, each
   worker its own minibatches), variance frozen after step 500, sync intervals doubling to 16,
   one program per step kind (:func:`optax_zero_one.dispatch_by_kind`): the loss of the
   synchronised params on held-out data, the error buffers, and how far the workers' params are
   apart right after each sync. ``optax.adam`` on the averaged gradient gives the reference
   loss.
3. **Workers' params after a sync**, 0/1 Adam with bfloat16 and with float32 params on a noisy
   quadratic: how far apart the workers are right after each sync, early and late in the run.

Memory: process RSS and the number of live JAX arrays, sampled through the run.

Usage::

    python -m benchmarks.long_run [--quick] [--out results/long_run.json]

``--quick`` runs 2,000 and 500 steps (a smoke test). Figures are printed and saved as JSON
(``--out``, default ``results/long_run.json``), with a Markdown summary (``.md``) and a figure
(``.png``: error buffers and drift, 0/1 Adam's loss, memory over the run) beside it.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported; main() sets PJRT_NPROC

import functools  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from benchmarks.support import common  # noqa: E402
from optax_zero_one.core.collective import init_errors  # noqa: E402
from optax_zero_one.core.flat import to_flat  # noqa: E402

AXIS = "w"
WORKERS = 8
TREE = {"w": (256, 64), "b": (1000,), "odd": (7,), "scalar": ()}
# The worker-major layout of TREE over the workers (the compressed mean works on flat buffers).
LAYOUT = ozo.core.flat.Layout.of({k: np.empty(s, np.float32) for k, s in TREE.items()}, WORKERS)


def rss_mib() -> float:
    """Resident set size of this process now (Linux ``/proc``), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def memory_sample() -> dict:
    return {"rss_mib": round(rss_mib(), 1), "live_arrays": len(jax.live_arrays())}


def per_worker(fn: Any) -> tuple[Any, jax.sharding.Mesh]:
    """``fn`` (one worker's view) on :data:`WORKERS` workers under ``shard_map``, jitted, every
    argument and result with a leading worker axis; and the mesh to put its inputs on."""
    mesh = ozo.worker_mesh(AXIS, WORKERS)
    return jax.jit(ozo.on_workers(fn, mesh)), mesh


def _curve(x: np.ndarray, points: int = 400) -> list[float]:
    """``x`` at about ``points`` evenly spread indices (for the figure)."""
    return [float(v) for v in x[_curve_index(len(x), points)]]


def _curve_index(n: int, points: int = 400) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(points, n)).astype(int))


def _node(state: Any, cls: type) -> Any:
    """The one ``cls`` node of an optimizer state (for reading its buffers)."""
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, cls))
    (node,) = [n for n in nodes if isinstance(n, cls)]
    return node


def _rms(leaves: list[jax.Array]) -> jax.Array:
    total = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
    count = sum(x.size for x in leaves)
    return jnp.sqrt(total / max(count, 1))


# --- 1. the compressed mean ---------------------------------------------------------------------


def compressed_mean_run(calls: int, report_every: int = 1000) -> dict:
    """``calls`` calls of the compressed mean; per-call figures and memory samples."""
    signal_key, noise_key = jax.random.split(jax.random.key(0))
    signal = {
        k: jax.random.normal(jax.random.fold_in(signal_key, i), s)
        for i, (k, s) in enumerate(TREE.items())
    }

    def call(errors: Any, drift: Any, k: jax.Array) -> tuple:
        i = lax.axis_index(AXIS)
        key = jax.random.fold_in(jax.random.fold_in(noise_key, k), i)
        k_scale, k_zero, *k_leaves = jax.random.split(key, 2 + len(TREE))
        scale = 10.0 ** jax.random.uniform(k_scale, (), minval=-1.0, maxval=1.0)
        z = {}
        for (name, shape), kk in zip(TREE.items(), k_leaves):
            noise = jax.random.normal(kk, shape) * scale
            keep = jax.random.uniform(jax.random.fold_in(k_zero, len(z)), shape) > 0.05
            z[name] = jnp.where(keep, signal[name] + noise, 0.0)  # with exact zeros
        true_mean = lax.pmean(z, AXIS)  # for the figures only: not part of the method
        out, errors, _ = ozo.core.collective.compressed_mean(to_flat(z, LAYOUT), errors, AXIS)
        drift = jax.tree.map(lambda d, o, m: d + (o - m), drift, out.to_tree(), true_mean)
        # the identity: drift = -(mean_i e_w,i + e_s), per element (row j of the worker-major
        # buffers: chunk j of every leaf; worker j serves row j and keeps its error e_s)
        ew_mean = ozo.core.flat.FlatTree(lax.pmean(errors.worker_error.buffer, AXIS), LAYOUT)
        es_all = ozo.core.flat.FlatTree(lax.all_gather(errors.server_error, AXIS), LAYOUT)
        gaps = [
            jnp.max(jnp.abs(d + w + s))
            for d, w, s in zip(*map(jax.tree.leaves, (drift, ew_mean.to_tree(), es_all.to_tree())))
        ]
        figures = jnp.stack(
            [
                lax.pmax(_rms([errors.worker_error.buffer]), AXIS),
                lax.pmax(_rms([errors.server_error]), AXIS),
                _rms(jax.tree.leaves(drift)),
                lax.pmax(jnp.max(jnp.stack(gaps)), AXIS),
                lax.pmean(_rms(jax.tree.leaves(z)), AXIS),
                _rms(jax.tree.leaves(true_mean)),
            ]
        )
        return errors, drift, figures

    step, mesh = per_worker(call)
    zeros = {k: jnp.zeros(s) for k, s in TREE.items()}
    errors = ozo.to_workers(ozo.replicate(init_errors(LAYOUT), WORKERS), mesh)
    drift = ozo.to_workers(ozo.replicate(zeros, WORKERS), mesh)
    rows, memory, start = np.zeros((calls, 6), np.float32), [], time.time()  # preallocated
    for k in range(1, calls + 1):
        errors, drift, figures = step(errors, drift, jnp.full((WORKERS,), k, jnp.int32))
        rows[k - 1] = np.asarray(figures)[0]  # waits for the step (simulated-device deadlock)
        if k == 1 or k % report_every == 0:
            memory.append({"call": k, **memory_sample()})
            print(f"  compressed mean: call {k:6d}, {memory[-1]}", flush=True)
    figures = rows
    ew, es, drift_rms, gap, z_rms, mean_rms = figures.T
    return {
        "calls": calls,
        "elements": int(sum(np.prod(s, dtype=int) for s in TREE.values())),
        "seconds": round(time.time() - start, 1),
        "worker_error_rms": _stats(ew),
        "server_error_rms": _stats(es),
        "worker_error_rms_over_input_rms": _stats(ew / z_rms),
        "drift_rms": _stats(drift_rms),
        "drift_rms_first_vs_last_tenth": [
            float(drift_rms[: calls // 10].mean()),
            float(drift_rms[-calls // 10 :].mean()),
        ],
        "random_walk_rms_for_comparison": float(np.sqrt(calls) * np.mean(mean_rms)),
        "identity_gap_max": float(gap.max()),
        "input_rms_mean": float(z_rms.mean()),
        "memory": memory,
        "curves": {
            "call": [int(i) + 1 for i in _curve_index(calls)],
            "worker_error_rms": _curve(ew),
            "server_error_rms": _curve(es),
            "drift_rms": _curve(drift_rms),
            "input_rms": _curve(z_rms),
        },
    }


def _stats(x: np.ndarray) -> dict:
    return {"max": float(np.max(x)), "mean": float(np.mean(x)), "last": float(x[-1])}


# --- 2. 0/1 Adam on a small problem -------------------------------------------------------------

IN, HIDDEN, BATCH = 16, 64, 32


def mlp(params: Any, x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return (h @ params["w2"] + params["b2"])[:, 0]


def init_mlp(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros(1),
    }


def zero_one_adam_run(steps: int, report_every: int = 250) -> dict:
    """``steps`` steps of 0/1 Adam (and of ``optax.adam`` on the float mean, for reference)."""
    teacher = init_mlp(jax.random.key(1))
    eval_x = jax.random.normal(jax.random.key(2), (4096, IN))
    eval_y = mlp(teacher, eval_x)
    freeze = max(steps // 10, 1)
    lr = optax.cosine_decay_schedule(3e-3, steps, alpha=0.05)
    policies = dict(
        var_freeze_step=freeze,
        var_update_scaler=16,
        local_step_scaler=max(steps // 12, 1),  # intervals 1, 2, 4, 8, 16 by ~ step 4F
        local_step_clipper=16,
    )
    tx = ozo.zero_one_adam(lr, axis_name=AXIS, **policies)
    schedule = ozo.zero_one_schedule(**policies)
    adam = optax.adam(lr)

    def batch(k: jax.Array) -> tuple[jax.Array, jax.Array]:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(3), k), lax.axis_index(AXIS))
        x = jax.random.normal(key, (BATCH, IN))
        noise = 0.05 * jax.random.normal(jax.random.fold_in(key, 1), (BATCH,))
        return x, mlp(teacher, x) + noise

    def loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean(jnp.square(mlp(params, x) - y))

    def step(
        params: Any, state: Any, ref: Any, ref_state: Any, k: jax.Array, step_kind: Any = None
    ) -> tuple:
        x, y = batch(k)
        grads = jax.grad(loss)(params, x, y)
        updates, state = tx.update(grads, state, params, step_kind=step_kind)
        params = optax.apply_updates(params, updates)
        ref_grads = lax.pmean(jax.grad(loss)(ref, x, y), AXIS)
        ref_updates, ref_state = adam.update(ref_grads, ref_state, ref)
        ref = optax.apply_updates(ref, ref_updates)
        synced = ozo.synchronized_params(params, state)
        errors = _node(state, ozo.ScheduledMeanState).errors  # lent to the syncs after F
        anchor = _node(state, ozo.LocalStepSyncState).anchor.to_tree()
        leaves = jax.tree.leaves(params)
        spread = jnp.max(
            jnp.stack([jnp.max(lax.pmax(p, AXIS) - lax.pmin(p, AXIS)) for p in leaves])
        )
        figures = jnp.stack(
            [
                loss(synced, eval_x, eval_y),
                loss(ref, eval_x, eval_y),
                lax.pmax(_rms([errors.worker_error.buffer]), AXIS),
                lax.pmax(_rms([errors.server_error]), AXIS),
                lax.pmax(_rms(jax.tree.leaves(jax.tree.map(jnp.subtract, anchor, params))), AXIS),
                spread,
                _rms(jax.tree.leaves(grads)),
            ]
        )
        return params, state, ref, ref_state, figures

    # one program per step kind, each step's chosen on the host from the schedule
    run = ozo.dispatch_by_kind(
        lambda kind: per_worker(functools.partial(step, step_kind=kind))[0], schedule
    )
    init, mesh = per_worker(tx.init)
    params = ozo.to_workers(ozo.replicate(init_mlp(jax.random.key(4)), WORKERS), mesh)
    state = init(params)
    ref = params
    ref_state = ozo.to_workers(ozo.replicate(adam.init(init_mlp(jax.random.key(4))), WORKERS), mesh)
    kinds = _kinds(schedule, steps)
    rows, memory, start = np.zeros((steps, 7), np.float32), [], time.time()  # preallocated
    for k in range(1, steps + 1):
        params, state, ref, ref_state, figures = run(
            params, state, ref, ref_state, jnp.full((WORKERS,), k, jnp.int32)
        )
        rows[k - 1] = np.asarray(figures)[0]  # waits for the step
        if k == 1 or k % report_every == 0:
            memory.append({"step": k, **memory_sample()})
            print(f"  0/1 Adam: step {k:5d}, loss {rows[k - 1][0]:.5f}, {memory[-1]}", flush=True)
    figures = rows
    eval_loss, ref_loss, ew, es, acc, spread, grad_rms = figures.T
    window = max(steps // 10, 1)
    windows = eval_loss[: steps - steps % window].reshape(-1, window).mean(1)
    sync_spread = spread[np.asarray(kinds) == "sync"]
    after_freeze = sync_spread[len(sync_spread) // 10 :] if len(sync_spread) else np.zeros(1)
    return {
        "steps": steps,
        "seconds": round(time.time() - start, 1),
        # the step at which the last kind's program first ran (compiled): memory grows until then
        "all_kinds_compiled_at_step": max(kinds.index(name) + 1 for name in set(kinds)),
        "schedule": {
            "var_freeze_step": freeze,
            "variance_steps": int(np.sum(np.asarray(kinds) == "variance")),
            "compressed_steps": int(np.sum(np.asarray(kinds) == "compressed")),
            "sync_steps": int(np.sum(np.asarray(kinds) == "sync")),
            "local_steps": int(np.sum(np.asarray(kinds) == "local")),
        },
        "eval_loss_per_tenth": [float(x) for x in windows],
        "eval_loss_final": float(eval_loss[-1]),
        "adam_eval_loss_final": float(ref_loss[-1]),
        "eval_loss_initial": float(eval_loss[0]),
        "worker_error_rms": _stats(ew),
        "server_error_rms": _stats(es),
        "worker_error_rms_over_grad_rms_phase_a": _stats((ew / grad_rms)[:freeze]),
        "accumulator_rms": _stats(acc),
        "params_spread_after_sync": {
            "max": float(sync_spread.max()) if len(sync_spread) else 0.0,
            "first_tenth_mean": float(sync_spread[: max(len(sync_spread) // 10, 1)].mean())
            if len(sync_spread)
            else 0.0,
            "last_tenth_mean": float(after_freeze[-max(len(after_freeze) // 10, 1) :].mean()),
        },
        "memory": memory,
        "curves": {
            "step": [int(i) + 1 for i in _curve_index(steps)],
            "eval_loss": _curve(eval_loss),
            "adam_eval_loss": _curve(ref_loss),
            "worker_error_rms": _curve(ew),
            "grad_rms": _curve(grad_rms),
        },
    }


def _kinds(schedule: ozo.StepSchedule, steps: int) -> list[str]:
    """The name of the kind of every step, from the policies alone."""
    return [schedule.names[k] for k in schedule.indices(steps)]


# --- 3. how far apart the workers' params are after a sync, by params dtype ---------------------


def sync_spread_run(steps: int, num_workers: int = 4, size: int = 256) -> dict:
    """0/1 Adam on a noisy quadratic (target 1, every worker its own curvature and noise) with
    params in bfloat16 and in float32: the largest difference between two workers' params right
    after each sync. After a sync every worker holds ``x_i + u_i - what / (sqrt(v) + eps)``; the
    rounding of ``x_i`` during the interval (which ``u_i`` does not see) stays in ``x_i + u_i``,
    differs between workers and is never corrected, so the spread can only random-walk."""
    schedule = dict(
        var_freeze_step=20, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4
    )
    tx = ozo.zero_one_adam(0.01, axis_name=AXIS, **schedule)
    # one scan over the steps: the graph decides each step's kind (no step_kind hint)
    syncs = np.asarray(_kinds(ozo.zero_one_schedule(**schedule), steps)) == "sync"

    def worker(x: jax.Array, noise: jax.Array) -> jax.Array:
        curvature = 1.0 + lax.axis_index(AXIS).astype(jnp.float32)

        def step(carry: Any, n: jax.Array) -> tuple:
            x, state = carry
            g = (curvature * (x.astype(jnp.float32) - 1.0) + n).astype(x.dtype)
            updates, state = tx.update(g, state, x)
            x = optax.apply_updates(x, updates)
            return (x, state), x

        return lax.scan(step, (x, tx.init(x)), noise)[1]

    noise = 0.5 * jax.random.normal(jax.random.key(5), (num_workers, steps, size))
    out = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        x0 = jnp.zeros((num_workers, size), dtype)
        xs = np.asarray(jax.jit(jax.vmap(worker, axis_name=AXIS))(x0, noise), np.float32)
        spread = (xs.max(0) - xs.min(0)).max(-1)[syncs]  # per sync step
        tenth = max(len(spread) // 10, 1)
        out[jnp.dtype(dtype).name] = {
            "ulp_at_1": float(jnp.finfo(dtype).eps),
            "first_tenth_mean": float(spread[:tenth].mean()),
            "last_tenth_mean": float(spread[-tenth:].mean()),
            "max": float(spread.max()),
            "distance_to_target_final": float(np.abs(xs[:, -1] - 1).mean()),
        }
    return {"steps": steps, "workers": num_workers, "syncs": int(syncs.sum()), **out}


def markdown(result: dict) -> str:
    """The figures as the README's reliability section reports them."""
    cm, za, sp = result["compressed_mean"], result["zero_one_adam"], result["sync_spread"]
    mem = lambda m: f"{m[0]['rss_mib']:.0f} -> {m[1]['rss_mib']:.0f} -> {m[-1]['rss_mib']:.0f} MiB"
    arrays = lambda m: f"{m[1]['live_arrays']} -> {m[-1]['live_arrays']}"
    return "\n".join(
        [
            f"# Long runs ({WORKERS} simulated CPU workers, shard_map)",
            "",
            f"## Compressed mean, {cm['calls']:,} calls, {cm['elements']:,} elements",
            "",
            "| figure | max | mean | last |",
            "|---|---|---|---|",
            *(
                f"| {name} | {cm[key]['max']:.4g} | {cm[key]['mean']:.4g} | {cm[key]['last']:.4g} |"
                for name, key in [
                    ("worker error RMS", "worker_error_rms"),
                    ("server error RMS", "server_error_rms"),
                    ("worker error RMS / input RMS", "worker_error_rms_over_input_rms"),
                    ("drift RMS, sum(out - true mean)", "drift_rms"),
                ]
            ),
            "",
            f"Input RMS {cm['input_rms_mean']:.3g}. Drift RMS, first vs last tenth of the run: "
            f"{cm['drift_rms_first_vs_last_tenth'][0]:.4g} vs "
            f"{cm['drift_rms_first_vs_last_tenth'][1]:.4g} (a random walk of the true mean's size "
            f"would reach {cm['random_walk_rms_for_comparison']:.3g}). Largest gap in "
            f"drift = -(mean e_w + e_s): {cm['identity_gap_max']:.2g}. RSS {mem(cm['memory'])}; "
            f"live arrays {arrays(cm['memory'])}. {cm['seconds']:.0f} s.",
            "",
            f"## 0/1 Adam, {za['steps']:,} steps (MLP 16-64-1 regression)",
            "",
            f"Schedule: {za['schedule']}.",
            "",
            "Eval loss of the synchronised params, mean per tenth of the run: "
            + ", ".join(f"{x:.4g}" for x in za["eval_loss_per_tenth"])
            + f". Final {za['eval_loss_final']:.4g} (optax.adam on the float mean: "
            f"{za['adam_eval_loss_final']:.4g}; initial {za['eval_loss_initial']:.4g}).",
            "",
            "| figure | max | mean | last |",
            "|---|---|---|---|",
            *(
                f"| {name} | {za[key]['max']:.4g} | {za[key]['mean']:.4g} | {za[key]['last']:.4g} |"
                for name, key in [
                    ("worker error RMS", "worker_error_rms"),
                    ("server error RMS", "server_error_rms"),
                    (
                        "worker error RMS / gradient RMS (phase A)",
                        "worker_error_rms_over_grad_rms_phase_a",
                    ),
                    ("u = anchor - x RMS", "accumulator_rms"),
                ]
            ),
            "",
            "Largest difference between two workers' params right after a sync: max "
            f"{za['params_spread_after_sync']['max']:.3g}, mean over the first tenth of syncs "
            f"{za['params_spread_after_sync']['first_tenth_mean']:.3g}, over the last tenth "
            f"{za['params_spread_after_sync']['last_tenth_mean']:.3g}. RSS {mem(za['memory'])}; "
            f"live arrays {arrays(za['memory'])}. {za['seconds']:.0f} s.",
            "",
            f"## Workers' params after a sync, by params dtype ({sp['steps']:,} steps, "
            f"{sp['workers']} workers, {sp['syncs']} syncs)",
            "",
            "Largest difference between two workers' params right after a sync (params ~1):",
            "",
            "| params | ulp at 1 | first tenth of syncs | last tenth | max | distance to target |",
            "|---|---|---|---|---|---|",
            *(
                f"| {name} | {sp[name]['ulp_at_1']:.3g} | {sp[name]['first_tenth_mean']:.3g} | "
                f"{sp[name]['last_tenth_mean']:.3g} | {sp[name]['max']:.3g} | "
                f"{sp[name]['distance_to_target_final']:.3g} |"
                for name in ("bfloat16", "float32")
            ),
            "",
        ]
    )


def plot(result: dict, path: Path) -> None:
    """Error buffers and drift of the compressed mean, 0/1 Adam's loss, and memory, over the run."""
    plt = common.pyplot()
    cm, za = result["compressed_mean"], result["zero_one_adam"]
    fig, (mean, adam, memory) = plt.subplots(1, 3, figsize=(15, 4))
    c = cm["curves"]
    labels = {
        "worker_error_rms": "worker error RMS (max)",
        "server_error_rms": "server error RMS (max)",
        "drift_rms": "drift RMS, sum(out - mean)",
        "input_rms": "input RMS",
    }
    for key, label in labels.items():
        mean.plot(c["call"], c[key], label=label)
    mean.set(xlabel="call", yscale="log", title=f"compressed mean, {cm['elements']:,} elements")
    c = za["curves"]
    adam.plot(c["step"], c["eval_loss"], label="0/1 Adam (synchronised params)")
    adam.plot(c["step"], c["adam_eval_loss"], label="optax.adam on the float mean")
    adam.set(xlabel="step", ylabel="eval loss", yscale="log", title="0/1 Adam, MLP regression")
    for name, run, x in (("compressed mean", cm, "call"), ("0/1 Adam", za, "step")):
        samples = run["memory"]
        done = [m[x] / samples[-1][x] for m in samples]
        memory.plot(done, [m["rss_mib"] for m in samples], "o-", label=name)
    memory.set(xlabel="fraction of the run", ylabel="RSS (MiB)", title="process memory")
    for ax in (mean, adam, memory):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Long runs, {WORKERS} simulated CPU workers (shard_map)")
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    parser = common.argument_parser("benchmarks.long_run", __doc__)
    parser.add_argument("--quick", action="store_true", help="2,000 calls and 500 steps")
    parser.add_argument("--out", default="results/long_run.json", help=".md, .png beside it")
    args = parser.parse_args(argv)
    common.setup_cpu_devices(WORKERS)
    calls, steps = (2_000, 500) if args.quick else (20_000, 5_000)
    print(f"compressed mean, {calls} calls on {WORKERS} workers", flush=True)
    result = {"compressed_mean": compressed_mean_run(calls, max(calls // 20, 1))}
    print(f"0/1 Adam, {steps} steps on {WORKERS} workers", flush=True)
    result["zero_one_adam"] = zero_one_adam_run(steps, max(steps // 20, 1))
    print(f"params spread after syncs, bfloat16 vs float32, {2 * steps // 5} steps", flush=True)
    result["sync_spread"] = sync_spread_run(2 * steps // 5)
    report = markdown(result)
    paths = common.write_results(args.out, result, report, plot)
    print(report)
    print("wrote " + ", ".join(map(str, paths)))
    return result


if __name__ == "__main__":
    main()
