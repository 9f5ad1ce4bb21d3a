"""Benchmarks: suites, methods, an interleaved runner, metrics, reports and plots (`quasar bench`)."""
