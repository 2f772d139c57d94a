"""0/1 Adam on the data axis of any mesh, for ``jax.jit`` training loops (``docs/jit.md``).

A jit user holds one copy of the params, replicated over the mesh's ``data`` axis and perhaps
sharded over others (``model``, ``fsdp``), and lets XLA average the gradients. The compressing
optimizers need something else: every data worker keeps its own params and state (during local
steps they differ), the *worker layout* (a leading worker axis sharded over ``data``), and each
worker's update must see its *local* gradient. :class:`DataParallel` does the conversion:

- :meth:`DataParallel.jit` turns a per-worker step, written as for one device with local
  gradients, into one jitted program over the worker layout, manual only over the data axis
  (``jax.shard_map(..., axis_names={data})``): the other mesh axes stay automatic, so params
  sharded over ``model`` keep their sharding inside the step and XLA inserts the model's own
  collectives as usual. The batch is passed as a jit user has it: one global batch whose
  leading axis is split over the data workers.
- :meth:`DataParallel.optimizer` makes an optimizer work on model-sharded params: each device
  runs it on its own shard of every leaf (a ``shard_map`` over the other axes, nested inside the
  step), so the compressed collectives run over ``data`` only and no model-sharded leaf is ever
  gathered. Each model shard of a leaf is compressed with its own scale.
- :meth:`DataParallel.to_workers`, :meth:`~DataParallel.from_workers`,
  :meth:`~DataParallel.init` and :meth:`~DataParallel.synchronized_params` go between the
  user's layout and the worker layout, in one process and across processes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import threading
import typing
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_zero_one.core import _checks, _graph, wrappers
from optax_zero_one.core.flat import FlatTree
from optax_zero_one.core.kinds import StepKind, StepSchedule
from optax_zero_one.integration import dispatch, distributed, workers
from optax_zero_one.integration.workers import ShardLocalState


def _own_mesh(method: Callable[..., Any]) -> Callable[..., Any]:
    """A helper's method that runs programs of its own, run under the helper's mesh whatever
    context mesh (``jax.set_mesh``) the caller has open. Under another one (the old mesh of an
    elastic restart, still open while the new helper is built) JAX refused them ("the context
    mesh ... should match the mesh passed to shard_map"; a trial); under none or its own,
    nothing changes. Inside a trace (``jax.eval_shape`` of ``dp.init``) the context is kept."""

    @functools.wraps(method)
    def wrapped(self: DataParallel, *args: Any, **kwargs: Any) -> Any:
        with _on(self.mesh):
            return method(self, *args, **kwargs)

    return wrapped


def _on(mesh: jax.sharding.Mesh) -> Any:
    """:func:`~optax_zero_one.integration.distributed.leave_other_mesh` for ``mesh``; traced,
    nothing: the caller's context stands (:func:`_own_mesh`)."""
    try:
        return distributed.leave_other_mesh(mesh)
    except ValueError:  # JAX: "`get_mesh` can only be used outside of `jax.jit`"
        return contextlib.nullcontext()


def _names(axis: str | tuple) -> tuple[str, ...]:
    """A mesh axis or tuple of axes (a ``PartitionSpec`` entry) as a tuple of names."""
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _spec_axes(spec: P) -> set[str]:
    axes: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        axes.update((entry,) if isinstance(entry, str) else entry)
    return axes


def _check_not_donated(params: Any, opt_state: Any) -> None:
    """Raises ``RuntimeError`` where the step is given params or state an earlier call of a
    donating step consumed: launched with them, XLA:CPU crashes the process (a segmentation
    fault, jax 0.10) instead of raising. A donated tree is consumed whole, so one leaf of each
    tells."""
    for name, tree in (("params", params), ("opt_state", opt_state)):
        leaf = _graph.first_leaf(tree)
        dispatch.check_not_traced(leaf, "A dp.jit step")
        if leaf is not None and leaf.is_deleted():
            raise dispatch.consumed(name, "dp.jit(..., donate=False)")


_KEY_FIX = (
    "Broadcast it to one row per worker ({n} rows) and fold in the worker's index inside the "
    "step (jax.random.fold_in(key[0], jax.lax.axis_index(data_axis)))."
)


def _raw_key(x: Any) -> bool:
    """Whether ``x`` looks like a raw ``jax.random.PRNGKey``: ``(2,)`` ``uint32`` (a typed key,
    ``jax.random.key``, has a key dtype, which NumPy cannot read: a review)."""
    dtype = getattr(x, "dtype", None)
    if np.shape(x) != (2,) or dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return dtype == jnp.uint32


def _warn_if_raw_key(batch: Any) -> None:
    """Warns of a leaf of ``batch`` that looks like a raw key: with 2 workers it splits evenly,
    one word each, and JAX then fails on a ``(1,)`` key without naming the fix (a review)."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if _raw_key(x):
            warnings.warn(
                f"batch leaf {_checks.leaf_name(path)} has shape (2,) and dtype uint32, like a "
                "raw jax.random.PRNGKey: as a batch leaf it is split over the 2 data workers, "
                f"one word each. A random key? {_KEY_FIX.format(n=2)}",
                stacklevel=5,
            )


_MAKING = threading.Lock()


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Data-parallel training with a compressing optimizer on one axis of a mesh.

    Build it with :func:`data_parallel`. All methods are safe to call in every process of a
    multi-process job (each process passes the same arguments, as with ``jax.jit``).

    Attributes:
      mesh: the device mesh (``jax.sharding.Mesh``), ``Auto`` or ``Explicit`` axes.
      data_axis: the mesh axis of the data workers: the ``axis_name`` of the optimizer; or a
        pair such as ``("node", "local")`` for hierarchical compression (the optimizer built
        with ``axis_name="node", fast_axis_name="local"``; ``docs/hierarchical.md``).
      param_specs: a tree like the params of ``PartitionSpec``\\ s over the *other* axes (how
        a jit user shards each leaf; ``P()``: replicated).
    """

    mesh: jax.sharding.Mesh
    data_axis: str | tuple[str, ...]
    param_specs: Any
    # the helpers' jitted programs, made once each (a fresh jax.jit per call compiled anew at
    # every call: synchronized_params cost ~0.6 s an evaluation; a trial)
    _programs: dict = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def _program(
        self, key: Any, make: Callable[[DataParallel], Callable[..., Any]]
    ) -> Callable[..., Any]:
        """The program ``make(helper)`` built for ``key`` the first time it is asked for;
        ``helper`` is a copy of this one without the kept programs, for ``make`` to close over
        (closing over ``self`` made a cycle: a used helper was freed by the cyclic GC only)."""
        try:
            hash(key)
        except TypeError:  # e.g. specs holding something unhashable: not kept
            return make(dataclasses.replace(self))
        with _MAKING:  # two threads asking at once get one program (one jax.jit to compile)
            if key not in self._programs:
                self._programs[key] = make(dataclasses.replace(self))
            return self._programs[key]

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The data axis as a tuple of mesh axis names."""
        return _names(self.data_axis)

    def _sized(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """``axes`` without those of size 1 (JAX drops them from a sharding's spec)."""
        return tuple(a for a in axes if self.mesh.shape[a] > 1)

    @property
    def num_workers(self) -> int:
        """The number of data workers (the product of the data axes' sizes)."""
        return math.prod(self.mesh.shape[a] for a in self.data_axes)

    @property
    def other_axes(self) -> tuple[str, ...]:
        """The mesh axes other than the data axis."""
        return tuple(a for a in self.mesh.axis_names if a not in self.data_axes)

    @property
    def model_sharded(self) -> bool:
        """Whether some leaf is sharded over another axis (then wrap the optimizer)."""
        specs = jax.tree.leaves(self.param_specs, is_leaf=lambda x: isinstance(x, P))
        return any(_spec_axes(s) for s in specs)

    # ------------------------------------------------------------------ layouts

    def _auto(self, fn: Callable[..., Any], out_shardings: Any) -> Callable[..., Any]:
        """``fn`` (the helper's own program, no user code) with the mesh's ``Explicit`` axes
        made ``Auto`` inside (``jax.sharding.auto_axes``): it indexes and stacks the worker
        axis, which explicit sharding types refuse when it is sharded. ``fn`` as it is on a
        mesh of ``Auto`` axes."""
        explicit = self._explicit(self.mesh.axis_names)
        if not explicit:
            return fn
        return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=out_shardings)

    def _shardings(self, specs: Any) -> Any:
        """``NamedSharding``\\ s on the mesh for a tree of specs."""
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )

    def to_workers(self, tree: Any, specs: Any = None) -> Any:
        """A tree in the user's layout (default specs: the params') as the worker layout.

        Each leaf ``x`` (a ``jax.Array`` sharded as its spec says, or a host array that every
        process holds in full) becomes ``N`` copies on a leading axis sharded over the data
        axis, placed without communication: every device's block is its own shard of ``x``
        (``jax.make_array_from_single_device_arrays``), so this works when the mesh spans
        several processes.
        """
        given = specs is not None
        specs = self.param_specs if specs is None else specs
        _check_structure(tree, specs, "the tree", "its specs" if given else _PARAMS_SPECS)

        @distributed.outside_user_mesh
        def one(path: Any, x: Any, spec: P) -> tuple:
            placed = getattr(x, "sharding", None)
            if self._in_worker_layout(x):  # what to_workers makes
                raise ValueError(
                    f"leaf {_checks.leaf_name(path)} of shape {np.shape(x)} is already sharded "
                    f"over the data axis ({placed.spec}): the tree is in the worker layout "
                    "(dp.to_workers' output, or a worker-layout checkpoint restored onto the "
                    "mesh), and a second worker axis would be stacked on it. Pass it to dp.init "
                    "and dp.jit as it is; dp.from_workers or dp.synchronized_params give the "
                    "user layout."
                )
            self._check_divides(path, np.shape(x), spec)
            sharding = NamedSharding(self.mesh, spec)
            if not (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim)):
                x = _place(x, sharding)
            target = NamedSharding(self.mesh, P(self.data_axis, *spec))
            shape = (self.num_workers, *x.shape)
            blocks = {s.device: s.data for s in x.addressable_shards}
            return shape, target, [blocks[d] for d in target.addressable_devices_indices_map(shape)]

        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        spec_leaves = treedef.flatten_up_to(specs)
        planned = [one(path, x, spec) for (path, x), spec in zip(leaves, spec_leaves, strict=True)]
        # one program per device for all the leaves' blocks (distributed.on_each_device)
        stacked = iter(
            distributed.on_each_device(
                _with_leading_axis, [b for _, _, blocks in planned for b in blocks]
            )
        )
        return jax.tree.unflatten(
            treedef,
            [
                jax.make_array_from_single_device_arrays(
                    shape, target, [next(stacked) for _ in blocks]
                )
                for shape, target, blocks in planned
            ],
        )

    def _check_divides(self, path: Any, shape: tuple, spec: P) -> None:
        """Raises ``ValueError`` naming the leaf where ``spec`` shards a dimension of ``shape``
        into parts that do not divide it (JAX's error names neither leaf nor spec)."""
        for dim, entry in enumerate(spec):
            parts = math.prod(self.mesh.shape[a] for a in _names(entry)) if entry else 1
            size = shape[dim] if dim < len(shape) else None
            if size is None or size % parts:
                raise ValueError(
                    f"leaf {_checks.leaf_name(path)} of shape {shape} is sharded as {spec}: its "
                    f"dimension {dim} ({'absent' if size is None else size}) does not split "
                    f"into {parts} equal parts over {entry!r}. Shard a dimension that does, "
                    "or replicate the leaf (P())."
                )

    @_own_mesh
    def from_workers(self, tree: Any, specs: Any = None, worker: int = 0) -> Any:
        """One worker's copy of a worker-layout tree, in the user's layout (``jax.Array``\\ s
        sharded by ``specs``, default the params'). Runs as one jitted program on every
        process."""
        specs = self.param_specs if specs is None else specs
        n = self.num_workers
        # inside jit an index past the end is clamped: another worker's copy, without a word
        if isinstance(worker, bool) or not isinstance(worker, int | np.integer):
            raise ValueError(f"worker must be an int, got {worker!r}.")
        if not -n <= worker < n:
            raise ValueError(f"worker={worker}, but there are {n} data workers (0 to {n - 1}).")
        self.check_worker_layout(tree, "the tree")
        _check_structure(
            tree, specs, "the tree", _PARAMS_SPECS if specs is self.param_specs else "its specs"
        )
        leaves, treedef = jax.tree.flatten(specs)
        program = self._program(
            ("from_workers", int(worker), treedef, tuple(leaves)),
            lambda helper: jax.jit(
                helper._auto(
                    lambda t: jax.tree.map(lambda x: x[worker], t), helper._shardings(specs)
                ),
                out_shardings=helper._shardings(specs),
            ),
        )
        return program(tree)

    def check_worker_layout(self, tree: Any, what: str) -> None:
        """Raises ``ValueError`` unless every array of ``tree`` has a leading axis of one entry
        per data worker sharded over the data axis; for the params, also sharded over the
        other axes as the specs given to :func:`data_parallel` say."""
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        model_specs = None
        if what == "params":  # by position: the params may wrap their leaves (Flax NNX)
            model_specs = jax.tree.leaves(self.param_specs, is_leaf=lambda x: isinstance(x, P))
            model_specs = model_specs if len(model_specs) == len(flat) else None
        for i, (path, x) in enumerate(flat):
            shape = np.shape(x)
            spec = (
                x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding) else None
            )
            ok = len(shape) >= 1 and shape[0] == self.num_workers
            # traced (e.g. comm_stats): shapes only; zero-size (the error buffers of one node):
            # nothing to place, and XLA gives such outputs a replicated sharding
            if not isinstance(x, jax.core.Tracer) and math.prod(shape) > 0:
                # a spec drops axes of size 1: on a mesh of one device it is P()
                lead = _names(spec[0] or ()) if spec else ()
                ok = ok and spec is not None and self._sized(lead) == self._sized(self.data_axes)
            if not ok:
                raise ValueError(
                    f"{what} is not in the worker layout: leaf {_checks.leaf_name(path)} has shape "
                    f"{shape} and sharding {getattr(x, 'sharding', None)}, not a leading axis of "
                    f"{self.num_workers} data workers sharded over {self.data_axis!r}. "
                    + self._layout_advice(x, shape, what)
                )
            placed = not isinstance(x, jax.core.Tracer) and math.prod(shape) > 0
            if model_specs is not None and placed:
                want = P(self.data_axis, *model_specs[i])
                if self._dims(spec, len(shape)) != self._dims(want, len(shape)):
                    raise ValueError(
                        f"{what} leaf {_checks.leaf_name(path)} is sharded as {spec}, where the "
                        f"worker layout has {want} (the data axis, then the specs the params had "
                        "when given to data_parallel): the step would keep that placement for the "
                        "whole run. " + self._layout_advice(x, shape, what)
                    )

    def _dims(self, spec: P, ndim: int) -> list[tuple[str, ...]]:
        """The mesh axes of each of ``ndim`` dimensions under ``spec``, without the axes of
        size 1 (JAX drops them)."""
        entries = list(spec) + [None] * (ndim - len(spec))
        return [self._sized(_names(e) if e is not None else ()) for e in entries[:ndim]]

    def _layout_advice(self, x: Any, shape: tuple, what: str) -> str:
        """What to do about a leaf :meth:`check_worker_layout` refused."""
        template = "dp.to_workers(params)" if what == "params" else "dp.init(tx, params_w)"
        place = (
            f"place it as the step's arrays are placed: jax.device_put(restored, "
            f"jax.tree.map(lambda x: x.sharding, {template})) (or restore with Orbax against "
            "that template's shapes and shardings: docs/reliability.md)."
        )
        if shape and shape[0] == self.num_workers:  # the right shape, placed otherwise
            host = not isinstance(x, jax.Array)
            return (
                "It is a host array (e.g. read back from a checkpoint): "
                if host
                else "To move it: "
            ) + place
        if what == "opt_state" and not shape:
            return (
                "A value set by hand in the state (e.g. inject_hyperparams' "
                "hyperparams['learning_rate'] = 1e-3) must keep the leaf's worker layout: set "
                "it as jnp.full_like(old_leaf, value)."
            )
        return (
            "Convert your params with dp.to_workers(params) and build the state with "
            "dp.init(tx, params); a tree restored from a checkpoint of the worker layout is "
            "placed instead: " + place
        )

    # ------------------------------------------------------------------ optimizer

    def optimizer(self, tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
        """``tx`` (built with ``axis_name=data_axis``) run on each device's own model shard.

        On a mesh where no leaf is sharded over another axis this is ``tx`` itself. Otherwise
        ``init`` and ``update`` run inside a ``shard_map`` over the other axes, nested in the
        step: every device sees its shard of each leaf (and of the state), the compressed and
        float means run over the data axis within each model shard, and updates come out
        sharded like the params. Each shard of a leaf gets its own compression scale. Before
        the update, a non-finite gradient anywhere in a worker's model shards is made visible
        to all of them, so that every shard skips or drops the same steps and the copies of
        replicated leaves stay identical.
        """
        if not self.model_sharded:
            return optax.with_extra_args_support(tx)
        stack = P(self.other_axes)
        # Specs as a list, one per leaf: the trees the optimizer sees may wrap their leaves
        # differently from the params the specs came from (e.g. Flax NNX's State of Params).
        specs = jax.tree.leaves(self.param_specs, is_leaf=lambda x: isinstance(x, P))

        def leaves(tree: Any, what: str) -> tuple[list, Any]:
            values, treedef = jax.tree.flatten(tree)
            if len(values) != len(specs):
                raise ValueError(
                    f"{what} has {len(values)} leaves, the params given to data_parallel "
                    f"{len(specs)}: build the DataParallel from the params this optimizer updates."
                )
            return values, treedef

        def init_fn(params: Any) -> ShardLocalState:
            if _checks.is_placeholder(params):  # optax.tree_map_params: the structure only
                return ShardLocalState(tx.init(params))
            if _SHAPES_ONLY.get():  # state_target: shapes only, outside the mesh
                return self._shard_shapes(tx, params)
            values, treedef = leaves(params, "params")
            init = lambda p: _stack(tx.init(jax.tree.unflatten(treedef, p)))  # noqa: E731
            return ShardLocalState(self._per_shard(init, (specs,), stack)(values))

        def update_fn(
            updates: Any, state: ShardLocalState, params: Any = None, **extra: Any
        ) -> tuple[Any, ShardLocalState]:
            values, treedef = leaves(_poison_if_not_finite(updates), "updates")
            p_def = None if params is None else leaves(params, "params")[1]
            # the extra arguments' arrays (e.g. value=loss) enter the per-shard program as
            # inputs, the same on every shard; the rest (a step_kind) stays static
            found, extra_def = jax.tree.flatten(extra)
            is_array = [isinstance(x, jax.Array | np.ndarray | np.generic) for x in found]

            def local(u: Any, s: Any, arrays: list, *p: Any) -> Any:
                p = [jax.tree.unflatten(p_def, p[0])] if p else []
                given = iter(arrays)
                extra_in = [next(given) if a else x for x, a in zip(found, is_array, strict=True)]
                kwargs = jax.tree.unflatten(extra_def, extra_in)

                def one(inner: Any) -> tuple[list, Any]:
                    out, inner = tx.update(jax.tree.unflatten(treedef, u), inner, *p, **kwargs)
                    return jax.tree.leaves(out), inner

                if kwargs.get("step_kind") is None:  # deciding in the graph: the row itself
                    out, inner = one(jax.tree.map(lambda x: x[0], s))
                    return out, _stack(inner)
                # One kind: under vmap over the shard's one-row stack of state, as dp.jit runs
                # the workers; taken apart and stacked again, state buffers were copied each
                # step (XLA:CPU, a local step on a (4, 1) mesh: 15 bytes per parameter of
                # temporaries, 12 under vmap, 4 on a (4,) mesh; docs/jit.md, "Memory").
                out, inner = jax.vmap(one)(s)
                return [o[0] for o in out], inner

            arrays = [x for x, a in zip(found, is_array, strict=True) if a]
            args, in_specs = (values, state.inner, arrays), (specs, stack, P())
            if params is not None:
                args, in_specs = (*args, jax.tree.leaves(params)), (*in_specs, specs)
            out, inner = self._per_shard(local, in_specs, (specs, stack))(*args)
            # typed as varying over the axes their inputs varied over (the data axis): the
            # nested program's outputs are not (check_vma=False), and a scan, loop or cond
            # carrying the state (optax.MultiSteps) needs its type unchanged
            out = [_graph.vary_like(o, v) for o, v in zip(out, values, strict=True)]
            inner = jax.tree.map(_graph.vary_like, inner, state.inner)
            return jax.tree.unflatten(treedef, out), ShardLocalState(inner)

        return _checks.standard_transformation(init_fn, update_fn)

    def _per_shard(self, fn: Callable[..., Any], in_specs: Any, out_specs: Any) -> Any:
        """``fn`` inside the step, manual over the other axes too: it sees each device's shard.
        (Replicated leaves are identical on every shard by construction, hence no check_vma.)"""
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:  # called outside the helper's programs (JAX: "a non-empty mesh")
            raise ValueError(
                "dp.optimizer(tx) on a model-sharded mesh runs init and update on each "
                "device's shard, inside the helper's programs: build the state with "
                "dp.init(tx, params_w) (shapes only, e.g. to plan shardings: "
                "jax.eval_shape(lambda p: dp.init(tx, p), params_w)) and call update in the "
                "step given to dp.jit."
            )
        return jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=set(self.other_axes),
            check_vma=False,
        )

    @_own_mesh
    def init(self, tx: optax.GradientTransformation, params: Any) -> Any:
        """The optimizer state of ``params`` (worker layout), in the worker layout."""
        self.check_worker_layout(params, "params")
        explicit = self._explicit(self.other_axes)
        shapes = None  # the state's structure, traced once for both uses below
        if self.model_sharded or explicit:
            shapes = jax.eval_shape(self.on_workers(tx.init), params)
        if self.model_sharded and not _graph.nodes_of(shapes, ShardLocalState):
            raise ValueError(
                f"some params are sharded over {self.other_axes}: wrap the optimizer with "
                "dp.optimizer(tx), so that it runs on each model shard instead of gathering them."
            )
        outs = None
        if explicit:  # each model shard's state stays on its shard
            per_shard = NamedSharding(self.mesh, P(self.data_axis, self.other_axes))
            outs = jax.tree.map(
                lambda x: (
                    per_shard
                    if isinstance(x, ShardLocalState)
                    else NamedSharding(self.mesh, P(self.data_axis))
                ),
                shapes,
                is_leaf=lambda x: isinstance(x, ShardLocalState),
            )
        program = self._on_workers(tx.init, False, None if outs is None else lambda p: outs)
        # once a run, not kept (a new tx each); params kept as an input even where the state
        # does not read them (1-bit Adam's): on an Explicit mesh they place the program there
        return jax.jit(program, keep_unused=True)(params)

    def on_workers(self, fn: Callable[..., Any], out_specs: Any = None) -> Callable[..., Any]:
        """``fn`` on one worker's trees, lifted to the worker layout: every argument and result
        has a leading worker axis; ``fn`` runs manual over the data axis only (other axes
        automatic). Not jitted. E.g. ``jax.jit(dp.on_workers(make_nnx_optimizer_state))``.

        ``out_specs``: on a mesh whose other axes are ``Explicit``, the results' specs in the
        worker layout (a tree, or a prefix of one, of ``PartitionSpec``\\ s over the mesh,
        e.g. ``P("data", None, "model")``); ``fn`` then runs with those axes ``Auto`` and its
        results are placed so. Default: ``P(data_axis)``, replicated over the other axes.
        Unused on ``Auto`` axes, where XLA places the results."""
        outs = None if out_specs is None else self._shardings(out_specs)
        return self._on_workers(fn, False, None if outs is None else lambda *args: outs)

    def _explicit(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """Those of the mesh axes ``axes`` whose type is ``Explicit``."""
        types = dict(zip(self.mesh.axis_names, self.mesh.axis_types, strict=True))
        return tuple(a for a in axes if types[a] == jax.sharding.AxisType.Explicit)

    def _on_workers(
        self, fn: Callable[..., Any], batched: bool, outs: Callable[..., Any] | None = None
    ) -> Callable[..., Any]:
        """:meth:`on_workers`, with ``batched`` as in :func:`~optax_zero_one.on_workers` (``fn``
        under ``jax.vmap`` over the block: params and state updated in place on CPU), and
        ``outs(*args)`` the results' shardings where the other axes are ``Explicit``."""
        body = distributed.worker_body(fn, batched, self.data_axes, "data_parallel")
        spec, manual = P(self.data_axis), set(self.data_axes)
        others = self._explicit(self.other_axes)
        if not others:
            return jax.shard_map(
                body, mesh=self.mesh, in_specs=spec, out_specs=spec, axis_names=manual
            )

        # JAX 0.10.2 lowers a shard_map over an Explicit mesh with an input sharding that
        # replicates the axes it is not manual over: every model-sharded leaf and state was
        # all-gathered over them in and sharded again out, ~190x a step's bytes and 2-2.4x its
        # peak memory (a trial). With those axes Auto inside (as on an Auto mesh) nothing moves.
        def mapped(*args: Any) -> Any:
            inner = jax.shard_map(body, in_specs=spec, out_specs=spec, axis_names=manual)
            placed = NamedSharding(self.mesh, spec) if outs is None else outs(*args)
            return jax.sharding.auto_axes(inner, axes=others, out_sharding=placed)(*args)

        return mapped

    # ------------------------------------------------------------------ the step

    @typing.overload
    def jit(
        self, step: Callable[..., Any], *, donate: bool = True, schedule: None = None
    ) -> Callable[[Any, Any, Any], tuple[Any, Any, Any]]: ...

    @typing.overload
    def jit(
        self, step: Callable[..., Any], *, donate: bool = True, schedule: StepSchedule
    ) -> dispatch.KindDispatcher: ...

    def jit(
        self,
        step: Callable[..., Any],
        *,
        donate: bool = True,
        schedule: StepSchedule | None = None,
    ) -> Callable[[Any, Any, Any], tuple[Any, Any, Any]] | dispatch.KindDispatcher:
        """``step(params, opt_state, batch) -> (params, opt_state, aux)`` over the worker layout.

        ``step`` is one worker's step: its params and state, its share of the batch (the
        global batch's leading axis split into ``N`` equal consecutive parts), gradients taken
        locally, the optimizer (built with ``axis_name=data_axis``) doing the communicating.
        The returned function takes params and state in the worker layout and the *global*
        batch (any tree whose leaves have a leading axis divisible by ``N``), and returns
        params, state and ``aux`` in the worker layout (``aux``'s leaves get a leading worker
        axis). It is jitted; with ``donate`` the params and state buffers are reused. Each
        program checks the layout of its first call's arguments and is compiled for them;
        calls with arguments of the same shapes, dtypes and shardings (a training loop) run
        that executable with no Python check, others are checked again and compiled for.

        With ``schedule`` (the optimizer's :class:`~optax_zero_one.StepSchedule`), ``step``
        must take a keyword ``step_kind`` and pass it on to ``tx.update``: one program is
        compiled per step kind, the first time that kind comes up (or all at once, ahead:
        ``train.precompile(params, opt_state, batch)``), and the host calls the one
        for each step (:func:`~optax_zero_one.dispatch_by_kind`), so no program decides a
        step's kind on the device; each program runs ``step`` under ``jax.vmap`` over the
        worker's one-entry block (a ``lax.cond`` on the worker's own values then runs both
        branches; ``docs/jit.md``) and also returns the state's counters, which the host
        reads back every 8 steps to check that the state took them. Without it, one program
        decides in the graph.
        """
        if not isinstance(donate, bool | np.bool_):
            raise TypeError(f"dp.jit's donate must be True or False, got {donate!r}.")
        n = self.num_workers

        def split(batch: Any) -> Any:
            return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)

        by_worker = NamedSharding(self.mesh, P(self.data_axis))
        typed = lambda tree: jax.tree.map(lambda x: jax.typeof(x).sharding, tree)  # noqa: E731
        # an Explicit data axis is typed in the program: its layout is changed by reshard
        place = (
            jax.sharding.reshard
            if self._explicit(self.data_axes)
            else jax.lax.with_sharding_constraint
        )
        donated = (0, 1) if donate else ()
        warned: set = set()  # the leaves warned about, once per step function, not per kind

        def check(params: Any, opt_state: Any, batch: Any, leaves: bool) -> None:
            self.check_worker_layout(params, "params")
            self.check_worker_layout(opt_state, "opt_state")
            if leaves:  # without a schedule: no dispatcher checks these at its first call
                wrappers.check_leaf_keys(opt_state)  # a state restored for another tree
                _graph.check_no_per_worker_skip(opt_state, "dp.jit")
            self._check_batch(batch)

        def compile_kind(kind: StepKind | None) -> Callable[..., Any]:
            one = self._on_workers(
                functools.partial(_checked_step, step, {} if kind is None else {"step_kind": kind}),
                kind is not None,
                lambda params, opt_state, batch: (typed(params), typed(opt_state), by_worker),
            )

            def whole(params: Any, opt_state: Any, batch: Any) -> Any:
                # the batch split into the workers' shares inside the program: one launch
                shares = place(split(batch), by_worker)
                return one(params, opt_state, shares)

            # with a kind, the dispatcher's counts come out of the same program: one launch
            body = whole if kind is None else dispatch.with_counts(whole, 1)
            mapped: list[Any] = [None]  # jitted at the first call, for its shardings

            def keep(params: Any, opt_state: Any) -> None:
                # The shardings of params and state as the program is lowered for them: its
                # outputs keep them. Left free, XLA may shard a replicated leaf's output over
                # another axis (a bias over "model"), and the next step, given other shardings,
                # compiles again. As out_shardings, not a constraint inside: XLA gives a
                # zero-size output a replicated sharding whatever a constraint says.
                named = lambda x: x if isinstance(x, NamedSharding) else None  # noqa: E731
                kept = jax.tree.map(
                    lambda x: named(getattr(x, "sharding", None)), (params, opt_state)
                )
                outs = (*kept, None)
                mapped[0] = jax.jit(
                    body,
                    donate_argnums=donated,
                    out_shardings=outs if kind is None else (outs, None),
                )

            # The executable compiled for the first call's (checked) arguments. It checks every
            # later call's shapes, dtypes and shardings itself, in C++, before it runs, so a
            # loop passing back what it got runs no Python check: checking each leaf's layout
            # costs ~0.1-0.2 ms of host time per step at 100 leaves, as long as a small
            # model's whole optimizer step on a GPU.
            first: list[Any] = [None]
            compiling = threading.Lock()  # two threads' first calls compile once

            def program(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
                params, opt_state, batch = _three(args, kwargs, "train")
                if jax.config.jax_disable_jit:  # JAX's error names its ahead-of-time path
                    raise ValueError(
                        "dp.jit's steps are compiled programs and do not run under "
                        "jax.disable_jit(). To step through the optimizer in Python, run your "
                        "step for simulated workers, jax.vmap(step, axis_name=...) over "
                        "ozo.replicate'd params (with ozo.dispatch_by_kind for a schedule), "
                        "which runs under disable_jit (docs/usage.md)."
                    )
                _check_not_donated(params, opt_state)
                if first[0] is not None:
                    try:
                        return first[0](params, opt_state, batch)
                    except (TypeError, ValueError):
                        pass  # raised before running: other arguments, checked here
                # traced under the helper's mesh, whatever context mesh the caller has open
                with _on(self.mesh):
                    # a dispatcher checks the leaves itself, at its first call and after a restore
                    check(params, opt_state, batch, leaves=kind is None)
                    with compiling:
                        compiled_here = first[0] is None
                        if compiled_here:
                            traced = trace(params, opt_state, batch)
                            lowered = traced.lower()
                            if kind is None:
                                sizes = [len(jax.tree.leaves(t)) for t in (params, opt_state)]
                                self._warn_if_no_mean(traced.jaxpr, program.passed_through, *sizes)
                                # no dispatcher compares the processes: this first call does
                                _check_processes_run(lowered, params, opt_state, batch)
                            first[0] = lowered.compile()
                    if not compiled_here:  # another thread's first call compiled it
                        try:
                            return first[0](params, opt_state, batch)
                        except (TypeError, ValueError):
                            pass  # for other shapes
                        return mapped[0](params, opt_state, batch)  # jit compiles for the others
                    return first[0](params, opt_state, batch)

            def lower(*args: Any) -> Any:  # for precompile
                params, opt_state, batch = _three(args, {}, "train.precompile")
                if not any(
                    isinstance(x, jax.ShapeDtypeStruct)
                    for x in jax.tree.leaves((params, opt_state, batch))
                ):
                    check(params, opt_state, batch, leaves=True)  # before any step has run
                with _on(self.mesh):
                    return trace(params, opt_state, batch).lower()

            def trace(params: Any, opt_state: Any, batch: Any) -> Any:
                """The step traced for its compile (first call or precompile), and what is read
                from it: the params it returns as given, the leaves that train apart."""
                keep(params, opt_state)
                traced = mapped[0].trace(params, opt_state, batch)
                program.passed_through = _params_passed_through(traced.jaxpr, params)
                self._warn_if_leaves_apart(traced.jaxpr, params, opt_state, warned)
                return traced

            program.lower = lower  # type: ignore[attr-defined]
            # the params leaves the step returns as given (a GAN's other model), which the
            # dispatcher's params check leaves out: known once the program is traced
            program.passed_through = frozenset()  # type: ignore[attr-defined]
            return program

        if schedule is None:
            return compile_kind(None)
        _check_takes_step_kind(step)
        return dispatch.KindDispatcher(
            compile_kind,
            schedule,
            counts_in_program=True,
            params_index=0,
            where_state="the step's second argument must be opt_state: step(params, opt_state, "
            "batch)",
        )

    def _warn_if_no_mean(
        self, closed: Any, passed: frozenset, num_params: int, num_state: int
    ) -> None:
        """Warns if a step without a schedule returns new params that, with the state it
        returns, depend on no collective over the data axis (or over part of a pair of axes):
        then each worker trains its own copy on its share of the batch. ``optax.adamw`` in
        ``dp.optimizer`` with no mean of the gradients ran so silently (a trial). Read from
        the step's traced program (``closed``: ``jax.stages.Traced.jaxpr``; its first
        ``num_params`` inputs and outputs the params, the next ``num_state`` outputs the state:
        a mean kept there for the next step counts, one only in ``aux`` does not) at its first
        compile: nothing runs or is read back. Not warned about: an evaluation step (all its
        params returned as given: ``passed``, :func:`_params_passed_through`'s) and a program
        where a transform was given a step kind (by the caller, whose local steps exchange
        nothing by design, or by an enclosing transform deciding in the graph, which
        exchanges)."""
        if self.num_workers < 2 or len(passed) == num_params:
            return
        body = closed.jaxpr
        axes = frozenset(self.data_axes)
        missing = sorted(axes - _mean_axes(body, body.outvars[: num_params + num_state], axes))
        if not missing or _hinted(body):  # the whole program read only where it would warn
            return
        axis = self.data_axis
        built = (
            f"axis_name={axis!r}"
            if isinstance(axis, str)
            else f"axis_name={axis[0]!r}, fast_axis_name={axis[1]!r}"
        )
        over = f"the data axis {axis!r}" if len(missing) == len(axes) else f"axis {missing[0]!r}"
        warnings.warn(
            f"dp.jit: the params this step returns depend on no collective over {over} (no "
            "psum, pmean, all_gather, ... of what updates them; one of the loss for logging "
            f"does not count): each of the {self.num_workers} workers trains its own copy on "
            f"its share of the batch. Average the gradients before a plain optax optimizer "
            f"(grads = jax.lax.pmean(grads, {axis!r})), or use an optimizer that communicates "
            f"(ozo.zero_one_adam(..., {built})). If the workers train apart on purpose (local "
            "steps you average in another program), ignore this warning.",
            stacklevel=3,
        )

    def _warn_if_leaves_apart(self, closed: Any, params: Any, opt_state: Any, warned: set) -> None:
        """Warns if some params the step returns depend on a collective over the data axis
        and others depend on the batch through none: those go their own way on every worker.
        A plain optax optimizer beside ours in an ``optax.multi_transform`` (``optax.adamw``
        on the biases, given each worker's own gradients) trained so silently (a trial), where
        every leaf of the optimizer's own was averaged; a whole step without any collective is
        :meth:`_warn_if_no_mean`'s, a leaf that does not learn from the batch (frozen by
        ``optax.set_to_zero``) is not warned about. Read from the traced program at each
        program's first compile (every step kind's: a local step's, which exchanges nothing,
        is never mixed); the same leaves once per step function (``warned``), not once per
        step kind."""
        if self.num_workers < 2:
            return
        body = closed.jaxpr
        leaves = jax.tree_util.tree_leaves_with_path(params)
        skip = len(leaves) + len(jax.tree.leaves(opt_state))
        axes = frozenset(self.data_axes)
        # the batch's inputs carry a marker that no axis name can be
        given = [frozenset({_BATCH} if i >= skip else ()) for i in range(len(body.invars))]
        exchanged = _exchanged_axes(body, axes | {_BATCH}, given)[: len(leaves)]
        if not any(got >= axes for got in exchanged):
            return
        apart = [  # scalars are left out: their mean is a scalar too, read as a flag's
            _checks.leaf_name(path)
            for (path, x), got in zip(leaves, exchanged, strict=True)
            if _BATCH in got and not got >= axes and np.size(x) > 1
        ]
        if not apart or tuple(apart) in warned:
            return
        warned.add(tuple(apart))
        shown = ", ".join(apart[:5]) + (f" and {len(apart) - 5} more" if len(apart) > 5 else "")
        warnings.warn(
            f"dp.jit: the params {shown} learn from each worker's share of the batch with no "
            f"collective over the data axis {self.data_axis!r}, where the others are averaged: "
            "each worker's copy of them goes its own way, and nothing brings them back (e.g. "
            "optax.adamw for the biases in an optax.multi_transform beside the compressing "
            "optimizer, given each worker's own gradients). Give them a compressing optimizer "
            "of their own (the same one, under another label; or weight_decay_mask= to keep the "
            "decay off them), or average their gradients first (jax.lax.pmean(grads, "
            f"{self.data_axis!r})). If they are each worker's own statistics on purpose (a "
            "batch norm's running mean), ignore this warning.",
            stacklevel=4,
        )

    def _check_batch(self, batch: Any) -> None:
        n = self.num_workers
        # per step: the leaves' shapes alone (~2 us); their paths only to name a bad one
        shapes = [getattr(x, "shape", None) or np.shape(x) for x in jax.tree.leaves(batch)]
        if n == 2 and (2,) in shapes:
            _warn_if_raw_key(batch)
        if all(s and s[0] % n == 0 for s in shapes):
            return
        for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if np.ndim(x) == 0:
                raise ValueError(
                    f"batch leaf {_checks.leaf_name(path)} is a scalar: every leaf of the batch is "
                    f"split along its leading axis into {n} parts, one per data worker. "
                    f"Broadcast it to one row per worker ({n} rows) or per example; a value "
                    "fixed for the whole run may be a closure. For a per-step random key, "
                    "broadcast it and fold in the worker's index inside the step "
                    "(jax.random.fold_in(key[0], jax.lax.axis_index(data_axis))), or every "
                    "worker draws the same dropout masks."
                )
            if np.shape(x)[0] % n:
                raise ValueError(
                    f"batch leaf {_checks.leaf_name(path)} has shape {np.shape(x)}: its leading "
                    f"axis must split into {n} equal parts, one per data worker. Make the "
                    f"global batch size a multiple of {n}."
                    + (f" A random key? {_KEY_FIX.format(n=n)}" if _raw_key(x) else "")
                )

    # ------------------------------------------------------------------ evaluation

    @_own_mesh
    def synchronized_params(self, params: Any, opt_state: Any) -> Any:
        """The parameters at the last synchronisation, in the user's layout (sharded by
        ``param_specs``, no worker axis): what to evaluate, export or checkpoint."""
        self.check_worker_layout(params, "params")
        specs, stack = self.param_specs, P(self.other_axes)
        _check_structure(params, specs, "params", _PARAMS_SPECS)

        def make(helper: DataParallel) -> Callable[..., Any]:
            def one(p: Any, s: Any) -> Any:
                found = _graph.nodes_of(s, ShardLocalState)
                if not found:
                    return workers.synchronized_params(p, s)
                if len(found) > 1:
                    raise ValueError("opt_state holds more than one ShardLocalState")

                def local(p: Any, d: Any) -> Any:
                    return workers.synchronized_params(p, jax.tree.map(lambda x: x[0], d))

                return helper._per_shard(local, (specs, stack), specs)(p, found[0].inner)

            first = helper._auto(
                lambda t: jax.tree.map(lambda x: x[0], t), helper._shardings(specs)
            )
            stacked = jax.tree.map(
                lambda spec: P(helper.data_axis, *spec), specs, is_leaf=lambda x: isinstance(x, P)
            )
            return jax.jit(
                lambda p, s: first(helper.on_workers(one, stacked)(p, s)),
                out_shardings=helper._shardings(specs),
            )

        return self._program(("synchronized_params",), make)(params, opt_state)

    def state_target(
        self, tx: optax.GradientTransformation, params: Any, num_workers: int
    ) -> tuple[Any, Any]:
        """What a run of ``num_workers`` data workers saved, as ``jax.ShapeDtypeStruct``\\ s
        without shardings: the params in its worker layout and its optimizer state
        (``dp.init``'s), built without that run's mesh (which a smaller restart cannot make).
        The restore target for :meth:`reset_compression`, e.g. as host arrays:
        ``jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), target)``.

        Args:
          tx: the saved run's optimizer, built for ``num_workers`` (the compressing
            optimizer's ``num_workers=`` argument, e.g. ``ozo.zero_one_adam(...,
            axis_name="data", num_workers=4)``) with the saved run's other arguments (the
            state's structure follows them): on a model-sharded mesh, as given to ``dp.init``
            with this helper's ``dp.optimizer`` around that optimizer (e.g.
            ``optax.chain(optax.clip_by_global_norm(1.0), dp.optimizer(tx_4))``), or the
            optimizer alone, as given to ``dp.optimizer``.
          params: this helper's params in the user's layout (arrays or shapes).
          num_workers: the saved run's number of data workers; its model axes had this
            mesh's sizes (the only move :meth:`reset_compression` makes).
        """
        _checks.check_int("num_workers", num_workers, 1)
        _check_structure(params, self.param_specs, "params", "the params given to data_parallel")
        for path, x in jax.tree_util.tree_leaves_with_path(params):
            if self._in_worker_layout(x):
                raise ValueError(
                    f"state_target takes the params in the user's layout, and leaf "
                    f"{_checks.leaf_name(path)} of shape {np.shape(x)} is in the worker layout "
                    "(a leading worker axis over the data axis): pass dp.from_workers(params_w), "
                    "or the params as the user holds them."
                )
        shape = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)  # noqa: E731
        params = jax.tree.map(shape, params)
        for (path, x), spec in zip(
            jax.tree_util.tree_leaves_with_path(params),
            jax.tree.leaves(self.param_specs, is_leaf=lambda v: isinstance(v, P)),
            strict=True,
        ):
            self._check_divides(path, x.shape, spec)
        stacked = lambda x: jax.ShapeDtypeStruct((num_workers, *x.shape), x.dtype)  # noqa: E731
        token = _SHAPES_ONLY.set(True)
        try:
            state = jax.eval_shape(tx.init, params)
        finally:
            _SHAPES_ONLY.reset(token)
        if self.model_sharded and not _graph.nodes_of(state, ShardLocalState):
            state = jax.eval_shape(lambda p: self._shard_shapes(tx, p), params)  # the inner tx
        for layout in _layouts(state):
            if math.prod(np.atleast_1d(layout.num_workers)) != num_workers:
                raise ValueError(
                    f"state_target: tx was built for {layout.num_workers} workers, but "
                    f"num_workers={num_workers}: build it with num_workers={num_workers} (the "
                    "saved run's count), as the saved run's state was laid out for it."
                )
        return jax.tree.map(stacked, params), jax.tree.map(stacked, state)

    def _shard_shapes(self, tx: optax.GradientTransformation, params: Any) -> ShardLocalState:
        """``dp.optimizer(tx)``'s state of ``params`` (user layout, one worker's), zeros shaped
        as ``dp.init`` makes it: ``tx``'s state of one model shard's blocks, stacked once per
        shard. Outside the mesh; for :meth:`state_target` (under ``jax.eval_shape``)."""
        shards = _ModelShards(self)
        values, treedef = jax.tree.flatten(params)
        local = [
            jax.ShapeDtypeStruct(shards.block_shape(np.shape(x), spec), x.dtype)
            for x, spec in zip(values, shards.specs, strict=True)
        ]
        inner = jax.eval_shape(tx.init, jax.tree.unflatten(treedef, local))
        return ShardLocalState(
            jax.tree.map(lambda x: jnp.zeros((shards.count, *x.shape), x.dtype), inner)
        )

    def _in_worker_layout(self, x: Any) -> bool:
        """Whether ``x`` is what :meth:`to_workers` makes: a leading worker axis sharded over
        the data axis."""
        placed = getattr(x, "sharding", None)
        return bool(
            isinstance(placed, NamedSharding)
            and len(placed.spec)
            and placed.spec[0] is not None
            and set(self._sized(_names(placed.spec[0]))) == set(self._sized(self.data_axes))
            and np.shape(x)[0] == self.num_workers
        )

    @_own_mesh
    def reset_compression(self, params: Any, opt_state: Any, fresh_state: Any) -> tuple[Any, Any]:
        """:func:`~optax_zero_one.reset_compression` onto this helper's mesh: a state restored
        from a run with another number of data workers moved to this one's, continuing from the
        last synchronised point with fresh compression buffers and the mean momentum.

        On a model-sharded mesh (``dp.optimizer``: one optimizer state per model shard) each
        shard's state is moved as a state of its own, from its block of the params; the model
        axes must have the sizes they had in the saved run (from ``("data"=4, "model"=2)`` onto
        ``(2, 2)``, not onto ``(4, 1)``). Elsewhere it is ``reset_compression`` with the
        params placed on this mesh.

        Args:
          params: the saved run's params in its worker layout (leading axis: its data-worker
            count), restored e.g. as host arrays (the saved run's mesh need not exist).
          opt_state: the matching optimizer state, restored for that worker count.
          fresh_state: this run's state as ``dp.init(tx, params_w)`` makes it.

        Returns:
          ``(params_w, opt_state)`` in this mesh's worker layout, ready for ``dp.jit``'s step.

        In a job of several processes every process calls it with the same arguments.
        """
        from optax_zero_one.integration import checkpoint  # checkpoint imports workers only

        self.check_worker_layout(fresh_state, "fresh_state")
        found = _graph.nodes_of(opt_state, ShardLocalState)
        if not self.model_sharded:
            if found:
                raise ValueError(
                    "opt_state was saved on a model-sharded mesh (dp.optimizer's state, one "
                    "per model shard), and this helper's params are sharded over no model "
                    f"axis ({self.mesh.shape}): the model axes must keep their sizes. Resume "
                    "on a mesh with the saved run's model axes, or start the optimizer afresh "
                    "from the synchronised params saved beside the state (docs/reliability.md)."
                )
            where = NamedSharding(self.mesh, P(self.data_axis))
            return checkpoint.reset_compression(params, opt_state, fresh_state, sharding=where)
        _check_structure(params, self.param_specs, "params", "the params given to data_parallel")
        if len(found) != 1:
            raise ValueError(
                f"opt_state holds {len(found)} states of dp.optimizer (ShardLocalState); a "
                "model-sharded run's state holds one: pass the state dp.init made, as restored."
            )
        shards = _ModelShards(self)
        for what, tree in (("the restored state", opt_state), ("fresh_state", fresh_state)):
            (node,) = _graph.nodes_of(tree, ShardLocalState) or [ShardLocalState(())]
            counts = {np.shape(x)[1] for x in jax.tree.leaves(node.inner) if np.ndim(x) > 1}
            if counts and counts != {shards.count}:
                raise ValueError(
                    f"{what} holds {'/'.join(map(str, sorted(counts)))} model shards, this "
                    f"mesh {shards.count} (the product of {self.other_axes}): the model axes "
                    "must keep their sizes (only the data axis may change). "
                    + (
                        "Resume on a mesh with the model axes the state was saved with, or "
                        "start the optimizer afresh from the synchronised params saved beside "
                        "the state (docs/reliability.md)."
                        if what != "fresh_state"
                        else "Make fresh_state with this helper: dp.init(tx, params_w)."
                    )
                )
        params0, state = checkpoint._reset(params, opt_state, fresh_state, shards=shards)
        return self.to_workers(params0), state


