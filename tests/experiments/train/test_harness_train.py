"""The trainer, in process, on tiny data written here: every task, resume, corrupt-checkpoint
fallback, no usable checkpoint, best-checkpoint selection, NaN stop, gradient accumulation, one
compilation, the memory check."""
import contextlib
import json
import re
import shutil
import struct

import jax
import numpy as np
import pytest

import lra
from attention_zoo.models import DualEncoderClassifier, num_params
from experiments.common import task_configs
from experiments.common.errors import HarnessError, Interrupted
from experiments.train import build
from experiments.train import checkpoints as checkpoints_lib
from experiments.train import data as data_lib
from experiments.train import trainer
from experiments.train.metrics import read_metrics
from lra_fixtures import write_cifar, write_imdb, write_pathfinder, write_retrieval

# Compilation dominates: runs whose model, optimiser and schedule match share compiled steps
# (experiments/train/steps.py, Steps), so most tests below use the same settings; dropout off
# halves compile time.
SMALL = ["model.num_layers=1", "model.emb_dim=16", "model.num_heads=2", "model.mlp_dim=32",
         "model.max_len=32", "batch_size=4", "log_every=1", "keep_checkpoints=10",
         "schedule.steps_per_cycle=100"]
NO_DROPOUT = ["model.dropout_rate=0.0", "model.attention_dropout_rate=0.0"]
LISTOPS_SIZES = ["generate.num_train=48", "generate.num_val=8", "generate.num_test=8",
                 "generate.min_length=4", "generate.max_length=30"]


def config_for(task, data_dir, *overrides, attention="full", seed=0):
  """The tiny preset's config over data_dir, where missing ListOps / Pathfinder are generated."""
  return task_configs.task_config(task, attention, "tiny", seed,
                               SMALL + [f"data_dir={data_dir}", "generate_data=True", *overrides])


def our_warnings(caplog):
  """The warnings our harness logged, without those of the libraries under it (orbax warns
  when a save waits on the one before, under load)."""
  return [r.getMessage() for r in caplog.records
          if r.levelname == "WARNING" and "/experiments/" in r.pathname]


def without_timing(events):
  return [{k: v for k, v in e.items() if k != "steps_per_sec"} for e in events]


