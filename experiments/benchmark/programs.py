"""The programs a measurement compiles and times, known from shapes before anything exists, and
how they are timed under a budget.

Every program is compiled from ShapeDtypeStructs (nnx.eval_shape, jax.eval_shape), so its
memory and FLOPs are known before an array of it exists, and the parameters' bytes are known
before it is even compiled; `Workload.create()` makes the arrays once the measurement has
decided to run. Times are medians of `repeats` calls after `warmup` calls; a measurement that
would exceed the time budget, predicted or after its first call, stops there (OverBudget).
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable

import jax


@dataclasses.dataclass
class Program:
  jitted: Any      # a jax.jit-wrapped function
  shapes: tuple    # its arguments as ShapeDtypeStructs
  mesh: Any = None   # the jax.sharding.Mesh it is traced under (jax.set_mesh), if any

  def compile(self):
    with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
      return self.jitted.lower(*self.shapes).compile()


@dataclasses.dataclass
class Workload:
  """What one (variant, length) measures."""
  programs: dict[str, Program]   # compiled and timed in this order; the last is the main one
  resident_bytes: int            # parameters, plus the optimiser state in train mode
  create: Callable[[], Any]      # -> the inputs of the first call, as arrays
  step: Callable                 # (program name, compiled, inputs) -> (result, next inputs)
  options: dict                  # the variant's attention options as built
  exact: bool                    # computes exact attention (a FLOP rate is meaningful)
  # attention mode, an exact variant: (forward+backward's FLOPs as attention_flops counts them,
  # over the pairs the pattern keeps; how they were counted)
  nominal_flops: tuple[float, str] | None

  @property
  def main(self) -> str:
    return list(self.programs)[-1]


def call(compiled, *args):
  """One call of a compiled program (asynchronous); the one place programs are called, so that
  tests can make a call fail."""
  return compiled(*args)


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


class OverBudget(Exception):
  """A measurement that would take longer than the time budget."""


def time_calls(workload: Workload, program: str, compiled, inputs, *, warmup: int,
               repeats: int, budget_s: float, predicted_call_s: float | None = None):
  """-> (median ms, first-call ms, the inputs of the next call). Raises OverBudget before
  running when the prediction exceeds the budget, or after the first call when it does."""
  calls = warmup + repeats
  if predicted_call_s is not None and predicted_call_s * calls > budget_s:
    raise OverBudget(f"predicted {calls} x {predicted_call_s:.3g} s > time budget {budget_s:g} s"
                     " (not run)")
  times = []
  for i in range(calls):
    start = time.perf_counter()
    result, inputs = workload.step(program, compiled, inputs)
    jax.block_until_ready((result, inputs))
    times.append(time.perf_counter() - start)
    del result
    if i == 0 and times[0] * calls > budget_s:
      raise OverBudget(f"first call {times[0]:.3g} s x {calls} calls > time budget {budget_s:g} s")
  return 1e3 * statistics.median(times[warmup:]), 1e3 * times[0], inputs
