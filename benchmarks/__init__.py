"""Benchmarks of the dsv4 ops: one `bench_<family>.py` per op family, run by `python -m benchmarks.run`."""
