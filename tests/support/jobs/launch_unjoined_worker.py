"""A module run by the launcher that forgets ``ozo.initialize_from_env()``: each process is a
job of its own (tests/test_launch.py checks that the launcher fails it)."""

import jax

print("processes", jax.process_count(), flush=True)