class _ModelShards:
    """How a model-sharded state's shards map to blocks of the params, on the host
    (:meth:`DataParallel.reset_compression`). Shard ``s`` is entry ``s`` of the state's
    stacked axis (``P(other_axes)``: the other axes' coordinates in mesh order, the last
    fastest); its block of a leaf is the one ``NamedSharding(mesh, spec)`` gives a device
    with those coordinates."""

    def __init__(self, helper: DataParallel):
        mesh, others = helper.mesh, helper.other_axes
        self.count = math.prod(mesh.shape[a] for a in others)
        self.specs = jax.tree.leaves(helper.param_specs, is_leaf=lambda x: isinstance(x, P))
        self._mesh = mesh
        names = list(mesh.axis_names)
        self._devices = []  # one device per shard: data coordinates 0
        for s in range(self.count):
            at = dict(zip(others, np.unravel_index(s, [mesh.shape[a] for a in others])))
            index = tuple(int(at.get(a, 0)) for a in names)
            self._devices.append(mesh.devices[index])
        self._found: dict = {}

    def _blocks(self, shape: tuple, spec: P) -> list[tuple]:
        """Every shard's index of a leaf of ``shape``, made once per shape and spec (the move
        asks for one shard's at a time, for every shard and leaf, several times)."""
        key = (tuple(shape), spec)
        if key not in self._found:
            where = NamedSharding(self._mesh, spec).devices_indices_map(tuple(shape))
            self._found[key] = [where[d] for d in self._devices]
        return self._found[key]

    def block_shape(self, shape: tuple, spec: P) -> tuple[int, ...]:
        """The shape of a leaf's block on one shard (every shard's is the same)."""
        index = self._blocks(shape, spec)[0]
        return tuple(len(range(*i.indices(n))) for i, n in zip(index, shape, strict=True))

    def local(self, params: Any, s: int) -> Any:
        """Shard ``s``'s block of every leaf of one worker's ``params`` (host arrays)."""
        values, treedef = jax.tree.flatten(params)
        blocks = [
            np.asarray(x)[self._blocks(np.shape(x), spec)[s]]
            for x, spec in zip(values, self.specs, strict=True)
        ]
        return jax.tree.unflatten(treedef, blocks)

    def state(self, state: Any, s: int) -> Any:
        """Shard ``s``'s inner state in one worker's ``state``."""
        (node,) = _graph.nodes_of(state, ShardLocalState)
        return jax.tree.map(lambda x: np.asarray(x)[s], node.inner)

    def synchronized_params(self, params: Any, state: Any) -> Any:
        """The last synchronised point of one worker's ``params``, each shard's block from its
        own state (a replicated leaf's blocks are the same on every shard)."""
        values, treedef = jax.tree.flatten(params)
        out = [np.array(x) for x in values]
        for s in range(self.count):
            point = jax.tree.leaves(
                workers.synchronized_params(self.local(params, s), self.state(state, s))
            )
            for whole, block, spec in zip(out, point, self.specs, strict=True):
                whole[self._blocks(whole.shape, spec)[s]] = np.asarray(block)
        return jax.tree.unflatten(treedef, out)


