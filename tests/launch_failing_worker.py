"""A job for tests/test_launch.py: process 1 fails after a first collective, process 0 goes on
to a second collective that can never complete; the launcher must stop it and report."""

import sys

from benchmarks import distributed

job = distributed.initialize_from_env()

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = distributed.worker_mesh("w")
total = jax.jit(
    jax.shard_map(lambda x: jax.lax.psum(x, "w"), mesh=mesh, in_specs=P("w"), out_specs=P("w"))
)
x = distributed.to_workers(lambda i: float(i + 1), mesh)
print("first sum", distributed.local_rows(total(x))[1][0], flush=True)
if job.process_id == 1:
    raise RuntimeError("deliberate failure in process 1")
jax.block_until_ready(total(x))
sys.exit(0)
