"""What a run records and where its results came from: the code (git commit), the software, the
device, the date; the files it writes, each atomically; and its metrics.

    environment() -> {"git_commit": ..., "versions": ..., "device": ..., ...}
    write_text(path, text)    # the old file or the new one, never a torn one
    with atomic_write(path, "wb") as f: ...   # the same for any writer (CSV, PNG; lra.fileio)
    save_figure(fig, path)    # a matplotlib figure as PNG (legend_beside: its legend outside)

A run's metrics go to `metrics.jsonl` (one JSON object per event, each with `step`) and to
TensorBoard event files (tensorboardX) under `tensorboard/`; only process 0 writes them. A
resumed run repeats the steps after its checkpoint, so `MetricsWriter.resume(step)` first
forgets what came after that step: in metrics.jsonl (rewritten atomically) and in TensorBoard,
whose events are written again from the kept metrics into a new event file before the old files
are removed. So neither shows a step twice. A run that starts from step 0 over an earlier one's
files (`start_fresh()`) renames them with a suffix .1 (older ones shift to .2, ...) instead of
deleting them.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import uuid
from pathlib import Path

import jax
from absl import logging

from lra.fileio import atomic_write

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
      "device_count": jax.device_count(),
      "host": f"{platform.machine()}, {os.cpu_count()} CPU cores",
      "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
  }


def write_text(path, text: str) -> None:
  with atomic_write(path, "w", encoding="utf-8") as f:
    f.write(text)


def write_json(path, value) -> None:
  write_text(path, json.dumps(value, indent=2) + "\n")


def pyplot():
  """matplotlib.pyplot on the Agg backend (no display needed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def legend_beside(ax, *handles_and_labels, **options):
  """The legend of `ax` to the right of it, top-aligned, where it covers no bar, curve or point
  (save_figure's image grows to hold it); `handles_and_labels` and `options` as ax.legend's."""
  return ax.legend(*handles_and_labels, loc="upper left", bbox_to_anchor=(1.01, 1), **options)


def save_figure(fig, path) -> Path:
  """Writes `fig` to the PNG `path` atomically (the old plot or the new one), then closes it;
  the image grows to hold a legend placed outside the axes."""
  fig.tight_layout()
  with atomic_write(path, "wb") as f:
    fig.savefig(f, format="png", dpi=120, bbox_inches="tight")
  pyplot().close(fig)
  return Path(path)


METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
RESULTS = "results.json"


class MetricsWriter:

  def __init__(self, workdir):
    self.enabled = jax.process_index() == 0
    self.workdir = Path(workdir)
    self.path = self.workdir / METRICS
    self._tensorboard = None

  def resume(self, step: int) -> None:
    """Continues a run restored at `step`: events after it and test results are forgotten."""
    if not self.enabled:
      return
    kept = [e for e in read_metrics(self.workdir)
            if e["step"] <= step and not any(k.startswith("test_") for k in e)]
    write_text(self.path, "".join(json.dumps(e) + "\n" for e in kept))
    folder = self.workdir / TENSORBOARD
    earlier = sorted(folder.glob("events.out.tfevents.*")) if folder.is_dir() else []
    self._open()
    for event in kept:
      self._add_scalars(event["step"], {k: float(v) for k, v in event.items() if k != "step"})
    self._tensorboard.flush()
    for path in earlier:   # only now: a crash before this leaves duplicates, never a gap
      path.unlink()

  def start_fresh(self, *, also: tuple[str, ...] = ()) -> str | None:
    """Starts at step 0. An earlier run's metrics.jsonl, tensorboard/ and results.json, and the
    files or folders named in `also`, are renamed to <name>.1 (older copies shift up); returns
    how they are named now, or None."""
    if not self.enabled:
      return None
    rotated = None
    paths = [self.workdir / name for name in (METRICS, TENSORBOARD, RESULTS, *also)]
    if read_metrics(self.workdir) or any(path.exists() for path in paths[2:]):
      rotated = rotate(paths)
    self._open()
    return rotated

  def _open(self) -> None:
    from tensorboardX import SummaryWriter

    # A name of its own: tensorboardX names files by the second and would overwrite a file
    # opened in the same second.
    self._tensorboard = SummaryWriter(str(self.workdir / TENSORBOARD),
                                      filename_suffix=f".{uuid.uuid4().hex[:8]}")

  def write(self, step: int, **scalars) -> None:
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    with open(self.path, "a", encoding="utf-8") as f:
      finite_or_text = {k: v if math.isfinite(v) else str(v) for k, v in scalars.items()}
      record = {"step": int(step), **finite_or_text}
      f.write(json.dumps(record) + "\n")
    self._add_scalars(step, scalars)
    self._tensorboard.flush()

  def _add_scalars(self, step: int, scalars: dict[str, float]) -> None:
    for name, value in scalars.items():
      self._tensorboard.add_scalar(name, value, step)

  def close(self) -> None:
    if self._tensorboard is not None:
      self._tensorboard.close()


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


def read_metrics(workdir) -> list[dict]:
  """The events of metrics.jsonl. A last line that is not JSON is the torn end of a write that
  was cut off: it is skipped with a warning. A bad line before it is an error."""
  path = Path(workdir) / METRICS
  if not path.exists():
    return []
  lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
  events = []
  for number, line in enumerate(lines, start=1):
    try:
      events.append(json.loads(line))
    except json.JSONDecodeError as e:
      if number < len(lines):
        raise ValueError(f"{path}: line {number} is not JSON ({e})") from None
      logging.warning("%s: skipping its last line, cut off in the middle of a write: %r", path,
                      line[:80])
  return events
