"""The compiled steps of a run: the train step (forward, backward, the optimiser's update;
micro-batches summed in a scan), the evaluation step, and what a task trains for (`score`).

Length buckets (`length_bucket` > 0, classification of one input): the batch's rows are sorted
by real length (last real token + 1) and cut into `grad_accum_steps` micro-batches, each run at
its longest real length rounded up to a multiple of `length_bucket` (`lax.switch` over the
lengths; the full length last). For a model whose outputs at real tokens ignore padding this is
the padded computation in another order, at a cost that follows the real lengths: the trainer
checks it on a validation batch before the first step (Steps.truncation_error). The rows are
only reordered inside the batch, so every step sees the examples it would see without buckets.

The model is split into a graph definition and its state so that one `jax.jit`-compiled step
trains it; the training state lives on the run's mesh as its layout says (replicated, or cut
over `fsdp`), and the batch is sharded over the mesh's batch and context axes
(experiments/train/mesh.py).
"""
from __future__ import annotations

import json
from typing import Callable

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.train import optimizer
from lra.spec import IGNORED


@flax.struct.dataclass
class TrainState:
  step: jax.Array          # int32 scalar: updates done
  params: nnx.State        # nnx.Param variables
  rest: nnx.State          # everything else in the model, e.g. its RNG state
  opt_state: optax.OptState


class Steps:
  """The compiled functions of a run: train step, evaluation step, placement, finiteness.

  They depend only on the model, optimiser and schedule (and the devices), so runs that differ
  in seed, data or length share them (`Steps.for_config`): a seed grid compiles once. The train
  step is compiled ahead of time per batch shape (`compiled_train`), so that its memory can be
  read before the first step and the same executable runs every step.
  """

  _cache: dict[str, "Steps"] = {}
  CACHE_SIZE = 4

  def __init__(self, graphdef, tx, schedule, grad_accum_steps: int, layout,
               length_bucket: int = 0):
    """`layout`: the run's mesh and shardings (experiments/train/mesh.py Layout)."""
    self.graphdef, self.tx, self.schedule = graphdef, tx, schedule
    self.grad_accum_steps, self.length_bucket = grad_accum_steps, length_bucket
    self.layout = layout
    # The new state is placed where the layout puts the state, so that it matches the donated
    # input it replaces; the metrics are scalars, on every device.
    self.train = jax.jit(self._train_step, donate_argnums=0)
    self.eval = jax.jit(self._eval_step, out_shardings=layout.replicated)
    self.eval_padded = jax.jit(self._eval_sums, out_shardings=layout.replicated)  # never bucketed
    self._compiled_train = {}
    self.all_finite = jax.jit(lambda tree: jnp.all(jnp.array(
        [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)])))

  def place(self, tree):
    """A copy of `tree` placed on the mesh as the layout says: the best model (the training
    state's buffers are donated to the next step). jax.device_put cannot place a process's
    arrays on other processes' devices; a compiled copy can."""
    # One function for every call: jax caches its compilations by function and shardings.
    return jax.jit(_copy, out_shardings=jax.tree.map(self.layout.state, tree))(tree)

  def create(self, make: Callable):
    """`make()` (the initial training state) computed where the layout places its arrays,
    each device making only its own pieces."""
    return jax.jit(make, out_shardings=jax.tree.map(self.layout.state, jax.eval_shape(make)))()

  @classmethod
  def for_config(cls, config, make: "Callable[[], Steps]") -> "Steps":
    key = json.dumps({"task": config.task, "model": config.model.to_dict(),
                      "optimizer": config.optimizer.to_dict(),
                      "schedule": config.schedule.to_dict(),
                      "grad_accum_steps": config.grad_accum_steps,
                      "length_bucket": config.length_bucket,
                      "devices": [d.id for d in jax.devices()],
                      "mesh": config.mesh.to_dict()}, sort_keys=True)
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
    return self.place((state.params, state.rest))

  def _grads(self, params, rest, batch):
    """Summed loss, correct count, target count and the gradient of the summed loss on one
    batch; the advanced model state."""
    # Parameters cut over fsdp: the model gathers each layer's just before it runs it
    # (attention_zoo/ops/fsdp.py), so the activations stay split over the batch.
    model = nnx.merge(self.graphdef, params, rest)

    def loss_fn(model):
      losses, correct, weights = score(model, batch, deterministic=False)
      return losses.sum(), (correct.sum(), weights.sum())

    (loss, (correct, count)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    _, _, rest = nnx.split(model, nnx.Param, ...)   # e.g. the dropout RNG has advanced
    return loss, correct, count, grads, rest

  def _micro_batches(self, batch, fn):
    """(micro-batches stacked along a new axis 0, f): f(*args, micro_batch) is fn(*args, batch)
    on one of them. Without length buckets micro-batch i is rows i, i + accum, ... (every
    device holds a share of each); with them, see the module's docstring."""
    accum = self.grad_accum_steps
    if not self.length_bucket:
      micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, accum, *x.shape[1:]), 0, 1), batch)
      return micro, fn
    micro, length_index = by_length(batch, accum, self.length_bucket)
    branches = [truncated(fn, length)
                for length in bucket_lengths(batch["inputs"].shape[1], self.length_bucket)]

    def at_its_length(*args):
      *leading, (micro_batch, index) = args
      return jax.lax.switch(index, branches, *leading, micro_batch)
    return (micro, length_index), at_its_length

  def _train_step(self, state: TrainState, batch):
    if self.grad_accum_steps == 1 and not self.length_bucket:
      loss, correct, count, grads, rest = self._grads(state.params, state.rest, batch)
    else:
      micro, grads_of = self._micro_batches(batch, self._grads)

      def add(carry, micro_batch):  # params ride in the carry: NNX needs them at the scan's level
        params, *sums, rest = carry
        *terms, rest = grads_of(params, rest, micro_batch)
        return (params, *jax.tree.map(jnp.add, sums, terms), rest), None

      zeros = jax.tree.map(jnp.zeros_like, state.params)
      carry = (state.params, 0.0, 0.0, 0.0, zeros, state.rest)
      (_, loss, correct, count, grads, rest), _ = jax.lax.scan(add, carry, micro)
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)   # the gradient of the mean loss
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    metrics = {"train_loss": loss / count, "train_accuracy": correct / count,
               "grad_norm": optax.global_norm(grads), "lr": self.schedule(state.step)}
    return self.layout.constrain(TrainState(
        step=state.step + 1, params=optax.apply_updates(state.params, updates), rest=rest,
        opt_state=opt_state)), metrics

  def _eval_sums(self, model_state, batch):
    params, rest = model_state
    model = nnx.merge(self.graphdef, params, rest)   # as in _grads
    losses, correct, weights = score(model, batch, deterministic=True)
    return {"loss": losses.sum(), "correct": correct.sum(), "count": weights.sum()}

  def _eval_step(self, model_state, batch):
    if not self.length_bucket:
      return self._eval_sums(model_state, batch)
    micro, sums_of = self._micro_batches(batch, self._eval_sums)
    sums = jax.lax.map(lambda micro_batch: sums_of(model_state, micro_batch), micro)
    return jax.tree.map(lambda x: x.sum(0), sums)

  def truncation_error(self, model_state, batch) -> float:
    """|bucketed - padded| / |padded| of the summed evaluation loss on `batch`: about 1e-7 in
    f32 where the model's outputs at real tokens ignore padding, far more where they do not."""
    bucketed = self.eval(model_state, batch)["loss"]
    padded = self.eval_padded(model_state, batch)["loss"]
    return float(jnp.abs(bucketed - padded) / jnp.maximum(jnp.abs(padded), 1e-30))


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


