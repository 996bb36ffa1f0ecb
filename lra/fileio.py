"""Writing files so that an interruption never leaves a half-written one behind."""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


def temp_path(path: Path) -> Path:
  """A hidden sibling of `path`, unique to this process and call."""
  return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_write(path, mode: str = "w", **open_kwargs):
  """Open a temporary sibling of `path`; rename it onto `path` only if the block succeeds.

  On any exception (KeyboardInterrupt included) the temporary file is removed and `path`
  is left as it was.
  """
  path = Path(path)
  tmp = temp_path(path)
  try:
    with open(tmp, mode, **open_kwargs) as f:
      yield f
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
