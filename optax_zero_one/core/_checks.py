"""Argument checks shared by the optimizers: clear errors, raised at construction or ``init``."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import operator
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_zero_one.core import _graph


class ArgumentError(ValueError):
    """A bad value of one named argument of a constructor: ``argument`` is its name, so that a
    front end that took the value from elsewhere (a DeepSpeed config) can say where."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument

    def __reduce__(self) -> tuple:  # pickled and copied with both arguments
        return type(self), (self.argument, str(self))


def is_static_number(value: Any) -> bool:
    """True for Python/NumPy numbers (checkable now); False for tracers and schedules."""
    return isinstance(value, int | float | np.number) and not isinstance(value, bool)


def concrete_number(value: Any) -> Any:
    """``value`` as a Python number where it is a concrete numeric scalar array (what
    ``optax.inject_hyperparams`` passes to the constructor, checkable now), else unchanged (a
    tracer, a schedule, a Python number)."""
    if (
        isinstance(value, jax.Array | np.ndarray)
        and not isinstance(value, jax.core.Tracer)
        and np.ndim(value) == 0
        and jnp.issubdtype(value.dtype, jnp.number)
    ):
        return value.item()
    return value


def leaf_name(path: Any) -> str:
    """A key path as errors print it: ``<root>`` for a tree that is one bare array."""
    return jax.tree_util.keystr(path) or "<root>"


INT32_MAX = 2**31 - 1
"""The largest step number the optimizers' int32 counters hold."""


def as_index(name: str, value: Any, what: str) -> int:
    """``value`` as a Python int if it is an integer (a Python or NumPy int, or a 0-d integer
    array, e.g. ``jnp.argmin(losses)``), else ``ValueError`` naming ``name`` (``what`` it is)."""
    try:
        if isinstance(value, bool | np.bool_):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int ({what}), got {value!r}.") from None


def check_int(name: str, value: Any, minimum: int, field: str | None = None) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``value`` is an integer ``>= minimum``;
    ``field``: where the value is held when that is not ``name`` (a policy's field that the
    optimizers take as ``name``), named beside it.

    Integer arrays are accepted (``optax.inject_hyperparams`` turns numeric arguments into
    arrays, and traced ones inside ``update``); a concrete one is checked, a traced one cannot
    be, and was checked when ``init`` built the state from concrete values.
    """
    shown = name if field is None else f"{name} ({field})"
    if isinstance(value, jax.Array | np.ndarray | np.generic) and not isinstance(value, bool):
        if not jnp.issubdtype(jnp.result_type(value), jnp.integer) or jnp.ndim(value) != 0:
            raise ArgumentError(name, f"{shown} must be an integer >= {minimum}, got {value!r}.")
        if isinstance(value, jax.core.Tracer):
            return
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArgumentError(name, f"{shown} must be an integer >= {minimum}, got {value!r}.")
    if value > INT32_MAX:
        never = "a step beyond" if name.endswith("step") else "a value larger than"
        held = "" if field is None else f" ({field})"
        raise ArgumentError(
            name,
            f"{name}={value}{held} does not fit the optimizer's int32 step counters (at most "
            f"{INT32_MAX}). For 'never', pass {never} the run's length, e.g. 10**9.",
        )


def check_range(name: str, value: Any, low: float, high: float, *, high_open: bool) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``low <= value < high`` (or ``<= high``).

    A concrete scalar array (injected) is checked like a number; a tracer cannot be. A bool,
    a string or ``None`` is refused (``True`` was taken as 1 and ``b1=True`` trained nothing)."""
    bracket = ")" if high_open else "]"
    if isinstance(value, bool | np.bool_ | str) or value is None:
        raise ArgumentError(
            name, f"{name} must be a number in [{low}, {high}{bracket}, got {value!r}."
        )
    dtype = getattr(value, "dtype", None)
    is_array = isinstance(value, jax.Array | np.ndarray | np.generic)
    if not (is_static_number(value) or is_array) or (is_array and np.ndim(value) != 0):
        shape = f"an array of shape {np.shape(value)}" if is_array else repr(value)
        raise ArgumentError(
            name,
            f"{name} must be a number in [{low}, {high}{bracket} (one scalar; an injected "
            f"hyperparameter is a scalar array), got {shape}"
            + (
                ". PyTorch's betas=(b1, b2) are two arguments here."
                if name == "b1" and isinstance(value, tuple | list)
                else "."
            ),
        )
    value = concrete_number(value)
    if not is_static_number(value):
        coarse = dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
        if coarse and high_open and np.isfinite(high):  # b2 = 0.9999 is 1.0 in float16 too
            raise ArgumentError(  # a trial: b2 = 1.0 in bfloat16 sent the params to -1e5
                name,
                f"{name} is a traced {dtype} array (injected under jit): its value cannot be "
                f"checked, and in {dtype} values near {high} round onto it (b2 = 0.999 is "
                "1.0 in bfloat16, and the params blow up). Pass the hyperparameters in "
                "float32: optax.inject_hyperparams(..., hyperparam_dtype=jnp.float32).",
            )
        return
    ok = low <= value < high if high_open else low <= value <= high
    if not ok or np.isnan(value):
        hint = ""
        narrow = dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
        if narrow and value in (low, high):  # rounding only carries a value onto a bound
            hint = (  # e.g. b2=0.999 injected in bfloat16 is 1.0
                f" (a {dtype} array: it may have rounded there; pass the hyperparameter in "
                "float32, e.g. optax.inject_hyperparams(..., hyperparam_dtype=jnp.float32))"
            )
        raise ArgumentError(
            name, f"{name} must be in [{low}, {high}{bracket}, got {value!r}{hint}."
        )


