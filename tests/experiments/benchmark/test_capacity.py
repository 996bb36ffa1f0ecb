"""experiments.benchmark --mode=capacity: the length search against fake memory functions (a
brute-force oracle), the step clock, and the command end to end at tiny lengths with a small
memory limit. No timing assertions."""
import csv
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from experiments.benchmark import capacity

REPO = Path(__file__).resolve().parents[3]
LENGTHS = capacity.candidates(1024, 131072)   # 1K .. 128K, 8 candidates


def test_candidates_are_the_powers_of_two_in_range():
  assert LENGTHS == (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
  assert capacity.candidates(1000, 4096) == (1024, 2048, 4096)   # rounded up to a power of two
  assert capacity.candidates(16, 100) == (16, 32, 64)
  with pytest.raises(ValueError, match="min_length <= max_length"):
    capacity.candidates(64, 16)


def fake_memory(kind: str, scale: float):
  """Monotone memory curves: constant + linear, quadratic, a jump (params ~ max_len²)."""
  return {"linear": lambda n: 1e6 + scale * n,
          "quadratic": lambda n: 1e6 + scale * n * n / 1024,
          "n log n": lambda n: scale * n * math.log2(n),
          "steep": lambda n: scale * (n / 1024) ** 3}[kind]


CASES = list(itertools.product(("linear", "quadratic", "n log n", "steep"),
                               (1e3, 1e4, 1e5), (3e6, 5e7, 1e9, 1e10, 1e12)))


@pytest.mark.parametrize("kind, scale, threshold", CASES)
def test_search_finds_the_oracles_answer_and_compiles_only_inside_the_bracket(kind, scale,
                                                                               threshold):
  memory = fake_memory(kind, scale)
  resident = lambda n: memory(n) / 10          # parameters: a part of the compiled total
  compiled = []
  search = capacity.LengthSearch(LENGTHS, resident, lambda n: compiled.append(n) or memory(n))
  longest, complete = search.longest(threshold)
  oracle = max((n for n in LENGTHS if memory(n) <= threshold), default=None)
  assert complete and longest == oracle
  assert len(compiled) == len(set(compiled))                     # never the same length twice
  assert len(compiled) <= 2 * math.ceil(math.log2(len(LENGTHS) + 1))
  # every compile lies strictly between the longest known fit and the shortest known misfit
  fit, misfit = 0, math.inf
  for n in compiled:
    assert fit < n < misfit, (compiled, n)
    if memory(n) <= threshold:
      fit = n
    else:
      misfit = n
  if oracle is not None and oracle < LENGTHS[-1]:   # the answer is proven: it and the next
    assert oracle in compiled and 2 * oracle in compiled


def test_parameters_over_the_threshold_rule_lengths_out_without_compiling():
  """synthesizer-like: parameters grow with max_len², so the long lengths fail from shapes."""
  compiled = []
  resident = lambda n: n * n            # 8K: 6.7e7 > 5e7
  memory = lambda n: 2 * n * n
  search = capacity.LengthSearch(LENGTHS, resident, lambda n: compiled.append(n) or memory(n))
  longest, _ = search.longest(5e7)
  assert longest == 4096                # 2·4096² = 3.4e7 fits; 8192's parameters alone do not
  assert max(compiled) <= 4096, compiled
  assert search.resident[131072] == 131072 ** 2   # known from shapes alone


def test_a_second_threshold_reuses_what_is_known():
  memory = lambda n: 10.0 * n
  compiled = []
  search = capacity.LengthSearch(LENGTHS, lambda n: 0, lambda n: compiled.append(n) or memory(n))
  assert search.longest(10.0 * 131072)[0] == 131072 and compiled == [131072]   # fits at once
  assert search.longest(10.0 * 8192)[0] == 8192
  assert compiled.count(131072) == 1 and 16384 in compiled


def test_the_deadline_stops_the_search_with_a_lower_bound(monkeypatch):
  search = capacity.LengthSearch(LENGTHS, lambda n: 0, lambda n: float(n), deadline=-math.inf)
  assert search.longest(5000.0) == (None, False)


def test_extrapolate_fits_a_power_law_of_at_least_linear_growth():
  predicted, exponent = capacity.extrapolate({1024: 0.5, 2048: 1.0, 4096: 4.0}, 16384)
  assert exponent == pytest.approx(2.0) and predicted == pytest.approx(64.0)   # the last two
  predicted, exponent = capacity.extrapolate({2048: 1.0, 4096: 1.5}, 8192)
  assert exponent == 1.0 and predicted == pytest.approx(3.0)    # never slower than linear


TINY_SETTINGS = capacity.Settings(attentions=("local",), lengths=(16,), num_layers=1, emb_dim=32,
                                  num_heads=2, mlp_dim=64)


@pytest.mark.slow
def test_a_step_predicted_over_the_budget_is_not_run(monkeypatch):
  """Probe steps of 1 s at 16 and 4 s at 32 predict 64 s at 128 (n²): over a 10 s budget."""
  timed = []

  def fake_time_step(workload, compiled, budget_s):
    timed.append(budget_s)
    return (1.0, 4.0)[len(timed) - 1], 2

  monkeypatch.setattr(capacity, "time_step", fake_time_step)
  result = capacity.measure_capacity("local", "none", "float32", (64, 128), device_memory=1e12,
                                     memory_limit=1e12, step_budget_s=10.0, probe_lengths=(16, 32),
                                     base=TINY_SETTINGS)
  assert len(timed) == 2 and result.probes == (16, 32) and result.timed_length == 128
  assert result.exponent == pytest.approx(2.0) and result.predicted_s == pytest.approx(64.0)
  assert result.step_s is None and result.calls == 0
  assert result.note == "not timed: predicted 64 s @ 128 > step budget 10 s"


TINY = ["--num_layers=1", "--emb_dim=32", "--num_heads=2", "--mlp_dim=64"]


@pytest.mark.slow
def test_capacity_command_end_to_end(tmp_path):
  """synthesizer at 64 and 128 on the real device, with a memory limit that 128 exceeds: the
  table, CSV and plot are written, 128 fits the device (compiled first, once), and the step
  is timed at 64, the longest within the limit."""
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  args = [sys.executable, "-m", "experiments.benchmark", "--mode=capacity",
          "--attentions=synthesizer", "--min_length=64", "--max_length=128", "--remats=none",
          "--dtypes=float32",
          "--memory_limit_gb=0.0015", "--probe_lengths=16,32", f"--out={tmp_path}", *TINY]
  done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(tmp_path / "capacity.csv", newline="") as f:
    (row,) = list(csv.DictReader(f))
  assert (row["attention"], row["remat"], row["dtype"]) == ("synthesizer", "none", "float32")
  assert row["longest"] == "128" and row["complete"] == "True"    # fits the device
  assert int(row["longest_bytes"]) > 1.5e6                          # but not the limit
  assert float(row["memory_limit_bytes"]) == pytest.approx(1.5e6)
  assert row["compiled"] == "128 64"
  assert row["timed_length"] == "64" and float(row["step_s"]) > 0 and row["calls"] == "2"
  assert row["probes"] == "16 32" and float(row["predicted_s"]) > 0   # predicted from 16 and 32
  assert float(row["exponent"]) >= 1
  text = (tmp_path / "capacity.md").read_text()
  assert "| synthesizer | 128 (the longest tried)" in text and "s @ 64 (" in text
  assert "1 layer, emb 32, 2 heads, MLP 64" in text and "n^" in text
  with Image.open(tmp_path / "capacity.png") as image:
    image.verify()
    assert image.format == "PNG"


@pytest.mark.parametrize("flag, message", [
    ("--dtypes=float64", "error: --dtypes=float64: choose from"),
    pytest.param("--probe_lengths=4096",
                 "error: --probe_lengths=4096: give two different positive lengths",
                 marks=pytest.mark.slow),
])
def test_capacity_command_refuses_bad_flags_in_one_line(tmp_path, flag, message):
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  done = subprocess.run([sys.executable, "-m", "experiments.benchmark", "--mode=capacity", flag,
                         f"--out={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 1
  assert message in done.stderr and "Traceback" not in done.stderr


def test_a_search_stopped_by_the_time_budget_says_so():
  result = capacity.measure_capacity("local", "none", "float32", (16, 32), device_memory=1e12,
                                     memory_limit=1e12, deadline=-math.inf, base=TINY_SETTINGS)
  assert result.longest is None and not result.complete and result.compiled == ()
  assert result.note == "not timed: over the time budget"
