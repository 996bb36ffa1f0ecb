"""The formal-language tasks (synthetic/formal_languages.py): vocabulary, lengths, the one scored
position, answers against an independent evaluation, the released streams, the grazzi preset and
the scaled accuracy the harness reports."""
import json

import numpy as np
import pytest

import attention_zoo as az
import synthetic
from configs import formal_languages, modular_arithmetic, parity_check
from configs.lra import listops
from experiments.common import tasks
from helpers import tiny_run_overrides
from synthetic import IGNORED

TASKS = ("parity_check", "modular_arithmetic", "modular_arithmetic_brackets")
# The read lengths (tokens up to the scored position) each split allows: the released lengths
# 3..40 and 40..256 count the answer (and with brackets a pad after it).
READ_LENGTHS = {"parity_check": ((2, 39), (39, 255)), "modular_arithmetic": ((2, 38), (38, 254)),
                "modular_arithmetic_brackets": ((3, 38), (38, 254))}
BRACKET_TEXT = {5: "+", 6: "-", 7: "*", 8: "(", 9: ")"}


def load(task, split, n, **options):
  return synthetic.load(task, split, **{f"num_{split}": n}, **options)


def answer(task: str, read: list[int]) -> int:
  """The answer token computed here, from the tokens as text (Python evaluates the
  expressions)."""
  if task == "parity_check":
    return read.count(2) % 2 + 1
  if task == "modular_arithmetic":
    text = "".join(str(t - 5) if t >= 5 else "?+-*="[t] for t in read[:-1])
    return eval(text) % 5 + 5   # the text holds digits and + - * only
  text = "".join(BRACKET_TEXT.get(t, str(t)) for t in read[:-1])
  return eval(text) % 5   # digits, brackets and + - * only


@pytest.mark.parametrize("task", TASKS)
def test_one_scored_position_with_the_right_answer_at_the_released_lengths(task):
  vocab = synthetic.task_spec(task).vocab_size
  for split, n, (shortest, longest) in (("train", 2000, READ_LENGTHS[task][0]),
                                        ("validation", 300, READ_LENGTHS[task][1])):
    ds = load(task, split, n)
    assert ds.inputs.shape == (n, 40 if split == "train" else 255)
    assert ds.inputs.max() < vocab and ds.spec.vocab_size == vocab
    asked = ds.targets != IGNORED
    assert (asked.sum(axis=1) == 1).all()
    assert (np.flatnonzero(asked) % ds.inputs.shape[1] == ds.lengths - 1).all()
    assert ds.lengths.min() == shortest and ds.lengths.max() == longest, split
    if task == "modular_arithmetic":
      assert (ds.lengths % 2 == 0).all()   # n op ... n = : an odd expression and its '='
    for row in range(n):
      read = ds.inputs[row, :ds.lengths[row]].tolist()
      assert ds.targets[row, ds.lengths[row] - 1] == answer(task, read), (split, row)
      assert not ds.inputs[row, ds.lengths[row]:].any() and ds.masks[row].sum() == len(read)
      if task == "parity_check":
        assert set(read) <= {1, 2}
      elif task == "modular_arithmetic":
        assert read[-1] == 4 and set(read[0:-1:2]) <= {5, 6, 7, 8, 9}
        assert set(read[1:-1:2]) <= {1, 2, 3}
      else:
        assert read[-1] == 10 and set(read[:-1]) <= set(range(10))


def test_the_first_sequences_are_the_released_generators():
  """Seed 42's first training sequence of each task, as the released code (commit dd420c5,
  OnlineTaskGenerate with its tasks/*.py) generates and shifts it."""
  released = {
      "parity_check": ([2, 1, 2, 1, 2, 2, 2, 2, 2, 1, 2, 1, 1, 2, 1], 2),
      "modular_arithmetic": ([9, 3, 5, 2, 5, 2, 8, 3, 7, 1, 7, 2, 7, 4], 9),
      "modular_arithmetic_brackets": ([8, 8, 3, 7, 8, 0, 9, 9, 5, 8, 8, 8, 1, 5, 6, 2, 9, 5, 6,
                                       2, 9, 5, 8, 8, 6, 0, 9, 5, 0, 9, 9, 9, 10], 2),
  }
  for task, (read, token) in released.items():
    ds = load(task, "train", 1)
    assert ds.inputs[0, :ds.lengths[0]].tolist() == read and ds.targets[0].max() == token


def test_splits_are_prefixes_of_seeded_streams():
  short, long = load("parity_check", "train", 20), load("parity_check", "train", 50)
  np.testing.assert_array_equal(short.inputs, long.inputs[:20])
  np.testing.assert_array_equal(short.targets, long.targets[:20])
  other = load("parity_check", "train", 20, seed=1)
  assert not np.array_equal(other.inputs, short.inputs)
  validation, test = load("parity_check", "validation", 20), load("parity_check", "test", 20)
  assert not np.array_equal(validation.inputs, test.inputs)