def check_learning_rate(learning_rate: Any) -> None:
    """A float >= 0, an array (e.g. injected), or a schedule (callable) of a scalar."""
    if callable(learning_rate):
        check_schedule_of("learning_rate", learning_rate)
        return
    if isinstance(learning_rate, jax.Array | np.ndarray) and np.ndim(learning_rate) != 0:
        raise ArgumentError(
            "learning_rate",
            f"learning_rate must be a scalar (one rate for every parameter), got an array of "
            f"shape {np.shape(learning_rate)}; for a rate per group of parameters use "
            "optax.multi_transform with one optimizer per group.",
        )
    if isinstance(learning_rate, bool | np.bool_) or not (
        is_static_number(learning_rate) or isinstance(learning_rate, jax.Array | np.ndarray)
    ):
        raise ArgumentError(
            "learning_rate",
            f"learning_rate must be a float or an optax.Schedule, got {learning_rate!r}.",
        )
    check_range("learning_rate", learning_rate, 0.0, float("inf"), high_open=True)


# what tracing a schedule on an abstract count raises when the schedule branches on its value
# in Python (it fails where the update is traced, as in optax): not the schedule's fault here
_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


def check_schedule_of(name: str, schedule: Any) -> None:
    """A schedule of a hyperparameter (``name``: a learning rate, a weight decay) takes the
    step count and returns a real scalar, finite and >= 0 at count 0 (traced on an abstract count
    for its shape; called on 0 for its value once a backend runs: building an optimizer starts
    none)."""
    example = "e.g. optax.cosine_decay_schedule(1e-3, 10_000)"
    try:
        inspect.signature(schedule).bind(0)
    except TypeError:
        raise ArgumentError(
            name,
            f"{name} is a schedule that cannot be called with one argument (the step "
            f"count): {schedule!r}; {example}.",
        ) from None
    except ValueError:  # no signature to read (a builtin): let the calls below say
        pass
    try:
        out = jax.eval_shape(schedule, jax.ShapeDtypeStruct((), jnp.int32))
    except _TRACER_ERRORS:
        return
    except TypeError as e:  # e.g. a result that is not an array (a str)
        raise ArgumentError(
            name,
            f"{name} is a schedule that must return a real scalar (a float or a float "
            f"array of shape ()), {example}; calling it on a step count failed: {e}",
        ) from None
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if (
        shape is None
        or dtype is None
        or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
    ):
        raise ArgumentError(
            name,
            f"{name} is a schedule returning {out!r}: it must return a real scalar (a "
            f"float or a float array of shape ()), {example}.",
        )
    if shape != ():
        raise ArgumentError(
            name,
            f"{name} is a schedule returning shape {shape}: it must return a scalar "
            f"(one rate for every parameter), {example}.",
        )
    if _graph.backends_started(default=False):
        _check_schedule_value(name, schedule)
    # else running it would start a backend (before jax.distributed.initialize, say): the
    # optimizer's first init or update with a backend running checks it
    # (schedules_checked_at_init)


