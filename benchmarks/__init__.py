"""Benchmarks: side-by-side measurements, each with a command anyone can rerun (see docs/PERFORMANCE.md)."""
