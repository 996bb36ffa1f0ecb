"""The six MAD generators (synthetic.mad), each checked for its defining property on its own output
by an independent walk over the sequence, the bottleneck model of compression, the configs and
the MAD table."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import synthetic
from attention_zoo.models import BottleneckLM, TransformerConfig
from helpers import tiny_run_overrides
from synthetic import IGNORED, mad

SIZES = dict(num_train=40, num_validation=8, num_test=40)


def load(task, split="test", max_len=32, **options):
  return synthetic.load(task, split, max_len=max_len, **{**SIZES, **options})


def asked(targets):
  return targets != IGNORED


@pytest.mark.parametrize("task", ["in_context_recall", "noisy_in_context_recall"])
def test_recall_asks_exactly_the_values_of_keys_seen_before(task):
  ds = load(task)
  settings = synthetic.TASKS[task].settings()
  num_keys = settings.num_keys
  noise_from = settings.vocab_size - settings.noise_vocab_size
  for tokens, targets in zip(ds.inputs, ds.targets):
    value_of, expected = {}, np.full(len(tokens), IGNORED)
    for position in range(0, len(tokens), 2):
      key, value = tokens[position], tokens[position + 1]
      if key >= noise_from:                       # a noise slot: two noise tokens, not a pair
        assert value >= noise_from
        continue
      assert key < num_keys and num_keys <= value < 2 * num_keys
      if key in value_of:
        assert value_of[key] == value            # a key keeps its value
        expected[position] = value               # emitted at the key, before the value
      value_of[key] = value
    np.testing.assert_array_equal(targets, expected)
    assert expected[-2] != IGNORED                # the last pair is always a recall
  train = load(task, "train")
  np.testing.assert_array_equal(train.targets[:, :-1], train.inputs[:, 1:])   # every next token


def test_noisy_recall_replaces_about_a_fifth_of_the_pairs_with_noise():
  ds = load("noisy_in_context_recall", max_len=128, num_test=200)
  noise_slots = ds.inputs[:, 0::2] >= 16
  assert (noise_slots == (ds.inputs[:, 1::2] >= 16)).all()
  assert 0.15 < noise_slots[:, :-1].mean() < 0.25            # frac_noise = 0.2
  assert not (asked(ds.targets[:, 0::2]) & noise_slots).any()


def test_fuzzy_recall_keys_and_values_are_runs_of_their_own_ids():
  settings = mad.FuzzyInContextRecall()
  pad, num_keys = settings.vocab_size - 1, settings.num_keys
  for split in ("train", "test"):
    ds = load("fuzzy_in_context_recall", split, max_len=64)
    key_sizes = set()
    for tokens, targets in zip(ds.inputs, ds.targets):
      tokens = list(tokens)
      start = len(tokens) - tokens[::-1].index(pad) if pad in tokens else 0
      assert set(tokens[:start]) <= {pad}          # padding only in front
      runs, position = [], start                   # (is_key, first, tokens) of maximal runs
      while position < len(tokens):
        is_key = tokens[position] < num_keys
        end = position
        while end < len(tokens) and (tokens[end] < num_keys) == is_key:
          end += 1
        runs.append((is_key, position, tuple(tokens[position:end])))
        position = end
      assert [r[0] for r in runs] == [True, False] * (len(runs) // 2)
      value_of, expected = {}, np.full(len(tokens), IGNORED)
      for (_, _, key), (_, first, value) in zip(runs[0::2], runs[1::2]):
        assert 1 <= len(value) <= settings.v_motif_size and len(set(value)) == len(value)
        key_sizes.add(len(key))
        if key in value_of:
          assert value_of[key] == value
          expected[first - 1:first - 1 + len(value)] = value   # each value token, one early
        value_of[key] = value
      if split == "test":
        np.testing.assert_array_equal(targets, expected)
    # Training keys have every length 1..k (so pairs run together); test keys have k tokens.
    assert key_sizes == ({1, 2, 3} if split == "train" else {3})


def test_selective_copying_targets_are_the_non_blank_tokens_in_order():
  ds = load("selective_copying", max_len=40, num_tokens_to_copy=6)
  blank, copy = 14, 15
  for tokens, targets in zip(ds.inputs, ds.targets):
    at = list(tokens).index(copy)
    assert at == 40 - 6 - 1 and (tokens[at + 1:] == blank).all()
    data = [t for t in tokens[:at] if t != blank]
    assert len(data) == 6
    assert list(targets[at + 1:]) == data and not asked(targets[:at + 1]).any()


def test_compression_asks_every_token_before_the_compression_token():
  ds = load("compression", max_len=16)
  assert (ds.inputs[:, -1] == 15).all() and (ds.inputs[:, :-1] < 15).all()
  np.testing.assert_array_equal(ds.targets[:, :-1], ds.inputs[:, :-1])
  assert (ds.targets[:, -1] == IGNORED).all()
  assert ds.spec.readout == "last_position"


def test_memorization_map_is_one_fixed_bijection_in_every_split_and_seed():
  mapping = {}
  for split, seed in (("train", 0), ("test", 0), ("test", 3)):
    ds = load("memorization", split, max_len=16, vocab_size=32, seed=seed)
    assert (ds.inputs[:, 1::2] == 31).all() and not asked(ds.targets[:, 0::2]).any()
    for key, value in zip(ds.inputs[:, 0::2].ravel(), ds.targets[:, 1::2].ravel()):
      assert mapping.setdefault(key, value) == value
  keys, values = zip(*mapping.items())
  assert max(keys) < 15 and min(values) >= 15 and len(set(values)) == len(values)
  other = load("memorization", max_len=16, vocab_size=32, map_seed=1)
  assert any(mapping[k] != v for k, v in zip(other.inputs[:, 0], other.targets[:, 1]))


@pytest.mark.parametrize("task", synthetic.family_tasks("mad"))
def test_deterministic_per_seed_and_split(task):
  options = {"num_tokens_to_copy": 4} if task == "selective_copying" else {}
  load = lambda *args, **more: globals()["load"](task, *args, **options, **more)   # noqa: E731
  a, b = load(), load()
  np.testing.assert_array_equal(a.inputs, b.inputs)
  np.testing.assert_array_equal(a.targets, b.targets)
  assert not np.array_equal(load("validation").inputs, a.inputs[:8])
  assert not np.array_equal(load(seed=1).inputs, a.inputs)
  assert a.spec.objective == "next_token" and asked(a.targets).any(axis=1).all()


def test_bad_settings_name_what_is_wrong():
  with pytest.raises(ValueError, match="selective_copying: unknown option.*num_pairs.*"
                                       "num_tokens_to_copy"):
    synthetic.load("selective_copying", "train", num_pairs=3)
  with pytest.raises(ValueError, match="max_len=20 must exceed 2 \\* num_tokens_to_copy \\+ 1"):
    load("selective_copying", max_len=20, num_tokens_to_copy=10)
  with pytest.raises(ValueError, match="max_len must be even"):
    load("in_context_recall", max_len=31)
  with pytest.raises(ValueError, match="frac_noise must be in \\[0, 1\\)"):
    load("noisy_in_context_recall", frac_noise=1.5)
  with pytest.raises(ValueError, match="num_train must be an integer >= 1"):
    synthetic.load("compression", "train", num_train=0)


def test_bottleneck_reads_every_position_from_the_last_real_one():
  """BottleneckLM against a float64 numpy readout of the decoder's hidden state."""
  config = TransformerConfig(vocab_size=16, max_len=8, num_layers=1, emb_dim=16, num_heads=2,
                             mlp_dim=32, dropout_rate=0.0, positions="rope")
  model = BottleneckLM(config, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 16)
  mask = jnp.arange(8)[None] < jnp.array([[8], [5]])
  hidden, _ = model.decoder(tokens, mask)
  h = np.asarray(hidden, np.float64)[[0, 1], [7, 4]]                  # the last real positions

  def layer_norm(x, norm):
    x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
    return x * np.asarray(norm.scale[...]) + np.asarray(norm.bias[...])

  def linear(x, layer):
    return x @ np.asarray(layer.kernel[...], np.float64) + np.asarray(layer.bias[...])

  angles = np.arange(8)[:, None] / 10000.0 ** (np.arange(0, 16, 2) / 16)
  sinusoid = np.stack([np.sin(angles), np.cos(angles)], -1).reshape(8, 16)
  x = h[:, None] + sinusoid
  for norm, layer in zip(model.norms[:2], model.hidden):
    y = linear(layer_norm(x, norm), layer)
    x = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))   # gelu (tanh)
  expected = linear(layer_norm(x, model.norms[2]), model.lm_head)
  np.testing.assert_allclose(np.asarray(model(tokens, mask)), expected, rtol=2e-4, atol=2e-4)


