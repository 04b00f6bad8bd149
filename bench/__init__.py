"""Benchmarks (not tests): `python -m bench.exchange`."""
