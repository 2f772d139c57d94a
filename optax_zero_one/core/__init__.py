"""The optimizer: pure Optax transforms and what they are made of.

Nothing here knows about processes, meshes, launchers or files; every transform takes its worker
axis by name (``axis_name``) and runs under whatever binds it (``jax.shard_map``, ``jax.pmap``,
``jax.vmap``, or the :mod:`optax_zero_one.integration` helpers).

- :mod:`~optax_zero_one.core.frozen_variance`, :mod:`~optax_zero_one.core.scheduled_mean`,
  :mod:`~optax_zero_one.core.local_steps`: the three composable transforms;
- :mod:`~optax_zero_one.core.zero_one_adam`, :mod:`~optax_zero_one.core.onebit_adam`: the two
  optimizers, short chains of them;
- :mod:`~optax_zero_one.core.collective`, :mod:`~optax_zero_one.core.compression`,
  :mod:`~optax_zero_one.core.psum_mean`: the 1-bit compressed mean (two-phase and one-``psum``
  backends) with error feedback;
- :mod:`~optax_zero_one.core.flat`, :mod:`~optax_zero_one.core.wrappers`: the flat worker-major
  layout and the wrappers (``flatten``, ``skip_not_finite``, weight decay);
- :mod:`~optax_zero_one.core.policies`, :mod:`~optax_zero_one.core.kinds`: variance and
  local-step policies, and the step kinds they imply;
- :mod:`~optax_zero_one.core.comm`, :mod:`~optax_zero_one.core.diloco`: the validated
  communication config the compositions pass down, and DiLoCo's compositions;
- ``_graph``, ``_checks``, ``_cut``, ``_flax_state``: private helpers (graph primitives and
  the per-platform ones, input checks, the cut of the flat buffer into leaves, Flax's
  serialization of the flat buffers).
"""
