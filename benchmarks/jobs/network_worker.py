"""One process of ``benchmarks.network``: training throughput over the shaped link it runs on.

Started by ``benchmarks.network`` through ``optax_zero_one.integration.launch`` inside a network
namespace (one device per process, so every collective crosses the link). Process 0 sets each
rate with ``tc`` and reads the link's byte counter around every measured window; it writes one
JSON file.

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

Every optimizer runs one compiled program per step kind, the host picking each step's
(``benchmarks.support.common.train_step``). Warm-up (compilation, 1-bit Adam's float step, 0/1
Adam's first 16 steps) happens before the first rate's windows and is not timed. Every window
checks that the programs run were those of the kinds the policies predict and that the state
took every step (its step counter), and prices them with the bytes each kind's compiled program
sends (``benchmarks.support.common.traffic_per_kind``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")  # run alone: one device (before JAX starts)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from benchmarks.support import common, netns  # noqa: E402

ZERO_ONE_CLIP = 16
LR, WEIGHT_DECAY = 1e-4, 1e-4
PHASE_B = (ozo.VarianceDoubling(1, 1), ozo.LocalStepDoubling(1, ZERO_ONE_CLIP))
WHOLE = (ozo.VarianceDoubling(8, 2), ozo.LocalStepDoubling(4, ZERO_ONE_CLIP))
SCHEDULE = "0/1 Adam (whole schedule)"
# Steps taken before the first timed window (1-bit Adam's float warm-up step; 0/1 Adam until its
# sync interval reached the clip); and the order of a round (reversed every other round).
WARMUP = {"AdamW": 1, "1-bit Adam": 2, "0/1 Adam (phase B)": 16, "no communication": 1}
ORDER = ("no communication", "0/1 Adam (phase B)", "1-bit Adam", "AdamW")
# The kinds each optimizer's first m steps take, from its policies.
KINDS_OF: dict[str, Callable[[int], np.ndarray]] = {
    "AdamW": lambda m: np.zeros(m, np.int8),
    "1-bit Adam": lambda m: ozo.onebit_schedule(1).indices(m),
    "0/1 Adam (phase B)": lambda m: ozo.step_kinds(*PHASE_B, m),
    "no communication": lambda m: np.zeros(m, np.int8),
    SCHEDULE: lambda m: ozo.step_kinds(*WHOLE, m),
}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, dict[str, int]]]:
    """The options, and the steps per timed window of each optimizer at each rate."""
    parser = common.argument_parser("benchmarks.jobs.network_worker", __doc__)
    parser.add_argument("--out", required=True, help="JSON file (written by process 0)")
    parser.add_argument("--rates", default="1gbit,100mbit", help="tc rates, in measuring order")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per rate")
    parser.add_argument(
        "--steps-adamw",
        default=None,
        help="steps per round, per rate or one (default: 2 at 1gbit and faster, 1 below)",
    )
    parser.add_argument("--steps-onebit", default="8")
    parser.add_argument("--steps-zero-one", default="16", help="multiples of 16")
    parser.add_argument("--steps-nocomm", default="8")
    parser.add_argument("--schedule-steps", type=int, default=64, help="0: no whole-schedule run")
    parser.add_argument("--schedule-rates", default="", help="rates for it (default: all)")
    opts = parser.parse_args(argv)
    rates = opts.rates.split(",")

    def per_rate(text: str) -> dict[str, int]:
        values = [int(v) for v in text.split(",")]
        values = values * len(rates) if len(values) == 1 else values
        if len(values) != len(rates):
            parser.error(f"need one window length or one per rate, got {text!r}")
        return dict(zip(rates, values))

    # AdamW's default window follows --rates: its float steps are slow on a slow link
    adamw = opts.steps_adamw or ",".join("2" if netns.rate_bits(r) >= 1e9 else "1" for r in rates)
    windows = {
        "AdamW": per_rate(adamw),
        "1-bit Adam": per_rate(opts.steps_onebit),
        "0/1 Adam (phase B)": per_rate(opts.steps_zero_one),
        "no communication": per_rate(opts.steps_nocomm),
    }
    if any(v % ZERO_ONE_CLIP for v in windows["0/1 Adam (phase B)"].values()):
        parser.error(f"--steps-zero-one must be multiples of {ZERO_ONE_CLIP}")
    return opts, windows


@dataclasses.dataclass
class Problem:
    """The model and data every optimizer trains on: an MLP of ``depth`` square ``width x width``
    tanh layers on a fixed batch per worker."""

    mesh: jax.sharding.Mesh
    params0: dict[str, np.ndarray]
    batch: Any
    depth: int

    @property
    def workers(self) -> int:
        return self.mesh.devices.size

    @property
    def num_params(self) -> int:
        return sum(p.size for p in self.params0.values())

    def loss(self, params: Any, batch: Any) -> jax.Array:
        h = batch["x"]
        for i in range(self.depth):
            h = jnp.tanh(h @ params[f"layer{i}"])
        return jnp.mean(jnp.square(h - batch["y"]))

    def fresh_params(self) -> Any:
        return ozo.to_workers(lambda i: self.params0, self.mesh)


def make_problem(width: int, depth: int, batch: int) -> Problem:
    rng = np.random.default_rng(0)
    params0 = {
        f"layer{i}": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        for i in range(depth)
    }

    def batch_of(worker: int) -> dict[str, np.ndarray]:
        r = np.random.default_rng([1, worker])
        return {
            "x": r.standard_normal((batch, width)).astype(np.float32),
            "y": r.standard_normal((batch, width)).astype(np.float32),
        }

    mesh = ozo.worker_mesh(common.AXIS)
    return Problem(mesh, params0, ozo.to_workers(batch_of, mesh), depth)


def optimizer_specs(schedule: bool) -> dict[str, common.OptimizerSpec]:
    """The optimizers, by name (see the module docstring); the whole-schedule run if asked."""

    def zero_one(name: str, policies: tuple[Any, Any]) -> common.OptimizerSpec:
        tx = ozo.scale_by_zero_one_adam(
            LR,
            weight_decay=WEIGHT_DECAY,
            variance_policy=policies[0],
            local_step_policy=policies[1],
            axis_name=common.AXIS,
        )
        return common.zero_one_spec(name, tx, *policies)

    adamw = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    onebit = ozo.onebit_adam(LR, weight_decay=WEIGHT_DECAY, freeze_step=1, axis_name=common.AXIS)
    specs = {
        "AdamW": common.OptimizerSpec("AdamW", adamw, True),
        "1-bit Adam": common.onebit_spec("1-bit Adam", onebit, 1),
        "0/1 Adam (phase B)": zero_one("0/1 Adam (phase B)", PHASE_B),
        "no communication": common.OptimizerSpec("no communication", adamw, False, ("local",)),
    }
    if schedule:
        specs[SCHEDULE] = zero_one(SCHEDULE, WHOLE)
    return specs


@dataclasses.dataclass
class Run:
    """One optimizer's training step (one compiled program per step kind), its params and
    state, and what each step kind sends."""

    spec: common.OptimizerSpec
    problem: Problem
    step: Any = None
    params: Any = None
    state: Any = None
    done: int = 0  # steps taken
    traffic: dict = dataclasses.field(default_factory=dict)
    compile_s: float = 0.0

    def restart(self) -> None:
        self.params = self.problem.fresh_params()
        self.state = jax.jit(ozo.on_workers(self.spec.tx.init, self.problem.mesh))(self.params)
        self.done = 0

    def advance(self) -> int:
        """One step, waited for; the kind of the program that ran."""
        self.params, self.state, _, kind = self.step(self.params, self.state, self.problem.batch)
        jax.block_until_ready(self.params)
        self.done += 1
        return kind

    def check_steps_taken(self) -> None:
        """Raises unless the state took every step run (read from its step counter)."""
        if self.spec.schedule is not None and ozo.step_count(self.state) != self.done:
            raise RuntimeError(
                f"{self.spec.name}: the state took {ozo.step_count(self.state)} of "
                f"{self.done} steps"
            )


def compile_run(name: str, spec: common.OptimizerSpec, problem: Problem) -> Run:
    """Compiles ``spec``'s training step, one program for each kind the run takes, and reads
    what each of its step kinds sends.

    Every process does the accounting (compile only): a process that arrives at a collective
    more than 30 s before another gives up (gloo's context initialisation timeout).
    """
    t0 = time.perf_counter()
    run = Run(spec, problem)
    run.restart()
    run.step = common.train_step(spec, problem.loss, problem.mesh)
    args = (run.params, run.state, problem.batch)
    first = common.first_step_of_each_kind(KINDS_OF[name](512))
    compiled = {k: run.step.program(k).lower(*args).compile() for k in sorted(first)}
    run.compile_s = time.perf_counter() - t0
    run.traffic = common.traffic_per_kind(
        spec, problem.loss, problem.mesh, first, args, compiled.get(0)
    )
    return run


class Link:
    """The shaped link as process 0 sees it, and barriers that line the processes up."""

    def __init__(self, lead: bool) -> None:
        self.lead, self.barriers = lead, 0

    def barrier(self) -> None:
        self.barriers += 1
        multihost_utils.sync_global_devices(f"network-{self.barriers}")

    def set_rate(self, rate: str) -> None:
        if self.lead:
            netns.set_rate(rate)

    def counters(self) -> tuple[int, int]:
        """Bytes sent and packets dropped so far (process 0; zeros elsewhere)."""
        return (netns.tx_bytes(), netns.qdisc_drops()) if self.lead else (0, 0)


def measure(run: Run, name: str, steps: int, link: Link) -> dict[str, Any]:
    """One timed window of ``steps`` steps: time per step, bytes on the link, step kinds."""
    first = run.done + 1
    kinds = KINDS_OF[name](run.done + steps)[run.done :]
    link.barrier()
    b0, d0 = link.counters()
    seen, step_seconds = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        seen.append(run.advance())
        step_seconds.append(time.perf_counter() - t)
    seconds = time.perf_counter() - t0
    link.barrier()
    b1, d1 = link.counters()
    if seen != [int(k) for k in kinds]:
        raise RuntimeError(f"{name}: step kinds {seen} differ from the policy's {kinds}")
    run.check_steps_taken()
    counts = {run.spec.kind_names[k]: int(np.sum(kinds == k)) for k in np.unique(kinds)}
    hlo = run.problem.workers * sum(run.traffic[int(k)].sent_bytes for k in kinds)
    return dict(
        optimizer=name,
        steps=steps,
        first_step=first,
        kinds=counts,
        seconds=seconds,
        steps_per_s=steps / seconds,
        link_bytes=b1 - b0,
        link_bytes_per_step=(b1 - b0) / steps,
        hlo_bytes=hlo,
        hlo_bytes_per_step=hlo / steps,
        qdisc_drops=d1 - d0,
        load_average=os.getloadavg()[0],  # other users of the machine's cores
        step_seconds=step_seconds,
        step_kinds=[int(k) for k in kinds],
    )


def combine(name: str, parts: list[dict[str, Any]], kind_names: tuple[str, ...]) -> dict:
    """The rounds of one optimizer together.

    Throughput from the median step time of each step kind, weighted by how often the kind
    occurs: robust to bursts of load from other users of the cores, which a window total is not.
    """
    keys = ("steps", "seconds", "link_bytes", "hlo_bytes", "qdisc_drops")
    total = {k: sum(p[k] for p in parts) for k in keys}
    kinds: dict[str, int] = {}
    for p in parts:
        for k, v in p["kinds"].items():
            kinds[k] = kinds.get(k, 0) + v
    times = [t for p in parts for t in p["step_seconds"]]
    step_kinds = [k for p in parts for k in p["step_kinds"]]
    median_by_kind = {
        run_kind: float(np.median([t for t, k in zip(times, step_kinds) if k == run_kind]))
        for run_kind in sorted(set(step_kinds))
    }
    per_step = sum(median_by_kind[k] for k in step_kinds) / len(step_kinds)
    return dict(
        optimizer=name,
        **total,
        kinds=kinds,
        steps_per_s=1.0 / per_step,
        median_step_seconds={kind_names[k]: v for k, v in median_by_kind.items()},
        window_steps_per_s=total["steps"] / total["seconds"],
        link_bytes_per_step=total["link_bytes"] / total["steps"],
        hlo_bytes_per_step=total["hlo_bytes"] / total["steps"],
        rounds_steps_per_s=[p["steps_per_s"] for p in parts],
        load_average=[p["load_average"] for p in parts],
    )


def measure_rate(
    rate: str, runs: dict[str, Run], windows: dict, rounds: int, link: Link
) -> list[dict]:
    """Every optimizer at ``rate``, in interleaved rounds (the same background load for all)."""
    link.set_rate(rate)
    link.barrier()
    parts: dict[str, list[dict[str, Any]]] = {name: [] for name in ORDER}
    for i in range(rounds):
        for name in ORDER if i % 2 == 0 else ORDER[::-1]:
            parts[name].append(measure(runs[name], name, windows[name][rate], link))
    results = []
    for name in ORDER:
        r = combine(name, parts[name], runs[name].spec.kind_names)
        r["rate"] = rate
        results.append(r)
        spread = ", ".join(f"{v:.2f}" for v in r["rounds_steps_per_s"])
        say(
            link.lead,
            f"{rate:>8} {name:<22} {r['steps_per_s']:8.2f} steps/s ({spread})  "
            f"link {r['link_bytes_per_step'] / 1e6:8.4f} MB/step  "
            f"HLO {r['hlo_bytes_per_step'] / 1e6:8.4f} MB/step  {r['kinds']}",
        )
    return results


def whole_schedule(rate: str, run: Run, steps: int, link: Link) -> dict[str, Any]:
    """A fresh 0/1 Adam run through every phase, timed step by step."""
    run.restart()
    link.barrier()
    b0, _ = link.counters()
    times, kinds = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        kinds.append(run.advance())
        times.append(time.perf_counter() - t0)
    link.barrier()
    link_bytes = link.counters()[0] - b0
    run.check_steps_taken()
    names = run.spec.kind_names
    by_kind = {
        names[k]: dict(
            steps=int(sum(1 for x in kinds if x == k)),
            seconds=float(sum(t for t, x in zip(times, kinds) if x == k)),
            hlo_bytes=run.problem.workers * run.traffic[k].sent_bytes,
        )
        for k in sorted(set(kinds))
    }
    hlo = sum(v["hlo_bytes"] * v["steps"] for v in by_kind.values())
    say(link.lead, f"{rate:>8} whole schedule: {sum(times):.1f} s for {steps} steps")
    return dict(
        optimizer=SCHEDULE,
        rate=rate,
        steps=steps,
        first_step=1,
        kinds={k: v["steps"] for k, v in by_kind.items()},
        by_kind=by_kind,
        seconds=float(sum(times)),
        steps_per_s=steps / sum(times),
        link_bytes=link_bytes,
        link_bytes_per_step=link_bytes / steps,
        hlo_bytes=hlo,
        hlo_bytes_per_step=hlo / steps,
        step_seconds=times,
        step_kinds=[names[k] for k in kinds],
    )


def _policies(policies: tuple[ozo.VarianceDoubling, ozo.LocalStepDoubling]) -> dict[str, int]:
    variance, local = policies
    return dict(
        var_freeze_step=variance.freeze_step,
        var_update_scaler=variance.update_scaler,
        local_step_scaler=local.scaler,
        local_step_clipper=local.clipper,
    )


def summary(
    job: ozo.integration.distributed.DistributedJob,
    opts: Any,
    problem: Problem,
    runs: dict,
    results: list,
) -> dict:
    """What process 0 writes: the setup, compile times, traffic per kind and the results."""
    return dict(
        processes=job.num_processes,
        workers=problem.workers,
        params=problem.num_params,
        width=opts.width,
        depth=opts.depth,
        batch_per_worker=opts.batch,
        compile_seconds={k: r.compile_s for k, r in runs.items()},
        phase_b_policies=_policies(PHASE_B),
        whole_schedule_policies=_policies(WHOLE),
        jax_version=jax.__version__,
        traffic_per_kind={
            k: {
                t.name: dict(sent_bytes_per_worker=t.sent_bytes, collectives=t.collectives)
                for t in r.traffic.values()
            }
            for k, r in runs.items()
        },
        results=results,
    )


def say(lead: bool, text: str) -> None:
    """Prints on process 0 only."""
    if lead:
        print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    opts, windows = parse_args(argv)
    job = ozo.initialize_from_env()
    link = Link(job.process_id == 0)
    rates = opts.rates.split(",")
    schedule_rates = opts.schedule_rates.split(",") if opts.schedule_rates else rates
    problem = make_problem(opts.width, opts.depth, opts.batch)
    size = f"{problem.num_params / 1e6:.2f}M params, batch {opts.batch} per worker"
    say(link.lead, f"{problem.workers} workers, {size}")
    runs = {}
    for name, spec in optimizer_specs(bool(opts.schedule_steps)).items():
        runs[name] = compile_run(name, spec, problem)
        say(link.lead, f"compiled {name} in {runs[name].compile_s:.1f} s")
    link.set_rate(rates[0])  # warm-up, untimed
    link.barrier()
    for name, steps in WARMUP.items():
        for _ in range(steps):
            runs[name].advance()
    link.barrier()
    results = []
    for rate in rates:
        results += measure_rate(rate, runs, windows, opts.rounds, link)
        if opts.schedule_steps and rate in schedule_rates:
            results.append(whole_schedule(rate, runs[SCHEDULE], opts.schedule_steps, link))
    if link.lead:
        with open(opts.out, "w") as f:
            json.dump(summary(job, opts, problem, runs, results), f, indent=1)
    link.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