def _check_processes_run(lowered: Any, params: Any, opt_state: Any, batch: Any) -> None:
    """With several processes, before a step without a schedule first runs: raises
    ``ValueError`` on every process if they are not about to run the same program on
    arguments of the same shapes from the same step (one host all-gather of digests and a
    read of the step counter). The program decides the step kinds from constants baked into it
    and the counters: a process built with another ``var_freeze_step`` ran a sync's
    collectives against the others' full-precision mean, took their bytes as data (losses
    1e4 times the run's) and hung later; one given a batch of another size trained silently
    on other rows (a trial)."""
    if jax.process_count() == 1:
        return
    counter = _graph.step_counter(opt_state)
    step = 0 if counter is None else int(_graph.first_value(counter))
    args = (params, opt_state, batch)
    text = lowered.as_text()
    dispatch.check_processes_agree(None, step, args, state=1, params=0, program=text)


def data_parallel(
    mesh: jax.sharding.Mesh, params: Any, data_axis: str | tuple[str, ...] = "data"
) -> DataParallel:
    """A :class:`DataParallel` for ``params`` (as a jit user holds them) on ``mesh``.

    Args:
      mesh: the device mesh; must have ``data_axis``. Its axes may be ``Explicit`` (what
        ``jax.make_mesh`` makes by default) or ``Auto``; either way the step runs manual over
        the data axis with the other axes ``Auto`` (``docs/jit.md``, "Limits").
      params: the params tree in the user's layout: ``jax.Array``\\ s sharded with a
        ``NamedSharding`` over ``mesh`` (replicated over the data axis), host arrays (taken as
        replicated), or ``PartitionSpec``\\ s directly.
      data_axis: the mesh axis of the data workers; build the optimizer with
        ``axis_name=data_axis``. Or a pair ``(slow, fast)`` of axes, e.g. ``("node", "local")``:
        the workers are the devices of both (worker ``node * local_size + local``); build the
        optimizer with ``axis_name=slow, fast_axis_name=fast`` (``docs/hierarchical.md``).

    Returns:
      The :class:`DataParallel` helper.

    Example:
      >>> mesh = jax.make_mesh((2, 1), ("data", "model"), devices=jax.devices()[:2],
      ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
      >>> params = {"w": np.zeros((4, 2), np.float32)}
      >>> dp = data_parallel(mesh, params, "data")
      >>> tx = dp.optimizer(ozo.zero_one_adam(1e-3, var_freeze_step=4, axis_name="data"))
      >>> def step(params, opt_state, batch, step_kind=None):  # one data worker
      ...     loss, grads = jax.value_and_grad(lambda p: jnp.sum((batch @ p["w"]) ** 2))(params)
      ...     updates, opt_state = tx.update(grads, opt_state, params, step_kind=step_kind)
      ...     return optax.apply_updates(params, updates), opt_state, loss
      >>> params_w = dp.to_workers(params)
      >>> opt_state = dp.init(tx, params_w)
      >>> train_step = dp.jit(step, schedule=ozo.zero_one_schedule(var_freeze_step=4))
      >>> params_w, opt_state, loss = train_step(params_w, opt_state, np.ones((2, 4), np.float32))
      >>> loss.shape  # one per worker
      (2,)
    """
    distributed.check_mesh(mesh, "data_parallel(mesh, params, data_axis)")
    if not isinstance(data_axis, str | tuple) or not all(
        isinstance(a, str) for a in _names(data_axis)
    ):
        raise ValueError(
            f"data_axis must be the name of a mesh axis, or a tuple (slow, fast) of two, e.g. "
            f"('node', 'local'); got {data_axis!r}."
        )
    names = _names(data_axis)
    if len(names) > 2 or len(set(names)) != len(names):
        raise ValueError(
            f"data_axis={data_axis!r}: the data workers are on one mesh axis, or on a pair of "
            "two different axes (slow, fast) for hierarchical compression (the optimizer "
            "built with axis_name=slow, fast_axis_name=fast; docs/hierarchical.md)."
        )
    missing = [a for a in names if a not in mesh.axis_names]
    if len(names) == 2 and missing:
        raise ValueError(
            f"the mesh has axes {mesh.axis_names}, not {missing} of data_axis={data_axis!r}: "
            "a pair names two axes of the mesh, e.g. jax.make_mesh((nodes, per_node), "
            "('node', 'local'), axis_types=(jax.sharding.AxisType.Auto,) * 2)."
        )
    if not names or missing:
        raise ValueError(
            f"the mesh has axes {mesh.axis_names} and no data axis {data_axis!r}: make a mesh "
            f"with a data axis, e.g. jax.make_mesh(({mesh.size}, 1), ({data_axis!r}, 'model'), "
            "axis_types=(jax.sharding.AxisType.Auto,) * 2), or pass data_axis= the name of the "
            "axis your batch is split over."
        )
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    odd = {
        a: t.name
        for a, t in types.items()
        if t not in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit)
    }
    if odd:
        raise ValueError(
            f"mesh axes {odd} are neither Auto nor Explicit: data_parallel makes the data axis "
            "manual itself, inside its programs. Give it the mesh as jax.make_mesh makes it "
            "(Explicit axes), or with axis_types=(jax.sharding.AxisType.Auto,) * k."
        )
    if len({types[a] for a in names}) > 1:
        raise ValueError(
            f"the data axes {names} are typed {[types[a].name for a in names]}: give the pair "
            "one type, both Explicit or both Auto (the batch is split over both at once)."
        )

    def spec_of(path: Any, x: Any) -> P:
        if not isinstance(x, P | int | float | np.generic) and not (
            hasattr(x, "shape") and hasattr(x, "dtype")
        ):  # an Equinox model's activation function failed later, inside JAX (a trial)
            raise ValueError(
                f"param {_checks.leaf_name(path)} is a {type(x).__name__}, not an array: "
                "data_parallel takes the params as a tree of arrays (or PartitionSpecs). Keep "
                "the rest out of it, e.g. with Equinox params, static = eqx.partition(model, "
                "eqx.is_array), and put the model together inside the step (eqx.combine)."
            )
        if isinstance(x, P):
            spec = x
        elif isinstance(getattr(x, "sharding", None), NamedSharding):
            if x.sharding.mesh.shape_tuple != mesh.shape_tuple:
                raise ValueError(
                    f"param {_checks.leaf_name(path)} is sharded over mesh "
                    f"{x.sharding.mesh.shape}, not over {mesh.shape}: place the params on the "
                    "mesh you pass."
                )
            spec = x.sharding.spec
        else:
            spec = P()
        if set(names) & _spec_axes(spec):
            raise ValueError(
                f"param {_checks.leaf_name(path)} is sharded over the data axis {data_axis!r} "
                f"({spec}): "
                "every data worker keeps a whole copy of its params (and they differ during "
                "local steps). Shard it over another axis (e.g. 'fsdp' or 'model') and keep "
                f"{data_axis!r} for the batch."
            )
        return spec

    specs = jax.tree_util.tree_map_with_path(spec_of, params, is_leaf=lambda x: isinstance(x, P))
    return DataParallel(mesh, data_axis, specs)


