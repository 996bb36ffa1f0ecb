"""One trainer for every task (the LRA tasks and the diagnostics) and every registered attention.

    results = Trainer(config, workdir).run()     # config: configs/lra/<task>.py get_config(...)

The model (experiments/build.py) is an NNX Classifier, a DualEncoderClassifier when the task has
two inputs (Retrieval), or a causal DecoderLM for a next-token task (MQAR). It is split into a
graph definition and its state so that one `jax.jit`-compiled step trains it; the step is
compiled once per run, ahead of the first step, and a run whose compiled step needs more
memory than the device has stops there (config.check_memory). Data parallel: a `Mesh` over
every device of every process with one `data` axis; the batch is sharded along it and the
training state is replicated. Several processes (one machine or many) each feed their own rows
of every batch; process 0 writes the metrics and results.

A run in `workdir` leaves:
  checkpoints/     orbax checkpoints (latest few; each also holds the best model so far and
                   the checksums of its files; experiments/checkpoints.py)
  metrics.jsonl    one JSON object per event: train_loss, train_accuracy, lr, grad_norm,
                   steps_per_sec; eval_loss, eval_accuracy; test_{loss,accuracy}_{final,
                   best_validation}
  tensorboard/     the same scalars as TensorBoard events
  results.json     test accuracy of the final model and of the best-validation model (both
                   labelled; test_examples: how many were tested) and the validation accuracy
                   of each (validation_accuracy_final, best_eval_accuracy), the resolved model
                   and config, the user's overrides of the config file's values, where the
                   data came from, the code and device
Starting again in the same workdir resumes from the latest checkpoint that verifies; if none
does, the run starts again from step 0 and an earlier run's files are renamed, not deleted
(experiments/provenance.py). Checkpoints of another model (a model field changed, other than the
compute-only `dtype` and `remat`) are refused with an error naming the fields: train it in a
new workdir, or pass `restart=True` (experiments.train --restart) to start from step 0 there,
the earlier run's files and checkpoints renamed <name>.1.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

import lra
from lra.mqar import IGNORED
from attention_zoo.models import TransformerConfig, num_params
from experiments import build
from experiments import data as data_lib
from experiments import measure, provenance
from experiments.provenance import MetricsWriter
from experiments.checkpoints import FOLDERS as CHECKPOINT_FOLDERS
from experiments.checkpoints import Checkpoints, barrier
from experiments.cli import HarnessError


class NaNLossError(HarnessError):
  """Training produced a non-finite loss or parameters."""


# Model fields that change how the model is computed, not what it is or what a checkpoint holds:
# a run may resume with them changed (check_memory suggests both to make a run fit).
COMPUTE_ONLY_FIELDS = ("dtype", "remat")


def model_differences(saved: dict, current: dict) -> list[str]:
  """"model.<field> is <saved> there, <current> in this config" for each field of two recorded
  models (build.describe) that differs, compute-only fields aside."""
  def flat(model: dict, prefix: str = "model") -> dict:
    fields = {}
    for name, value in model.items():
      if isinstance(value, dict):
        fields.update(flat(value, f"{prefix}.{name}"))
      elif name not in COMPUTE_ONLY_FIELDS or prefix != "model":
        fields[f"{prefix}.{name}"] = value
    return fields

  saved, current = flat(saved), flat(current)
  return [f"{name} is {saved.get(name, 'unset')} there, {current.get(name, 'unset')} in this "
          "config" for name in sorted(saved.keys() | current.keys())
          if saved.get(name) != current.get(name)]


# What a run that starts from step 0 has seen.
FRESH_RECORD = {"best_eval_accuracy": -1.0, "best_step": 0, "last_eval_accuracy": None,
                "wall_seconds": 0.0}


@flax.struct.dataclass
class TrainState:
  step: jax.Array          # int32 scalar: updates done
  params: nnx.State        # nnx.Param variables
  rest: nnx.State          # everything else in the model, e.g. its RNG state
  opt_state: optax.OptState


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
  for name in ("batch_size", "eval_batch_size", "num_train_steps", "eval_every",
               "checkpoint_every", "log_every", "grad_accum_steps", "keep_checkpoints"):
    if config[name] < 1:
      raise HarnessError(f"config.{name} must be >= 1, got {config[name]}")
  if config.eval_batches < 0:
    raise HarnessError(f"config.eval_batches must be >= 0 (0 = the whole validation split), "
                       f"got {config.eval_batches}")
  devices, processes = jax.device_count(), jax.process_count()
  if config.batch_size % config.grad_accum_steps:
    raise HarnessError(f"batch_size={config.batch_size} is not divisible by "
                       f"grad_accum_steps={config.grad_accum_steps}")
  for name, size in (("batch_size / grad_accum_steps",
                      config.batch_size // config.grad_accum_steps),
                     ("eval_batch_size", config.eval_batch_size)):
    if size % devices or size % processes:
      raise HarnessError(f"{name} = {size} is not divisible by the {devices} devices "
                         f"({processes} processes): data parallelism gives each device an equal "
                         f"share; use a multiple of {devices}")


def plan_line(config, workdir, *, shapes: bool = False) -> str:
  """What a run of `config` into `workdir` would be, in one line (a dry run's): the checks the
  trainer makes first, then task, variant, seed, the resolved size, budget and options, the
  data; with `shapes`, the parameter count of the model built abstractly (nnx.eval_shape:
  about a second, nothing computed)."""
  resolved = build.resolve(config)
  check_config(resolved)
  model = resolved.model
  options = ", ".join(f"{k}={v}" for k, v in sorted(model.attention_options.items()))
  parts = [f"{config.task} / {model.attention} / seed {config.seed} ({config.preset})",
           f"{model.num_layers} layers, emb {model.emb_dim}, {model.num_heads} heads, max_len "
           f"{model.max_len}, batch {resolved.batch_size}, {resolved.num_train_steps} steps",
           f"options {options or '(none)'}"]
  if shapes:
    abstract = nnx.eval_shape(lambda: build_model(resolved)[0])
    parts.append(f"{num_params(abstract):,} parameters")
  parts.append(data_lib.describe(resolved))
  return "; ".join(filter(None, parts)) + f" -> {workdir}"


def build_model(config) -> tuple[nnx.Module, TransformerConfig]:
  """The task's model (experiments.build) and its resolved TransformerConfig."""
  try:
    return build.model(config, nnx.Rngs(params=config.seed, dropout=config.seed + 1))
  except (TypeError, ValueError) as e:
    raise HarnessError(f"cannot build the {config.model.attention} model: {e}") from None


def check_memory(compiled, config) -> None:
  """HarnessError if the compiled train step needs more memory than the device has (XLA's
  memory_analysis: arguments + outputs - donated + temporaries, per device; see
  experiments/measure.py), naming what would make it fit. CPU devices share the host's memory."""
  memory = measure.compiled_memory(compiled)
  if memory is None:   # a backend without the analysis: nothing to compare
    return
  temporary, buffers = memory.temp_bytes, memory.buffer_bytes
  on_cpu = jax.default_backend() == "cpu"
  sharing = jax.local_device_count() if on_cpu else 1
  need, have = (temporary + buffers) * sharing, measure.device_memory_bytes()
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


class Steps:
  """The compiled functions of a run: train step, evaluation step, replication, finiteness.

  They depend only on the model, optimiser and schedule (and the devices), so runs that differ
  in seed, data or length share them (`Steps.for_config`): a seed grid compiles once. The train
  step is compiled ahead of time per batch shape (`compiled_train`), so that its memory can be
  read before the first step and the same executable runs every step.
  """

  _cache: dict[str, "Steps"] = {}
  CACHE_SIZE = 4

  def __init__(self, graphdef, tx, schedule, grad_accum_steps: int, replicated):
    self.graphdef, self.tx, self.schedule = graphdef, tx, schedule
    self.grad_accum_steps = grad_accum_steps
    self.train = jax.jit(self._train_step, donate_argnums=0, out_shardings=(replicated, replicated))
    self.eval = jax.jit(self._eval_step, out_shardings=replicated)
    # A copy on every device: the initial state, and the best model (the training state's
    # buffers are donated to the next step). jax.device_put cannot place a process's arrays
    # on other processes' devices.
    self.replicate = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=replicated)
    self._compiled_train = {}
    self.all_finite = jax.jit(lambda tree: jnp.all(jnp.array(
        [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)])))

  @classmethod
  def for_config(cls, config, make: "Callable[[], Steps]") -> "Steps":
    key = json.dumps({"task": config.task, "model": config.model.to_dict(),
                      "optimizer": config.optimizer.to_dict(),
                      "schedule": config.schedule.to_dict(),
                      "grad_accum_steps": config.grad_accum_steps,
                      "devices": [d.id for d in jax.devices()]}, sort_keys=True)
    if key not in cls._cache:
      if len(cls._cache) >= cls.CACHE_SIZE:
        cls._cache.pop(next(iter(cls._cache)))
      cls._cache[key] = make()
    return cls._cache[key]

  def compiled_train(self, state: TrainState, batch_spec: dict):
    """The train step compiled ahead of time for this state and batch shape (once per shape)."""
    key = tuple((name, spec.shape, str(spec.dtype)) for name, spec in sorted(batch_spec.items()))
    if key not in self._compiled_train:
      self._compiled_train[key] = self.train.lower(state, batch_spec).compile()
    return self._compiled_train[key]

  def copy_model(self, state: TrainState):
    return self.replicate((state.params, state.rest))

  def _grads(self, params, rest, batch):
    """Summed loss, correct count, target count and the gradient of the summed loss on one
    batch; the advanced model state."""
    model = nnx.merge(self.graphdef, params, rest)

    def loss_fn(model):
      losses, correct, weights = score(model, batch, deterministic=False)
      return losses.sum(), (correct.sum(), weights.sum())

    (loss, (correct, count)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    _, _, rest = nnx.split(model, nnx.Param, ...)   # e.g. the dropout RNG has advanced
    return loss, correct, count, grads, rest

  def _train_step(self, state: TrainState, batch):
    accum = self.grad_accum_steps
    if accum == 1:
      loss, correct, count, grads, rest = self._grads(state.params, state.rest, batch)
    else:  # micro-batch i = rows i, i + accum, ...: every device holds a share of each
      micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, accum, *x.shape[1:]), 0, 1), batch)

      def add(carry, micro_batch):  # params ride in the carry: NNX needs them at the scan's level
        params, *sums, rest = carry
        *terms, rest = self._grads(params, rest, micro_batch)
        return (params, *jax.tree.map(jnp.add, sums, terms), rest), None

      zeros = jax.tree.map(jnp.zeros_like, state.params)
      carry = (state.params, 0.0, 0.0, 0.0, zeros, state.rest)
      (_, loss, correct, count, grads, rest), _ = jax.lax.scan(add, carry, micro)
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)   # the gradient of the mean loss
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    metrics = {"train_loss": loss / count, "train_accuracy": correct / count,
               "grad_norm": optax.global_norm(grads), "lr": self.schedule(state.step)}
    return TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                      rest=rest, opt_state=opt_state), metrics

  def _eval_step(self, model_state, batch):
    model = nnx.merge(self.graphdef, *model_state)
    losses, correct, weights = score(model, batch, deterministic=True)
    return {"loss": losses.sum(), "correct": correct.sum(), "count": weights.sum()}


