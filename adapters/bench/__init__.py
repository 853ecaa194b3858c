"""Benchmarks and load harnesses: `fencepost bench NAME` and real_model_resume.

Measurement code, never part of serving: nothing but the benches (this package
and top-level bench/) and adapters/cli/bench.py imports it
(tests/test_import_rules.py checks), and the CLI imports a bench only when that
bench is chosen.
"""
