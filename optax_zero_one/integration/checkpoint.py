"""Checkpoints of the per-worker state: the worker count they were made for, and an opt-in reset.

Exact resume needs nothing from this module. Save the params and the optimizer state *in the
worker layout* (every worker's copy: error-feedback buffers, 0/1 Adam's anchor and ``lr_sum``,
counters) with any pytree checkpointer, e.g. Orbax, and restore them against a target
of the same structure (``jax.tree.map(ocp.utils.to_shape_dtype_struct, (params, opt_state))``):
the continuation is bitwise identical to the uninterrupted run, at any step, including in the
middle of a local-step interval and across the variance freeze. (DeepSpeed saves rank 0's state
only and resets the error buffers and its accumulator on every load.)

What cannot be restored exactly is a state saved by ``N`` workers onto ``M != N`` workers: each
worker's error buffers are sized for ``N`` (padding and server chunks) and hold that worker's
own residual, and during local steps each worker's params differ. So:

- :func:`worker_count` reads the worker count of a tree in the worker layout (live arrays,
  ``jax.ShapeDtypeStruct``\\ s, or a checkpoint's metadata such as Orbax's ``item_metadata``);
- :func:`check_worker_count` raises a ``ValueError`` that says so, before anything is restored;
- :func:`reset_compression` is the explicit opt-in: it moves a restored ``N``-worker state to
  ``M`` workers with fresh (zero) compression state, continuing from the last synchronised point.

This module does not import Orbax; any checkpointer that stores a pytree of arrays works.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_zero_one.core import _checks, _graph, kinds, wrappers
from optax_zero_one.integration import workers


def _items(tree: Any) -> Any:
    """The saved tree of a checkpoint's metadata: Orbax's ``Checkpointer.metadata(path)`` gives
    a step's metadata whose ``item_metadata`` is the tree (its other fields are scalars such as
    the save time); anything else as it is."""
    items = getattr(tree, "item_metadata", None)
    return tree if items is None else items


def _one_worker(tree: Any) -> bool:
    """Whether ``tree`` is one worker's, without a worker axis: its step counters (the leaves
    named ``count``, optax's and this library's) are scalars, where a state in the worker
    layout has one per worker. A tree without counters is one worker's if it has a scalar leaf.
    Other scalars (a training loop's own ``step``, or ``count``, saved beside the state) say
    nothing: every counter must be a scalar."""
    leaves = jax.tree_util.tree_leaves_with_path(_items(tree))
    counters = [leaf for path, leaf in leaves if path and _key_name(path[-1]) == "count"]
    if counters:
        return all(not workers.shape_of(leaf) for leaf in counters)
    return any(not workers.shape_of(leaf) for _, leaf in leaves)


def _key_name(key: Any) -> Any:
    return getattr(key, "name", getattr(key, "key", None))


def worker_count(tree: Any) -> int:
    """The number of workers of a tree in the worker layout: the common leading axis size.

    Args:
      tree: params and/or optimizer state with a leading worker axis on every leaf; the leaves
        may be arrays or anything with a ``shape`` (``jax.ShapeDtypeStruct``, Orbax's
        ``ArrayMetadata`` from ``CheckpointManager.item_metadata(step)``); or Orbax's metadata
        of a whole step (``StandardCheckpointer().metadata(path)``), read for its tree.

    A tree whose step counters (leaves named ``count``) are scalars is one worker's, with no
    worker axis (the state of an optimizer built with ``axis_name=None``): 1. Other scalar
    leaves (a loop's step number saved beside the state) are skipped; a tree without counters
    and with a scalar leaf counts as one worker's.

    Returns:
      The size of the leading axis, identical on every leaf (1 for one worker's tree).

    Raises:
      ValueError: if the tree holds no arrays, or the leaves' leading axes disagree.

    Example:
      >>> worker_count(ozo.replicate({"w": jnp.zeros(3)}, 4))
      4
    """
    if _one_worker(tree):
        return 1
    # a scalar beside a worker-layout state is the loop's own (a step number): skipped
    counts = workers.leading_axes(_items(tree))
    if not counts:
        raise ValueError("The tree holds no arrays, so it says nothing about the worker count.")
    if len(counts) > 1:
        found = ", ".join(f"{n} at {where}" for n, where in counts.items())
        raise ValueError(
            f"The leaves' leading (worker) axes disagree ({found}); the tree is not one state "
            "in the worker layout."
        )
    return next(iter(counts))


def check_worker_count(tree: Any, num_workers: int | tuple[int, int]) -> None:
    """Raises a clear ``ValueError`` unless ``tree`` was made for ``num_workers`` workers.

    Call it on a checkpoint's metadata *before* restoring (a checkpointer would otherwise fail
    on the first mismatched shape, without saying why), or on a restored state.

    Args:
      tree: params and/or optimizer state in the worker layout, or their shapes (see
        :func:`worker_count`). An empty tree passes.
      num_workers: the number of workers of this run, or for a hierarchical run
        (``fast_axis_name``) the pair ``(nodes, per_node)``: then the split is checked too
        (the error buffers are sized per node).

    Raises:
      ValueError: with the saved and current counts, and the two ways forward: restart with the
        saved count (exact resume), or opt in to :func:`reset_compression`.

    Example:
      >>> saved = ozo.replicate({"w": jnp.zeros(3)}, 4)  # e.g. Orbax's item_metadata(step)
      >>> ozo.check_worker_count(saved, num_workers=4)  # passes
      >>> ozo.check_worker_count(saved, num_workers=2)
      Traceback (most recent call last):
      ValueError: This state was saved by 4 workers, but this run has 2. ...
    """
    pair = isinstance(num_workers, tuple | list)
    if pair:
        what = "the pair (nodes, per_node) of a hierarchical run, each a positive int"
        if len(num_workers) != 2:
            raise ValueError(f"num_workers must be an int or {what}, got {num_workers!r}.")
        num_workers = tuple(_checks.as_index("num_workers", n, what) for n in num_workers)
        if min(num_workers) < 1:
            raise ValueError(f"num_workers must be {what}, got {num_workers}.")
    else:
        what = "this run's worker count, or the pair (nodes, per_node) of a hierarchical run"
        num_workers = _checks.as_index("num_workers", num_workers, what)
        if num_workers < 1:
            raise ValueError(f"num_workers must be a positive int ({what}), got {num_workers}.")
    if not jax.tree.leaves(_items(tree)):
        return
    saved = worker_count(tree)
    total = num_workers[0] * num_workers[1] if pair else num_workers
    workers_ = lambda n: f"{n} worker" + ("s" if n != 1 else "")  # noqa: E731
    nodes = _saved_nodes(tree)
    if nodes is not None and saved % nodes:
        raise ValueError(
            f"The tree's leading axis has {saved} entries, but its error-feedback buffers are "
            f"sized for {nodes} workers (or nodes), which do not divide them: the leading axis "
            "is not the workers. Runs batched by an outer jax.vmap go inside the worker axis, "
            "(workers, runs, ...) (docs/usage.md, 'Batching independent runs'); or check each "
            "run's state on its own."
        )
    if saved == total:
        want = num_workers[0] if pair else total  # a flat run: as many compressing nodes
        if nodes is not None and nodes != want:
            raise ValueError(
                f"This state was saved by {saved} workers in {nodes} node"
                f"{'s' if nodes != 1 else ''} of {saved // nodes}, but this run has {want} node"
                f"{'s' if want != 1 else ''} of {total // want}. The error-feedback "
                "buffers are sized per node, so they cannot be restored into another split (do "
                "not restore with strict=False: the buffers would be padded or cut). Resume "
                f"with {nodes} nodes for a bitwise-exact continuation, or restore it for that "
                "split and pass it to optax_zero_one.reset_compression(params, opt_state, "
                "fresh_state) with this run's freshly initialised state (not bit-identical)."
            )
    if saved != total:
        raise ValueError(
            f"This state was saved by {workers_(saved)}, but this run has {total}. Each "
            "worker's error-feedback buffers (and 0/1 Adam's params during "
            "local steps) belong to that worker and are sized for the worker count, so they "
            f"cannot be split or merged exactly. Resume with {workers_(saved)} for a bitwise-exact "
            "continuation, or opt in to a fresh compression state: restore the checkpoint for "
            f"{workers_(saved)} and pass it to optax_zero_one.reset_compression(params, opt_state, "
            f"fresh_state) with this run's freshly initialised state for {total} workers "
            "(training continues from the last synchronised point; not bit-identical)."
        )


def check_restored(opt_state: Any, schedule: kinds.StepSchedule | None = None) -> None:
    """Raises a clear ``ValueError`` if a restored optimizer state does not fit this run.

    Call it once after a restore, in a loop of your own (a dispatcher, ``dp.jit(...,
    schedule=)`` or :func:`~optax_zero_one.dispatch_by_kind`, runs the same checks itself at its
    first call and after a restore). A checkpoint holds neither the params' names nor the
    optimizer's arguments (``docs/reliability.md``), so two mistakes restore without an error
    and corrupt training:

    - **another params tree**: a flat state's buffers are restored by position, so a leaf
      renamed (sorting elsewhere) or reshaped since the save would get another leaf's moments,
      anchor and error buffers. The state keeps a fingerprint of each leaf's name and shape;
      they are compared with the tree the state was restored for.
    - **other schedule arguments** (with ``schedule``): see
      :func:`~optax_zero_one.check_schedule`.

    Args:
      opt_state: the restored optimizer state (any layout; concrete arrays, not shapes).
      schedule: the :class:`~optax_zero_one.StepSchedule` of the optimizer as built now, if it
        has local steps or phases (``ozo.zero_one_schedule(...)`` etc.); ``None`` checks the
        leaves only.

    Example:
      >>> tx = ozo.zero_one_adam(1e-3, axis_name="w")
      >>> saved = jax.vmap(tx.init, axis_name="w")(ozo.replicate({"a": jnp.zeros(8)}, 2))
      >>> ozo.check_restored(saved)  # passes
      >>> renamed = jax.vmap(tx.init, axis_name="w")(ozo.replicate({"b": jnp.zeros(8)}, 2))
      >>> restored = jax.tree.unflatten(jax.tree.structure(renamed), jax.tree.leaves(saved))
      >>> ozo.check_restored(restored)  # as a checkpointer restores it: by position
      Traceback (most recent call last):
      ValueError: The optimizer state was saved for another parameter tree: ...
    """
    _graph.check_not_nnx_state(opt_state, "check_restored")
    _graph.check_holds_own_state(opt_state, "check_restored")
    restore_checks(opt_state, schedule)


def restore_checks(
    opt_state: Any,
    schedule: kinds.StepSchedule | None,
    count: int | None = None,
    walk: Any = None,
) -> None:
    """The checks of a restored state (:func:`check_restored`'s, which a dispatcher runs at
    its first call and after a restore): its leaves against the tree, then, with ``schedule``,
    its policies' history (``count`` and ``walk`` as :func:`~optax_zero_one.check_schedule`
    takes them: a dispatcher's, already read)."""
    wrappers.check_leaf_keys(opt_state)
    if schedule is not None:
        kinds.check_schedule(opt_state, schedule, count, walk)


def _saved_nodes(tree: Any) -> int | None:
    """The number of nodes (slow-axis workers) the compression state of ``tree`` was sized
    for: the rows of each worker's ``worker_error`` buffer (``OnebitMeanState``'s field, found
    by name, as a checkpoint's metadata has no classes); ``None`` without such a buffer."""
    rows = {
        workers.shape_of(leaf)[-2]  # (workers, [model shards,] rows, C)
        for path, leaf in jax.tree_util.tree_leaves_with_path(_items(tree))
        if "worker_error" in jax.tree_util.keystr(path) and len(workers.shape_of(leaf)) >= 3
    }
    return next(iter(rows)) if len(rows) == 1 else None


def _row_shape(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype)


def _check_worker_params(row: Any, state: Any) -> None:
    """Raises if one worker's ``row`` of the params is not the tree ``state``'s flat layout was
    made for: params in the user's layout whose leaves' leading axis happens to be the old
    worker count pass the worker-count check, and their first rows were taken as the params
    (a bad-input trial). Checked where the state has one flat layout over the whole tree."""
    nodes = _graph.nodes_of(state, wrappers.FlattenState)
    layout = wrappers.find_layout(nodes[0].inner_state) if len(nodes) == 1 else None
    if layout is None or len(layout.paths) != len(jax.tree.leaves(row)):
        return
    try:
        layout.check_tree(row, "params (one worker's row)", "the optimizer state")
    except ValueError as err:
        raise ValueError(
            "reset_compression takes the params in the worker layout of the saved run (every "
            "worker's copy: each leaf with a leading axis of the old worker count, as saved), "
            f"and one worker's row of these is not the optimizer's tree: {err}"
        ) from None


def reset_compression(
    params: Any,
    opt_state: Any,
    fresh_state: Any,
    sharding: jax.sharding.Sharding | None = None,
) -> tuple[Any, Any]:
    r"""Moves a restored worker-layout state to another worker count, resetting compression.

    The explicit opt-in for restoring onto another number of workers. From the state of ``N``
    workers (restored for ``N``), each of the ``M`` new workers gets::

        params     <- xbar         the last synchronised point (0/1 Adam's anchor, equal on all
                                   workers; before local steps, worker 0's params, which all
                                   workers share); the local steps since the last sync are dropped
        lr_sum     <- 0
        m          <- mean_i m_i   equal on all workers, except during local steps
        e_w, e_s   <- 0            fresh error buffers, shaped as in ``fresh_state``
        the rest   <- worker 0's   counters, v, other transforms' states: equal on all workers
                                   (per-worker diagnostics, e.g. dropped_local_grads: worker 0's),
                                   except the inner state of a local_step_sync around a plain
                                   optax optimizer (DiLoCo's AdamW moments), which is each
                                   worker's own: worker 0's is kept, not the mean

    Flat buffers are re-laid out for ``M`` workers. Counters and schedules carry on where they
    were. The continuation is not bit-identical to any uninterrupted run: the residuals the old
    workers had not yet transmitted are dropped (as DeepSpeed does on every load), which costs at
    most the error of one compression round.

    Args:
      params: parameters in the worker layout of the saved run (leading axis ``N``).
      opt_state: the matching optimizer state, restored for ``N`` workers.
      fresh_state: this run's optimizer state as ``init`` makes it for ``M`` workers, in the
        worker layout (the state you would otherwise restore into). It supplies ``M`` and the
        shape and placement of every buffer. One worker's trees (an optimizer built with
        ``axis_name=None``, no worker axis) are taken as they are, for ``params`` and
        ``opt_state`` or for ``fresh_state`` (then the result is one worker's too).
      sharding: where to put the params (default: where ``fresh_state``'s first leaf is, e.g.
        ``NamedSharding(mesh, P(axis_name))``).

    In a job of several processes every process calls it with the same arguments: a restored
    ``params`` or ``opt_state`` that spans other processes' devices is gathered to each host
    (every old worker's copy, as in one process), and ``fresh_state`` is read where this
    process holds it.

    Returns:
      ``(params, opt_state)`` in the worker layout for ``M`` workers.

    Example:
      >>> tx = ozo.zero_one_adam(1e-3, axis_name="w")
      >>> params = {"w": jnp.zeros(16)}
      >>> old = jax.vmap(tx.init, axis_name="w")(ozo.replicate(params, 4))  # as restored, 4 workers
      >>> fresh = jax.vmap(tx.init, axis_name="w")(ozo.replicate(params, 2))  # this run: 2
      >>> params_w, opt_state = ozo.reset_compression(ozo.replicate(params, 4), old, fresh)
      >>> worker_count((params_w, opt_state))
      2

    References:
      Lu et al., 0/1 Adam, arXiv:2202.06009; DeepSpeed's load path resets the same buffers.
    """
    return _reset(params, opt_state, fresh_state, sharding)


def _reset(
    params: Any,
    opt_state: Any,
    fresh_state: Any,
    sharding: jax.sharding.Sharding | None = None,
    shards: Any = None,
) -> tuple[Any, Any]:
    """:func:`reset_compression`; ``shards`` (from :meth:`DataParallel.reset_compression`)
    cuts the params into the model shards of a model-sharded state (``count``, ``local(params,
    s)``, ``state(state, s)``, ``synchronized_params(params, state)``); with it, the params are
    returned as one worker's tree on the host, for the caller to place."""
    if shards is None and _graph.nodes_of(opt_state, workers.ShardLocalState):
        raise ValueError(
            "reset_compression got the state of DataParallel.optimizer on a model-sharded mesh "
            "(one state per model shard, each with its own compression scales): it needs the "
            "params' shardings to cut the params into those shards. Call the new run's "
            "dp.reset_compression(params, opt_state, fresh_state) instead (the DataParallel "
            "of the mesh you resume on; its model axes must have the sizes they had)."
        )
    # moved by position: the leaves must be the tree's, and fresh_state's
    wrappers.check_leaf_keys(opt_state, fresh_state)
    if _graph.state_nodes(opt_state) and not _graph.state_nodes(fresh_state):
        raise ValueError(
            "fresh_state holds no optimizer state (the params?): pass this run's freshly "
            "initialised optimizer state third, reset_compression(params, opt_state, "
            "fresh_state), e.g. jax.vmap(tx.init, axis_name=...)(ozo.replicate(params, M)) for "
            "M workers."
        )
    # one worker's trees (axis_name=None: no worker axis) go through as one row
    if _one_worker((params, opt_state)):
        params, opt_state = workers.replicate(params, 1), workers.replicate(opt_state, 1)
    one_out = _one_worker(fresh_state)
    if one_out:
        fresh_state = workers.replicate(fresh_state, 1)
    worker_count((params, opt_state))  # the layout must be consistent before we slice it
    num_workers = worker_count(fresh_state)
    full = jax.tree.map(_on_host, opt_state)
    first = jax.tree.map(lambda x: x[0], full)
    fresh0 = jax.tree.map(_first_row, fresh_state)
    row = jax.tree.map(lambda x: _on_host(x)[0], params)
    if shards is None:
        _check_worker_params(jax.tree.map(_row_shape, params), first)
        params0 = workers.synchronized_params(row, first)
    else:
        for s in range(shards.count):
            local = shards.local(row, s)
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), local)
            try:
                _check_worker_params(shapes, shards.state(first, s))
            except ValueError as err:  # the shapes it names are one model shard's blocks
                raise ValueError(
                    f"{err} (Shapes of model shard {s}'s block of each leaf.)"
                ) from None
        params0 = shards.synchronized_params(row, first)
    state0 = Move(params0, shards)(first, full, fresh0)
    placements = [getattr(x, "sharding", None) for x in jax.tree.leaves(fresh_state)]
    leaves, treedef = jax.tree.flatten(state0)
    if treedef != jax.tree.structure(fresh_state):
        raise ValueError(
            "fresh_state must be a state of the same optimizer as opt_state (same structure).\n"
            f"  converted: {treedef}\n  fresh_state: {jax.tree.structure(fresh_state)}"
        )
    state = jax.tree.unflatten(
        treedef,
        [
            _place(np.repeat(np.asarray(x)[None], num_workers, axis=0), where)
            for x, where in zip(leaves, placements)
        ],
    )
    if one_out:
        return jax.tree.map(jnp.asarray, params0), jax.tree.map(lambda x: x[0], state)
    if shards is not None:
        return params0, state
    sharding = sharding or next((s for s in placements if s is not None), None)
    return workers.replicate(params0, num_workers, sharding), state


