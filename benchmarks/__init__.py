"""The benchmark runner (benchmarks/run.py) and its parts: models, measurement, strategies, report."""
