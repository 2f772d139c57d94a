"""1-bit Adam: full-precision warm-up, then frozen variance and 1-bit compressed momentum.

The baseline 0/1 Adam is compared against (Tang et al., 2021). Every step after the warm-up
communicates the compressed momentum (~2 bits per element), through the same fused collective
as 0/1 Adam.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_zero_one import _checks
from optax_zero_one import collective as collective_lib  # `collective` names the backend


class OnebitAdamState(NamedTuple):
    """State of :func:`scale_by_onebit_adam`, one per worker.

    Attributes:
      count: int32, the number of updates done.
      mu: first moment, float32, like the params (identical on all workers).
      nu: second moment, float32, like the params (frozen after ``freeze_step``).
      comm: the error-feedback buffers of the compressed mean.
      skipped_updates: int32, steps skipped by every worker together because some worker's
        gradient was not finite (identical on all workers).
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    comm: collective_lib.OnebitMeanState
    skipped_updates: jax.Array


def scale_by_onebit_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    freeze_step: int = 100_000,
    axis_name: str | None = None,
    num_workers: int | None = None,
    mask: Any = None,
    collective: str = "two_phase",
    *,
    weight_decay: float = 0.0,
    learning_rate: optax.ScalarOrSchedule | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Rescales local gradients by 1-bit Adam's moments (a direction, or an update with a
    learning rate).

    ::

        k <= T:  gbar = mean_i g_i (float all-reduce);  m <- b1 m + (1-b1) gbar
                 v <- b2 v + (1-b2) gbar^2
        k > T:   m <- mask * C(b1 m + (1-b1) g_i);  v frozen
        output:  d = m / (sqrt(v) + eps) + wd x,   or  -lr_k d  if learning_rate is given

    No bias correction. Pass each worker's *local* gradient.

    Non-finite gradients: every step communicates, and a NaN or Inf in any worker's gradient
    makes the communicated mean non-finite on every worker, so all workers skip the step
    together: the output is zero, the state (moments, error buffers, count) stays as it was
    and ``skipped_updates`` grows by one. Weight decay and the learning rate live in this block
    (not chained after it) so that a skipped step moves nothing and a schedule is evaluated at
    the count of steps actually taken.

    Args:
      b1, b2, eps: Adam's constants.
      freeze_step: ``T``, the number of full-precision warm-up steps.
      axis_name: the worker axis, or ``None`` for one worker.
      num_workers: needed only if ``init`` runs outside the mapped context.
      mask: optional pytree of 0/1 like the params; multiplies the compressed momentum.
      collective: the backend of ``C``: ``"two_phase"`` (DeepSpeed's scheme) or ``"psum"``
        (one integer all-reduce, up to 255 workers); see :func:`~optax_zero_one.onebit_mean`.
      weight_decay: decoupled weight decay added to the direction (needs ``params``).
      learning_rate: if given, a float or schedule; the output is then ``-lr_k d``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state :class:`OnebitAdamState`.

    References:
      Tang et al., 1-bit Adam: Communication Efficient Large-Scale Training with Adam's
      Convergence Speed, ICML 2021, arXiv:2102.02888.
    """
    _checks.check_range("b1", b1, 0.0, 1.0, high_open=True)
    _checks.check_range("b2", b2, 0.0, 1.0, high_open=True)
    _checks.check_range("eps", eps, 0.0, float("inf"), high_open=True)
    _checks.check_int("freeze_step", freeze_step, 0)
    _checks.check_range("weight_decay", weight_decay, 0.0, float("inf"), high_open=True)
    if learning_rate is not None:
        _checks.check_learning_rate(learning_rate)
    _checks.check_axis_name(axis_name)
    collective_lib.check_collective(collective)

    def init_fn(params: optax.Params) -> OnebitAdamState:
        collective_lib.check_float_leaves(params, "params")
        _checks.check_mask(mask, params)
        n = collective_lib.resolve_num_workers(axis_name, num_workers)
        return OnebitAdamState(  # separate buffers, so that the state can be donated
            jnp.zeros([], jnp.int32),
            _checks.float32_like(params),
            _checks.float32_like(params),
            collective_lib.init_errors(params, n, collective),
            jnp.zeros([], jnp.int32),
        )

    def update_fn(
        updates: optax.Updates,
        state: OnebitAdamState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, OnebitAdamState]:
        del extra_args
        _checks.check_state_type(state, OnebitAdamState, "onebit_adam")
        _checks.check_tree_matches(updates, state.mu, "updates", "the optimizer state")
        if params is not None:
            _checks.check_tree_matches(params, state.mu, "params", "the optimizer state")
        elif not (_checks.is_static_number(weight_decay) and weight_decay == 0):
            raise ValueError("onebit_adam with weight_decay needs params: update(g, s, params).")
        if num_workers is not None:
            collective_lib.resolve_num_workers(axis_name, num_workers)
        collective_lib.axis_size(axis_name)
        grads = jax.tree.map(lambda g, m: g.astype(m.dtype), updates, state.mu)
        warmup = state.count + 1 <= freeze_step

        # Each kind runs in a loop of zero or one trip (`_checks.run_if`: nothing is copied
        # through the kind that does not run) and leaves the new moments in (m, v). A loop
        # carries exactly what its kind reads or writes: a value read from outside would be
        # copied in on every call, one passed through unchanged is copied when the loop runs.
        def full_precision(carry: Any) -> Any:
            g, m, v, _ = carry
            mean = collective_lib.float_mean(g, axis_name)
            ok = _checks.all_finite(mean)
            m = _checks.moving_average(ok, m, mean, b1)
            v = _checks.moving_average(ok, v, jax.tree.map(jnp.square, mean), b2)
            return g, m, v, ok

        def compressed(carry: Any) -> Any:
            g, m, comm, _ = carry
            local = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
            mean, comm, ok = collective_lib.checked_mean(local, comm, axis_name, collective)
            mean = _checks.apply_mask(mask, mean)
            return g, jax.tree.map(lambda x, m: jnp.where(ok, x, m), mean, m), comm, ok

        finite = jnp.ones([], bool)
        _, mu, nu, finite = _checks.run_if(
            warmup, full_precision, (grads, state.mu, state.nu, finite), like=grads
        )
        _, mu, comm, finite = _checks.run_if(
            jnp.logical_not(warmup), compressed, (grads, mu, state.comm, finite), like=grads
        )
        lr = None if learning_rate is None else _checks.evaluate(learning_rate, state.count)
        out_dtypes = jax.tree.map(lambda x: x.dtype, params if params is not None else updates)

        def output(m: Any, v: Any, x: Any, dtype: Any) -> Any:
            d = m / (jnp.sqrt(v) + eps)
            if x is not None:
                d = d + weight_decay * x
            if lr is not None:
                d = -lr * d
            return jnp.where(finite, d, 0).astype(dtype)  # a skipped step moves nothing

        if params is None:
            direction = jax.tree.map(lambda m, v, t: output(m, v, None, t), mu, nu, out_dtypes)
        else:
            direction = jax.tree.map(output, mu, nu, params, out_dtypes)
        new_state = OnebitAdamState(
            jnp.where(finite, optax.safe_increment(state.count), state.count),
            mu,
            nu,
            comm,
            state.skipped_updates + (~finite).astype(jnp.int32),
        )
        return direction, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    freeze_step: int = 100_000,
    axis_name: str | None = None,
    num_workers: int | None = None,
    mask: Any = None,
    collective: str = "two_phase",
) -> optax.GradientTransformationExtraArgs:
    """1-bit Adam (Tang et al., 2021): :func:`scale_by_onebit_adam` with decoupled weight decay
    and the learning rate.

    ``x <- x - lr_k (m / (sqrt(v) + eps) + wd x)``. Pass each worker's **local** gradient.

    Args:
      learning_rate: a float or an ``optax.Schedule``.
      b1, b2, eps: Adam's constants (no bias correction).
      weight_decay: decoupled weight decay, scaled by the learning rate.
      freeze_step: ``T``, the number of full-precision warm-up steps.
      axis_name: the worker axis, or ``None`` for one worker.
      num_workers: needed only if ``init`` runs outside the mapped context.
      mask: optional pytree of 0/1 like the params; multiplies the compressed momentum.
      collective: ``"two_phase"`` or ``"psum"``, the backend of the compressed mean.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> tx = onebit_adam(1e-3, freeze_step=1000, axis_name="batch")

    References:
      Tang et al., 1-bit Adam, ICML 2021, arXiv:2102.02888.
    """
    _checks.check_learning_rate(learning_rate)
    _checks.check_range("weight_decay", weight_decay, 0.0, float("inf"), high_open=True)
    return scale_by_onebit_adam(
        b1,
        b2,
        eps,
        freeze_step,
        axis_name,
        num_workers,
        mask,
        collective,
        weight_decay=weight_decay,
        learning_rate=learning_rate,
    )
