"""The light preset (the Nyströmformer paper's LRA protocol, VALUES.light in
configs/lra/listops.py) against the values its released code ran, written out here from the
code (mlpen/Nystromformer, LRA/code); light_fair against it; the models it builds; its
evaluation switches; a run through the harness."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lra
from attention_zoo.models import num_params
from experiments import report, reproduce
from experiments.common.errors import HarnessError
from experiments.common.task_configs import task_config
from experiments.train import build, optimizer, trainer
from experiments.train import data as data_lib

# What the released ListOps run used, by our field names (the spec of the light preset).
RELEASED = {
    "model.vocab_size": 32, "model.max_len": 2048, "model.num_layers": 2, "model.emb_dim": 64,
    "model.qkv_dim": 64, "model.num_heads": 2, "model.mlp_dim": 128, "model.num_classes": 10,
    "model.dropout_rate": 0.1, "model.positions": "learned", "model.embed_init_std": 0.02,
    "model.pooling": "padded_mean", "model.pre_ln": True, "model.gelu_approximate": False,
    "model.layer_norm_epsilon": 1e-5, "model.dtype": "float32",
    "batch_size": 32, "eval_batch_size": 32, "grad_accum_steps": 1, "num_train_steps": 5000,
    "eval_every": 50, "eval_batches": 62, "eval_stream": True, "test_drop_last": True,
    "optimizer.name": "adamw", "optimizer.b2": 0.999, "optimizer.eps": 1e-6,
    "optimizer.weight_decay": 0.0, "optimizer.grad_clip_norm": 0.0,
    "schedule.factors": "constant * one_cycle", "schedule.base_learning_rate": 1e-4,
    "schedule.warmup_steps": 1000, "schedule.steps_per_cycle": 5000, "schedule.div_factor": 25.0,
    "schedule.final_div_factor": 1e4, "schedule.cycle_b1": True, "schedule.min_b1": 0.85,
    "schedule.max_b1": 0.95, "data.closing_brackets": False,
}
RELEASED_ATTENTION = {
    "full": ({}, 0.1),   # (options, attention dropout the model applies)
    "reformer": ({"n_hashes": 2, "chunk_len": 64, "n_buckets": 64, "scale": 1.0,
                  "dropout_rate": 0.0, "eval_rotations": "fresh",
                  "duplicate_correction": False}, 0.1),
    "linformer": ({"k": 256, "share": "kv_per_head", "init_std": 0.02, "dropout_rate": 0.0}, 0.1),
    "performer": ({"kernel": "softmax", "features": "random", "nb_features": 256,
                   "redraw": False, "scale": 1 / 32, "padded_keys": "zeroed",
                   "stabiliser": "performer_pytorch"}, 0.0),
    "nystromformer": ({"num_landmarks": 64, "conv_kernel_size": 35, "pinv_iterations": 6,
                       "landmarks": "padded_segments", "pinv_init": "batch_global",
                       "dropout_rate": 0.0}, 0.1),
}
# light_fair: what changes, for every variant and for each.
FIXED = {"model.pooling": "mean", "data.closing_brackets": True, "eval_batches": 0,
         "eval_stream": False, "test_drop_last": False, "schedule.cycle_b1": False}
FIXED_ATTENTION = {
    "full": {},
    "reformer": {"eval_rotations": "fixed", "duplicate_correction": True, "dropout_rate": 0.1},
    "linformer": {"dropout_rate": 0.1},
    "performer": {"scale": None, "padded_keys": "removed", "stabiliser": "per_feature"},
    "nystromformer": {"landmarks": "real_tokens", "pinv_init": "per_matrix", "dropout_rate": 0.1},
}


def resolved(variant, preset="light", *overrides):
  return build.check(task_config("listops", variant, preset, overrides=list(overrides)))[0]


def flat(config) -> dict:
  """RELEASED's fields as the run uses them (a 0 that follows another field read as it)."""
  used = {"eval_batch_size": data_lib.eval_batch_size(config),
          "schedule.steps_per_cycle": optimizer.steps_per_cycle(config)}
  return {field: used[field] if field in used else
          config[field.split(".")[0]][field.split(".")[1]] if "." in field
          else config[field] for field in RELEASED}


@pytest.mark.parametrize("variant", RELEASED_ATTENTION)
def test_light_resolves_to_the_released_values(variant):
  config = resolved(variant)
  assert flat(config) == RELEASED
  options, attention_dropout = RELEASED_ATTENTION[variant]
  # the options as the model receives them (a scale given by formula made a number)
  assert dict(build.model_config(config).attention_options) == pytest.approx(options)
  assert config.model.attention_dropout_rate == attention_dropout
  assert config.model.share_attention_across_layers == (variant == "linformer")
  assert config.data_dir == "data/lra" and config.seed == 0