def _check_schedule_value(name: str, schedule: Any) -> None:
    """The value of a schedule at count 0, finite and >= 0 (where it can be computed)."""
    try:
        with jax.ensure_compile_time_eval():  # concrete, even where init is traced
            value = float(schedule(jnp.zeros((), jnp.int32)))
    except (*_TRACER_ERRORS, TypeError):
        return  # not concrete (built while tracing): the value is the graph's
    if not (np.isfinite(value) and value >= 0):
        raise ArgumentError(
            name,
            f"{name} is a schedule whose value at step count 0 is {value}: it must be finite "
            "and >= 0 (a NaN would reach every worker's params and the state for good; a "
            "negative rate climbs the loss).",
        )


def schedules_checked_at_init(
    tx: optax.GradientTransformationExtraArgs, **hyperparameters: Any
) -> optax.GradientTransformationExtraArgs:
    """``tx`` whose ``init`` and ``update`` check the values at count 0 of the
    ``hyperparameters`` that are schedules, once, at the first call that finds a JAX backend
    running: an optimizer built before any backend ran (a script's first lines, before
    ``jax.distributed.initialize``) could not run them at construction
    (:func:`check_schedule_of`), and a NaN rate would reach every worker's params. Not
    checked: a run whose every init and update is traced before any backend starts and then
    only called compiled (``jax.jit(step).lower(...).compile()`` as the first JAX work)."""
    pending = {n: s for n, s in hyperparameters.items() if callable(s)}
    if not pending:
        return tx

    def check() -> None:
        if pending and _graph.backends_started(default=True):
            for name, schedule in list(pending.items()):  # threads may check twice: harmless
                _check_schedule_value(name, schedule)
                pending.pop(name, None)

    def init_fn(params: Any) -> Any:
        state = tx.init(params)
        # after it: an eager init that is the script's first computation starts the backend
        # itself (a review: NumPy params skipped the check for good); under eval_shape or a
        # jit trace before any backend ran, nothing starts one here
        check()
        return state

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        check()  # traced after a state was made: a backend runs
        return tx.update(updates, state, params, **extra_args)

    return tx._replace(init=init_fn, update=update_fn)


def check_weight_decay(weight_decay: Any) -> None:
    """A float >= 0, a scalar array (injected) or a schedule of the count (as
    ``optax.add_decayed_weights`` takes)."""
    if callable(weight_decay):
        check_schedule_of("weight_decay", weight_decay)
        return
    check_range("weight_decay", weight_decay, 0.0, float("inf"), high_open=True)


def check_axis_name(axis_name: Any) -> None:
    if axis_name is not None and (not isinstance(axis_name, str) or not axis_name):
        raise ValueError(
            f"axis_name must be the name (a str) of the worker axis bound by shard_map / pmap / "
            f"vmap, or None for a single worker; got {axis_name!r}."
        )


Axes = str | tuple[str, str] | None
"""The workers as the transforms see them: one axis, ``(slow, fast)`` for a hierarchy (the mean
over ``fast`` is exact, only ``slow`` compresses: ``docs/hierarchical.md``), or ``None``."""


