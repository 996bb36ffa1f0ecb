"""What every command of the harness shares, and nothing of any one job: one-line errors and the
dry run, flag parsing and config overrides, task configs looked up by name, the registered
variants' names, XLA flags, device facts, run records and plot helpers.

It imports no job (experiments/train/, experiments/benchmark/, the commands beside them):
tests/test_lint.py checks.
"""
