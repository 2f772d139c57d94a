"""Bytes per device of the fused 1-bit compressed mean against a float32 pmean.

``python -m benchmarks.comm_report [--workers 4 8 16] [--sizes 1e5 1e6 1e7]`` compiles (only;
nothing is allocated) ``onebit_mean`` and ``lax.pmean`` of the same tree under ``jax.shard_map``
on N simulated CPU devices, reads the collectives from the optimised HLO with
``optax_zero_one.comm_stats``, and prints a table. The tree is transformer-like: square
matrices plus biases, ~20 leaves per million elements.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_zero_one as ozo

AXIS = "w"


def setup_cpu_devices(count: int) -> None:
    """Simulated CPU devices (and PJRT_NPROC against the rendezvous deadlock, JAX_NOTES.md).

    Must run before JAX first uses its backend; ``import jax`` alone does not start it.
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("PJRT_NPROC", str(2 * count))
    jax.config.update("jax_num_cpu_devices", count)


def worker_specs(tree, mesh):
    """Compile-only inputs in the worker layout: a leading worker axis sharded over the mesh."""
    sharding = NamedSharding(mesh, P(AXIS))
    n = mesh.devices.size
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=sharding), tree
    )


def transformer_like_tree(numel: int) -> list[jax.ShapeDtypeStruct]:
    """Square float32 matrices (and a bias each) totalling about ``numel`` elements."""
    leaves = max(2, round(20 * numel / 1e6)) // 2
    width = max(8, int(math.sqrt(numel / leaves)))
    tree = []
    for _ in range(leaves):
        tree += [jax.ShapeDtypeStruct((width, width), jnp.float32)]
        tree += [jax.ShapeDtypeStruct((width,), jnp.float32)]
    return tree


def measure(numel: int, n: int) -> dict:
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), (AXIS,))
    tree = transformer_like_tree(numel)
    actual = sum(math.prod(x.shape) for x in tree)
    tx = ozo.onebit_mean(AXIS, num_workers=n)
    state = jax.eval_shape(tx.init, tree)

    def onebit(t, s):
        out = tx.update(*jax.tree.map(lambda x: x[0], (t, s)))
        return jax.tree.map(lambda x: x[None], out)

    def pmean(t):
        return jax.lax.pmean(t, AXIS)

    spec = P(AXIS)
    compressed = ozo.comm_stats(
        jax.shard_map(onebit, mesh=mesh, in_specs=spec, out_specs=spec),
        worker_specs(tree, mesh),
        worker_specs(state, mesh),
    )
    base = ozo.comm_stats(
        jax.shard_map(pmean, mesh=mesh, in_specs=spec, out_specs=spec), worker_specs(tree, mesh)
    )
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


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e5, 1e6])
    parser.add_argument("--out", default="results/comm_report.json")
    args = parser.parse_args(argv)
    setup_cpu_devices(max(args.workers))
    rows = []
    header = (
        f"{'elements':>11} {'leaves':>6} {'N':>4} {'pmean B/dev':>13} {'1-bit B/dev':>12} "
        f"{'limit B':>11} {'pmean/1-bit':>11}  collectives"
    )
    print("Bytes each device sends per call (from the compiled HLO)\n" + header)
    for n in args.workers:
        for size in args.sizes:
            r = measure(int(size), n)
            rows.append(r)
            kinds = " + ".join(f"{v} {k}" for k, v in r["onebit_collectives"].items())
            print(
                f"{r['numel']:>11,} {r['leaves']:>6} {n:>4} {r['pmean_bytes']:>13,.0f} "
                f"{r['onebit_bytes']:>12,.0f} {r['one_bit_limit_bytes']:>11,.0f} "
                f"{r['ratio']:>10.1f}x  {kinds}",
                flush=True,
            )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print("\nlimit = 2 (N-1)/N numel/8: one bit per element in each of the two phases.")
    print(f"saved {out} ({os.path.getsize(out)} bytes)")
    return rows


if __name__ == "__main__":
    main()
