"""Where a transform's workers are and how they communicate: one config, checked once.

The communicating transforms (:func:`~optax_zero_one.onebit_mean`,
:func:`~optax_zero_one.scheduled_mean`, :func:`~optax_zero_one.local_step_sync`,
:func:`~optax_zero_one.flatten`) each take the same five arguments: the worker axis, the fast
axis of a hierarchy, the worker count, the backend of the compressed mean, and the mask. Each
public function checks them into a :class:`Comm` at construction; a composition such as
:func:`~optax_zero_one.zero_one_adam` builds one :class:`Comm` and hands it to every block, so
the blocks cannot disagree and nothing is checked twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optax_zero_one.core import _checks, psum_mean
from optax_zero_one.core._checks import Axes
from optax_zero_one.core.flat import FlatTree

COLLECTIVES = ("two_phase", "psum")
"""The backends of the 1-bit compressed mean."""
SYNC_COLLECTIVES = (*COLLECTIVES, "float")
"""What a sync of :func:`~optax_zero_one.local_step_sync` may average with: 1-bit or exact."""


def check_collective(collective: str, allowed: tuple[str, ...] = COLLECTIVES) -> None:
    """Raises ``ValueError`` unless ``collective`` is one of ``allowed``."""
    if collective not in allowed:
        raise ValueError(f"collective must be one of {allowed}, got {collective!r}.")


def check_hierarchy(fast_axis_name: str | None, collective: str) -> None:
    """Raises ``ValueError`` if ``collective`` cannot run under a fast axis (of the 1-bit
    backends only the two-phase one has a hierarchical form; an exact mean has one too)."""
    if fast_axis_name is not None and collective not in ("two_phase", "float"):
        raise ValueError(
            f"fast_axis_name={fast_axis_name!r} works with collective='two_phase' only, got "
            f"collective={collective!r}. Use the default collective, or drop fast_axis_name to "
            "compress over every worker."
        )


@dataclasses.dataclass(frozen=True)
class Comm:
    """The workers of a transform and how they average, checked (build it with :meth:`of`).

    Attributes:
      axes: the worker axis, ``(slow, fast)`` for a hierarchy, or ``None`` for one worker.
      num_workers: the worker count (a pair for a hierarchy) when ``init`` runs outside the
        mapped context; ``None`` to read it from the bound axes.
      collective: ``"two_phase"``, ``"psum"`` (the 1-bit backends) or ``"float"`` (exact).
      mask: an optional tree of 0/1 like the params, multiplying the averaged values.
    """

    axes: Axes
    num_workers: Any = None
    collective: str = "two_phase"
    mask: Any = dataclasses.field(default=None, compare=False)

    @classmethod
    def of(
        cls,
        axis_name: str | None,
        fast_axis_name: str | None = None,
        num_workers: Any = None,
        collective: str = "two_phase",
        mask: Any = None,
        *,
        collectives: tuple[str, ...] = COLLECTIVES,
    ) -> Comm:
        """The public arguments, checked once: ``ValueError`` naming the wrong one."""
        axes = _checks.worker_axes(axis_name, fast_axis_name)
        check_collective(collective, collectives)
        check_hierarchy(fast_axis_name, collective)
        _checks.check_num_workers(axes, num_workers)
        if isinstance(num_workers, list | tuple):
            num_workers = tuple(int(n) for n in num_workers)
        elif num_workers is not None:
            num_workers = int(num_workers)  # a NumPy integer too
            if collective == "psum":  # its limit at construction, where it is known (else init)
                psum_mean.check_num_workers(num_workers)
        return cls(axes, num_workers, collective, mask)

    @property
    def exact(self) -> bool:
        """Whether the mean is the exact float one (no error buffers)."""
        return self.collective == "float"

    def init_workers(self, params: Any) -> int:
        """The worker count in ``init`` (``ValueError`` if unknown or disagreeing)."""
        return _checks.workers_for(params, self.axes, self.num_workers)

    def update_workers(self, updates: Any) -> int:
        """The worker count in ``update``: the axes bound (and those a surrounding helper
        expects), ``num_workers`` agreeing (:func:`~optax_zero_one.core._checks.bound_workers`)."""
        return _checks.bound_workers(self.axes, self.num_workers, updates)

    def check_mask(self, params: Any) -> None:
        """Raises ``ValueError`` unless the mask fits ``params`` (a tree or a flat buffer)."""
        check_mask_fits(self.mask, params)


def check_mask_fits(mask: Any, params: Any, name: str = "mask") -> None:
    """:func:`~optax_zero_one.core._checks.check_mask` for ``params`` given as a tree or as a
    flat buffer (its leaves' shapes)."""
    shapes = params.shapes() if isinstance(params, FlatTree) else params
    _checks.check_mask(mask, shapes, name)
