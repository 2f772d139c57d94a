"""What the transforms share about the compiled graph: the one in-graph conditional, ``shard_map``
typing, the finiteness checks and the counters of a state (``docs/design.md``, "Step kinds").

- :func:`switch` is the only conditional the transforms use. A step's kind is normally known on
  the host and passed as a static hint (``step_kind=``), so a program traces one kind and holds no
  conditional at all; :func:`switch` is the path *without* the hint, for users who jit
  ``tx.update`` themselves and let the graph decide.
- :func:`vary_over` / :func:`worker_state` type values as varying over the manual mesh axes so
  that a state made by ``init`` and one returned by ``update`` have the same type (``optax``'s
  wrappers, e.g. ``MultiSteps``, put the two in one ``lax.cond``).
- :func:`all_finite`, :func:`keep_if` and :func:`restore_scalars` are the non-finite handling and
  the gate a hinted step goes through: straight-line selects that XLA fuses into the writes;
  :func:`computed_once` keeps each scalar check one value that every write reads.
- :func:`step_counter`, :func:`refusals` and :func:`shared_values` find a state's step counter,
  its records of refused hints and the values every worker holds alike through the
  ``STEP_COUNTER``, ``REFUSED_HINT`` and ``SHARED`` hooks that state classes declare, without
  knowing the classes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax
from jax.interpreters import ad, batching, mlir


def varying_axes(x: Any) -> frozenset:
    """The mesh axes ``x`` is typed as varying over (``shard_map``); empty elsewhere."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return getattr(manual, "varying", frozenset())


def vary_over(x: jax.Array, axes: frozenset) -> jax.Array:
    """``x`` typed as varying over ``axes`` too (``shard_map``'s check; a no-op elsewhere)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_like(x: jax.Array, like: Any) -> jax.Array:
    """``x`` typed as varying over the axes ``like`` varies over too (``shard_map``)."""
    return vary_over(x, varying_axes(like))


def worker_axes(axis_name: Any) -> frozenset:
    """The manual mesh axes a per-worker value varies over: the worker axes inside
    ``shard_map`` (and ``pmap``, which is built on it), nothing under ``vmap`` or unbound."""
    if axis_name is None:
        return frozenset()
    try:
        return varying_axes(jax.lax.axis_index(axis_name))
    except NameError:
        return frozenset()


def worker_state(state: Any, axis_name: Any) -> Any:
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


def backends_started(default: bool) -> bool:
    """Whether this process has started a JAX backend (``default`` where this jax cannot say).
    Nothing run before then: ``jax.distributed.initialize`` must come first."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return default


def first_values(x: Any, count: int) -> np.ndarray:
    """The first ``count`` entries of an array this process can read (a replicated or
    per-worker counter or record), without communication."""
    shards = getattr(x, "addressable_shards", None)
    if shards:
        x = shards[0].data
    return np.asarray(x).reshape(-1)[:count]


def first_leaf(tree: Any) -> Any:
    """An array of ``tree`` found without flattening it (host time each step: ~1 us through
    dicts and tuples, ~6 us through Flax NNX's State, where a flatten takes ~80 us at 100
    leaves), or None if it holds no array. Empty nodes are passed over: a chain whose first
    state is ``optax.EmptyState()`` (a clip before the optimizer) read as holding none."""
    if isinstance(tree, jax.Array):
        return tree
    if isinstance(tree, dict | list | tuple):  # a NamedTuple is a tuple
        children: Any = tree.values() if isinstance(tree, dict) else tree
    else:  # another pytree node
        try:
            children, _ = jax.tree_util.flatten_one_level(tree)
        except ValueError:  # a leaf that is not an array
            return None
    for child in children:
        found = first_leaf(child)
        if found is not None:
            return found
    return None


def first_value(x: Any) -> Any:
    """The first entry of an array this process can read (:func:`first_values`)."""
    return first_values(x, 1)[0]


def readable_values(x: Any) -> np.ndarray:
    """Every entry of an array that this process holds (all its addressable shards, flattened;
    a counter or a record is a few bytes per worker), without communication."""
    shards = getattr(x, "addressable_shards", None)
    if shards:
        return np.concatenate([np.asarray(s.data).reshape(-1) for s in shards])
    return np.asarray(x).reshape(-1)


# What a host-side reader says when it is called under a transformation (its arrays traced).
TRACED = (
    "optax_zero_one's host-side helpers (a dispatch_by_kind dispatcher, dp.jit's steps, "
    "ozo.step_kind and ozo.step_count, the workers' checks) read arrays on the host between "
    "steps: they cannot run under a JAX transformation (jax.jit, jax.grad, jax.vmap, "
    "lax.scan). Inside one, call the optimizer's update with step_kind= the kind read on the "
    "host (schedule.kind(k) for update k, numbered from 1; ozo.step_kind(opt_state, schedule) "
    "before the traced step), or without a hint to decide in the graph."
)


BATCHED_RUNS = (
    "An optimizer state's counters are equal on every worker of one run; entries that differ "
    "are independent runs batched in one state (an outer jax.vmap over seeds or learning "
    "rates), one of which skipped a step the others took (a non-finite gradient) and now "
    "counts other steps. A hinted kind is one for the whole batch, and that run refuses every "
    "hint after (its steps not applied). Run the batch without step_kind (each run decides its "
    "own kind in the graph), or make the runs skip together (grads made NaN in every run "
    "where one run's are not finite), or give each run a loop of its own (docs/usage.md, "
    "'Batching independent runs')."
)


