"""experiments.benchmark: tiny runs end to end in both modes, every Status path, the jax.nn
baseline, speed-ups against the faster baseline, atomic outputs.

Nothing here asserts on timings: only that they exist and that the bookkeeping is right.
"""
import csv
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import attention_zoo as az
from experiments.benchmark import attention, flash, measuring, programs
from experiments.benchmark import outputs as output
from experiments.benchmark import settings as settings_lib
from experiments.benchmark.settings import JAX_BASELINE, Settings, Status
from experiments.common import device
from experiments.common.errors import HarnessError
from experiments.train import build
from experiments.train import steps as train_steps

REPO = Path(__file__).resolve().parents[3]
TINY_MODEL = dict(num_layers=1, emb_dim=32, num_heads=2, mlp_dim=64)
TINY_FLAGS = ["--num_layers=1", "--emb_dim=32", "--num_heads=2", "--mlp_dim=64"]


def read_csv(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def tiny_settings(**overrides):
  kw = dict(attentions=("full",), lengths=(16,), mode="attention", repeats=1, matmul_size=0,
            **TINY_MODEL)
  return Settings(**{**kw, **overrides})


def by(rows, name):
  return [r for r in rows if r["attention"] == name]


# -- end to end ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def attention_run(tmp_path_factory):
  """The command in attention mode, as a user runs it."""
  out = tmp_path_factory.mktemp("attention")
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  done = subprocess.run(
      [sys.executable, "-m", "experiments.benchmark", "--mode=attention", "--attentions=flash",
       "--lengths=32,16", "--repeats=2", "--matmul_size=128", f"--out={out}", *TINY_FLAGS],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return output.output_paths(str(out), "attention")


def test_attention_mode_measures_both_baselines_and_the_flop_rate(attention_run):
  rows = read_csv(attention_run["csv"])
  assert [(r["attention"], int(r["length"])) for r in rows] == [
      ("full", 16), ("full", 32), (JAX_BASELINE, 16), (JAX_BASELINE, 32), ("flash", 16),
      ("flash", 32)]
  assert all(r["status"] == "ok" and float(r["step_ms"]) > 0 and float(r["fwd_ms"]) > 0
             for r in rows)
  for n in (16, 32):
    full, jax_nn, flash = (next(r for r in by(rows, name) if int(r["length"]) == n)
                           for name in ("full", JAX_BASELINE, "flash"))
    ms = {name: float(r["step_ms"]) for name, r in (("full", full), ("jax", jax_nn),
                                                    ("flash", flash))}
    # full's ratio to jax.nn, and speed-ups against the faster of the two
    assert float(full["speedup_vs_jax"]) == pytest.approx(ms["jax"] / ms["full"], rel=1e-4)
    assert float(flash["speedup_vs_best"]) == pytest.approx(
        min(ms["full"], ms["jax"]) / ms["flash"], rel=1e-4)
    assert float(flash["speedup_vs_full"]) == pytest.approx(ms["full"] / ms["flash"], rel=1e-4)
    # the nominal dense count, 3.5 x 4·b·h·n²·d, and its share of the matmul limit
    nominal = 3.5 * 4 * 1 * 2 * n * n * 16
    assert float(flash["rate_flops"]) == pytest.approx(nominal)
    gflops = nominal / (ms["flash"] / 1e3) / 1e9
    assert float(flash["gflops_per_s"]) == pytest.approx(gflops, rel=1e-4)
    assert float(flash["fraction_of_matmul"]) == pytest.approx(
        gflops / float(flash["matmul_gflops"]), rel=1e-3)
  assert json.loads(by(rows, JAX_BASELINE)[0]["options"]) == {}
  for name in ("full", "flash"):
    short, long = by(rows, name)
    assert float(long["flops"]) > float(short["flops"]) > 0
    assert int(long["temp_bytes"]) > int(short["temp_bytes"]) > 0


def test_attention_mode_markdown_and_plots(attention_run):
  text = open(attention_run["markdown"]).read()
  assert "jax.nn.dot_product_attention" in text and "## FLOP rate of the exact variants" in text
  assert "| variant | fwd+bwd ms 16 | vs jax.nn | speed-up |" in text
  assert any(line.startswith(f"| {JAX_BASELINE} |") for line in text.splitlines())
  assert "Matmul limit:" in text
  for key in ("time_plot", "memory_plot"):
    with Image.open(attention_run[key]) as image:
      image.verify()
      assert image.format == "PNG"
  data = json.load(open(attention_run["json"]))
  assert data["settings"]["mode"] == "attention" and len(data["rows"]) == 6


def test_train_mode_times_the_trainers_step(tmp_path, monkeypatch):
  made = []
  real_make_steps = train_steps.make_steps
  monkeypatch.setattr(train_steps, "make_steps",
                      lambda *a: made.append(a[0]) or real_make_steps(*a))
  settings = tiny_settings(mode="train", attentions=("local",), lengths=(16,), repeats=2,
                           attention_options={"local": {"block_size": "8"}})
  rows = measuring.run_and_write(settings, str(tmp_path), command="test")
  assert [(r["attention"], r["length"], r["status"]) for r in rows] == [
      ("full", 16, Status.OK), ("local", 16, Status.OK)]
  # the Text config (fair preset) with the run's overrides, through the trainer's make_steps
  assert [(c.model.attention, c.model.max_len) for c in made] == [("full", 16), ("local", 16)]
  assert all(c.model.num_layers == 1 and c.model.emb_dim == 32 for c in made)
  assert json.loads(rows[1]["options"])["block_size"] == 8     # the override beats LRA's 50
  for row in rows:
    assert row["step_ms"] > 0 and row["flops"] > 0 and row["temp_bytes"] > 0
    assert row["resident_bytes"] > 0 and row["compiled_total_bytes"] > row["temp_bytes"]
  assert rows[0]["speedup_vs_full"] == 1.0 == rows[0]["speedup_vs_best"]
  text = open(output.output_paths(str(tmp_path), "train")["markdown"]).read()
  assert "| Model | 16 | Mem 16 | time exponent | memory exponent |" in text
  # the paper's Table 2, read from configs/lra/paper_tables.py
  assert "published figures, quoted, not measured here" in text
  assert "| full = Transformer | 8.1 | 4.9 | 2.3 | 1.4 | 0.85 | 2.65 | 5.51 | 9.48 |" in text
  local_row = next(line for line in text.splitlines() if line.startswith("| local |"))
  assert local_row.count("x)") == 1                          # steps/s (speed-up vs full)


# -- the jax.nn baseline -------------------------------------------------------------------------

def test_jax_baseline_computes_masked_softmax_attention():
  """Against a plain numpy softmax over the unmasked keys."""
  b, n, h, d = 2, 12, 2, 8
  q, k, v = np.random.default_rng(0).normal(size=(3, b, n, h, d)).astype(np.float32)
  mask = np.ones((b, n), bool)
  mask[1, 7:] = False
  out = attention.JaxDotProductAttention()(q, k, v, q_mask=jnp.asarray(mask),
                                           kv_mask=jnp.asarray(mask))
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)             # [b, h, q, k]
  scores = np.where(mask[:, None, None, :], scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  expected = np.einsum("bhqk,bkhd->bqhd", weights, v)                   # [b, q, h, d]
  np.testing.assert_allclose(out, expected, atol=1e-5)


def test_jax_baseline_only_in_attention_mode():
  assert tiny_settings().names() == ["full", JAX_BASELINE]
  assert tiny_settings(mode="train", attentions=("local",)).names() == ["full", "local"]


# -- every Status ------------------------------------------------------------------------------

def test_runtime_oom_stops_the_longer_lengths(monkeypatch):
  real_call = programs.call

  def call(compiled, *args):
    if args[2].shape[1] == 24:                 # q [b, 24, h, d]: pretend 24 does not fit
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 bytes")
    return real_call(compiled, *args)

  monkeypatch.setattr(programs, "call", call)
  rows = measuring.run(tiny_settings(attentions=("full",), lengths=(16, 24, 32)))
  full = by(rows, "full")
  assert [r["status"] for r in full] == [Status.OK, Status.OOM_RUNTIME, Status.NOT_TRIED]
  assert "RESOURCE_EXHAUSTED" in full[1]["note"] and full[1]["temp_bytes"] > 0
  assert full[2]["note"] == "length 24 ran out of memory"
  assert full[1]["speedup_vs_full"] is None


def test_memory_limit_refuses_before_running_and_longer_lengths_still_compile():
  rows = by(measuring.run(tiny_settings(lengths=(16, 32), memory_limit_bytes=1024)), "full")
  assert [r["status"] for r in rows] == [Status.OVER_MEMORY_LIMIT] * 2
  assert all("memory limit" in r["note"] and r.get("step_ms") is None for r in rows)
  assert rows[1]["temp_bytes"] > rows[0]["temp_bytes"] > 0      # known from compiling alone
  assert rows[0]["memory_exponent"] is not None


def test_more_than_the_device_has_is_oom_compiled(monkeypatch):
  monkeypatch.setattr(device, "device_memory_bytes", lambda: 1024.0)
  rows = by(measuring.run(tiny_settings(lengths=(16, 32))), "full")
  assert [r["status"] for r in rows] == [Status.OOM_COMPILED] * 2
  assert all("the device's" in r["note"] for r in rows)


def test_parameters_over_the_limit_are_refused_before_compiling():
  settings = tiny_settings(attentions=("synthesizer",), lengths=(16, 512), mode="train")
  resident = [measuring.workload("synthesizer", n, settings).resident_bytes
              for n in (16, 512)]
  assert resident[1] > 10 * resident[0] > 0     # max_len² parameters per head
  row, _ = measuring.measure("synthesizer", 512, settings, memory_limit=resident[1] / 2)
  assert row["status"] is Status.OVER_MEMORY_LIMIT
  assert "parameters and optimizer state" in row["note"] and row.get("flops") is None


def test_time_budget_stops_the_variant(tmp_path):
  settings = tiny_settings(lengths=(16, 32), time_budget_s=1e-9)
  rows = by(measuring.run(settings), "full")
  assert [r["status"] for r in rows] == [Status.OVER_TIME_BUDGET, Status.NOT_TRIED]
  assert rows[0]["note"].startswith("first call")
  assert rows[1]["note"] == "length 16 exceeded the time budget"
  paths = output.write_outputs(measuring.run(settings), settings, str(tmp_path), plots=False)
  assert "| full | skipped |" in open(paths["markdown"]).read()
  assert [r["status"] for r in read_csv(paths["csv"])][:2] == ["over_time_budget", "not_tried"]


def test_a_prediction_over_the_budget_is_not_run():
  settings = tiny_settings(lengths=(16, 32), time_budget_s=1.0)
  previous = {"length": 16, "timings": {"fwd": (1e4, None, False), "fwd_bwd": (1e4, None, False)}}
  row, _ = measuring.measure("full", 32, settings, memory_limit=1e12, previous=previous)
  assert row["status"] is Status.OVER_TIME_BUDGET and row["note"].endswith("(not run)")


def test_an_unexpected_failure_is_error_and_does_not_stop_the_variant(monkeypatch):
  real_call = programs.call

  def call(compiled, *args):
    if args[2].shape[1] == 16:
      raise ValueError("boom")
    return real_call(compiled, *args)

  monkeypatch.setattr(programs, "call", call)
  rows = by(measuring.run(tiny_settings(lengths=(16, 24))), "full")
  assert [r["status"] for r in rows] == [Status.ERROR, Status.OK]
  assert rows[0]["note"] == "ValueError: boom"


def test_status_decides_what_follows():
  assert {s for s in Status if s.stops_longer_lengths} == {Status.OOM_RUNTIME,
                                                           Status.OVER_TIME_BUDGET}
  assert Status.OOM_COMPILED.label == Status.OOM_RUNTIME.label == "OOM"
  assert Status.OVER_MEMORY_LIMIT.label == Status.NOT_TRIED.label == "skipped"


# -- outputs ---------------------------------------------------------------------------------

def test_outputs_are_rewritten_after_every_measurement():
  seen = []
  rows = measuring.run(tiny_settings(lengths=(16, 24)), on_row=lambda rows: seen.append(len(rows)))
  assert seen == [1, 2, 3, 4] and rows[0]["device"] and rows[0]["speedup_vs_full"] == 1.0


def test_a_write_that_fails_leaves_the_old_file(tmp_path, monkeypatch):
  rows = measuring.run(tiny_settings())
  settings = tiny_settings()
  paths = output.write_outputs(rows, settings, str(tmp_path), plots=False)
  before = {kind: open(path).read() for kind, path in paths.items()}

  def broken_writerow(self, row):
    raise OSError("disk full")

  monkeypatch.setattr(csv.DictWriter, "writerow", broken_writerow)
  with pytest.raises(OSError, match="disk full"):
    output.write_outputs(rows, settings, str(tmp_path), plots=False)
  assert {kind: open(path).read() for kind, path in paths.items()} == before
  assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in paths.values())


def test_flash_mode_writes_its_table_atomically(tmp_path, monkeypatch):
  written = []
  monkeypatch.setattr(flash, "write_text", lambda path, text: written.append((path, text)))
  flash.write(str(tmp_path / "fb.md"), "# header", [], ["| row |"])
  ((path, text),) = written
  assert path.endswith("fb.md") and text.startswith("# header") and "| row |" in text


def test_fit_exponent_recovers_power_laws():
  lengths = [1024, 2048, 4096]
  assert output.fit_exponent(lengths, [3 * n ** 2 for n in lengths]) == pytest.approx(2.0)
  assert output.fit_exponent(lengths, [5 * n for n in lengths]) == pytest.approx(1.0)
  assert output.fit_exponent([1024], [1.0]) is None
  assert output.fit_exponent(lengths, [None, 2.0, None]) is None


def test_speedups_are_against_the_faster_baseline():
  rows = [{"attention": "full", "length": 8, "step_ms": 4.0},
          {"attention": JAX_BASELINE, "length": 8, "step_ms": 2.0},
          {"attention": "local", "length": 8, "step_ms": 1.0},
          {"attention": "local", "length": 16, "step_ms": 1.0}]
  measuring.add_speedups(rows)
  assert rows[2]["speedup_vs_full"] == 4.0 and rows[2]["speedup_vs_jax"] == 2.0
  assert rows[2]["speedup_vs_best"] == 2.0 and rows[0]["speedup_vs_jax"] == 0.5
  assert rows[3]["speedup_vs_best"] is None     # no baseline at 16


# -- settings and flags ------------------------------------------------------------------------

def test_attention_options_parsing():
  parsed = settings_lib.parse_attention_options(
      ["performer:nb_features=128,redraw=false", "local:block_size=64", "performer:kernel=relu"])
  assert parsed == {"performer": {"nb_features": "128", "redraw": "false", "kernel": "relu"},
                    "local": {"block_size": "64"}}
  with pytest.raises(ValueError, match="name:key=value"):
    settings_lib.parse_attention_options(["nb_features=128"])
  with pytest.raises(ValueError, match="not key=value"):
    settings_lib.parse_attention_options(["performer:nb_features"])


def test_bad_settings_are_refused_clearly():
  with pytest.raises(ValueError, match="unknown attention 'nope'"):
    tiny_settings(attentions=("nope",))
  with pytest.raises(ValueError, match="blocksize"):
    tiny_settings(attention_options={"local": {"blocksize": "8"}})
  with pytest.raises(ValueError, match="lengths must be positive"):
    tiny_settings(lengths=(0,))
  with pytest.raises(ValueError, match="remat='all'; choose one of none"):
    tiny_settings(remat="all")


def test_settings_from_flags_defaults_to_every_variant_and_the_text_config():
  values = types.SimpleNamespace(
      attentions=[], lengths=["1024", "2048"], mode="train", dtype="float32", remat="none",
      batch_size=None, repeats=5, warmup=1, time_budget_s=60.0, memory_limit_gb=None,
      num_layers=None, emb_dim=None, num_heads=None, mlp_dim=None, attention_options=[],
      seed=0, matmul_size=0)
  settings = settings_lib.settings_from_flags(values)
  # every name but the causal-only ones (stick_breaking), which the Text model, an encoder, refuses
  causal_only = {n for n in az.available() if not az.spec(n).supports_bidirectional}
  assert "stick_breaking" in causal_only
  assert settings.attentions == tuple(n for n in az.available() if n not in causal_only)
  assert settings.batch_size == settings_lib.default_batch_size()
  model = build.model_config(settings.config("local", 1024))
  assert (model.num_layers, model.emb_dim, model.max_len) == (4, 256, 1024)
  assert model.attention_options["block_size"] == 50   # the fair preset's Text options
  with pytest.raises(HarnessError, match="--lengths must be integers"):
    settings_lib.settings_from_flags(types.SimpleNamespace(**{**vars(values), "lengths": ["1k"]}))


def test_flops_are_flagged_as_a_lower_bound_only_when_a_loop_runs_products():
  x = jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)
  scan_products = lambda x: jax.lax.scan(lambda c, m: (c @ m, None), x[0], x)[0]
  scan_adds = lambda x: jax.lax.scan(lambda c, m: (c + m, None), x[0], x)[0]
  one_product = lambda x: x[0] @ x[1]
  flagged = {fn: device.loops_over_products(jax.jit(fn).lower(x).compile())
             for fn in (scan_products, scan_adds, one_product)}
  assert flagged == {scan_products: True, scan_adds: False, one_product: False}


def test_the_log_says_what_the_budget_covers_and_prints_compile_and_run_apart(caplog):
  settings = tiny_settings(attentions=("sliding_window",), lengths=(40,),
                           attention_options={"sliding_window": {"window": "3"}})
  with caplog.at_level("INFO"):
    rows = measuring.run(settings)
  assert "timed calls (warmup + repeats; compiling is not counted)" in caplog.text
  row = by(rows, "sliding_window")[0]
  line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("sliding_window"))
  assert (f"setup {row['setup_s']:.1f} s, compile {row['compile_s']:.1f} s, "
          f"run {row['run_s']:.1f} s, ") in line
  # the rate counts the pairs the window keeps, not n², nor XLA's once-per-loop count
  kept = sum(min(i + 3, 39) - max(i - 3, 0) + 1 for i in range(40))
  assert row["rate_flops"] == 3.5 * 4 * 2 * kept * 16   # batch 1 x 2 heads of 16
  assert row["flops_source"].startswith("nominal") and row["gflops_per_s"] > 0
