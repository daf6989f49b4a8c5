"""Benchmarks behind ``elasticctl bench``; each returns one JSON-serialisable dict."""
