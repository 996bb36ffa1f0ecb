"""Plot helpers: matplotlib without a display, legends beside the axes, figures written
atomically as PNG."""
from __future__ import annotations

from pathlib import Path

from lra.fileio import atomic_write


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
