"""Wrappers around whole transforms: one flat buffer per worker, and skipping non-finite steps.

- :func:`flatten` runs a transform on the worker-major flat layout (``docs/design.md``, "The
  flat layout"), converting once on the way in and once on the way out, so that the compiled
  program does not grow with the number of leaves. ``optax.flatten`` is the precedent.
- :func:`skip_not_finite` keeps a step only if its update is finite, for transforms that
  communicate on every step (1-bit Adam); ``optax.apply_if_finite`` is the single-device
  precedent.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_zero_one.core import _checks, _cut, _graph
from optax_zero_one.core import collective as collective_lib  # `collective` names the backend
from optax_zero_one.core.comm import Comm, check_mask_fits
from optax_zero_one.core.flat import (
    FlatTree,
    Layout,
    compute_dtype,
    cut_leaves,
    find_layout,
    leaf_keys,
    leaf_offsets,
    to_flat,
)


class FlattenState(NamedTuple):
    """State of :func:`flatten`.

    Attributes:
      offsets: the first column of each leaf in the flat buffers, int32 ``(leaves,)`` (one
        array whatever the leaf count, so that the state's structure does not depend on the
        params' and ``optax.tree_map_params`` works). They never change, and ``update`` no
        longer reads them: it takes the same numbers from the layout, in the form the backend
        compiles best (``_graph.cut_offsets``: on XLA:CPU behind an optimisation barrier, each
        handed to its cut as a value of its own, so that XLA compiles one kernel per leaf
        *shape* rather than one per leaf; elsewhere folded constants; ``docs/design.md``).
        Read from the state, they were batched wherever the state is (``dp.jit``'s programs
        vmap each device's block), and XLA:CPU then cut two buffers at one batched offset with
        gathers. Kept in the state so that its structure, and saved checkpoints, stay as they
        were.
      inner_state: the state of the wrapped transform, over :class:`FlatTree` values.
      leaf_keys: a fingerprint of each leaf's path and shape, int32 ``(leaves,)``
        (:func:`~optax_zero_one.core.flat.leaf_keys`). A checkpoint restores the flat buffers
        by position, with no names; :func:`check_leaf_keys` compares these, as saved, with the
        tree the state is restored for, so that a renamed or reshaped leaf is refused instead
        of receiving another leaf's moments.
    """

    KEEPS_BUFFERS = True  # its transform keeps its buffers on a skipped step
    INNER_FIELDS = ("inner_state",)  # the inner transform's state

    offsets: jax.Array
    inner_state: optax.OptState
    leaf_keys: jax.Array

    def moved(self, every: Any, fresh: FlattenState, move: Any) -> FlattenState:
        """To another worker count: the fresh layout's offsets, the inner state moved."""
        inner = move(self.inner_state, every.inner_state, fresh.inner_state)
        return FlattenState(fresh.offsets, inner, fresh.leaf_keys)


def flatten(
    inner: optax.GradientTransformation,
    axis_name: str | None = None,
    num_workers: int | tuple[int, int] | None = None,
    *,
    fast_axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Runs ``inner`` on the whole tree as one flat buffer per worker (like ``optax.flatten``).

    On the way in, the updates (and the params, when given) become :class:`FlatTree`\ s in the
    worker-major layout for the ``N`` workers of ``axis_name``; ``inner`` sees those, and its
    state holds flat buffers too; on the way out the updates are cut back into the tree, in the
    params' dtypes (the updates' when no params are given). Elementwise transforms are
    unaffected; the compressed mean (:func:`~optax_zero_one.onebit_mean` and the transforms
    built on it) reads the leaf boundaries from the layout, so per-leaf scales and padding are
    exactly those of the unflattened tree. What changes is the program: a handful of operations
    on a few large buffers, whatever the number of leaves. A transform that looks at a leaf's
    shape or norm (``optax.lamb``'s trust ratios, ``optax.clip_by_block_rms``, a callable mask
    such as ``optax.adamw(..., mask=lambda p: ...)``, which receives the flat buffer) sees one
    flat buffer instead and computes something else, without an error; a mask or label *tree*
    (``optax.masked``, ``optax.multi_transform``, ``adamw(mask=tree)``) fails with optax's
    pytree-structure error; ``optax.contrib.muon`` and ``optax.adafactor`` are refused at
    ``init``. Keep all of these outside ``flatten`` (``flatten`` the optimizer inside each part
    of a ``multi_transform``, not around it). So is one that writes the
    layout's zero padding (``optax.add_noise``) before a norm over the buffer (a global-norm
    clip then counts the noise there too), and ``jax.grad`` through a square root of a
    zero second moment (Adam's, as in plain optax at an exact zero) is NaN at the padding,
    which a global norm's derivative spreads to every element.

    Args:
      inner: the transformation to run on flat buffers.
      axis_name: the worker axis the layout is made for (``None``: one worker).
      num_workers: needed only when ``init`` runs outside the mapped context.
      fast_axis_name: the axis inside a node, for a hierarchical ``inner``: the layout is then
        made for the workers of both axes (``docs/hierarchical.md``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`FlattenState`.

    Example:
      >>> tx = ozo.flatten(optax.chain(ozo.onebit_mean("w"), optax.sgd(0.1)), axis_name="w")

    References:
      ``optax.flatten`` is the precedent (a single flat vector, no layout).
    """
    comm = Comm.of(axis_name, fast_axis_name=fast_axis_name, num_workers=num_workers)
    return flatten_over(inner, comm)


# optax states of transforms that read each leaf's own shape (Muon's orthogonalised matrices,
# Adafactor's factored moments): on one flat buffer they compute something else, silently
_SHAPE_READERS = tuple(
    cls
    for cls in (getattr(optax.contrib, "MuonState", None), getattr(optax, "FactoredState", None))
    if cls is not None
)


def _refuse_shape_readers(inner_state: Any) -> None:
    found = _graph.nodes_of(inner_state, _SHAPE_READERS) if _SHAPE_READERS else []
    if found:
        raise ValueError(
            f"flatten runs its inner transform on one flat buffer, but the inner transform "
            f"holds a {type(found[0]).__name__}: optax.contrib.muon and optax.adafactor read "
            "each leaf's own shape, and on the flat buffer they compute something else (a "
            "MuLoCo run diverged). Keep them outside flatten, e.g. ozo.diloco(optax.contrib."
            "muon(...), outer, sync_every, axis_name) unflattened."
        )


def flatten_over(
    inner: optax.GradientTransformation, comm: Comm
) -> optax.GradientTransformationExtraArgs:
    """:func:`flatten` for the workers of a checked :class:`~optax_zero_one.core.comm.Comm`."""
    axes = comm.axes
    inner = _checks.check_transformation("inner", inner, optional=False)

    def init_fn(params: optax.Params) -> FlattenState:
        _checks.check_float_leaves(params, "params")
        workers = comm.init_workers(params)
        layout = Layout.of(params, workers)
        inner_state = inner.init(to_flat(params, layout))
        _refuse_shape_readers(inner_state)
        if _checks.is_placeholder(params):
            inner_state = _flat_buffers_as_leaves(inner_state)
        state = FlattenState(leaf_offsets(layout), inner_state, jnp.asarray(leaf_keys(layout)))
        return _graph.worker_state(state, axes)

    def update_fn(updates: Any, state: FlattenState, params: Any, **extra_args: Any) -> Any:
        workers = comm.update_workers(updates)
        stored = find_layout(state.inner_state)
        if stored is not None:
            stored.check_tree(updates, "updates", "the optimizer state")
            if params is not None:
                stored.check_tree(params, "params", "the optimizer state")
        layout = Layout.of(updates, workers)
        if stored is not None:
            layout.check(stored, "The optimizer state")
        _checks.check_float_leaves(updates, "updates")
        if params is not None and len(jax.tree.leaves(params)) != len(jax.tree.leaves(updates)):
            _checks.check_tree_matches(params, updates, "params", "updates")
        dtype = compute_dtype(updates if params is None else params)
        flat_params = None if params is None else to_flat(params, layout, dtype)

        def run(flat_in: FlatTree, inner_state: Any, flat_params: Any) -> tuple:
            out, inner_state = inner.update(flat_in, inner_state, flat_params, **extra_args)
            return out.buffer, inner_state

        # the updates' structure, the params' dtypes
        dtypes = jax.tree.unflatten(
            jax.tree.structure(updates),
            [jnp.result_type(x) for x in jax.tree.leaves(updates if params is None else params)],
        )
        # from the layout, never batched (FlattenState.offsets); their form by backend
        offsets = _graph.cut_offsets(np.asarray(layout.starts))
        # each leaf's cut takes the slices of the last elementwise stage's inputs (_cut)
        out, inner_state = _cut.call_and_cut(
            run,
            (to_flat(updates, layout, dtype), state.inner_state, flat_params),
            lambda take: cut_leaves(take, layout, offsets, dtypes),
        )
        return out, state._replace(inner_state=inner_state)

    return _checks.transformation(init_fn, update_fn, FlattenState, "this optimizer")


def check_leaf_keys(state: Any, fresh: Any = None) -> None:
    """Raises ``ValueError`` if a :class:`FlattenState` in ``state`` holds leaves saved for
    another tree than its layout's, or than ``fresh``'s (one small read per such state).

    A checkpoint restores the flat buffers by position: restored into the state of a tree whose
    leaves were renamed (so that they sort in another order) or reshaped, each leaf's moments,
    anchor and error buffers would land on another leaf, silently (``optax.adam``'s restore
    fails on the names instead). The state keeps a fingerprint of each leaf's path and shape
    from its ``init``; the restore brings the saved ones, the layout is the tree's now.

    Args:
      state: a restored optimizer state (concrete arrays).
      fresh: another state of the same optimizer (``reset_compression``'s ``fresh_state``,
        for another worker count) whose leaves must be those of ``state``, if any.
    """
    nodes = _graph.nodes_of(state, FlattenState)
    others = None if fresh is None else _graph.nodes_of(fresh, FlattenState)
    for i, node in enumerate(nodes):
        layout = find_layout(node.inner_state)
        if layout is None or not layout.paths:
            continue
        saved = _saved_keys(node.leaf_keys, len(layout.paths))
        _refuse_other_leaves(
            saved, layout, "The optimizer state was saved for another parameter tree"
        )
        if others is not None and i < len(others):
            theirs = find_layout(others[i].inner_state)
            if theirs is not None and theirs.paths:
                what = "fresh_state was made for another parameter tree than opt_state"
                _refuse_other_leaves(saved, theirs, what)


def _saved_keys(keys: Any, count: int) -> np.ndarray:
    if isinstance(keys, jax.ShapeDtypeStruct):
        raise ValueError(
            "The optimizer state's leaf_keys hold no values (a ShapeDtypeStruct), as a "
            "checkpoint written before the state kept them (code before the CHANGELOG's leaf_keys "
            "entry; its version string, 0.2.0, is the same) "
            "restored with partial_restore=True leaves them. If the params tree is the one it "
            "was saved with, take them from the state you restored into, initialised (the same "
            "optimizer, for the saved worker count): restored = jax.tree.map(lambda r, f: f if "
            "isinstance(r, jax.ShapeDtypeStruct) else r, restored, target) "
            "(docs/reliability.md)."
        )
    if isinstance(keys, jax.core.Tracer) or not hasattr(keys, "__array__"):
        raise ValueError(
            "The restore check reads the optimizer state's values: call it on the restored "
            f"state itself, outside jit (its leaf_keys are {type(keys).__name__})."
        )
    return _graph.first_values(keys, count)


def _refuse_other_leaves(saved: np.ndarray, layout: Layout, what: str) -> None:
    want = leaf_keys(layout)
    count = want.size
    if saved.shape == want.shape and np.array_equal(saved, want):
        return
    moved = [i for i in range(count) if i >= saved.size or saved[i] != want[i]]
    names = ", ".join(f"{layout.paths[i]} {layout.shapes[i]}" for i in moved[:6])
    more = f" and {len(moved) - 6} more" if len(moved) > 6 else ""
    raise ValueError(
        f"{what}: at {len(moved)} of its {count} leaf positions the "
        f"saved leaf's name or shape is not that of this tree's leaf there ({names}{more}; "
        "shapes as the optimizer sees them: on a model-sharded mesh, each device's piece). A "
        "checkpoint restores the flat buffers by position, not by name, so each of these "
        "leaves would get another leaf's moments (and anchor and error buffers). Restore with "
        "the params tree the state was saved with (the same leaf names and shapes), or, to go "
        "on with this tree, start the optimizer afresh from the restored params "
        "(tx.init(params)): the moments are lost, the params kept."
    )


def _flat_buffers_as_leaves(state: Any) -> Any:
    """``state`` with every :class:`FlatTree` replaced by a plain leaf.

    What ``init`` returns for a tree without parameters, as ``optax.tree_map_params`` calls it
    (with a placeholder for the params): the flat buffers then stand in the state's structure as
    leaves, which are not the placeholder, so that ``tree_map_params`` hands each real buffer
    to ``transform_non_params``. A flat buffer holds every leaf of the params at once (in the
    worker-major layout); it is not one of them (``docs/jit.md``, "Sharding the state")."""
    return jax.tree.map(
        lambda x: jnp.zeros([], jnp.int32) if isinstance(x, FlatTree) else x,
        state,
        is_leaf=lambda x: isinstance(x, FlatTree),
    )


class SkipNotFiniteState(NamedTuple):
    """State of :func:`skip_not_finite`.

    Attributes:
      skipped_updates: int32, the steps skipped because the update was not finite (a refused
        ``step_kind`` hint of the inner transform too: :func:`~optax_zero_one.check_hints`).
      inner_state: the wrapped transform's state (unchanged by a skipped step).
    """

    KEEPS_BUFFERS = True  # its transform keeps its buffers on a skipped step
    INNER_FIELDS = ("inner_state",)  # the inner transform's state

    skipped_updates: jax.Array
    inner_state: optax.OptState


def skip_not_finite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` and keeps its result only if the update is finite.

    ::

        u, s' = inner(g, s)
        finite:      return u, s'
        otherwise:   return 0, s        (skipped_updates += 1)

    Every worker skips together if ``inner`` averages across workers before producing ``u``
    (a non-finite value then reaches every worker); wrap only such transforms. The wrapper
    restores every counter of the inner state. This library's transforms keep their own buffers
    on a bad step (their states declare ``KEEPS_BUFFERS``); the buffers of any other state in
    ``inner`` (e.g. ``optax.adam``'s moments) are restored by the wrapper, at the cost of a
    select over them on every step (:func:`~optax_zero_one.core._graph.restore_skipped`).

    Args:
      inner: the transformation to guard.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`SkipNotFiniteState`.

    Example:
      >>> policy = ozo.VarianceDoubling(freeze_step=100)
      >>> tx = skip_not_finite(optax.chain(ozo.scheduled_mean("w", policy), optax.sgd(0.1)))
    """

    inner = _checks.check_transformation("inner", inner, optional=False)

    def init_fn(params: optax.Params) -> SkipNotFiniteState:
        return SkipNotFiniteState(jnp.zeros([], jnp.int32), inner.init(params))

    def update_fn(updates: Any, state: SkipNotFiniteState, params: Any, **extra_args: Any) -> Any:
        step, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        finite = _graph.finite_or_skipped(step, inner_state, state.inner_state)
        kept = SkipNotFiniteState(state.skipped_updates, inner_state)
        skipped = SkipNotFiniteState(state.skipped_updates + 1, state.inner_state)
        return _graph.zero_unless(finite, step), _graph.restore_skipped(finite, kept, skipped)

    return _checks.transformation(init_fn, update_fn, SkipNotFiniteState, "skip_not_finite")


def decayed_weights(
    weight_decay: Any, optimizer: str, mask: Any = None
) -> optax.GradientTransformationExtraArgs:
    """``optax.add_decayed_weights(weight_decay)``, an identity for a static ``0.0``.

    Its state is ``optax.EmptyState()`` for a number or an array, so that an optimizer's state
    has the same structure with a float ``weight_decay`` and under ``optax.inject_hyperparams``
    (where it is an array); a schedule of the count keeps optax's ``WeightDecaySchedule``
    counter. A non-zero decay without params gets an error naming ``optimizer``. ``mask``, a
    tree of 0/1 like the params (per leaf or per element), says which parameters decay
    (``optax.adamw``'s ``mask``); the params, flat or a tree, are multiplied by it first, so the
    state is the same with and without one.
    """
    _checks.check_weight_decay(weight_decay)
    _checks.check_mask(mask, mask, "weight_decay_mask")  # a function is refused now
    if _checks.is_static_number(weight_decay) and weight_decay == 0:
        return optax.with_extra_args_support(optax.identity())
    inner = optax.add_decayed_weights(weight_decay)

    def init_fn(params: Any) -> Any:
        check_mask_fits(mask, params, "weight_decay_mask")
        return inner.init(params)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        if params is None:
            raise ValueError(
                f"{optimizer} with weight_decay needs params: update(grads, state, params)."
            )
        if mask is not None and isinstance(params, FlatTree):
            dtype = params.buffer.dtype
            params = collective_lib.apply_mask(
                collective_lib.flat_mask(mask, params.layout, dtype), params
            )
        elif mask is not None:
            params = jax.tree.map(lambda m, x: x * jnp.asarray(m, x.dtype), mask, params)
        return inner.update(updates, state, params)

    return _checks.standard_transformation(init_fn, update_fn)