def check_counters_agree(counter: Any, what: str) -> int:
    """The count every readable entry of ``counter`` holds; ``ValueError`` (naming ``what``) if
    the entries differ (:data:`BATCHED_RUNS`)."""
    if isinstance(counter, jax.core.Tracer):
        raise TypeError(f"{what}: " + TRACED)
    values = readable_values(counter)
    if values.size and values.min() != values.max():
        seen = sorted({int(v) for v in values})
        shown = ", ".join(str(v) for v in seen[:6]) + (", ..." if len(seen) > 6 else "")
        raise ValueError(
            f"{what}: the state's step counters differ between its entries (shape "
            f"{tuple(np.shape(counter))}, values {shown}). " + BATCHED_RUNS
        )
    return int(values[0])


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


# ---------------------------------------------------------------- the in-graph conditional


def switch(
    index: jax.Array,
    branches: Sequence[Callable[[Any], Any]],
    operand: Any,
    axis_name: Any = None,
) -> Any:
    """``branches[index](operand)``, decided in the graph: the transforms' one conditional.

    Used only where no static step kind was given (``step_kind=None``). It is ``lax.switch`` on
    every backend. The zero-or-one-trip loops of earlier versions were faster on XLA:CPU for a
    *live* program (a conditional copies the buffers its branches pass through), but they put
    loops into every transform, a loop per decision; the library's own loops now compile one
    program per kind instead, which beats both (``docs/benchmarks/overhead.md``). On GPU a
    conditional costs a predicate copy to the host per decision unless it is captured in a CUDA
    graph, one more reason to hint.

    Under ``jax.vmap`` (simulated workers) every worker holds its own copy of the counters, so
    the index would be *batched* and the conditional would become a select over every branch,
    each computed for every worker. The index is taken once for all workers instead (a ``pmax``
    over the worker axis, which under ``vmap`` communicates nothing): the conditional stays one,
    and every worker's result comes from the same code.

    Args:
      index: a scalar int32, identical on the workers of a collective (derived from counters).
      branches: functions of ``operand`` returning trees of the same structure and types.
      operand: what the branches read.
      axis_name: the worker axis (or axes) of the transform, ``None`` for one worker.
    """
    if len(branches) == 1:
        return branches[0](operand)
    if _ROWS.get():
        raise DecidedInGraph
    index = once_for_all_workers(index, axis_name)
    axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves((index, operand))))
    # shard_map's check wants every branch to return the same varying types. Inside a
    # shard_map with check_vma=False (data_parallel's per-model-shard optimizer) pcast adds
    # nothing and a new value carries no varying axes, while a value passed through keeps its
    # own: there every output becomes a new value (a select of itself, which XLA removes).
    checked = varying_axes(vary_over(jnp.zeros(()), axes)) >= axes
    typing = (lambda y: vary_over(y, axes)) if checked else _new_value

    def typed(branch: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return lambda x: jax.tree.map(lambda y: typing(jnp.asarray(y)), branch(x))

    return jax.lax.switch(index, [typed(b) for b in branches], operand)


# Whether the workers' code is being traced under jax.vmap over each device's one-row block of
# a shard_map (on_workers(..., batched=True), dp.jit with a schedule)
_ROWS: contextvars.ContextVar = contextvars.ContextVar("optax_zero_one_rows", default=False)


class DecidedInGraph(Exception):
    """Raised by :func:`switch` while :func:`rows_batched` is open: the update decides its step
    kind in the graph, which that body must not run under ``vmap``."""


def is_unbatchable_switch(err: ValueError) -> bool:
    """Whether ``err`` is JAX's error for batching a conditional of this library's switch
    inside ``shard_map`` (what :class:`DecidedInGraph` stands for where the switch was not
    traced anew: a jitted function's cached trace)."""
    return "pvary is a invariant->variant collective" in str(err)


@contextlib.contextmanager
def rows_batched() -> Iterator[None]:
    """While this is open (at trace time), :func:`switch` raises :class:`DecidedInGraph`.

    A ``shard_map`` body run under ``jax.vmap`` over each device's block of one row is for
    programs of one step kind (``step_kind=``). An update without the hint decides its kind in
    the graph; batched, its switch would be a select over every branch, which JAX 0.10 cannot
    batch inside ``shard_map`` (``pvary is a invariant->variant collective``), so the body
    catches this and runs the worker's code on the row instead."""
    token = _ROWS.set(True)
    try:
        yield
    finally:
        _ROWS.reset(token)


def _new_value(y: jax.Array) -> jax.Array:
    return jax.lax.select(jnp.full(jnp.shape(y), True), y, y)


def once_for_all_workers(x: Any, axis_name: Any) -> Any:
    """``x``, identical on every worker by construction, taken once for all of them under
    ``jax.vmap`` (a ``pmax`` over the simulated axis, which communicates nothing), so that it is
    not *batched*: a batched index makes a conditional a select over every branch. Elsewhere
    (one worker, ``shard_map`` and ``pmap`` axes) ``x`` unchanged."""
    if axis_name is None or worker_axes(axis_name):
        return x
    with contextlib.suppress(NameError):
        return jax.lax.pmax(x, axis_name)
    return x


def scalars_apart(x: jax.Array) -> list[jax.Array]:
    """The elements of a 1-D array ``x`` as separate scalars, made by one variadic reduce.

    A per-leaf cut at ``x[i]`` would read its offset through a slice of ``x`` that XLA folds
    into the cut's own kernel, so every leaf's kernel differs (by the slice) and is compiled on
    its own. Taken apart here, each offset enters its cut as a plain input, and the cuts of
    leaves of one shape are one kernel, which XLA compiles once (it merges identical fusions).
    The reduce runs over ``x`` stacked on itself (a maximum of two equal values: exact), an
    axis XLA cannot drop as it would a size-1 one. Measured on XLA:CPU, a 100-leaf GPT-2 tree
    (8 leaf shapes): the cuts compiled in 0.9 s instead of 3.4 s, step time unchanged
    (``docs/design.md``, "The flat layout")."""
    count = x.shape[0]
    if count == 0:
        return []
    pair = jnp.stack([x, x])
    low = jnp.asarray(jnp.iinfo(x.dtype).min, x.dtype)
    return list(
        jax.lax.reduce(
            [pair[:, i] for i in range(count)],
            [low] * count,
            lambda a, b: [jnp.maximum(u, v) for u, v in zip(a, b)],
            (0,),
        )
    )


def cut_offsets(starts: np.ndarray) -> list:
    """The per-leaf cuts' offsets ``starts`` (numpy, 1-D), one int32 scalar each, in the form
    each backend compiles best, chosen at lowering (:func:`per_platform`: one form in the
    program, no conditional).

    On XLA:CPU, constants behind an optimisation barrier taken apart by :func:`scalars_apart`:
    folded constants would make every cut a kernel of its own, and the 100-leaf programs
    compiled twice as long (all kinds 17.5 s against 10.3 s, first kind 4.3 s against 2.1 s),
    step time unchanged. On a GPU the folded constants win both (one H200, jax 0.11.2, in one
    process, 2026-12-04): a 64-step ``dp.jit`` run at 67M parameters 0.70 ms per step against
    0.74, all kinds compiled at 100 leaves in 11.4-12.1 s against 15.9-16.1 s; so they are the
    default (TPU not measured). Never batched either way (``flatten``).
    """
    starts = int32_starts(starts)
    if starts.size == 0:
        return []
    return list(_cut_offsets_p.bind(starts=tuple(int(v) for v in starts)))


def _offsets_apart(*, starts: tuple) -> tuple:
    barrier = jax.lax.optimization_barrier(jnp.asarray(starts, jnp.int32))
    return tuple(scalars_apart(barrier))


def _offsets_folded(*, starts: tuple) -> tuple:
    return tuple(jnp.asarray(v, jnp.int32) for v in starts)


def segment_sums(
    values: jax.Array, segment_of: np.ndarray, num_segments: int, how: str | None = None
) -> jax.Array:
    """Sums of ``values`` (``(..., K)``) over the segments of its last axis: ``(..., S)``.

    ``segment_of`` (numpy, ``(K,)``, sorted) names each position's segment; a segment with no
    position sums to 0. The same bits on every call, on every backend: XLA:GPU runs
    ``jax.ops.segment_sum`` (a scatter-add) with atomic adds in whatever order the threads
    arrive, so one program gave different per-leaf scales from one call to the next (seen on an
    H200, jax 0.11.2). On CPU, where the scatter is a loop in order, it is kept (it is the
    faster); elsewhere a segmented prefix sum (``lax.associative_scan``, a fixed tree of adds,
    resetting at each segment's start) read at each segment's end.

    The choice is made at lowering (:func:`per_platform`), so only the chosen form is traced:
    0/1 Adam's compressed and sync programs lowered in 0.39-0.67 s at 100 leaves when both
    forms were traced, 0.24-0.34 s with the CPU form alone (docs/benchmarks/overhead.md,
    "Reading it"). ``how="scatter"`` or ``"scan"`` takes one on any backend (for tests).
    """
    segments = _Segments(segment_of, num_segments)
    if not jnp.ndim(values) or jnp.shape(values)[-1] != segments.size:
        raise TypeError(
            f"segment_sums: the last axis of values {jnp.shape(values)} must have one entry per "
            f"position of segment_of ({segments.size})"
        )
    if segments.size == 0:
        return jnp.zeros((*values.shape[:-1], num_segments), values.dtype)
    if how is not None:
        return {"scatter": _scatter_sums, "scan": _scan_sums}[how](values, segments=segments)
    return _segment_sums_p.bind(values, segments=segments)


class _Segments:
    """A sorted ``segment_of`` and its segment count as a static, hashable primitive parameter
    (hashed once, from its bytes)."""

    def __init__(self, segment_of: np.ndarray, num: int) -> None:
        self.segment_of = np.array(segment_of, copy=True)  # the caller's array may change
        self.segment_of.setflags(write=False)
        self.num = int(num)
        self.size = int(self.segment_of.size)
        self._key = (self.num, self.segment_of.dtype.str, self.segment_of.tobytes())
        self._hash = hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Segments) and self._key == other._key

    def __reduce__(self) -> tuple:  # unpickled, hashed again (str hashes are per process)
        return _Segments, (self.segment_of, self.num)

    def __repr__(self) -> str:  # printed in jaxprs
        return f"Segments(positions={self.size}, segments={self.num})"