def make_steps(config, graphdef, replicated) -> Steps:
  """The step functions of `config`'s model (`graphdef`) with its optimiser (config.optimizer)
  under its learning-rate schedule (config.schedule). The trainer keeps them per config
  (Steps.for_config); the efficiency benchmark compiles and times this same train step."""
  tx, schedule = build.optimizer(config)
  return Steps(graphdef, tx, schedule, config.grad_accum_steps, replicated)


def initial_state(steps: Steps, params, rest) -> TrainState:
  """Step 0: the model's parameters and other state, and the optimiser's initial state (of
  shapes alone under jax.eval_shape)."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest,
                    opt_state=steps.tx.init(params))


class Trainer:
  """Builds everything a run needs from the config; `run()` trains, tests, writes results."""

  def __init__(self, config, workdir, *, restart: bool = False):
    """`restart`: start from step 0 even when `workdir` holds checkpoints (of this model or of
    another), renaming the earlier run's files and checkpoints to <name>.1."""
    self.overrides = build.overrides(config)
    config = build.resolve(config)
    check_config(config)
    self.config, self.workdir, self.restart = config, Path(workdir), restart
    self.task = lra.task_spec(config.task)
    self.is_writer = jax.process_index() == 0
    self.mesh = Mesh(np.array(jax.devices()), ("data",))
    self.batch_sharding = NamedSharding(self.mesh, PartitionSpec("data"))
    replicated = NamedSharding(self.mesh, PartitionSpec())

    self.datasets = data_lib.load_splits(config)
    self.data_checks = data_lib.check_splits(config, self.datasets)
    model, self.model_config = build_model(config)
    self.model_record = json.loads(json.dumps(build.describe(self.model_config)))  # as reread
    self.num_params = num_params(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    self.steps = Steps.for_config(config, lambda: make_steps(config, graphdef, replicated))
    self.eval_step = self.steps.eval
    self.state = self.steps.replicate(initial_state(self.steps, params, rest))
    self.best = self.steps.copy_model(self.state)
    self.train_step = self.steps.compiled_train(
        self.state, data_lib.batch_spec(self.datasets["train"], config.batch_size,
                                        self.batch_sharding))
    if config.check_memory:
      check_memory(self.train_step, config)

  # -- evaluation --------------------------------------------------------------------------

  def evaluate(self, split: str, model_state, evaluation: int = 0) -> dict[str, float]:
    """Loss, accuracy and example count of (params, rest) on the split: the validation batches
    of the run's evaluation number `evaluation` (data.validation_batches), or the test batches
    (data.test_batches)."""
    ds = self.datasets[split]
    batches = (data_lib.validation_batches(ds, self.config, evaluation) if split == "validation"
               else data_lib.test_batches(ds, self.config))
    totals = None
    for batch in batches:
      sums = self.eval_step(model_state, data_lib.to_device(batch, self.batch_sharding))
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    totals = jax.device_get(totals)
    return {"loss": float(totals["loss"] / totals["count"]),
            "accuracy": float(totals["correct"] / totals["count"]),
            "examples": int(totals["count"])}

  # -- the run -----------------------------------------------------------------------------

  def run(self) -> dict:
    self.workdir.mkdir(parents=True, exist_ok=True)
    writer = MetricsWriter(self.workdir)
    if self.restart:
      kept = writer.start_fresh(also=CHECKPOINT_FOLDERS)
      barrier("earlier run set aside")
      logging.warning("restarting %s from step 0 as asked%s", self.workdir,
                      f"; the earlier run's files are kept as {kept}" if kept else "")
    checkpoints = Checkpoints(self.workdir, keep=self.config.keep_checkpoints)
    try:
      record = dict(FRESH_RECORD) if self.restart else self._resume(checkpoints, writer)
      clock = _Clock(record["wall_seconds"])
      self._train(checkpoints, writer, record, clock)
      checkpoints.finish()
      return self._test(writer, record, clock)
    finally:
      checkpoints.close()
      writer.close()

  def _resume(self, checkpoints: Checkpoints, writer: MetricsWriter) -> dict:
    latest = checkpoints.latest_record()
    if latest is not None and "model" in latest[1]:   # older checkpoints did not record it
      self._check_same_model(checkpoints, *latest)
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

  def _check_same_model(self, checkpoints: Checkpoints, step: int, record: dict) -> None:
    differences = model_differences(record["model"], self.model_record)
    if differences:
      raise HarnessError(
          f"{checkpoints.directory} holds checkpoints of another model (step {step}): "
          f"{'; '.join(differences)}. To train this model, use a new workdir, or start this "
          "one again from step 0 with --restart (Trainer(..., restart=True)), which keeps the "
          "earlier run's files and checkpoints as <name>.1")

  def _train(self, checkpoints: Checkpoints, writer: MetricsWriter, record: dict, clock: _Clock):
    config = self.config
    first = int(self.state.step)
    batches = data_lib.train_batches(self.datasets["train"], config.batch_size, seed=config.seed,
                                     start_step=first)
    pending, last_log = [], (first, time.time())
    with tqdm(total=config.num_train_steps, initial=first, disable=not self.is_writer,
              desc=f"{config.task}/{config.model.attention}", unit="step", mininterval=2) as bar:
      for step in range(first + 1, config.num_train_steps + 1):
        batch = data_lib.to_device(next(batches), self.batch_sharding)
        self.state, metrics = self.train_step(self.state, batch)
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
        if step % config.checkpoint_every == 0 or last:
          self._check_finite(pending, step, checkpoints)
          if not bool(self.steps.all_finite(self.state.params)):
            self._stop(step, "the parameters", checkpoints)
          record["wall_seconds"] = clock.total()
          checkpoints.save(step, {"train": self.state, "best": self.best},
                           {**record, "model": self.model_record})

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
    final = self.evaluate("test", (self.state.params, self.state.rest))
    best = self.evaluate("test", self.best)
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
      provenance.write_json(self.workdir / "results.json", results)
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
  return Trainer(config, workdir, restart=restart).run()


# -- what a task trains for ---------------------------------------------------------------------
#
# Classification (the LRA tasks): targets int [batch], one class per sequence. Token prediction
# (the diagnostics, e.g. associative recall with a causal LM): targets int [batch, length], the
# token expected at each position, IGNORED (-1) where nothing is asked. `score` gives
# per-target losses, correctness and weights of one shape; a loss or an accuracy is the weighted
# sum over the weight sum, so a masked token loss and a classification loss are the same
# computation, and sums over micro-batches or devices stay exact.

def logits(model, batch, deterministic: bool):
  if "inputs2" in batch:
    return model(batch["inputs"], batch["masks"], batch["inputs2"], batch["masks2"],
                 deterministic=deterministic)
  return model(batch["inputs"], batch["masks"], deterministic=deterministic)


def score(model, batch, deterministic: bool):
  """(losses, correct, weights), each f32 shaped like batch["targets"]: cross-entropy and
  exact-match at every target, weight 0 where the target is IGNORED or the example is
  filler (batch["weights"] = 0)."""
  targets = batch["targets"]
  out = logits(model, batch, deterministic).astype(jnp.float32)   # [b, classes] | [b, n, vocab]
  weights = (targets != IGNORED).astype(jnp.float32)
  if "weights" in batch:
    weights = weights * batch["weights"].reshape((-1,) + (1,) * (targets.ndim - 1))
  safe = jnp.where(targets == IGNORED, 0, targets)
  losses = optax.softmax_cross_entropy_with_integer_labels(out, safe) * weights
  correct = (jnp.argmax(out, -1) == targets).astype(jnp.float32) * weights
  return losses, correct, weights