def test_configs_build_for_both_presets_and_refuse_fair():
  from experiments.common import task_configs
  from experiments.train import build

  for task in synthetic.family_tasks("mad"):
    for preset in ("tiny", "paper"):
      config = task_configs.task_module(task).get_config(f"linear_transformer,{preset}")
      ds = synthetic.load(task, "validation", max_len=config.model.max_len,
                    **{**config.data, "num_validation": 2})
      assert config.model.vocab_size == ds.spec.vocab_size
      model_config = build.model_config(config)
      assert model_config.attention == "linear_transformer"
      expected = BottleneckLM if task == "compression" else build.DecoderLM
      assert build.model_class(task) is expected
  with pytest.raises(ValueError, match="has no preset 'fair'; its presets: paper, tiny$"):
    task_configs.task_module("compression").get_config("full,fair")


def test_mad_group_expands_and_unknown_tasks_list_the_names():
  from experiments import reproduce
  from experiments.common.errors import HarnessError

  mad_tasks = synthetic.family_tasks("mad")
  assert reproduce.expand_tasks(["mqar", "mad", "compression"]) == ["mqar", *mad_tasks]
  with pytest.raises(HarnessError, match="unknown task 'copying'; tasks: .*selective_copying"
                                             ".*groups: mad \\(compression, "):
    reproduce.check_names(["copying"], ["full"])


