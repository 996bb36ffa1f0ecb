"""experiments.benchmark: outputs of a tiny run, OOM / budget skips recorded, flag parsing.

Nothing here asserts on timings: only that they exist and that the bookkeeping is right.
"""
import csv
import dataclasses
import json
import sys

import jax
import numpy as np
import pytest
from absl import flags
from PIL import Image

import attention_zoo as az
from experiments import benchmark, benchmarking, cli, plugins

TINY_MODEL = ["--num_layers=1", "--emb_dim=32", "--num_heads=2", "--mlp_dim=64"]


def run_main(args):
  flags.FLAGS.unparse_flags()
  argv = flags.FLAGS(["benchmark", *args])
  try:
    return benchmark.main(argv)
  finally:
    flags.FLAGS.unparse_flags()


def read_csv(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def tiny_settings(**overrides):
  kw = dict(attentions=("full",), lengths=(16,), mode="attention", num_layers=1, emb_dim=32,
            num_heads=2, mlp_dim=64, repeats=1)
  return benchmarking.Settings(**{**kw, **overrides})


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  status = run_main(["--attentions=local", "--lengths=40,16", "--repeats=2", "--mode=train",
                     "--attention_options=local:block_size=8", f"--out={out}", *TINY_MODEL])
  return status, benchmarking.output_paths(str(out), "train")


def test_smoke_run_writes_a_sane_csv(smoke):
  status, paths = smoke
  assert status == 0
  rows = read_csv(paths["csv"])
  assert [(r["attention"], int(r["length"])) for r in rows] == [
      ("full", 16), ("full", 40), ("local", 16), ("local", 40)]   # full added as the baseline
  assert set(benchmarking.CSV_COLUMNS) <= set(rows[0])
  for row in rows:
    assert row["status"] == "ok", row
    assert float(row["step_ms"]) > 0 and float(row["steps_per_s"]) > 0
    assert float(row["flops"]) > float(row["flops_fwd"]) > 0      # a train step does more than a forward
    assert row["mode"] == "train" and row["dtype"] == "float32" and row["batch_size"] == "1"
    assert row["jax_version"] == jax.__version__ and row["date"] and row["device"]
    assert row["time_exponent"] != "" and row["memory_exponent"] != ""
  for row in rows[:2]:
    assert float(row["speedup_vs_full"]) == 1.0
  assert json.loads(rows[2]["options"]) == {"block_size": 8}     # the flag overrides LRA's 50
  for name in ("full", "local"):
    short, long = [r for r in rows if r["attention"] == name]
    for column in ("temp_bytes_fwd", "temp_bytes_fwd_bwd", "flops"):
      assert int(float(long[column])) > int(float(short[column])), (name, column)
    for row in (short, long):
      assert int(row["temp_bytes_fwd_bwd"]) > int(row["temp_bytes_fwd"])
      assert int(row["compiled_peak_bytes"]) > int(row["temp_bytes_fwd_bwd"])   # + parameters, inputs


def test_smoke_run_writes_the_table2_markdown(smoke):
  _, paths = smoke
  text = open(paths["markdown"]).read()
  assert "| Model | 16 | 40 | Mem 16 | 40 | time exponent | memory exponent |" in text
  lines = text.splitlines()
  full_row = next(line for line in lines if line.startswith("| full |"))
  local_row = next(line for line in lines if line.startswith("| local |"))
  assert "x)" not in full_row                               # the baseline has no speed-up
  assert local_row.count("x)") == 2                         # steps/s (speed-up) at both lengths
  assert len(local_row.split("|")) == len(full_row.split("|")) == 9      # model, 2 + 2 lengths, 2 exponents
  # the paper's published figures, labelled as such, beside ours
  assert "published figures, quoted, not measured here" in text
  assert "| full = Transformer | 8.1 | 4.9 | 2.3 | 1.4 | 0.85 | 2.65 | 5.51 | 9.48 |" in text
  assert jax.__version__ in text and "Device:" in text


def test_smoke_run_writes_valid_plots_and_json(smoke):
  _, paths = smoke
  for key in ("time_plot", "memory_plot"):
    with Image.open(paths[key]) as image:
      image.verify()
      assert image.format == "PNG" and image.size[0] > 100
  data = json.load(open(paths["json"]))
  assert data["environment"]["jax_version"] == jax.__version__
  assert data["settings"]["mode"] == "train" and len(data["rows"]) == 4


def test_forced_oom_is_recorded_and_longer_lengths_skipped(monkeypatch):
  real_call = benchmarking.call

  def call(compiled, args):
    if args[2].shape[1] == 24:                 # q [b, 24, h, d]: pretend length 24 does not fit
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes")
    return real_call(compiled, args)

  monkeypatch.setattr(benchmarking, "call", call)
  rows = benchmarking.run(tiny_settings(lengths=(16, 24, 32)))
  assert [r["status"] for r in rows] == ["ok", "OOM", "skipped"]
  assert "RESOURCE_EXHAUSTED" in rows[1]["note"]
  assert rows[1]["temp_bytes_fwd_bwd"] > 0                    # compiled before it ran out
  assert rows[2]["note"] == "length 24 ran out of memory"
  assert rows[0]["fwd_ms"] > 0 and rows[0]["speedup_vs_full"] == 1.0
  assert rows[1]["speedup_vs_full"] is None


def test_memory_limit_skips_before_running_but_records_memory():
  rows = benchmarking.run(tiny_settings(memory_limit_bytes=1024))
  (row,) = rows
  assert row["status"] == "skipped" and "memory limit" in row["note"] and row["note"].endswith("(not run)")
  assert row["temp_bytes_fwd_bwd"] > 0 and row["flops"] > 0       # known from compiling alone
  assert row.get("step_ms") is None


def test_parameters_over_the_limit_are_never_created(monkeypatch):
  """synthesizer keeps max_len x max_len per head: over the limit it is refused from its shapes,
  before any array of it exists (at 16K it would take 17 GB and kill the process)."""
  settings = tiny_settings(attentions=("synthesizer",), lengths=(16, 512), mode="train")
  resident = [benchmarking.resident_bytes("synthesizer", n, settings) for n in (16, 512)]
  assert resident[1] > 10 * resident[0] > 0
  created = []
  real_make = benchmarking.make_module
  monkeypatch.setattr(benchmarking, "make_module", lambda *a: created.append(a) or real_make(*a))
  rows = benchmarking.run(dataclasses.replace(settings, memory_limit_bytes=resident[1] / 2))
  synthesizer = [r for r in rows if r["attention"] == "synthesizer"]
  assert [r["status"] for r in synthesizer] == ["ok", "skipped"], [r["note"] for r in synthesizer]
  assert "parameters and optimizer state" in synthesizer[1]["note"] and synthesizer[1].get("flops") is None
  built = [a for a in created if a[0] == "synthesizer" and a[1] == 512]
  assert len(built) == 1, "only the shape-only call may make the length-512 model"


def test_outputs_are_rewritten_after_every_measurement(tmp_path):
  seen = []
  rows = benchmarking.run(tiny_settings(lengths=(16, 24)), on_row=lambda rows: seen.append(len(rows)))
  assert seen == [1, 2] and rows[0]["speedup_vs_full"] == 1.0 and rows[0]["device"]


def test_more_compiled_memory_than_the_device_has_is_oom_and_longer_lengths_still_compile(monkeypatch):
  monkeypatch.setattr(benchmarking, "device_memory_bytes", lambda: 1024.0)
  rows = benchmarking.run(tiny_settings(lengths=(16, 32)))
  assert [r["status"] for r in rows] == ["OOM", "OOM"]
  assert all("the device's" in r["note"] and r.get("step_ms") is None for r in rows)
  assert rows[1]["temp_bytes_fwd_bwd"] > rows[0]["temp_bytes_fwd_bwd"] > 0
  assert rows[0]["memory_exponent"] is not None


def test_time_budget_skips_and_stops_the_variant(tmp_path):
  settings = tiny_settings(lengths=(16, 32), time_budget_s=1e-9)
  rows = benchmarking.run(settings)
  assert [r["status"] for r in rows] == ["skipped", "skipped"]
  assert rows[0]["note"].startswith("first call") and rows[1]["note"] == "length 16 exceeded the time budget"
  paths = benchmarking.write_outputs(rows, settings, str(tmp_path))   # outputs still written
  assert "| full | skipped | skipped |" in open(paths["markdown"]).read()
  assert [r["status"] for r in read_csv(paths["csv"])] == ["skipped", "skipped"]


def test_fit_exponent_recovers_power_laws():
  lengths = [1024, 2048, 4096]
  assert benchmarking.fit_exponent(lengths, [3 * n ** 2 for n in lengths]) == pytest.approx(2.0)
  assert benchmarking.fit_exponent(lengths, [5 * n for n in lengths]) == pytest.approx(1.0)
  assert benchmarking.fit_exponent([1024], [1.0]) is None
  assert benchmarking.fit_exponent(lengths, [None, 2.0, None]) is None


def test_attention_options_parsing():
  parsed = benchmarking.parse_attention_options(
      ["performer:nb_features=128,redraw=false", "local:block_size=64", "performer:kernel=relu"])
  assert parsed == {"performer": {"nb_features": 128, "redraw": False, "kernel": "relu"},
                    "local": {"block_size": 64}}
  assert benchmarking.parse_option_value("0.5") == 0.5
  assert benchmarking.parse_option_value("none") is None
  with pytest.raises(ValueError, match="name:key=value"):
    benchmarking.parse_attention_options(["nb_features=128"])
  with pytest.raises(ValueError, match="not key=value"):
    benchmarking.parse_attention_options(["performer:nb_features"])


def test_bad_settings_are_refused_clearly():
  with pytest.raises(ValueError, match="unknown attention 'nope'"):
    tiny_settings(attentions=("nope",))
  with pytest.raises(ValueError, match="unknown option.*blocksize"):
    tiny_settings(attention_options={"local": {"blocksize": 8}})
  with pytest.raises(ValueError, match="lengths must be positive"):
    tiny_settings(lengths=(0,))
  with pytest.raises(cli.HarnessError, match="--lengths must be integers"):
    run_main(["--lengths=1k", "--out=/nonexistent"])
  with pytest.raises(cli.HarnessError, match="unknown attention 'nope'"):
    run_main(["--attentions=full,nope", "--out=/nonexistent"])
  with pytest.raises(plugins.PluginError, match="no_such_plugin_module"):
    run_main(["--plugins=no_such_plugin_module", "--out=/nonexistent"])


def test_default_attentions_are_every_registered_variant():
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["benchmark", "--out=/nonexistent"])
  try:
    settings = benchmark.settings_from_flags()
  finally:
    flags.FLAGS.unparse_flags()
  assert settings.attentions == az.available()
  assert settings.lengths == (1024, 2048, 3072, 4096, 8192, 16384)
  assert settings.mode == "train" and settings.batch_size == benchmarking.default_batch_size()
  assert settings.options_for("local") == {"block_size": 50}     # LRA's settings by default


