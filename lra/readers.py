"""Readers of the official LRA file formats, one per task.

Each reader checks that its files exist (naming the exact path and how to get it) and
returns a `Source`: the files whose fingerprint keys the cache, and `build()`, which parses
them into arrays. The README's Data section lists the files each task reads.
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image
from tqdm import tqdm

from lra import listops
from lra.tasks import PATHFINDER_DIFFICULTIES, PATHFINDER_RESOLUTIONS

log = logging.getLogger("lra")

RELEASE_HINT = ("It is part of the official LRA release: download lra_release.gz (linked from "
                "the README of https://github.com/google-research/long-range-arena), unpack it "
                "and pass the unpacked root as data_dir.")
RETRIEVAL_FILES = {"train": "new_aan_pairs.train.tsv", "validation": "new_aan_pairs.eval.tsv",
                   "test": "new_aan_pairs.test.tsv"}
RETRIEVAL_BYTE_CUT = 10_000  # each document is cut to this many bytes before max_len
CIFAR_DIR = "cifar-10-batches-py"
IMDB_DIR = "aclImdb"
DATA_EXTRA_HINT = 'pip install -e ".[data]"'


@dataclasses.dataclass
class Source:
  """Where one split comes from. `files` is None when it is not read from local files
  (the TFDS fallback), which then is not cached."""

  files: list[Path] | None
  build: Callable[[], dict]


def _require(path: Path, what: str, how: str) -> Path:
  if not path.exists():
    raise FileNotFoundError(f"{what} not found: expected {path}. {how}")
  return path


def _require_data_dir(data_dir, what: str, how: str) -> Path:
  if data_dir is None:
    raise ValueError(f"{what} is read from data_dir, but data_dir is None. {how}")
  return Path(data_dir)


def _bad_row(path: Path, lineno: int, message: str) -> ValueError:
  return ValueError(f"{path}, line {lineno}: {message}")


def _pack(rows: list[bytes], max_len: int, dtype, offset: int = 0) -> dict:
  """One byte string per example -> {'tokens': dtype [N, max_len], 'lengths': int32 [N]}:
  each byte (plus `offset`, 1 for the byte+1 encoding) is a token, cut to max_len and
  left-aligned, zeros after."""
  tokens = np.zeros((len(rows), max_len), dtype)
  lengths = np.zeros(len(rows), np.int32)
  for i, row in enumerate(rows):
    ids = np.frombuffer(row[:max_len], np.uint8).astype(dtype)
    tokens[i, :len(ids)] = ids + offset
    lengths[i] = len(ids)
  return {"tokens": tokens, "lengths": lengths}


# ---------------------------------------------------------------------------------- ListOps

def read_listops(data_dir, split: str, max_len: int) -> Source:
  how = (f"Generate it with `python -m lra.generate listops --out {data_dir or 'DIR'}` "
         f"(LRA sizes by default; --num_train/--num_val/--num_test to change). {RELEASE_HINT}")
  root = _require_data_dir(data_dir, "ListOps", how)
  path = _require(root / listops.DIR_NAME / listops.SPLIT_FILES[split], "ListOps file", how)
  return Source([path], lambda: _parse_listops(path, max_len))


def _parse_listops(path: Path, max_len: int) -> dict:
  rows, targets = [], []
  with open(path, encoding="utf-8", newline="") as f:
    header = f.readline().rstrip("\r\n")
    if header.split("\t") != ["Source", "Target"]:
      raise _bad_row(path, 1, f"expected the header 'Source<TAB>Target', got {header!r}")
    for lineno, line in enumerate(f, start=2):
      line = line.rstrip("\r\n")
      if not line.strip():
        continue
      fields = line.split("\t")
      if len(fields) != 2:
        raise _bad_row(path, lineno, "expected 2 tab-separated fields (Source, Target), "
                                     f"got {len(fields)}")
      source, target = fields
      if target.strip() not in listops.DIGITS:
        raise _bad_row(path, lineno, f"Target must be an integer 0-9, got {target!r}")
      try:
        ids = bytes(map(listops.TOKEN_IDS.__getitem__, listops.tokenize(source)))
      except KeyError as e:
        raise _bad_row(path, lineno, f"unknown token {e.args[0]!r}; ListOps tokens are "
                                     f"{' '.join(listops.VOCAB[1:])}") from None
      if not ids:
        raise _bad_row(path, lineno, "empty Source expression")
      rows.append(ids)
      targets.append(int(target))
  return {**_pack(rows, max_len, np.uint8), "targets": np.array(targets, np.int32)}


# -------------------------------------------------------------------------------- Retrieval

def read_retrieval(data_dir, split: str, max_len: int) -> Source:
  root = _require_data_dir(data_dir, "Retrieval (AAN)", RELEASE_HINT)
  path = _require(root / "tsv_data" / RETRIEVAL_FILES[split], "Retrieval (AAN) file",
                  RELEASE_HINT)
  return Source([path], lambda: _parse_retrieval(path, max_len))


def _parse_retrieval(path: Path, max_len: int) -> dict:
  cut = min(RETRIEVAL_BYTE_CUT, max_len)
  docs1, docs2, targets = [], [], []
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, start=1):
      line = line.rstrip(b"\r\n")
      if not line.strip():
        continue
      fields = line.split(b"\t")
      if len(fields) != 5:
        raise _bad_row(path, lineno, "expected 5 tab-separated fields (label, id1, id2, "
                                     f"text1, text2), got {len(fields)}")
      try:
        label = float(fields[0])
      except ValueError:
        label = None
      if label not in (0.0, 1.0):
        raise _bad_row(path, lineno, f"label must be 0.0 or 1.0, got {fields[0]!r}")
      targets.append(int(label))
      docs1.append(fields[3][:cut])
      docs2.append(fields[4][:cut])
  first, second = _pack(docs1, max_len, np.uint16, 1), _pack(docs2, max_len, np.uint16, 1)
  return {**first, "tokens2": second["tokens"], "lengths2": second["lengths"],
          "targets": np.array(targets, np.int32)}


# ------------------------------------------------------------------------------------- Text

def read_text(data_dir, split: str, max_len: int, download: bool = False) -> Source:
  imdb = Path(data_dir) / IMDB_DIR if data_dir is not None else None
  if imdb is None or not imdb.exists():
    return Source(None, lambda: _text_from_tfds(split, max_len, download, imdb))
  folder = imdb / ("train" if split == "train" else "test")  # validation = test (reference)
  files, targets = [], []
  for label, name in enumerate(("neg", "pos")):
    class_dir = _require(folder / name, "IMDb review folder",
                         f"Unpack aclImdb_v1.tar.gz so that {imdb} holds train/ and test/.")
    found = sorted(class_dir.glob("*.txt"))
    files += found
    targets += [label] * len(found)
  if not files:
    raise FileNotFoundError(f"no *.txt reviews in {folder}/neg or {folder}/pos")

  def build():
    texts = [p.read_bytes().strip() for p in tqdm(files, desc=f"text/{split}", disable=None)]
    return {**_pack(texts, max_len, np.uint16, 1), "targets": np.array(targets, np.int32)}

  return Source(files, build)


def _tfds_load(name: str, split: str, download: bool, local_hint: str) -> dict:
  try:
    import tensorflow_datasets as tfds
  except ImportError:
    raise ImportError(
        f"tensorflow_datasets is needed to read TFDS {name!r}: install it with "
        f"`{DATA_EXTRA_HINT}`, or {local_hint}") from None
  try:
    data = tfds.load(name, split=split, batch_size=-1, download=download)
  except AssertionError as e:  # TFDS asserts when the prepared data is missing
    raise FileNotFoundError(
        f"TFDS {name!r} is not prepared ({e}). Prepare it with "
        f"lra.load(..., download=True) or tfds.builder({name!r}).download_and_prepare(), "
        f"or {local_hint}") from None
  return tfds.as_numpy(data)


def _text_from_tfds(split: str, max_len: int, download: bool, imdb: Path | None) -> dict:
  hint = (f"unpack aclImdb (aclImdb/{{train,test}}/{{pos,neg}}/*.txt) so that it is "
          f"{imdb if imdb else 'DATA_DIR/aclImdb'} and pass data_dir.")
  data = _tfds_load("imdb_reviews", "train" if split == "train" else "test", download, hint)
  return {**_pack([bytes(t) for t in data["text"]], max_len, np.uint16, 1),
          "targets": data["label"].astype(np.int32)}


# ------------------------------------------------------------------------------------ Image

def rgb_to_grayscale(rgb: np.ndarray) -> np.ndarray:
  """uint8 [..., 3] -> uint8 [...], exactly as TF's `tf.image.rgb_to_grayscale`.

  TF converts to float32 in [0, 1] (x * float32(1/255)), takes 0.2989 R + 0.5870 G +
  0.1140 B summed in that order, and converts back by * 255.5 and truncation. Summing in
  another order (e.g. a BLAS matmul) or in float64 changes a few hundred of the 2^24
  colours by one level; this order matches TF 2.21 on all of them.
  """
  x = rgb.astype(np.float32) * np.float32(1 / 255)
  r, g, b = x[..., 0], x[..., 1], x[..., 2]
  gray = r * np.float32(0.2989) + g * np.float32(0.5870) + b * np.float32(0.1140)
  return (gray * np.float32(255.5)).astype(np.uint8)


def _pixels(images: np.ndarray, max_len: int) -> dict:
  """uint8 [N, H, W] -> row-major pixel tokens [N, max_len] (cut, or zero-padded)."""
  flat = images.reshape(len(images), -1)
  length = min(flat.shape[1], max_len)
  tokens = np.zeros((len(flat), max_len), np.uint8)
  tokens[:, :length] = flat[:, :length]
  return {"tokens": tokens, "lengths": np.full(len(flat), length, np.int32)}


def read_image(data_dir, split: str, max_len: int, download: bool = False) -> Source:
  folder = Path(data_dir) / CIFAR_DIR if data_dir is not None else None
  if folder is None or not folder.exists():
    return Source(None, lambda: _image_from_tfds(split, max_len, download, folder))
  names = ["test_batch"] if split == "test" else [f"data_batch_{i}" for i in range(1, 6)]
  how = f"Unpack cifar-10-python.tar.gz so that {folder} holds data_batch_1..5 and test_batch."
  files = [_require(folder / name, "CIFAR-10 batch", how) for name in names]
  return Source(files, lambda: _parse_cifar(files, split, max_len))


def _split_train(n: int, split: str) -> slice:
  """train = the first 90%, validation = the last 10% (TFDS train[:90%] / train[90%:])."""
  cut = n * 9 // 10
  return slice(0, cut) if split == "train" else slice(cut, n)


def _parse_cifar(files: list[Path], split: str, max_len: int) -> dict:
  data, labels = [], []
  for path in files:
    with open(path, "rb") as f:
      try:
        batch = pickle.load(f, encoding="bytes")
      except Exception as e:
        raise ValueError(f"{path}: not a CIFAR-10 python pickle ({e})") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
      raise ValueError(f"{path}: expected a dict with b'data' and b'labels'")
    pixels = np.asarray(batch[b"data"])
    if pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != 3 * 32 * 32 \
            or len(batch[b"labels"]) != len(pixels):
      raise ValueError(f"{path}: b'data' must be uint8 [N, 3072] with N labels, got "
                       f"{pixels.dtype} {pixels.shape} and {len(batch[b'labels'])} labels")
    data.append(pixels)
    labels.append(np.asarray(batch[b"labels"], np.int32))
  data, labels = np.concatenate(data), np.concatenate(labels)
  if split != "test":
    part = _split_train(len(data), split)
    data, labels = data[part], labels[part]
  rgb = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # channel-major rows -> [N, H, W, 3]
  return {**_pixels(rgb_to_grayscale(rgb), max_len), "targets": labels}


def _image_from_tfds(split: str, max_len: int, download: bool, folder: Path | None) -> dict:
  hint = (f"unpack the CIFAR-10 python batches so that "
          f"{folder if folder else 'DATA_DIR/' + CIFAR_DIR} exists and pass data_dir.")
  tfds_split = {"train": "train[:90%]", "validation": "train[90%:]", "test": "test"}[split]
  data = _tfds_load("cifar10", tfds_split, download, hint)
  gray = rgb_to_grayscale(np.asarray(data["image"], np.uint8))
  return {**_pixels(gray, max_len), "targets": data["label"].astype(np.int32)}


# ------------------------------------------------------------------------------- Pathfinder

def pathfinder_dir(data_dir, resolution: int, difficulty: str) -> Path:
  """`data_dir/pathfinder{resolution}/{difficulty folder}`."""
  return Path(data_dir) / f"pathfinder{resolution}" / PATHFINDER_DIFFICULTIES[difficulty]


def check_pathfinder_options(resolution, difficulty) -> None:
  if resolution not in PATHFINDER_RESOLUTIONS:
    raise ValueError(f"resolution must be one of {PATHFINDER_RESOLUTIONS}, got {resolution!r}")
  if difficulty not in PATHFINDER_DIFFICULTIES:
    raise ValueError(f"difficulty must be one of {tuple(PATHFINDER_DIFFICULTIES)}, "
                     f"got {difficulty!r}")


def _metadata_key(path: Path):
  return (0, int(path.stem), "") if path.stem.isdigit() else (1, 0, path.stem)


def read_pathfinder(data_dir, split: str, max_len: int, resolution: int,
                    difficulty: str) -> Source:
  check_pathfinder_options(resolution, difficulty)
  how = (f"Generate it with `python -m lra.generate pathfinder --resolution {resolution} "
         f"--difficulty {difficulty} --num N --out {data_dir or 'DIR'}`. {RELEASE_HINT}")
  root = _require_data_dir(data_dir, f"Pathfinder {resolution}x{resolution}", how)
  folder = pathfinder_dir(root, resolution, difficulty)
  meta_dir = _require(folder / "metadata", "Pathfinder metadata folder", how)
  _require(folder / "imgs", "Pathfinder image folder", how)
  meta_files = sorted(meta_dir.glob("*.npy"), key=_metadata_key)
  if not meta_files:
    raise FileNotFoundError(f"no metadata/*.npy files in {meta_dir}. {how}")
  entries = []  # (image path, label), in metadata order
  for meta in meta_files:
    try:
      lines = meta.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
      raise ValueError(f"{meta}: a Pathfinder metadata file must be text, one line per "
                       "image (despite the .npy name)") from None
    for lineno, line in enumerate(lines, start=1):
      fields = line.split()
      if not fields:
        continue
      if len(fields) < 4 or fields[3] not in ("0", "1"):
        raise _bad_row(meta, lineno, "expected whitespace-separated fields "
                                     "'imgs/<k> <file name> <n> <label 0|1> ...', got "
                                     f"{line!r}")
      entries.append((folder / fields[0] / fields[1], int(fields[3])))
  n = len(entries)
  bounds = {"train": (0, n * 8 // 10), "validation": (n * 8 // 10, n * 9 // 10),
            "test": (n * 9 // 10, n)}[split]  # deterministic 80/10/10, in metadata order
  entries = entries[slice(*bounds)]
  if not entries:
    raise ValueError(f"the {split} split of {folder} is empty: it has {n} images in all, "
                     "split 80/10/10 in metadata order; generate more with --num")
  files = meta_files + [path for path, _ in entries]
  return Source(files, lambda: _read_pathfinder_images(entries, resolution, max_len, split))


def _read_image(path: Path, resolution: int) -> np.ndarray | None:
  """The grayscale pixels of one PNG, or None if it is empty or unreadable."""
  try:
    if path.stat().st_size == 0:
      return None
    with Image.open(path) as image:
      image.load()
      mode, size = image.mode, image.size
      pixels = np.asarray(image)
  except OSError:  # missing, truncated or not an image
    return None
  if mode != "L" or size != (resolution, resolution):
    raise ValueError(f"{path}: expected an 8-bit grayscale (mode L) {resolution}x{resolution} "
                     f"PNG, got mode {mode} {size[0]}x{size[1]}")
  return pixels


def _read_pathfinder_images(entries, resolution: int, max_len: int, split: str) -> dict:
  images = np.empty((len(entries), resolution, resolution), np.uint8)
  targets, skipped = [], []
  for path, label in tqdm(entries, desc=f"pathfinder{resolution}/{split}", disable=None):
    pixels = _read_image(path, resolution)
    if pixels is None:
      skipped.append(path)
      continue
    images[len(targets)] = pixels
    targets.append(label)
  if skipped:
    log.warning("skipped %d empty or unreadable Pathfinder images, e.g. %s",
                len(skipped), skipped[0])
  if not targets:
    raise ValueError(f"none of the {len(entries)} Pathfinder images of the {split} split "
                     f"could be read (e.g. {skipped[0]})")
  return {**_pixels(images[:len(targets)], max_len), "targets": np.array(targets, np.int32),
          "num_skipped": np.int64(len(skipped))}
