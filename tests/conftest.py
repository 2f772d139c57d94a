"""Test configuration: 8 simulated CPU devices, set before JAX initialises its backend.

PJRT_NPROC >= 2x the device count avoids the rendezvous deadlock of simulated devices on a
2-core machine (docs/testing.md); loops over simulated devices also block on every step.
"""

import os

NUM_DEVICES = 8
os.environ.setdefault("PJRT_NPROC", str(2 * NUM_DEVICES))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", NUM_DEVICES)

from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run (CI must not go red on a lucky draw);
# HYPOTHESIS_PROFILE=explore draws fresh ones, to search for new counterexamples.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