def worker_axes(axis_name: str | None, fast_axis_name: str | None) -> Axes:
    """The transforms' :data:`Axes` from the public arguments, checked."""
    check_axis_name(axis_name)
    if fast_axis_name is None:
        return axis_name
    if not isinstance(fast_axis_name, str) or not fast_axis_name:
        raise ValueError(
            f"fast_axis_name must be the name (a str) of the mesh axis inside a node, or None; "
            f"got {fast_axis_name!r}."
        )
    if axis_name is None:
        raise ValueError(
            f"fast_axis_name={fast_axis_name!r} needs axis_name, the axis across nodes that the "
            "compressed mean runs over. For one node pass axis_name naming a node axis of size "
            "1, or use the fast axis alone as axis_name."
        )
    if fast_axis_name == axis_name:
        raise ValueError(
            f"axis_name and fast_axis_name must be two different mesh axes, both are {axis_name!r}."
        )
    return (axis_name, fast_axis_name)


def split_axes(axes: Axes) -> tuple[str | None, str | None]:
    """``(slow, fast)`` of :data:`Axes` (``fast`` is ``None`` without a hierarchy)."""
    return (axes[0], axes[1]) if isinstance(axes, tuple) else (axes, None)


_EXPECTED_AXES: contextvars.ContextVar[tuple[Axes, str] | None] = contextvars.ContextVar(
    "optax_zero_one_expected_axes", default=None
)


@contextlib.contextmanager
def expect_worker_axes(axes: Axes, owner: str) -> Iterator[None]:
    """While this is open (at trace time), every transform of the library must communicate
    over ``axes``: a helper that owns the worker axis (``owner``, e.g. ``data_parallel``) knows
    which axis the workers are on, and an optimizer built for another axis (or none) would
    train each worker alone without any error from JAX."""
    token = _EXPECTED_AXES.set((axes, owner))
    try:
        yield
    finally:
        _EXPECTED_AXES.reset(token)


def _built_with(axes: Axes) -> str:
    slow, fast = split_axes(axes)
    return f"axis_name={slow!r}" + ("" if fast is None else f", fast_axis_name={fast!r}")


def check_expected_axes(axes: Axes) -> None:
    """Raises ``ValueError`` if ``axes`` are not those a surrounding helper expects."""
    found = _EXPECTED_AXES.get()
    if found is None or found[0] == axes:
        return
    expected, owner = found
    if axes is None:
        problem = (
            "was built with axis_name=None, so each data worker would train alone and the "
            "workers would never average"
        )
    else:
        problem = (
            f"communicates over {_built_with(axes)}, which is not where the data workers are: "
            "they would never average"
        )
    raise ValueError(
        f"The optimizer {problem}. {owner} runs its data workers on {expected!r}: build the "
        f"optimizer with {_built_with(expected)}, e.g. "
        f"ozo.zero_one_adam(learning_rate, {_built_with(expected)})."
    )


def bound_workers(axes: Axes, num_workers: Any, updates: Any) -> int:
    """The worker count in ``update``, checked: ``axes`` bound (and those a surrounding helper
    expects), ``num_workers`` agreeing, and a warning if ``axes`` is ``None`` while the updates
    are per worker over a ``shard_map`` / ``pmap`` axis (then no worker ever hears from the
    others: most likely the optimizer was built without its ``axis_name``)."""
    workers = axis_size(axes)
    if num_workers is not None:
        resolve_num_workers(axes, num_workers)
    if axes is None:
        mapped = _mapped_axes(updates)
        if mapped:
            names = ", ".join(repr(a) for a in sorted(mapped))
            warnings.warn(
                "An optax_zero_one optimizer was built with axis_name=None but runs per worker "
                f"inside a mapped program over {names}: every worker trains alone, nothing is "
                f"averaged. Build it with axis_name= the workers' axis (one of {names}); for "
                "one worker, call update outside shard_map / pmap.",
                stacklevel=2,
            )
    return workers


