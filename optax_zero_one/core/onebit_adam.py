"""1-bit Adam: full-precision warm-up, then frozen variance and 1-bit compressed momentum.

The baseline 0/1 Adam is compared against (Tang et al., 2021), composed of the same blocks::

    flatten(skip_not_finite(optax.chain(
        scheduled_mean(FullPrecisionWarmup(T)),             float mean up to T, nothing after
        scale_by_frozen_variance_adam(..., FullPrecisionWarmup(T),
                                      momentum_mean=onebit_mean(...)),   m <- C(m) after T
        optax.add_decayed_weights(wd), optax.scale_by_learning_rate(lr))))

Every step after the warm-up communicates the compressed momentum (~2 bits per element).
"""

from __future__ import annotations

from typing import Any

import optax

from optax_zero_one.core import _checks, policies
from optax_zero_one.core import collective as collective_lib  # `collective` names the backend
from optax_zero_one.core.comm import Comm
from optax_zero_one.core.frozen_variance import scale_by_frozen_variance_adam
from optax_zero_one.core.scheduled_mean import scheduled_mean_over
from optax_zero_one.core.wrappers import decayed_weights, flatten_over, skip_not_finite


def scale_by_onebit_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    freeze_step: int = 100_000,
    axis_name: str | None = None,
    num_workers: int | tuple[int, int] | None = None,
    mask: Any = None,
    collective: str = "two_phase",
    *,
    weight_decay: float = 0.0,
    learning_rate: optax.ScalarOrSchedule | None = None,
    fast_axis_name: str | None = None,
    weight_decay_mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Rescales local gradients by 1-bit Adam's moments (a direction, or an update with a
    learning rate).

    ::

        k <= T:  gbar = mean_i g_i (float all-reduce);  m <- b1 m + (1-b1) gbar
                 v <- b2 v + (1-b2) gbar^2
        k > T:   m <- mask * C(b1 m + (1-b1) g_i);  v frozen
        output:  d = m / (sqrt(v) + eps) + wd x,   or  -lr_k d  if learning_rate is given

    No bias correction. Pass each worker's *local* gradient.

    Non-finite gradients: during the warm-up the gradients are averaged first, so a NaN or Inf
    in any worker's gradient makes the mean non-finite on every worker and all workers skip the
    step together: the output is zero, the state stays as it was and ``skipped_updates`` grows
    by one. After it each worker's own gradient enters its momentum before the 1-bit average: a
    non-finite gradient is dropped (taken as zero) on that worker only, and every worker still
    takes the step (``docs/algorithm.md``). Weight decay and the learning rate live inside the
    guard so that a skipped step moves nothing and a schedule is evaluated at the count of steps
    actually taken.

    Args:
      b1, b2, eps: Adam's constants.
      freeze_step: ``T``, the number of full-precision warm-up steps.
      axis_name: the worker axis, or ``None`` for one worker.
      num_workers: needed only if ``init`` runs outside the mapped context.
      mask: optional pytree of 0/1 like the params; multiplies the compressed momentum (a
        compression mask, not ``optax.adamw``'s: that is ``weight_decay_mask``).
      collective: the backend of ``C``: ``"two_phase"`` (DeepSpeed's scheme) or ``"psum"``
        (one integer all-reduce, up to 255 workers); see :func:`~optax_zero_one.onebit_mean`.
      weight_decay: decoupled weight decay added to the direction (needs ``params``).
      learning_rate: if given, a float or schedule; the output is then ``-lr_k d``.
      fast_axis_name: a second worker axis, inside a node (fast links). Then ``axis_name`` is
        the axis across nodes: every mean is exact over ``fast_axis_name`` and compressed only
        over ``axis_name``, on a 1/L share per worker (``docs/hierarchical.md``).
        ``num_workers`` is then a pair ``(nodes, workers per node)``. Two-phase backend only.
      weight_decay_mask: optional pytree of 0/1 like the params (per leaf or per element):
        the parameters ``weight_decay`` applies to, as ``optax.adamw``'s ``mask`` (e.g. not
        biases and norms). A tree, not a function: pass ``mask_fn(params)``. (Under
        ``optax.inject_hyperparams`` a mask that is one array is injected as a value.)

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    References:
      Tang et al., 1-bit Adam: Communication Efficient Large-Scale Training with Adam's
      Convergence Speed, ICML 2021, arXiv:2102.02888.
    """
    _checks.check_variance_measured(freeze_step, "freeze_step")
    _checks.check_int("freeze_step", freeze_step, 0)
    _checks.check_weight_decay(weight_decay)
    if learning_rate is not None:
        _checks.check_learning_rate(learning_rate)
    # the workers and the backend, checked once and shared by every block
    comm = Comm.of(axis_name, fast_axis_name, num_workers, collective, mask)
    warmup = policies.FullPrecisionWarmup(freeze_step)
    momentum = collective_lib.onebit_mean_over(comm)
    steps = [
        scheduled_mean_over(comm, warmup, compressed_steps=False),
        scale_by_frozen_variance_adam(
            b1, b2, eps, warmup, momentum_mean=momentum, axis_name=comm.axes
        ),
    ]
    steps.append(decayed_weights(weight_decay, "onebit_adam", weight_decay_mask))
    if learning_rate is not None:
        steps.append(optax.scale_by_learning_rate(learning_rate))
    guarded = skip_not_finite(optax.chain(*steps))
    return _checks.schedules_checked_at_init(
        flatten_over(guarded, comm), learning_rate=learning_rate, weight_decay=weight_decay
    )


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    freeze_step: int = 100_000,
    axis_name: str | None = None,
    num_workers: int | tuple[int, int] | None = None,
    mask: Any = None,
    collective: str = "two_phase",
    fast_axis_name: str | None = None,
    weight_decay_mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """1-bit Adam (Tang et al., 2021): :func:`scale_by_onebit_adam` with decoupled weight decay
    and the learning rate.

    ``x <- x - lr_k (m / (sqrt(v) + eps) + wd x)``. Pass each worker's **local** gradient.

    Args:
      learning_rate: a float or an ``optax.Schedule``.
      b1, b2, eps: Adam's constants (no bias correction).
      weight_decay: decoupled weight decay, scaled by the learning rate.
      freeze_step: ``T``, the number of full-precision warm-up steps.
      axis_name, num_workers, mask, collective, fast_axis_name, weight_decay_mask: as in
        :func:`scale_by_onebit_adam` (the worker axis; its size if ``init`` runs outside it; a
        0/1 compression mask; the backend; the axis inside a node, for hierarchical
        compression; which parameters decay).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> tx = onebit_adam(1e-3, freeze_step=1000, axis_name="batch")

    References:
      Tang et al., 1-bit Adam, ICML 2021, arXiv:2102.02888.
    """
    _checks.check_learning_rate(learning_rate)
    _checks.check_weight_decay(weight_decay)
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
        fast_axis_name=fast_axis_name,
        weight_decay_mask=weight_decay_mask,
    )
