"""What a run records: where its results came from (the code's git commit, the software, the
device, the date), and its files, each written atomically (the old file or the new one, never a
torn one).

    environment() -> {"git_commit": ..., "versions": ..., "device": ..., ...}
    write_text(path, text); write_json(path, value)
    with atomic_write(path, "wb") as f: ...   # the same for any writer (lra.fileio)
    rotate([path, ...])       # an earlier run's files kept as <name>.1 (older: .2, ...)
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

import jax

from lra.fileio import atomic_write

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


def write_text(path, text: str) -> None:
  with atomic_write(path, "w", encoding="utf-8") as f:
    f.write(text)


def write_json(path, value) -> None:
  write_text(path, json.dumps(value, indent=2) + "\n")


def rotate(paths: list[Path]) -> str:
  """Renames each existing path to <name>.1 after shifting <name>.i to <name>.i+1; the same
  suffix for all of them, so that the files of one earlier run keep one number."""
  free = 1
  while any(p.with_name(f"{p.name}.{free}").exists() for p in paths):
    free += 1
  for i in range(free - 1, 0, -1):
    for path in paths:
      older = path.with_name(f"{path.name}.{i}")
      if older.exists():
        older.rename(path.with_name(f"{path.name}.{i + 1}"))
  for path in paths:
    if path.exists():
      path.rename(path.with_name(f"{path.name}.1"))
  return ", ".join(f"{p.name}.1" for p in paths if p.with_name(f"{p.name}.1").exists())
