"""How much memory a device has and how much a compiled program needs: one definition for the
trainer's memory check, the efficiency benchmark and the capacity table.

A compiled program's memory (XLA's `memory_analysis()`, per device) is

    total = arguments + outputs - aliased (donated buffers reused as outputs) + temporaries

and a device has its accelerator's memory, or on CPU the host's physical memory.
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax


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
