"""Evaluation of a model state on a split's batches: loss, accuracy and example count, with a
progress bar (an evaluation of a long split takes minutes on a CPU)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from tqdm import tqdm

from experiments.train import data as data_lib


def evaluate(eval_step, model_state, batches, *, layout, before_batch, description: str,
             total: int | None, show: bool) -> dict[str, float]:
  """Sums `eval_step(model_state, batch)` over `batches` (placed as `layout` says), calling
  `before_batch()` before each (Ctrl-C is taken there); a bar named `description` counts the
  batches (of `total`, when known) where `show`."""
  totals = None
  with tqdm(batches, total=total, desc=description, unit="batch", disable=not show,
            mininterval=2) as bar:
    for batch in bar:
      before_batch()
      sums = eval_step(model_state, data_lib.to_device(batch, layout))
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  totals = jax.device_get(totals)
  return {"loss": float(totals["loss"] / totals["count"]),
          "accuracy": float(totals["correct"] / totals["count"]),
          "examples": int(totals["count"])}


def batch_count(num_examples: int, config, split: str) -> int:
  """How many batches an evaluation of `split` reads (for the progress bar)."""
  size = data_lib.eval_batch_size(config)
  whole = (num_examples // size if split == "test" and config.test_drop_last
           else math.ceil(num_examples / size))
  return min(whole, config.eval_batches) if split == "validation" and config.eval_batches \
      else whole
