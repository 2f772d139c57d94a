"""DiLoCo: local steps of any inner optimizer, an outer optimizer on the averaged delta.

Douillard et al. (DiLoCo, arXiv:2311.08105) train across poorly connected sites with the shape
of 0/1 Adam's phase B: every worker takes ``H`` steps of its own inner optimizer (AdamW in
the paper), then the workers average their distance to the last synchronised point, the
*pseudo-gradient* ``delta = xbar - mean_i(x_i)``, and an outer optimizer (Nesterov momentum,
learning rate 0.7, momentum 0.9 in the paper) moves ``xbar`` by it. :func:`diloco` is that
composition of :func:`~optax_zero_one.local_step_sync` with a fixed sync gap
(:class:`~optax_zero_one.SyncEvery`) and an ``outer`` optimizer; ``collective`` decides how
``delta`` travels: ``"float"`` (the paper: one float32 all-reduce per sync), or 1-bit with
error feedback (``"two_phase"``, ``"psum"``, as 0/1 Adam's syncs), ~2 bits per element.

MuLoCo (Thérien et al., arXiv:2505.23725) is the same shape with Muon as the inner optimizer:
``diloco(optax.contrib.muon(...), ...)``; it compresses ``delta`` to 2 bits with error
feedback, we to 1 bit (``docs/diloco.md``).
"""

from __future__ import annotations

from typing import Any

import optax

from optax_zero_one.core import kinds, local_steps, policies


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    sync_every: int,
    axis_name: str | None,
    *,
    collective: str = "float",
    start_step: int = 0,
    mask: Any = None,
    num_workers: int | tuple[int, int] | None = None,
    fast_axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""DiLoCo: ``sync_every`` local steps of ``inner``, then ``outer`` on the averaged delta.

    For update ``k`` of worker ``i`` (``d_i``: ``inner``'s update of its own gradient)::

        x_i <- x_i + d_i                                  every step, no communication
        if k % sync_every == 0:
            delta = C(mean_i(xbar - x_i))                 (C: exact, or 1-bit with feedback)
            xbar <- xbar + outer(delta);  x_i <- xbar     (the outer step, on every worker)

    Each worker keeps its own inner state (e.g. AdamW's moments); the outer state is
    identical on every worker. ``outer=optax.sgd(1.0)`` is local ``inner`` with model
    averaging. Evaluate :func:`~optax_zero_one.synchronized_params` (``xbar``).

    Args:
      inner: each worker's optimizer (e.g. ``optax.adamw(...)``, ``optax.contrib.muon(...)``).
      outer: the optimizer of the synchronised point, fed ``delta`` as its gradient (the
        paper's: ``optax.sgd(0.7, momentum=0.9, nesterov=True)``). Its count, and so any
        schedule it holds, advances once per sync: size a schedule in syncs (steps / ``H``).
      sync_every: ``H``, the inner steps per outer step; ``>= 1``.
      axis_name: the worker axis, or ``None`` for one worker.
      collective: how ``delta`` is averaged: ``"float"`` (exact float32, ~32 bits per element
        each way), ``"two_phase"`` or ``"psum"`` (1-bit with error feedback; each worker sends
        up to 2 bits per element, or ``2 (N - 1) / N * 32 / floor(32 / ceil(log2(N + 1)))``:
        7 at 8 workers).
      start_step: steps before local steps begin, on which ``inner`` itself must average
        across workers (a dispatched run checks it once), e.g.
        ``optax.chain(ozo.scheduled_mean(axis_name, ozo.FullPrecisionWarmup(start_step),
        compressed_steps=False), optax.adamw(...))``;
        ``0``: local from the start.
      mask: optional tree of 0/1 like the params, multiplying the averaged delta. Where it is
        0 the synchronised point never moves and every sync puts the workers back on it: those
        elements keep their initial values (the mask does not make them local-only).
      num_workers: needed only when ``init`` runs outside the mapped context.
      fast_axis_name: the axis inside a node: syncs reduce over it exactly first
        (``docs/hierarchical.md``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state
      :class:`~optax_zero_one.LocalStepSyncState`; ``update`` needs ``params``. Its step kinds:
      :func:`diloco_schedule` (pass the kind as ``step_kind=`` or let
      :func:`~optax_zero_one.dispatch_by_kind` do it).

    Example:
      >>> outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
      >>> tx = ozo.diloco(optax.adamw(1e-3), outer, sync_every=50, axis_name="w")

    References:
      Douillard et al., DiLoCo, arXiv:2311.08105; Thérien et al., MuLoCo, arXiv:2505.23725.
    """
    if outer is None:
        raise ValueError(
            "diloco needs an outer optimizer, e.g. optax.sgd(0.7, momentum=0.9, nesterov=True) "
            "(DiLoCo's) or optax.sgd(1.0) (plain model averaging)."
        )
    return local_steps.local_step_sync(
        inner,
        policies.SyncEvery(sync_every),
        axis_name,
        start_step=start_step,
        num_workers=num_workers,
        collective=collective,
        mask=mask,
        fast_axis_name=fast_axis_name,
        outer=outer,
    )


def diloco_schedule(sync_every: int, start_step: int = 0) -> kinds.StepSchedule:
    """The step kinds of :func:`diloco` with these arguments: ``"variance"`` up to
    ``start_step`` (``inner`` averages itself), then ``"local"`` and ``"sync"``."""
    return kinds.local_step_schedule(policies.SyncEvery(sync_every), start_step)
