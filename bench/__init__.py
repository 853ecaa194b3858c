"""Benchmarks and load harnesses, the project's one bench home: `fencepost bench NAME`
(one module per bench), real_model_resume, and the scripts run by hand with
`PYTHONPATH=. python bench/NAME.py` (gpu_check, kernel_build, packed_prefill and
the others whose docstrings say so).

Measurement code, never part of serving: nothing but the benches and
adapters/cli/bench.py imports it (tests/test_import_rules.py checks), and the CLI
imports a bench only when that bench is chosen.
"""
