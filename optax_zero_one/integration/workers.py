"""Worker-layout helpers: one copy of params and state per worker, and reading them back.

Data-parallel training with these optimizers keeps one copy of the parameters and of the
optimizer state per worker (during 0/1 Adam's local steps the copies differ). The layouts:

- ``jax.pmap(..., axis_name=a)``: the leading (device) axis of every array;
- ``jax.shard_map(..., in_specs=P(a), out_specs=P(a))``: a leading worker axis sharded over the
  mesh axis ``a`` (each device sees a block of size 1 and drops it inside the body);
- ``jax.vmap(..., axis_name=a)``: a leading worker axis on one device (simulated workers).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_zero_one.core import _checks, _graph
from optax_zero_one.integration.distributed import _addressable_rows


class ShardLocalState(NamedTuple):
    """State of :meth:`DataParallel.optimizer`: the inner optimizer's state of every model shard.

    Attributes:
      inner: the inner state, each array with a leading axis of one entry per shard of the
        other mesh axes (sharded over them): every device keeps the state of its own shard.
    """

    KEEPS_BUFFERS = True  # its transform keeps its buffers on a skipped step
    INNER_FIELDS = ("inner",)  # other transforms' states

    inner: Any

    def moved(self, every: Any, fresh: ShardLocalState, move: Any) -> ShardLocalState:
        """To another data-worker count (:meth:`DataParallel.reset_compression`, which checks
        first that the shards are those of its mesh; ``move.shards`` cuts the params): each
        model shard's state moved as a state of its own, from the params' block of that
        shard."""
        shards = move.shards
        moved = []
        for s in range(shards.count):
            take = lambda tree, s=s: jax.tree.map(lambda x: np.asarray(x)[s], tree)  # noqa: E731
            every_s = jax.tree.map(lambda x, s=s: np.asarray(x)[:, s], every.inner)
            local = type(move)(shards.local(move.params, s))
            moved.append(local(take(self.inner), every_s, take(fresh.inner)))
        return ShardLocalState(jax.tree.map(lambda *xs: np.stack(xs), *moved))


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
    _checks.check_int("num_workers", num_workers, 1)
    out = jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x)[None], num_workers, axis=0), tree)
    return out if sharding is None else jax.device_put(out, sharding)


def shape_of(leaf: Any) -> tuple[int, ...]:
    """The shape of an array or of anything with a ``shape`` (``jax.ShapeDtypeStruct``, Orbax's
    metadata); ``()`` for a Python number."""
    return tuple(getattr(leaf, "shape", np.shape(leaf)))


def leading_axes(tree: Any) -> dict[int, str]:
    """The leading axis sizes of the non-scalar leaves of ``tree`` (arrays, or anything with a
    ``shape``: ``jax.ShapeDtypeStruct``, Orbax's metadata), each with the first leaf that has
    it: one entry for a tree in the worker layout."""
    found: dict[int, str] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shape = shape_of(leaf)
        if shape:
            found.setdefault(shape[0], _checks.leaf_name(path))
    return found


def unreplicate(tree: Any, worker: int | None = None) -> Any:
    """One worker's copy of a tree in the worker layout (the inverse of :func:`replicate`).

    Works when the worker axis spans other processes' devices (a ``jax.distributed`` job):
    only the rows this process can address are read, without communication, so ``worker`` must
    be one of this process's workers (see :func:`~optax_zero_one.local_rows`). In a single
    process every row is addressable.

    Args:
      tree: a tree in the worker layout (leading worker axis: ``pmap``, ``shard_map`` or
        ``vmap``), of ``jax.Array`` or NumPy arrays.
      worker: the worker whose copy to return (negative counts from the last worker); default:
        the first worker this process holds (worker 0 in a single process).

    Returns:
      The tree without the worker axis, as NumPy arrays. Raises ``ValueError`` if ``worker``
      is held by another process.

    Example:
      >>> tx = ozo.zero_one_adam(1e-3, axis_name="w")
      >>> params = replicate({"w": jnp.zeros(3)}, 4)  # 4 workers
      >>> opt_state = jax.vmap(tx.init, axis_name="w")(params)
      >>> params, opt_state = unreplicate((params, opt_state))  # worker 0's copy
      >>> eval_params = synchronized_params(params, opt_state)
      >>> eval_params["w"].shape
      (3,)
    """

    if worker is not None:
        worker = _checks.as_index("worker", worker, "a worker's index")
    leading = leading_axes(tree)
    if len(leading) > 1:
        found = ", ".join(f"{n} at {where}" for n, where in leading.items())
        raise ValueError(
            f"unreplicate needs the worker layout (one leading worker axis on every leaf), but "
            f"the leaves' leading axes disagree ({found}): the tree is one worker's already (or "
            "a mix), and its first rows would come back. Pass the tree ozo.replicate or the "
            "mapped step made."
        )

    def one(x: Any) -> Any:
        if np.ndim(x) == 0:
            raise ValueError(
                "unreplicate needs the worker layout (a leading worker axis on every leaf); got "
                "a scalar leaf. Pass the tree ozo.replicate or the mapped step made."
            )
        if worker is not None and not -len(x) <= worker < len(x):
            raise ValueError(f"worker {worker} is out of range: the tree holds {len(x)} workers.")
        rows, data = _addressable_rows(x)
        if worker is None:
            return data[0]
        if len(rows) == len(x):  # every row is here: NumPy indexing (negative counts from the end)
            return data[worker]
        index = worker + len(x) if worker < 0 else worker
        if index not in rows:
            raise ValueError(
                f"worker {worker} is not on a device of this process (process "
                f"{jax.process_index()} holds workers {rows})"
            )
        return data[rows.index(index)]

    return jax.tree.map(one, tree)


def synchronized_params(params: Any, opt_state: Any) -> Any:
    """The parameters at the last synchronisation point, identical on every worker.

    During local steps (0/1 Adam's phase B, or any :func:`~optax_zero_one.local_step_sync`)
    each worker's parameters drift apart; the wrapper's ``anchor`` is where all workers were at
    the last sync, bitwise equal on every worker. Before local steps begin the parameters are
    synchronised themselves and are returned. Use it to evaluate, export or checkpoint a model.
    For states without local steps (1-bit Adam, Adam) the parameters are returned as they are.

    Works on one worker's tree inside the mapped context and on the worker layout outside it.

    Args:
      params: parameters (one worker's, or in the worker layout).
      opt_state: the matching optimizer state (may be nested, e.g. inside ``optax.chain``).

    Returns:
      A tree like ``params`` (their dtypes).
    """
    if _graph.nodes_of(opt_state, ShardLocalState):
        raise ValueError(
            "opt_state comes from DataParallel.optimizer (one state per model shard): use "
            "dp.synchronized_params(params, opt_state) instead."
        )
    found = _graph.synchronizing_states(opt_state)
    if not found and _graph.synchronizing_states(params):
        raise ValueError(
            "synchronized_params got an optimizer state as params: the arguments are "
            "(params, opt_state), in that order."
        )
    if not found:
        _graph.check_not_nnx_state(opt_state, "synchronized_params")
        return params
    covered: set[str] = set()
    for state in found:  # several: e.g. optax.multi_transform of 0/1 Adam on two partitions
        params, paths = state.at_last_sync(params)
        if covered & paths:
            raise ValueError(
                f"opt_state holds more than one {type(state).__name__} over the same params; "
                "pass the one to use."
            )
        covered |= paths
    return params
