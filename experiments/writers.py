"""Where a run's metrics go: `metrics.jsonl` (one JSON object per event, each with `step`),
TensorBoard event files (tensorboardX) under `tensorboard/`. Only process 0 writes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import jax

from experiments import provenance


class MetricsWriter:

  def __init__(self, workdir):
    self.enabled = jax.process_index() == 0
    self.path = Path(workdir) / "metrics.jsonl"
    self._tensorboard = None
    if self.enabled:
      from tensorboardX import SummaryWriter

      self._tensorboard = SummaryWriter(str(Path(workdir) / "tensorboard"))

  def write(self, step: int, **scalars) -> None:
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    with open(self.path, "a", encoding="utf-8") as f:
      record = {"step": int(step), **{k: v if math.isfinite(v) else str(v) for k, v in scalars.items()}}
      f.write(json.dumps(record) + "\n")
    for name, value in scalars.items():
      self._tensorboard.add_scalar(name, value, step)
    self._tensorboard.flush()

  def drop_after(self, step: int) -> None:
    """Forget events after `step` and test results (a resumed run repeats them)."""
    if self.enabled and self.path.exists():
      events = [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip()]
      kept = [json.dumps(e) for e in events
              if e["step"] <= step and not any(k.startswith("test_") for k in e)]
      provenance.write_text(self.path, "".join(line + "\n" for line in kept))

  def close(self) -> None:
    if self._tensorboard is not None:
      self._tensorboard.close()


def read_metrics(workdir) -> list[dict]:
  path = Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