def _scatter_sums(x: jax.Array, *, segments: _Segments) -> jax.Array:
    out = jax.ops.segment_sum(
        jnp.moveaxis(x, -1, 0),
        jnp.asarray(segments.segment_of),
        segments.num,
        indices_are_sorted=True,
    )
    return jnp.moveaxis(out, 0, -1)


def _scan_sums(x: jax.Array, *, segments: _Segments) -> jax.Array:
    segment_of = segments.segment_of
    counts = np.bincount(segment_of, minlength=segments.num)
    ends = np.maximum(np.cumsum(counts) - 1, 0)
    starts = np.ones(segment_of.shape, bool)
    starts[1:] = segment_of[1:] != segment_of[:-1]

    def add(a: Any, b: Any) -> Any:
        return jnp.where(b[1], b[0], a[0] + b[0]), a[1] | b[1]

    flags = jnp.broadcast_to(jnp.asarray(starts), x.shape)
    prefix, _ = jax.lax.associative_scan(add, (x, flags), axis=-1)
    return jnp.where(jnp.asarray(counts > 0), prefix[..., ends], 0).astype(x.dtype)


def _segment_sums_abstract(x: Any, *, segments: _Segments) -> Any:
    # the input's type with the last axis resized (dtype and shard_map typing kept; the
    # library never splits this axis over a mesh), not weak: the forms' results are not
    return x.update(shape=(*x.shape[:-1], segments.num), weak_type=False)