@pytest.mark.parametrize("variant", RELEASED_ATTENTION)
def test_light_fair_changes_exactly_the_quirks(variant):
  light, fair = resolved(variant), resolved(variant, "light_fair")
  changed = {field for field in RELEASED if flat(light)[field] != flat(fair)[field]}
  assert changed == set(FIXED) and all(flat(fair)[f] == v for f, v in FIXED.items())
  options = dict(light.model.attention_options)
  assert dict(fair.model.attention_options) == {**options, **FIXED_ATTENTION[variant]}


def test_light_is_listops_only():
  with pytest.raises(HarnessError, match="text has no preset 'light'; its presets: paper, fair, "
                                         "tiny$"):
    task_config("text", "full", "light")


@pytest.mark.parametrize("variant, count", [("full", 209_802), ("nystromformer", 209_942),
                                            ("linformer", 1_258_378), ("performer", 209_802)])
def test_parameter_counts_are_the_released_models(variant, count):
  """The released models' counts, from their code: 131,072 positions, 2,048 tokens, 2 blocks of
  33,472, a final LayerNorm of 128, the head's 9,610; Nyström adds 2 convolutions of 2 x 35,
  Linformer one E of 2 x 256 x 2048 shared by both layers; Performer's projection is no
  parameter. (Reformer: 8,320 fewer here, the key projection the released code built unused.)"""
  config = resolved(variant)
  abstract = nnx.eval_shape(lambda: build.model(config, nnx.Rngs(0))[0])
  assert num_params(abstract) == count


def test_the_light_model_pools_over_the_padded_length_with_the_released_head_and_inits():
  """Sum of the real positions' final LayerNorm outputs / the padded length; the 64 -> 128 ->
  10 ReLU head; token and position embeddings N(0, 0.02²); exact GELU; LayerNorm eps 1e-5."""
  model, _ = build.model(resolved("full", "light", "model.max_len=48"), nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 16, (2, 48)), jnp.int32)
  mask = jnp.arange(48)[None] < jnp.array([[48], [12]])
  hidden, _ = model.encoder(tokens, mask)
  expected = (hidden * mask[..., None]).sum(1) / 48
  np.testing.assert_allclose(model.encode(tokens, mask), expected, rtol=1e-6, atol=1e-7)
  assert model.head.hidden.kernel.shape == (64, 128) and model.head.out.kernel.shape == (128, 10)
  logits = model(tokens, mask)
  np.testing.assert_allclose(
      logits, model.head.out(jax.nn.relu(model.head.hidden(expected))), rtol=1e-5, atol=1e-6)
  full, _ = build.model(resolved("full"), nnx.Rngs(0))
  positions = np.asarray(full.encoder.learned_positions.table[...])
  assert positions.shape == (2048, 64) and positions.std() == pytest.approx(0.02, rel=0.02)
  tokens_table = np.asarray(full.encoder.embed.embedding[...])
  assert tokens_table.shape == (32, 64) and tokens_table.std() == pytest.approx(0.02, rel=0.1)
  block = full.encoder.blocks[0]
  assert block.mlp.approximate_gelu is False and block.self_norm.epsilon == 1e-5
  assert full.encoder.final_norm.epsilon == 1e-5


def test_linformer_shares_one_e_between_its_layers():
  model, _ = build.model(resolved("linformer"), nnx.Rngs(0))
  first, second = (block.self_attention.attention for block in model.encoder.blocks)
  assert first.key_projection is second.key_projection and first.value_projection is None
  assert first.key_projection.shape == (2, 2048, 256)


# -- evaluation switches -----------------------------------------------------------------------

def tiny_dataset(n):
  """Example i holds the token i (n <= 16, ListOps ids), so a batch names its examples."""
  return lra.Dataset(spec=lra.task_spec("listops"), split="validation",
                     tokens=np.arange(n, dtype=np.uint8)[:, None].repeat(4, 1),
                     lengths=np.full(n, 4, np.int32), targets=np.arange(n, dtype=np.int32) % 10)


def settings(**fields):
  config = resolved("full", "light").copy_and_resolve_references()
  config.update({"eval_batch_size": 4, **fields})
  return config


def examples(batches):
  """The examples the batches count (weight 1), in order."""
  return [int(row) for batch in batches
          for row, w in zip(batch["inputs"][:, 0], batch["weights"]) if w]


