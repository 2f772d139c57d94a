"""The two backends of the compressed mean side by side: bytes per worker and one-call accuracy.

``python -m benchmarks.psum_report [--workers 8 16 64 128] [--numel 1e6] [--accuracy-numel 65536]``

- Bytes: ``onebit_mean(collective="psum")``, ``onebit_mean(collective="two_phase")`` and a float32
  ``lax.pmean`` of the same transformer-like tree (~20 leaves per million elements) are compiled
  (only; nothing is allocated) under ``jax.shard_map`` on N simulated CPU devices, and the
  collectives and the bytes each device sends per call are read from the optimised HLO
  (``benchmarks.support.common.mean_comm_stats``; ring all-reduce: ``2 S (N-1)/N`` for a payload
  of ``S`` bytes).
- Accuracy: one call of each backend, from zero error buffers, on the same inputs (N workers
  under ``jax.vmap``): cosine similarity to the true mean and relative error
  ``||out - mean|| / ||mean||``, for two input families: ``signal+noise`` (every worker sees a
  shared N(0, 1) signal plus its own N(0, 1) noise, i.e. a gradient with SNR 1) and
  ``mixed scales`` (the same, times a per-worker magnitude log-uniform in 10^[-1, 1]).

Prints a markdown table and saves ``results/psum_report.json``, ``.md`` and ``.png`` (bytes per
call against N; cosine to the true mean against N).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX is imported
# PJRT_NPROC (2x the devices): set by main() from --workers, common.setup_cpu_devices

import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from benchmarks.support import common, model_trees  # noqa: E402
from optax_zero_one.core import psum_mean  # noqa: E402

AXIS = common.AXIS
BACKENDS = ("psum", "two_phase")


def measure_bytes(tree: list, n: int) -> dict:
    """Bytes each worker sends per call and the collectives, per backend and for a pmean."""
    row = {}
    for name, collective in (*((b, b) for b in BACKENDS), ("pmean", None)):
        stats = common.mean_comm_stats(tree, n, collective)
        row[name] = {
            "sent_bytes": stats.sent_bytes_per_device,
            "collectives": [f"{c.kind} {','.join(c.dtypes)}" for c in stats.collectives],
        }
    return row


def make_inputs(kind: str, n: int, numel: int, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    signal = rng.standard_normal(numel)
    z = signal + rng.standard_normal((n, numel))
    if kind == "mixed scales":
        z = z * 10.0 ** rng.uniform(-1, 1, (n, 1))
    return jnp.asarray(z, jnp.float32)


def measure_accuracy(kind: str, n: int, numel: int) -> dict:
    z = make_inputs(kind, n, numel)
    true_mean = np.asarray(z, np.float64).mean(0)
    row = {}
    for backend in BACKENDS:
        tx = ozo.onebit_mean(AXIS, collective=backend)
        out, _ = jax.jit(jax.vmap(lambda x, tx=tx: tx.update(x, tx.init(x)), axis_name=AXIS))(z)
        out = np.asarray(out[0], np.float64)
        row[backend] = {
            "cosine": float(out @ true_mean / (np.linalg.norm(out) * np.linalg.norm(true_mean))),
            "relative_error": float(np.linalg.norm(out - true_mean) / np.linalg.norm(true_mean)),
        }
    return row


def table(result: dict) -> str:
    """The report as markdown: bytes sent per worker per call, then one-call accuracy."""
    rows, kinds = result["rows"], result["input_kinds"]
    numel, leaves = rows[0]["numel"], rows[0]["leaves"]
    collectives = {k: " + ".join(v["collectives"]) for k, v in rows[0]["bytes"].items()}
    lines = [
        f"Bytes each worker sends per call for {numel:,} float32 in {leaves} leaves (compiled HLO "
        "on N simulated devices; bits per element in brackets) and the accuracy of one call "
        f"from zero error on {result['accuracy_numel']:,} elements (cosine to the true mean / "
        "relative error). Collectives: "
        + "; ".join(f"{k}: {v}" for k, v in collectives.items())
        + ".",
        "",
        "| N | field bits | psum | two-phase | f32 pmean | psum / two-phase | psum / pmean | "
        + " | ".join(f"{k}: psum | {k}: two-phase" for k in kinds)
        + " |",
        "|" + "---|" * (7 + 2 * len(kinds)),
    ]
    for r in rows:
        b = {k: v["sent_bytes"] for k, v in r["bytes"].items()}
        bits = {k: 8 * v / numel for k, v in b.items()}
        cells = [
            str(r["workers"]),
            str(r["field_bits"]),
            f"{b['psum'] / 1e3:,.0f} kB ({bits['psum']:.1f})",
            f"{b['two_phase'] / 1e3:,.0f} kB ({bits['two_phase']:.1f})",
            f"{b['pmean'] / 1e6:,.2f} MB ({bits['pmean']:.0f})",
            f"{b['psum'] / b['two_phase']:.1f}x",
            f"1/{b['pmean'] / b['psum']:.1f}",
        ]
        for k in kinds:
            for backend in BACKENDS:
                a = r["accuracy"][k][backend]
                cells.append(f"{a['cosine']:.3f} / {a['relative_error']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    """Bytes per call against N (log), and one call's cosine to the true mean against N."""
    plt = common.pyplot()
    rows = result["rows"]
    workers = [r["workers"] for r in rows]
    fig, (sent, cosine) = plt.subplots(1, 2, figsize=(11, 4))
    for name in (*BACKENDS, "pmean"):
        sent.plot(workers, [r["bytes"][name]["sent_bytes"] for r in rows], "o-", label=name)
    sent.set(yscale="log", ylabel="bytes per worker per call")
    for kind in result["input_kinds"]:
        for backend in BACKENDS:
            values = [r["accuracy"][kind][backend]["cosine"] for r in rows]
            cosine.plot(workers, values, "o-", label=f"{backend}, {kind}")
    cosine.set(ylabel="cosine to the true mean (one call)")
    for ax in (sent, cosine):
        common.workers_axis(ax, workers)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    head = f"compressed mean backends, {rows[0]['numel']:,} float32 in {rows[0]['leaves']} leaves"
    fig.suptitle(head)
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    parser = common.argument_parser("benchmarks.psum_report", __doc__)
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[8, 16, 64, 128], help="worker counts N"
    )
    parser.add_argument("--numel", type=float, default=1e6, help="elements of the bytes tree")
    parser.add_argument("--accuracy-numel", type=int, default=65_536)
    parser.add_argument("--out", default="results/psum_report.json", help=".md, .png beside it")
    args = parser.parse_args(argv)
    common.setup_cpu_devices(max(args.workers))
    tree = model_trees.transformer_like_tree(int(args.numel))
    numel = sum(math.prod(x.shape) for x in tree)
    kinds = ["signal+noise", "mixed scales"]
    rows = []
    start = time.time()
    for n in args.workers:
        row = {"workers": n, "numel": numel, "leaves": len(tree), "bytes": measure_bytes(tree, n)}
        row["accuracy"] = {k: measure_accuracy(k, n, args.accuracy_numel) for k in kinds}
        row["field_bits"] = psum_mean.field_width(n)
        rows.append(row)
        print(f"N={n} done ({time.time() - start:.0f} s)", flush=True)
    result = {
        "command": "python -m benchmarks.psum_report",
        "accuracy_numel": args.accuracy_numel,
        "input_kinds": kinds,
        "rows": rows,
    }
    report = table(result)
    print("\n" + report)
    paths = common.write_results(args.out, result, report, plot)
    print("saved " + ", ".join(map(str, paths)))
    return result


if __name__ == "__main__":
    main()
