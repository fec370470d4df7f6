"""Benchmark harness: cases come from the op registry, peers run in the same process."""