def test_each_evaluation_reads_the_next_window_of_a_reshuffled_stream():
  """eval_stream: evaluation k is stream batches [3k, 3k + 3) of reshuffled passes over the 10
  examples (so windows differ and may repeat an example); without it, the first 3 batches;
  eval_batches 0: every example once."""
  ds = tiny_dataset(10)
  batches = lra.iterate(ds, 4, shuffle=True, seed=0)
  stream = [int(x) for _ in range(9) for x in next(batches)["inputs"][:, 0]]
  config = settings(eval_batches=3)
  windows = [examples(data_lib.validation_batches(ds, config, k)) for k in range(3)]
  assert windows == [stream[12 * k:12 * (k + 1)] for k in range(3)]
  assert windows[0] != windows[1] and len(set(windows[0])) < 12
  fixed = settings(eval_batches=3, eval_stream=False)
  assert examples(data_lib.validation_batches(ds, fixed, 5)) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
  whole = settings(eval_batches=0)
  assert sorted(examples(data_lib.validation_batches(ds, whole, 5))) == list(range(10))


def test_drop_last_tests_the_full_batches_of_a_shuffled_pass():
  """10 examples in batches of 4: 8 tested, in the seed's order; the 2 left out differ by seed;
  without drop_last all 10, each once."""
  ds = tiny_dataset(10)
  tested = [examples(data_lib.test_batches(ds, settings(seed=seed))) for seed in (0, 1)]
  assert [len(t) for t in tested] == [8, 8] and set(tested[0]) != set(tested[1])
  order = lra.batching.epoch_order(10, 0, shuffle=True, seed=0)
  assert tested[0] == order[:8].tolist()
  every = examples(data_lib.test_batches(ds, settings(test_drop_last=False)))
  assert sorted(every) == list(range(10))
  with pytest.raises(HarnessError, match="eval_batches must be >= 0"):
    trainer.check_config(settings(eval_batches=-1))


# -- through the harness --------------------------------------------------------------------------

@pytest.mark.slow
def test_two_light_steps_of_every_published_row_through_reproduce(tmp_path):
  """reproduce --preset=light over tiny generated ListOps (closing brackets dropped, 2 steps,
  the released schedule's first two rates): each variant trains, evaluates a 2-batch window per
  evaluation, tests the full batches only, and the report sets it beside the Nyströmformer
  paper's number."""
  lra.generate_listops(tmp_path / "data", num_train=40, num_val=20, num_test=21, seed=0,
                       progress=False, min_length=4, max_length=60)
  overrides = [f"data_dir={tmp_path / 'data'}", "model.max_len=128", "batch_size=4",
               "eval_batches=2", "num_train_steps=2", "eval_every=1", "log_every=1",
               "schedule.steps_per_cycle=5000"]
  variants = list(RELEASED_ATTENTION)
  failures = reproduce.run_grid(preset="light", tasks=["listops"], attentions=variants,
                                seeds=[0], out=tmp_path / "out", overrides=overrides)
  assert not failures
  runs = {run["attention"]: run for run in report.read_runs(tmp_path / "out" / "runs")}
  assert set(runs) == set(variants)
  for run in runs.values():
    assert run["preset"] == "light" and run["steps"] == 2
    assert run["test_examples"] == 20 and run["num_examples"]["test"] == 21
    assert run["config"]["data"] == {"closing_brackets": False}
  table = report.write_report(tmp_path / "out" / "runs", tmp_path / "out")
  assert "(37.10, " in table and "(37.15, " in table and "(18.80, " in table


def test_the_light_csv_sets_the_authors_tested_model_beside_their_number(tmp_path):
  """light_listops.csv: per variant the best-validation model's test accuracy over its seeds
  (the model the Nyströmformer paper's authors tested) beside their number and its source; the
  final model's numbers and other presets stay out of it."""
  def result(attention, seed, best, final, preset="light", device="1 x cpu (cpu)"):
    return {"task": "listops", "attention": attention, "preset": preset, "seed": seed,
            "test_accuracy_best_validation": best, "test_accuracy_final": final,
            "majority_accuracy": 0.173, "workdir": str(tmp_path),
            "environment": {"git_commit": "f7054afe91b2", "device": device,
                            "versions": {"jax": "0.10.2"}, "date": "2026-12-05T07:44:19+00:00"}}
  runs = [result("full", 0, 0.36, 0.10), result("full", 1, 0.38, 0.10),
          result("performer", 0, 0.35, 0.10, device="1 x NVIDIA H200 (gpu)"),
          result("full", 0, 0.99, 0.99, preset="tiny")]
  (path,) = report.write_published_csvs(report.summarize(runs), tmp_path)
  assert path.name == "light_listops.csv"
  source = report.PUBLISHED_SOURCE
  assert path.read_text().splitlines() == [
      "variant,seeds,test_mean,test_std,published,source,device,commit,jax,date",
      f"full,2,37.00,1.41,37.10,{source},1 x cpu (cpu),f7054af,0.10.2,2026-12-05",
      f"performer,1,35.00,,18.80,{source},1 x NVIDIA H200 (gpu),f7054af,0.10.2,2026-12-05"]
