"""What a task trains for, in one scoring rule for both kinds of task.

Classification (the LRA tasks): targets int [batch], one class per sequence.
Token prediction (the diagnostics, e.g. associative recall with a causal LM): targets int
[batch, length], the token expected at each position, IGNORED (-1) where nothing is asked.

`score` gives per-target losses, correctness and weights of one shape; a loss or an accuracy
is the weighted sum over the weight sum, so a masked token loss and a classification loss are
the same computation, and sums over micro-batches or devices stay exact.
"""
from __future__ import annotations

import jax.numpy as jnp
import optax

IGNORED = -1   # a target position with nothing to predict


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
