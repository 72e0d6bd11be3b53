"""Benchmarks for pargrad (run as modules, e.g. ``python -m benchmarks.engines``)."""
