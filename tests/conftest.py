"""Test-session set-up shared by every test file."""
from experiments import cli

# Before JAX starts its CPU backend: the XLA scheduler setting the command-line tools use too.
cli.avoid_cpu_scheduler_deadlock()