# ---------------------------------------------------------------------- helpers


def _checked_step(
    step: Callable[..., Any], kwargs: dict, params: Any, opt_state: Any, batch: Any
) -> Any:
    """``step(params, opt_state, batch, **kwargs)``, its result checked (while tracing) against
    dp.jit's contract, ``(params, opt_state, aux)`` in that order: JAX's error for another
    shape names out_shardings and tuple lengths, not the step."""
    out = step(params, opt_state, batch, **kwargs)
    if not isinstance(out, tuple | list) or len(out) != 3:
        got = (
            f"a {type(out).__name__} of {len(out)}"
            if isinstance(out, tuple | list)
            else type(out).__name__
        )
        raise ValueError(
            f"dp.jit's step must return (params, opt_state, aux), got {got}. Return the new "
            "params and optimizer state and anything else per worker as aux (the loss; None "
            "if nothing), e.g. return optax.apply_updates(params, updates), opt_state, loss."
        )
    for i, (what, given) in enumerate((("params", params), ("opt_state", opt_state))):
        if jax.tree.structure(out[i]) != jax.tree.structure(given):
            raise ValueError(
                f"dp.jit's step returned as its {('first', 'second')[i]} value a tree unlike the "
                f"{what} it was given: it must return (params, opt_state, aux) in that order, "
                "the first two with the structure they came in with."
            )
    return tuple(out)  # a list too: the programs' outputs are declared as a tuple


