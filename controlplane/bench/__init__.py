"""Benchmarks behind ``elasticctl bench``; each returns one JSON-serialisable dict."""


class BenchError(RuntimeError):
    """A run of the benchmark did not do what it must (a failed job, a missing incident)."""
