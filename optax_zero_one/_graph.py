"""Graph-level tricks the transforms share: zero-or-one-trip loops, ``shard_map`` typing, and the
finiteness checks (``docs/design.md``, "Why the step kinds are loops").

Everything here exists for speed or for ``shard_map``'s type check, not for semantics:

- :func:`run_if` runs a step kind only where it applies, without copying the buffers it does
  not touch (a ``lax.cond`` branch copies every buffer it passes through on XLA:CPU; measured).
- :func:`vary_over` / :func:`worker_state` type values as varying over the manual mesh axes so
  that a state made by ``init`` and one returned by ``update`` have the same type (``optax``'s
  wrappers, e.g. ``MultiSteps``, put the two in one ``lax.cond``).
- :func:`all_finite`, :func:`restore_scalars` and :func:`zero_if` are the non-finite handling: a
  check that costs one reduction, and restores that cost nothing on a finite step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def all_static(*values: Any) -> bool:
    """True if every value is a Python/NumPy bool or int (known at trace time)."""
    return all(isinstance(v, bool | int | np.bool_ | np.integer) for v in values)


def both(a: Any, b: Any) -> Any:
    """``a and b`` for Python bools (a pinned step), ``logical_and`` for traced ones."""
    return bool(a and b) if all_static(a, b) else jnp.logical_and(a, b)


def negate(a: Any) -> Any:
    """``not a`` for a Python bool (a pinned step), ``logical_not`` for a traced one."""
    return (not a) if all_static(a) else jnp.logical_not(a)


def varying_axes(x: Any) -> frozenset:
    """The mesh axes ``x`` is typed as varying over (``shard_map``); empty elsewhere."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return getattr(manual, "varying", frozenset())


def vary_over(x: jax.Array, axes: frozenset) -> jax.Array:
    """``x`` typed as varying over ``axes`` too (``shard_map``'s check; a no-op elsewhere)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def worker_axes(axis_name: str | None) -> frozenset:
    """The manual mesh axes a per-worker value varies over: ``{axis_name}`` inside
    ``shard_map`` (and ``pmap``, which is built on it), nothing under ``vmap`` or unbound."""
    if axis_name is None:
        return frozenset()
    try:
        return varying_axes(jax.lax.axis_index(axis_name))
    except NameError:
        return frozenset()


def worker_state(state: Any, axis_name: str | None) -> Any:
    """Types every array of an optimizer state as per worker (varying over ``axis_name``).

    ``init`` builds the state from constants, which ``shard_map`` types as replicated; after one
    ``update`` it mixes in per-worker values and is varying. Typing it as varying from the start
    makes the two agree, so that ``optax.MultiSteps`` and other wrappers that hold both in one
    ``lax.cond`` work under ``shard_map``.
    """
    axes = worker_axes(axis_name)
    if not axes:
        return state
    return jax.tree.map(lambda x: vary_over(jnp.asarray(x), axes), state)


def nodes_of(tree: Any, cls: type) -> list:
    """The nodes of ``tree`` that are instances of ``cls`` (e.g. a transform's state in a chain)."""
    nodes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, cls))
    return [node for node in nodes if isinstance(node, cls)]


def only_node(tree: Any, cls: type, where: str) -> Any:
    """The one node of ``tree`` that is a ``cls``; ``ValueError`` naming ``where`` otherwise."""
    found = nodes_of(tree, cls)
    if len(found) != 1:
        raise ValueError(
            f"{where} needs exactly one {cls.__name__} in the state, found {len(found)}."
        )
    return found[0]


