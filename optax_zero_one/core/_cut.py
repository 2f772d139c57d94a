"""Cut a flat buffer into leaves *before* its last elementwise stage (``docs/design.md``, "The
flat layout").

A transform run on flat buffers (:func:`~optax_zero_one.flatten`) ends with elementwise
arithmetic on whole buffers, e.g. Adam's direction ``m / (sqrt(v) + eps)`` scaled by the
learning rate, and the wrapper then cuts the result into the parameter leaves. XLA does not
duplicate a division or a square root into several consumers, so the direction is written
out whole and read again by every leaf's cut: two passes over the tree that the algorithm does
not need (measured on XLA:CPU: 4.2M parameters, local step 8.0 ms with the direction
materialised against 5.0 ms without, docs/benchmarks/overhead.md).

:func:`call_and_cut` traces the call to a jaxpr, finds the buffer's elementwise tail (the
operations that only feed it), runs the rest without it and replays the tail on each leaf's
slices of its inputs. Elementwise operations give the same bits on a slice as on the whole, so
the result is unchanged; the compiled program then fuses each leaf's tail into its cut (and
into ``optax.apply_updates`` after it). Anything this module does not recognise stays where it
was: the tail is then shorter, at worst empty (the plain cut).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

# Operations with one output whose every element depends on the same element of each operand
# (or on a scalar operand): the same bits on a slice as on the whole buffer.
# fmt: off
_ELEMENTWISE = frozenset({
    "abs", "add", "and", "convert_element_type", "copy", "div", "eq", "exp", "expm1", "ge", "gt",
    "integer_pow", "is_finite", "le", "log", "log1p", "lt", "max", "min", "mul", "ne", "neg",
    "not", "or", "pow", "rsqrt", "select_n", "sign", "sqrt", "square", "sub",
    # shard_map's type casts (a value marked as varying over mesh axes): no arithmetic at all
    "pvary", "pcast",
})
# fmt: on
_CALLS = frozenset({"jit", "pjit", "closed_call"})  # a nested jaxpr: its tail is replayed inside


def call_and_cut(
    fn: Callable[..., tuple[jax.Array, Any]],
    args: tuple,
    cut: Callable[[Callable[[Any, int], jax.Array]], Any],
) -> tuple[Any, Any]:
    """``buffer, rest = fn(*args)``; returns ``(cut(take), rest)``.

    ``buffer`` is ``(N, C)``; ``cut`` receives ``take(start, width)``, which returns the columns
    ``[start, start + width)`` of ``buffer`` (``start`` may be traced, never negative), computed
    from the same columns of the tail's inputs. ``cut`` calls it once per leaf.
    """
    leaves, in_tree = jax.tree.flatten(args)
    rest_tree: list = []

    def flat_fn(*xs: Any) -> list:
        buffer, rest = fn(*jax.tree.unflatten(in_tree, xs))
        out, tree = jax.tree.flatten(rest)
        rest_tree[:] = [tree]
        return [buffer, *out]

    closed = jax.make_jaxpr(flat_fn)(*leaves)
    jaxpr = closed.jaxpr
    tail, frontier = _tail_of(jaxpr)
    replayed = {id(eqn) for eqn in tail}
    kept = jaxpr.outvars if not tail else jaxpr.outvars[1:]
    rest_of = jaxpr.replace(
        eqns=[eqn for eqn in jaxpr.eqns if id(eqn) not in replayed],
        outvars=[*kept, *frontier],
    )
    values = jex.jaxpr_as_fun(jex.ClosedJaxpr(rest_of, closed.consts))(*leaves)
    if not tail:
        buffer, *out = values
        taken = functools.partial(_columns, buffer)
        return cut(taken), rest_tree[0].unflatten(out)
    out, inputs = values[: len(kept)], values[len(kept) :]
    whole = jaxpr.outvars[0].aval.shape

    # One traced function for all leaves: a leaf's tail is traced once per width (leaves of
    # one shape share it), and each call is one operation in the caller's trace.
    @functools.partial(jax.jit, static_argnums=0)
    def columns(width: int, start: Any, *values: Any) -> jax.Array:
        env = {
            v: _columns(x, start, width) if jnp.shape(x) == whole else x
            for v, x in zip(frontier, values)
        }
        return _replay(tail, env, jaxpr.outvars[0], (*whole[:-1], width))

    return (
        cut(lambda start, width: columns(width, start, *inputs)),
        rest_tree[0].unflatten(out),
    )


def _columns(x: jax.Array, start: Any, width: int) -> jax.Array:
    # offsets are never negative: no index normalisation in the cut's kernel
    return jax.lax.dynamic_slice_in_dim(x, start, width, axis=1, allow_negative_indices=False)


def _tail_of(jaxpr: Any) -> tuple[list, list]:
    """The equations that only feed ``jaxpr``'s first output, elementwise, in order, and the
    variables they read from outside (the frontier)."""
    target = jaxpr.outvars[0]
    if not isinstance(target, jex.Var) or sum(v is target for v in jaxpr.outvars) != 1:
        return [], []
    whole = target.aval.shape
    users: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jex.Var):
                users[v] = users.get(v, 0) + 1
    for v in jaxpr.outvars:
        if isinstance(v, jex.Var):
            users[v] = users.get(v, 0) + 1
    owned = {target: 1}  # uses of a variable from inside the tail (the target: the output)
    tail = []
    for eqn in reversed(jaxpr.eqns):
        if len(eqn.outvars) != 1:
            continue
        out = eqn.outvars[0]
        if out not in owned or owned[out] != users.get(out, 0):
            continue
        if not _replayable(eqn, whole):
            continue
        tail.append(eqn)
        for v in eqn.invars:
            if isinstance(v, jex.Var):
                owned[v] = owned.get(v, 0) + 1
    tail.reverse()
    made = {eqn.outvars[0] for eqn in tail}
    frontier, seen = [], set()
    for eqn in tail:
        for v in eqn.invars:
            if isinstance(v, jex.Var) and v not in made and v not in seen:
                seen.add(v)
                frontier.append(v)
    return tail, frontier


def _replayable(eqn: Any, whole: tuple) -> bool:
    """An equation whose one output is shaped like the buffer, computed elementwise from
    operands shaped like it or scalars (a nested call: one output, scalar constants, and every
    equation inside such; a second output or a buffer-shaped constant would not be sliced)."""
    if len(eqn.outvars) != 1 or eqn.outvars[0].aval.shape != whole:
        return False
    if any(jnp.shape(v.aval) not in (whole, ()) for v in eqn.invars):
        return False
    name = eqn.primitive.name
    if name in _CALLS:
        inner = _called(eqn)
        return (
            inner is not None
            and len(inner.jaxpr.outvars) == 1
            and all(jnp.shape(c) == () for c in inner.consts)
            and all(_replayable(e, whole) or _scalar_only(e) for e in inner.jaxpr.eqns)
        )
    return name in _ELEMENTWISE or _scalar_broadcast(eqn, whole)


def _called(eqn: Any) -> Any:
    """The closed jaxpr a call equation (``jit``, ``closed_call``) runs, ``None`` if it holds
    no closed jaxpr (then it is not replayed)."""
    inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    return inner if isinstance(inner, jex.ClosedJaxpr) else None


def _scalar_broadcast(eqn: Any, whole: tuple) -> bool:
    return (
        eqn.primitive.name == "broadcast_in_dim"
        and eqn.outvars[0].aval.shape == whole
        and jnp.shape(eqn.invars[0].aval) == ()
    )


def _scalar_only(eqn: Any) -> bool:
    """Arithmetic on scalars inside a nested call (e.g. a dtype conversion of a constant)."""
    return all(jnp.shape(v.aval) == () for v in [*eqn.invars, *eqn.outvars])


def _replay(eqns: list, env: dict, target: Any, shape: tuple) -> jax.Array:
    """Runs ``eqns`` on the slices in ``env`` (variable -> value), each slice of ``shape``, and
    returns ``target``'s value."""

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    for eqn in eqns:
        args = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _CALLS:
            inner = _called(eqn)
            sub = dict(zip(inner.jaxpr.constvars, inner.consts))
            sub.update(zip(inner.jaxpr.invars, args))
            out = _replay(inner.jaxpr.eqns, sub, inner.jaxpr.outvars[0], shape)
        elif name == "broadcast_in_dim" and jnp.ndim(args[0]) == 0 and eqn.outvars[0].aval.ndim:
            out = jnp.broadcast_to(args[0], shape).astype(eqn.outvars[0].aval.dtype)
        else:
            out = eqn.primitive.bind(*args, **eqn.params)
        env[eqn.outvars[0]] = out
    return read(target)