def test_the_mad_table_has_a_column_per_task_an_average_and_n_a_rows():
  from experiments import report

  runs = []
  for task, base in zip(synthetic.family_tasks("mad"), (10, 20, 30, 40, 50, 60)):
    for seed, shift in ((0, 0.0), (1, 0.02)):
      runs.append({"task": task, "attention": "full", "preset": "tiny", "seed": seed,
                   "test_accuracy_final": base / 100 + shift,
                   "test_accuracy_best_validation": base / 100, "majority_accuracy": 0.125})
    runs.append({"task": task, "attention": "linformer", "preset": "tiny", "seed": 0,
                 "not_applicable": "linformer cannot be causal: why"})
  text = report.markdown(report.summarize(runs))
  assert "### MAD, preset `tiny`, final step" in text and "Diagnostics" not in text
  assert ("| Model | " + " | ".join(synthetic.family_tasks("mad")) + " | Avg |") in text
  # Seeds 0 and 1: mean base + 1, std of (base, base + 2) = sqrt(2); the average of the means.
  assert "| full | 11.00 ± 1.41 | 21.00 ± 1.41 |" in text and "| 61.00 ± 1.41 | 36.00 |" in text
  assert "| linformer | " + " | ".join(["n/a"] * 7) + " |" in text
  assert "n/a: linformer on compression: linformer cannot be causal: why" in text


@pytest.mark.slow
def test_every_mad_task_trains_through_the_harness_and_reports(tmp_path):
  from experiments import report, reproduce

  overrides = tiny_run_overrides()
  failures = reproduce.run_grid(preset="tiny", tasks=["mad"], attentions=["full", "linformer"],
                                seeds=[0], out=tmp_path, overrides=overrides)
  assert failures == []
  runs = report.read_runs(tmp_path / "runs")
  trained = {r["task"]: r for r in runs if r["attention"] == "full"}
  assert set(trained) == set(synthetic.family_tasks("mad"))
  for task, run in trained.items():
    assert 0 <= run["test_accuracy_final"] <= 1 and run["steps"] == 2
    assert run["data"]["generator"]["generator"] == "synthetic.mad"
  assert trained["compression"]["model"]["max_len"] == 32
  text = report.write_report(tmp_path / "runs", tmp_path)
  assert "### MAD, preset `tiny`, final step" in text and "| linformer | n/a |" in text
  assert (tmp_path / "mad_tiny.png").stat().st_size > 1000


@pytest.mark.parametrize("task, max_len, options", [
    ("in_context_recall", 16, {}), ("noisy_in_context_recall", 16, {}),
    ("fuzzy_in_context_recall", 24, {}), ("selective_copying", 16, {"num_tokens_to_copy": 4}),
    ("compression", 8, {}), ("memorization", 12, {"vocab_size": 16})])
def test_the_worked_examples_in_the_docs_are_the_generators_output(task, max_len, options):
  from pathlib import Path

  docs = (Path(__file__).resolve().parents[2] / "docs" / "mad.md").read_text(encoding="utf-8")
  ds = synthetic.load(task, "test", max_len=max_len, num_train=2, num_validation=2, num_test=2,
                **options)
  assert "tokens : " + " ".join(f"{t:>2}" for t in ds.inputs[0]) in docs
  assert "targets: " + " ".join(" ." if t < 0 else f"{t:>2}" for t in ds.targets[0]) in docs