def _mapped_axes(updates: Any) -> set[str]:
    """The named axes bound where ``update`` is traced (``shard_map``, ``pmap``, ``vmap``).

    JAX has no public query for them: this reads its axis environment where that exists
    (``jax._src.core.unsafe_get_axis_names``, jax 0.10) and otherwise falls back to the axes the
    updates are typed as varying over (``shard_map`` only). Used for a warning and for the
    wording of an error, never to decide a result."""
    names: set[str] = set()
    try:
        from jax._src import core as jax_core

        names = {a for a in jax_core.unsafe_get_axis_names() if isinstance(a, str)}
    except (ImportError, AttributeError):
        pass
    for x in jax.tree.leaves(updates):
        names |= {a for a in _graph.varying_axes(x) if isinstance(a, str)}
    return names


def axis_size(axis_name: Axes) -> int:
    """Number of workers on ``axis_name`` (``1`` for ``None``; the product of the sizes of a
    ``(slow, fast)`` pair), with a clear error if unbound."""
    check_expected_axes(axis_name)
    if axis_name is None:
        return 1
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound here. Call the optimizer's update inside "
            f"jax.shard_map / jax.pmap / jax.vmap with axis_name={axis_name!r}, or pass "
            "axis_name=None for a single worker."
        ) from err


def fast_size(axes: Axes, num_workers: Any = None) -> int:
    """``L``, the workers inside a node (1 without a hierarchy): the bound size of the fast
    axis, else the second entry of ``num_workers``."""
    if not isinstance(axes, tuple):
        return 1
    try:
        return jax.lax.axis_size(axes[1])
    except NameError:
        resolve_num_workers(axes, num_workers)  # raises the unbound-axis error if None
        return int(num_workers[1])


def positive_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= 1


def check_num_workers(axes: Axes, num_workers: Any) -> None:
    """The form of ``num_workers`` for ``axes``: ``None``, a positive int (1 without an axis),
    or for a ``(slow, fast)`` pair a pair of them (``ValueError`` otherwise)."""
    if num_workers is None:
        return
    if isinstance(num_workers, jax.Array):
        raise ValueError(
            f"num_workers is a JAX array ({num_workers!r}): a worker count sizes the state's "
            "buffers and must be a static int. optax.inject_hyperparams makes every numeric "
            "argument an array (and traces it in update): pass "
            "optax.inject_hyperparams(ozo.zero_one_adam, static_args=('num_workers',))(...), "
            "or run init inside the mapped function without num_workers."
        )
    if isinstance(axes, tuple):
        pair = isinstance(num_workers, tuple | list) and len(num_workers) == 2
        if not pair or not all(positive_int(v) for v in num_workers):
            raise ValueError(
                f"With fast_axis_name, num_workers must be None or a pair (nodes, workers per "
                f"node), e.g. (2, 4); got {num_workers!r}."
            )
    elif not positive_int(num_workers):
        raise ValueError(f"num_workers must be a positive int or None, got {num_workers!r}.")
    elif axes is None and num_workers != 1:
        raise ValueError(
            f"num_workers={num_workers} needs an axis_name to communicate over; with "
            "axis_name=None there is one worker."
        )


def resolve_num_workers(axis_name: Axes, num_workers: Any) -> int:
    """The worker count: the bound axis size, else ``num_workers`` (which must agree).

    For a ``(slow, fast)`` pair ``num_workers`` is ``(nodes, workers per node)`` and the count
    is their product."""
    check_expected_axes(axis_name)
    check_num_workers(axis_name, num_workers)
    if isinstance(axis_name, tuple) and num_workers is not None:
        num_workers = tuple(int(v) for v in num_workers)
        for name, count in zip(axis_name, num_workers, strict=True):
            try:
                bound = jax.lax.axis_size(name)
            except NameError:
                continue
            if bound != count:
                raise ValueError(
                    f"num_workers={num_workers} but axis {name!r} has {bound} workers; "
                    "they must agree (or leave num_workers=None)."
                )
        return num_workers[0] * num_workers[1]
    if axis_name is None:
        return 1
    try:
        bound = jax.lax.axis_size(axis_name)
    except NameError:
        if num_workers is None:
            bound = sorted(_mapped_axes(None))
            if bound and isinstance(axis_name, str):  # mapped over other axes only
                raise ValueError(
                    f"The optimizer was built with axis_name={axis_name!r}, but init runs "
                    f"inside a mapped program over {', '.join(map(repr, bound))} only. If the "
                    "workers' axis is one of those, build the optimizer with that axis_name; "
                    "if it is bound outside this init (an ensemble's vmap around it), call init "
                    "inside it, or pass num_workers=N and replicate the state over the workers "
                    "yourself (optax_zero_one.replicate)."
                ) from None
            count = "(nodes, workers per node)" if isinstance(axis_name, tuple) else "N"
            raise ValueError(
                f"init was called outside a context that binds axis_name={axis_name!r}, so the "
                "number of workers is unknown. Either call init inside jax.shard_map / "
                f"jax.pmap / jax.vmap(axis_name=...), or pass num_workers={count} (then "
                "replicate the state over the workers yourself, e.g. with "
                "optax_zero_one.replicate)."
            ) from None
        return num_workers
    if num_workers is not None and num_workers != bound:
        raise ValueError(
            f"num_workers={num_workers} but axis {axis_name!r} has {bound} workers; they must "
            "agree (or leave num_workers=None)."
        )
    return bound


