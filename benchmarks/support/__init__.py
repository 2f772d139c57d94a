"""Modules the benchmark scripts share (see ``benchmarks/README.md``)."""
