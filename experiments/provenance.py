"""Where a result came from: the code (git commit), the software, the device, the date; and
atomic writes for the files a run rewrites.

    environment() -> {"git_commit": ..., "jax_version": ..., "device": ..., ...}
    write_text(path, text)    # the old file or the new one, never a torn one
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import jax

REPO_ROOT = Path(__file__).resolve().parents[1]
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
      "host": f"{platform.machine()}, {os.cpu_count()} CPU cores",
      "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
  }


def write_text(path, text: str) -> None:
  """Writes `text` to `path` atomically: a temporary file in the same folder, flushed to disk,
  then renamed over `path`. A reader (or a crash) sees the old file or the new one."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(handle, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
  except BaseException:
    Path(temporary).unlink(missing_ok=True)
    raise


def write_json(path, value) -> None:
  write_text(path, json.dumps(value, indent=2) + "\n")