def _segment_sums_batched(args: Sequence, dims: Sequence, *, segments: _Segments) -> tuple:
    (x,), (dim,) = args, dims
    return _segment_sums_p.bind(jnp.moveaxis(x, dim, 0), segments=segments), 0


def _segment_sums_transposed(cotangent: Any, x: Any, *, segments: _Segments) -> list:
    del x  # linear: the cotangent of each position is its segment's
    return [jnp.take(cotangent, jnp.asarray(segments.segment_of), axis=-1)]


def per_platform(
    name: str,
    cpu: Callable,
    default: Callable,
    abstract: Callable,
    multiple_results: bool = False,
) -> jex.Primitive:
    """A primitive computed by ``cpu`` when lowered for XLA:CPU and by ``default`` elsewhere
    (both ``fn(*arrays, **params) ->`` the same types, which ``abstract`` gives from the
    inputs' types): the one place the library's CPU-only forms are chosen.

    Unlike ``lax.platform_dependent``, which traces every form into a conditional (and under
    ``vmap`` batches every form again), the program's trace holds one operation, and only the
    chosen form is traced, when the program is lowered for its platform; lowered for several
    platforms at once (``jax.export``), each gets its own. Batching and differentiation rules,
    where a use needs them, are registered on the primitive returned.
    """

    def lowered_by(impl: Callable) -> Callable:
        def rule(ctx: Any, *args: Any, **params: Any) -> Any:
            body = functools.partial(impl, **params)
            return mlir.lower_fun(body, multiple_results=multiple_results)(ctx, *args)

        return rule

    primitive = jex.Primitive(name)
    primitive.multiple_results = multiple_results
    # Outside a trace (eagerly, under jax.disable_jit, or in ensure_compile_time_eval) the form
    # of the platform the operands are on runs op by op. (A jit of the primitive, as JAX's own
    # primitives run eagerly, would call this again under disable_jit: a recursion.)
    primitive.def_impl(lambda *args, **params: (cpu if _on_cpu(args) else default)(*args, **params))
    primitive.def_abstract_eval(abstract)
    mlir.register_lowering(primitive, lowered_by(cpu), platform="cpu")
    mlir.register_lowering(primitive, lowered_by(default))
    return primitive


def _on_cpu(args: Sequence) -> bool:
    """Whether arrays ``args`` live on CPU devices (the default backend's if none says)."""
    for x in args:
        devices = getattr(x, "devices", None)
        if callable(devices):
            with contextlib.suppress(Exception):  # e.g. a deleted array: the default's
                return all(d.platform == "cpu" for d in devices())
    return jax.default_backend() == "cpu"


_cut_offsets_p = per_platform(
    "ozo_cut_offsets",
    _offsets_apart,
    _offsets_folded,
    lambda *, starts: [jax.core.ShapedArray((), jnp.int32)] * len(starts),
    multiple_results=True,
)
_segment_sums_p = per_platform(
    "ozo_segment_sums", _scatter_sums, _scan_sums, _segment_sums_abstract
)
batching.primitive_batchers[_segment_sums_p] = _segment_sums_batched
ad.deflinear2(_segment_sums_p, _segment_sums_transposed)


def index_of(conditions: Sequence[Any]) -> jax.Array:
    """The index of the first true condition among scalar bools (the last one if none is)."""
    index = jnp.asarray(len(conditions) - 1, jnp.int32)
    for i in reversed(range(len(conditions) - 1)):
        index = jnp.where(conditions[i], i, index).astype(jnp.int32)
    return index


# ---------------------------------------------------------------- non-finite values and gates


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
    return computed_once(jnp.stack(sums).all()) if sums else jnp.ones([], bool)


