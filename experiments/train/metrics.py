"""A run's metrics: `metrics.jsonl` (one JSON object per event, each with `step`) and
TensorBoard event files (tensorboardX) under `tensorboard/`; only process 0 writes them.

A resumed run repeats the steps after its checkpoint, so `MetricsWriter.resume(step)` first
forgets what came after that step: in metrics.jsonl (rewritten atomically) and in TensorBoard,
whose events are written again from the kept metrics into a new event file before the old files
are removed. So neither shows a step twice. A run that starts from step 0 over an earlier one's
files (`start_fresh()`) renames them with a suffix .1 (older ones shift to .2, ...) instead of
deleting them.
"""
from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import jax

from experiments.common.records import METRICS, read_metrics, rotate, write_text

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
