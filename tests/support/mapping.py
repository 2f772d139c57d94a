"""Run a per-worker function over N simulated workers in each of the three mapped styles, and
the inputs and calls the compressed-mean tests share."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_zero_one as ozo

MODES = ("vmap", "pmap", "shard_map")
AXIS = "w"


def mapped(fn: Any, mode: str, num_workers: int) -> Any:
    """``fn`` (one worker's view, arrays without the worker axis) lifted to the worker layout.

    The returned callable takes and returns trees with a leading worker axis of size
    ``num_workers``; it is jitted.
    """
    devices = jax.devices()[:num_workers]
    if mode == "vmap":
        return jax.jit(jax.vmap(fn, axis_name=AXIS))
    if mode == "pmap":
        return jax.pmap(fn, axis_name=AXIS, devices=devices)
    if mode != "shard_map":
        raise ValueError(mode)
    mesh = jax.make_mesh((num_workers,), (AXIS,), devices=devices)
    run = jax.jit(ozo.on_workers(fn, mesh))
    sharding = NamedSharding(mesh, P(AXIS))

    def call(*args: Any) -> Any:
        return run(*jax.device_put(args, sharding))

    return call


def make_inputs(shapes, n, calls, seed=0, dtypes=None, spread=(-1, 1), shared=False):
    """``calls`` trees (lists of leaves in the worker layout) of random values; each worker's
    magnitude is ``10**u`` with ``u`` uniform in ``spread``; with ``shared``, a signal common to
    the workers is added to the noise before scaling."""
    rng = np.random.default_rng(seed)
    dtypes = dtypes or [np.float32] * len(shapes)
    out = []
    for _ in range(calls):
        tree = []
        for shape, dtype in zip(shapes, dtypes):
            scale = 10.0 ** rng.uniform(*spread, size=(n,) + (1,) * len(shape))
            signal = rng.standard_normal(shape) if shared else 0.0
            tree.append(((signal + rng.standard_normal((n, *shape))) * scale).astype(dtype))
        out.append(tree)
    return out


def run_calls(tx, n, inputs, mode="vmap"):
    """``tx`` (a mean such as ``onebit_mean``) called on each tree of ``inputs`` in turn, state
    carried over: every call's output and the final state."""
    state = mapped(tx.init, mode, n)(inputs[0])
    step = mapped(lambda t, s: tx.update(t, s), mode, n)
    outs = []
    for tree in inputs:
        out, state = step(tree, state)
        jax.block_until_ready(out)
        outs.append(out)
    return outs, state


def sharded_specs(mesh, tree):
    """``ShapeDtypeStruct``s of ``tree`` with the worker axis sharded over ``mesh``."""
    sh = NamedSharding(mesh, P(AXIS))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree)
