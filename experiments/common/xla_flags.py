"""XLA flags set before JAX starts: one probe-and-set (`add_xla_flag`), and the CPU scheduler
setting every command and the tests use.

XLA's CPU scheduler that runs independent ops concurrently can deadlock (seen with jax 0.10.2 on
2 cores): a multi-layer train step of Performer with redraw=True (several LAPACK QR calls among
matmuls) then blocks forever in its first call. Turning it off, for every variant alike, avoids
that. It is an XLA_FLAGS entry, read when the backend starts, and an XLA that does not know it
aborts the process: so it is tried in a child process first.
"""
from __future__ import annotations

import os
import subprocess
import sys

CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def avoid_cpu_scheduler_deadlock() -> None:
  """Adds CPU_SCHEDULER_FLAG to XLA_FLAGS (before JAX starts) unless set already or XLA refuses
  it."""
  if not add_xla_flag(CPU_SCHEDULER_FLAG):
    print(f"note: this XLA refuses {CPU_SCHEDULER_FLAG}; running without it", file=sys.stderr)


def add_xla_flag(flag: str) -> bool:
  """Appends `flag` ("--name=value") to XLA_FLAGS before JAX starts, unless the name is set
  already or a child process shows that this XLA refuses it (XLA aborts on a flag it does not
  know); False when refused."""
  current = os.environ.get("XLA_FLAGS", "")
  if flag.split("=")[0] in current:
    return True
  flags_with = f"{current} {flag}".strip()
  probe = subprocess.run([sys.executable, "-c",
                          "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"],
                         env={**os.environ, "XLA_FLAGS": flags_with, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=300)
  if probe.returncode == 0:
    os.environ["XLA_FLAGS"] = flags_with
  return probe.returncode == 0