def computed_once(flag: Any) -> Any:
    """The scalar bool ``flag``, in a form every consumer reads instead of recomputing.

    XLA fuses a chain of cheap scalar ops (the counters' arithmetic behind a hint check or a
    skip) into *every* fusion that reads its result: each leaf's gated write gets its own copy
    (~50 ops per leaf in 0/1 Adam's compressed step), which makes the programs larger and
    slower to compile, not faster to run. A floating-point division is an op XLA does not
    duplicate, so on XLA:CPU the flag goes through one (exactly: ``1 / 1 > 0.75``,
    ``1 / 2 < 0.75``) and is computed once; other backends get ``flag`` as it is (not
    measured there), chosen at lowering (:func:`per_platform`: no conditional).
    Measured in ``docs/design.md`` ("The checks are computed once").
    """

    return _computed_once_p.bind(flag)


def _flag_apart(x: Any) -> Any:
    return jnp.reciprocal(jnp.where(x, 1.0, 2.0).astype(jnp.float32)) > 0.75


def _flag_type(x: Any) -> Any:
    if x.dtype != np.bool_:  # a scalar, or one per batched run under vmap
        raise TypeError(f"computed_once takes a bool, got {x.str_short()}")
    return x


_computed_once_p = per_platform("ozo_computed_once", _flag_apart, lambda x: x, _flag_type)
batching.primitive_batchers[_computed_once_p] = lambda args, dims: (
    _computed_once_p.bind(*args),
    dims[0],
)


def keep_if(ok: Any, new: Any, old: Any) -> Any:
    """``new`` where the scalar ``ok`` holds, else ``old``, leaf by leaf (a select that XLA fuses
    into the pass that computes ``new``; a leaf passed through unchanged costs nothing)."""
    return jax.tree.map(lambda n, o: n if n is o else jnp.where(ok, n, o), new, old)


def zero_unless(ok: Any, tree: Any) -> Any:
    """``tree`` where ``ok`` holds, zeros (in its dtypes) elsewhere."""
    return jax.tree.map(lambda x: jnp.where(ok, x, jnp.zeros([], x.dtype)), tree)


def no_refusals() -> jax.Array:
    """The initial ``refused_hint`` of a state: no hint refused (int32 ``(2,)``)."""
    return jnp.zeros((2,), jnp.int32)


STEP_OK = "step_ok"
"""The extra argument a hinted wrapper passes to its inner transforms: a traced bool, false
when the wrapper refused its hint (or was told so by its own caller), so that every transform
keeps its buffers in the pass that writes them (no select over the state afterwards)."""


def admitted(own_ok: Any, extra_args: dict) -> Any:
    """Whether a hinted step is applied: this transform's own check, and the caller's."""
    outer = extra_args.get(STEP_OK)
    return own_ok if outer is None else jnp.logical_and(own_ok, outer)


def refuse_unless(ok: Any, own_ok: Any, expected: jax.Array, new_state: Any, old: Any) -> Any:
    """A hinted step's state: ``new_state`` where it is applied (``ok``), else ``old``: the
    scalars of every state, and every leaf of a state that does not keep its own buffers
    (:func:`restore_skipped`: this library's transforms keep theirs in the passes that write
    them, told by ``ok``; an optax state inside a wrapper, e.g. DiLoCo's inner AdamW, took the
    refused step's input into its moments); a refusal of this transform's own hint (``own_ok``
    false) is recorded in ``refused_hint`` (one more, and 1 + ``expected``, the branch its
    counters asked for)."""
    kept = restore_skipped(ok, new_state, old)
    record = old.refused_hint
    refused = jnp.stack([record[0] + 1, expected.astype(jnp.int32) + 1])
    refused = vary_like(refused, record)
    return kept._replace(refused_hint=jnp.where(own_ok, record, refused))


# The name scope of a transform's update given a step kind (by the caller, picking kinds on the
# host: its local steps exchange nothing by design; or by an enclosing transform's branch).
HINTED_SCOPE = "ozo_step_kind"


def by_kind(
    hint: int | None,
    expected: jax.Array,
    num_branches: int,
    step: Callable[[int, Any, Any, dict], tuple[Any, Any]],
    operand: tuple[Any, Any],
    extra_args: dict,
    axis_name: Any,
    refused: Callable[[Any, Any], Any],
) -> tuple[Any, Any]:
    """A transform's ``(updates, state)`` for the branch of this step's kind.

    The one place where a transform's hinted and unhinted paths part:

    - ``hint`` is ``None`` (no ``step_kind`` given): :func:`switch` over every branch on
      ``expected``, the branch the transform's counters ask for, decided in the graph;
    - else ``hint`` is the branch of the given kind, traced alone. It is applied only where the
      counters agree and so does the caller (:data:`STEP_OK`, :func:`admitted`); the verdict goes
      to ``step`` and, as :data:`STEP_OK`, to the transforms inside it, so that every buffer is
      kept in the pass that writes it. The update is ``refused(ok, updates)`` (NaN for a guard,
      or zero) and a refusal is recorded in the state (:func:`refuse_unless`).

    Args:
      hint: the hinted branch, or ``None``.
      expected: a scalar int32, the branch (``0 .. num_branches - 1``) the counters ask for.
      num_branches: how many branches ``step`` has.
      step: ``step(branch, ok, operand, extra_args) -> (updates, state)``, ``branch`` static and
        ``ok`` a bool (``True`` in the unhinted path) that says whether to write the buffers.
      operand: ``(updates, state)``, the transform's inputs.
      extra_args: the extra arguments of this update.
      axis_name: the worker axis (or axes) of the transform, for :func:`switch`.
      refused: what a refused step returns as its update, given ``ok`` and the updates.
    """
    if hint is None:
        branches = [
            functools.partial(lambda b, o: step(b, True, o, extra_args), b)
            for b in range(num_branches)
        ]
        return switch(expected, branches, operand, axis_name)
    with jax.named_scope(HINTED_SCOPE):  # in the program: dp.jit reads it (a cached trace too)
        own = expected == hint  # feeds scalar selects only (refuse_unless)
        ok = computed_once(admitted(own, extra_args))  # a wrong hint is not applied: state kept
        updates, new_state = step(hint, ok, operand, {**extra_args, STEP_OK: ok})
        return refused(ok, updates), refuse_unless(ok, own, expected, new_state, operand[1])


