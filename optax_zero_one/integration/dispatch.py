"""One compiled program per step kind, chosen on the host: the loop the library owns.

A step's kind follows from its number (:class:`~optax_zero_one.StepSchedule`), so the host can
pick a program compiled for that kind alone, and the device runs no conditional
(``docs/design.md``, "Step kinds"). :func:`dispatch_by_kind` does it for any step function:
``jax.jit``, ``jax.pmap``, ``jax.shard_map`` or ``jax.vmap`` steps alike;
:meth:`~optax_zero_one.DataParallel.jit` uses it.

The step number lives on the host. It is read from the state once, at the first call and
whenever the state passed in is not the one this dispatcher returned last (a restore), never
per step. The counters stay traced arrays in every program, so no program is ever compiled
twice. What the host cannot know is a step the state did not take (a non-finite step skipped
by every worker keeps the counters): it learns that a few steps later from the counters, copied
to the host in the background once every ``check_every`` steps (a read per step would cost a
GPU host more than a small model's step), and moves its step number back. A step whose hint
does not match the state is not applied by the optimizer (each transform checks its hint); if
that happens while the host's step number was right, the schedule given here is not the
optimizer's, and a call soon after raises an error naming the kind the state expected.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import inspect
import operator
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_zero_one.core import _checks, _graph, flat, kinds
from optax_zero_one.core.kinds import StepKind, StepSchedule
from optax_zero_one.integration import checkpoint, distributed
from optax_zero_one.integration.distributed import outside_user_mesh


class KindMemory(NamedTuple):
    """Bytes one device holds while a kind's program runs
    (:meth:`KindDispatcher.memory_analysis`, from XLA's ``memory_analysis()``).

    Attributes:
      arguments: the program's inputs (params, optimizer state, batch).
      outputs: its results.
      aliased: the results written in place of donated inputs (counted in both above).
      temporaries: the buffers the program allocates for its own use while it runs.
    """

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @property
    def peak(self) -> int:
        """``arguments + outputs - aliased + temporaries``: what the program needs on the
        device at once, beside any other live arrays."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @classmethod
    def of(cls, compiled: Any, name: str = "the") -> KindMemory:
        """Read from a compiled program (``jax.jit(f).lower(...).compile()``); ``name`` the
        program's, for the error where the backend reports nothing."""
        stats = compiled.memory_analysis()
        if stats is None:
            raise ValueError(
                f"XLA gives no memory analysis for {name} program on "
                f"{jax.default_backend()!r}: this backend does not report it."
            )
        return cls(
            arguments=int(stats.argument_size_in_bytes),
            outputs=int(stats.output_size_in_bytes),
            aliased=int(stats.alias_size_in_bytes),
            temporaries=int(stats.temp_size_in_bytes),
        )


@dataclasses.dataclass
class _Pending:
    step: int  # the step number the host assumed
    kind: StepKind
    counts: Any  # [count, refused hints of each state...] after the call (device), or None
    checked: bool  # counts on their way to the host, read when the step settles
    stale: bool = False  # expected to be refused: dispatched before the host learnt of a skip


def _counts(leaves: list, per_worker: bool = False) -> jax.Array:
    """The counter and the refused-hint counts, one small int32 array (a copy: the state
    itself is donated to the next step): ``[count, refused, hint, ..., spread]`` of one worker;
    with ``per_worker``, that along a new last axis of the counter's shape (the worker layout:
    each device computes its own workers' counts, as the counter is sharded; no communication).
    Without it, the refusals are the entry's that refused most and ``spread`` is how far the
    counters of the entries given differ (0 for one run: a batch of runs that parted is an
    error, :data:`~optax_zero_one.core._graph.BATCHED_RUNS`); with it, 0."""
    counter, *refused = leaves
    if per_worker:
        lead = tuple(jnp.shape(counter))
        parts = [jnp.reshape(counter, (*lead, 1))]
        parts += [jnp.reshape(r, (*lead, -1))[..., :2] for r in refused]
        parts.append(jnp.zeros_like(parts[0]))
        # on a mesh of Explicit axes each part's sharding is typed, and the concatenate needs
        # them alike (a model-sharded state's refusals are sharded over the model axes)
        typed = jax.typeof(parts[0]).sharding
        if not typed.mesh.empty and typed.mesh.explicit_axes:
            parts = [jax.sharding.reshard(x, typed) for x in parts]
    else:
        flat = jnp.reshape(counter, -1)
        parts = [flat[:1]]
        for r in refused:
            rows = jnp.reshape(r, (-1, 2))
            parts.append(rows[jnp.argmax(rows[:, 0])])
        parts.append(jnp.reshape(jnp.max(flat) - jnp.min(flat), (1,)))
    return jnp.concatenate([x.astype(jnp.int32) for x in parts], axis=-1)


_snapshot = jax.jit(_counts)

# Steps skipped in a row (not finite) after which a dispatcher warns that the run is stuck.
STALLED_WARNING = 64


@outside_user_mesh
def _host_counts(counter: Any, refused: list) -> jax.Array:
    """:func:`_counts` of this process's first worker, by a program of its own."""
    return _snapshot([_first_shard(counter)] + [_first_shard(r) for _, r in refused])


def with_counts(fn: Callable[..., Any], state_index: int) -> Callable[..., Any]:
    """``fn`` (traced, in the worker layout) that also returns the counts of the state it
    returns, per worker (:func:`_counts`). A dispatcher built with ``counts_in_program=True``
    expects programs of this shape: it then needs no program of its own per step to copy the
    counter (:meth:`KindDispatcher.__call__`)."""

    def both(*args: Any) -> tuple[Any, jax.Array]:
        out = fn(*args)
        state = out[state_index]
        leaves = [_graph.step_counter(state)] + [r for _, r in _graph.refusals(state)]
        return out, _counts(leaves, per_worker=True)

    return both


class _Precompiled:
    """A kind's program compiled ahead of time (:meth:`KindDispatcher.precompile`), called
    instead of the jitted one while the arguments are like those it was compiled for.

    A call with other arguments (an epoch's last, shorter batch) runs the jitted program,
    which compiles for them as ``jax.jit`` would, and the precompiled one stays for the calls
    after it: dropped, the next call like precompile's made the jitted program compile again,
    and every later step went through its argument checks (+30% host time per step at 100
    leaves). It is dropped only after :data:`STALE_AFTER` such calls in a row: the run's
    arguments have changed for good, and each refusal costs an exception."""

    def __init__(self, compiled: Any, program: Callable[..., Any], name: str, signature: tuple):
        self.compiled, self.program, self.name = compiled, program, name
        self.signature = signature  # what it was compiled for (memory_analysis compares)
        self.misses = 0  # calls in a row that it did not take
        self.warned = False

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                out = self.compiled(*args)
            except (TypeError, ValueError) as err:
                # raised by the executable's check of its arguments, before it runs (nothing
                # donated yet): other shapes, dtypes, tree or shardings than at precompile;
                # or arrays a donated step consumed, which no program takes: raised as it is
                if any(_deleted(x) for x in jax.tree.leaves(args)):
                    raise
                self.misses += 1
                if self.misses >= STALE_AFTER:
                    self.compiled = None
                if not self.warned:
                    self.warned = True
                    warnings.warn(
                        f"the program precompiled for the {self.name!r} kind does not take "
                        f"these arguments ({_mismatch(err)}); they get a program compiled for "
                        "them, as jax.jit would, and calls like precompile's keep the "
                        "precompiled one. Pass precompile() arguments like the step's.",
                        stacklevel=3,
                    )
            else:
                self.misses = 0
                return out
        return self.program(*args)


# Calls in a row with arguments a precompiled program does not take after which it is dropped.
STALE_AFTER = 16


def _check_one_update_per_call(state: Any) -> None:
    """Raises ``ValueError`` for a state whose optimizer is not updated at every call."""
    if _graph.nodes_of(state, optax.MultiStepsState):
        raise ValueError(
            "The optimizer state holds an optax.MultiStepsState: with optax.MultiSteps the "
            "optimizer takes a step once every k calls, while a schedule gives every call a step "
            "kind of its own, so the kinds cannot follow the state. Accumulate the gradients of "
            "the k micro-batches inside your step (e.g. a jax.lax.scan over them) and call "
            "tx.update once, or run without a schedule (the step's kind decided in the graph)."
        )


def _check_one_count(state: Any) -> None:
    """Raises ``ValueError`` for a state holding several optimizers whose step counts differ:
    a dispatcher follows one count (the first), and would send the others kinds they refuse."""
    found = _graph.step_counters(state)
    if len(found) < 2:
        return
    counts = [(path, int(_graph.first_value(c))) for path, c in found]
    if len({c for _, c in counts}) == 1:
        return
    listed = ", ".join(f"{path or 'the state'}: {c}" for path, c in counts)
    raise ValueError(
        f"The optimizer state holds {len(counts)} step counters that differ ({listed}; "
        "e.g. one trained for more steps than the other, or skipped a step the others took: a "
        "non-finite gradient in its part of the tree). A dispatcher follows one count, the "
        "first, and would send the others the kinds of other steps, which they refuse (their "
        "steps not applied). Dispatch each optimizer's update in a step of its own (its own "
        "dispatch_by_kind, its state argument holding that optimizer's state only), or update "
        "them together from their first step so that their counts stay equal. " + _SKIP_TOGETHER
    )


def _check_one_run(spread: int, counter: Any) -> None:
    """Raises ``ValueError`` where the state's counters differ between its entries by
    ``spread`` (:func:`_counts`'s last entry; ``counter``, if given, read again for the error's
    values)."""
    if spread:
        if counter is not None:
            _graph.check_counters_agree(counter, "The step dispatched by kind")
        raise ValueError(
            f"The step dispatched by kind: the state's step counters differ between its "
            f"entries (by up to {spread} steps). " + _graph.BATCHED_RUNS
        )


_SKIP_TOGETHER = (
    "To make several optimizers skip together, make the whole gradient non-finite where a part "
    "is, before the update: grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.nan), "
    "grads), with finite the conjunction of jnp.isfinite(g).all() over its leaves."
)


def _shape_of(x: Any) -> Any:
    """``x``'s shape, dtype and (for a ``jax.Array``) sharding, as a ``ShapeDtypeStruct``."""
    if isinstance(x, jax.ShapeDtypeStruct) or not hasattr(x, "dtype"):
        return x
    if isinstance(x, jax.Array):
        # an array on one device is placed by the program as a host array is: no sharding to
        # match (jax.pmap refuses to lower for a single-device sharding; it shards such inputs)
        single = isinstance(x.sharding, jax.sharding.SingleDeviceSharding)
        sharding = None if single else x.sharding
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def _signature(args: Any) -> tuple:
    """What a program is compiled for: the arguments' tree and each leaf's shape, dtype and
    sharding (where it has one)."""
    leaves, tree = jax.tree.flatten(jax.tree.map(_shape_of, args))
    return tree, tuple(
        (np.shape(x), np.dtype(x.dtype), getattr(x, "sharding", None))
        if hasattr(x, "dtype")
        else (type(x), x)
        for x in leaves
    )


def _mismatch(err: Exception) -> str:
    """What an executable's refusal of its arguments says differs (JAX's message opens with a
    guess about x64 mode, then lists the mismatches)."""
    text = str(err)
    head, found, rest = text.partition("The mismatches are:")
    lines = [line.strip() for line in (rest if found else head).splitlines() if line.strip()]
    return "; ".join(lines[:3]) if lines else type(err).__name__


def consumed(name: str, instead: str) -> RuntimeError:
    """The error for a step given ``name`` (params or state) that a donating call consumed."""
    return RuntimeError(
        f"the step was given {name} that an earlier call consumed: the step donates its "
        "params and state, so their buffers went to that call's results. Pass the arrays the "
        "last call returned (params, opt_state, aux = step(params, opt_state, batch)); keep a "
        f"copy (jnp.copy) of any you need later, or build the step with {instead}."
    )


def check_not_traced(leaf: Any, who: str) -> None:
    """Raises ``TypeError`` where ``leaf`` (a tree's :func:`~._graph.first_leaf`: a tree is
    traced whole) is a tracer: a dispatcher or a ``dp.jit`` step called inside ``jax.jit``,
    ``lax.scan`` or another step, where JAX said "The is_deleted() method was called on
    traced array" (a trial)."""
    if isinstance(leaf, jax.core.Tracer):
        raise TypeError(
            f"{who} is called from Python with arrays, once per step: it chooses each step's "
            "program on the host and runs it, so it cannot run inside jax.jit, a lax.scan or "
            "another step. Call the step function you gave it inside (with step_kind= the "
            "kind, or without a hint to decide in the graph), or call this one from your loop."
        )


def _deleted(x: Any) -> bool:
    is_deleted = getattr(x, "is_deleted", None)
    return bool(is_deleted()) if is_deleted is not None else False


def _paths(tree: Any, where: list[int]) -> list[list[Callable[[Any], Any]]] | None:
    """Getters of ``tree``'s leaves at positions ``where`` (for each, the steps of its key
    path: one ``attrgetter`` per run of attribute names, one ``itemgetter`` per index or
    key), or None if a path goes through a node whose children have no key."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    getters = []
    for i in where:
        steps: list[Callable[[Any], Any]] = []
        names: list[str] = []
        for key in flat[i][0]:
            if isinstance(key, jax.tree_util.GetAttrKey):
                names.append(key.name)
                continue
            if names:
                steps.append(operator.attrgetter(".".join(names)))
                names = []
            if isinstance(key, jax.tree_util.SequenceKey):
                steps.append(operator.itemgetter(key.idx))
            elif isinstance(key, jax.tree_util.DictKey):
                steps.append(operator.itemgetter(key.key))
            else:
                return None
        if names:
            steps.append(operator.attrgetter(".".join(names)))
        getters.append(steps)
    return getters


def _follow(tree: Any, steps: list[Callable[[Any], Any]]) -> Any:
    for get in steps:
        tree = get(tree)
    return tree


_EXITING = threading.Event()
"""Set when the interpreter starts to exit, before it waits for the threads that are not
daemons: a background precompile then stops after the kind it is lowering."""
_register_atexit = getattr(threading, "_register_atexit", None)  # CPython's, as concurrent.futures'
if _register_atexit is not None:
    _register_atexit(_EXITING.set)


def _thread_config() -> list[tuple[Any, Any]]:
    """The JAX settings this thread holds in a context (``with jax.default_matmul_precision(
    "highest")``, ``jax.numpy_rank_promotion("raise")``, ``jax.set_mesh``), as ``(setting,
    value)``: JAX keeps them per thread, so a program lowered on another thread would not see
    them (a trial: a background precompile lowered every kind at the default precision)."""
    from jax._src import config as jax_config  # JAX has no public reader of a thread's own

    unset = jax_config.config_ext.unset
    return [
        (state, state.get_local())
        for state in jax_config.config_states.values()
        if state.get_local() is not unset
    ]


def _enter_thread_config(config: list[tuple[Any, Any]]) -> None:
    """Sets ``config`` (:func:`_thread_config` of another thread) on this thread, as the
    settings' own context managers do on entry (this thread ends with the work it does)."""
    for state, value in config:
        state.set_local(value)
        hook = getattr(state, "_update_thread_local_hook", None)
        if hook is not None:
            hook(value)


def _first_shard(x: Any) -> Any:
    shards = getattr(x, "addressable_shards", None)
    return shards[0].data if shards else x


_JITTED = type(jax.jit(lambda: None))  # what jax.jit returns (a jitted step, not a factory)


def _one_thread(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of a :class:`KindDispatcher`, run while no other thread is inside one of the
    dispatcher's methods that read or move its host-side step (it waits its turn). The
    dispatcher keeps one run's step number: two threads moving it at once sent each other's
    states the wrong kinds (a trial: one thread's run refused 30 of its 40 steps, silently;
    ``settle`` from a checkpoint thread stalled a run). Taking turns, each call finds the state
    it is given as a call from one thread would (a state other than the last one returned is
    read afresh). The same thread may nest them."""

    @functools.wraps(method)
    def wrapped(self: KindDispatcher, *args: Any, **kwargs: Any) -> Any:
        with self._entry:
            return method(self, *args, **kwargs)

    return wrapped


class KindDispatcher:
    """A step function that runs, at each call, the program compiled for the step's kind.

    Build it with :func:`dispatch_by_kind`. Attributes (read-only): ``programs``, the compiled
    programs by kind name; ``step``, the step number the next call is for; ``skipped``, the
    steps the state did not take (non-finite, skipped by every worker); ``lost``, steps not
    applied because they were dispatched before the host learnt of a skip and the kind had
    changed (at most ``check_every + lag`` per skip, in practice the few steps around a change
    of kind; their batch is dropped, as for a skipped step).
    """

    def __init__(
        self,
        compile_kind: Callable[[StepKind], Callable[..., Any]],
        schedule: StepSchedule,
        state_index: int = 1,
        lag: int = 2,
        check_every: int = 8,
        counts_in_program: bool = False,
        params_index: int | None = None,
        where_state: str = "pass state_index= the position of opt_state",
    ):
        if not isinstance(schedule, StepSchedule):
            raise ValueError(
                f"dispatch_by_kind needs an optax_zero_one.StepSchedule (e.g. "
                f"ozo.zero_one_schedule(...)), got {schedule!r}."
            )
        jitted = isinstance(compile_kind, _JITTED) or (  # jax.jit's, or jax.pmap's function
            inspect.isfunction(compile_kind) and hasattr(compile_kind, "lower")
        )
        if not callable(compile_kind) or jitted:
            what = "a jitted step" if callable(compile_kind) else repr(compile_kind)
            raise ValueError(
                f"dispatch_by_kind's compile_kind must be a function from a step kind to that "
                f"kind's step program, e.g. lambda kind: jax.jit(functools.partial(step, "
                f"step_kind=kind)); got {what}."
            )
        if not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag must be an int >= 1, got {lag!r}.")
        if not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be an int >= 1, got {check_every!r}.")
        for name, index in (("state_index", state_index), ("params_index", params_index)):
            if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
                raise ValueError(f"{name} must be an int (a position), got {index!r}.")
        self._compile = compile_kind
        self.schedule = schedule
        self._state_index = state_index
        self._where_state = where_state  # what to do where that argument holds no state
        self._lag = lag
        self.check_every = check_every
        self._since_check = 0
        self.programs: dict[str, Callable[..., Any]] = {}
        self._ran: set[str] = set()  # kinds whose program has run (so is compiled)
        # with counts_in_program, compile_kind's programs also return the counts of the state
        # they return (with_counts): called by the dispatcher; programs drops the counts
        self._counted = counts_in_program
        self._raw: dict[str, Callable[..., Any]] = {}
        self._walk = kinds._Walk(schedule)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._last_counter: Any = None
        self._last_refused: list = []
        self._confirmed: np.ndarray | None = None  # the last settled snapshot
        self._types: list[type] = []  # the states whose refused hints a snapshot holds
        self._layout: tuple[Any, list[int], list[type], list | None] | None = None  # _probe
        self._probed: set[str] = set()  # the kinds whose program's output _probe has flattened
        self._lock = threading.Lock()  # installing programs (precompile_in_background)
        self._entry = threading.RLock()  # one thread at a time in a call (_one_thread)
        self._waiting: dict[str, concurrent.futures.Future] = {}  # kinds compiling in background
        self.step: int | None = None
        self.skipped = 0
        self.lost = 0
        self._compared = False  # the workers' shared values compared since the last restore
        self._stalled = 0  # steps skipped in a row (whole windows), as last settled
        self._warned_stalled = False
        self._params_index = params_index  # where the params are among the results, if known
        self._params_checks = 0  # syncs after which the workers' params were compared
        self._after_local = False  # a local step ran since then
        self._agreed = False  # the processes compared (schedule, step, arguments) since then
        self._returned: Any = None  # the first leaf of the params the last call returned
        self._returned_tree: Any = None  # and their tree's structure

    @_one_thread
    def next_kind(self, state: Any) -> StepKind:
        """The kind the next call with ``state`` will run (reads the counter if ``state`` is
        not the one this dispatcher returned last, and settles the steps the call would
        settle first: a skip found there moves the step back)."""
        self._sync_with(state)
        self._settle_with(state)
        return self._walk.kind(kinds._check_step(self.step))

    def program(self, kind: StepKind) -> Callable[..., Any]:
        """The program for ``kind`` (compiled at its first use, unless precompiled)."""
        if kind.name not in self.programs:
            waiting = self._waiting.get(kind.name)
            if waiting is not None:  # compiling in the background: wait for it
                waiting.result()
            with self._lock:
                if kind.name not in self.programs:
                    self._install(kind.name, self._compile(kind))
        return self.programs[kind.name]

    def _install(self, name: str, raw: Callable[..., Any]) -> None:
        if not callable(raw):
            raise ValueError(
                f"compile_kind({name!r}) returned {raw!r}: it must return the step program of "
                "that kind (a function; jitted)."
            )
        self._raw[name] = raw
        self.programs[name] = (lambda *a: raw(*a)[0]) if self._counted else raw

    @_one_thread
    def precompile(
        self,
        *args: Any,
        kinds: Sequence[StepKind] | None = None,
        max_workers: int | None = None,
    ) -> dict[str, float]:
        """Compiles now, several at once, the programs of the kinds the run will meet.

        Without it each kind's program is compiled at the kind's first step: the first step,
        then, at the variance freeze, mid-run, each of phase B's kinds (0/1 Adam: a stall of a
        few compiles hours into a run, and any compile error only then). ``precompile`` lowers
        the programs one after the other and compiles each on a thread of its own while the
        next is lowered (XLA releases the GIL while it compiles), so all kinds together take
        less time than one after the other (measured: docs/benchmarks/overhead.md). Each call
        after runs the precompiled executable; one whose arguments differ from these (shapes,
        dtypes, shardings) warns once and falls back to compiling for them, as ``jax.jit``
        would, and later calls like precompile's run the precompiled executable again. The
        programs of ``compile_kind`` must have ``.lower`` (``jax.jit`` and
        ``jax.pmap`` functions and :meth:`~optax_zero_one.DataParallel.jit` do).

        Args:
          *args: the step's arguments, or ``jax.ShapeDtypeStruct``\\ s with the same shapes,
            dtypes and shardings. With the real optimizer state the kinds still ahead are
            those from its step on (phase B's alone after the freeze); with shapes only, all
            the schedule's run meets from step 1.
          kinds: the kinds to compile (default: as above). Kinds already compiled are skipped.
          max_workers: compile threads (default: the number of kinds, at most the CPU count).

        Returns:
          Seconds spent on each kind compiled now (lowering and compiling; they overlap).
        """
        with self._lock:
            compiling = list(self._waiting.values())
        for future in compiling:  # a background precompile's kinds: done, or failed and due here
            future.result()
        return self._precompile(self._ahead_of_time(args, kinds), args, max_workers)

    @_one_thread
    def precompile_in_background(
        self,
        *args: Any,
        kinds: Sequence[StepKind] | None = None,
        max_workers: int | None = None,
    ) -> concurrent.futures.Future:
        """:meth:`precompile` on a thread of its own, while the run goes on: phase A's steps run
        while phase B's programs compile, so neither the start nor the freeze waits for them
        (a step whose kind is still compiling waits for that kind alone). The compiles share
        the host's cores with the run meanwhile. Takes the same arguments (real arrays are
        read for their shapes, dtypes and shardings before this returns, so the run may
        donate them); returns a ``Future`` of :meth:`precompile`'s result, whose ``result()``
        raises a compile error (the kinds it did not compile then compile at their first step,
        which raises the error of its own if it has one)."""
        programs = self._ahead_of_time(args, kinds)
        shapes = jax.tree.map(_shape_of, args)
        waiting = {name: concurrent.futures.Future() for name in programs}
        with self._lock:
            self._waiting.update(waiting)
        done: concurrent.futures.Future = concurrent.futures.Future()
        config = _thread_config()  # `with jax.default_matmul_precision(...)` and the like

        def run() -> None:
            try:
                _enter_thread_config(config)
                done.set_result(self._precompile(programs, shapes, max_workers, waiting))
            except BaseException as err:
                # a step waiting for a kind not compiled compiles it itself, and raises its own
                # error if it has one: given this one, a step of another kind raised it, and a
                # good step that of a precompile given other shapes (a trial)
                with self._lock:
                    for name, future in waiting.items():
                        self._waiting.pop(name, None)
                        if not future.done():
                            future.set_result(None)
                done.set_exception(err)

        # not a daemon: Python ends a daemon thread inside JAX's lowering at exit by force, which
        # aborted the process (a trial: 3 of ~30 scripts that ended while it lowered); this one
        # stops after the kind it is lowering when the interpreter exits (_EXITING)
        threading.Thread(target=run, name="precompile").start()
        return done

    @_one_thread
    def memory_analysis(
        self, *args: Any, kinds: Sequence[StepKind] | None = None
    ) -> dict[str, KindMemory]:
        """What one device holds while each kind's program runs, from XLA's buffer assignment:
        whether the run fits, known before its first step.

        The kinds' programs differ in what they hold beside the arguments (0/1 Adam's sync
        step several buffers the size of the params, its local step one; figures in
        ``docs/jit.md``, "Memory"), and each is compiled at its kind's first step: a run that
        fits at step 1 may not at the variance freeze, hours in. This compiles the kinds not
        compiled yet, as :meth:`precompile` does (later steps run those executables), and
        reads each one's ``memory_analysis()``; a kind compiled at a step already, or
        precompiled for other arguments (another batch size: "which batch fits?"), is compiled
        once more for these to be read, and the run keeps the program it had. A state other
        than the one the run holds (a fresh ``init``) makes the dispatcher read its step
        counter, as a call with it would: pass the live state, or shapes.

        Args:
          *args: as for :meth:`precompile` (the step's arguments, or ``jax.ShapeDtypeStruct``\\ s).
          kinds: the kinds to read, or one kind (default: as :meth:`precompile`'s, those
            still ahead).

        Returns:
          :class:`KindMemory` by kind name, in bytes per device (a program over several
          devices, as ``dp.jit``'s or a ``pmap``'s, holds this on each of them; a ``vmap``
          over simulated workers on one device holds all the workers' on that one).
        """
        wanted = self._kinds_ahead(args, kinds)
        self.precompile(*args, kinds=wanted)
        signature = _signature(args)
        out = {}
        for kind in wanted:
            waiting = self._waiting.get(kind.name)
            if waiting is not None:  # compiling in the background: read it when it is done
                waiting.result()
            raw = self._raw.get(kind.name)
            compiled = raw.compiled if isinstance(raw, _Precompiled) else None
            if compiled is not None and raw.signature != signature:
                compiled = None  # precompiled for other arguments (another batch size)
            if compiled is None:  # compiled at a step, or for others: compiled for these
                compiled = self._compile(kind).lower(*args).compile()
            out[kind.name] = KindMemory.of(compiled, f"the {kind.name!r}")
        return out

    def _kinds_ahead(self, args: tuple, kinds: Sequence[StepKind] | None) -> list[StepKind]:
        """``kinds`` (checked against the schedule), or the kinds still ahead of the state in
        ``args`` (every kind from step 1 where ``args`` are shapes only)."""
        if isinstance(kinds, StepKind):
            kinds = [kinds]
        state = args[self._state_index]
        counter, _ = self._probe(state)
        abstract = isinstance(counter, jax.ShapeDtypeStruct)
        if kinds is None:
            if not abstract:
                self._sync_with(state)
            # shapes only: the step is not known, so every kind the schedule has from step 1
            # (a DiLoCo schedule has no compressed step, nor a pass-through without start_step)
            kinds = self.schedule.kinds_from(1 if abstract else self.step)
        unknown = [k for k in kinds if k not in self.schedule.kinds]
        if unknown:
            raise ValueError(
                f"kinds= got {unknown}, not kinds of this schedule "
                f"({list(self.schedule.names)}): pass kinds from schedule.kinds."
            )
        return list(dict.fromkeys(kinds))

    def _ahead_of_time(
        self, args: tuple, kinds: Sequence[StepKind] | None
    ) -> dict[str, Callable[..., Any]]:
        """The programs (built, not compiled) of the kinds to precompile: ``kinds``, or those
        still ahead of the state in ``args``, less those compiled or compiling already."""
        programs = {}
        for kind in self._kinds_ahead(args, kinds):
            # compiled: by precompile, or at a step that ran (a first call that failed, e.g. on
            # a refused restore, installed a program it never compiled)
            done = kind.name in self._ran or isinstance(self._raw.get(kind.name), _Precompiled)
            if done or kind.name in self._waiting:
                continue
            program = programs[kind.name] = self._compile(kind)
            if getattr(program, "lower", None) is None:
                raise ValueError(
                    f"precompile and memory_analysis need programs with .lower (jax.jit or "
                    f"jax.pmap); "
                    f"compile_kind({kind.name!r}) returned {program!r}. Jit it, or let "
                    "each kind compile at its first step."
                )
        return programs

    def _precompile(
        self,
        programs: dict[str, Callable[..., Any]],
        args: tuple,
        max_workers: int | None,
        waiting: dict[str, concurrent.futures.Future] | None = None,
    ) -> dict[str, float]:
        """Lowers ``programs`` in turn, compiles each on a pool thread while the next lowers,
        and installs each as soon as it is compiled (then sets its ``waiting`` future)."""
        seconds: dict[str, float] = {}
        workers = max_workers or max(1, min(len(programs), os.cpu_count() or 1))
        signature = _signature(args)

        def compile_one(name: str, lowered: Any, started: float) -> None:
            compiled = lowered.compile()
            seconds[name] = time.perf_counter() - started
            with self._lock:
                self._install(name, _Precompiled(compiled, programs[name], name, signature))
                if waiting is not None:
                    self._waiting.pop(name, None)
                    waiting[name].set_result(None)

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = []
            for name, program in programs.items():
                if waiting is not None and _EXITING.is_set():  # the interpreter is exiting
                    with self._lock:
                        for left in programs.keys() - {n for n, _ in futures}:
                            self._waiting.pop(left, None)
                            waiting[left].set_result(None)
                    break
                started = time.perf_counter()
                futures.append(
                    (name, pool.submit(compile_one, name, program.lower(*args), started))
                )
            for _, future in futures:
                future.result()
        return seconds

    @_one_thread
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            called = "step_kind=" if "step_kind" in kwargs else f"{', '.join(kwargs)}="
            raise TypeError(
                f"The dispatcher takes the step's arguments by position, got {called}. "
                + (
                    "The dispatcher chooses each step's kind itself: call it without one, "
                    "train(params, opt_state, batch). If your code does not pass step_kind= "
                    "here, compile_kind seems to call the dispatcher itself: was the "
                    "dispatcher bound to the name of the step function that compile_kind "
                    "reads (train_step = ozo.dispatch_by_kind(...))? Give it a new name "
                    "(step = ozo.dispatch_by_kind(...))."
                    if "step_kind" in kwargs
                    else "Pass them by position."
                )
            )
        if not -len(args) <= self._state_index < len(args):
            raise ValueError(
                f"state_index={self._state_index}, but the step got {len(args)} arguments: "
                "pass state_index= the position of opt_state among them."
            )
        check_not_traced(_graph.first_leaf(args[self._state_index]), "The dispatcher")
        self._sync_with(args[self._state_index])
        if not self._agreed:  # before any program that would wait on a process in vain
            # dp.jit's (counts in the program): the params are its first argument and result
            params_at = self._params_index if self._counted else None
            check_processes_agree(self.schedule, self.step, args, self._state_index, params_at)
            self._agreed = True
        # before this step's program: an error leaves the caller's state as it was (not donated)
        self._settle_with(args[self._state_index])
        kind = self._walk.kind(kinds._check_step(self.step))  # past int32's counters: an error
        self.program(kind)
        checks_params = (
            self._params_index is not None
            and self._params_checks < PARAMS_CHECKS
            and kind.sync
            and self._after_local
        )
        # the params before the sync, read before the step donates them: how far apart the
        # workers' rounding may leave them (check_params_agree). They are the argument that
        # holds the last call's returned params (params_index is their place among the
        # results; among the arguments it may differ), else the first of their structure
        # (another step ran between: a GAN's other model's); none found: the plain bound
        given = None
        if checks_params and self._returned is not None:
            given = next((a for a in args if _graph.first_leaf(a) is self._returned), None)
            if given is None:
                same = (a for a in args if jax.tree.structure(a) == self._returned_tree)
                given = next(same, None)
        before = _peaks(given, self._last_counter) if given is not None else None
        out = self._raw[kind.name](*args)
        self._ran.add(kind.name)
        counts = None
        if self._counted:
            out, counts = out
        if kind.name not in self._probed:
            self._check_results(out)
        # a program's output has the structure of its input: probed in full once per program
        counter, refused = self._probe(out[self._state_index], kind.name in self._probed)
        self._probed.add(kind.name)
        self._types = [cls for cls, _ in refused]
        # Reading a value back costs the host a device-to-host copy (~0.2 ms on a GPU host,
        # docs/benchmarks/overhead.md): the counts are read once every check_every steps
        self._since_check += 1
        checked = self._since_check >= self.check_every
        if checked:
            self._since_check = 0
            counts = _first_shard(counts) if self._counted else _host_counts(counter, refused)
            counts.copy_to_host_async()
            # once: where local steps have begun; without local steps (1-bit Adam: every step
            # averages, so the params themselves are alike on every worker), at once
            every_step_averages = self.schedule.local_step_policy is None
            if not self._compared and (every_step_averages or not kind.phase_a):
                # the leading axis is the workers' where dp.jit says so, or where the step
                # returns params in the worker layout (params_index): also for a state without
                # flat buffers (a float-sync diloco), whose layout records no worker count
                known = self._counted or self._params_index is not None
                params = None
                if every_step_averages and self._params_index is not None:
                    params = out[self._params_index]
                check_workers_agree(out[self._state_index], counter, self.step, known, params)
                self._compared = True  # once done: an interrupt inside leaves it to do again
        if self._params_index is not None and self._params_checks < PARAMS_CHECKS:
            # at the first syncs after a local step (the workers apart before it): a sync lands
            # every worker on the same point. More than one: a wrapper with a period of its own
            # (optax.lookahead every 5 steps) may agree at one sync and part at the next (a trial)
            if checks_params:
                try:
                    layout = flat.find_layout(out[self._state_index])
                    passed = _passed_through(self._raw[kind.name])
                    check_params_agree(
                        out[self._params_index], counter, self.step, before, layout, passed
                    )
                except ValueError as apart:
                    self._explain(out[self._state_index], counter, refused, kind, apart)
                    raise
                self._params_checks += 1  # once done, as above
            self._after_local = self._after_local or not (kind.phase_a or kind.sync)
            # what the next call passes, if it is a checked sync (none before local steps:
            # phase A's steps pay nothing for it)
            self._returned = (
                _graph.first_leaf(out[self._params_index]) if self._after_local else None
            )
            self._returned_tree = (  # a flatten: only where _returned is kept
                jax.tree.structure(out[self._params_index]) if self._after_local else None
            )
        self._pending.append(_Pending(self.step, kind, counts, checked))
        self._last_counter, self._last_refused = counter, refused
        self.step += 1
        return out

    def _explain(
        self, state: Any, counter: Any, refused: list, kind: Any, found: Exception
    ) -> None:
        """Raises the cause of ``found`` (params apart after a sync) where it is not a wrapper
        after the optimizer: a refused hint (the sync did not run: the schedule is not the
        optimizer's), or synchronised points that differ (the workers started apart)."""
        # this process's workers only: the other processes may have found nothing to explain
        check_workers_agree(state, counter, self.step, True, across_processes=False)
        counts = np.asarray(_host_counts(counter, refused))
        if np.any(counts[1:-1:2] > 0):
            raise ValueError(
                f"The optimizer state refused the {kind.name!r} program of step {self.step} (and "
                "the workers' params are apart after it, as a sync that did not run leaves "
                "them): the schedule given to the dispatcher is not the optimizer's. Build it "
                "from the optimizer's own arguments: ozo.diloco_schedule(sync_every, "
                "start_step) for diloco, ozo.zero_one_schedule(...) for zero_one_adam, "
                "ozo.local_step_schedule(policy, start_step) for local_step_sync."
            ) from found

    def _check_results(self, out: Any) -> None:
        """Raises ``ValueError`` where ``state_index`` or ``params_index`` does not name the
        state or the params among a program's results (once per kind)."""
        count = len(out) if isinstance(out, tuple | list) else None
        for name, index in (
            ("state_index", self._state_index),
            ("params_index", self._params_index),
        ):
            if index is not None and (count is None or not -count <= index < count):
                got = f"{count} results" if count is not None else "one result, not a tuple"
                raise ValueError(
                    f"{name}={index}, but the step returned {got}: the step returns the params "
                    "and the state it was given (e.g. (params, opt_state, loss)), and "
                    f"{name} is the position of the {name.split('_')[0]} among them."
                )
        if self._params_index is not None and (
            _graph.step_counter(out[self._params_index]) is not None
        ):
            raise ValueError(
                f"params_index={self._params_index} names an optimizer state among the step's "
                "results: pass the position of the params (e.g. 0 for (params, opt_state))."
            )

    @_one_thread
    def settle(self) -> None:
        """Checks every step still in flight (waits for them); raises as a call would."""
        if self._pending and not self._pending[-1].checked:
            tail = self._pending[-1]
            if tail.counts is not None:
                tail.counts, tail.checked = _first_shard(tail.counts), True
            elif not getattr(self._last_counter, "is_deleted", lambda: True)():
                # the state this dispatcher returned last is still held: its counts
                tail.counts = _host_counts(self._last_counter, self._last_refused)
                tail.checked = True
        self._settle_due(0)
        if self._pending:  # no count readable after them: the next call reads the counter
            self._pending.clear()
            self._last_counter = None

    def _settle_with(self, state: Any) -> None:
        """:meth:`_settle_due` before a call with ``state``; where the steps do not add up and
        the state holds several optimizers, the error also names the cause that is theirs (one
        skipped a non-finite step the others took, so their counts parted)."""
        try:
            self._settle_due(self._lag)
        except ValueError as err:
            found = _graph.step_counters(state)
            if len(found) < 2:
                raise
            raise ValueError(
                f"{err} Or: the state holds several step counters "
                f"({', '.join(path or 'the state' for path, _ in found)}); the dispatcher "
                "follows the first (optax.multi_transform orders its groups by label, sorted), "
                "so its optimizers must share one schedule (else dispatch each in a step of "
                "its own); or one skipped a step the others took (a non-finite gradient in its "
                "part of the tree; each skips its own), so their steps parted. " + _SKIP_TOGETHER
            ) from err

    def _settle_due(self, lag: int) -> None:
        """Settles the steps up to each checked one that has ``lag`` steps after it (the device
        has those queued while the host reads)."""
        while True:
            last = next((i for i, p in enumerate(self._pending) if p.checked), None)
            if last is None or len(self._pending) - 1 - last < lag:
                return
            # all or nothing: an interrupt (Ctrl-C while the host waits for the counts) left
            # the window popped and the count moved, so a skip in it was never accounted for,
            # and the run stalled, then raised a false "refused" (a review)
            saved = self._settled_fields()
            try:
                self._settle([self._pending.popleft() for _ in range(last + 1)])
            except ValueError:  # the dispatcher's own verdict on these steps
                raise
            except BaseException:
                self._restore_settled(saved)
                raise

    # the scalars _settle and _predict change (beside the pending steps and their stale flags)
    _SETTLED = ("_confirmed", "skipped", "lost", "step", "_stalled", "_warned_stalled")

    def _settled_fields(self) -> tuple:
        """What :meth:`_settle` and :meth:`_predict` change, to put back."""
        pending = list(self._pending)
        return pending, [p.stale for p in pending], [getattr(self, f) for f in self._SETTLED]

    def _restore_settled(self, saved: tuple) -> None:
        pending, stale, values = saved
        self._pending.clear()
        self._pending.extend(pending)
        for p, was in zip(pending, stale, strict=True):
            p.stale = was
        for field, value in zip(self._SETTLED, values, strict=True):
            setattr(self, field, value)

    def _probe(self, state: Any, trusted: bool = False, counter_only: bool = False) -> tuple:
        """The state's step counter and its refused-hint arrays, found through the hooks once
        per tree structure and then by position (one flatten per step, not a walk per hook).
        ``trusted``: ``state`` has the structure last probed (a program's output, the program's
        first already probed), so the arrays are read by their key paths, without a flatten
        (~1 us against ~10 us at 23 leaves: host time each step)."""
        if trusted and self._layout is not None and self._layout[3] is not None:
            paths = self._layout[3][:1] if counter_only else self._layout[3]
            try:
                found = [_follow(state, path) for path in paths]
            except (AttributeError, IndexError, KeyError, TypeError):
                pass
            else:
                return found[0], list(zip(self._layout[2], found[1:]))
        leaves, treedef = jax.tree.flatten(state)
        if self._layout is None or self._layout[0] != treedef:
            _check_one_update_per_call(state)
            counter = _graph.step_counter(state)
            refused = _graph.refusals(state)
            at = {id(x): i for i, x in enumerate(leaves)}
            wanted = [counter] + [r for _, r in refused]
            if counter is None or any(id(x) not in at for x in wanted):
                return counter, refused  # not arrays of this tree: no shortcut
            where = [at[id(x)] for x in wanted]
            self._layout = (treedef, where, [cls for cls, _ in refused], _paths(state, where))
        _, where, types, _ = self._layout
        return leaves[where[0]], [(cls, leaves[i]) for cls, i in zip(types, where[1:])]

    def _sync_with(self, state: Any) -> None:
        if self._last_counter is not None:  # a loop passing back the last state: no flatten
            counter, _ = self._probe(state, trusted=True, counter_only=True)
            if counter is self._last_counter and not _deleted(counter):
                return  # (deleted: a donating call interrupted after it took them, said below)
        counter, refused = self._probe(state)
        if _deleted(counter):
            raise consumed("opt_state", "no donation (donate=False, or no donate_argnums)")
        if counter is None:
            _graph.check_not_nnx_state(state, "The step dispatched by kind")
            raise ValueError(
                f"Argument {self._state_index} of the step holds no optimizer state of "
                "optax_zero_one (no step counter). A schedule names the step kinds of this "
                "library's optimizers (zero_one_adam, onebit_adam, diloco, local_step_sync), "
                "whose states count their steps: with another optimizer, drop the schedule; "
                f"else {self._where_state}."
            )
        if counter is not self._last_counter:  # first call, or a state from elsewhere
            _check_one_count(state)
            _graph.check_no_per_worker_skip(state, "The step dispatched by kind")
            confirmed = np.asarray(_host_counts(counter, refused))
            _check_one_run(int(confirmed[-1]), counter)
            # a first call, or a restore: also one at the step this run is at (another run's
            # checkpoint of the same cadence was taken on trust, a trial), or a copy. Checked
            # before the dispatcher takes it: refused, the run goes on with its own state
            checkpoint.restore_checks(state, self.schedule, int(confirmed[0]), self._walk)
            self._pending.clear()
            self._types = [cls for cls, _ in refused]
            self._confirmed = confirmed
            self.step = int(self._confirmed[0]) + 1
            self._last_counter, self._last_refused = counter, refused
            self._since_check = 0
            self._compared = self._after_local = self._agreed = False
            self._params_checks = 0

    def _settle(self, window: list[_Pending]) -> None:
        """Checks the steps of ``window`` against the counts after its last one."""
        now = np.asarray(window[-1].counts).reshape(-1)
        # a program's own counts come per worker of this process's first device: rows to compare
        rows = now.reshape(-1, 2 + 2 * len(self._types)) if self._counted else now[None]
        _check_one_run(max(int(np.ptp(rows[:, 0])), int(rows[:, -1].max())), None)
        now = rows[0]
        before, self._confirmed = self._confirmed, now
        taken = int(now[0] - before[0])
        # A refused step raises each refusing state's count by one: at least the largest rise
        # refused.
        rises = [int(now[1 + 2 * i] - before[1 + 2 * i]) for i in range(len(self._types))]
        refused = max(rises, default=0)
        self._stalled = 0 if taken else self._stalled + len(window)
        if self._stalled >= STALLED_WARNING and not self._warned_stalled:
            self._warned_stalled = True
            warnings.warn(
                f"the last {self._stalled} calls were all skipped (the state's step count "
                f"stays at {int(now[0])}): "
                "each update was not finite, so the state kept its counters and the run makes "
                "no progress. Look at the gradients (a NaN or Inf in the loss, a learning rate "
                "too large, fp16 overflow), at the params, which a step can have made "
                "non-finite, and at the hyperparameters at this step (a learning-rate schedule "
                "that is NaN or Inf past its horizon, e.g. sqrt(1 - count / total)); the "
                "state's skipped_updates counts these steps.",
                RuntimeWarning,
                stacklevel=4,
            )
        if taken:
            self._warned_stalled = False
        if taken == len(window) and not refused:
            return
        asked = "; ".join(
            f"{cls.__name__} asked for {cls.BRANCHES[int(now[2 + 2 * i]) - 1]}"
            for i, cls in enumerate(self._types)
            if rises[i]
        )
        if taken == len(window):  # the counter followed took every step, another state refused
            raise ValueError(
                f"Of steps {window[0].step} to {window[-1].step}, the optimizer state's first "
                f"step counter took every step while other states in it refused {refused} "
                f"({asked} at the last refusal); a refused step is not applied. Either a "
                "transform inside the optimizer has a schedule of its own (e.g. an inner "
                "ozo.scheduled_mean whose warm-up policy ends at another step than diloco's or "
                "local_step_sync's start_step: give it the same), or the state holds several "
                "optimizers on different schedules (e.g. optax.multi_transform of two with "
                "another var_freeze_step), and one dispatcher follows one schedule: give them "
                "the same policies, or dispatch each optimizer's update in a step of its own "
                "(its own dispatch_by_kind, its state argument holding that optimizer's state "
                "only)."
            )
        # Some steps were not taken: hints refused, or non-finite steps skipped.
        skipped = max(len(window) - taken - refused, 0)
        expected = sum(p.stale for p in window)  # dispatched before the host learnt of a skip
        if refused > expected and not skipped:
            sent = ", ".join(sorted({repr(p.kind.name) for p in window}))
            raise ValueError(
                f"Of steps {window[0].step} to {window[-1].step}, run with the programs for "
                f"the {sent} kinds (from the schedule given to dispatch_by_kind), the optimizer "
                f"state refused {refused}: its counters expected other kinds ({asked} at the "
                "last refusal). A refused step is not applied. The schedule is not the "
                "optimizer's: build it from the same policies, with the optimizer's own "
                "arguments: ozo.zero_one_schedule(var_freeze_step=..., ...) for zero_one_adam, "
                "ozo.onebit_schedule(freeze_step) for onebit_adam, "
                "ozo.diloco_schedule(sync_every, start_step) for diloco, "
                "ozo.StepSchedule(variance_policy, local_step_policy) for blocks of your own. "
                "If the state was restored from a run with other schedule arguments, resume "
                "with that run's: a state carries its policies' history (the sync intervals so "
                "far, whether local steps have begun), which new arguments do not replay "
                "(docs/reliability.md)."
            )
        self.lost += refused
        self.skipped += skipped
        self._predict()

    def _predict(self) -> None:
        """The step number of the next call, from the last count the host knows and the kinds
        of the calls still in flight: each will be taken if its kind is the one due at the
        state's step then, refused otherwise (a refusal the host then expects: ``stale``)."""
        count = int(self._confirmed[0])
        walk = kinds._Walk(self.schedule)
        for later in self._pending:
            taken = later.kind == walk.kind(count + 1)
            later.stale = not taken
            count += taken
        self.step = count + 1


Samples = dict[tuple, list[tuple[int, np.ndarray]]]


def _samples_of(leaves: Sequence[jax.Array]) -> list[Samples]:
    """Up to 64 elements of each worker's row of each of ``leaves`` (leading axis: the
    workers), from the shards this process holds, grouped by where the shard lies besides the
    worker axis (model shards hold different values), in worker order. Taken on each device by
    one program for all the leaves' shards there (:func:`_sample_rows`,
    :func:`~optax_zero_one.integration.distributed.on_each_device`)."""
    shards = [
        (i, shard, shard.data.shape[0] if isinstance(shard.index[0], slice) else 1)
        for i, leaf in enumerate(leaves)
        for shard in leaf.addressable_shards
        if shard.data.size  # index[0]: a slice, or an int where a sharding drops the axis
    ]
    taken = distributed.on_each_device(
        _sample_rows, [s.data for _, s, _ in shards], tuple(c for _, _, c in shards)
    )
    out: list[Samples] = [{} for _ in leaves]
    for (i, shard, count), sample in zip(shards, jax.device_get(taken), strict=True):
        lead = shard.index[0]
        first = (lead.start or 0) if isinstance(lead, slice) else int(lead)
        rows = out[i].setdefault(_where(shard.index), [])
        rows.extend((first + r, sample[r]) for r in range(count))
    for samples in out:  # in worker order, whatever the devices' order
        for rows in samples.values():
            rows.sort(key=lambda row: row[0])
    return out


@functools.partial(jax.jit, static_argnums=1)
def _sample_rows(blocks: tuple, counts: tuple) -> tuple:
    """Up to 64 evenly spaced elements of each of ``counts[i]`` rows of each block (one
    device's shards), ``(count, <= 64)`` each."""
    out = []
    for block, count in zip(blocks, counts, strict=True):
        rows = block.reshape(count, -1)
        out.append(rows[:, :: max(1, rows.shape[1] // 64)][:, :64])
    return tuple(out)


def _worker_leaves(tree: Any, counter: Any) -> list[tuple[Any, jax.Array]]:
    """``(key path, leaf)`` of the arrays of ``tree`` with a leading axis of one entry per
    worker (``counter``'s leading axis), none if there is no worker axis."""
    workers = np.shape(counter)[0] if np.ndim(counter) else 0  # (workers, model shards...)
    return [
        (path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if workers > 1 and isinstance(leaf, jax.Array) and np.shape(leaf)[:1] == (workers,)
    ]


@outside_user_mesh
def check_workers_agree(
    state: Any,
    counter: Any,
    step: int | None = None,
    worker_axis: bool = False,
    params: Any = None,
    across_processes: bool = True,
) -> None:
    """Raises ``ValueError`` if the values every worker must hold alike (the ``SHARED`` fields
    of the states in ``state``: ``local_step_sync``'s last synchronised point; and ``params``
    if given, for an optimizer whose every step averages: 1-bit Adam's) differ between the
    workers this process holds, compared on up to 64 elements of each leaf per worker.

    Nothing in the compiled programs can see it (that would take a collective per step), and
    it does not heal: workers that did not start from the same params, or a ``start_step``
    whose inner transform does not average, train apart for good while every step succeeds.
    A dispatcher calls this once, on the first checked step after local steps begin (a read
    back from the device, once per run or restore). ``counter`` (the state's step counter) says
    where the workers are: a leading axis of one entry per worker (then maybe one per model
    shard: values are compared between shards of the same block only), or none (one worker:
    nothing to compare). Whether that leading axis is the workers' (and not, say, a ``vmap``
    over independent one-worker models) is read from the state's flat layouts, which record
    the worker count; without one, only where the caller knows it (``worker_axis``:
    ``dp.jit``, or a step whose params are named). With several processes the workers of
    other processes are compared too (one small all-gather: every process must make this
    call, unless ``across_processes=False``)."""
    layout = flat.find_layout(state)
    if (layout.num_workers if layout is not None else 2 if worker_axis else 1) < 2:
        return
    named = [
        (f"{cls.__name__}.{cls.SHARED}{jax.tree_util.keystr(path)}", leaf)
        for cls, value in _graph.shared_values(state)
        for path, leaf in _worker_leaves(value, counter)
    ]
    named += [
        (f"the params{jax.tree_util.keystr(path)}", leaf)
        for path, leaf in _optimized_leaves(params, counter, layout)
    ]
    sampled = _samples_of([leaf for _, leaf in named])
    entries = [(name, leaf, s) for (name, leaf), s in zip(named, sampled, strict=True)]
    at = "" if step is None else f" at step {step}"
    # the workers this process holds; then (every process takes part in the gather before any
    # raises, also the one that found its own workers apart) those of other processes
    # (across_processes=False where not every process makes this call: it would wait for them)
    inside = None
    for name, _, samples in entries:
        for found in samples.values():
            differs = [w for w, b in found if b.tobytes() != found[0][1].tobytes()]
            if differs and inside is None:
                inside = (name, f"worker {found[0][0]} and worker {differs[0]}")
    apart = _processes_apart(entries, inside is not None) if across_processes else None
    if inside is not None:
        _raise_apart(*inside, at)
    if apart is not None:
        name, first, other = apart
        if other < 0:  # another process found its own workers apart
            _raise_apart(name, f"the workers of process {first}", at)
        _raise_apart(
            name,
            f"the workers of process {first} and those of process {other}",
            at,
            " (across processes: each process must build the params from the same seed "
            "and the same data, not from its process index, and the optimizer with the same "
            "hyperparameters: a learning rate or weight decay that differs by process parts "
            "the workers too)",
        )


def _optimized_leaves(params: Any, counter: Any, layout: Any) -> list[tuple[Any, jax.Array]]:
    """The float leaves of ``params`` in the worker layout that the optimizer updates: where
    the state's flat ``layout`` names its leaves, those whose path ends with one of its names
    (the step may pass the optimizer a subtree, ``params["net"]``). Values kept beside them
    that each worker updates on its own (a batch norm's running statistics) are not compared:
    a review found 1-bit Adam's check refusing them."""
    leaves = [
        (path, leaf)
        for path, leaf in _worker_leaves(params, counter)
        if jnp.issubdtype(leaf.dtype, jnp.floating)  # not a key or counter kept beside them
    ]
    return [(path, leaf) for path, leaf in leaves if _is_optimizers(path, layout)]


def _is_optimizers(path: Any, layout: Any) -> bool:
    """Whether a leaf of the params (at ``path``) is one the optimizer updates: its path ends
    with the path of a leaf the optimizer was given (``layout``: the state's flat layout; the
    step may pass it a subtree); any leaf where they are not known."""
    names = tuple(layout.paths) if layout is not None else ()
    return not names or "" in names or flat._leaf_name(path).endswith(names)


def _raise_apart(name: str, where: str, at: str, hint: str = "") -> None:
    what = (
        "the params, the same on every worker where every step averages (1-bit Adam)"
        if name.startswith("the params")
        else "the last synchronised point, the same on every worker by design"
    )
    raise ValueError(
        f"The workers train apart: {name} ({what}) differs between {where}{at}, and no "
        "later sync brings them together. Either the workers did not start from the same "
        "params (build them with ozo.replicate(params, num_workers) or "
        "dp.to_workers(params), not with a key per "
        f"worker{hint}); or a local_step_sync / diloco with start_step > 0 has an inner "
        "transform that does not average up to start_step (docs/diloco.md shows one that "
        "does); or a wrapper acts on one worker alone: optax.apply_if_finite around the "
        "optimizer (it handles non-finite values itself), or a transform after it that "
        "changes its updates (docs/usage.md, 'What does not compose'); or the leading axis "
        "is not the workers: runs batched by an outer jax.vmap go inside the worker axis, "
        "(workers, runs, ...) (docs/usage.md, 'Batching independent runs')."
    )


def _where(index: tuple) -> tuple:
    """Where a shard lies besides the worker axis (its index's other entries, hashable)."""
    return tuple((s.start, s.stop) if isinstance(s, slice) else s for s in index[1:])


def _digest(data: bytes) -> int:
    """A 32-bit digest of ``data``, as a signed int (what :func:`distributed.host_allgather`
    gathers)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little", signed=True)


def _processes_apart(entries: list, inside: bool = False) -> tuple[str, int, int] | None:
    """With several processes: ``(name, process, other process)`` of the first leaf whose
    shared values differ between processes (compared where both hold the same part of it:
    model shards hold different values), or ``(name, process, -1)`` where that process found
    its own workers apart (``inside``: this one did), else ``None``. One small all-gather of
    a digest per leaf and part, on every process (a host-side collective, once per run)."""
    if jax.process_count() == 1 or not entries:
        return None
    keys = [
        (i, where)
        for i, (_, leaf, _) in enumerate(entries)
        for where in sorted(
            {_where(ix) for ix in leaf.sharding.devices_indices_map(leaf.shape).values()}, key=repr
        )
    ]
    mine = np.zeros((2, len(keys) + 1), np.int32)  # (digest, held); last: apart inside
    for k, (i, where) in enumerate(keys):
        found = entries[i][2].get(where)
        if found:
            mine[:, k] = _digest(found[0][1].tobytes()), 1
    mine[:, -1] = int(inside)
    every = distributed.host_allgather(mine)  # (processes, 2, keys + 1)
    flagged = np.flatnonzero(every[:, 0, -1])
    if flagged.size:
        return "a value shared by design", int(flagged[0]), -1
    for k, (i, _) in enumerate(keys):
        held = np.flatnonzero(every[:, 1, k])
        digests = every[held, 0, k]
        differs = held[digests != digests[:1]]
        if differs.size:
            return entries[i][0], int(held[0]), int(differs[0])
    return None


def check_processes_agree(
    schedule: StepSchedule | None,
    step: int,
    args: tuple,
    state: int,
    params: int | None = None,
    program: str | None = None,
) -> None:
    """With several processes: raises ``ValueError`` on every process if they do not run the
    same schedule, at the same step, on arguments of the same structure, shapes and dtypes
    (one small host all-gather at a dispatcher's first call and after a restore: every process
    must call the dispatcher, also where its arrays live on its own devices alone, as
    ``jax.pmap``'s do while its collectives span the processes). ``params``: the place of the
    params among ``args`` (named so in the error); ``program``: the text of the program about
    to run (``dp.jit`` without a schedule, where the kinds are decided in the program: one
    built with another ``var_freeze_step`` differs only in a constant), compared too.

    Each process dispatches on its own: a process whose schedule, optimizer or batch differs
    compiles other programs, whose collectives wait for partners that never come (trials: a
    ``var_freeze_step`` or ``collective`` that differed by process hung the job without a
    word; a batch of another size per process trained silently on other rows)."""
    if jax.process_count() == 1:
        return
    described = "" if schedule is None else repr(schedule)
    parts = [("the schedule", "" if " at 0x" in described else described)]
    described_args = []
    for i, arg in enumerate(args):
        leaves = [
            f"{jax.tree_util.keystr(path)}:{np.shape(x)}:{getattr(x, 'dtype', type(x).__name__)}"
            for path, x in jax.tree_util.tree_flatten_with_path(arg)[0]
        ]
        described_args.append(leaves)
        what = (
            "the optimizer state"
            if i == state
            else "the params"
            if i == params
            else f"argument {i} of the step"
        )
        parts.append((what, ";".join(leaves)))
    if program is not None:
        parts.append(("the step's program", program))
    digests = [step] + [_digest(text.encode()) for _, text in parts]
    every = distributed.host_allgather(np.asarray(digests, np.int32))
    differs = np.flatnonzero((every != every[:1]).any(axis=1))
    if not differs.size:
        return
    other = int(differs[0])
    if every[other, 0] != every[0, 0]:
        found = (
            f"process 0 is at step {int(every[0, 0])} and process {other} at step "
            f"{int(every[other, 0])} (restored from different checkpoints?)"
        )
    else:
        k = int(np.flatnonzero(every[other, 1:] != every[0, 1:])[0])
        differ = "differ" if parts[k][0] == "the params" else "differs"
        found = f"{parts[k][0]} {differ} between process 0 and process {other}"
        if 1 <= k <= len(args):  # every process gets here with the same k: one more gather
            found += _first_leaf_apart(described_args[k - 1], other)
        hint = {
            "the schedule": " (built with other arguments)",
            "the optimizer state": (
                " (an optimizer built with other arguments, e.g. collective= or mask=, or "
                "for another worker count)"
            ),
            "the params": " (a model built with other sizes)",
            "the step's program": (
                " although the arguments agree: an optimizer built with other "
                "hyperparameters (var_freeze_step, the learning rate, ...), or a step that "
                "reads jax.process_index() or another per-process value (pass such values "
                "in, or use jax.lax.axis_index inside the step)"
            ),
        }
        found += hint.get(parts[k][0], " (e.g. a batch of another size)")
    raise ValueError(
        f"The processes of this job do not run the same step: {found}. Every process must "
        "call the step with the same optimizer, schedule and argument shapes (the global "
        "batch, the same on each, or per-process data of the same size), from the same "
        "checkpoint; else their collectives wait on each other for good."
    )


def _first_leaf_apart(leaves: list[str], other: int, window: int = 512) -> str:
    """Where an argument's structure, shapes or dtypes differ between process 0 and process
    ``other``: the first of its leaves (``path:shape:dtype``) whose digest differs, as this
    process holds it. Host all-gathers of ``window`` digests at a time, until one differs:
    every process must call it (and makes the same calls, the counts gathered first)."""
    counts = distributed.host_allgather(np.asarray([len(leaves)], np.int32))[:, 0]
    for start in range(0, int(counts.max()), window):
        part = [_digest(x.encode()) for x in leaves[start : start + window]]
        mine = np.zeros(window, np.int32)
        mine[: len(part)] = part
        every = distributed.host_allgather(mine)
        apart = np.flatnonzero(every[other] != every[0])
        if apart.size:
            k = start + int(apart[0])
            if k >= len(leaves):
                break
            path, shape, dtype = leaves[k].rsplit(":", 2)
            return (
                f" in structure, shapes or dtypes, first at leaf {k} (here "
                f"{path or 'the leaf'}: {shape} {dtype})"
            )
    return f" in structure ({counts[0]} and {counts[other]} leaves)"


PARAMS_CHECKS = 3  # syncs after which a dispatcher compares the workers' params (a read each)


@outside_user_mesh
def _peaks(params: Any, counter: Any) -> dict[str, float]:
    """The largest magnitude among the sampled elements of each leaf of ``params`` (every
    worker's), by key path: what the rounding of a step on them scales with."""
    peaks = {}
    floats = [
        (path, leaf)
        for path, leaf in _worker_leaves(params, counter)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    ]
    for (path, _), samples in zip(floats, _samples_of([x for _, x in floats]), strict=True):
        rows = [r for found in samples.values() for _, r in found]
        peaks[jax.tree_util.keystr(path)] = max(
            (float(np.max(np.abs(r.astype(np.float64)), initial=0.0)) for r in rows),
            default=0.0,
        )
    return peaks


def _passed_through(program: Any) -> frozenset:
    """The key paths of the params leaves ``program`` returns as given, where it says
    (``dp.jit``'s programs record them from their traced program: ``passed_through``)."""
    found = getattr(program, "passed_through", None)
    if found is None:  # a precompiled program wraps the step's
        found = getattr(getattr(program, "program", None), "passed_through", None)
    return found or frozenset()


@outside_user_mesh
def check_params_agree(
    params: Any,
    counter: Any,
    step: int | None = None,
    before: dict[str, float] | None = None,
    layout: Any = None,
    passed: frozenset = frozenset(),
) -> None:
    """Raises ``ValueError`` if, right after a sync, the workers' params differ by more than
    the rounding of ``x + (xbar - x)`` in their dtype (a few ulps of the larger of ``x`` and
    ``xbar``; ``before``: the peaks of the params before the sync, :func:`_peaks`): a sync
    lands every worker on the synchronised point, unless something after the optimizer changed
    its update or a wrapper skipped it on one worker. ``passed``: the key paths of leaves the
    step's program returns as it was given them, which are not its optimizer's (another
    model's params, passed through a GAN's discriminator step: a trial found them refused
    mid-interval of their own); where the step changes a leaf at some steps only (a wrapper's
    slow weights) it is compared. A dispatcher that knows where the params are calls this
    after the first :data:`PARAMS_CHECKS` syncs that follow a local step (a read back from the
    device each, and one of the params before the sync). ``layout``: the
    state's flat layout, whose paths are the leaves the optimizer was given, to say so of a
    leaf that is none of them."""
    checked = [
        (path, leaf)
        for path, leaf in _worker_leaves(params, counter)
        if jnp.issubdtype(leaf.dtype, jnp.floating) and jax.tree_util.keystr(path) not in passed
    ]
    for (path, leaf), samples in zip(checked, _samples_of([x for _, x in checked]), strict=True):
        key = jax.tree_util.keystr(path)
        ulps = 8 * float(jnp.finfo(leaf.dtype).eps)
        # a worker's params before the sync may be far larger than the synchronised point (a
        # DiLoCo outer step lands near 0): x + (xbar - x) rounds at x's scale (a trial)
        prior = (before or {}).get(key, 0.0)
        for found in samples.values():
            first = found[0][1].astype(np.float64)
            scale = max(float(np.max(np.abs(first), initial=0.0)), prior, 1e-30)
            for worker, row in found[1:]:
                gap = float(np.max(np.abs(row.astype(np.float64) - first), initial=0.0))
                if gap > ulps * scale:
                    at = "" if step is None else f" after the sync of step {step}"
                    raise ValueError(
                        f"The workers' params differ{at}: leaf "
                        f"{_checks.leaf_name(path)} of worker {worker} is {gap:.3g} from "
                        f"worker {found[0][0]}'s, where a sync lands every worker on the same "
                        "point. Something after the optimizer changed its update (optax.scale, "
                        "clip, add_decayed_weights, contrib.reduce_on_plateau or lookahead "
                        "chained after it: chain clipping and weight decay before it), a "
                        "wrapper skipped a step on one worker (optax.apply_if_finite: the "
                        "optimizer handles non-finite values itself), or the optimizer never "
                        "saw this leaf (optax.masked passes a masked-out leaf's own gradient "
                        "through as its update: freeze leaves with optax.multi_transform and "
                        "optax.set_to_zero). docs/usage.md, 'What does not compose'."
                        + _not_the_optimizers(path, layout)
                    )


def _not_the_optimizers(path: Any, layout: Any) -> str:
    """A hint for a leaf of the params that the optimizer does not update (its path ends with
    none of ``layout``'s), if it is one: a value each worker may keep on its own (a review)."""
    if _is_optimizers(path, layout):
        return ""
    return (
        f" {_checks.leaf_name(path)} is not among the leaves the optimizer was given: if it "
        "holds values each worker updates on its own (a batch norm's running statistics), "
        "average them across the data axis at the syncs or keep them out of the params."
    )


def dispatch_by_kind(
    compile_kind: Callable[[StepKind], Callable[..., Any]],
    schedule: StepSchedule,
    *,
    state_index: int = 1,
    lag: int = 2,
    check_every: int = 8,
    params_index: int | None = None,
) -> KindDispatcher:
    """A step function that calls, at every step, a program compiled for that step's kind.

    ``compile_kind(kind)`` returns the program for one kind, typically your step with
    ``step_kind=kind`` passed on to the optimizer's ``update``, jitted or mapped as you run it.
    It is called once per kind, the first time the kind comes up (four programs at most for
    0/1 Adam, two for 1-bit Adam); the counters stay arrays, so no program recompiles as the
    steps go by.

    Args:
      compile_kind: maps a :class:`~optax_zero_one.StepKind` to a callable step.
      schedule: the optimizer's :class:`~optax_zero_one.StepSchedule` (same policies).
      state_index: the position of the optimizer state among the step's arguments and among
        its results (default 1: ``step(params, opt_state, ...) -> (params, opt_state, ...)``).
      lag: how many steps behind the host checks that the state took each step (it reads a
        counter copied in the background, so the device never waits for the host).
      check_every: the host reads the counters back once every ``check_every`` steps (each
        read costs the host a device-to-host copy, ~0.2 ms on a GPU host), and checks the
        steps since the last read together. A schedule that is not the optimizer's raises
        within ``check_every + lag`` steps; after a step every worker skipped (non-finite),
        the steps dispatched before the host learns of it whose kind then differs are not
        applied (``lost``: a few at most, around a change of kind).
      params_index: the position of the params among the step's results, if it returns them
        in the worker layout (e.g. ``0``). Then the workers' params are compared after the
        first three syncs that follow a local step (a sync lands them all on the same point;
        the params passed to each such sync, the argument holding the last call's returned
        params, are read too, for the rounding bound): a transform chained after the
        optimizer that changes its update, or ``optax.apply_if_finite`` around it, raises
        there instead of training the workers apart (``docs/usage.md``).

    Returns:
      A :class:`KindDispatcher`, called like the step.

    Example:
      >>> policies = dict(var_freeze_step=4, var_update_scaler=1, local_step_scaler=1,
      ...                 local_step_clipper=2)
      >>> tx = ozo.zero_one_adam(1e-2, axis_name="w", **policies)
      >>> schedule = ozo.zero_one_schedule(**policies)  # the same policies
      >>> def train_step(params, opt_state, grads, step_kind=None):  # one worker
      ...     updates, opt_state = tx.update(grads, opt_state, params, step_kind=step_kind)
      ...     return optax.apply_updates(params, updates), opt_state
      >>> def compile_kind(kind):
      ...     return jax.jit(jax.vmap(functools.partial(train_step, step_kind=kind), axis_name="w"))
      >>> step = ozo.dispatch_by_kind(compile_kind, schedule)
      >>> params = ozo.replicate({"w": jnp.zeros(8)}, 2)  # 2 workers
      >>> opt_state = jax.vmap(tx.init, axis_name="w")(params)
      >>> for k in range(8):
      ...     params, opt_state = step(params, opt_state, {"w": jnp.full((2, 8), 1.0 + k)})
      >>> sorted(step.programs)
      ['compressed', 'local', 'sync', 'variance']
    """
    return KindDispatcher(
        compile_kind, schedule, state_index, lag, check_every, params_index=params_index
    )