# Primitives that name a mesh axis without moving data between its devices.
_NOT_EXCHANGES = frozenset({"axis_index", "pvary", "pcast"})
_BATCH = object()  # _warn_if_leaves_apart's marker of what depends on the batch
# set by DataParallel.state_target: dp.optimizer's init builds the per-shard state's shapes only
_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("shapes_only", default=False)


def _layouts(state: Any) -> list:
    """The flat layouts of the :class:`~optax_zero_one.core.flat.FlatTree`\\ s in ``state``."""
    found = _graph.nodes_of(state, FlatTree)
    return [node.layout for node in found]


# Calls whose one inner jaxpr maps their inputs to their outputs one to one (no loop carry),
# followed into exactly; any other nested jaxpr (loops, conditionals) counts whole.
_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "shard_map", "remat2", "checkpoint", "custom_jvp_call"}
)


def _inner(eqn: Any) -> list[Any]:
    """The jaxprs inside ``eqn`` (conditionals' branches, loops' bodies, calls)."""
    found = []
    for value in eqn.params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            inner = sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub
            if isinstance(inner, jex.Jaxpr):
                found.append(inner)
    return found


def _call_body(eqn: Any) -> Any:
    """The jaxpr of a call-like ``eqn`` whose inputs and outputs are its own, else ``None``."""
    inner = _inner(eqn)
    if eqn.primitive.name not in _CALLS or len(inner) != 1:
        return None
    body = inner[0]
    fits = len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars)
    return body if fits else None