def read_metrics_file(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
  """Official-format fixtures for text, retrieval, image and pathx; ListOps and Pathfinder
  are left missing so that the trainer generates them."""
  root = tmp_path_factory.mktemp("lra")
  rng = np.random.default_rng(0)
  text = lambda: bytes(rng.integers(32, 127, rng.integers(10, 60)).astype(np.uint8))
  write_imdb(root, {(split, label): [text() for _ in range(n)]
                    for split, n in (("train", 8), ("test", 4)) for label in ("neg", "pos")})
  for split_file, n in (("new_aan_pairs.train.tsv", 16), ("new_aan_pairs.eval.tsv", 4),
                        ("new_aan_pairs.test.tsv", 4)):
    write_retrieval(root, split_file, [f"{i % 2}.0\tA{i}\tB{i}\t".encode() + text() + b"\t" + text()
                                       for i in range(n)])
  write_cifar(root, rng, sizes=(4, 4, 4, 4, 4), test_size=4)
  write_pathfinder(root, rng, resolution=64, per_file=(7, 7, 6))
  return root


def run_config(task, data_root):
  return config_for(task, data_root, "num_train_steps=6", "eval_every=2", *LISTOPS_SIZES)


@pytest.fixture(scope="module")
def run_a(data_root, tmp_path_factory):
  """An uninterrupted 6-step ListOps run (checkpoints and evaluations every 2 steps)."""
  workdir = tmp_path_factory.mktemp("run_a")
  run = trainer.Trainer(run_config("listops", data_root), workdir)
  results = run.run()
  return run, results, read_metrics(workdir)


def test_missing_listops_is_generated_and_compiled_once(run_a, data_root):
  run, results, events = run_a
  assert (data_root / "listops-1000" / "basic_train.tsv").exists()
  assert results["num_examples"] == {"train": 48, "validation": 8, "test": 8}
  # Compiled ahead of time, before the first step; a Compiled never compiles again.
  assert isinstance(run.train_step, jax.stages.Compiled) and run.steps.train._cache_size() == 0
  assert run.eval_step._cache_size() == 1
  assert [e["step"] for e in events if "train_loss" in e] == [1, 2, 3, 4, 5, 6]
  assert [e["step"] for e in events if "eval_accuracy" in e] == [2, 4, 6]
  assert {"train_loss", "train_accuracy", "lr", "grad_norm", "steps_per_sec"} <= set(events[0])
  assert {"test_accuracy_final", "test_accuracy_best_validation"} <= set(events[-1])


@contextlib.contextmanager
def batches_spy(stop_before_step=None):
  """Records each run's start step; raises KeyboardInterrupt when asked for a given step."""
  starts, real = [], data_lib.train_batches

  def spy(ds, batch_size, *, seed, start_step):
    starts.append(start_step)
    for step, batch in enumerate(real(ds, batch_size, seed=seed, start_step=start_step),
                                 start=start_step + 1):
      if step == stop_before_step:
        raise KeyboardInterrupt
      yield batch

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(data_lib, "train_batches", spy)
    yield starts


def tensorboard_scalars(folder) -> list[tuple[int, str, float]]:
  """(step, tag, value) of every scalar in the TensorBoard event files (TFRecord framing: an
  8-byte length, its 4-byte CRC, the Event, the Event's 4-byte CRC)."""
  from tensorboardX.proto import event_pb2

  scalars, paths = [], sorted(folder.glob("events.out.tfevents.*"))
  assert paths, f"no TensorBoard event file in {folder}"
  for path in paths:
    data, at = path.read_bytes(), 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
      at += 12 + length + 4
      scalars += [(event.step, value.tag, value.simple_value) for value in event.summary.value]
  return scalars


def assert_tensorboard_matches_metrics(workdir):
  """Every metrics.jsonl value is in TensorBoard once, and nothing else is."""
  scalars = tensorboard_scalars(workdir / "tensorboard")
  expected = [(e["step"], k, float(np.float32(v))) for e in read_metrics(workdir)
              for k, v in e.items() if k != "step"]
  assert sorted(scalars) == sorted(expected)


def flip_bytes_in_largest_array_file(checkpoint):
  """Overwrites 64 bytes in the middle of the checkpoint's largest array-data file in place
  (same size)."""
  data = [p for p in checkpoint.rglob("*") if p.is_file() and p.parent.name == "d"]
  assert data, f"no array file in {checkpoint}"
  path = max(data, key=lambda p: p.stat().st_size)
  content = bytearray(path.read_bytes())
  middle = len(content) // 2
  content[middle:middle + 64] = bytes(b ^ 0xFF for b in content[middle:middle + 64])
  path.write_bytes(bytes(content))
  return path


SAME = ("test_accuracy_final", "test_loss_final", "test_accuracy_best_validation",
        "test_loss_best_validation", "validation_accuracy_final", "best_eval_accuracy",
        "best_step", "steps", "num_params")


def test_resume_and_corrupt_checkpoint_fallback_give_the_same_results(run_a, data_root, tmp_path,
                                                                       caplog):
  run, results_a, events_a = run_a
  config = run_config("listops", data_root)
  with batches_spy(stop_before_step=6), pytest.raises(Interrupted, match=(
      rf"^listops / full / seed 0 interrupted at step 5 of 6; the last checkpoint is step 4 in "
      rf"{tmp_path}/checkpoints$")):
    trainer.Trainer(config, tmp_path).run()   # steps 1-5 done, checkpoints at 2 and 4
  interrupted = read_metrics(tmp_path)
  assert without_timing(interrupted) == without_timing(events_a[:len(interrupted)])  # same seed
  assert max(e["step"] for e in interrupted) == 5 and not (tmp_path / "results.json").exists()

  with batches_spy() as starts, caplog.at_level("INFO"):
    resumed = trainer.Trainer(config, tmp_path)
    results = resumed.run()
  assert starts == [4]
  # Each slow part says what it is doing as it starts, not only once it is done.
  said = [r.getMessage() for r in caplog.records if "/experiments/" in r.pathname]
  steps = ["loading the data", "compiling the train step",
           f"restoring the newest usable checkpoint of {tmp_path}/checkpoints (steps 2, 4)",
           f"resumed {tmp_path} from step 4"]
  found = [next(i for i, line in enumerate(said) if step in line) for step in steps]
  assert found == sorted(found), said
  caplog.clear()
  assert resumed.train_step is run.train_step   # the same compiled step: nothing compiled twice
  assert without_timing(read_metrics(tmp_path)) == without_timing(events_a)
  assert {k: results[k] for k in SAME} == {k: results_a[k] for k in SAME}
  assert json.loads((tmp_path / "results.json").read_text())["steps"] == 6
  assert_tensorboard_matches_metrics(tmp_path)   # steps 5 and 6 written twice, shown once
  for step in (2, 4, 6):   # the checksums still match once orbax is done with a checkpoint
    assert checkpoints_lib.verify_checksums(tmp_path / "checkpoints" / str(step))

  latest = tmp_path / "checkpoints" / "6"
  flipped = flip_bytes_in_largest_array_file(latest).relative_to(latest).as_posix()
  # Orbax alone notices such bytes only where they land in a compressed chunk (it depends on the
  # file's layout); the checksums catch them wherever they land.
  with batches_spy() as starts, caplog.at_level("WARNING"):
    results = trainer.Trainer(config, tmp_path).run()
  assert starts == [4]
  assert (f"checkpoints/6 is unusable: file {flipped} differs from its checksum" in caplog.text
          and "corrupt_checkpoints/6; trying step 4" in caplog.text)
  assert (tmp_path / "corrupt_checkpoints" / "6").is_dir()
  assert {k: results[k] for k in SAME} == {k: results_a[k] for k in SAME}
  assert without_timing(read_metrics(tmp_path)) == without_timing(events_a)
  assert_tensorboard_matches_metrics(tmp_path)


def test_no_usable_checkpoint_keeps_the_earlier_files_and_starts_afresh(run_a, data_root, tmp_path,
                                                                       caplog):
  _, results_a, events_a = run_a
  config = run_config("listops", data_root)
  trainer.Trainer(config, tmp_path).run()
  for step in (2, 4, 6):   # unreadable for orbax, and no checksums to catch it first
    (tmp_path / "checkpoints" / str(step) / "checksums.json").unlink()
    arrays = [path for path in (tmp_path / "checkpoints" / str(step) / "state").rglob("*")
              if path.is_file() and path.parent.name == "d"]
    assert arrays, f"no array file in checkpoint {step}"
    for path in arrays:
      path.write_bytes(b"corrupt")
  with batches_spy() as starts, caplog.at_level("WARNING"):
    results = trainer.Trainer(config, tmp_path).run()
  assert starts == [0]
  warnings = our_warnings(caplog)
  assert len(warnings) == 4, warnings
  for step, warning, then in zip((6, 4, 2), warnings, ("trying step 4", "trying step 2",
                                                       "no older checkpoint is left")):
    # The innermost error, readable: not the text of a printed TensorStore method object.
    assert re.search(rf"checkpoints/{step} is unusable: orbax cannot restore it \(ValueError: "
                     rf"[A-Z_]+: .*\); moved to .*corrupt_checkpoints/{step}; {then}$", warning)
    assert "bound method" not in warning and "\n" not in warning
  assert warnings[-1] == (f"no usable checkpoint in {tmp_path}/checkpoints (steps 6, 4, 2 moved to "
                          f"{tmp_path}/corrupt_checkpoints, see above): starting again from step "
                          "0; the earlier run's files are kept as metrics.jsonl.1, tensorboard.1, "
                          "results.json.1")
  # The same seed from step 0: the uninterrupted run again; the earlier one's files kept.
  assert {k: results[k] for k in SAME} == {k: results_a[k] for k in SAME}
  assert without_timing(read_metrics(tmp_path)) == without_timing(events_a)
  assert without_timing(read_metrics_file(tmp_path / "metrics.jsonl.1")) == without_timing(events_a)
  assert json.loads((tmp_path / "results.json.1").read_text())["steps"] == 6
  assert_tensorboard_matches_metrics(tmp_path)
  assert len(tensorboard_scalars(tmp_path / "tensorboard.1")) == len(tensorboard_scalars(
      tmp_path / "tensorboard"))


def test_a_checkpoint_of_another_run_is_refused_then_restarted_on_request(run_a, data_root,
                                                                        tmp_path):
  """Not corrupt, so not set aside: the error names the differing fields, of the model (not
  remat, which changes no stored value) and of the training (not log_every, which says how it
  is carried out), and the ways out; restart=True keeps the earlier run's files."""
  run, results_a, _ = run_a
  shutil.copytree(run.workdir, tmp_path, dirs_exist_ok=True)
  config = run_config("listops", data_root)
  config.log_every += 1
  assert trainer.plan_line(config, tmp_path).endswith(f"; resumes from step 6 -> {tmp_path}")
  config.model.mlp_dim, config.model.remat = 48, "block"
  config.schedule.base_learning_rate *= 2
  refused = (rf"^{tmp_path}/checkpoints holds checkpoints of another run \(step 6\): "
             r"model.mlp_dim is 32 there, 48 in this config; schedule.base_learning_rate is "
             rf"{run_config('listops', data_root).schedule.base_learning_rate} there, "
             r".*a new workdir.*--restart")
  with pytest.raises(HarnessError, match=refused):   # the dry run refuses it as the run does
    trainer.plan_line(config, tmp_path)
  with pytest.raises(HarnessError, match=refused):
    trainer.Trainer(config, tmp_path).run()
  assert "resumes" not in trainer.plan_line(config, tmp_path, restart=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in run.workdir.iterdir())
  with batches_spy() as starts:
    results = trainer.Trainer(config, tmp_path, restart=True).run()
  assert starts == [0] and results["model"]["mlp_dim"] == 48
  assert sorted(p.name for p in (tmp_path / "checkpoints.1").iterdir()) == ["2", "4", "6"]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4", "6"]
  assert json.loads((tmp_path / "results.json.1").read_text())["model"]["mlp_dim"] == 32
  assert read_metrics_file(tmp_path / "metrics.jsonl.1")[-1] == read_metrics(run.workdir)[-1]


def test_checkpoints_verify_checksums_and_values_and_fall_back(tmp_path, caplog):
  """Newest first: a file changed in place, then NaN values, are set aside; a checkpoint
  without checksums is used with a warning when it restores finite values; the folder of a
  save cut short (Ctrl-C during `save`) is removed."""
  tree = {"w": jax.numpy.arange(6.0), "key": jax.random.key(0)}
  saved = checkpoints_lib.Checkpoints(tmp_path, keep=10)
  for step, w in ((1, [0.0] * 6), (2, [1.0] * 6), (3, [0.0, np.nan, 0, 0, 0, 0]),
                  (4, [2.0] * 6)):
    saved.save(step, {**tree, "w": jax.numpy.array(w)}, {"step": step})
  saved.close()
  folder = tmp_path / "checkpoints"
  (folder / "2" / "checksums.json").unlink()     # as an older version wrote it
  (folder / "5.orbax-checkpoint-tmp").mkdir()    # as a save cut short leaves it
  (folder / "5.orbax-checkpoint-tmp" / "part").write_bytes(b"half")
  flipped = flip_bytes_in_largest_array_file(folder / "4").relative_to(folder / "4").as_posix()
  with caplog.at_level("WARNING"):
    checkpoints = checkpoints_lib.Checkpoints(tmp_path, keep=10)
    step, restored, record = checkpoints.restore_latest(tree)
    checkpoints.close()
  assert (step, record) == (2, {"step": 2}) and checkpoints.set_aside == [4, 3]
  np.testing.assert_array_equal(restored["w"], np.ones(6))
  assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(tree["key"])
  messages = our_warnings(caplog)
  assert f"checkpoints/4 is unusable: file {flipped} differs from its checksum" in messages[0]
  assert messages[0].endswith("corrupt_checkpoints/4; trying step 3")
  assert "checkpoints/3 is unusable: ['w'] holds NaN or infinite values" in messages[1]
  assert "checkpoints/2 has no checksums.json" in messages[2]
  assert "cannot be verified" in messages[2]
  assert sorted(p.name for p in (tmp_path / "corrupt_checkpoints").iterdir()) == ["3", "4"]
  assert sorted(p.name for p in folder.iterdir()) == ["1", "2"]


def test_a_run_that_cannot_fit_stops_before_the_first_step(data_root, tmp_path, monkeypatch):
  config = run_config("listops", data_root)
  config.check_memory = False
  analysis = trainer.Trainer(config, tmp_path).train_step.memory_analysis()
  need = (analysis.temp_size_in_bytes + analysis.argument_size_in_bytes
          + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
  model, _ = trainer.build_model(config)
  assert need > 3 * 4 * num_params(model)   # at least the parameters and Adam's two moments
  config.check_memory = True
  monkeypatch.setattr(trainer.device, "device_memory_bytes", lambda: need - 1.0)
  with pytest.raises(HarnessError) as info:
    trainer.Trainer(config, tmp_path)
  message = str(info.value)
  megabytes = lambda n: f"{n / 1e6:.1f} MB"
  assert message.startswith(
      f"the compiled train step needs {megabytes(need)} ({megabytes(analysis.temp_size_in_bytes)}"
      f" temporary, {megabytes(need - analysis.temp_size_in_bytes)} parameters, optimiser state "
      f"and batch) but this CPU run has {megabytes(need - 1)}; ")
  assert message.endswith(
      "to fit, use config.grad_accum_steps > 1 (micro-batches), config.model.dtype=bfloat16, "
      "config.model.remat=block (recompute each block in the backward pass), a smaller "
      "config.batch_size (now 4); or config.check_memory=False to try anyway")
  assert not (tmp_path / "checkpoints").exists()
  monkeypatch.setattr(trainer.device, "device_memory_bytes", lambda: need)
  trainer.Trainer(config, tmp_path)   # just fits


def test_test_accuracy_of_the_final_and_the_best_validation_model(data_root, tmp_path, monkeypatch):
  config = config_for("listops", data_root, "num_train_steps=3", "eval_every=1", *LISTOPS_SIZES)
  real, fake = trainer.Trainer.evaluate, iter([0.2, 0.6, 0.4])

  def evaluate(self, split, model_state, evaluation=0, description=None):
    result = real(self, split, model_state, evaluation, description)
    return {**result, "accuracy": next(fake)} if split == "validation" else result

  monkeypatch.setattr(trainer.Trainer, "evaluate", evaluate)
  run = trainer.Trainer(config, tmp_path)
  results = run.run()
  assert (results["best_step"], results["best_eval_accuracy"]) == (2, 0.6)
  assert results["validation_accuracy_final"] == 0.4   # the validation accuracy of each model
  saved = checkpoints_lib.Checkpoints(tmp_path, keep=10)
  template = {"train": run.state, "best": run.best}
  at_2 = saved.restore(2, template)[0]["train"]
  at_3 = saved.restore(3, template)[0]
  saved.close()
  best_params = at_3["best"][0]
  same = jax.tree.map(lambda a, b: bool((a == b).all()), best_params, at_2.params)
  assert all(jax.tree.leaves(same))
  differs = jax.tree.map(lambda a, b: bool((a != b).any()), best_params, at_3["train"].params)
  assert any(jax.tree.leaves(differs))
  assert results["test_accuracy_best_validation"] == real(run, "test", (at_2.params, at_2.rest))[
      "accuracy"]
  final = at_3["train"]
  assert results["test_accuracy_final"] == real(run, "test", (final.params, final.rest))["accuracy"]


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(data_root, tmp_path):
  config = config_for("listops", data_root, "num_train_steps=5", "eval_every=1", *NO_DROPOUT,
                      "schedule.base_learning_rate=1e30", "schedule.warmup_steps=1", *LISTOPS_SIZES)
  with pytest.raises(trainer.NaNLossError, match=r"became NaN or infinite at step (\d)") as info:
    trainer.Trainer(config, tmp_path).run()
  bad_step = int(re.search(r"at step (\d)", str(info.value)).group(1))
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert saved == list(range(1, bad_step))
  assert f"last good checkpoint is step {bad_step - 1}" in str(info.value)
  assert not (tmp_path / "results.json").exists()


def test_gradient_accumulation_matches_one_big_batch(data_root, tmp_path):
  # A large Adam eps makes the update proportional to the gradient (instead of its sign), so
  # the parameters show any difference in the accumulated gradients.
  params, events = [], []
  for accum in (1, 2):
    config = config_for("listops", data_root, "num_train_steps=2", f"grad_accum_steps={accum}",
                        "optimizer.eps=1.0", *NO_DROPOUT, *LISTOPS_SIZES)
    run = trainer.Trainer(config, tmp_path / str(accum))
    run.run()
    params.append(run.state.params)
    events.append([e for e in read_metrics(tmp_path / str(accum)) if "train_loss" in e])
  for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  for one, accumulated in zip(*events):
    for key in ("train_loss", "train_accuracy", "grad_norm"):
      assert accumulated[key] == pytest.approx(one[key], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["padded_mean", "cls"])
def test_length_buckets_train_and_evaluate_like_the_padded_batches(pooling, data_root, tmp_path):
  """Expressions of 4-30 tokens padded to 32, cut to multiples of 8 per sorted micro-batch."""
  params, events = [], []
  for bucket in (0, 8):
    config = config_for("listops", data_root, "num_train_steps=2", "eval_every=1",
                        "grad_accum_steps=2", f"length_bucket={bucket}", f"model.pooling={pooling}",
                        "optimizer.eps=1.0", *NO_DROPOUT, *LISTOPS_SIZES)
    run = trainer.Trainer(config, tmp_path / str(bucket))
    run.run()
    params.append(run.state.params)
    events.append(without_timing(read_metrics(tmp_path / str(bucket))))
  for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert [sorted(e) for e in events[0]] == [sorted(e) for e in events[1]]
  for padded, bucketed in zip(*events):
    for key, value in padded.items():
      assert bucketed[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_length_buckets_refuse_a_model_that_reads_the_padding(data_root, tmp_path):
  config = config_for("listops", data_root, "length_bucket=8", "grad_accum_steps=2",
                      "model.attention_ignores_padding=True", *NO_DROPOUT, *LISTOPS_SIZES)
  with pytest.raises(HarnessError, match="length_bucket=8: the full model's loss on a validation "
                                         "batch changes by .* depend on the padding"):
    trainer.Trainer(config, tmp_path)


def test_bfloat16_compute_trains_like_float32_with_float32_state(data_root, tmp_path):
  """8 tiny ListOps steps: bf16 compute gives each step's loss within 1% of f32's (measured:
  0.1%), while parameters and Adam's moments stay f32."""
  losses, states = {}, {}
  for dtype in ("float32", "bfloat16"):
    config = config_for("listops", data_root, "num_train_steps=8", "eval_every=8",
                        f"model.dtype={dtype}", *NO_DROPOUT, *LISTOPS_SIZES)
    run = trainer.Trainer(config, tmp_path / dtype)
    run.run()
    losses[dtype] = [e["train_loss"] for e in read_metrics(tmp_path / dtype) if "train_loss" in e]
    states[dtype] = run.state
  assert len(losses["bfloat16"]) == 8
  np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=1e-2)
  assert losses["bfloat16"] != losses["float32"]                 # bf16 did compute in bf16
  state = states["bfloat16"]
  floats = {x.dtype for x in jax.tree.leaves((state.params, state.opt_state))
            if np.issubdtype(x.dtype, np.floating)}
  assert floats == {np.dtype("float32")}


@pytest.mark.parametrize("task", lra.available_tasks())
def test_each_task_trains_and_writes_results(task, data_root, tmp_path, run_a):
  sizes = {"listops": LISTOPS_SIZES, "pathfinder": ["generate.num=20"]}.get(task, [])
  dropout = [] if task == "listops" else NO_DROPOUT  # listops shares run_a's compiled steps
  bf16 = ["model.dtype=bfloat16"] if task == "image" else []  # bf16 compute, f32 parameters
  config = config_for(task, data_root, "num_train_steps=2", "eval_every=1", *sizes, *dropout,
                      *bf16, seed=1)
  run = trainer.Trainer(config, tmp_path)
  results = run.run()
  written = json.loads((tmp_path / "results.json").read_text())
  assert written == json.loads(json.dumps(results))
  for field in ("task", "attention", "preset", "seed", "test_accuracy_final",
                "test_accuracy_best_validation", "best_eval_accuracy", "best_step", "num_params",
                "steps", "wall_seconds", "environment", "data", "model", "config"):
    assert field in written
  assert ((written["task"], written["attention"], written["preset"], written["seed"])
          == (task, "full", "tiny", 1))
  assert 0 <= written["test_accuracy_final"] <= 1 and written["best_step"] in (1, 2)
  assert written["steps"] == 2
  assert written["environment"]["versions"]["jax"] == jax.__version__
  assert written["environment"]["git_commit"]   # this checkout's HEAD
  assert written["model"]["attention"] == "full"
  assert written["config"]["model"]["max_len"] == 32 and written["wall_seconds"] > 0
  test = lra.load(task, "test", data_dir=data_root, max_len=32, **config.data)
  assert written["majority_accuracy"] == np.bincount(test.targets).max() / len(test)
  assert list((tmp_path / "tensorboard").iterdir())
  model, _ = trainer.build_model(config)
  assert isinstance(model, DualEncoderClassifier) == (task == "retrieval")
  assert written["num_params"] == num_params(model)
  if task == "retrieval":  # the NLI head reads [u, v, u * v, u - v]
    assert model.head.hidden.in_features == 4 * config.model.emb_dim
  if task == "listops":   # another seed, other metrics (same seed: identical, see resume test)
    first = lambda events: next(e["train_loss"] for e in events if "train_loss" in e)
    assert first(read_metrics(tmp_path)) != first(run_a[2])
  if task == "pathfinder":
    assert (data_root / "pathfinder32" / "curv_contour_length_14" / "metadata").is_dir()
  if task == "image":
    assert written["config"]["model"]["dtype"] == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(run.state.params)} == {np.dtype("float32")}


def test_bad_config_values_are_clear_errors(data_root, tmp_path):
  cases = [("model.attention=nope", "config.model.attention cannot be overridden: the variant "
                                    "is part of the config argument"),
           ("task=cifar", "config.task cannot be overridden"),
           ("batch_size=3", "batch_size / grad_accum_steps = 3 is not divisible"
            if jax.device_count() > 1 else "batch_size=3 is not divisible by grad_accum_steps=2"),
           ("model.pooling=max", "cannot build the full model: .*pooling='max'"),
           ("length_bucket=-1", "length_bucket must be >= 0")]
  for override, message in cases:
    extra = ["grad_accum_steps=2"] if override == "batch_size=3" and jax.device_count() == 1 else []
    with pytest.raises(HarnessError, match=message):
      trainer.Trainer(config_for("listops", data_root, override, *extra, *LISTOPS_SIZES), tmp_path)
  with pytest.raises(HarnessError, match="aclImdb"):
    trainer.Trainer(config_for("text", tmp_path / "empty"), tmp_path)


def test_an_unfinished_run_with_other_training_values_is_refused_and_the_config_recorded(
    run_a, data_root, tmp_path):
  """An interrupted run (its last checkpoint at step 4 of 6, no results.json) resumed with
  another learning rate is refused as a finished one is, naming the field; results.json records
  the config the run was given, as the one check leaves it (model.max_len=32 recorded as the
  length its options follow)."""
  run, results_a, _ = run_a
  shutil.copytree(run.workdir, tmp_path, dirs_exist_ok=True)
  shutil.rmtree(tmp_path / "checkpoints" / "6")
  (tmp_path / "results.json").unlink()
  config = run_config("listops", data_root)
  checked, _ = build.check(config)
  assert checked.made.scaled_for == 32 != config.made.scaled_for
  assert results_a["config"] == json.loads(json.dumps(checked.to_dict()))
  config.schedule.base_learning_rate *= 2
  refused = (rf"^{tmp_path}/checkpoints holds checkpoints of another run \(step 4\): "
             r"schedule.base_learning_rate is .* there, .* in this config\..*--restart")
  with pytest.raises(HarnessError, match=refused):
    trainer.plan_line(config, tmp_path)
  with pytest.raises(HarnessError, match=refused):
    trainer.Trainer(config, tmp_path).run()
