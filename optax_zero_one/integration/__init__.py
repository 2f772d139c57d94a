"""What runs the optimizer: host-side dispatch, data parallelism, processes, checkpoints.

These modules import :mod:`optax_zero_one.core`, never the other way round.

- :mod:`~optax_zero_one.integration.dispatch`: one compiled program per step kind, the kind of
  each step chosen on the host (``dispatch_by_kind``);
- :mod:`~optax_zero_one.integration.data_parallel`: ``data_parallel(mesh).jit``, the drop-in for
  ``jax.jit`` on a ``(data, model)`` mesh;
- :mod:`~optax_zero_one.integration.workers`, :mod:`~optax_zero_one.integration.distributed`: the
  worker layout in one process and across processes;
- :mod:`~optax_zero_one.integration.launch`: ``python -m optax_zero_one.integration.launch``, a
  local multi-process job;
- :mod:`~optax_zero_one.integration.checkpoint`: checkpoints across worker counts;
- :mod:`~optax_zero_one.integration.comm_stats`: what a compiled program communicates;
- :mod:`~optax_zero_one.integration.deepspeed`: DeepSpeed optimizer configs.
"""
