"""`lra.load`: one split of one task, read from the official formats (and cached)."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from lra import cache as cache_lib
from lra import readers
from lra.checks import check_dataset, check_generated_count
from lra.dataset import Dataset
from lra.spec import TaskSpec
from lra.tasks import check_split, task_spec

log = logging.getLogger("lra")

_READERS = {
    "listops": readers.read_listops,
    "text": readers.read_text,
    "retrieval": readers.read_retrieval,
    "image": readers.read_image,
    "pathfinder": readers.read_pathfinder,
    "pathx": readers.read_pathfinder,
}
_PIXEL_TASKS = ("pathfinder", "pathx")
_TFDS_TASKS = ("text", "image")


def load(name: str, split: str, data_dir=None, max_len: int | None = None, cache_dir=None, *,
         cache: bool = True, resolution: int | None = None, difficulty: str | None = None,
         download: bool = False, closing_brackets: bool | None = None) -> Dataset:
  """Load one split of an LRA task (the synthetic tasks load with `synthetic.load`).

  Args:
    name: one of `lra.available_tasks()`.
    split: "train", "validation" or "test".
    data_dir: root of an unpacked official `lra_release` archive, or of files written by
      `python -m lra.generate`. Text and Image look there for `aclImdb/` and
      `cifar-10-batches-py/` and otherwise read TFDS `imdb_reviews` / `cifar10`. Text's
      validation split is 10% of IMDb's training reviews, chosen by a hash of their text
      (`lra.readers.text_validation_mask`); train is the other 90%.
    max_len: tokens per input (per document for retrieval); default `task_spec(name).max_len`.
      Longer inputs are cut, shorter ones padded (masks False on padding).
    cache_dir: where tokenised splits are cached; default `data_dir/.lra_cache`. (The TFDS
      fallback is not cached: TFDS keeps its own prepared copy.)
    cache: set False to always parse the source files.
    resolution, difficulty: Pathfinder / Path-X only: image side (32, 64, 128, 256;
      default 32 for pathfinder, 128 for pathx) and "easy" | "intermediate" | "hard"
      (default "hard", as LRA).
    download: Text / Image TFDS fallback only: let TFDS download and prepare the data set
      if it is not prepared yet (off by default: this package never downloads unasked).
    closing_brackets: ListOps only. False drops every `]` token, as LRA's input pipeline did
      before 2021-03-04 (its tokenizer kept only alphanumeric characters): the sequence keeps
      the operators and digits, and no longer says where an operator's arguments end.
      Default (None, True): kept.

  Returns:
    A `Dataset` with `inputs` int32 [N, L], `masks` bool [N, L], `targets` int32 [N]
    (and `inputs2`, `masks2` for retrieval), `spec`, the task spec as loaded, `source`, and
    the counts `num_truncated` and `num_skipped`. It has passed `lra.check_dataset` without
    the ceiling on skipped examples: a trainer calls that with its ceiling.

  Raises:
    FileNotFoundError: missing files (the message says how to get them).
    ValueError: bad options, malformed files (naming the file and line), an empty split,
      targets or token ids out of range, a split of generated files whose count differs from
      the one in the generator's manifest (`generated.json`).
  """
  spec, params, options = resolve_options(name, max_len, resolution, difficulty, download,
                                          closing_brackets)
  check_split(split)
  params = {"task": name, "split": split, **params}
  source = _READERS[name](data_dir, split, spec.max_len, **options)
  if cache and source.files is not None:
    root = Path(data_dir)
    cache_dir = Path(cache_dir) if cache_dir is not None else root / cache_lib.DEFAULT_DIR_NAME
    arrays = cache_lib.load_or_build(cache_dir, params, source.files, root, source.build)
  else:
    arrays = source.build()
  counts = {key: int(arrays.pop(key, 0)) for key in ("num_truncated", "num_skipped")}
  skipped = tuple(str(path) for path in arrays.pop("skipped_examples", ()))
  ds = Dataset(spec=spec, split=split, source=source.description, skipped_examples=skipped,
               **counts, **arrays)
  if ds.num_skipped:  # logged on every load, cached or not
    log.warning("%s: skipped %d empty or unreadable examples of the %s split, e.g. %s",
                ds.source, ds.num_skipped, split, ", ".join(skipped))
  if source.expected is not None:
    check_generated_count(ds, *source.expected)
  check_dataset(ds, max_skipped_fraction=None)
  return ds


def resolve_options(name: str, max_len=None, resolution=None, difficulty=None,
                    download: bool = False, closing_brackets=None
                    ) -> tuple[TaskSpec, dict, dict]:
  """Checks `lra.load`'s options for task `name`; returns the spec as loaded, the
  parameters that key the cache, and the keyword options of the task's reader."""
  spec = task_spec(name)
  options, params = {}, {}
  if name in _PIXEL_TASKS:
    resolution = spec.image_size if resolution is None else resolution
    difficulty = "hard" if difficulty is None else difficulty
    readers.check_pathfinder_options(resolution, difficulty)
    options = {"resolution": resolution, "difficulty": difficulty}
    params.update(options)
    spec = dataclasses.replace(spec, image_size=resolution, max_len=resolution * resolution)
  elif resolution is not None or difficulty is not None:
    raise ValueError(f"resolution and difficulty apply only to {_PIXEL_TASKS}, not {name!r}")
  if closing_brackets is not None:
    if name != "listops" or not isinstance(closing_brackets, (bool, np.bool_)):
      raise ValueError(f"closing_brackets is True or False, for listops only; got "
                       f"{closing_brackets!r} for {name!r}")
    if not closing_brackets:   # the default (kept) stays out of the cache key
      options["closing_brackets"] = params["closing_brackets"] = False
  if name in _TFDS_TASKS:
    options["download"] = download
  elif download:
    raise ValueError(f"download applies only to the TFDS fallback of {_TFDS_TASKS}; "
                     f"{name!r} is read from data_dir")

  max_len = spec.max_len if max_len is None else max_len
  if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
    raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
  max_len = int(max_len)
  params["max_len"] = max_len
  has_padding = spec.has_padding
  if spec.image_size and max_len > spec.image_size ** 2:
    has_padding = True  # pixels padded up to max_len
  return dataclasses.replace(spec, max_len=max_len, has_padding=has_padding), params, options


def reader(name: str):
  """The reader of task `name`: (data_dir, split, max_len, **options) -> readers.Source."""
  return _READERS[name]
