"""A job for tests/test_launch.py that never uses JAX and writes a byte that is not UTF-8, then
many lines (more than a pipe holds): the launcher must forward all of it and succeed."""

import sys

sys.stdout.buffer.write(b"caf\xe9\n")
sys.stdout.flush()
for i in range(20_000):
    print(f"line {i}")
