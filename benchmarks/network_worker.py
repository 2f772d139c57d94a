"""One process of ``benchmarks.network``: training throughput over the shaped link it runs on.

Started by ``benchmarks.network`` through ``benchmarks.launch`` inside a network namespace
(one device per process, so every collective crosses the link). Process 0 sets each rate with
``tc`` and reads the link's byte counter around every measured window; it writes one JSON file.

The model is an MLP of ``depth`` square ``width x width`` layers (default 4 x 512 x 512, 1.05M
parameters) on a fixed batch per worker; every optimizer runs the same model, batch and
gradient computation. At each rate, in the same processes, each optimizer runs timed windows
(every step waited for and timed), in ``--rounds`` (5) interleaved rounds so that all see the
same background load on the shared cores. An optimizer's throughput is computed from the
median step time of each of its step kinds, weighted by how often each kind occurs in the
windows (robust to bursts of background load); the plain window figure (all steps over all
time) is recorded beside it:

- ``AdamW``: float32 ``pmean`` of the gradients, then ``optax.adamw``;
- ``1-bit Adam``: ``freeze_step=1``; the windows hold compressed steps only;
- ``0/1 Adam (phase B)``: ``var_freeze_step=1, var_update_scaler=1, local_step_scaler=1,
  local_step_clipper=16``: after 16 warm-up steps the sync interval sits at its clip, 16
  (DeepSpeed's default ``local_step_clipper``); windows are whole multiples of 16 steps starting
  after a sync, so they hold 1 sync per 16 steps and local steps otherwise;
- ``no communication``: ``optax.adamw`` on each worker's own gradients, no collective: the
  throughput a communication-free optimizer would reach with this model and batch;
- ``0/1 Adam (whole schedule)`` (``--schedule-steps``, default 64): a fresh run through every
  phase (``var_freeze_step=8, var_update_scaler=2, local_step_scaler=4,
  local_step_clipper=16``: 5 variance, 3 compressed, 11 sync and 45 local steps), timed step by
  step.

Warm-up (compilation, 1-bit Adam's float step, 0/1 Adam's first 16 steps) happens before the
first rate's windows and is not timed. Every window checks that the step kinds the programs
took are the ones the policies predict, and prices them with the bytes each kind's compiled
program sends (``benchmarks.common.traffic_per_kind``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks import distributed, netns

ZERO_ONE_CLIP = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file (written by process 0)")
    parser.add_argument("--rates", default="1gbit,100mbit", help="tc rates, in measuring order")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per rate")
    parser.add_argument("--steps-adamw", default="2,1", help="steps per round, per rate or one")
    parser.add_argument("--steps-onebit", default="8")
    parser.add_argument("--steps-zero-one", default="16", help="multiples of 16")
    parser.add_argument("--steps-nocomm", default="8")
    parser.add_argument("--schedule-steps", type=int, default=64, help="0: no whole-schedule run")
    parser.add_argument("--schedule-rates", default="", help="rates for it (default: all)")
    opts = parser.parse_args(argv)
    job = distributed.initialize_from_env(default_devices=1)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    import optax_zero_one as ozo
    from benchmarks import common

    rates = opts.rates.split(",")
    schedule_rates = opts.schedule_rates.split(",") if opts.schedule_rates else rates

    def per_rate(text: str) -> dict[str, int]:
        values = [int(v) for v in text.split(",")]
        values = values * len(rates) if len(values) == 1 else values
        if len(values) != len(rates):
            parser.error(f"need one window length or one per rate, got {text!r}")
        return dict(zip(rates, values))

    windows = {
        "AdamW": per_rate(opts.steps_adamw),
        "1-bit Adam": per_rate(opts.steps_onebit),
        "0/1 Adam (phase B)": per_rate(opts.steps_zero_one),
        "no communication": per_rate(opts.steps_nocomm),
    }
    if any(v % ZERO_ONE_CLIP for v in windows["0/1 Adam (phase B)"].values()):
        parser.error(f"--steps-zero-one must be multiples of {ZERO_ONE_CLIP}")
    lead = job.process_id == 0
    mesh = distributed.worker_mesh(common.AXIS)
    n = mesh.devices.size

    rng = np.random.default_rng(0)
    w, depth = opts.width, opts.depth
    params0 = {
        f"layer{i}": (rng.standard_normal((w, w)) / np.sqrt(w)).astype(np.float32)
        for i in range(depth)
    }
    num_params = depth * w * w

    def batch_of(worker: int) -> dict[str, np.ndarray]:
        r = np.random.default_rng([1, worker])
        return {
            "x": r.standard_normal((opts.batch, w)).astype(np.float32),
            "y": r.standard_normal((opts.batch, w)).astype(np.float32),
        }

    def loss(params: Any, batch: Any) -> jax.Array:
        h = batch["x"]
        for i in range(depth):
            h = jnp.tanh(h @ params[f"layer{i}"])
        return jnp.mean(jnp.square(h - batch["y"]))

    batch = distributed.to_workers(batch_of, mesh)
    lr, wd = 1e-4, 1e-4
    ax = common.AXIS
    phase_b = (ozo.VarianceDoubling(1, 1), ozo.LocalStepDoubling(1, ZERO_ONE_CLIP))
    whole = (ozo.VarianceDoubling(8, 2), ozo.LocalStepDoubling(4, ZERO_ONE_CLIP))  # see info

    def zero_one(name: str, policies: tuple[Any, Any]) -> common.OptimizerSpec:
        tx = ozo.scale_by_zero_one_adam(
            lr, weight_decay=wd, variance_policy=policies[0], local_step_policy=policies[1],
            axis_name=ax,
        )  # fmt: skip
        return common.zero_one_spec(name, tx, *policies)

    specs = {
        "AdamW": common.OptimizerSpec("AdamW", optax.adamw(lr, weight_decay=wd), True),
        "1-bit Adam": common.onebit_spec(
            "1-bit Adam", ozo.onebit_adam(lr, weight_decay=wd, freeze_step=1, axis_name=ax), 1
        ),
        "0/1 Adam (phase B)": zero_one("0/1 Adam (phase B)", phase_b),
        "no communication": common.OptimizerSpec(
            "no communication", optax.adamw(lr, weight_decay=wd), False, ("local",)
        ),
    }
    kinds_of: dict[str, Callable[[int], np.ndarray]] = {
        "AdamW": lambda m: np.zeros(m, np.int8),
        "1-bit Adam": lambda m: ozo.onebit_step_kinds(1, m),
        "0/1 Adam (phase B)": lambda m: ozo.step_kinds(*phase_b, m),
        "no communication": lambda m: np.zeros(m, np.int8),
        "0/1 Adam (whole schedule)": lambda m: ozo.step_kinds(*whole, m),
    }
    if opts.schedule_steps:
        specs["0/1 Adam (whole schedule)"] = zero_one("0/1 Adam (whole schedule)", whole)

    def say(text: str) -> None:
        if lead:
            print(text, flush=True)

    @dataclasses.dataclass
    class Run:
        spec: common.OptimizerSpec
        step: Any
        params: Any
        state: Any
        done: int = 0  # steps taken
        traffic: dict = dataclasses.field(default_factory=dict)
        compile_s: float = 0.0

        def restart(self) -> None:
            self.params = distributed.to_workers(lambda i: params0, mesh)
            self.state = jax.jit(common.per_worker(self.spec.tx.init, mesh))(self.params)
            self.done = 0

        def advance(self) -> int:
            self.params, self.state, _, kind = self.step(self.params, self.state, batch)
            jax.block_until_ready(self.params)
            self.done += 1
            return int(distributed.local_rows(kind)[1][0][0])

    say(f"{n} workers, {num_params / 1e6:.2f}M params, batch {opts.batch} per worker")
    runs: dict[str, Run] = {}
    for name, spec in specs.items():
        t0 = time.perf_counter()
        params = distributed.to_workers(lambda i: params0, mesh)
        state = jax.jit(common.per_worker(spec.tx.init, mesh))(params)
        step = jax.jit(common.make_step(spec, loss, mesh), donate_argnums=(0, 1))
        compiled = step.lower(params, state, batch).compile()
        run = Run(spec, compiled, params, state, compile_s=time.perf_counter() - t0)
        # What each step kind sends, from the optimised HLO (compile only). Every process
        # does it: a process that arrives at a collective more than 30 s before another gives up
        # (gloo's context initialisation timeout).
        first = common.first_step_of_each_kind(kinds_of[name](512))
        run.traffic = common.traffic_per_kind(
            spec, loss, mesh, first, (params, state, batch), compiled
        )
        runs[name] = run
        say(f"compiled {name} in {run.compile_s:.1f} s")

    barrier_count = [0]

    def barrier() -> None:
        barrier_count[0] += 1
        multihost_utils.sync_global_devices(f"network-{barrier_count[0]}")

    # Warm-up, untimed: every optimizer past its first steps (1-bit Adam's float warm-up step;
    # 0/1 Adam until its sync interval reached the clip).
    warmup = {"AdamW": 1, "1-bit Adam": 2, "0/1 Adam (phase B)": 16, "no communication": 1}
    if lead:
        netns.set_rate(rates[0])
    barrier()
    for name, steps in warmup.items():
        for _ in range(steps):
            runs[name].advance()
    barrier()

    def measure(name: str, steps: int) -> dict[str, Any]:
        run = runs[name]
        first = run.done + 1
        kinds = kinds_of[name](run.done + steps)[run.done :]
        barrier()
        b0 = netns.tx_bytes() if lead else 0
        d0 = netns.qdisc_drops() if lead else 0
        seen, step_seconds = [], []
        t0 = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            seen.append(run.advance())
            step_seconds.append(time.perf_counter() - t)
        seconds = time.perf_counter() - t0
        barrier()
        link = netns.tx_bytes() - b0 if lead else 0
        drops = netns.qdisc_drops() - d0 if lead else 0
        if seen != [int(k) for k in kinds]:
            raise RuntimeError(f"{name}: step kinds {seen} differ from the policy's {kinds}")
        counts = {run.spec.kind_names[k]: int(np.sum(kinds == k)) for k in np.unique(kinds)}
        hlo = n * sum(run.traffic[int(k)].sent_bytes for k in kinds)
        return dict(
            optimizer=name,
            steps=steps,
            first_step=first,
            kinds=counts,
            seconds=seconds,
            steps_per_s=steps / seconds,
            link_bytes=link,
            link_bytes_per_step=link / steps,
            hlo_bytes=hlo,
            hlo_bytes_per_step=hlo / steps,
            qdisc_drops=drops,
            load_average=os.getloadavg()[0],  # other users of the machine's cores
            step_seconds=step_seconds,
            step_kinds=[int(k) for k in kinds],
        )

    def combine(name: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """The rounds of one optimizer together."""
        total = {k: sum(p[k] for p in parts) for k in ("steps", "seconds", "link_bytes",
                                                       "hlo_bytes", "qdisc_drops")}  # fmt: skip
        kinds: dict[str, int] = {}
        for p in parts:
            for k, v in p["kinds"].items():
                kinds[k] = kinds.get(k, 0) + v
        # Throughput from the median step time of each step kind, weighted by how often the
        # kind occurs: robust to bursts of load from other users of the cores, which a window
        # total is not.
        times = [t for p in parts for t in p["step_seconds"]]
        step_kinds = [k for p in parts for k in p["step_kinds"]]
        median_by_kind = {
            run_kind: float(np.median([t for t, k in zip(times, step_kinds) if k == run_kind]))
            for run_kind in sorted(set(step_kinds))
        }
        per_step = sum(median_by_kind[k] for k in step_kinds) / len(step_kinds)
        names = runs[name].spec.kind_names
        return dict(
            optimizer=name,
            **total,
            kinds=kinds,
            steps_per_s=1.0 / per_step,
            median_step_seconds={names[k]: v for k, v in median_by_kind.items()},
            window_steps_per_s=total["steps"] / total["seconds"],
            link_bytes_per_step=total["link_bytes"] / total["steps"],
            hlo_bytes_per_step=total["hlo_bytes"] / total["steps"],
            rounds_steps_per_s=[p["steps_per_s"] for p in parts],
            load_average=[p["load_average"] for p in parts],
        )

    # Rounds interleave the optimizers so that each sees the same background load (the cores
    # are shared).
    order = ("no communication", "0/1 Adam (phase B)", "1-bit Adam", "AdamW")
    results = []
    for rate in rates:
        if lead:
            netns.set_rate(rate)
        barrier()
        parts: dict[str, list[dict[str, Any]]] = {name: [] for name in order}
        for i in range(opts.rounds):
            for name in order if i % 2 == 0 else order[::-1]:
                parts[name].append(measure(name, windows[name][rate]))
        for name in order:
            r = combine(name, parts[name])
            r["rate"] = rate
            results.append(r)
            spread = ", ".join(f"{v:.2f}" for v in r["rounds_steps_per_s"])
            say(
                f"{rate:>8} {name:<22} {r['steps_per_s']:8.2f} steps/s ({spread})  "
                f"link {r['link_bytes_per_step'] / 1e6:8.4f} MB/step  "
                f"HLO {r['hlo_bytes_per_step'] / 1e6:8.4f} MB/step  {r['kinds']}"
            )
        if opts.schedule_steps and rate in schedule_rates:
            run = runs["0/1 Adam (whole schedule)"]
            run.restart()
            barrier()
            b0 = netns.tx_bytes() if lead else 0
            times, kinds = [], []
            for _ in range(opts.schedule_steps):
                t0 = time.perf_counter()
                kinds.append(run.advance())
                times.append(time.perf_counter() - t0)
            barrier()
            link = netns.tx_bytes() - b0 if lead else 0
            names = run.spec.kind_names
            by_kind = {
                names[k]: dict(
                    steps=int(sum(1 for x in kinds if x == k)),
                    seconds=float(sum(t for t, x in zip(times, kinds) if x == k)),
                    hlo_bytes=n * run.traffic[k].sent_bytes,
                )
                for k in sorted(set(kinds))
            }
            hlo = sum(v["hlo_bytes"] * v["steps"] for v in by_kind.values())
            results.append(
                dict(
                    optimizer="0/1 Adam (whole schedule)",
                    rate=rate,
                    steps=opts.schedule_steps,
                    first_step=1,
                    kinds={k: v["steps"] for k, v in by_kind.items()},
                    by_kind=by_kind,
                    seconds=float(sum(times)),
                    steps_per_s=opts.schedule_steps / sum(times),
                    link_bytes=link,
                    link_bytes_per_step=link / opts.schedule_steps,
                    hlo_bytes=hlo,
                    hlo_bytes_per_step=hlo / opts.schedule_steps,
                    step_seconds=times,
                    step_kinds=[names[k] for k in kinds],
                )
            )
            say(f"{rate:>8} whole schedule: {sum(times):.1f} s for {opts.schedule_steps} steps")

    if lead:
        info = dict(
            processes=job.num_processes,
            workers=n,
            params=num_params,
            width=w,
            depth=depth,
            batch_per_worker=opts.batch,
            compile_seconds={k: r.compile_s for k, r in runs.items()},
            phase_b_policies=dict(
                var_freeze_step=1,
                var_update_scaler=1,
                local_step_scaler=1,
                local_step_clipper=ZERO_ONE_CLIP,
            ),  # fmt: skip
            whole_schedule_policies=dict(
                var_freeze_step=8,
                var_update_scaler=2,
                local_step_scaler=4,
                local_step_clipper=ZERO_ONE_CLIP,
            ),
            jax_version=jax.__version__,
            traffic_per_kind={
                k: {
                    t.name: dict(sent_bytes_per_worker=t.sent_bytes, collectives=t.collectives)
                    for t in r.traffic.values()
                }
                for k, r in runs.items()
            },  # fmt: skip
            results=results,
        )
        with open(opts.out, "w") as f:
            json.dump(info, f, indent=1)
    barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
