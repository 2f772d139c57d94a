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

The kinds that communicate each run in a loop of zero or one trip, so an untaken kind sends
nothing and costs nothing (no buffer is copied through it, as a ``lax.cond`` would); the moment
and parameter arithmetic of all kinds is one elementwise pass after them, fused by XLA.
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
      anchor: ``xbar``, the last synchronised point (where every worker was after the last
        sync; in phase A, the params after the last step), float32, like the params. Identical
        on every worker. ``u = xbar - x`` is the sum of this worker's local updates since.
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
    anchor: optax.Updates
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
      ``(m', d)``; the parameter update is ``-lr * d`` (so ``u = xbar - x`` grows by ``lr d``).
    """
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
    direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    if params is not None:
        direction = jax.tree.map(lambda d, x: d + wd * x.astype(d.dtype), direction, params)
    return mu, direction


def sync_payload(accumulated: Any, nu: Any, eps: float) -> Any:
    """What a sync step communicates: ``w = u * (sqrt(v) + eps)`` with ``u = xbar - x`` the
    interval's local updates, i.e. its momentum sum weighted by the learning rates (linear in
    ``m`` because ``v`` is frozen)."""
    return jax.tree.map(lambda u, v: u * (jnp.sqrt(v) + eps), accumulated, nu)


def sync_step(
    anchor: Any, mean_payload: Any, nu: Any, lr_sum: jax.Array, eps: float
) -> tuple[Any, Any]:
    """Finishes a sync step given the (compressed) mean ``what`` of :func:`sync_payload`.

    Every worker returns to the last synchronised point and takes the averaged step::

        xbar <- xbar - what / (sqrt(v) + eps)     x <- xbar     m <- what / lrs

    (``m <- 0`` if the learning rates of the interval sum to zero, so that ``m`` stays finite and
    identical on every worker.)

    Returns:
      ``(m, xbar)``: the new momentum and the new synchronised point, identical on every worker.
    """
    positive = lr_sum > 0
    inverse = jnp.where(positive, 1.0 / jnp.where(positive, lr_sum, 1.0), 0.0)
    mu = jax.tree.map(lambda w: w * inverse, mean_payload)
    anchor = jax.tree.map(lambda a, w, v: a - w / (jnp.sqrt(v) + eps), anchor, mean_payload, nu)
    return mu, anchor


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
                           x <- x - lr_k (m / (sqrt(v) + eps) + wd x);  xbar <- x
        phase B (k > F):   m <- b1 m + (1-b1) g_i;  d = m / (sqrt(v) + eps) + wd x
                           x <- x - lr_k d;  lrs <- lrs + lr_k
                   sync:   u = xbar - x;  what = mask * C(u (sqrt(v) + eps));  m <- what / lrs
                           xbar <- xbar - what / (sqrt(v) + eps);  x <- xbar;  lrs <- 0

    ``xbar`` (the state's ``anchor``) is the last synchronised point, so ``u = xbar - x`` is
    ``ALGORITHM.md``'s accumulator: the sum of the interval's local updates ``lr_k d`` as
    applied to ``x``. Keeping ``xbar`` rather than ``u`` has two reasons: a local step writes
    nothing but ``m`` and the update (it costs about what an Adam step does), and after a sync
    every worker's params are ``xbar`` rounded to their dtype, so the workers' copies cannot
    drift apart over many intervals (with ``x <- x + u - ...`` each worker's own rounding of
    ``x`` during the interval stayed, and bfloat16 params drifted ~46 ulps apart in 2,000
    steps). The price: with low-precision params, updates smaller than the params' resolution
    are lost during local steps (as in any training on bfloat16 params); keep float32 params
    (e.g. a float32 master copy) where that matters.

    No bias correction. The compression error buffers are reset at the end of step ``F``.
    Pass each worker's *local* gradient: the optimizer does the averaging.

    Non-finite gradients: if any worker's gradient holds a NaN or Inf at a communicating step
    (variance, compressed or sync), the mean is non-finite on every worker (NaN and Inf survive
    the float all-reduce and poison the compressed scales), so every worker sees it and skips
    the update together: params, moments, anchor, error buffers and counters stay as they
    were (the step is retried with the next gradient) and ``skipped_updates`` grows by one. No
    flag travels: the check reads the mean that was communicated anyway. At a local step a
    worker whose gradient is not finite uses zero instead (its momentum decays, the clock and
    ``lr_sum`` advance as on the other workers, so the next sync stays consistent) and counts
    it in ``dropped_local_grads``. A finite local gradient whose sum overflows float32 (entries
    near 1e38) also counts as non-finite.

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
      ``update`` needs ``params``.

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
            anchor=jax.tree.map(
                lambda p: jnp.array(p, jnp.promote_types(p.dtype, jnp.float32), copy=True), params
            ),
            lr_sum=jnp.zeros([], jnp.float32),
            comm=collective_lib.init_errors(params, n, collective),
            skipped_updates=jnp.zeros([], jnp.int32),
            dropped_local_grads=jnp.zeros([], jnp.int32),
        )

    def update_fn(
        updates: optax.Updates,
        state: ZeroOneAdamState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, ZeroOneAdamState]:
        del extra_args
        _checks.check_state_type(state, ZeroOneAdamState, "zero_one_adam")
        _checks.check_tree_matches(updates, state.mu, "updates", "the optimizer state")
        if params is None and jax.tree.leaves(updates):  # (an empty tree needs none)
            raise ValueError(
                "zero_one_adam's update needs the params: update(grads, state, params). A sync "
                "step sends x's distance to the last synchronised point."
            )
        _checks.check_tree_matches(params, state.mu, "params", "the optimizer state")
        if num_workers is not None:
            collective_lib.resolve_num_workers(axis_name, num_workers)
        collective_lib.axis_size(axis_name)  # clear error if the axis is unbound
        out_dtypes = jax.tree.map(lambda x: x.dtype, params)
        grads = jax.tree.map(lambda g, m: g.astype(m.dtype), updates, state.mu)

        k = state.count + 1
        lr = _checks.evaluate(learning_rate, state.count)
        kind = step_kind(state, variance_policy, local_step_policy)
        phase_a = k <= freeze
        is_local, is_sync = kind == LOCAL, kind == SYNC
        lr_sum = state.lr_sum + lr  # phase B: the interval's learning rates, this step's too
        decay = not (_checks.is_static_number(weight_decay) and weight_decay == 0)

        def direction(m: Any, v: Any, x: Any) -> Any:
            d = m / (jnp.sqrt(v) + eps)
            return d + weight_decay * x.astype(d.dtype) if decay else d

        # Kinds that communicate or need more than the local step run in loops of zero or one
        # trip (`_checks.run_if`): a kind that does not run costs nothing and its buffers stay
        # in place. Every buffer a loop reads travels in its carry (one read from outside would
        # be copied in on every call). In order:
        # 1. variance / compressed: the new moments (m, v) of the float or compressed mean;
        # 2. one elementwise pass for every kind: a local step's m and update -lr d; the other
        #    kinds leave x itself in `out` for the loops after it;
        # 3. sync: back to the anchor and the averaged step (m, anchor and the update);
        # 4. phase A: the update -lr d, and the anchor follows x.
        # A non-finite mean leaves everything as it was (update 0).
        def reset_at_freeze(ok: jax.Array, comm: Any, like: Any) -> Any:
            zeros = lambda c: jax.tree.map(jnp.zeros_like, c)  # noqa: E731
            return _checks.run_if(ok & (k == freeze), zeros, comm, like=like)

        def variance(c: _Carry) -> _Carry:
            mean = collective_lib.float_mean(c.g, axis_name)
            ok = _checks.all_finite(mean)
            mu = _checks.moving_average(ok, c.mu, mean, b1)
            nu = _checks.moving_average(ok, c.nu, jax.tree.map(jnp.square, mean), b2)
            comm = reset_at_freeze(ok, c.comm, c.g)
            return c._replace(mu=mu, nu=nu, comm=comm, finite=ok)

        def compressed(c: _Carry) -> _Carry:
            mean, comm, ok = collective_lib.checked_mean(c.g, c.comm, axis_name, collective)
            mu = _checks.moving_average(ok, c.mu, _checks.apply_mask(mask, mean), b1)
            return c._replace(mu=mu, comm=reset_at_freeze(ok, comm, c.g), finite=ok)

        def check_local(c: _Carry) -> _Carry:  # a non-finite local gradient is dropped
            return c._replace(drop=~_checks.all_finite(c.g))

        finite, drop = jnp.ones([], bool), jnp.zeros([], bool)
        zeros = jax.tree.map(lambda m: jnp.zeros((0,), m.dtype), state.mu)  # `out` comes in 2.
        c = _Carry(grads, state.mu, state.nu, state.anchor, zeros, state.comm, finite, drop)

        def run(pred: Any, fn: Any, c: _Carry, fields: tuple[str, ...]) -> _Carry:
            # Only the named fields travel through the loop: everything fn reads or writes
            # (a field passed through a loop unchanged is copied when the loop runs).
            def body(values: tuple) -> tuple:
                out = fn(c._replace(**dict(zip(fields, values))))
                return tuple(getattr(out, f) for f in fields)

            values = _checks.run_if(pred, body, tuple(getattr(c, f) for f in fields), like=grads)
            return c._replace(**dict(zip(fields, values)))

        c = run(kind == VARIANCE, variance, c, ("g", "mu", "nu", "comm", "finite"))
        c = run(kind == COMPRESSED, compressed, c, ("g", "mu", "comm", "finite"))
        c = run(is_local, check_local, c, ("g", "drop"))

        def local_pass(g: Any, m: Any, v: Any, x: Any) -> Any:
            m_local = b1 * m + (1 - b1) * jnp.where(c.drop, 0.0, g)
            m = jnp.where(is_local, m_local, m)
            out = jnp.where(is_local, -lr * direction(m, v, x), x.astype(m.dtype))
            return m, out

        passed = jax.tree.map(local_pass, c.g, c.mu, c.nu, params)
        pick = lambda i: jax.tree.map(lambda _, o: o[i], state.mu, passed)  # noqa: E731
        c = c._replace(mu=pick(0), out=pick(1))

        def sync(c: _Carry) -> _Carry:
            x = c.out  # the params, left by the local pass
            _, d = local_step(c.mu, c.nu, c.g, x if decay else None, lr, b1, eps, weight_decay)
            accumulated = jax.tree.map(lambda a, x, d: a - (x - lr * d), c.anchor, x, d)
            payload = sync_payload(accumulated, c.nu, eps)
            mean, comm, ok = collective_lib.checked_mean(payload, c.comm, axis_name, collective)
            mu, anchor = sync_step(c.anchor, _checks.apply_mask(mask, mean), c.nu, lr_sum, eps)
            keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
            update = jax.tree.map(lambda a, x: jnp.where(ok, a - x, 0.0), anchor, x)
            return c._replace(
                mu=jax.tree.map(keep, mu, c.mu),
                anchor=jax.tree.map(keep, anchor, c.anchor),
                out=update,
                comm=comm,
                finite=ok,
            )

        def phase_a_update(c: _Carry) -> _Carry:
            def leaf(m: Any, v: Any, x: Any, dtype: Any) -> Any:
                update = jnp.where(c.finite, -lr * direction(m, v, x), 0.0)
                # x + update exactly as optax.apply_updates will compute it: the max (exact) keeps
                # LLVM from contracting the multiply and the add into an FMA here.
                applied = jnp.maximum(update.astype(dtype), jnp.finfo(dtype).min)
                return update, (x.astype(dtype) + applied).astype(x.dtype)

            both = jax.tree.map(leaf, c.mu, c.nu, c.out, out_dtypes)
            take = lambda i: jax.tree.map(lambda _, o: o[i], state.mu, both)  # noqa: E731
            return c._replace(out=take(0), anchor=take(1))

        c = run(is_sync, sync, c, ("g", "mu", "nu", "anchor", "out", "comm", "finite"))
        c = run(phase_a, phase_a_update, c, ("mu", "nu", "out", "anchor", "finite"))
        finite, drop = c.finite, c.drop
        delta = jax.tree.map(lambda d, t: d.astype(t), c.out, out_dtypes)

        def scalar(old: jax.Array, new: jax.Array) -> jax.Array:
            return jnp.where(finite, new, old)

        lr_sum_new = jnp.where(phase_a, state.lr_sum, jnp.where(is_sync, 0.0, lr_sum))
        variance_state = _advance(phase_a, variance_policy, state.variance_policy, k)
        local_state = _advance(
            jnp.logical_not(phase_a), local_step_policy, state.local_step_policy, k
        )
        new_state = ZeroOneAdamState(
            count=scalar(state.count, optax.safe_increment(state.count)),
            variance_policy=jax.tree.map(scalar, state.variance_policy, variance_state),
            local_step_policy=jax.tree.map(scalar, state.local_step_policy, local_state),
            mu=c.mu,
            nu=c.nu,
            anchor=c.anchor,
            lr_sum=scalar(state.lr_sum, lr_sum_new).astype(state.lr_sum.dtype),
            comm=c.comm,
            skipped_updates=state.skipped_updates + (~finite).astype(jnp.int32),
            dropped_local_grads=state.dropped_local_grads + drop.astype(jnp.int32),
        )
        return delta, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _Carry(NamedTuple):
    """What the step kinds' loops read and update (see ``update_fn``)."""

    g: Any  # the local gradient (read only)
    mu: Any
    nu: Any
    anchor: Any
    out: Any  # after the local pass: the update, or the params for the loops after it
    comm: collective_lib.OnebitMeanState
    finite: jax.Array  # the communicated mean is finite (True at local steps)
    drop: jax.Array  # local step whose gradient is not finite


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