def _axes_in(eqn: Any, axes: frozenset[str]) -> set[str]:
    """The axes of ``axes`` that ``eqn``, or any jaxpr inside it, exchanges over."""
    got: set[str] = set()
    if eqn.primitive.name not in _NOT_EXCHANGES:
        for key in ("axes", "axis_name"):
            named = eqn.params.get(key)
            named = named if isinstance(named, tuple | list) else (named,)
            got |= {a for a in named if isinstance(a, str) and a in axes}
    for inner in _inner(eqn):
        for sub in inner.eqns:
            got |= _axes_in(sub, axes)
    return got


def _mean_axes(jaxpr: Any, outs: list, axes: frozenset[str]) -> set[str]:
    """The axes of ``axes`` over which a collective that ``outs`` (values of ``jaxpr``) depend
    on exchanges: followed into calls, whole inside loops and conditionals."""
    want = {v for v in outs if isinstance(v, jex.Var)}
    got: set[str] = set()
    for eqn in reversed(jaxpr.eqns):
        hit = [i for i, v in enumerate(eqn.outvars) if v in want]
        if not hit:
            continue
        body = _call_body(eqn)
        if body is not None:
            got |= _mean_axes(body, [body.outvars[i] for i in hit], axes)
        else:
            got |= _axes_in(eqn, axes)
        want |= {v for v in eqn.invars if isinstance(v, jex.Var)}
    return got