# -- length buckets ------------------------------------------------------------------------------

def bucket_lengths(length: int, bucket: int) -> tuple[int, ...]:
  """The lengths a micro-batch of `length` positions may be cut to: the multiples of `bucket`
  below `length`, then `length`."""
  return (*range(bucket, length, bucket), length)


def by_length(batch, groups: int, bucket: int):
  """The batch's rows sorted by real length, as `groups` micro-batches [groups, b / groups, ...],
  and for each the index into bucket_lengths of the shortest length that holds its longest row."""
  if "inputs2" in batch or batch["targets"].ndim != 1:
    raise ValueError("length_bucket cuts the inputs of a classifier of one input (targets [b]); "
                     "this task's batch has " + ("two inputs" if "inputs2" in batch
                                                 else "a target per token") + "; use 0")
  masks = batch["masks"]
  length = masks.shape[1]
  ends = jnp.max(jnp.where(masks, jnp.arange(1, length + 1), 0), axis=1)   # [b] last real + 1
  order = jnp.argsort(ends)
  micro = jax.tree.map(lambda x: x[order].reshape(groups, -1, *x.shape[1:]), batch)
  longest = ends[order].reshape(groups, -1).max(axis=1)                     # [groups]
  lengths = jnp.asarray(bucket_lengths(length, bucket))
  return micro, jnp.searchsorted(lengths, longest)   # the first length >= the longest row


def truncated(fn, length: int):
  """fn(*args, batch) on the batch's first `length` positions (inputs and masks [b, n])."""
  def cut(*args):
    *leading, batch = args
    return fn(*leading, {name: x[:, :length] if name in ("inputs", "masks") else x
                         for name, x in batch.items()})
  return cut


def make_steps(config, graphdef, layout) -> Steps:
  """The step functions of `config`'s model (`graphdef`) with its optimiser (config.optimizer)
  under its learning-rate schedule (config.schedule). The trainer keeps them per config
  (Steps.for_config); the efficiency benchmark compiles and times this same train step."""
  tx, schedule = optimizer.from_config(config)
  return Steps(graphdef, tx, schedule, config.grad_accum_steps, layout, config.length_bucket)


def initial_state(steps: Steps, params, rest) -> TrainState:
  """Step 0: the model's parameters and other state, and the optimiser's initial state (of
  shapes alone under jax.eval_shape)."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest,
                    opt_state=steps.tx.init(params))


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
