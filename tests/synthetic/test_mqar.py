"""The associative-recall generator (synthetic.mqar) and the token-level objective that trains on
it."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import lra
import synthetic
from attention_zoo.models import DecoderLM, TransformerConfig
from experiments.train import steps
from helpers import tiny_run_overrides
from synthetic import IGNORED

SMALL = dict(vocab_size=64, num_pairs=4, min_gap=6, num_train=200, num_validation=20,
             num_test=20)


def load(split="train", max_len=32, **options):
  return synthetic.load("mqar", split, max_len=max_len, **{**SMALL, **options})


def test_pairs_then_queries_with_values_only_as_targets():
  ds = load()
  tokens, targets = ds.inputs, ds.targets
  pairs, half = SMALL["num_pairs"], SMALL["vocab_size"] // 2
  keys, values = tokens[:, 0:2 * pairs:2], tokens[:, 1:2 * pairs:2]
  assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < 64)).all()
  assert all(len(set(row)) == pairs for row in keys)           # distinct keys per sequence
  asked = targets != IGNORED
  assert (asked.sum(1) == pairs).all()                          # every key queried once
  assert not asked[:, :2 * pairs + SMALL["min_gap"]].any()      # queries only after the gap
  for row in range(len(ds)):
    pair_of = dict(zip(keys[row], values[row]))
    for position in np.flatnonzero(asked[row]):
      assert targets[row, position] == pair_of[tokens[row, position]]   # the key's value
  # No answer leaks into the inputs: after the pairs there are only keys and filler 0.
  assert (tokens[:, 2 * pairs:] < half).all()
  assert ds.masks.all() and ds.spec.objective == "next_token"


def test_deterministic_per_seed_and_split():
  a, b = load(), load()
  np.testing.assert_array_equal(a.inputs, b.inputs)
  np.testing.assert_array_equal(a.targets, b.targets)
  assert not np.array_equal(load("test").inputs, load("validation").inputs)
  assert not np.array_equal(load(seed=1).inputs, a.inputs)
  assert (len(load("train")), len(load("validation")), len(load("test"))) == (200, 20, 20)


def test_power_law_puts_queries_soon_after_the_pairs():
  first = 2 * SMALL["num_pairs"] + SMALL["min_gap"]
  mean_offset = lambda ds: np.mean(np.nonzero(ds.targets != IGNORED)[1]) - first
  uniform, skewed = load(max_len=128), load(max_len=128, power_a=0.01)
  assert mean_offset(skewed) < 0.5 * mean_offset(uniform)


def test_bad_settings_name_what_is_wrong():
  with pytest.raises(ValueError, match="fewer than the 4 queries; use a longer max_len"):
    load(max_len=12)
  with pytest.raises(ValueError, match="unknown option.*pairs.*num_pairs"):
    synthetic.load("mqar", "train", pairs=3)
  with pytest.raises(ValueError, match="num_queries must be in \\[1, num_pairs=4\\]"):
    load(num_queries=5)
  with pytest.raises(ValueError, match="key ids .* fewer than num_pairs"):
    load(vocab_size=8)
  with pytest.raises(ValueError, match="unknown synthetic task 'listops'; synthetic tasks: .*mqar"):
    synthetic.load("listops", "train", num_pairs=3)
  with pytest.raises(ValueError, match="unknown LRA task 'mqar'.*load with synthetic.load"):
    lra.load("mqar", "train")
  provenance = synthetic.provenance("mqar", max_len=32, **SMALL)
  assert provenance["kind"] == "generated"
  assert provenance["generator"]["parameters"]["num_pairs"] == 4


def test_the_loss_counts_only_the_asked_positions():
  """steps.score against a hand computation over the target positions."""
  logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
  targets = jnp.array([[-1, 3, -1, -1, 6], [-1, -1, -1, 0, -1]])
  model = lambda inputs, masks, deterministic: logits
  batch = {"inputs": jnp.zeros((2, 5), jnp.int32), "masks": jnp.ones((2, 5), bool),
           "targets": targets, "weights": jnp.array([1.0, 0.0])}   # row 1 is filler
  losses, correct, weights = steps.score(model, batch, deterministic=True)
  log_p = jax.nn.log_softmax(logits)
  expected = -(log_p[0, 1, 3] + log_p[0, 4, 6])
  assert float(losses.sum()) == pytest.approx(float(expected), rel=1e-6)
  assert float(weights.sum()) == 2.0
  hits = int(jnp.argmax(logits[0, 1]) == 3) + int(jnp.argmax(logits[0, 4]) == 6)
  assert float(correct.sum()) == hits


def test_one_decoder_step_on_fake_data_lowers_the_loss():
  ds = load(max_len=32)
  batch = {k: jnp.asarray(v) for k, v in ds.batch(np.arange(16)).items()}
  config = TransformerConfig(vocab_size=64, max_len=32, num_layers=1, emb_dim=32, num_heads=2,
                             mlp_dim=64, dropout_rate=0.0, positions="rope")
  model = DecoderLM(config, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit   # compiled: op by op, the two evaluations cost more than the steps
  def mean_loss(model):
    losses, _, weights = steps.score(model, batch, deterministic=True)
    return losses.sum() / weights.sum()

  @nnx.jit   # one compiled step, not five op-by-op ones
  def step(model, optimizer):
    grads = nnx.grad(mean_loss)(model)
    optimizer.update(model, grads)

  before = float(mean_loss(model))
  for _ in range(5):
    step(model, optimizer)
  assert float(mean_loss(model)) < before


@pytest.mark.slow
def test_mqar_runs_through_the_harness_and_non_causal_variants_are_not_applicable(tmp_path):
  from experiments import report, reproduce

  overrides = tiny_run_overrides(examples=(64, 16, 16))
  failures = reproduce.run_grid(preset="tiny", tasks=["mqar"], attentions=["full", "linformer"],
                                seeds=[0], out=tmp_path, overrides=overrides)
  assert failures == []
  runs = {r["attention"]: r for r in report.read_runs(tmp_path / "runs")}
  full = runs["full"]
  assert full["model"]["attention"] == "full" and full["data"]["kind"] == "generated"
  assert 0 <= full["test_accuracy_final"] <= 1 and full["num_examples"]["test"] == 16
  assert full["majority_accuracy"] < 0.2   # over the asked values, not the filler
  assert "cannot be causal" in runs["linformer"]["not_applicable"]
  text = report.write_report(tmp_path / "runs", tmp_path)
  assert "### Diagnostics, preset `tiny`, final step" in text
  assert "| linformer | n/a |" in text
  assert "n/a: linformer on mqar: linformer cannot be causal" in text
  assert "LRA Table 1" not in text


@pytest.mark.slow
def one_step_sweep(out, field, values, attentions, width=16):
  """A sweep of one-step MQAR tiny runs over `field`: (table, states) as sweep.collect gives."""
  from experiments import sweep
  failures = sweep.run(task="mqar", preset="tiny", field=field, values=values,
                       attentions=attentions, seeds=[0], out=out,
                       overrides=tiny_run_overrides(steps=1, width=width))
  assert failures == []
  return sweep.collect(out, field, values)


def test_sweep_over_the_number_of_pairs_writes_the_capacity_table(tmp_path):
  from experiments import sweep

  values = ["2", "4"]
  table, states = one_step_sweep(tmp_path, "data.num_pairs", values, ["full", "linformer"])
  assert set(table["full"]) == set(values) and all(0 <= v <= 100 for v in table["full"].values())
  assert table["linformer"]["2"].startswith("n/a: linformer cannot be causal")
  text = sweep.write(table, states, tmp_path, "data.num_pairs", values, "mqar")
  assert "| variant | data.num_pairs=2 | data.num_pairs=4 |" in text
  assert (tmp_path / "sweep.png").stat().st_size > 1000 and (tmp_path / "sweep.csv").exists()


@pytest.mark.slow
def test_frontier_sweep_over_width_reports_each_runs_state_size(tmp_path):
  from experiments import sweep

  values = ["16", "32"]
  table, states = one_step_sweep(tmp_path, "model.emb_dim", values, ["full", "gated_deltanet"],
                                 width=None)
  # full keeps keys and values of all 64 positions: 2 · 64 · emb_dim floats per layer
  assert states["full"] == {"16": 2 * 64 * 16, "32": 2 * 64 * 32}
  # a recurrent state grows with the head dimensions, not with the length
  assert 0 < states["gated_deltanet"]["16"] < states["gated_deltanet"]["32"]
  text = sweep.write(table, states, tmp_path, "model.emb_dim", values, "mqar", x="state_size")
  assert f"({2 * 64 * 32:,})" in text and "recurrent state floats per layer" in text
  assert (tmp_path / "sweep.png").stat().st_size > 1000
