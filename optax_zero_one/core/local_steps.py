"""Local steps with periodic 1-bit synchronisation: a wrapper around any transform.

The third of 0/1 Adam's ideas (``docs/algorithm.md``, "Phase B"): after a start step the
workers run the inner transform on their own gradients, and on the steps a local-step policy
names they replace the interval's local updates by their 1-bit compressed average and all
return to one synchronised point. Around ``optax.sgd`` this is local SGD with 1-bit model
averaging; around a frozen-variance Adam it is 0/1 Adam's sync
(:class:`~optax_zero_one.FrozenAdamSync`, which lives beside :func:`~optax_zero_one.zero_one_adam`).

What the wrapper needs of the inner state, and may set in it, is the business of a *sync rule*:
what to send (``u``, or ``u`` weighted per element), and what to reset after a sync (e.g. the
momentum). :class:`ParamsAverage` needs nothing; :class:`MomentumAverage` (and 0/1 Adam's
rule) read and set named fields of the inner state. The wrapper itself never opens the inner
state: what it needs of it, the rule gives it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_zero_one.core import _checks, _graph, flat, kinds, policies
from optax_zero_one.core import collective as collective_lib  # `collective` names the backend
from optax_zero_one.core import comm as comm_lib
from optax_zero_one.core.comm import Comm
from optax_zero_one.core.flat import FlatTree
from optax_zero_one.core.kinds import StepKind


class LocalStepSyncState(NamedTuple):
    """State of :func:`local_step_sync`, one per worker.

    Attributes:
      count: int32, the number of updates done.
      local_step_policy: the local-step policy's counters (int32, identical on all workers).
      anchor: ``xbar``, the last synchronised point (float32 or wider, like the params),
        bitwise identical on every worker. Kept from the first step after ``start_step`` on;
        before it the params themselves are synchronised (see ``anchored``).
      anchored: bool, whether local steps have begun (then ``anchor`` is the synchronised point).
      lr_sum: float32, the sum of the learning rates since the last sync.
      errors: the compressed mean's error buffers, or ``optax.EmptyState()`` when the sync rule
        lends the wrapper idle buffers of the inner state.
      skipped_updates: int32, communicating steps that every worker skipped together because
        some worker's input was not finite (and, before ``start_step``, steps whose
        ``step_kind`` hint the inner transform refused: :func:`~optax_zero_one.check_hints`
        tells them apart).
      dropped_local_grads: int32, local steps at which *this* worker's gradient was not finite
        and was replaced by zero.
      inner_state: the inner transform's state.
      outer_state: the outer optimizer's state (identical on every worker), or
        ``optax.EmptyState()`` without one.
      refused_hint: int32 ``(2,)``: refused hints and the branch asked for at the last one
        (as in :class:`~optax_zero_one.ScheduledMeanState`).
    """

    KEEPS_BUFFERS = True  # its transform keeps its buffers on a skipped step
    INNER_FIELDS = ("inner_state", "outer_state")  # other transforms' states

    count: jax.Array
    local_step_policy: Any
    anchor: optax.Params
    anchored: jax.Array
    lr_sum: jax.Array
    errors: Any
    skipped_updates: jax.Array
    dropped_local_grads: jax.Array
    inner_state: optax.OptState
    outer_state: optax.OptState
    refused_hint: jax.Array

    STEP_COUNTER = "count"
    REFUSED_HINT = "refused_hint"
    SHARED = "anchor"  # the same on every worker (a dispatcher compares it once)
    BRANCHES = ("pass through (before start_step)", "a local step", "a sync")

    @staticmethod
    def walked(walked: Any) -> tuple[tuple[str, Any], ...]:
        """The fields a host's walk of the schedule predicts (``walked``: a
        :class:`~optax_zero_one.core.kinds.Walked`), as ``(field, value)``: the local-step
        policy's counters as the walk advanced them, and whether local steps have begun (the
        walk is past ``start_step``). A dispatcher compares them with a state it did not
        produce (a restore) before running it: a state saved under other schedule arguments
        carries another history, which the arguments given now would not replay."""
        return (("local_step_policy", walked.local), ("anchored", walked.begun))

    def at_last_sync(self, params: Any) -> tuple[Any, set[str]]:
        """``params`` with the leaves this state synchronises taken from its anchor once local
        steps have begun (every leaf, or, where the optimizer updates part of the tree,
        ``optax.masked`` or ``optax.multi_transform``, the leaves at the anchor's key paths), and
        those leaves' key paths (:func:`~optax_zero_one.synchronized_params`' hook)."""
        anchor = self.anchor.to_tree() if isinstance(self.anchor, FlatTree) else self.anchor
        anchored = jnp.asarray(self.anchored)
        found, treedef = jax.tree_util.tree_flatten_with_path(params)
        anchors = jax.tree_util.tree_leaves_with_path(anchor)
        where = _matched(found, [flat._leaf_name(path) for path, _ in anchors])
        leaves = [x for _, x in found]
        for i, (_, a) in zip(where, anchors, strict=True):
            x, a = jnp.asarray(leaves[i]), jnp.asarray(a)
            if x.shape != a.shape:
                raise ValueError(
                    f"params leaf {_checks.leaf_name(found[i][0])} has shape {x.shape}, but the "
                    f"optimizer state's last synchronised point has {a.shape}: pass the params "
                    "this state was built for (both one worker's, or both in the worker layout)."
                )
            flag = anchored.reshape(anchored.shape + (1,) * (a.ndim - anchored.ndim))
            leaves[i] = jnp.where(flag, a.astype(x.dtype), x)
        return jax.tree.unflatten(treedef, leaves), {flat._leaf_name(found[i][0]) for i in where}

    def moved(self, every: Any, fresh: LocalStepSyncState, move: Any) -> LocalStepSyncState:
        """To another worker count (:func:`~optax_zero_one.reset_compression`): every new
        worker starts at the last synchronised point with an empty interval; counters carry
        on; the error buffers (own or the inner state's) start afresh."""
        if isinstance(self.anchor, FlatTree):
            names = list(self.anchor.layout.paths)
            points = _params_at(move.params, names)
            anchor = flat.to_flat(points, fresh.anchor.layout, fresh.anchor.buffer.dtype)
        else:
            leaves, treedef = jax.tree_util.tree_flatten_with_path(self.anchor)
            names = [flat._leaf_name(path) for path, _ in leaves]
            points = _params_at(move.params, names)
            anchor = jax.tree.unflatten(
                treedef, [np.asarray(p, a.dtype) for p, (_, a) in zip(points, leaves, strict=True)]
            )
        return fresh._replace(
            count=self.count,
            local_step_policy=self.local_step_policy,
            anchor=anchor,
            anchored=self.anchored,
            lr_sum=np.zeros_like(self.lr_sum),
            skipped_updates=self.skipped_updates,
            dropped_local_grads=self.dropped_local_grads,
            inner_state=move(self.inner_state, every.inner_state, fresh.inner_state),
            # the same on every worker: worker 0's, laid out again where it is flat
            outer_state=move(self.outer_state, every.outer_state, fresh.outer_state),
            refused_hint=self.refused_hint,
        )


def _params_at(params: Any, names: list[str]) -> list:
    """The leaves of ``params`` that an anchor of leaves ``names`` (key paths) holds, in its
    order (:func:`_matched`)."""
    found = jax.tree_util.tree_flatten_with_path(params)[0]
    return [found[i][1] for i in _matched(found, names)]


def _matched(found: list, names: list[str]) -> list[int]:
    """For each leaf ``names`` of an anchor (key paths), the index of the params leaf it holds
    among ``found`` (``(path, leaf)`` pairs): every leaf in order where the counts agree (the
    optimizer saw the whole tree, perhaps wrapped otherwise), else by key path
    (``optax.multi_transform``, ``optax.masked``: the anchor holds a part)."""
    if len(found) == len(names):
        return list(range(len(names)))
    index = {flat._leaf_name(path): i for i, (path, _) in enumerate(found)}
    missing = [name for name in names if name not in index]
    if missing:
        raise ValueError(
            f"the optimizer state's last synchronised point holds leaves {missing[:3]} that "
            "params has not: pass the params this optimizer updates (the whole tree given "
            "to update)."
        )
    return [index[name] for name in names]


# What the wrapper does at a step: pass through (before start_step), a local step, a sync.
PASS, LOCAL, SYNC = range(3)

# How a sync averages: the two 1-bit backends of the compressed mean, or an exact float mean.
SYNC_COLLECTIVES = comm_lib.SYNC_COLLECTIVES


@dataclasses.dataclass(frozen=True)
class ParamsAverage:
    """Sync rule: send ``u`` (the interval's local updates), change nothing in the inner state.

    Around ``optax.sgd`` this is local SGD with 1-bit model averaging.
    """

    def learning_rate_at(self, count: jax.Array) -> Any:
        """The inner transform's learning rate at ``count`` (for the interval's sum); this
        rule does not use the sum."""
        del count
        return 0.0

    def weight(self, inner_state: Any) -> Any:
        """``None``: the payload is ``u`` itself."""
        del inner_state
        return None

    def unweighted(self, inner_state: Any, mean: Any) -> Any:
        """The averaged distance from the anchor from the mean of the weighted payloads
        (``what / w``); the anchor moves by minus it."""
        weight = self.weight(inner_state)
        return mean if weight is None else jax.tree.map(jnp.divide, mean, weight)

    def after_sync(self, inner_state: Any, mean: Any, lr_sum: jax.Array, ok: jax.Array) -> Any:
        """The inner state after a sync: nothing to reset.

        Where ``ok`` is false (the mean was not finite and the step is skipped) a rule leaves the
        buffers it would write as they are.
        """
        del mean, lr_sum, ok
        return inner_state

    def errors(self, inner_state: Any, start_step: int) -> Any:
        """``None``: the wrapper keeps its own error buffers."""
        del inner_state, start_step
        return None

    def with_errors(self, inner_state: Any, errors: Any) -> Any:
        del errors
        return inner_state

    #: Whether the inner transform is past its own phase A whenever the wrapper is past
    #: ``start_step`` (then, deciding in the graph, the wrapper tells it so at local steps and
    #: syncs, and the program holds the inner transform's phase-A branches once, not thrice).
    inner_frozen_after_start: ClassVar[bool] = False


def replace_nodes(tree: Any, cls: type, fn: Any) -> Any:
    return jax.tree.map(
        lambda node: fn(node) if isinstance(node, cls) else node,
        tree,
        is_leaf=lambda x: isinstance(x, cls),
    )


def divide_by_sum(mean: Any, lr_sum: jax.Array) -> Any:
    """``mean / lr_sum`` (zero if the learning rates of the interval sum to zero)."""
    positive = lr_sum > 0
    inverse = jnp.where(positive, 1.0 / jnp.where(positive, lr_sum, 1.0), 0.0)
    return jax.tree.map(lambda w: w * inverse.astype(w.dtype), mean)


@dataclasses.dataclass(frozen=True)
class MomentumAverage(ParamsAverage):
    """Sync rule for ``optax.sgd(..., momentum=b)``: after a sync the momentum (optax's
    ``TraceState.trace``) becomes the learning-rate-weighted mean momentum of the interval,
    ``what / sum(lr)``.

    Args:
      learning_rate: the inner transform's learning rate (a float or schedule of the count).
    """

    learning_rate: optax.ScalarOrSchedule  # no default: 0 would zero the momentum at syncs

    def __post_init__(self) -> None:
        _checks.check_learning_rate(self.learning_rate)

    def learning_rate_at(self, count: jax.Array) -> Any:
        return _checks.evaluate(self.learning_rate, count)

    def errors(self, inner_state: Any, start_step: int) -> Any:
        """``None`` (the wrapper keeps its own error buffers), once the inner state is seen to
        hold the one momentum this rule resets (called at ``init`` and again at each traced
        update, where the check costs nothing on the device)."""
        found = len(_graph.nodes_of(inner_state, optax.TraceState))
        if found != 1:
            raise ValueError(
                f"MomentumAverage resets the momentum of an inner optax.sgd(learning_rate, "
                f"momentum=...) (one optax.TraceState in its state), but the inner state holds "
                f"{found}. Give the inner SGD a momentum, or use the default rule "
                "(ParamsAverage) for an inner optimizer without one."
            )
        return super().errors(inner_state, start_step)

    def after_sync(self, inner_state: Any, mean: Any, lr_sum: jax.Array, ok: jax.Array) -> Any:
        old = _graph.only_node(inner_state, optax.TraceState, "MomentumAverage").trace
        # in the trace's dtype (optax keeps it in the params' one: bfloat16 params gave a float32
        # trace after the first sync, which a step deciding in the graph refused)
        new = jax.tree.map(lambda w, o: w.astype(o.dtype), divide_by_sum(mean, lr_sum), old)
        momentum = _graph.keep_if(ok, new, old)
        return replace_nodes(inner_state, optax.TraceState, lambda s: s._replace(trace=momentum))


def local_step_sync(
    inner: optax.GradientTransformation,
    local_step_policy: policies.LocalStepPolicy,
    axis_name: str | None,
    *,
    start_step: int = 0,
    rule: Any = None,
    num_workers: int | tuple[int, int] | None = None,
    collective: str = "two_phase",
    mask: Any = None,
    fast_axis_name: str | None = None,
    outer: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Local steps of ``inner``, replaced by their 1-bit compressed average on sync steps.

    For update ``k``, with ``x`` this worker's params, ``xbar`` the last synchronised point and
    ``d = inner(g)`` the inner transform's update::

        k <= start_step:   pass through (the inner transform is expected to average)
        otherwise:         x' = x + d                         (a local step: no communication)
        and on a sync:     u = xbar - x'                      (the interval's local updates)
                           what = mask * C(u * w)             (w: the rule's weight, e.g. 1)
                           xbar <- xbar - what / w;  x <- xbar
                           inner state <- rule.after_sync(inner state, what, sum of lrs)

    With an ``outer`` optimizer the averaged distance is a pseudo-gradient (DiLoCo's outer
    step): ``delta = what / w``, ``(s, outer state) = outer.update(delta, outer state, xbar)``,
    ``xbar <- xbar + s``. ``outer=optax.sgd(1.0)`` is the move above, to the bit; Nesterov
    momentum (``optax.sgd(0.7, momentum=0.9, nesterov=True)``) around AdamW is DiLoCo
    (:func:`~optax_zero_one.diloco`). ``C`` is 1-bit (``collective="two_phase"`` or ``"psum"``,
    with error feedback) or, with ``collective="float"``, the exact float32 mean.

    A sync step is a step ``k > start_step`` the local-step policy names; the policy advances on
    every such ``k``. The update returned at a sync is ``xbar - x``, so ``apply_updates`` gives
    ``x + (xbar - x)``: ``xbar`` up to the last bit of the params' dtype, which may differ
    between workers. Nothing drifts: ``xbar`` itself is shared exactly, and the next sync
    starts from it (evaluate :func:`~optax_zero_one.synchronized_params`, which is ``xbar``).
    Nothing may be chained after this wrapper that changes the updates.

    Non-finite values: up to ``start_step`` the inner transform averages, so a NaN or Inf on
    any worker reaches every worker through the mean and all skip the step together (the update
    is zero, the state is kept: the transforms that own buffers keep them, the wrapper restores
    every counter; ``skipped_updates`` grows). After it each worker's gradient is its own: a
    non-finite one is replaced by zero on that worker (``dropped_local_grads``), so local steps
    and syncs go on. Should a sync's mean still not be finite (an overflow), the sync is skipped
    together: no move, the anchor, the counters and an optax inner state (e.g. AdamW's moments)
    are kept; a frozen-variance Adam's momentum keeps this step's local update.

    Args:
      inner: the transformation run on every step (locally after ``start_step``).
      local_step_policy: which steps after ``start_step`` synchronise
        (e.g. :class:`~optax_zero_one.LocalStepDoubling`).
      axis_name: the worker axis, or ``None`` for one worker.
      start_step: the last step before local steps begin (0: from the first step). Up to it
        ``inner`` must average across workers itself (unchecked; ``docs/diloco.md`` shows
        one way): the first step after it takes each worker's params as its anchor.
      rule: what a sync sends and resets (default :class:`ParamsAverage`; 0/1 Adam uses
        :class:`~optax_zero_one.FrozenAdamSync`, SGD with momentum :class:`MomentumAverage`).
        A rule of one's own has ``ParamsAverage``'s methods: ``learning_rate_at``,
        ``weight``, ``after_sync``, ``errors``, and ``with_errors`` if ``errors`` lends
        buffers; ``unweighted`` and ``inner_frozen_after_start`` are optional.
      num_workers: needed only when ``init`` runs outside the mapped context.
      collective: how a sync averages: ``"two_phase"`` or ``"psum"`` (the 1-bit compressed
        mean's backends) or ``"float"`` (an exact float32 mean: one all-reduce, no error
        buffers).
      mask: optional tree of 0/1 like the params, multiplying the synchronised average.
      fast_axis_name: the axis inside a node; syncs are then hierarchical, exact over it and
        1-bit only over ``axis_name`` (:func:`~optax_zero_one.onebit_mean`; a float sync
        reduces inside the nodes first). Local steps stay local: no communication, not even
        inside a node (``docs/hierarchical.md``).
      outer: optional optax transformation applied at each sync to the averaged distance to
        the last synchronised point (the pseudo-gradient), with the anchor as its params; its
        state lives in this wrapper's state. ``None``: move by the average itself.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`LocalStepSyncState`;
      ``update`` needs ``params``.

    Example:
      >>> tx = ozo.local_step_sync(optax.sgd(0.1), ozo.LocalStepDoubling(100, 8), "w")  # local SGD

    References:
      Lu et al., 0/1 Adam, arXiv:2202.06009 (Algorithm 1); Lin et al., Don't Use Large
      Mini-Batches, Use Local SGD, arXiv:1808.07217.
    """
    if collective not in SYNC_COLLECTIVES:
        raise ValueError(
            f"local_step_sync's collective must be one of {SYNC_COLLECTIVES}, got {collective!r}."
        )
    if _checks.check_transformation("inner", inner) is None:
        raise TypeError("local_step_sync needs an inner optax transformation, got None.")
    _checks.check_policy(
        "local_step_policy",
        local_step_policy,
        "is_sync_step",
        "ozo.SyncEvery(50) or ozo.LocalStepDoubling(scaler, clipper)",
    )
    comm = Comm.of(
        axis_name, fast_axis_name, num_workers, collective, mask, collectives=SYNC_COLLECTIVES
    )
    return local_step_sync_over(
        inner, local_step_policy, comm, start_step=start_step, rule=rule, outer=outer
    )


def local_step_sync_over(
    inner: optax.GradientTransformation,
    local_step_policy: policies.LocalStepPolicy,
    comm: Comm,
    *,
    start_step: int = 0,
    rule: Any = None,
    outer: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
    """:func:`local_step_sync` for a checked :class:`~optax_zero_one.core.comm.Comm` (its
    ``collective`` one of :data:`SYNC_COLLECTIVES`)."""
    axes = comm.axes
    _checks.check_int("start_step", start_step, 0)
    exact = comm.exact
    rule = ParamsAverage() if rule is None else rule
    _check_rule(rule)
    inner = optax.with_extra_args_support(inner)
    outer = _checks.check_transformation("outer", outer)
    # Whether the first step after start_step is a sync whatever happens (LocalStepDoubling's
    # interval starts at 1): then a local step never has to take the synchronised point.
    first_is_sync = _static_truth(
        local_step_policy.is_sync_step(local_step_policy.init(), start_step + 1)
    )

    def init_fn(params: optax.Params) -> LocalStepSyncState:
        _checks.check_float_leaves(params, "params")
        comm.check_mask(params)
        comm.init_workers(params)
        inner_state = inner.init(params)
        borrowed = rule.errors(inner_state, start_step)
        if borrowed is not None and not callable(getattr(rule, "with_errors", None)):
            raise ValueError(
                f"rule {rule!r} lends error buffers (its errors() returned some) but has no "
                "with_errors(inner_state, errors) to store a sync's new ones back: add it "
                "(ozo.FrozenAdamSync shows one), or return None from errors() to let "
                "local_step_sync keep its own."
            )
        own = (
            optax.EmptyState()
            if borrowed is not None or exact
            else collective_lib.init_state(params, comm)
        )
        anchor = jax.tree.map(
            lambda p: jnp.array(p, jnp.promote_types(jnp.result_type(p), jnp.float32)), params
        )
        state = LocalStepSyncState(
            count=jnp.zeros([], jnp.int32),
            local_step_policy=_checks.as_int32_state(local_step_policy.init()),
            anchor=anchor,
            anchored=jnp.zeros([], bool),
            lr_sum=jnp.zeros([], jnp.float32),
            errors=own,
            skipped_updates=jnp.zeros([], jnp.int32),
            dropped_local_grads=jnp.zeros([], jnp.int32),
            inner_state=inner_state,
            outer_state=optax.EmptyState() if outer is None else outer.init(anchor),
            refused_hint=_graph.no_refusals(),
        )
        return _graph.worker_state(state, axes)

    def branch_of(kind: StepKind) -> int:
        return PASS if kind.phase_a else (SYNC if kind.sync else LOCAL)

    def expected(state: LocalStepSyncState) -> jax.Array:
        k = optax.safe_increment(state.count)  # saturates, as the count does
        sync = local_step_policy.is_sync_step(state.local_step_policy, k)
        return _graph.index_of([k <= start_step, jnp.logical_not(sync), True])  # PASS, LOCAL, SYNC

    def update_fn(updates: Any, state: LocalStepSyncState, params: Any, **extra_args: Any) -> Any:
        params = _checked_params(updates, state, params)
        _check_outer_state(outer, state)
        comm.update_workers(updates)
        kind = kinds.check_step_kind(extra_args.get("step_kind"), "local_step_sync")
        hint = None if kind is None else branch_of(kind)
        run = lambda b, ok, o, extra: step(b, ok, *o, params, extra)  # noqa: E731
        return _graph.by_kind(
            hint, expected(state), 3, run, (updates, state), extra_args, axes, _graph.zero_unless
        )

    def step(
        branch: int, admit: Any, updates: Any, state: LocalStepSyncState, params: Any, extra: dict
    ) -> Any:
        k = optax.safe_increment(state.count)  # saturates, as the count does
        skipped = state._replace(skipped_updates=state.skipped_updates + 1)
        if branch == PASS:  # the inner transform communicates: check what it returned
            out, inner_state = inner.update(updates, state.inner_state, params, **extra)
            out = jax.tree.map(lambda d, a: d.astype(a.dtype), out, state.anchor)
            new_state = state._replace(count=optax.safe_increment(state.count))
            new_state = new_state._replace(inner_state=inner_state)
            finite = _graph.finite_or_skipped(out, inner_state, state.inner_state)
            # the inner state may be any optax state (e.g. optax.adamw's moments, which took
            # the non-finite mean): its buffers are restored too, not only the counters
            return _graph.zero_unless(finite, out), _graph.restore_skipped(
                finite, new_state, skipped
            )

        # After start_step this worker's gradient is its own: dropped if it is not finite.
        drop = jnp.logical_not(_graph.all_finite(updates))
        grads = _graph.zero_unless(jnp.logical_not(drop), updates)
        if getattr(rule, "inner_frozen_after_start", False):  # the library's own inner transform
            extra = {**extra, kinds.INPUTS_FINITE: True}
            if extra.get("step_kind") is None:
                extra["step_kind"] = kinds.SYNC if branch == SYNC else kinds.LOCAL
        out, inner_state = inner.update(grads, state.inner_state, params, **extra)
        out = jax.tree.map(lambda d, a: d.astype(a.dtype), out, state.anchor)
        lr_sum = state.lr_sum + rule.learning_rate_at(state.count)
        anchor, own, outer_state = state.anchor, state.errors, state.outer_state
        first = jnp.logical_not(state.anchored)  # the first step after start_step
        finite = jnp.ones([], bool)
        if branch == SYNC or not first_is_sync:
            # The synchronised point is where every worker is at the first local step; the
            # borrowed error buffers start from zero there. (With a policy whose first step
            # after start_step is always a sync, as LocalStepDoubling's, a local step never
            # needs this and reads neither buffer.)
            x = jax.tree.map(lambda p, a: p.astype(a.dtype), params, anchor)
            first = jnp.logical_and(first, admit)
            held = anchor
            anchor = jax.tree.map(lambda a, p: jnp.where(first, p, a), anchor, x)
            inner_state, own = _fresh_errors(rule, inner_state, start_step, own, first)
        if branch == SYNC:
            errors = before = _lent(rule, inner_state, start_step, own)
            payload = _payload(rule, inner_state, held, x, out, first)
            mean, new_errors, finite = _compressed(payload, errors)
            errors = _graph.keep_if(admit, new_errors, errors)
            finite = jnp.logical_and(finite, admit)
            delta = _pseudo_gradient(rule, inner_state, mean)
            if outer is None:
                anchor = jax.tree.map(lambda a, m: jnp.where(finite, a - m, a), anchor, delta)
            else:  # a non-finite outer step skips the sync as a non-finite mean does
                moves, new_outer = outer.update(delta, outer_state, anchor)
                moved = _graph.all_finite(moves)
                # the payload is not sent after all: its residuals are not kept (a finite mean
                # has left finite buffers; a non-finite one zeroed them, as a skip does)
                errors = _graph.keep_if(moved, errors, before)
                finite = jnp.logical_and(finite, moved)
                # any optax state (Nesterov's momentum took the non-finite delta): kept whole
                outer_state = _graph.restore_skipped(finite, new_outer, outer_state)
                anchor = jax.tree.map(
                    lambda a, s: jnp.where(finite, a + s.astype(a.dtype), a), anchor, moves
                )
            inner_state = rule.after_sync(inner_state, mean, lr_sum, finite)
            inner_state, own = _give_back(rule, inner_state, start_step, own, errors)
            # a skipped sync leaves an optax inner state (AdamW's moments, which took this
            # step's gradient) as it was, with its count; this library's states keep their
            # buffers themselves (0/1 Adam's momentum keeps the local update: documented)
            inner_state = _graph.restore_skipped(finite, inner_state, state.inner_state)
            out = jax.tree.map(lambda a, x: jnp.where(finite, a - x, jnp.nan), anchor, x)
            lr_sum = jnp.zeros_like(lr_sum)
        new_state = LocalStepSyncState(
            count=optax.safe_increment(state.count),
            local_step_policy=policies.advance(local_step_policy, state.local_step_policy, k, True),
            anchor=anchor,
            anchored=jnp.ones([], bool),
            lr_sum=lr_sum,
            errors=own,
            skipped_updates=state.skipped_updates,
            dropped_local_grads=state.dropped_local_grads + drop.astype(jnp.int32),
            inner_state=inner_state,
            outer_state=outer_state,
            refused_hint=state.refused_hint,
        )
        return _graph.keep_if_finite(finite, out, new_state, skipped)

    def _compressed(payload: Any, errors: Any) -> tuple[Any, Any, jax.Array]:
        values, in_form = flat.as_flat(payload, _checks.axis_size(axes))
        if exact:  # no error feedback: the (borrowed) buffers are left as they are
            mean = collective_lib.float_mean(values, axes)
            mean = FlatTree(mean.buffer.astype(values.buffer.dtype), mean.layout)
            masked = collective_lib.flat_mask(comm.mask, values.layout, values.buffer.dtype)
            mean = collective_lib.apply_mask(masked, mean)
            return in_form(mean), errors, _graph.all_finite(mean.buffer)
        mean, errors, ok = collective_lib.masked_compressed_mean(
            values, errors, axes, comm.collective, comm.mask
        )
        return in_form(mean), errors, ok

    return _checks.transformation(init_fn, update_fn, LocalStepSyncState, "local_step_sync")


def _static_truth(value: Any) -> bool:
    """``bool(value)`` where it is known at trace time; ``False`` for a traced value (policies
    built from traced arguments, e.g. under ``optax.inject_hyperparams`` or in tests)."""
    try:
        return bool(value)
    except jax.errors.TracerBoolConversionError:
        return False


def _check_outer_state(outer: Any, state: LocalStepSyncState) -> None:
    """Raises ``ValueError`` where ``state.outer_state`` is not what ``outer.init`` makes (a
    state of another outer optimizer failed deep in optax, e.g. "'TraceState' object has no
    attribute 'mu'")."""
    made = optax.EmptyState() if outer is None else jax.eval_shape(outer.init, state.anchor)
    if jax.tree.structure(made) != jax.tree.structure(state.outer_state):
        raise ValueError(
            "The optimizer state's outer_state was not made by this outer optimizer (another "
            "outer transform, or outer=None against one): restore a checkpoint of this "
            "optimizer, or initialise the state with it."
        )


def _checked_params(updates: Any, state: LocalStepSyncState, params: Any) -> Any:
    _checks.check_tree_matches(updates, state.anchor, "updates", "the optimizer state")
    if params is None:
        if any(jnp.size(x) for x in jax.tree.leaves(updates)):
            raise ValueError(
                "local_step_sync's update needs the params: update(grads, state, params). A "
                "sync sends each worker's distance to the last synchronised point."
            )
        return jax.tree.map(jnp.zeros_like, updates)  # nothing to optimise
    _checks.check_tree_matches(params, state.anchor, "params", "the optimizer state")
    return params


def _check_rule(rule: Any) -> None:
    """Raises ``ValueError`` unless ``rule`` is a sync rule object, not its class or a name.

    The protocol, :class:`ParamsAverage` being its plain form: ``learning_rate_at``,
    ``weight``, ``after_sync`` and ``errors`` are required; ``with_errors`` is required of a
    rule whose ``errors`` lends buffers (checked at ``init``); ``unweighted`` and
    ``inner_frozen_after_start`` are optional, ``ParamsAverage``'s when absent."""
    methods = ("learning_rate_at", "weight", "after_sync", "errors")
    example = "ozo.ParamsAverage() or ozo.MomentumAverage(learning_rate)"
    _checks.check_protocol("rule", rule, methods, example, "sync rule")


def _payload(rule: Any, inner_state: Any, anchor: Any, x: Any, step: Any, first: Any) -> Any:
    """``u * w``: this worker's distance to the anchor after its local step, weighted; the
    anchor is ``x`` where ``first``.

    The same values as ``where(first, x, anchor) - (x + step)``, written per branch so that
    XLA does not share (and write out) the selected anchor between this and the anchor's
    update: one pass over the buffer less per sync on XLA:CPU."""
    weight = rule.weight(inner_state)
    u = jax.tree.map(lambda a, x, d: jnp.where(first, x - (x + d), a - (x + d)), anchor, x, step)
    return u if weight is None else jax.tree.map(jnp.multiply, u, weight)


def _pseudo_gradient(rule: Any, inner_state: Any, mean: Any) -> Any:
    """``what / w``: the averaged distance from the anchor (the anchor moves by minus it); a
    rule of its own making without ``unweighted`` gets :class:`ParamsAverage`'s."""
    own = getattr(rule, "unweighted", None)
    return (
        ParamsAverage.unweighted(rule, inner_state, mean) if own is None else own(inner_state, mean)
    )


def _lent(rule: Any, inner_state: Any, start_step: Any, own: Any) -> Any:
    """The error buffers for a sync: the inner state's, if the rule lends them, else our own."""
    lent = rule.errors(inner_state, start_step)
    return own if lent is None else lent


def _fresh_errors(rule: Any, inner_state: Any, start_step: Any, own: Any, first: Any) -> tuple:
    """``(inner_state, own)`` with the error buffers a sync uses zeroed where ``first``: borrowed
    buffers held another mean's residuals until start_step."""
    lent = rule.errors(inner_state, start_step)
    if lent is None:
        return inner_state, own
    zeroed = jax.tree.map(lambda e: jnp.where(first, jnp.zeros([], e.dtype), e), lent)
    return rule.with_errors(inner_state, zeroed), own


def _give_back(rule: Any, inner_state: Any, start_step: Any, own: Any, errors: Any) -> tuple:
    """``(inner_state, own)`` with the sync's new error buffers stored where they came from."""
    if rule.errors(inner_state, start_step) is None:
        return inner_state, errors
    return rule.with_errors(inner_state, errors), own
