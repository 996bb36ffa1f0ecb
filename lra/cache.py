"""A cache of tokenised splits: one `.npz` per (task, split, load parameters).

The first load of a split parses the source files and stores the arrays; later loads read
the `.npz` back if the fingerprint stored in it still matches: the paths, sizes and
modification times of the source files plus the load parameters. A changed source file
therefore rebuilds the entry. Entries are written to a temporary file and renamed, so an
interrupted write never leaves a partial entry.
"""
from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from lra.fileio import atomic_write

log = logging.getLogger("lra")

CACHE_VERSION = 2  # bump when the tokenisation, the splits or the stored arrays change
DEFAULT_DIR_NAME = ".lra_cache"
_FINGERPRINT_KEY = "_fingerprint"


def _digest(payload) -> str:
  return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def fingerprint(files: list[Path], root: Path, params: dict) -> str:
  """Hash of the load parameters and each file's path (relative to root when inside it),
  size and modification time."""
  entries = []
  for path in files:
    try:
      stat = path.stat()
      size, mtime = stat.st_size, stat.st_mtime_ns
    except OSError:  # a missing image is skipped by the reader; record it as missing
      size, mtime = -1, -1
    try:
      name = str(path.relative_to(root))
    except ValueError:
      name = str(path.absolute())
    entries.append((name, size, mtime))
  return _digest({"version": CACHE_VERSION, "params": params, "files": entries})


def cache_path(cache_dir: Path, params: dict) -> Path:
  """One file per task, split and set of load parameters (e.g. max_len)."""
  key = _digest({"version": CACHE_VERSION, "params": params})[:16]
  return Path(cache_dir) / f"{params['task']}-{params['split']}-{key}.npz"


def read(path: Path, expected_fingerprint: str) -> dict[str, np.ndarray] | None:
  """The arrays stored at `path`, or None if it is missing, stale or unreadable."""
  if not path.exists():
    return None
  try:
    with np.load(path, allow_pickle=False) as stored:
      if str(stored[_FINGERPRINT_KEY]) != expected_fingerprint:
        log.info("cache %s is stale: the source files or parameters changed", path)
        return None
      return {key: stored[key] for key in stored.files if key != _FINGERPRINT_KEY}
  except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
    log.warning("ignoring unreadable cache file %s (%s)", path, e)
    return None


def write(path: Path, fingerprint_: str, arrays: dict[str, np.ndarray]) -> None:
  """Store `arrays` at `path` atomically; a failure to write is logged, not raised."""
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "wb") as f:
      np.savez(f, **{_FINGERPRINT_KEY: np.array(fingerprint_)}, **arrays)
  except OSError as e:
    log.warning("could not write the cache file %s (%s); later loads will parse the "
                "source files again (pass cache_dir to put the cache elsewhere)", path, e)


def load_or_build(cache_dir: Path, params: dict, files: list[Path], root: Path,
                  build: Callable[[], dict]) -> dict[str, np.ndarray]:
  path = cache_path(cache_dir, params)
  expected = fingerprint(files, root, params)
  arrays = read(path, expected)
  if arrays is None:
    arrays = build()
    write(path, expected, arrays)
  return arrays