def run_if(pred: Any, fn: Any, carry: Any, like: Any = ()) -> Any:
    """``fn(carry)`` where ``pred`` holds, else ``carry``, updating ``carry``'s buffers in place.

    A Python bool traces only the side taken (a state pinned to one step kind compiles that
    kind alone). A traced ``pred`` becomes a ``while_loop`` of zero or one trip rather than a
    ``lax.cond``: XLA copies every buffer that a conditional's branch passes through unchanged
    (measured on CPU: a pass-through branch costs as much as one elementwise pass over the
    buffers), while a loop that does not run leaves its carry where it is.

    Args:
      pred: a scalar bool, identical on the workers (a Python bool, or a traced one).
      fn: maps ``carry`` to a tree of the same structure, shapes and dtypes. Pass everything
        ``fn`` reads in ``carry`` (read-only values too): an array read from outside the loop
        is copied into it on every call.
      carry: the values to update.
      like: arrays whose ``shard_map`` varying axes the carry takes on (everything ``fn`` reads
        per worker), so that the loop's types match.
    """
    if all_static(pred):
        return fn(carry) if pred else carry
    axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves((pred, carry, like))))
    carry = jax.tree.map(lambda x: vary_over(jnp.asarray(x), axes), carry)

    def body(state: Any) -> Any:
        trip, values = state
        out = jax.tree.map(lambda x: vary_over(x, axes), fn(values))
        # The barrier keeps XLA from treating values passed through unchanged as loop
        # invariants, which it would copy into the loop on every call (measured).
        return trip + 1, jax.lax.optimization_barrier(out)

    trips = jnp.asarray(pred).astype(jnp.int32)
    return jax.lax.while_loop(lambda s: s[0] < trips, body, (jnp.zeros([], jnp.int32), carry))[1]


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool: whether every element of every leaf of ``tree`` is finite.

    Read from each leaf's sum (a NaN or an infinity anywhere makes it NaN or infinite), which
    XLA:CPU computes several times faster than ``all(isfinite(x))``; a leaf is summed as rows of
    1,024 (XLA:CPU reduces the last axis of a 2-D array ~5x faster than a long 1-D one). A
    finite leaf whose sum overflows (entries ~1e38 / size) also counts as non-finite.
    """

    def leaf_sum(x: jax.Array) -> jax.Array:
        flat = jnp.reshape(x, -1).astype(jnp.promote_types(x.dtype, jnp.float32))
        pad = -flat.size % 1024
        if flat.size > 1024:
            flat = jnp.pad(flat, (0, pad)).reshape(-1, 1024)
            return jnp.sum(jnp.sum(flat, axis=-1))
        return jnp.sum(flat)

    sums = [jnp.isfinite(leaf_sum(x)) for x in jax.tree.leaves(tree) if jnp.size(x)]
    return jnp.stack(sums).all() if sums else jnp.ones([], bool)


def check_finite_if(pred: Any, tree: Any, finite: Any = True) -> tuple[Any, Any]:
    """``(tree, all_finite(tree))`` where ``pred`` holds, else ``(tree, finite)``: the check (one
    reduction over ``tree``) runs only on the steps that need it."""

    def check(carry: Any) -> Any:
        return carry[0], all_finite(carry[0])

    return run_if(pred, check, (tree, finite), like=tree)


def keep_if_finite(finite: Any, step: Any, new_state: Any, skipped_state: Any) -> tuple[Any, Any]:
    """A step's ``(update, state)``, or, where ``finite`` is false, a zero update and the state
    with every scalar taken from ``skipped_state`` (:func:`restore_scalars`; the buffers were
    kept by the transforms that own them)."""
    step = jax.tree.map(lambda d: jnp.where(finite, d, jnp.zeros_like(d)), step)
    return step, restore_scalars(finite, new_state, skipped_state)


def restore_scalars(ok: Any, new: Any, old: Any) -> Any:
    """``new`` with every scalar leaf (counters, flags) taken from ``old`` where ``ok`` is false.

    How a skipped step keeps a whole state unchanged at no cost: the buffers are kept by the
    transforms that own them, which know the step is bad *before* they write (a select in the
    pass that writes them anyway); the scalars, which cost nothing to select afterwards, are
    restored here, including those of transforms that do not know about skipping (e.g. the count
    of ``optax.scale_by_learning_rate``). Restoring a buffer after the fact would cost a full
    pass over it, and keeping both versions alive, on every step (measured: ~6x an Adam step).
    """
    if all_static(ok):
        return new if ok else jax.tree.map(lambda n, o: o if jnp.ndim(n) == 0 else n, new, old)
    return jax.tree.map(
        lambda n, o: (
            jnp.where(ok, n, jnp.asarray(o, jnp.result_type(n))) if jnp.ndim(n) == 0 else n
        ),
        new,
        old,
    )


def zero_if(bad: Any, tree: Any, like: Any = ()) -> Any:
    """``tree`` zeroed where ``bad`` holds: a loop that runs only then (e.g. error buffers that a
    non-finite step filled with NaN, or a gradient that is dropped).

    The zeros are computed from the values and from a zero that travels in the loop, never
    broadcast from a constant: XLA hoists a broadcast constant out of the loop and would then
    fill a buffer with zeros on every call, whether the loop runs or not (measured).
    """

    def zeros(carry: Any) -> Any:
        values, zero = carry
        return jax.tree.map(lambda x: jnp.where(jnp.isfinite(x), x * 0, zero), values), zero

    return run_if(bad, zeros, (tree, jnp.zeros([], jnp.float32)), like=like)[0]
