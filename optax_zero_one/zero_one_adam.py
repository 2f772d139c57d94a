"""0/1 Adam: frozen variance on a doubling schedule, 1-bit compression and local steps.

The step kind is chosen in the graph from replicated counters (``ALGORITHM.md``, "0/1 Adam"):

========== ======================= =====================================================
kind       when                    communication
========== ======================= =====================================================
variance   ``k <= F``, policy says one fused float all-reduce of the gradients
compressed ``k <= F``, otherwise   1-bit compressed mean of the gradients
local      ``k > F``, otherwise    none
sync       ``k > F``, policy says  1-bit compressed mean of the accumulated update
========== ======================= =====================================================

Only the communication sits in a ``lax.switch`` (an untaken branch sends nothing); the moment
and parameter arithmetic of all kinds is elementwise and fused by XLA around it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_zero_one import _checks, policies
from optax_zero_one import collective as collective_lib  # `collective` names the backend

VARIANCE, COMPRESSED, LOCAL, SYNC = 0, 1, 2, 3
STEP_KINDS = ("variance", "compressed", "local", "sync")


class ZeroOneAdamState(NamedTuple):
    """State of :func:`scale_by_zero_one_adam`, one per worker.

    Attributes:
      count: int32, the number of updates done (``k - 1`` during update ``k``).
      variance_policy: the variance policy's state (int32 counters, identical on all workers).
      local_step_policy: the local-step policy's state (int32 counters, identical on all workers).
      mu: first moment ``m``, float32, like the params.
      nu: second moment ``v``, float32, like the params (frozen after ``var_freeze_step``).
      accumulator: ``u``, the sum of this worker's updates since the last sync (``x + u`` is the
        last synchronised point), float32, like the params.
      lr_sum: float32, the sum of learning rates since the last sync.
      comm: the error-feedback buffers of the compressed mean.
      skipped_updates: int32, communicating steps skipped by every worker together because
        some worker's input was not finite (identical on all workers).
      dropped_local_grads: int32, local steps at which *this* worker's gradient was not finite
        and was replaced by zero.
    """

    count: jax.Array
    variance_policy: Any
    local_step_policy: Any
    mu: optax.Updates
    nu: optax.Updates
    accumulator: optax.Updates
    lr_sum: jax.Array
    comm: collective_lib.OnebitMeanState
    skipped_updates: jax.Array
    dropped_local_grads: jax.Array


def step_kind(
    state: ZeroOneAdamState,
    variance_policy: policies.VariancePolicy,
    local_step_policy: policies.LocalStepPolicy,
) -> jax.Array:
    """The kind (:data:`VARIANCE`, :data:`COMPRESSED`, :data:`LOCAL`, :data:`SYNC`) of the next
    update, computed from the counters in ``state`` (identical on every worker).

    An int32 array in the usual case. If the counters are Python ints (a state "pinned" to one
    step, e.g. to compile and account for one step kind on its own), the kind is a Python int
    and the update traces only that kind's branch.
    """
    k = state.count + 1
    phase_a = k <= variance_policy.freeze_step
    var_step = variance_policy.is_update_step(state.variance_policy, k)
    sync = local_step_policy.is_sync_step(state.local_step_policy, k)
    if _checks.all_static(phase_a, var_step, sync):
        return (VARIANCE if var_step else COMPRESSED) if phase_a else (SYNC if sync else LOCAL)
    return jnp.where(
        phase_a, jnp.where(var_step, VARIANCE, COMPRESSED), jnp.where(sync, SYNC, LOCAL)
    ).astype(jnp.int32)


def local_step(
    mu: Any, nu: Any, grads: Any, params: Any, lr: jax.Array, b1: float, eps: float, wd: float
) -> tuple[Any, Any]:
    """One local (phase B) step with frozen variance, no communication.

    ``m' = b1 m + (1-b1) g`` with the local gradient and ``d = m' / (sqrt(v) + eps) + wd x``.

    Returns:
      ``(m', d)``; the parameter update is ``-lr * d`` and the accumulator grows by ``lr * d``.
    """
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
    direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    if params is not None:
        direction = jax.tree.map(lambda d, x: d + wd * x.astype(d.dtype), direction, params)
    return mu, direction


def sync_payload(accumulator: Any, nu: Any, eps: float) -> Any:
    """What a sync step communicates: ``w = u * (sqrt(v) + eps)``, the interval's momentum sum
    weighted by the learning rates (linear in ``m`` because ``v`` is frozen)."""
    return jax.tree.map(lambda u, v: u * (jnp.sqrt(v) + eps), accumulator, nu)


def sync_step(
    accumulator: Any, mean_payload: Any, nu: Any, lr_sum: jax.Array, eps: float
) -> tuple[Any, Any]:
    """Finishes a sync step given the (compressed) mean ``what`` of :func:`sync_payload`.

    Every worker returns to its last synchronised point and takes the averaged step::

        x <- x + u - what / (sqrt(v) + eps)     m <- what / lrs

    (``m <- 0`` if the learning rates of the interval sum to zero, so that ``m`` stays finite and
    identical on every worker.)

    Returns:
      ``(m, delta)``: the new momentum and the parameter update ``u - what / (sqrt(v) + eps)``.
    """
    positive = lr_sum > 0
    inverse = jnp.where(positive, 1.0 / jnp.where(positive, lr_sum, 1.0), 0.0)
    mu = jax.tree.map(lambda w: w * inverse, mean_payload)
    delta = jax.tree.map(lambda u, w, v: u - w / (jnp.sqrt(v) + eps), accumulator, mean_payload, nu)
    return mu, delta


def scale_by_zero_one_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    variance_policy: policies.VariancePolicy | None = None,
    local_step_policy: policies.LocalStepPolicy | None = None,
    axis_name: str | None = None,
    num_workers: int | None = None,
    mask: Any = None,
    collective: str = "two_phase",
) -> optax.GradientTransformationExtraArgs:
    r"""The 0/1 Adam update, learning rate and weight decay included, with pluggable policies.

    The learning rate is part of this block (not chained after it) because local steps
    accumulate learning-rate-scaled updates and a sync replaces them (``ALGORITHM.md``)::

        phase A (k <= F):  variance step:   gbar = mean_i g_i;  m, v <- Adam moments of gbar
                           compressed step: m <- b1 m + (1-b1) mask * C(g_i);  v unchanged
                           x <- x - lr_k (m / (sqrt(v) + eps) + wd x)
        phase B (k > F):   m <- b1 m + (1-b1) g_i;  d = m / (sqrt(v) + eps) + wd x
                           x <- x - lr_k d;  u <- u + lr_k d;  lrs <- lrs + lr_k
                   sync:   what = mask * C(u (sqrt(v) + eps));  m <- what / lrs
                           x <- x + u - what / (sqrt(v) + eps);  u, lrs <- 0

    No bias correction. The compression error buffers are reset at the end of step ``F``.
    Pass each worker's *local* gradient: the optimizer does the averaging.

    Non-finite gradients: if any worker's gradient holds a NaN or Inf at a communicating step
    (variance, compressed or sync), the mean is non-finite on every worker (NaN and Inf survive
    the float all-reduce and poison the compressed scales), so every worker sees it and skips
    the update together: params, moments, accumulator, error buffers and counters stay as they
    were (the step is retried with the next gradient) and ``skipped_updates`` grows by one. No
    flag travels: the check reads the mean that was communicated anyway. At a local step a
    worker whose gradient is not finite uses zero instead (its momentum decays, the clock and
    ``lr_sum`` advance as on the other workers, so the next sync stays consistent) and counts
    it in ``dropped_local_grads``. A finite gradient so large that its squares overflow float32
    counts as non-finite.

    Args:
      learning_rate: a float or an ``optax.Schedule`` of the update count.
      b1, b2, eps: Adam's constants.
      weight_decay: decoupled weight decay, scaled by the learning rate.
      variance_policy: decides variance steps and the freeze (default
        :class:`~optax_zero_one.VarianceDoubling` ``(100_000, 16)``).
      local_step_policy: decides sync steps in phase B (default
        :class:`~optax_zero_one.LocalStepDoubling` ``(32_678, 16)``).
      axis_name: the worker axis, or ``None`` for one worker.
      num_workers: needed only if ``init`` runs outside the mapped context.
      mask: optional pytree of 0/1 like the params; multiplies the compressed means.
      collective: the backend of ``C``: ``"two_phase"`` (DeepSpeed's scheme) or ``"psum"``
        (one integer all-reduce, up to 255 workers); see :func:`~optax_zero_one.onebit_mean`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`ZeroOneAdamState`;
      ``update`` needs ``params`` when ``weight_decay != 0``.

    References:
      Lu et al., Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam,
      ICLR 2023, arXiv:2202.06009.
    """
    _checks.check_learning_rate(learning_rate)
    _checks.check_range("b1", b1, 0.0, 1.0, high_open=True)
    _checks.check_range("b2", b2, 0.0, 1.0, high_open=True)
    _checks.check_range("eps", eps, 0.0, float("inf"), high_open=True)
    _checks.check_range("weight_decay", weight_decay, 0.0, float("inf"), high_open=True)
    _checks.check_axis_name(axis_name)
    collective_lib.check_collective(collective)
    variance_policy = variance_policy or policies.VarianceDoubling()
    local_step_policy = local_step_policy or policies.LocalStepDoubling()
    freeze = variance_policy.freeze_step

    def init_fn(params: optax.Params) -> ZeroOneAdamState:
        collective_lib.check_float_leaves(params, "params")
        _checks.check_mask(mask, params)
        n = collective_lib.resolve_num_workers(axis_name, num_workers)
        # Separate buffers (not one zeros tree three times), so the state can be donated.
        return ZeroOneAdamState(
            count=jnp.zeros([], jnp.int32),
            variance_policy=_checks.as_int32_state(variance_policy.init()),
            local_step_policy=_checks.as_int32_state(local_step_policy.init()),
            mu=_checks.float32_like(params),
            nu=_checks.float32_like(params),
            accumulator=_checks.float32_like(params),
            lr_sum=jnp.zeros([], jnp.float32),
            comm=collective_lib.init_errors(params, n, collective),
            skipped_updates=jnp.zeros([], jnp.int32),
            dropped_local_grads=jnp.zeros([], jnp.int32),
        )

    def communicate(kind: jax.Array, grads: Any, accumulator: Any, nu: Any, comm: Any, k: Any):
        # Only what differs between kinds goes through the switch.
        # Each returns (mean, comm, finite); a non-finite mean keeps the old error buffers.
        def reset_if_freezing(c: Any) -> Any:
            return _checks.where_tree(k == freeze, jax.tree.map(jnp.zeros_like, c), c)

        def checked(mean: Any, new: Any, old: Any) -> Any:
            finite = _checks.all_finite(mean)
            return mean, _checks.where_tree(finite, new, old), finite

        def variance(g: Any, u: Any, v: Any, c: Any) -> Any:
            return checked(collective_lib.float_mean(g, axis_name), reset_if_freezing(c), c)

        def compressed(g: Any, u: Any, v: Any, c: Any) -> Any:
            mean, new = collective_lib.compressed_mean(g, c, axis_name, collective)
            return checked(mean, reset_if_freezing(new), c)

        def local(g: Any, u: Any, v: Any, c: Any) -> Any:
            leaves = jax.tree.leaves(g)
            finite = jnp.ones([], bool)
            if leaves:  # typed per-worker like the other branches' flags
                finite = collective_lib.vary_like(finite, leaves[0])
            return g, c, finite

        def sync(g: Any, u: Any, v: Any, c: Any) -> Any:
            payload = sync_payload(u, v, eps)
            return checked(*collective_lib.compressed_mean(payload, c, axis_name, collective), c)

        branches = (variance, compressed, local, sync)
        return _checks.switch(kind, branches, grads, accumulator, nu, comm)

    def update_fn(
        updates: optax.Updates,
        state: ZeroOneAdamState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, ZeroOneAdamState]:
        del extra_args
        _checks.check_state_type(state, ZeroOneAdamState, "zero_one_adam")
        _checks.check_tree_matches(updates, state.mu, "updates", "the optimizer state")
        if params is not None:
            _checks.check_tree_matches(params, state.mu, "params", "the optimizer state")
        elif not (_checks.is_static_number(weight_decay) and weight_decay == 0):
            raise ValueError("zero_one_adam with weight_decay needs params: update(g, s, params).")
        if num_workers is not None:
            collective_lib.resolve_num_workers(axis_name, num_workers)
        collective_lib.axis_size(axis_name)  # clear error if the axis is unbound
        out_dtypes = jax.tree.map(lambda x: x.dtype, params if params is not None else updates)
        grads = jax.tree.map(lambda g, m: g.astype(m.dtype), updates, state.mu)

        k = state.count + 1
        lr = _checks.evaluate(learning_rate, state.count)
        kind = step_kind(state, variance_policy, local_step_policy)
        phase_a, var_step, sync = k <= freeze, kind == VARIANCE, kind == SYNC

        # Phase B's local step, computed on every step (elementwise; fused by XLA). A
        # non-finite gradient at a local step is dropped on its worker (see the docstring).
        drop = (kind == LOCAL) & ~_checks.all_finite(grads)
        local_grads = _checks.where_tree(drop, jax.tree.map(jnp.zeros_like, grads), grads)
        mu_local, direction = local_step(
            state.mu, state.nu, local_grads, params, lr, b1, eps, weight_decay
        )
        accumulator = jax.tree.map(lambda u, d: u + lr * d, state.accumulator, direction)
        lr_sum = state.lr_sum + lr

        mean, comm, finite = communicate(kind, grads, accumulator, state.nu, state.comm, k)
        masked = _checks.apply_mask(mask, mean)

        # Phase A: Adam moments of the (float or compressed) mean gradient.
        g_a = _checks.where_tree(var_step, mean, masked)
        mu_a = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, g_a)
        nu = jax.tree.map(
            lambda v, g: jnp.where(var_step, b2 * v + (1 - b2) * jnp.square(g), v), state.nu, g_a
        )
        delta_a = jax.tree.map(lambda m, v: -lr * (m / (jnp.sqrt(v) + eps)), mu_a, nu)
        if params is not None:
            delta_a = jax.tree.map(lambda d, x: d - lr * weight_decay * x, delta_a, params)

        # Phase B: local step, or sync.
        mu_sync, delta_sync = sync_step(state.accumulator, masked, state.nu, lr_sum, eps)
        delta_local = jax.tree.map(lambda d: -lr * d, direction)

        def pick(a: Any, synced: Any, local: Any) -> Any:
            return _checks.where_tree(phase_a, a, _checks.where_tree(sync, synced, local))

        zeros = jax.tree.map(jnp.zeros_like, state.accumulator)
        updated = ZeroOneAdamState(
            count=optax.safe_increment(state.count),
            variance_policy=_advance(phase_a, variance_policy, state.variance_policy, k),
            local_step_policy=_advance(~phase_a, local_step_policy, state.local_step_policy, k),
            mu=pick(mu_a, mu_sync, mu_local),
            nu=nu,
            accumulator=pick(state.accumulator, zeros, accumulator),
            lr_sum=pick(state.lr_sum, jnp.zeros_like(lr_sum), lr_sum),
            comm=comm,
            skipped_updates=state.skipped_updates,
            dropped_local_grads=state.dropped_local_grads + drop.astype(jnp.int32),
        )
        # A skipped step leaves everything as it was, except the count of skipped steps.
        new_state = _checks.where_tree(finite, updated, state)._replace(
            skipped_updates=state.skipped_updates + (~finite).astype(jnp.int32)
        )
        delta = _checks.where_tree(finite, pick(delta_a, delta_sync, delta_local), zeros)
        return jax.tree.map(lambda d, t: d.astype(t), delta, out_dtypes), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _advance(active: jax.Array, policy: Any, state: Any, k: jax.Array) -> Any:
    """``policy.next(state, k)`` where ``active``, else ``state`` (dtypes kept)."""
    advanced = jax.tree.map(
        lambda new, old: jnp.asarray(new, jnp.result_type(old)), policy.next(state, k), state
    )
    return _checks.where_tree(active, advanced, state)


def zero_one_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    var_freeze_step: int = 100_000,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32_678,
    local_step_clipper: int = 16,
    axis_name: str | None = None,
    num_workers: int | None = None,
    mask: Any = None,
    collective: str = "two_phase",
) -> optax.GradientTransformationExtraArgs:
    """0/1 Adam (Lu et al., 2023) with DeepSpeed's default schedules.

    :func:`scale_by_zero_one_adam` with :class:`~optax_zero_one.VarianceDoubling`
    ``(var_freeze_step, var_update_scaler)`` and :class:`~optax_zero_one.LocalStepDoubling`
    ``(local_step_scaler, local_step_clipper)``. See there for the maths.

    Pass each worker's **local** gradient (no ``pmean`` of your own) and keep one copy of the
    params and state per worker: the device axis under ``pmap``, a leading worker axis sharded
    with ``P(axis_name)`` under ``shard_map``, a leading worker axis under ``vmap``.

    Args:
      learning_rate: a float or an ``optax.Schedule``.
      b1, b2, eps: Adam's constants (no bias correction).
      weight_decay: decoupled weight decay, scaled by the learning rate.
      var_freeze_step: ``F``; the variance is frozen after step ``F``.
      var_update_scaler: ``kappa``; variance steps per interval before the gap doubles.
      local_step_scaler: ``alpha``; phase-B steps per interval before the sync gap doubles.
      local_step_clipper: ``H``; the largest sync gap.
      axis_name: the worker axis, or ``None`` for one worker.
      num_workers: needed only if ``init`` runs outside the mapped context.
      mask: optional pytree of 0/1 like the params; multiplies the compressed means.
      collective: ``"two_phase"`` or ``"psum"``, the backend of the compressed mean.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> tx = zero_one_adam(1e-3, var_freeze_step=1000, axis_name="batch")
      >>> # inside jax.pmap(..., axis_name="batch"):
      >>> updates, opt_state = tx.update(local_grads, opt_state, params)

    References:
      Lu et al., Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam,
      ICLR 2023, arXiv:2202.06009.
    """
    return scale_by_zero_one_adam(
        learning_rate,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        variance_policy=policies.VarianceDoubling(var_freeze_step, var_update_scaler),
        local_step_policy=policies.LocalStepDoubling(local_step_scaler, local_step_clipper),
        axis_name=axis_name,
        num_workers=num_workers,
        mask=mask,
        collective=collective,
    )
