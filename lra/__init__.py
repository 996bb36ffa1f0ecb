"""The Long Range Arena tasks: task specs, readers of the official formats, generators, batches.

    import lra
    lra.available_tasks()        # ('listops', 'text', 'retrieval', 'image', 'pathfinder', 'pathx')
    lra.task_spec("listops")     # num_classes, max_len, vocab_size, dual, has_padding, ...
    ds = lra.load("listops", "train", data_dir="lra_release")
    ds.inputs, ds.masks, ds.targets           # int32 [N, L], bool [N, L], int32 [N]
    for batch in lra.iterate(ds, 32, shuffle=True, seed=0): ...
    report = lra.check_dataset(ds, max_skipped_fraction=0.01)  # fail fast; counts to log
    record = lra.provenance("listops", "lra_release")           # kind, files, fingerprint

The synthetic tasks (MQAR, MAD, state tracking, ...) are the package `synthetic`, which uses
this one's TaskSpec, Dataset and checks; this package knows only LRA.

Data can be generated in the official layout:
    python -m lra.generate listops --out DIR
    python -m lra.generate pathfinder --resolution 32 --difficulty hard --num 1000 --out DIR

This package knows nothing of models: it hands out numpy arrays.
"""
from lra.batching import iterate
from lra.checks import check_dataset
from lra.dataset import Dataset
from lra.listops import generate_listops
from lra.loader import load
from lra.provenance import provenance
from lra.readers import rgb_to_grayscale
from lra.spec import IGNORED, TaskSpec
from lra.tasks import (PATHFINDER_DIFFICULTIES, PATHFINDER_RESOLUTIONS, SPLITS, available_tasks,
                       task_spec)


def generate_pathfinder(out_dir, *, resolution: int = 32, difficulty: str = "hard", num: int,
                        seed: int = 0, workers: int = 1, progress: bool = True) -> str:
  """Write Pathfinder images in the official layout; see `lra.pathfinder_generator`.

  Writes `out_dir/pathfinder{resolution}/{difficulty folder}/{imgs,metadata,generated.json}`
  and returns that folder; `lra.load("pathfinder", split, data_dir=out_dir,
  resolution=...)` reads it.
  """
  from lra.pathfinder_generator import generate_pathfinder as generate  # imported on use

  return generate(out_dir, resolution=resolution, difficulty=difficulty, num=num, seed=seed,
                  workers=workers, progress=progress)


__all__ = [
    "Dataset", "IGNORED", "PATHFINDER_DIFFICULTIES", "PATHFINDER_RESOLUTIONS", "SPLITS",
    "TaskSpec", "available_tasks", "check_dataset", "generate_listops", "generate_pathfinder",
    "iterate", "load", "provenance", "rgb_to_grayscale", "task_spec",
]