def nan_unless(ok: Any, tree: Any) -> Any:
    """``tree`` where ``ok`` holds, NaN (in its dtypes) elsewhere: what a refused step returns to
    the guard around it, which then skips the step."""
    return jax.tree.map(lambda x: jnp.where(ok, x, jnp.nan).astype(x.dtype), tree)


def reported_skip(new_state: Any, old_state: Any) -> jax.Array | None:
    """Whether a transform inside said it skipped this step, read from its counter; ``None`` if
    none of the states in ``new_state`` makes that promise.

    A state class that declares ``SKIP_KEEPS_COUNTER = True`` promises that on a step its
    transform skips (its input was not finite, or its hint was refused) it keeps its
    ``STEP_COUNTER``, and that on every other step its update is finite given finite params
    and hyperparameters. A wrapper that must know whether the inner transform skipped
    (``local_step_sync`` before its start step, ``skip_not_finite``) then compares counters,
    two scalars, instead of checking every element of the update: one pass over the update
    less per step (the transform already checked its own input). ``old_state`` is the inner
    state before the update, of the same structure. A counter that stays at the largest int32
    (``optax.safe_increment`` saturates) is not read as a skip.
    """
    new_nodes = _promises_over_all(new_state)
    if not new_nodes:
        return None
    old_nodes = _promises_over_all(old_state)
    largest = jnp.iinfo(jnp.int32).max
    kept = []
    for new, old in zip(new_nodes, old_nodes, strict=True):
        field = type(new).STEP_COUNTER
        before, after = getattr(old, field), getattr(new, field)
        kept.append(jnp.logical_and(after == before, before != largest))
    return computed_once(jnp.stack(kept).any())


def _promises(x: Any) -> bool:
    return _declares(x, "STEP_COUNTER") and getattr(type(x), "SKIP_KEEPS_COUNTER", False)


def _promises_over_all(state: Any) -> list:
    """The states in ``state`` that promise to keep their counter on a skip (:func:`_promises`)
    and see every update: ``state`` itself, or reached through plain tuples and lists
    (``optax.chain``). One under another node (``optax.multi_transform``, ``optax.masked``,
    ``optax.MultiSteps``) sees part of the tree, or not every step: its counter says nothing
    of the rest (a NaN elsewhere went through unchecked; MultiSteps' accumulation steps read
    as skips, and it never updated)."""
    if _promises(state):
        return [state]
    if type(state) in (tuple, list):
        return [node for part in state for node in _promises_over_all(part)]
    return []


def finite_or_skipped(update: Any, new_state: Any, old_state: Any) -> jax.Array:
    """Whether to apply ``update``: what the inner states report (:func:`reported_skip`), or,
    where none of them promises to, whether every element of ``update`` is finite."""
    skipped = reported_skip(new_state, old_state)
    return all_finite(update) if skipped is None else jnp.logical_not(skipped)


def keep_if_finite(finite: Any, step: Any, new_state: Any, skipped_state: Any) -> tuple[Any, Any]:
    """A step's ``(update, state)``, or, where ``finite`` is false, a zero update and the state
    with every scalar taken from ``skipped_state`` (:func:`restore_scalars`; the buffers were
    kept by the transforms that own them)."""
    return zero_unless(finite, step), restore_scalars(finite, new_state, skipped_state)


def restore_skipped(ok: Any, new: Any, old: Any) -> Any:
    """A state where a step is skipped (``ok`` false): the scalars of every state restored
    (:func:`restore_scalars`), and every leaf of a state that does not keep its own buffers.

    A state class of this library declares ``KEEPS_BUFFERS = True``: its transform keeps its
    buffers on a bad step in the pass that writes them, so only its scalars need restoring
    here, at no cost. Any other state (``optax.adam``'s moments, ``optax.sgd``'s momentum) took
    the non-finite input into its buffers: they are restored with a select (one pass over them
    on every step; XLA fuses it into the pass that wrote them). Without it one NaN left in
    Adam's moments made every later step non-finite, and skipped.
    """
    return _restore(ok, new, old, owned=False)


