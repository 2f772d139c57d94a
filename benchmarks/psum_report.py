"""The two backends of the compressed mean side by side: bytes per worker and one-call accuracy.

``python -m benchmarks.psum_report [--workers 8 16 64 128] [--numel 1e6] [--accuracy-numel 65536]``

- Bytes: ``onebit_mean(collective="psum")``, ``onebit_mean(collective="two_phase")`` and a float32
  ``lax.pmean`` of the same transformer-like tree (~20 leaves per million elements) are compiled
  (only; nothing is allocated) under ``jax.shard_map`` on N simulated CPU devices, and
  ``optax_zero_one.comm_stats`` reads the collectives and the bytes each device sends per call
  from the optimised HLO (ring all-reduce: ``2 S (N-1)/N`` for a payload of ``S`` bytes).
- Accuracy: one call of each backend, from zero error buffers, on the same inputs (N workers
  under ``jax.vmap``): cosine similarity to the true mean and relative error
  ``||out - mean|| / ||mean||``, for two input families: ``signal+noise`` (every worker sees a
  shared N(0, 1) signal plus its own N(0, 1) noise, i.e. a gradient with SNR 1) and
  ``mixed scales`` (the same, times a per-worker magnitude log-uniform in 10^[-1, 1]).

Prints a markdown table and saves ``results/psum_report.json`` and ``results/psum_report.md``.
"""

import os

_MAX_DEVICES = 128  # the largest N of the default --workers; set before JAX starts
os.environ.setdefault("PJRT_NPROC", str(2 * _MAX_DEVICES))  # the deadlock guard (JAX_NOTES.md)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", _MAX_DEVICES)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_zero_one as ozo  # noqa: E402
from optax_zero_one import psum_mean  # noqa: E402

AXIS = "w"
BACKENDS = ("psum", "two_phase")


def transformer_like_tree(numel: int) -> list[jax.ShapeDtypeStruct]:
    """Square float32 matrices, a bias each, ~20 leaves per million elements."""
    pairs = max(2, round(20 * numel / 1e6)) // 2
    width = max(8, int(math.sqrt(numel / pairs)))
    return [
        jax.ShapeDtypeStruct(s, jnp.float32) for _ in range(pairs) for s in [(width,) * 2, (width,)]
    ]


def worker_specs(tree, mesh):
    sharding = NamedSharding(mesh, P(AXIS))
    n = mesh.devices.size
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=sharding), tree
    )


def per_worker(fn, mesh):
    def body(*args):
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    return jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))


def measure_bytes(tree, n: int) -> dict:
    mesh = jax.make_mesh(
        (n,), (AXIS,), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,)
    )
    row = {}
    for backend in BACKENDS:
        tx = ozo.onebit_mean(AXIS, num_workers=n, collective=backend)
        state = jax.eval_shape(tx.init, tree)
        stats = ozo.comm_stats(
            per_worker(lambda t, s, tx=tx: tx.update(t, s), mesh),
            worker_specs(tree, mesh),
            worker_specs(state, mesh),
        )
        row[backend] = {
            "sent_bytes": stats.sent_bytes_per_device,
            "collectives": [f"{c.kind} {','.join(c.dtypes)}" for c in stats.collectives],
        }
    pmean = ozo.comm_stats(
        per_worker(lambda t: jax.lax.pmean(t, AXIS), mesh), worker_specs(tree, mesh)
    )
    row["pmean"] = {
        "sent_bytes": pmean.sent_bytes_per_device,
        "collectives": [f"{c.kind} {','.join(c.dtypes)}" for c in pmean.collectives],
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 16, 64, 128])
    parser.add_argument("--numel", type=float, default=1e6, help="elements of the bytes tree")
    parser.add_argument("--accuracy-numel", type=int, default=65_536)
    parser.add_argument("--out", default="results/psum_report.json")
    args = parser.parse_args(argv)
    if max(args.workers) > jax.device_count():
        raise SystemExit(f"at most {jax.device_count()} workers (set _MAX_DEVICES)")
    tree = transformer_like_tree(int(args.numel))
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
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(report + "\n")
    print(f"saved {out} and {out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main()