def test_a_plugin_variant_is_measured(tmp_path, monkeypatch):
  """--plugins imports a module outside the package (the documented example); its variant runs."""
  monkeypatch.delitem(sys.modules, "examples.cosine_attention", raising=False)
  with az.scoped_registry():   # the registration and its module are undone after
    status = run_main(["--plugins=examples.cosine_attention", "--attentions=cosine", "--mode=attention",
                       "--lengths=16", "--repeats=1", f"--out={tmp_path}", *TINY_MODEL])
  assert status == 0
  rows = read_csv(benchmarking.output_paths(str(tmp_path), "attention")["csv"])
  assert [(r["attention"], r["status"]) for r in rows] == [("full", "ok"), ("cosine", "ok")]
  assert float(rows[1]["fwd_ms"]) > 0 and float(rows[1]["speedup_vs_full"]) > 0


def test_flops_are_flagged_as_a_lower_bound_only_when_a_loop_runs_products():
  x = np.ones((4, 8, 8), np.float32)
  scan_products = lambda x: jax.lax.scan(lambda c, m: (c @ m, None), x[0], x)[0]
  scan_adds = lambda x: jax.lax.scan(lambda c, m: (c + m, None), x[0], x)[0]
  one_product = lambda x: x[0] @ x[1]
  flagged = {fn: benchmarking.compile_program(benchmarking.Program(fn, (x,)))[1]["flops_in_loops"]
             for fn in (scan_products, scan_adds, one_product)}
  assert flagged == {scan_products: True, scan_adds: False, one_product: False}