def _restore(ok: Any, new: Any, old: Any, owned: bool) -> Any:
    """:func:`restore_skipped` of a node; ``owned``: a field (or part of one) of a state that
    keeps its own buffers, where only scalars are restored. A state that keeps its buffers
    names the fields that hold other transforms' states (``INNER_FIELDS``): those are restored
    as any state, so that a plain dict or list of arrays there (a user's transform) is too."""
    if hasattr(new, "_fields"):
        cls = type(new)
        if not getattr(cls, "KEEPS_BUFFERS", False):
            return _whole(ok, new, old)
        inner = getattr(cls, "INNER_FIELDS", ())
        return cls(
            *(
                _restore(ok, n, o, owned=field not in inner)
                for field, n, o in zip(cls._fields, new, old, strict=True)
            )
        )
    if isinstance(new, tuple | list):
        return type(new)(_restore(ok, n, o, owned) for n, o in zip(new, old, strict=True))
    if isinstance(new, dict):
        out = new.copy()  # the mapping's own type (optax.named_chain's state: an OrderedDict)
        for k, v in new.items():
            out[k] = _restore(ok, v, old[k], owned)
        return out
    return restore_scalars(ok, new, old) if owned else _whole(ok, new, old)


def _whole(ok: Any, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old`` in ``new``'s dtypes, every leaf."""
    return keep_if(ok, new, jax.tree.map(lambda n, o: jnp.asarray(o, jnp.result_type(n)), new, old))


def int32_starts(starts: Any) -> np.ndarray:
    """Column offsets as int32 (what the cuts index with), or a clear error where one does not
    fit: cast unchecked it wrapped negative, and a slice clamps a negative start to 0, so a
    later leaf would have read the first leaf's columns."""
    starts = np.asarray(starts, np.int64).reshape(-1)
    if starts.size and int(starts.max()) > np.iinfo(np.int32).max:
        raise ValueError(
            f"A worker's row of the flat buffer reaches column {int(starts.max()):,}, past the "
            "int32 offsets the flat buffers are cut with (2**31 - 1, ~2.1B parameters per "
            "worker row). Use more workers (each row is 1/N of the tree), or flatten parts of "
            "the tree apart (ozo.flatten around the optimizer of each part, e.g. under "
            "optax.multi_transform)."
        )
    return starts.astype(np.int32)


def restore_scalars(ok: Any, new: Any, old: Any) -> Any:
    """``new`` with every scalar leaf (counters, flags) taken from ``old`` where ``ok`` is false.

    How a skipped step keeps a whole state unchanged at no cost: the buffers are kept by the
    transforms that own them, which know the step is bad *before* they write (a select in the
    pass that writes them anyway); the scalars, which cost nothing to select afterwards, are
    restored here, including those of transforms that do not know about skipping (e.g. the count
    of ``optax.scale_by_learning_rate``).
    """
    return jax.tree.map(
        lambda n, o: (
            jnp.where(ok, n, jnp.asarray(o, jnp.result_type(n))) if jnp.ndim(n) == 0 else n
        ),
        new,
        old,
    )


# ---------------------------------------------------------------- counters


def _declares(x: Any, hook: str) -> bool:
    return isinstance(getattr(type(x), hook, None), str) and hasattr(x, "_fields")


def refusals(state: Any) -> list[tuple[type, Any]]:
    """``(state class, refused_hint array)`` of every state in ``state`` whose class declares a
    ``REFUSED_HINT`` field (and names its branches in ``BRANCHES``), outermost first, nested
    states (a wrapper's inner state) included."""
    return _hooked(state, "REFUSED_HINT")


def shared_values(state: Any) -> list[tuple[type, Any]]:
    """``(state class, value)`` of every state in ``state`` whose class declares a ``SHARED``
    field: one that is bitwise the same on every worker by design (``local_step_sync``'s
    anchor), which a host may compare across workers (``dispatch.check_workers_agree``)."""
    return _hooked(state, "SHARED")


def walked_states(state: Any) -> list[Any]:
    """The states in ``state`` whose class predicts fields from a host's walk of the schedule
    (a static ``walked(walked)``: :class:`~optax_zero_one.LocalStepSyncState`, and the states
    that keep a variance policy's counters), outermost first."""
    return [n for n in state_nodes(state) if callable(getattr(n, "walked", None))]


def synchronizing_states(state: Any) -> list[Any]:
    """The states in ``state`` that keep a last synchronised point of the params (an
    ``at_last_sync(params)`` method: :class:`~optax_zero_one.LocalStepSyncState`), outermost
    first."""
    return [n for n in state_nodes(state) if callable(getattr(n, "at_last_sync", None))]


def _hooked(state: Any, hook: str) -> list[tuple[type, Any]]:
    """``(state class, the field the class's ``hook`` names)`` of every state in ``state`` that
    declares ``hook``, depth first in tree order (outermost first)."""
    return [
        (type(n), getattr(n, getattr(type(n), hook))) for n in _nodes(state) if _declares(n, hook)
    ]


def state_nodes(state: Any) -> list[Any]:
    """The named-tuple states in ``state`` (optax's and this library's), outermost first."""
    return [n for n in _nodes(state) if isinstance(n, tuple) and hasattr(n, "_fields")]


def _nodes(state: Any) -> Iterator[Any]:
    """Every node of ``state`` (states, tuples, lists, mappings and their entries, and the
    children of any other registered pytree node: a dataclass holding the optax state, as a
    Flax ``TrainState`` does), depth first in tree order."""
    stack = [state]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, dict) or (hasattr(node, "keys") and hasattr(node, "values")):
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, tuple | list):
            stack.extend(reversed(node))
        elif node is not None and not isinstance(node, jax.Array | np.ndarray | np.generic):
            children = jax.tree_util.tree_flatten(node, is_leaf=lambda x, n=node: x is not n)[0]
            if not (len(children) == 1 and children[0] is node):  # not a leaf
                stack.extend(reversed(children))