def test_bad_settings_name_what_is_wrong():
  with pytest.raises(ValueError, match="max_len=30 reads sequences of up to 31 tokens"):
    synthetic.load("parity_check", "train", max_len=30, num_train=2)
  with pytest.raises(ValueError, match="num_validation=9000 exceeds the released split of 8,192"):
    synthetic.load("modular_arithmetic", "validation", num_validation=9000)


def test_scaled_accuracy_is_zero_at_chance_and_one_when_all_right():
  parity, brackets = synthetic.TASKS["parity_check"], synthetic.TASKS["modular_arithmetic_brackets"]
  assert parity.scaled_accuracy(0.75) == 0.5 and parity.scaled_accuracy(0.5) == 0.0
  assert brackets.scaled_accuracy(0.2) == pytest.approx(0.0)
  assert brackets.scaled_accuracy(1.0) == 1.0
  assert tasks.scaled_accuracies("modular_arithmetic", test_accuracy_final=0.6) == {
      "scaled_test_accuracy_final": pytest.approx(0.5)}
  assert tasks.scaled_accuracies("mqar", test_accuracy_final=0.6) == {}
  with pytest.raises(ValueError, match="mqar defines no chance level; the tasks that do: "
                                       "parity_check, modular_arithmetic"):
    synthetic.TASKS["mqar"].scaled_accuracy(0.5)
  assert formal_languages.CHANCE == {name: synthetic.TASKS[name].chance for name in TASKS}


def test_the_grazzi_preset_holds_the_released_values():
  config = parity_check.get_config("deltanet")
  assert config.preset == "grazzi" and config.model.vocab_size == config.model.num_classes == 3
  assert (config.model.num_layers, config.model.emb_dim, config.model.num_heads) == (2, 128, 4)
  assert (config.batch_size, config.num_train_steps, config.schedule.warmup_steps) == (
      256, 20_000, 2_000)
  assert config.schedule.base_learning_rate == 1e-3 and config.optimizer.weight_decay == 0.0
  assert (config.data.num_validation, config.data.num_test, config.model.max_len) == (
      8_192, 8_192, 255)
  arithmetic = modular_arithmetic.get_config("mamba,grazzi")
  assert (arithmetic.num_train_steps, arithmetic.optimizer.weight_decay) == (100_000, 0.1)
  assert modular_arithmetic.VALUES.attention_settings["mamba"][
      "model.attention_options.conv_size"] == 1
  with pytest.raises(ValueError, match="^parity_check has no preset 'tiny'; its presets: grazzi$"):
    parity_check.get_config("deltanet,tiny")
  with pytest.raises(ValueError, match="^listops has no preset 'grazzi'; its presets: paper, "
                                       "fair, tiny, light, light_fair$"):
    listops.get_config("full,grazzi")
  for variant, _ in formal_languages.ROWS.values():
    assert az.spec(variant).supports_causal, variant


@pytest.mark.slow
def test_a_run_checkpoints_resumes_and_reports_scaled_accuracy(tmp_path, monkeypatch):
  from experiments.common import task_configs
  from experiments.common.errors import Interrupted
  from experiments.train import data as data_lib
  from experiments.train import trainer

  overrides = [*tiny_run_overrides(examples=(32, 8, 8), steps=3), "checkpoint_every=1",
               "model.attention_options.allow_neg_eigval=True"]
  config = task_configs.task_config("parity_check", "deltanet", "grazzi", 0, overrides)
  real = data_lib.train_batches

  def stop_before_step_3(ds, batch_size, *, seed, start_step):
    for step, batch in enumerate(real(ds, batch_size, seed=seed, start_step=start_step),
                                 start=start_step + 1):
      if step == 3:
        raise KeyboardInterrupt
      yield batch

  monkeypatch.setattr(data_lib, "train_batches", stop_before_step_3)
  with pytest.raises(Interrupted, match="interrupted at step 2 of 3; the last checkpoint is "
                                        "step 2"):
    trainer.Trainer(config, tmp_path).run()
  monkeypatch.setattr(data_lib, "train_batches", real)
  results = trainer.Trainer(config, tmp_path).run()
  assert results["steps"] == 3
  assert results["scaled_test_accuracy_final"] == pytest.approx(
      (results["test_accuracy_final"] - 0.5) / 0.5)
  written = json.loads((tmp_path / "results.json").read_text())
  assert written["scaled_test_accuracy_best_validation"] == pytest.approx(
      (written["test_accuracy_best_validation"] - 0.5) / 0.5)
  assert written["data"]["generator"]["generator"] == "synthetic.formal_languages"