def _three(args: tuple, kwargs: dict, call: str) -> tuple[Any, Any, Any]:
    """``(params, opt_state, batch)`` of a call of ``dp.jit``'s step; a ``TypeError`` that says
    how to call it otherwise (Python's named an inner function of ``dp.jit``)."""
    if len(args) == 3 and not kwargs:
        return args
    got = ", ".join(
        [f"{len(args)} by position"] * bool(args or not kwargs) + [f"{k}=" for k in kwargs]
    )
    raise TypeError(
        f"dp.jit's step is called as {call}(params_w, opt_state, batch), with three arguments "
        f"by position; got {got}. The batch may be any tree (pass several arrays as one tuple "
        "or dict); each step's kind comes from the dispatcher (dp.jit(step, schedule=...)), "
        "not from the call."
    )


def _params_passed_through(closed: Any, params: Any) -> frozenset:
    """The key paths of the params leaves a step's traced program (``closed``: its first
    inputs and outputs the params) returns as it was given them."""
    body, made = closed.jaxpr, {}
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return frozenset(
        jax.tree_util.keystr(path)
        for i, ((path, _), out) in enumerate(zip(leaves, body.outvars, strict=False))
        if _passed_through(body, out, made) == i
    )


def _exchanged_axes(jaxpr: Any, axes: frozenset, given: list | None = None) -> list:
    """For each output of ``jaxpr``: the axes of ``axes`` over which a collective moving more
    than one element per worker (an average of values, not a finite flag or a norm) feeds
    it, and the markers in ``axes`` its inputs carry (``given``: each input's). One pass
    forward, followed into calls, conditionals' branches and loops' bodies (loop carries until
    they settle); anything else passes on all its inputs carry."""
    seen: dict = dict(zip(jaxpr.invars, given or [frozenset()] * len(jaxpr.invars)))
    read = lambda v: seen.get(v, frozenset()) if isinstance(v, jex.Var) else frozenset()  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _exchanged_by(eqn, ins, axes)
        seen.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _exchanged_by(eqn: Any, ins: list, axes: frozenset) -> list:
    """:func:`_exchanged_axes` of one equation's outputs, from its inputs' (``ins``)."""
    name, params = eqn.primitive.name, eqn.params
    body = _call_body(eqn)
    if body is not None:
        return _exchanged_axes(body, axes, ins)
    if name == "cond":  # operand i of the eqn (after the index) is input i of every branch
        index, ops = ins[0], ins[1:]
        outs = [index] * len(eqn.outvars)
        for branch in params["branches"]:
            got = _exchanged_axes(branch.jaxpr, axes, ops)
            outs = [a | b for a, b in zip(outs, got, strict=True)]
        return outs
    if name == "scan":
        consts, carried = params["num_consts"], params["num_carry"]
        carry = ins[consts : consts + carried]
        while True:
            args = [*ins[:consts], *carry, *ins[consts + carried :]]
            outs = _exchanged_axes(params["jaxpr"].jaxpr, axes, args)
            grown = [a | b for a, b in zip(carry, outs[:carried], strict=True)]
            if grown == carry:
                return outs
            carry = grown
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        carry = ins[nc + nb :]
        while True:
            (pred,) = _exchanged_axes(params["cond_jaxpr"].jaxpr, axes, [*ins[:nc], *carry])
            outs = _exchanged_axes(params["body_jaxpr"].jaxpr, axes, [*ins[nc : nc + nb], *carry])
            grown = [a | b | pred for a, b in zip(carry, outs, strict=True)]
            if grown == carry:
                return carry
            carry = grown
    whole = frozenset().union(*ins)
    if any(math.prod(getattr(v.aval, "shape", ())) > 1 for v in eqn.outvars):
        whole |= frozenset(_axes_in(eqn, axes))
    else:  # a scalar (a flag, a norm, a loss) neither averages nor teaches what it scales
        whole = frozenset()
    return [whole] * len(eqn.outvars)


