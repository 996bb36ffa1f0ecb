"""Writing files so that an interruption never leaves a half-written one behind, and the
manifest a generator leaves beside the files it wrote."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
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


MANIFEST_NAME = "generated.json"


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
