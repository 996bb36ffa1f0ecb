"""Where a task's data came from, for a training run to record beside its results."""
from __future__ import annotations

import collections
from pathlib import Path

from lra import cache as cache_lib
from lra import listops, readers
from lra.fileio import read_manifest
from lra.loader import reader, resolve_options
from lra.tasks import SPLITS, pathfinder_dir

_SPLIT_RULES = {
    "listops": "the files basic_train / basic_val / basic_test",
    "text": (f"IMDb test is test; validation is {readers.TEXT_VALIDATION_FRACTION:.0%} of "
             "IMDb train, chosen by SHA-256 of the text (never a text also in test), train the "
             "rest"),
    "retrieval": "the files new_aan_pairs.train / eval / test",
    "image": "CIFAR-10 test is test; the training images split 90/10 in order into train / "
             "validation",
    "pathfinder": "80/10/10 in metadata order",
    "pathx": "80/10/10 in metadata order",
}
_TFDS_NAMES = {"text": "imdb_reviews", "image": "cifar10"}
_COLLAPSE = 10  # more files than this of one folder and suffix are listed as one pattern


def _generator_folder(task: str, root: Path, options: dict) -> Path | None:
  """Where a generator of this package leaves its manifest for `task`, if it has one."""
  if task == "listops":
    return root / listops.DIR_NAME
  if task in ("pathfinder", "pathx"):
    return pathfinder_dir(root, options["resolution"], options["difficulty"])
  return None


def _relative(path: Path, root: Path) -> str:
  try:
    return path.relative_to(root).as_posix()
  except ValueError:
    return path.absolute().as_posix()


def summarise_files(paths: list[Path], root: Path) -> dict[str, int]:
  """{relative path: 1} per file, except that a folder's files of one suffix, when there
  are more than 10, become one entry {"folder/*.suffix": how many of them were read}."""
  groups = collections.defaultdict(list)
  for path in paths:
    groups[path.parent, path.suffix].append(path)
  summary = {}
  for (folder, suffix), members in groups.items():
    if len(members) > _COLLAPSE:
      summary[_relative(folder, root) + f"/*{suffix}"] = len(members)
    else:
      summary.update((_relative(path, root), 1) for path in members)
  return dict(sorted(summary.items()))


def _tfds_info(name: str) -> dict:
  info = {"name": name, "version": None, "data_dir": None}
  try:
    import tensorflow_datasets as tfds

    builder = tfds.builder(name)
  except ImportError:  # TFDS or TensorFlow missing: unknown here; the load says what to install
    return info
  info.update(version=str(builder.version), data_dir=str(builder.data_dir))
  return info


def provenance(task: str, data_dir=None, *, max_len: int | None = None,
               resolution: int | None = None, difficulty: str | None = None,
               download: bool = False, closing_brackets: bool | None = None) -> dict:
  """Where `lra.load(task, split, data_dir, ...)` takes the data of all three splits from.

  Takes `lra.load`'s options (those that change what is read) and returns a JSON-ready dict:
    task, data_dir (absolute, or None), load_options (max_len, and resolution / difficulty
      for Pathfinder / Path-X), splits (how the three splits are formed);
    kind: "generated" (files with the manifest of this package's generator),
      "official files" (files without one) or "tfds" (TFDS, no local files);
    files: {path relative to data_dir: 1}, a folder's many files of one suffix as
      {"folder/*.suffix": count}; num_files;
    fingerprint: the cache's fingerprint (paths, sizes and modification times of every file
      read, and the load options): equal fingerprints mean the same data was read;
    generator: the generator's manifest (generator, rules_version, seed, sizes, parameters,
      created) when kind is "generated", else None;
    tfds: {name, version, data_dir} when kind is "tfds" (version and data_dir None when
      tensorflow_datasets is not installed), else None.
  Raises what `lra.load` raises for missing files or bad options.
  """
  spec, params, options = resolve_options(task, max_len, resolution, difficulty, download,
                                          closing_brackets)
  sources = [reader(task)(data_dir, split, spec.max_len, **options) for split in SPLITS]
  root = Path(data_dir) if data_dir is not None else None
  record = {"task": task, "data_dir": str(root.absolute()) if root else None,
            "load_options": params, "splits": _SPLIT_RULES[task], "generator": None,
            "tfds": None}
  if any(source.files is None for source in sources):
    tfds = _tfds_info(_TFDS_NAMES[task])
    fingerprint = cache_lib.fingerprint([], Path("."), {"task": task, **params, "tfds": tfds})
    return {**record, "kind": "tfds", "files": {}, "num_files": 0, "fingerprint": fingerprint,
            "tfds": tfds}
  files = sorted({path for source in sources for path in source.files})
  folder = _generator_folder(task, root, options)
  manifest = read_manifest(folder) if folder is not None else None
  return {**record, "kind": "generated" if manifest else "official files",
          "files": summarise_files(files, root), "num_files": len(files),
          "fingerprint": cache_lib.fingerprint(files, root, {"task": task, **params}),
          "generator": manifest}
