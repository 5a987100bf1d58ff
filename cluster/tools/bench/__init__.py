"""Benchmarks and load tests: speed as ratios within one run."""
