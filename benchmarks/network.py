"""End-to-end training throughput of AdamW, 1-bit Adam and 0/1 Adam over a shaped link.

::

    sudo .venv/bin/python -m benchmarks.network            # P = 2 and 4, 1 Gbit/s and 100 Mbit/s
    sudo .venv/bin/python -m benchmarks.network --quick    # a one-minute smoke run

For each process count ``P`` it creates a private network namespace whose loopback is shaped
with ``tc tbf`` (``benchmarks/support/netns.py``), starts ``P`` processes in it with
``optax_zero_one.integration.launch`` (one CPU device each, ``jax.distributed`` over 127.0.0.1, so
every collective crosses the link), and runs ``benchmarks/jobs/network_worker.py`` there: at each
rate, a timed window of each optimizer on the same model and batch, plus the no-communication limit
(each worker steps alone). The namespace is always removed, also on Ctrl-C or failure.

Reported per ``P`` and rate: steps/s, speedup over AdamW and over 1-bit Adam, fraction of the
no-communication limit, bytes per step counted on the link (``tx_bytes`` of the namespace's
loopback) beside the bytes the compiled programs send
(``benchmarks.support.common.traffic_per_kind``, times ``P``: all processes share the one link).
Tables on stdout and in ``results/network.md``, with ``results/network.json`` and
``results/network.png`` (``--out``; the ``.md`` and ``.png`` beside it). Options the script does
not know go to the worker (``--rounds``, ``--width``, ``--steps-*``, ...; see ``python -m
benchmarks.jobs.network_worker --help``; the window defaults follow ``--rates``). Needs root and
iproute2; says so and exits with status 2 otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks.support import common, netns
from optax_zero_one.integration.launch import launch

OPTIMIZERS = ("AdamW", "1-bit Adam", "0/1 Adam (phase B)", "no communication")
SCHEDULE = "0/1 Adam (whole schedule)"
CANNOT_RUN = 2


def summarize(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows per (P, rate, optimizer), and per (P, rate) for the whole-schedule run.

    The whole-schedule run is set beside AdamW and 1-bit Adam over as many steps, *estimated*
    from their measured steady rates (1-bit Adam with as many float warm-up steps as 0/1 Adam
    has phase-A steps, each costed as an AdamW step).
    """
    rows, schedule = [], []
    for run in runs:
        by_rate: dict[str, dict[str, dict[str, Any]]] = {}
        for r in run["results"]:
            by_rate.setdefault(r["rate"], {})[r["optimizer"]] = r
        for rate, found in by_rate.items():
            limit = found["no communication"]["steps_per_s"]
            adamw = found["AdamW"]["steps_per_s"]
            onebit = found["1-bit Adam"]["steps_per_s"]
            for name in OPTIMIZERS:
                r = found[name]
                hlo = r["hlo_bytes_per_step"]
                rows.append(
                    dict(
                        processes=run["processes"],
                        rate=rate,
                        optimizer=name,
                        steps=r["steps"],
                        kinds=r["kinds"],
                        steps_per_s=r["steps_per_s"],
                        window_steps_per_s=r["window_steps_per_s"],
                        rounds_steps_per_s=r["rounds_steps_per_s"],
                        median_step_seconds=r["median_step_seconds"],
                        speedup_over_adamw=r["steps_per_s"] / adamw,
                        speedup_over_onebit=r["steps_per_s"] / onebit,
                        fraction_of_limit=r["steps_per_s"] / limit,
                        link_bytes_per_step=r["link_bytes_per_step"],
                        hlo_bytes_per_step=hlo,
                        link_over_hlo=r["link_bytes_per_step"] / hlo if hlo else None,
                        qdisc_drops=r["qdisc_drops"],
                        load_average=r["load_average"],
                    )
                )
            if SCHEDULE in found:
                r = found[SCHEDULE]
                n, warm = r["steps"], run["whole_schedule_policies"]["var_freeze_step"]
                adamw_s = n / adamw
                onebit_s = warm / adamw + (n - warm) / onebit
                schedule.append(
                    dict(
                        processes=run["processes"],
                        rate=rate,
                        steps=n,
                        seconds=r["seconds"],
                        by_kind=r["by_kind"],
                        adamw_seconds_estimated=adamw_s,
                        onebit_seconds_estimated=onebit_s,
                        speedup_over_adamw=adamw_s / r["seconds"],
                        speedup_over_onebit=onebit_s / r["seconds"],
                        fraction_of_limit=n / limit / r["seconds"],
                        link_bytes=r["link_bytes"],
                        hlo_bytes=r["hlo_bytes"],
                        link_over_hlo=r["link_bytes"] / r["hlo_bytes"],
                    )
                )
    return rows, schedule


