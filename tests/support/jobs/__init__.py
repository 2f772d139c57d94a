"""Scripts the tests run in subprocesses (each also runs as ``python -m support.jobs.NAME``)."""
