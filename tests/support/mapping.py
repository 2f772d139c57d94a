"""Run a per-worker function over N simulated workers in each of the three mapped styles."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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

    def body(*args: Any) -> Any:
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    sharding = NamedSharding(mesh, P(AXIS))

    def call(*args: Any) -> Any:
        return run(*jax.device_put(args, sharding))

    return call
