"""Writing files and folders so that an interruption never leaves a half-written one behind,
and the manifest a generator leaves beside the files it wrote."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path


def temp_path(path: Path) -> Path:
  """A hidden sibling of `path`, unique to this process and call."""
  return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_write(path, mode: str = "w", **open_kwargs):
  """Open a temporary sibling of `path` (its folder made if missing); once the block has
  succeeded, flush it to disk and rename it onto `path`. A reader or a crash sees the old file
  or the new one, never a torn one.

  On any exception (KeyboardInterrupt included) the temporary file is removed and `path`
  is left as it was.
  """
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = temp_path(path)
  try:
    with open(tmp, mode, **open_kwargs) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def ignore_interrupts() -> None:
  """A generator's worker processes' initializer: Ctrl-C reaches every process of the
  terminal's group, and the parent alone stops the run (and cleans up), so the workers need not
  each print a traceback."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)


MANIFEST_NAME = "generated.json"


@contextlib.contextmanager
def made_folder(folder):
  """Makes `folder` and its missing parents; if the block fails (KeyboardInterrupt included),
  removes those this call made, unless something else has been put in them."""
  folder = Path(folder)
  made = [path for path in (folder, *folder.parents) if not path.exists()]   # innermost first
  folder.mkdir(parents=True, exist_ok=True)
  try:
    yield folder
  except BaseException:
    for path in made:
      with contextlib.suppress(OSError):   # not empty: it stays, and so do its parents
        path.rmdir()
    raise


@contextlib.contextmanager
def staged_folder(target):
  """A hidden temporary folder beside `target` to write into. Once the block has succeeded, its
  files replace those of the same name in `target` (the manifest, MANIFEST_NAME, last), or it
  is renamed to `target` when that does not exist. On any exception (KeyboardInterrupt
  included) it is removed, and so are the folders above `target` that this call made: an
  interrupted generator leaves nothing behind."""
  target = Path(target)
  with made_folder(target.parent):
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
      yield staging
      if target.is_dir():
        (target / MANIFEST_NAME).unlink(missing_ok=True)   # it would describe the old files
        for path in sorted(staging.iterdir(), key=lambda p: p.name == MANIFEST_NAME):
          os.replace(path, target / path.name)
        staging.rmdir()
      else:
        staging.rename(target)
    except BaseException:
      shutil.rmtree(staging, ignore_errors=True)
      raise


def write_manifest(folder, *, generator: str, rules_version: int, seed: int, sizes: dict,
                   parameters: dict) -> Path:
  """Write `folder/generated.json`, the record of how a generator made the files beside it:
  generator name, version of its rules (bumped whenever they change what is written), seed,
  sizes, parameters and the UTC date. Written to a temporary file and renamed."""
  manifest = {
      "generator": generator,
      "rules_version": rules_version,
      "seed": seed,
      "sizes": sizes,
      "parameters": parameters,
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  path = Path(folder) / MANIFEST_NAME
  with atomic_write(path, "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=2, sort_keys=True)
    f.write("\n")
  return path


def read_manifest(folder) -> dict | None:
  """The generator manifest in `folder`, or None if there is none."""
  path = Path(folder) / MANIFEST_NAME
  if not path.exists():
    return None
  try:
    manifest = json.loads(path.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not a readable generator manifest ({e}); delete it or "
                     "generate the data again") from None
  if not isinstance(manifest, dict):
    raise ValueError(f"{path}: a generator manifest must be a JSON object, got "
                     f"{type(manifest).__name__}")
  return manifest