def _passed_through(jaxpr: Any, out: Any, made: dict | None = None) -> int | None:
    """The index among ``jaxpr``'s inputs of the value ``out`` is, unchanged (followed out of
    calls: an evaluation step under ``jax.jit`` returns its params through one), else ``None``.
    ``made``: where each jaxpr's values come from, built once per jaxpr (by ``id``)."""
    made = {} if made is None else made
    if id(jaxpr) not in made:
        where = {v: ("in", i) for i, v in enumerate(jaxpr.invars)}
        for eqn in jaxpr.eqns:
            where.update({v: (eqn, i) for i, v in enumerate(eqn.outvars)})
        made[id(jaxpr)] = where
    found = made[id(jaxpr)].get(out) if isinstance(out, jex.Var) else None
    if found is None:
        return None
    eqn, i = found
    if eqn == "in":
        return i
    if _reshapes(eqn):  # dp.jit's worker axis, dropped and put back
        return _passed_through(jaxpr, eqn.invars[0], made)
    body = _call_body(eqn)
    inside = None if body is None else _passed_through(body, body.outvars[i], made)
    return None if inside is None else _passed_through(jaxpr, eqn.invars[inside], made)


def _reshapes(eqn: Any) -> bool:
    """Whether ``eqn`` gives its one array operand's elements another shape only."""
    if len(eqn.outvars) != 1 or not eqn.invars or not isinstance(eqn.invars[0], jex.Var):
        return False
    name, (x, y) = eqn.primitive.name, (eqn.invars[0].aval, eqn.outvars[0].aval)
    same = getattr(x, "size", None) == getattr(y, "size", -1) and x.dtype == y.dtype
    shaped = ("reshape", "squeeze", "expand_dims", "broadcast_in_dim", "copy", "stop_gradient")
    return same and name in shaped


def _hinted(jaxpr: Any) -> bool:
    """Whether a transform in ``jaxpr`` (or inside it) was given a step kind
    (:data:`~optax_zero_one.core._graph.HINTED_SCOPE`)."""
    for eqn in jaxpr.eqns:
        if _graph.HINTED_SCOPE in str(eqn.source_info.name_stack):
            return True
        if any(_hinted(inner) for inner in _inner(eqn)):
            return True
    return False


# what a tree is compared with when no specs are given, and what to do about it (a trial gave
# one model of a GAN's two: "pytree structure error ... pjit out_shardings", from inside JAX)
_PARAMS_SPECS = (
    "the params this helper was built for (data_parallel(mesh, params)). For another tree "
    "pass its specs (specs=jax.tree.map(lambda _: P(), tree) for replicated values); for one "
    "model of several, build a helper per model on the same mesh "
    "(ozo.data_parallel(mesh, params['generator']))"
)


def _check_structure(tree: Any, specs: Any, what: str, specs_what: str) -> None:
    got = jax.tree.structure(tree)
    want = jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P))
    if got != want:
        raise ValueError(f"{what} does not have the structure of {specs_what}: {got} vs {want}")


@jax.jit
def _with_leading_axis(blocks: tuple) -> tuple:
    """``block[None]`` of each of one device's ``blocks``."""
    return tuple(block[None] for block in blocks)


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    """``x`` placed with ``sharding``; every process passes the whole value."""
    if isinstance(x, jax.Array) and x.is_fully_addressable and sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _check_takes_step_kind(step: Callable[..., Any]) -> None:
    """Raises ``ValueError`` now, not at the first step, if ``step`` cannot take ``step_kind=``."""
    try:
        parameters = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): let the call tell
        return
    if not any(
        p.kind == p.VAR_KEYWORD
        or (p.name == "step_kind" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in parameters
    ):
        raise ValueError(
            "dp.jit(step, schedule=...) calls step(params, opt_state, batch, step_kind=kind), "
            "one program per kind, but step takes no step_kind argument. Add a keyword "
            "step_kind=None to step and pass it on: tx.update(grads, opt_state, params, "
            "step_kind=step_kind). Or leave schedule out to decide each step's kind in the graph."
        )


def _stack(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)


def _poison_if_not_finite(updates: Any) -> Any:
    """``updates`` with every element NaN where any element of this worker is not finite
    (computed across the model shards by XLA), else unchanged."""
    leaves = [x for x in jax.tree.leaves(updates) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return updates
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
    return jax.tree.map(
        lambda x: (
            jnp.where(finite, x, jnp.nan).astype(x.dtype)
            if jnp.issubdtype(x.dtype, jnp.inexact)
            else x
        ),
        updates,
    )
