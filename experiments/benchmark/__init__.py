"""The benchmark job: efficiency measurements, `python -m experiments.benchmark --mode=...`
(__main__.py: its flags, and a `run_mode(values, command)` per mode). One file per mode: the
train and attention modes (train_step.py, attention.py; measured by measuring.py over their
settings.py and programs.py, written by outputs.py), ops.py, capacity.py, flash.py and
approximation.py. This file imports nothing.
"""
