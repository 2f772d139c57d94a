"""A job for tests/test_launch.py: process 1 fails after a first collective, process 0 goes on
to a second collective that can never complete; the launcher must stop it and report.

Run from ``tests/`` as ``python -m optax_zero_one.integration.launch --processes 2 -- \\
support.jobs.launch_failing_worker``. With ``FAIL_BY_SIGKILL=1`` process 1 kills itself with
SIGKILL instead of raising."""

import os
import signal
import sys

import optax_zero_one as ozo

job = ozo.initialize_from_env()

import jax  # noqa: E402

mesh = ozo.worker_mesh("w")
total = jax.jit(ozo.on_workers(lambda x: jax.lax.psum(x, "w"), mesh))
x = ozo.to_workers(lambda i: float(i + 1), mesh)
print("first sum", ozo.local_rows(total(x))[1][0], flush=True)
if job.process_id == 1:
    if os.environ.get("FAIL_BY_SIGKILL"):  # as the OOM killer ends a process: no note, no exit
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("deliberate failure in process 1")
jax.block_until_ready(total(x))
sys.exit(0)
