"""Worker-layout helpers: one copy of params and state per worker, and reading them back.

Data-parallel training with these optimizers keeps one copy of the parameters and of the
optimizer state per worker (during 0/1 Adam's local steps the copies differ). The layouts:

- ``jax.pmap(..., axis_name=a)``: the leading (device) axis of every array;
- ``jax.shard_map(..., in_specs=P(a), out_specs=P(a))``: a leading worker axis sharded over the
  mesh axis ``a`` (each device sees a block of size 1 and drops it inside the body);
- ``jax.vmap(..., axis_name=a)``: a leading worker axis on one device (simulated workers).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_zero_one.zero_one_adam import ZeroOneAdamState


def replicate(tree: Any, num_workers: int, sharding: jax.sharding.Sharding | None = None) -> Any:
    """Stacks ``num_workers`` copies of every leaf along a new leading worker axis.

    Args:
      tree: a single worker's pytree (params, or a state made by ``init(..., num_workers=N)``).
      num_workers: the number of workers.
      sharding: optional sharding to place the result with, e.g.
        ``NamedSharding(mesh, P(axis_name))`` for ``shard_map``.

    Returns:
      The tree in the worker layout (leading axis of size ``num_workers``).
    """
    out = jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x)[None], num_workers, axis=0), tree)
    return out if sharding is None else jax.device_put(out, sharding)


def unreplicate(tree: Any, worker: int = 0) -> Any:
    """One worker's copy of a tree in the worker layout (the inverse of :func:`replicate`)."""
    return jax.tree.map(lambda x: jax.device_get(x)[worker], tree)


def synchronized_params(params: Any, opt_state: Any) -> Any:
    """The parameters at the last synchronisation point, identical on every worker.

    During 0/1 Adam's local steps each worker's parameters drift apart; the anchor in
    :class:`~optax_zero_one.ZeroOneAdamState` is where all workers were at the last sync (in
    phase A: the parameters after the last step), bitwise equal on every worker. Use it to
    evaluate, export or checkpoint a model. For other states (1-bit Adam, Adam) the parameters
    are returned as they are.

    Works on one worker's tree inside the mapped context and on the worker layout outside it.

    Args:
      params: parameters (one worker's, or in the worker layout).
      opt_state: the matching optimizer state (may be nested, e.g. inside ``optax.chain``).

    Returns:
      A tree like ``params`` (their dtypes).
    """
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, ZeroOneAdamState))
        if isinstance(s, ZeroOneAdamState)
    ]
    if not found:
        return params
    if len(found) > 1:
        raise ValueError("opt_state holds more than one ZeroOneAdamState; pass the one to use.")
    return jax.tree.map(lambda x, a: jnp.asarray(a).astype(x.dtype), params, found[0].anchor)