def workers_for(params: Any, axis_name: Axes, num_workers: Any) -> int:
    """:func:`resolve_num_workers` for ``init``; the placeholder ``optax.tree_map_params``
    initialises with (no parameters at all) needs no worker count and gets 1 if unbound."""
    if is_placeholder(params) and num_workers is None:
        try:
            return resolve_num_workers(axis_name, None)
        except ValueError:
            return 1
    return resolve_num_workers(axis_name, num_workers)


def is_placeholder(params: Any) -> bool:
    """Whether ``params`` is the stand-in that ``optax.tree_map_params`` calls ``init`` with
    (or a flat buffer laid out for it): a state is then built only for its structure."""
    layout = getattr(params, "layout", None)
    if layout is not None and hasattr(layout, "treedef"):
        return "_ParamsPlaceholder" in str(layout.treedef)
    return type(params).__name__ == "_ParamsPlaceholder"


def check_float_leaves(tree: Any, what: str) -> None:
    """Rejects non-floating leaves of ``tree`` with a message naming the leaf."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{what} leaf {leaf_name(path)} has dtype {dtype}; only real "
                "floating-point leaves (float32, bfloat16, float16, float64) can be compressed "
                "and optimised. Keep integer/complex arrays out of this optimizer's tree: "
                "optax.multi_transform({'train': tx, 'fixed': optax.set_to_zero()}, labels) "
                "for leaves that do not train; for complex ones that do, an optax optimizer of "
                "their own under another label, given jax.lax.pmean of their gradients. Not "
                "optax.masked: it applies each worker's own gradient to them, and the workers "
                "part."
            )


def as_int32_state(tree: Any) -> Any:
    """A policy state made of Python ints, as int32 arrays."""
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.int32), tree)


def evaluate(hyperparam: Any, count: jax.Array) -> jax.Array:
    """``h(count)`` for a schedule, ``h`` otherwise (optax convention: count before the step)."""
    return jnp.asarray(hyperparam(count) if callable(hyperparam) else hyperparam, jnp.float32)


def check_tree_matches(tree: Any, reference: Any, what: str, reference_what: str) -> None:
    """Raises ``ValueError`` if ``tree`` and ``reference`` differ in structure or shapes, or if
    ``tree`` has a non-floating leaf where ``reference`` has a floating one."""
    got, want = jax.tree.structure(tree), jax.tree.structure(reference)
    if got != want:
        raise ValueError(
            f"{what} does not have the tree structure of {reference_what}.\n"
            f"  {what}: {got}\n  {reference_what}: {want}"
        )
    for path, a, b in zip(
        jax.tree_util.tree_leaves_with_path(tree),
        jax.tree.leaves(tree),
        jax.tree.leaves(reference),
    ):
        if jnp.shape(a) != jnp.shape(b):
            raise ValueError(
                f"{what} leaf {leaf_name(path[0])} has shape {jnp.shape(a)}, but "
                f"{reference_what} has {jnp.shape(b)} there."
            )
        # A complex or integer value would be cast to the float buffers silently (dropping the
        # imaginary part), so it is refused here rather than optimised wrongly.
        got_dtype, want_dtype = jnp.result_type(a), jnp.result_type(b)
        if jnp.issubdtype(want_dtype, jnp.floating) and not jnp.issubdtype(got_dtype, jnp.floating):
            raise ValueError(
                f"{what} leaf {leaf_name(path[0])} has dtype {got_dtype}, but "
                f"{reference_what} holds real floating-point values ({want_dtype}) there; pass "
                "real floating-point values (float32, bfloat16, float16, float64)."
            )


def check_mask(mask: Any, params: Any, name: str = "mask") -> None:
    """A mask (``name``: the compression's, or the weight decay's) must be a tree like
    ``params`` of 0/1 values (per leaf or per element)."""
    if mask is None:
        return
    # a function: a leaf of its own (a callable pytree node, an Equinox model of 0/1 values,
    # is a tree like the params: it was refused as a function, with no way in but a wrapper)
    leaves = jax.tree.leaves(mask)
    if callable(mask) and len(leaves) == 1 and leaves[0] is mask:
        raise ValueError(
            f"{name} must be a pytree of 0/1 like the params, not a function (optax's masks "
            f"take either; here the tree is needed before the params are flattened): pass "
            f"{name}=mask_fn(params)."
        )
    if jax.tree.structure(mask) != jax.tree.structure(params):
        raise ValueError(
            f"{name} must be a pytree with the structure of the params (one 0/1 array, or one "
            "0/1 scalar, per parameter leaf).\n"
            f"  {name}: {jax.tree.structure(mask)}\n  params: {jax.tree.structure(params)}"
        )
    for path, m, p in zip(
        jax.tree_util.tree_leaves_with_path(mask), jax.tree.leaves(mask), jax.tree.leaves(params)
    ):
        where = leaf_name(path[0])
        if jnp.shape(m) not in ((), jnp.shape(p)):
            raise ValueError(
                f"{name} leaf {where} has shape {jnp.shape(m)}; it must be a scalar or have the "
                f"shape of the parameter as the optimizer sees it, {jnp.shape(p)} (under "
                "ozo.data_parallel's dp.optimizer a leaf sharded over model axes is seen one "
                "shard at a time, and a mask cannot differ per shard: give such a leaf a "
                "scalar mask)."
            )
        if not isinstance(m, jax.core.Tracer):
            values = np.asarray(m)
            if not np.all((values == 0) | (values == 1)):
                raise ValueError(f"{name} leaf {where} must contain only 0 and 1 (or booleans).")


def standard_numpy(fn: Any) -> Any:
    """``fn`` traced with JAX's default NumPy promotion rules, whatever the caller set: the
    library's arithmetic broadcasts ranks and mixes dtypes as NumPy does, and codebases that
    run under ``jax.numpy_rank_promotion("raise")`` or ``jax.numpy_dtype_promotion("strict")``
    (a trial: every 1-bit collective, and 0/1 Adam's counters, refused there) keep their
    setting for their own code. Transforms wrapped inside (DiLoCo's inner optimizer) run with
    the defaults too."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
            return fn(*args, **kwargs)

    return run


def standard_transformation(init_fn: Any, update_fn: Any) -> optax.GradientTransformationExtraArgs:
    """``init_fn`` and ``update_fn`` as an Optax transform, both traced with NumPy's promotion
    rules (:func:`standard_numpy`)."""
    return optax.GradientTransformationExtraArgs(standard_numpy(init_fn), standard_numpy(update_fn))


def transformation(
    init_fn: Any, update_fn: Any, state_type: type, name: str
) -> optax.GradientTransformationExtraArgs:
    """``init_fn`` and ``update_fn`` as an Optax transform whose ``update`` first checks that it
    was given its own state (``state_type``), naming the transform (``name``) if not
    (:func:`standard_transformation`)."""

    def checked_update(
        updates: optax.Updates, state: Any, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, Any]:
        check_state_type(state, state_type, name)
        return update_fn(updates, state, params, **extra_args)

    return standard_transformation(init_fn, checked_update)


def check_state_type(state: Any, expected: type, optimizer: str) -> None:
    """Raises ``ValueError`` if ``update`` is given another transformation's state."""
    if not isinstance(state, expected):
        raise ValueError(
            f"{optimizer}'s update needs a {expected.__name__} (made by its own init), got "
            f"{type(state).__name__}. Was the state made by another optimizer, or taken from "
            "the wrong position of an optax.chain state?"
        )


def check_policy(name: str, policy: Any, method: str, example: str) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``policy`` has ``init``, ``next`` and
    ``method`` (a policy of :mod:`~optax_zero_one.core.policies`, or one written alike)."""
    check_protocol(
        name, policy, ("init", f"{method}(state, k)", "next(state, k)"), example, "policy"
    )


def check_protocol(name: str, obj: Any, methods: tuple[str, ...], example: str, what: str) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``obj`` is an object (not a class) with
    every method of ``methods`` (each written as it is called, e.g. ``"next(state, k)"``)."""
    if isinstance(obj, type):
        raise ValueError(
            f"{name} must be a {what} object, got the class {obj.__name__}: build one, "
            f"e.g. {example}."
        )
    if not all(callable(getattr(obj, m.split("(")[0], None)) for m in methods):
        shown = ", ".join(m if "(" in m else f"{m}()" for m in methods)
        raise ValueError(
            f"{name} must be a {what} object with {shown}, e.g. {example}; got {obj!r}."
        )


def check_variance_policy(policy: Any) -> None:
    """:func:`check_policy` for a variance policy, which also needs its ``freeze_step`` (the
    last step of phase A)."""
    check_policy(
        "variance_policy", policy, "is_update_step", "ozo.VarianceDoubling(freeze_step=1000)"
    )
    if not hasattr(policy, "freeze_step"):
        raise ValueError(
            f"variance_policy needs a freeze_step (the last step that may update the variance), "
            f"as ozo.VarianceDoubling and ozo.FullPrecisionWarmup have; got {policy!r}."
        )


_TRANSFORMATION_EXAMPLES = {
    "inner": "optax.adamw(1e-3)",
    "outer": "optax.sgd(0.7, momentum=0.9, nesterov=True)",
}


def check_transformation(name: str, tx: Any, *, optional: bool = True) -> Any:
    """``tx`` (``None`` stays ``None`` where ``optional``) with extra-args support, or a
    ``TypeError`` naming ``name`` if it is not an optax transformation."""
    if tx is None and optional:
        return None
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        example = _TRANSFORMATION_EXAMPLES.get(name, "optax.sgd(0.1)")
        called = (
            f" {getattr(tx, '__name__', tx)!r} looks like an optimizer's factory: call it, "
            f"e.g. {example}."
            if callable(tx)
            else ""
        )
        raise TypeError(
            f"{name} must be an optax.GradientTransformation (e.g. {example}), got {tx!r}.{called}"
        )
    return optax.with_extra_args_support(tx)


def check_variance_measured(freeze: Any, name: str = "") -> None:
    """Raises ``ValueError`` for a static variance freeze step below 1 (a negative one too:
    the same reason, said at once; ``name`` the argument's, for its message)."""
    freeze = concrete_number(freeze)  # injected: checked like a number
    if not is_static_number(freeze) or isinstance(freeze, bool):
        return
    if freeze >= 1:
        check_int(name or "freeze_step", freeze, 1)  # a step number: an integer
        return
    given = f"{name}={freeze}: " if name else ""
    raise ArgumentError(
        name or "freeze_step",
        f"{given}The variance is frozen after step {freeze}, before any step has measured it: v "
        "would stay 0 and every update would be m / eps, which diverges. Freeze after at "
        "least one step (zero_one_adam's var_freeze_step, onebit_adam's freeze_step >= 1); "
        "DeepSpeed's recipes freeze at the end of the learning-rate warm-up "
        "(docs/parameters.md).",
    )
