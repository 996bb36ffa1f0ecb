"""One trainer for every task (the LRA tasks and the synthetic ones) and every registered attention.

    results = Trainer(config, workdir).run()     # config: configs/lra/<task>.py get_config(...)

The model (experiments/train/build.py) is an NNX Classifier, a DualEncoderClassifier when the
task has two inputs (Retrieval), or a causal DecoderLM for a next-token task (MQAR). It is split
into a graph definition and its state so that one `jax.jit`-compiled step trains it
(experiments/train/steps.py); the step is compiled once per run, ahead of the first step, and a
run whose compiled step needs more memory than the device has stops there
(config.check_memory). The devices of every process form one mesh (config.mesh: data × fsdp ×
context, experiments/train/mesh.py) under which the run is compiled and runs: the batch is
split over data and fsdp, the sequence over context, the parameters and optimiser state over
fsdp. Several processes (one machine or many) each feed their own pieces of every batch;
process 0 writes the metrics and results. Checkpoints are saved sharded and restored onto
whatever mesh the resuming run has.

A run in `workdir` leaves:
  checkpoints/     orbax checkpoints (latest few; each also holds the best model so far and
                   the checksums of its files; experiments/train/checkpoints.py)
  metrics.jsonl    one JSON object per event: train_loss, train_accuracy, lr, grad_norm,
                   steps_per_sec; eval_loss, eval_accuracy; test_{loss,accuracy}_{final,
                   best_validation}
  tensorboard/     the same scalars as TensorBoard events
  results.json     test accuracy of the final model and of the best-validation model (both
                   labelled; test_examples: how many were tested) and the validation accuracy
                   of each (validation_accuracy_final, best_eval_accuracy), the resolved model
                   and config, the user's overrides of the config file's values, where the
                   data came from, the code and device
One run at a time holds a workdir (experiments/train/workdir_lock.py); a second is refused in
one line naming the first. Starting again in the same workdir resumes from the latest
checkpoint that verifies; if none does, the run starts again from step 0 and an earlier run's
files are renamed, not deleted (experiments/train/metrics.py). Checkpoints of another run (a
field of the config changed, other than run_identity's COMPUTE_ONLY_FIELDS and HOW_FIELDS), of
a finished run or an unfinished one, are refused with an error naming the fields: train it in a
new workdir, or pass `restart=True` (experiments.train --restart) to start from step 0 there,
the earlier run's files and checkpoints renamed <name>.1. Ctrl-C stops a run with
Interrupted, saying the step it reached and its last checkpoint (the entry points print that
in one line with the command that resumes it).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import jax
import numpy as np
from absl import logging
from flax import nnx
from tqdm import tqdm

from attention_zoo import registry
from attention_zoo.models import Classifier, TransformerConfig, num_params
from experiments.common import device, dry_run, provenance, records, task_configs, tasks
from experiments.common.errors import CtrlC, HarnessError, Interrupted
from experiments.train import build
from experiments.train import checkpoints as checkpoints_lib
from experiments.train import data as data_lib
from experiments.train import mesh as mesh_lib
from experiments.train import evaluation as evaluation_lib
from experiments.train import optimizer
from experiments.train.checkpoints import FOLDERS as CHECKPOINT_FOLDERS
from experiments.train.checkpoints import Checkpoints, barrier
from experiments.train.metrics import MetricsWriter
from experiments.train.run_identity import check_same_run, model_record, settings_record
from experiments.train.steps import Steps, initial_state, make_steps
from experiments.train.workdir_lock import WorkdirLock


class NaNLossError(HarnessError):
  """Training produced a non-finite loss or parameters."""


# Length buckets change the order of the sums, not their terms (steps.py): a relative change of
# the loss beyond this on the check batch means the model's outputs depend on the padding.
LENGTH_BUCKET_TOLERANCE = 1e-5


# What a run that starts from step 0 has seen.
FRESH_RECORD = {"best_eval_accuracy": -1.0, "best_step": 0, "last_eval_accuracy": None,
                "wall_seconds": 0.0}


def initialize_distributed() -> None:
  """Joins a multi-process run when the environment describes one: explicit
  JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, SLURM, Open MPI, or a
  multi-host TPU slice; a single process needs nothing. Call it before anything uses JAX."""
  env = os.environ
  if "JAX_COORDINATOR_ADDRESS" in env:
    where = (env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]),
             int(env["JAX_PROCESS_ID"]))
  elif (int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
        or "," in env.get("TPU_WORKER_HOSTNAMES", "")):
    where = ()  # jax detects the cluster from the environment
  else:
    return
  if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in env:
    # CPU processes exchange gradients over gloo: jax's default, named here so that a CPU
    # cluster does not depend on it. Read when the CPU backend starts, after initialize.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(*where)


def check_config(config) -> None:
  """Sizes the run cannot start with (of a resolved config) -> HarnessError."""
  for name in ("batch_size", "num_train_steps", "eval_every", "log_every", "grad_accum_steps",
               "keep_checkpoints"):
    if config[name] < 1:
      raise HarnessError(f"config.{name} must be >= 1, got {config[name]}")
  for name, follows in (("eval_batch_size", "batch_size"), ("checkpoint_every", "eval_every")):
    if config[name] < 0:
      raise HarnessError(f"config.{name} must be >= 0 (0 = {follows}), got {config[name]}")
  eval_batch_size = data_lib.eval_batch_size(config)
  if config.eval_batches < 0:
    raise HarnessError(f"config.eval_batches must be >= 0 (0 = the whole validation split), "
                       f"got {config.eval_batches}")
  if config.length_bucket < 0:
    raise HarnessError(f"config.length_bucket must be >= 0 (0 = off), got {config.length_bucket}")
  if config.length_bucket and build.model_class(config.task) is not Classifier:
    raise HarnessError(f"config.length_bucket={config.length_bucket} cuts the batches of a "
                       f"classifier of one input; {config.task} trains a "
                       f"{build.model_class(config.task).__name__}: use 0")
  if config.length_bucket and eval_batch_size % config.grad_accum_steps:
    raise HarnessError(f"eval_batch_size={eval_batch_size} is not divisible by "
                       f"grad_accum_steps={config.grad_accum_steps}, the micro-batches that "
                       "length_bucket cuts every batch into")
  if config.batch_size % config.grad_accum_steps:
    raise HarnessError(f"batch_size={config.batch_size} is not divisible by "
                       f"grad_accum_steps={config.grad_accum_steps}")
  mesh_lib.check(config, jax.device_count())


def check_run(config):
  """The checks a run makes before it reads data or compiles (a dry run makes the same): the
  config (build.check, once), its sizes, the data's load options, the optimiser and schedule,
  and the model, built abstractly (nnx.eval_shape: nothing computed). Returns (the checked
  config, the abstract model, the check's notes); HarnessError naming what is wrong."""
  checked, notes = build.check(config)
  check_config(checked)
  data_lib.check_options(checked)
  optimizer.from_config(checked)
  return checked, abstract_model(checked), notes


# A grid's runs that differ in their seed or training values share one model: a dry run of
# the paper preset (93 runs a task) built each one abstractly in 0.8 s.
_ABSTRACT_MODELS: dict = {}


def abstract_model(resolved) -> nnx.Module:
  """The run's model built abstractly (nnx.eval_shape: nothing computed), once per process for
  each task kind and resolved model."""
  try:   # the class registered now (tests and plugins may register a name again)
    variant = registry.get(resolved.model.attention)
  except ValueError:
    variant = None   # build_model names the choices
  key = (build.model_class(resolved.task), variant,
         json.dumps(resolved.model.to_dict(), sort_keys=True, default=repr))
  if key not in _ABSTRACT_MODELS:
    _ABSTRACT_MODELS[key] = nnx.eval_shape(lambda: build_model(resolved)[0])
  return _ABSTRACT_MODELS[key]


def plan_line(config, workdir, *, restart: bool = False) -> str:
  """What a run of `config` into `workdir` would be, in one line (a dry run's), after the
  checks the run makes before its first step (`check_run`; a workdir holding checkpoints of
  another run is refused unless `restart`): task, variant, seed, the resolved size, budget
  and options, the parameter count, the data, and the step it would resume from."""
  resolved, abstract, notes = check_run(config)
  model = resolved.model
  parts = [f"{config.task} / {model.attention} / seed {config.seed} ({config.preset})",
           f"{dry_run.count(model.num_layers, 'layer')}, emb {model.emb_dim}, "
           f"{dry_run.count(model.num_heads, 'head')}, max_len {model.max_len}, batch "
           f"{resolved.batch_size}, {dry_run.count(resolved.num_train_steps, 'step')}",
           dry_run.options_text(model.attention, model.attention_options),
           f"{num_params(abstract):,} parameters",
           "mesh " + mesh_lib.describe(mesh_lib.check(resolved, jax.device_count())),
           data_lib.describe(resolved), *notes]
  latest = None if restart else checkpoints_lib.latest_saved_record(workdir)
  if latest is not None:
    step, record = latest
    check_same_run(Path(workdir).absolute() / CHECKPOINT_FOLDERS[0], step, record,
                   model_record(build.model_config(resolved)), settings_record(resolved))
    parts.append(f"resumes from step {step}")
  return "; ".join(filter(None, parts)) + f" -> {workdir}"


def sharding_lines(config) -> list[str]:
  """The run's mesh and where each array of its training state and batch lies on it (a dry
  run's report), from shapes alone."""
  resolved, abstract, _ = check_run(config)
  layout = mesh_lib.Layout(mesh_lib.check(resolved, jax.device_count()))
  _, params, _ = nnx.split(abstract, nnx.Param, ...)
  tx, _ = optimizer.from_config(resolved)
  rows = (resolved.batch_size // resolved.grad_accum_steps, resolved.model.max_len)
  targets = rows if tasks.task_spec(resolved.task).objective == "next_token" else rows[:1]
  batch = {"inputs": jax.ShapeDtypeStruct(rows, np.int32),
           "masks": jax.ShapeDtypeStruct(rows, np.bool_),
           "targets": jax.ShapeDtypeStruct(targets, np.int32)}
  return layout.lines(params, jax.eval_shape(tx.init, params), batch)


def build_model(config) -> tuple[nnx.Module, TransformerConfig]:
  """The task's model (build.model) and its resolved TransformerConfig."""
  try:
    return build.model(config, nnx.Rngs(params=config.seed, dropout=config.seed + 1))
  except (TypeError, ValueError) as e:
    raise HarnessError(f"cannot build the {config.model.attention} model: {e}") from None


def check_memory(compiled, config) -> None:
  """HarnessError if the compiled train step needs more memory than the device has (XLA's
  memory_analysis: arguments + outputs - donated + temporaries, per device; see
  experiments/common/device.py), naming what would make it fit. CPU devices share the host's
  memory."""
  memory = device.compiled_memory(compiled)
  if memory is None:   # a backend without the analysis: nothing to compare
    return
  temporary, buffers = memory.temp_bytes, memory.buffer_bytes
  on_cpu = jax.default_backend() == "cpu"
  sharing = jax.local_device_count() if on_cpu else 1
  need, have = (temporary + buffers) * sharing, device.device_memory_bytes()
  if need <= have:
    return
  size = lambda n: f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
  who = (f"{sharing} CPU devices of this host" if sharing > 1 else "this CPU run") if on_cpu \
      else f"one {jax.devices()[0].device_kind}"
  switches = [f"config.grad_accum_steps > {config.grad_accum_steps} (micro-batches)",
              *(["config.model.dtype=bfloat16"] if config.model.dtype != "bfloat16" else []),
              "config.model.remat=block (recompute each block in the backward pass)",
              f"a smaller config.batch_size (now {config.batch_size})"]
  raise HarnessError(
      f"the compiled train step needs {size(need)} ({size(temporary * sharing)} temporary, "
      f"{size(buffers * sharing)} parameters, optimiser state and batch) but {who} has "
      f"{size(have)}; to fit, use {', '.join(switches)}; or config.check_memory=False to try "
      "anyway")


class Trainer:
  """Builds everything a run needs from the config; `run()` trains, tests, writes results."""

  def __init__(self, config, workdir, *, restart: bool = False):
    """`restart`: start from step 0 even when `workdir` holds checkpoints (of this model or of
    another), renaming the earlier run's files and checkpoints to <name>.1."""
    self.overrides = build.overrides(config, task_configs.baseline(config))
    config, _, notes = check_run(config)   # before the data: a bad config fails in a second
    for note in notes:
      logging.info("%s", note)
    self.config, self.workdir, self.restart = config, Path(workdir), restart
    self.steps_done: int | None = None   # the step training has reached (None: not started)
    self.ctrl_c = CtrlC()   # taken between steps and evaluation batches
    self.task = tasks.task_spec(config.task)
    self.is_writer = jax.process_index() == 0
    self.layout = mesh_lib.Layout(mesh_lib.check(config, jax.device_count()))
    with jax.set_mesh(self.layout.mesh):   # the ops read the mesh when they are traced
      self._prepare(config, workdir)

  def _prepare(self, config, workdir) -> None:
    """The data, the model, the initial state on the mesh, and the compiled train step."""
    # What each slow step is doing, as it starts (a resume under load can take minutes here).
    logging.info("%s / %s / seed %d -> %s: loading the data (%s)", config.task,
                 config.model.attention, config.seed, workdir,
                 data_lib.describe(config) or "generated in memory")
    self.datasets = data_lib.load_splits(config)
    self.data_checks = data_lib.check_splits(config, self.datasets)
    abstract = abstract_model(config)
    self.model_config = build.model_config(config)
    self.model_record = model_record(self.model_config)
    self.settings_record = settings_record(config)
    self.num_params = num_params(abstract)
    graphdef, _, _ = nnx.split(abstract, nnx.Param, ...)
    self.steps = Steps.for_config(config, lambda: make_steps(config, graphdef, self.layout))
    self.eval_step = self.steps.eval

    def initial():
      _, params, rest = nnx.split(build_model(config)[0], nnx.Param, ...)
      return initial_state(self.steps, params, rest)
    self.state = self.steps.create(initial)   # made in place: no device holds all of it
    self.best = self.steps.copy_model(self.state)
    if config.length_bucket:   # before the train step compiles: a refusal comes in seconds
      self._check_length_buckets()
    logging.info("compiling the train step (%s parameters, batch %d)", f"{self.num_params:,}",
                 config.batch_size)
    self.train_step = self.steps.compiled_train(
        self.state, data_lib.batch_spec(self.datasets["train"], config.batch_size, self.layout))
    if config.check_memory:
      check_memory(self.train_step, config)

  def _check_length_buckets(self) -> None:
    """HarnessError unless cutting a validation batch to its rows' real lengths leaves the
    model's loss as it is (to LENGTH_BUCKET_TOLERANCE)."""
    config = self.config
    batch = next(iter(data_lib.validation_batches(self.datasets["validation"], config, 0)))
    error = self.steps.truncation_error((self.state.params, self.state.rest),
                                        data_lib.to_device(batch, self.layout))
    if not error <= LENGTH_BUCKET_TOLERANCE:
      raise HarnessError(
          f"config.length_bucket={config.length_bucket}: the {config.model.attention} model's "
          f"loss on a validation batch changes by {error:.1e} (relative) when its micro-batches "
          "are cut to their real lengths, so its outputs at real tokens depend on the padding; "
          "use length_bucket=0")
    logging.info("length buckets of %d: the loss of a validation batch cut to its real lengths "
                 "differs by %.1e (relative) from the padded one", config.length_bucket, error)

  # -- evaluation --------------------------------------------------------------------------

  def evaluate(self, split: str, model_state, evaluation: int = 0,
               description: str | None = None) -> dict[str, float]:
    """Loss, accuracy and example count of (params, rest) on the split: the validation batches
    of the run's evaluation number `evaluation` (data.validation_batches), or the test batches
    (data.test_batches); a progress bar named `description` (default: the split)."""
    ds = self.datasets[split]
    batches = (data_lib.validation_batches(ds, self.config, evaluation) if split == "validation"
               else data_lib.test_batches(ds, self.config))
    return evaluation_lib.evaluate(
        self.eval_step, model_state, batches, layout=self.layout,
        before_batch=self.ctrl_c.check, description=description or split,
        total=evaluation_lib.batch_count(len(ds), self.config, split), show=self.is_writer)

  # -- the run -----------------------------------------------------------------------------

  def run(self) -> dict:
    """Trains (or resumes), tests and writes results.json, holding the workdir's lock
    (experiments/train/workdir_lock.py; process 0 holds it for a multi-process run)."""
    with WorkdirLock(self.workdir) if self.is_writer else contextlib.nullcontext():
      return self._run()

  def _run(self) -> dict:
    self.workdir.mkdir(parents=True, exist_ok=True)
    writer = MetricsWriter(self.workdir)
    if self.restart:
      kept = writer.start_fresh(also=CHECKPOINT_FOLDERS)
      barrier("earlier run set aside")
      logging.warning("restarting %s from step 0 as asked%s", self.workdir,
                      f"; the earlier run's files are kept as {kept}" if kept else "")
    checkpoints = Checkpoints(self.workdir, keep=self.config.keep_checkpoints)
    try:
      with self.ctrl_c.deferred(), jax.set_mesh(self.layout.mesh):
        record = dict(FRESH_RECORD) if self.restart else self._resume(checkpoints, writer)
        clock = _Clock(record["wall_seconds"])
        self._train(checkpoints, writer, record, clock)
        checkpoints.finish()
        return self._test(writer, record, clock)
    except KeyboardInterrupt:
      raise self._interrupted(checkpoints) from None
    finally:
      checkpoints.close()
      writer.close()

  def _resume(self, checkpoints: Checkpoints, writer: MetricsWriter) -> dict:
    if checkpoints.all_steps():
      logging.info("restoring the newest usable checkpoint of %s (steps %s): verifying its "
                   "checksums, then reading it", checkpoints.directory,
                   ", ".join(map(str, checkpoints.all_steps())))
    latest = checkpoints.latest_record()
    if latest is not None:
      check_same_run(checkpoints.directory, *latest, self.model_record, self.settings_record)
    record = dict(FRESH_RECORD)
    restored = checkpoints.restore_latest({"train": self.state, "best": self.best})
    if restored is None:
      kept = writer.start_fresh()
      kept = f"; the earlier run's files are kept as {kept}" if kept else ""
      if checkpoints.set_aside:
        logging.warning("no usable checkpoint in %s (steps %s moved to %s, see above): "
                        "starting again from step 0%s", checkpoints.directory,
                        ", ".join(map(str, checkpoints.set_aside)),
                        checkpoints.corrupt_directory, kept)
      elif kept:
        logging.info("no checkpoint in %s: starting from step 0%s", checkpoints.directory, kept)
      return record
    step, tree, saved = restored
    record = {**record, **saved}   # a checkpoint written before a key was recorded lacks it
    self.state, self.best = tree["train"], tree["best"]
    writer.resume(step)
    logging.info("resumed %s from step %d", self.workdir, step)
    return record

  def _train(self, checkpoints: Checkpoints, writer: MetricsWriter, record: dict, clock: _Clock):
    config = self.config
    first = self.steps_done = int(self.state.step)
    batches = data_lib.train_batches(self.datasets["train"], config.batch_size, seed=config.seed,
                                     start_step=first)
    pending, last_log = [], (first, time.time())
    with tqdm(total=config.num_train_steps, initial=first, disable=not self.is_writer,
              desc=f"{config.task}/{config.model.attention}", unit="step", mininterval=2) as bar:
      for step in range(first + 1, config.num_train_steps + 1):
        self.ctrl_c.check()
        batch = data_lib.to_device(next(batches), self.layout)
        self.state, metrics = self.train_step(self.state, batch)
        self.steps_done = step   # counted here: the state's buffers are donated to the step
        pending.append(metrics)
        checkpoints.poll()
        bar.update()
        last = step == config.num_train_steps
        if step % config.log_every == 0 or last:
          means = self._check_finite(pending, step, checkpoints)
          steps_per_sec = (step - last_log[0]) / (time.time() - last_log[1])
          writer.write(step, **means, steps_per_sec=steps_per_sec)
          bar.set_postfix(loss=f"{means['train_loss']:.3f}", acc=f"{means['train_accuracy']:.3f}")
          pending, last_log = [], (step, time.time())
        if step % config.eval_every == 0 or last:
          self._check_finite(pending, step, checkpoints)
          evaluation = -(-step // config.eval_every) - 1   # 0 for the first
          result = self.evaluate("validation", (self.state.params, self.state.rest), evaluation)
          writer.write(step, eval_loss=result["loss"], eval_accuracy=result["accuracy"])
          record["last_eval_accuracy"] = result["accuracy"]
          if result["accuracy"] > record["best_eval_accuracy"]:
            self.best = self.steps.copy_model(self.state)
            record.update(best_eval_accuracy=result["accuracy"], best_step=step)
        if step % (config.checkpoint_every or config.eval_every) == 0 or last:
          self._check_finite(pending, step, checkpoints)
          if not bool(self.steps.all_finite(self.state.params)):
            self._stop(step, "the parameters", checkpoints)
          record["wall_seconds"] = clock.total()
          checkpoints.save(step, {"train": self.state, "best": self.best},
                           {**record, "model": self.model_record,
                            "settings": self.settings_record})

  def _interrupted(self, checkpoints: Checkpoints) -> Interrupted:
    """Where a run stopped by Ctrl-C stands: its step and its last checkpoint (a save under way
    is finished first, so that it counts)."""
    checkpoints.finish()
    saved = checkpoints.all_steps()
    kept = (f"the last checkpoint is step {saved[-1]} in {checkpoints.directory}" if saved
            else "no checkpoint was saved yet")
    where = ("before its first step" if self.steps_done is None else
             f"at step {self.steps_done} of {self.config.num_train_steps}")
    return Interrupted(f"{self.config.task} / {self.config.model.attention} / seed "
                           f"{self.config.seed} interrupted {where}; {kept}")

  def _check_finite(self, pending: list, step: int, checkpoints: Checkpoints) -> dict:
    """Means of the pending train metrics; stops the run if a loss is not finite."""
    if not pending:
      return {}
    fetched = jax.device_get(pending)
    losses = np.array([m["train_loss"] for m in fetched])
    if not np.isfinite(losses).all():
      first_bad = step - len(losses) + 1 + int(np.argmin(np.isfinite(losses)))
      self._stop(first_bad, "the training loss", checkpoints)
    return {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}

  def _stop(self, step: int, what: str, checkpoints: Checkpoints):
    checkpoints.finish()
    saved = checkpoints.all_steps()
    kept = (f"the last good checkpoint is step {saved[-1]} in {checkpoints.directory}" if saved
            else "no checkpoint was saved before it")
    raise NaNLossError(f"{what} became NaN or infinite at step {step}; training stopped "
                       f"({kept}). Try a lower schedule.base_learning_rate or "
                       "optimizer.grad_clip_norm")

  def _test(self, writer: MetricsWriter, record: dict, clock: _Clock) -> dict:
    """Test accuracy under both policies, each labelled: the final step's model (what the
    released LRA code reported) and the best-validation model (chosen on validation only)."""
    config = self.config
    final = self.evaluate("test", (self.state.params, self.state.rest), description="test (final)")
    best = self.evaluate("test", self.best, description="test (best validation)")
    writer.write(config.num_train_steps, test_loss_final=final["loss"],
                 test_accuracy_final=final["accuracy"],
                 test_loss_best_validation=best["loss"],
                 test_accuracy_best_validation=best["accuracy"])
    results = {
        "task": config.task, "attention": config.model.attention, "preset": config.preset,
        "seed": config.seed,
        "test_accuracy_final": final["accuracy"], "test_loss_final": final["loss"],
        "test_accuracy_best_validation": best["accuracy"],
        "test_loss_best_validation": best["loss"],
        # (accuracy - chance) / (1 - chance) where the task's protocol reports it
        **tasks.scaled_accuracies(config.task, test_accuracy_final=final["accuracy"],
                                  test_accuracy_best_validation=best["accuracy"]),
        # The validation accuracy of each tested model (what tuning chooses on): the final
        # step always evaluates, so the last evaluation is the final model's.
        "validation_accuracy_final": record["last_eval_accuracy"],
        "best_eval_accuracy": record["best_eval_accuracy"], "best_step": record["best_step"],
        "majority_accuracy": data_lib.majority_accuracy(self.datasets["test"]),
        "num_params": self.num_params, "steps": int(self.state.step),
        "wall_seconds": clock.total(),
        "num_examples": {split: len(ds) for split, ds in self.datasets.items()},
        "test_examples": final["examples"],   # fewer than the split's under test_drop_last
        "data": data_lib.provenance(config),
        "data_checks": self.data_checks,
        "environment": provenance.environment(),
        "model": build.describe(self.model_config),
        "overrides": self.overrides,
        "config": config.to_dict(),
    }
    if self.is_writer:
      records.write_json(self.workdir / "results.json", results)
    logging.info("%s/%s: test accuracy %.4f at the final step %d, %.4f at the best validation "
                 "step %d", config.task, config.model.attention, final["accuracy"],
                 results["steps"], best["accuracy"], record["best_step"])
    return results


class _Clock:
  """Wall time of a run, summed over the processes that resumed it."""

  def __init__(self, before: float):
    self.before, self.started = before, time.time()

  def total(self) -> float:
    return self.before + time.time() - self.started


def train_and_evaluate(config, workdir, *, restart: bool = False) -> dict:
  """Trainer(...).run(), the workdir locked before the data is read (a second run into it is
  refused at once, not after it has compiled)."""
  with WorkdirLock(workdir) if jax.process_index() == 0 else contextlib.nullcontext():
    try:
      trainer = Trainer(config, workdir, restart=restart)
    except KeyboardInterrupt:
      raise Interrupted(f"{config.task} / {config.model.attention} / seed {config.seed} "
                        f"interrupted while preparing the run into {workdir}") from None
    return trainer.run()


