"""Device facts: what a compiled program needs and how long it takes, and what the device holds;
for the trainer's memory check and every benchmark mode alike. No project imports.

Memory. A compiled program's memory (XLA's `memory_analysis()`, per device) is

    total = arguments + outputs - aliased (donated buffers reused as outputs) + temporaries

and a device has its accelerator's memory, or on CPU the host's physical memory.

FLOPs. XLA's cost analysis counts a while loop's body once, so the FLOPs of a program that scans
over chunks with a matmul in the body are a lower bound (`loops_over_products` reads that from
the HLO text). The device's matmul speed (`matmul_gflops`, one square matmul, 2·n³ FLOPs) is the
yardstick for an attention kernel's FLOP rate.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """The memory of one compiled program, in bytes."""
  temp_bytes: int      # temporaries (activations kept for the backward pass, workspaces)
  buffer_bytes: int    # arguments + outputs - aliased

  @property
  def total_bytes(self) -> int:
    return self.temp_bytes + self.buffer_bytes


def compiled_memory(compiled) -> CompiledMemory | None:
  """The memory a compiled program needs; None on a backend without the analysis."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return None
  return CompiledMemory(
      temp_bytes=int(analysis.temp_size_in_bytes),
      buffer_bytes=int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                       - analysis.alias_size_in_bytes))


def memory_stats(device=None) -> dict | None:
  """The allocator's statistics (bytes_limit, peak_bytes_in_use, ...), or None where the
  backend keeps none (CPU)."""
  device = device or jax.devices()[0]
  try:
    return device.memory_stats()
  except Exception:   # backends without allocator statistics (some CPU builds) raise
    return None


def device_memory_bytes() -> float:
  """What the device holds: an accelerator's memory, or the host's physical memory on CPU."""
  stats = memory_stats()
  if stats and stats.get("bytes_limit"):
    return float(stats["bytes_limit"])
  try:
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
  except (ValueError, OSError, AttributeError):
    return math.inf


def free_host_bytes() -> float:
  """The host memory free now (what a CPU run can take without pushing others out)."""
  try:
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
  except (ValueError, OSError, AttributeError):
    return device_memory_bytes()


def is_out_of_memory(error: BaseException) -> bool:
  """Whether an exception is XLA running out of device memory."""
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def median_call_s(fn, *args, repeats: int = 5) -> float:
  """Median seconds of `repeats` calls of a compiled fn(*args), after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def matmul_gflops(n: int = 4096, dtype: str = "float32", repeats: int = 5) -> float:
  """GFLOP/s of an n x n by n x n matmul (2·n³ FLOPs) on the default device, median of `repeats`."""
  a, b = jax.random.normal(jax.random.key(0), (2, n, n), jnp.dtype(dtype))
  product = jax.jit(jnp.matmul).lower(a, b).compile()
  return 2 * n ** 3 / median_call_s(product, a, b, repeats=repeats) / 1e9


def loops_over_products(compiled) -> bool:
  """Whether a while loop's body (or what it calls) holds a dot or a convolution."""
  try:
    hlo = compiled.as_text()
  except Exception:   # no HLO text on this backend: say nothing
    return False
  computations, current = {}, None
  for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" "):   # "[ENTRY ]%name (args) -> type {"
      current = line.removeprefix("ENTRY ").split()[0].lstrip("%")
      computations[current] = []
    elif current is not None and line.startswith(" "):
      computations[current].append(line)
  calls = {name: {ref for line in lines for ref in re.findall(r"%([\w.\-]+)", line)
                 if ref in computations}
           for name, lines in computations.items()}
  has_product = {name: any(re.search(r"\b(dot|convolution)\(", line) for line in lines)
                 for name, lines in computations.items()}
  todo = [body for lines in computations.values() for line in lines if " while(" in line
          for body in re.findall(r"body=%([\w.\-]+)", line)]
  seen = set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    if has_product.get(name):
      return True
    todo.extend(calls.get(name, ()))
  return False


@dataclasses.dataclass(frozen=True)
class Facts:
  """What compiling a program tells before it runs."""
  memory: CompiledMemory | None
  flops: float | None      # XLA's cost analysis
  flops_in_loops: bool     # a loop runs products: `flops` is a lower bound


def compile_facts(compiled) -> Facts:
  """Memory, FLOPs (XLA's cost analysis) and whether a loop undercounts them."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):   # older jax returns one dict per computation
    cost = cost[0] if cost else None
  flops = None if not cost or "flops" not in cost else float(cost["flops"])
  return Facts(compiled_memory(compiled), flops, loops_over_products(compiled))