def holds_own_state(tree: Any) -> bool:
    """Whether ``tree`` holds a state of this library's transforms (by the class's module)."""
    return any(type(n).__module__.startswith("optax_zero_one") for n in state_nodes(tree))


def check_holds_own_state(state: Any, what: str) -> None:
    """Raises if ``state`` holds no state of this library's transforms: a check of it would
    pass whatever it is (params, ``optax.adam``'s state; a bad-input trial)."""
    if not holds_own_state(state):
        raise ValueError(
            f"{what} found no optimizer state of optax_zero_one's transforms in its argument "
            f"(the params? another optimizer's state?): pass the state that zero_one_adam, "
            f"onebit_adam, diloco or one of their blocks made, e.g. opt_state."
        )


def check_no_per_worker_skip(state: Any, what: str) -> None:
    """Raises if ``state`` holds this library's state inside ``optax.apply_if_finite`` or an
    ``optax.MultiSteps`` with a ``should_skip_update_fn``: each decides on each worker's own
    gradient whether to run the update, so at one worker's NaN that worker skips the collectives
    the others wait in and a job on devices hangs (XLA:CPU aborts after ~40 s; a Flax trial).
    Found by optax's state classes (their fields, not their transforms, tell)."""

    for node in _nodes(state):
        if isinstance(node, optax.ApplyIfFiniteState) and holds_own_state(node.inner_state):
            wrapper = "optax.apply_if_finite"
        elif (
            isinstance(node, optax.MultiStepsState)
            and jax.tree.leaves(node.skip_state)
            and holds_own_state(node.inner_opt_state)
        ):
            wrapper = "optax.MultiSteps with a should_skip_update_fn"
        else:
            continue
        raise ValueError(
            f"{what}: the optimizer runs inside {wrapper}, which decides on each worker's own "
            "gradient whether to run it. At a non-finite gradient on one worker, that worker "
            "skips the optimizer's collectives while the others wait in them, and the job "
            "hangs. Drop the wrapper: the optimizers skip non-finite steps themselves, on "
            "every worker together (docs/usage.md, 'What does not compose'); for MultiSteps, "
            "zero a worker's whole gradient when any of it is not finite before it."
        )


def check_not_nnx_state(state: Any, what: str) -> None:
    """Raises ``ValueError`` if ``state`` is (or holds) a Flax NNX ``State`` or a plain-mapping
    copy of this library's states (``nnx.to_pure_dict``, a checkpoint restored without a
    target): the state classes are gone, so no hook can be found, and ``what`` would silently
    treat a 0/1 Adam state as one without local steps or counters."""
    nodes = jax.tree.leaves(state, is_leaf=lambda x: type(x).__module__.startswith("flax.nnx"))
    if any(type(x).__module__.startswith("flax.nnx.statelib") for x in nodes):
        found = "a Flax NNX State (nnx.state of an nnx.Optimizer, which keeps optax's state "
        found += "as plain mappings)"
    elif _plain_copy(state):
        found = "an optimizer state as plain mappings (nnx.to_pure_dict, or a checkpoint restored "
        found += "without a target)"
    else:
        return
    raise ValueError(
        f"{what} got {found}: without the state classes the step counter and the last "
        "synchronised point cannot be found in it (worker 0's "
        "unsynchronised params would come back). Pass optax's own state: an nnx.Optimizer's "
        "optimizer.opt_state, or the state restored into the structure tx.init makes "
        "(docs/reliability.md; docs/jit.md, 'Flax NNX')."
    )


def _plain_copy(state: Any) -> bool:
    """Whether ``state`` holds a mapping with a ``refused_hint`` entry: one of this library's
    hooked states copied into plain mappings."""
    return any(hasattr(n, "keys") and "refused_hint" in n for n in _nodes(state))


def step_counter(state: Any) -> Any:
    """The step counter of the first state in ``state`` whose class declares one.

    A state class names its counter in a class attribute ``STEP_COUNTER`` (e.g. ``"count"``, the
    number of updates the state has taken). Generic code (the host-side dispatch, checkpoints)
    reads it through this hook instead of knowing the classes. ``None`` if there is none.
    """

    found = step_counters(state)
    return found[0][1] if found else None


def step_counters(state: Any) -> list[tuple[str, Any]]:
    """``(key path, counter)`` of every outermost state in ``state`` whose class declares a
    ``STEP_COUNTER``, in tree order: one per optimizer (a chain's transforms each count the
    same steps), several where the state holds several optimizers (``optax.multi_transform``,
    a dict of two)."""
    accept = lambda x: _declares(x, "STEP_COUNTER")  # noqa: E731
    found = jax.tree_util.tree_flatten_with_path(state, is_leaf=accept)[0]
    return [
        (jax.tree_util.keystr(path), getattr(node, type(node).STEP_COUNTER))
        for path, node in found
        if accept(node)
    ]