def table(rows: list[dict[str, Any]]) -> str:
    """The throughput table, one line per P, rate and optimizer.

    ``steps/s`` comes from the median step time of each step kind (robust to bursts of load);
    ``windows`` is all timed steps over all their time.
    """
    head = (
        f"{'P':>2} {'rate':>8} {'optimizer':<20} {'steps/s':>8} {'windows':>8} {'x AdamW':>8} "
        f"{'x 1-bit':>8} {'of limit':>8} {'link MB/step':>13} {'HLO MB/step':>12} {'link/HLO':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = "" if r["link_over_hlo"] is None else f"{r['link_over_hlo']:.3f}"
        lines.append(
            f"{r['processes']:>2} {r['rate']:>8} {r['optimizer']:<20} {r['steps_per_s']:8.2f} "
            f"{r['window_steps_per_s']:8.2f} {r['speedup_over_adamw']:8.2f} "
            f"{r['speedup_over_onebit']:8.2f} "
            f"{r['fraction_of_limit']:8.1%} {r['link_bytes_per_step'] / 1e6:13.4f} "
            f"{r['hlo_bytes_per_step'] / 1e6:12.4f} {ratio:>8}"
        )
    return "\n".join(lines)


def schedule_table(rows: list[dict[str, Any]]) -> str:
    """The whole-schedule runs: time by step kind, against estimated AdamW and 1-bit Adam."""
    head = (
        f"{'P':>2} {'rate':>8} {'steps':>5} {'seconds':>8} {'x AdamW*':>9} {'x 1-bit*':>9} "
        f"{'of limit':>8} {'link/HLO':>8}  seconds by kind (steps)"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        kinds = ", ".join(f"{k} {v['seconds']:.1f} ({v['steps']})" for k, v in r["by_kind"].items())
        lines.append(
            f"{r['processes']:>2} {r['rate']:>8} {r['steps']:>5} {r['seconds']:8.1f} "
            f"{r['speedup_over_adamw']:9.2f} {r['speedup_over_onebit']:9.2f} "
            f"{r['fraction_of_limit']:8.1%} {r['link_over_hlo']:8.3f}  {kinds}"
        )
    lines.append(
        "* against AdamW / 1-bit Adam over as many steps, estimated from their rates; of limit: "
        "the no-communication row's rate over as many steps"
    )
    return "\n".join(lines)


def markdown(summary: dict[str, Any], command: str) -> str:
    """The tables and the setup, as the Markdown report."""
    lines = [
        "# Throughput over a shaped link",
        "",
        f"`{command}`: {summary['wall_seconds']:.0f} s; load average (1 min) during the windows "
        f"{summary['load_average']}."
        + (
            " Workers with " + common.allocator_note(summary["allocator"])
            if summary.get("allocator")
            else ""
        ),
        "",
        "```",
        table(summary["rows"]),
    ]
    if summary["whole_schedule"]:
        lines += ["", schedule_table(summary["whole_schedule"])]
    lines += ["```", ""]
    lines += [
        f"- P={run['processes']}: {run['params'] / 1e6:.2f}M params, batch "
        f"{run['batch_per_worker']} per worker"
        for run in summary["runs"]
    ]
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Any) -> None:
    import numpy as np

    plt = common.pyplot()
    rows = summary["rows"]
    groups = sorted(
        {(r["processes"], r["rate"]) for r in rows}, key=lambda g: (g[0], netns.rate_bits(g[1]))
    )
    names = list(OPTIMIZERS)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(names)
    x = np.arange(len(groups))
    for i, name in enumerate(names):
        get = {(r["processes"], r["rate"]): r for r in rows if r["optimizer"] == name}
        speed = [get[g]["steps_per_s"] if g in get else np.nan for g in groups]
        frac = [get[g]["fraction_of_limit"] if g in get else np.nan for g in groups]
        axes[0].bar(x + i * width, speed, width, label=name)
        axes[1].bar(x + i * width, frac, width, label=name)
    labels = [f"P={p}\n{rate}" for p, rate in groups]
    for ax, title in zip(axes, ("training steps/s", "fraction of the no-communication limit")):
        ax.set_xticks(x + width * (len(names) - 1) / 2, labels)
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].legend(fontsize=8, loc="upper left")
    fig.suptitle("Throughput over a shaped loopback link (all processes share it), CPU")
    common.save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = common.argument_parser("benchmarks.network", __doc__)
    parser.add_argument("--processes", default="2,4", help="process counts, one job each")
    parser.add_argument("--rates", default="1gbit,100mbit", help="tc rates, fastest first")
    parser.add_argument("--out", default="results/network.json", help=".md, .png beside it")
    parser.add_argument("--timeout", type=float, default=900, help="per process count, seconds")
    parser.add_argument("--quick", action="store_true", help="tiny model, short windows")
    parser.add_argument(
        common.SYSTEM_ALLOCATOR,
        action="store_true",
        help="the workers with glibc as it comes (default: common.KEEP_MEMORY, docs/jit.md)",
    )
    opts, worker_args = parser.parse_known_args(argv)
    # the worker's options pass through: a typo stops here (exit 2, argparse's message), not in
    # every process of the job after the namespace is built
    from benchmarks.jobs import network_worker

    network_worker.parse_args(["--out", os.devnull, "--rates", opts.rates, *worker_args])
    reason = netns.unavailable()
    if reason:
        print(f"benchmarks.network cannot run here: {reason}.", file=sys.stderr)
        return CANNOT_RUN
    if opts.quick:
        worker_args = [
            "--width", "256", "--depth", "2", "--rounds", "1", "--steps-adamw", "4",
            "--steps-onebit", "8", "--steps-zero-one", "32", "--steps-nocomm", "8",
            "--schedule-steps", "40",
            *worker_args,
        ]  # fmt: skip
    for name in netns.remove_stale():
        print(f"removed namespace {name} left by an earlier run")
    rates = opts.rates.split(",")
    allocator = {} if opts.system_allocator else dict(common.KEEP_MEMORY)
    runs = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for p in (int(v) for v in opts.processes.split(",")):
            out = os.path.join(tmp, f"p{p}.json")
            try:
                with netns.shaped_namespace(rates[0]) as ns:
                    print(f"== {p} processes in namespace {ns.name} ==", flush=True)
                    status = launch(
                        "benchmarks.jobs.network_worker",
                        ["--out", out, "--rates", opts.rates, *worker_args],
                        processes=p,
                        devices_per_process=1,
                        wrapper=ns.exec_prefix,
                        timeout=opts.timeout,
                        env=allocator,
                    )
            except RuntimeError as err:  # the namespace could not be made (e.g. no CAP_NET_ADMIN)
                print(f"benchmarks.network cannot run here: {err}", file=sys.stderr)
                return CANNOT_RUN
            if status == 130:
                raise KeyboardInterrupt
            if status != 0:
                print(f"the {p}-process run failed (status {status})", file=sys.stderr)
                return status
            with open(out) as f:
                runs.append(json.load(f))
    rows, schedule = summarize(runs)
    print(table(rows))
    if schedule:
        print(schedule_table(schedule))
    for run in runs:
        print(
            f"P={run['processes']}: {run['params'] / 1e6:.2f}M params, batch "
            f"{run['batch_per_worker']} per worker"
        )
    loads = [x for r in rows for x in r["load_average"]]
    summary = dict(
        rows=rows,
        whole_schedule=schedule,
        runs=runs,
        load_average=f"{min(loads):.2f}-{max(loads):.2f}" if loads else "?",
        allocator=allocator,
        wall_seconds=time.perf_counter() - started,
    )
    command = "python -m benchmarks.network " + " ".join(argv if argv is not None else sys.argv[1:])
    paths = common.write_results(opts.out, summary, markdown(summary, command.strip()), plot)
    print(f"wrote {', '.join(map(str, paths))} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("benchmarks.network: interrupted; processes stopped, namespace removed.")
        sys.exit(130)
