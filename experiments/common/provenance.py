"""Where a run's results came from: the code's git commit, the software, the device, the date.
Importing it starts JAX (the device); writing the records is experiments.common.records, which
does not.

    environment() -> {"git_commit": ..., "versions": ..., "device": ..., ...}
"""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import jax

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def git_commit() -> str | None:
  """The checkout's HEAD commit, with "+dirty" when tracked files differ from it; None outside
  a git checkout."""
  def git(*args):
    return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True,
                          timeout=30)
  try:
    head = git("rev-parse", "HEAD")
    if head.returncode:
      return None
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return head.stdout.strip() + ("+dirty" if dirty else "")


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def environment() -> dict:
  device = jax.devices()[0]
  return {
      "git_commit": git_commit(),
      "versions": {p: _version(p) for p in PACKAGES},
      "python": platform.python_version(),
      "device": f"{jax.device_count()} x {getattr(device, 'device_kind', '') or device.platform}"
                f" ({device.platform})",
      "process_count": jax.process_count(),
      "device_count": jax.device_count(),
      "host": f"{platform.machine()}, {os.cpu_count()} CPU cores",
      "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
  }
