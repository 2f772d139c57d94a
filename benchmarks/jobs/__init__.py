"""Jobs the benchmark scripts start as subprocesses (see ``benchmarks/README.md``)."""
