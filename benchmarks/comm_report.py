"""Bytes per device of the fused 1-bit compressed mean against a float32 pmean.

``python -m benchmarks.comm_report [--workers 4 8 16] [--sizes 1e5 1e6] [--out PATH]`` compiles
(only; nothing is allocated) ``onebit_mean`` and ``lax.pmean`` of the same tree under
``jax.shard_map`` on N simulated CPU devices, reads the collectives from the optimised HLO
(``benchmarks.support.common.mean_comm_stats``), and prints a table. The tree is
transformer-like: square matrices plus biases, ~20 leaves per million elements
(``model_trees.transformer_like_tree``).

Writes ``results/comm_report.json``, ``.md`` (the table) and ``.png`` (bytes per device against
N, per tree size, with the 1-bit limit ``2 (N-1)/N numel/8``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported
# PJRT_NPROC (2x the devices): set by main() from --workers, common.setup_cpu_devices

import math  # noqa: E402

from benchmarks.support import common, model_trees  # noqa: E402


def measure(numel: int, n: int) -> dict:
    """Bytes per device of one call of ``onebit_mean`` and of a float ``pmean``, ``N = n``."""
    tree = model_trees.transformer_like_tree(numel)
    actual = sum(math.prod(x.shape) for x in tree)
    compressed = common.mean_comm_stats(tree, n, "two_phase")
    base = common.mean_comm_stats(tree, n, None)
    return {
        "numel": actual,
        "leaves": len(tree),
        "workers": n,
        "pmean_bytes": base.sent_bytes_per_device,
        "pmean_collectives": base.count(),
        "onebit_bytes": compressed.sent_bytes_per_device,
        "onebit_collectives": {c.kind: compressed.count(c.kind) for c in compressed.collectives},
        "one_bit_limit_bytes": 2 * (n - 1) / n * actual / 8,
        "ratio": base.sent_bytes_per_device / compressed.sent_bytes_per_device,
    }


HEADER = (
    f"{'elements':>11} {'leaves':>6} {'N':>4} {'pmean B/dev':>13} {'1-bit B/dev':>12} "
    f"{'limit B':>11} {'pmean/1-bit':>11}  collectives"
)
NOTE = "limit = 2 (N-1)/N numel/8: one bit per element in each of the two phases."


def row_line(r: dict) -> str:
    kinds = " + ".join(f"{v} {k}" for k, v in r["onebit_collectives"].items())
    return (
        f"{r['numel']:>11,} {r['leaves']:>6} {r['workers']:>4} {r['pmean_bytes']:>13,.0f} "
        f"{r['onebit_bytes']:>12,.0f} {r['one_bit_limit_bytes']:>11,.0f} "
        f"{r['ratio']:>10.1f}x  {kinds}"
    )


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Bytes per device: fused 1-bit mean vs float32 pmean",
        "",
        "From the compiled HLO (`python -m benchmarks.comm_report`).",
        "",
        "```",
        HEADER,
        *map(row_line, rows),
        "```",
        "",
        NOTE,
    ]
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    """Bytes per device against N, one line per tree size and mean, and the 1-bit limit."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for numel in sorted({r["numel"] for r in rows}):
        mine = sorted((r for r in rows if r["numel"] == numel), key=lambda r: r["workers"])
        workers = [r["workers"] for r in mine]
        pmean = [r["pmean_bytes"] for r in mine]
        (line,) = ax.plot(workers, pmean, "o-", label=f"{numel:,}: f32 pmean")
        color = line.get_color()
        onebit = [r["onebit_bytes"] for r in mine]
        ax.plot(workers, onebit, "s--", color=color, label=f"{numel:,}: 1-bit mean")
        ax.plot(workers, [r["one_bit_limit_bytes"] for r in mine], ":", color=color, lw=1)
    common.workers_axis(ax, sorted({r["workers"] for r in rows}))
    ax.set(yscale="log", ylabel="bytes sent per device")
    ax.set_title("one call (dotted: 1-bit limit)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="center right")
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.argument_parser("benchmarks.comm_report", __doc__)
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[4, 8, 16], help="worker counts N"
    )
    parser.add_argument(
        "--sizes", type=float, nargs="+", default=[1e5, 1e6], help="elements per call"
    )
    parser.add_argument("--out", default="results/comm_report.json", help=".md, .png beside it")
    args = parser.parse_args(argv)
    common.setup_cpu_devices(max(args.workers))
    rows = []
    print("Bytes each device sends per call (from the compiled HLO)\n" + HEADER)
    for n in args.workers:
        for size in args.sizes:
            rows.append(measure(int(size), n))
            print(row_line(rows[-1]), flush=True)
    print("\n" + NOTE)
    paths = common.write_results(args.out, rows, markdown(rows), plot)
    print("saved " + ", ".join(map(str, paths)))
    return rows


if __name__ == "__main__":
    main()