class Move:
    """Moves one node of a restored state to the fresh state of another worker count.

    ``Move(params)(old, every, fresh)``: ``old`` is worker 0's node, ``every`` the same node with
    every old worker's copy (a leading worker axis), ``fresh`` the node of the new state. A
    state class says how it moves in a ``moved(self, every, fresh, move)`` method (its hook;
    ``move`` is this object, for the children, and ``move.params`` the synchronised point the
    new workers start from); a class without one moves field by field, and a leaf keeps worker
    0's value. This module knows no state class.
    """

    def __init__(self, params: Any, shards: Any = None):
        self.params = params
        # how to cut ``params`` into the model shards of a model-sharded state (None: no such
        # state expected); read by that state's hook
        self.shards = shards

    def __call__(self, old: Any, every: Any, fresh: Any) -> Any:
        if hasattr(fresh, "_fields") and type(old) is not type(fresh):
            raise ValueError(
                "fresh_state is not a state of the same optimizer as opt_state (a "
                f"{type(fresh).__name__} where the restored state has {type(old).__name__})."
            )
        hook = getattr(fresh, "moved", None)
        if callable(hook) and type(old) is type(fresh):
            return old.moved(every, fresh, self)
        if hasattr(fresh, "_fields"):
            return type(fresh)(*(self(o, e, f) for o, e, f in zip(old, every, fresh)))
        if isinstance(fresh, tuple | list) and not hasattr(fresh, "shape"):
            if not isinstance(old, tuple | list) or len(old) != len(fresh):
                raise ValueError("fresh_state is not a state of the same optimizer as opt_state.")
            return type(fresh)(self(o, e, f) for o, e, f in zip(old, every, fresh))
        if isinstance(fresh, dict):
            return {key: self(old[key], every[key], fresh[key]) for key in fresh}
        if hasattr(type(fresh), "tree_unflatten") and not hasattr(fresh, "shape"):
            raise ValueError("fresh_state is not a state of the same optimizer as opt_state.")
        return old

    def worker_mean(self, every: Any, fresh: Any) -> Any:
        """The mean over the old workers of ``every`` (e.g. momenta), moved like ``fresh``."""
        mean = jax.tree.map(_worker_mean, every)
        return self(mean, mean, fresh)


def _on_host(x: Any) -> np.ndarray:
    """Every row of ``x`` on this host: an array that spans other processes' devices is
    gathered (a collective: every process of a multi-process job calls reset_compression)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _first_row(x: Any) -> np.ndarray:
    """Row 0 of a fresh state's leaf, read where this process holds it: every worker's row of
    a state as ``init`` makes it is the same (no collective, nor the whole state on the host)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        block = x.addressable_shards[0].data
        if block.shape[1:] != x.shape[1:]:  # a model-sharded row: gathered (every process calls)
            return _on_host(x)[0]
        x = block
    return np.asarray(x)[0]


def _place(x: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
    return jax.device_put(x, sharding) if sharding is not None else jnp.asarray(x)


def _worker_mean(x: Any) -> np.ndarray:
    x = np.asarray(x)
    return x.mean(axis=0, dtype=np.float64).astype(x.dtype)
