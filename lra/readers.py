"""Readers of the official LRA file formats, one per task.

Each reader checks that its files exist (naming the exact path and how to get it) and
returns a `Source`: the files whose fingerprint keys the cache, `build()`, which parses
them into arrays, and a description of where the data comes from for error messages. Parsing
checks each row as it goes (errors name the file and line). docs/data.md lists
the files each task reads.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import pickle
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image
from tqdm import tqdm

from lra import listops
from lra.fileio import MANIFEST_NAME, read_manifest
from lra.tasks import PATHFINDER_DIFFICULTIES, PATHFINDER_RESOLUTIONS, pathfinder_dir


RELEASE_HINT = ("It is part of the official LRA release: download lra_release.gz (linked from "
                "the README of https://github.com/google-research/long-range-arena), unpack it "
                "and pass the unpacked root as data_dir.")
RETRIEVAL_FILES = {"train": "new_aan_pairs.train.tsv", "validation": "new_aan_pairs.eval.tsv",
                   "test": "new_aan_pairs.test.tsv"}
RETRIEVAL_BYTE_CUT = 10_000  # each document is cut to this many bytes before max_len
CIFAR_DIR = "cifar-10-batches-py"
IMDB_DIR = "aclImdb"
DATA_EXTRA_HINT = 'pip install -e ".[data]"'
TEXT_VALIDATION_FRACTION = 0.1  # of the IMDb training reviews (IMDb has no validation split)
MAX_SKIPPED_LISTED = 5          # unreadable examples named in a Dataset (and its cache entry)
_TFDS_BATCH = 1024              # examples per batch read from TFDS


@dataclasses.dataclass
class Source:
  """Where one split comes from. `files` is None when it is not read from local files
  (the TFDS fallback), which then is not cached. `description` names it in errors.
  `expected`: (examples, manifest) when a generator's manifest beside the files says how many
  examples of the split it wrote."""

  files: list[Path] | None
  build: Callable[[], dict]
  description: str
  expected: tuple[int, Path] | None = None


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
  """One byte string per example -> {'tokens': dtype [N, max_len], 'lengths': int32 [N],
  'num_truncated': rows longer than max_len}: each byte (plus `offset`, 1 for the byte+1
  encoding) is a token, cut to max_len and left-aligned, zeros after."""
  tokens = np.zeros((len(rows), max_len), dtype)
  lengths = np.zeros(len(rows), np.int32)
  for i, row in enumerate(rows):
    ids = np.frombuffer(row[:max_len], np.uint8).astype(dtype)
    tokens[i, :len(ids)] = ids + offset
    lengths[i] = len(ids)
  return {"tokens": tokens, "lengths": lengths,
          "num_truncated": np.int64(sum(len(row) > max_len for row in rows))}


def _no_examples(path: Path, what: str) -> ValueError:
  return ValueError(f"{path}: no examples: {what}. The file is cut short or not the released "
                    "one; generate or unpack it again.")


# ---------------------------------------------------------------------------------- ListOps

def read_listops(data_dir, split: str, max_len: int, closing_brackets: bool = True) -> Source:
  """closing_brackets=False drops every `]` (LRA's pipeline before 2021-03-04)."""
  how = (f"Generate it with `python -m lra.generate listops --out {data_dir or 'DIR'}` "
         f"(LRA sizes by default; --num_train/--num_val/--num_test to change). {RELEASE_HINT}")
  root = _require_data_dir(data_dir, "ListOps", how)
  path = _require(root / listops.DIR_NAME / listops.SPLIT_FILES[split], "ListOps file", how)
  written = (read_manifest(path.parent) or {}).get("sizes", {}).get(split)
  expected = None if written is None else (written, path.parent / MANIFEST_NAME)
  return Source([path], lambda: _parse_listops(path, max_len, closing_brackets), str(path),
                expected=expected)


_OPEN_IDS = np.array([listops.TOKEN_IDS[op] for op in listops.OPERATORS], np.uint8)
_END_ID = listops.TOKEN_IDS[listops.END]


def _unbalanced(steps: np.ndarray, opening: str, closing: str, unit: str) -> str | None:
  """What is wrong with a bracket sequence given as +1 (opening), -1 (closing) and 0 steps
  per `unit`, or None when each closing bracket closes an earlier opening one and none stays
  open."""
  depth = np.cumsum(steps, dtype=np.int32)
  if len(depth) and depth.min() < 0:
    return f"the {closing!r} at {unit} {int(np.argmax(depth < 0)) + 1} closes no {opening!r}"
  if len(depth) and depth[-1] > 0:
    return f"{int(depth[-1])} {opening!r} never closed by {closing!r}"
  return None


def _bracket_error(source: str, ids: bytes) -> str | None:
  """Checks both bracket systems of a Source: operators with their `]`, and the parens."""
  tokens = np.frombuffer(ids, np.uint8)
  operators = np.isin(tokens, _OPEN_IDS).astype(np.int32) - (tokens == _END_ID)
  chars = np.frombuffer(source.encode("utf-8"), np.uint8)
  parens = (chars == ord("(")).astype(np.int32) - (chars == ord(")"))
  return (_unbalanced(operators, "[OP", "]", "token")
          or _unbalanced(parens, "(", ")", "character"))


def _parse_listops(path: Path, max_len: int, closing_brackets: bool = True) -> dict:
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
      problem = _bracket_error(source, ids)
      if problem:
        raise _bad_row(path, lineno, f"unbalanced brackets: {problem}")
      rows.append(ids if closing_brackets else ids.replace(bytes([_END_ID]), b""))
      targets.append(int(target))
  if not rows:
    raise _no_examples(path, "it has the header line and no row after it")
  return {**_pack(rows, max_len, np.uint8), "targets": np.array(targets, np.int32)}


# -------------------------------------------------------------------------------- Retrieval

def read_retrieval(data_dir, split: str, max_len: int) -> Source:
  root = _require_data_dir(data_dir, "Retrieval (AAN)", RELEASE_HINT)
  path = _require(root / "tsv_data" / RETRIEVAL_FILES[split], "Retrieval (AAN) file",
                  RELEASE_HINT)
  return Source([path], lambda: _parse_retrieval(path, max_len), str(path))


def _parse_retrieval(path: Path, max_len: int) -> dict:
  cut = min(RETRIEVAL_BYTE_CUT, max_len)
  docs1, docs2, targets, truncated = [], [], [], 0  # truncated: a document > max_len bytes
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
        header = " (the AAN files have no header line)" if lineno == 1 else ""
        raise _bad_row(path, lineno, f"label must be 0.0 or 1.0, got {fields[0]!r}{header}")
      targets.append(int(label))
      truncated += len(fields[3]) > max_len or len(fields[4]) > max_len
      docs1.append(fields[3][:cut])
      docs2.append(fields[4][:cut])
  if not targets:
    raise _no_examples(path, "it has no row")
  first, second = _pack(docs1, max_len, np.uint16, 1), _pack(docs2, max_len, np.uint16, 1)
  return {"tokens": first["tokens"], "lengths": first["lengths"], "tokens2": second["tokens"],
          "lengths2": second["lengths"], "targets": np.array(targets, np.int32),
          "num_truncated": np.int64(truncated)}


# ------------------------------------------------------------------------------------- Text

def read_text(data_dir, split: str, max_len: int, download: bool = False) -> Source:
  imdb = Path(data_dir) / IMDB_DIR if data_dir is not None else None
  if imdb is None or not imdb.exists():
    return Source(None, lambda: _text_from_tfds(split, max_len, download, imdb),
                  f"TFDS imdb_reviews ({split} split)")
  how = f"Unpack aclImdb_v1.tar.gz so that {imdb} holds train/ and test/."
  train_files, train_targets = _imdb_reviews(imdb / "train", how)
  test_files, test_targets = _imdb_reviews(imdb / "test", how)
  if split == "test":
    def build():
      return _text_arrays(_read_reviews(test_files, split), test_targets, max_len)

    return Source(test_files, build, f"{imdb / 'test'}/{{neg,pos}}/*.txt")

  def build():  # train and validation: both read test, which validation must not overlap
    texts = _read_reviews(train_files, split)
    texts, targets = _text_split(split, texts, train_targets, _read_reviews(test_files, "test"))
    return _text_arrays(texts, targets, max_len)

  return Source(train_files + test_files, build, f"{imdb / 'train'}/{{neg,pos}}/*.txt")


def _imdb_reviews(folder: Path, how: str) -> tuple[list[Path], list[int]]:
  """The review files of aclImdb/<split>/{neg,pos} (sorted) and their labels 0 / 1."""
  files, targets = [], []
  for label, name in enumerate(("neg", "pos")):
    found = sorted(_require(folder / name, "IMDb review folder", how).glob("*.txt"))
    files += found
    targets += [label] * len(found)
  if not files:
    raise FileNotFoundError(f"no *.txt reviews in {folder}/neg or {folder}/pos. {how}")
  return files, targets


def _read_reviews(files: list[Path], split: str) -> list[bytes]:
  # TFDS imdb_reviews strips surrounding whitespace; so does this reader.
  return [p.read_bytes().strip() for p in tqdm(files, desc=f"text/{split}", disable=None)]


def _text_arrays(texts: list[bytes], targets, max_len: int) -> dict:
  return {**_pack(texts, max_len, np.uint16, 1), "targets": np.asarray(targets, np.int32)}


def _review_digest(text: bytes) -> bytes:
  return hashlib.sha256(b"lra/text/validation\0" + text).digest()


def text_validation_mask(train_texts: list[bytes], test_texts: list[bytes]) -> np.ndarray:
  """bool [N]: which IMDb training reviews form the validation split.

  IMDb has a train and a test split only, so validation is carved out of train: the
  `TEXT_VALIDATION_FRACTION` (10 %, floor(N / 10)) of training reviews with the smallest
  SHA-256 of their text (salted). The choice depends on the texts alone, not on file names,
  their order or the process. Copies of one text are chosen together (so validation shares
  no text with train; when a group of copies straddles the cut, validation gets those few
  more), and a text that also occurs in test is never chosen (so none is shared with test).
  """
  digests = [_review_digest(text) for text in train_texts]
  in_test = {_review_digest(text) for text in test_texts}
  copies = collections.Counter(digests)
  wanted = int(len(digests) * TEXT_VALIDATION_FRACTION)
  chosen, count = set(), 0
  for digest in sorted(copies.keys() - in_test):
    if count >= wanted:
      break
    chosen.add(digest)
    count += copies[digest]
  return np.array([digest in chosen for digest in digests], bool)


def _text_split(split: str, train_texts: list[bytes], train_targets,
                test_texts: list[bytes]) -> tuple[list[bytes], np.ndarray]:
  """The texts and targets of `split` ("train" or "validation") out of the training reviews."""
  keep = text_validation_mask(train_texts, test_texts)
  if split == "train":
    keep = ~keep
  return [t for t, k in zip(train_texts, keep) if k], np.asarray(train_targets, np.int32)[keep]


def _tfds_load(name: str, split: str, download: bool, local_hint: str) -> dict:
  """All examples of a TFDS split as numpy arrays, read batch by batch.

  (`tfds.load(..., batch_size=-1)` would read the split as one tensor, but it aborts the
  process under `tfds.testing.mock_data` with TF 2.21, which is how the tests run this.)
  """
  try:
    import tensorflow_datasets as tfds
  except ImportError:
    raise ImportError(
        f"tensorflow_datasets is needed to read TFDS {name!r}: install it with "
        f"`{DATA_EXTRA_HINT}`, or {local_hint}") from None
  try:
    data = tfds.load(name, split=split, download=download)
  except AssertionError as e:  # TFDS asserts when the prepared data is missing
    raise FileNotFoundError(
        f"TFDS {name!r} is not prepared ({e}). Prepare it with "
        f"lra.load(..., download=True) or tfds.builder({name!r}).download_and_prepare(), "
        f"or {local_hint}") from None
  parts = collections.defaultdict(list)
  for batch in tfds.as_numpy(data.batch(_TFDS_BATCH)):
    for key, value in batch.items():
      parts[key].append(value)
  if not parts:
    raise ValueError(f"TFDS {name!r} has no examples in its {split!r} split; prepare it "
                     f"again with tfds.builder({name!r}).download_and_prepare()")
  return {key: np.concatenate(values) for key, values in parts.items()}


def _text_from_tfds(split: str, max_len: int, download: bool, imdb: Path | None) -> dict:
  hint = (f"unpack aclImdb (aclImdb/{{train,test}}/{{pos,neg}}/*.txt) so that it is "
          f"{imdb if imdb else 'DATA_DIR/aclImdb'} and pass data_dir.")
  test = _tfds_load("imdb_reviews", "test", download, hint)
  if split == "test":
    return _text_arrays([bytes(t) for t in test["text"]], test["label"], max_len)
  train = _tfds_load("imdb_reviews", "train", download, hint)
  texts, targets = _text_split(split, [bytes(t) for t in train["text"]], train["label"],
                               [bytes(t) for t in test["text"]])
  return _text_arrays(texts, targets, max_len)


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
  return {"tokens": tokens, "lengths": np.full(len(flat), length, np.int32),
          "num_truncated": np.int64(len(flat) if flat.shape[1] > max_len else 0)}


def read_image(data_dir, split: str, max_len: int, download: bool = False) -> Source:
  folder = Path(data_dir) / CIFAR_DIR if data_dir is not None else None
  if folder is None or not folder.exists():
    return Source(None, lambda: _image_from_tfds(split, max_len, download, folder),
                  f"TFDS cifar10 ({split} split)")
  names = ["test_batch"] if split == "test" else [f"data_batch_{i}" for i in range(1, 6)]
  how = f"Unpack cifar-10-python.tar.gz so that {folder} holds data_batch_1..5 and test_batch."
  files = [_require(folder / name, "CIFAR-10 batch", how) for name in names]
  return Source(files, lambda: _parse_cifar(files, split, max_len), str(folder))


def _split_train(n: int, split: str) -> slice:
  """train = the first 90%, validation = the last 10% (TFDS train[:90%] / train[90%:])."""
  cut = n * 9 // 10
  return slice(0, cut) if split == "train" else slice(cut, n)


class UnsafePickleError(ValueError):
  """A pickle asked for a global that a CIFAR-10 batch never holds."""


# What unpickling the official batches needs: besides dicts, lists, bytes and ints (built by
# opcodes, no global), numpy arrays ask for these globals (numpy 2 writes `numpy._core`).
_RECONSTRUCT = np.empty(0).__reduce__()[0]  # numpy's array reconstructor, by its public route
_CIFAR_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class _CifarUnpickler(pickle.Unpickler):
  """Unpickles only what a CIFAR-10 batch holds. Any other global (a function such as
  os.system that the pickle would call) is refused before it is looked up, so a crafted
  file runs no code."""

  def __init__(self, file, path: Path):
    super().__init__(file, encoding="bytes")  # the batches were pickled by Python 2
    self.path = path

  def find_class(self, module, name):
    found = _CIFAR_GLOBALS.get((module, name))
    if found is None:
      allowed = ", ".join(sorted({f"{m}.{n}" for m, n in _CIFAR_GLOBALS}))
      raise UnsafePickleError(
          f"{self.path}: refused to unpickle the global {module}.{name}: a CIFAR-10 python "
          f"batch holds only dicts, lists, bytes, integers and numpy arrays (globals "
          f"{allowed}). The file is not the released one and may be crafted to run code; "
          "unpack cifar-10-python.tar.gz again.")
    return found


def _load_cifar_batch(path: Path) -> dict:
  with open(path, "rb") as f:
    try:
      return _CifarUnpickler(f, path).load()
    except UnsafePickleError:
      raise
    except Exception as e:
      raise ValueError(f"{path}: not a CIFAR-10 python pickle ({e})") from None


def _parse_cifar(files: list[Path], split: str, max_len: int) -> dict:
  data, labels = [], []
  for path in files:
    batch = _load_cifar_batch(path)
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
      raise ValueError(f"{path}: expected a dict with b'data' and b'labels'")
    pixels = np.asarray(batch[b"data"])
    if pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != 3 * 32 * 32 \
            or len(batch[b"labels"]) != len(pixels):
      raise ValueError(f"{path}: b'data' must be uint8 [N, 3072] with N labels, got "
                       f"{pixels.dtype} {pixels.shape} and {len(batch[b'labels'])} labels")
    batch_labels = np.asarray(batch[b"labels"])
    if len(batch_labels) and batch_labels.dtype.kind not in "iu":
      raise ValueError(f"{path}: b'labels' must be integers 0-9, got {batch_labels.dtype}")
    bad = np.flatnonzero((batch_labels < 0) | (batch_labels > 9))
    if len(bad):
      raise ValueError(f"{path}: b'labels' must be integers 0-9, got "
                       f"{batch_labels[bad[0]]} for image {bad[0]}")
    data.append(pixels)
    labels.append(batch_labels.astype(np.int32))
  data, labels = np.concatenate(data), np.concatenate(labels)
  if split != "test":
    part = _split_train(len(data), split)
    data, labels = data[part], labels[part]
  rgb = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # channel-major rows -> [N, H, W, 3]
  return {**_pixels(rgb_to_grayscale(rgb), max_len), "targets": labels}


def _image_from_tfds(split: str, max_len: int, download: bool, folder: Path | None) -> dict:
  hint = (f"unpack the CIFAR-10 python batches so that "
          f"{folder if folder else 'DATA_DIR/' + CIFAR_DIR} exists and pass data_dir.")
  data = _tfds_load("cifar10", "test" if split == "test" else "train", download, hint)
  images, labels = data["image"], data["label"]
  if split != "test":  # the same cut as the local batches: TFDS train[:90%] / train[90%:]
    part = _split_train(len(images), split)
    images, labels = images[part], labels[part]
  return {**_pixels(rgb_to_grayscale(np.asarray(images, np.uint8)), max_len),
          "targets": labels.astype(np.int32)}


# ------------------------------------------------------------------------------- Pathfinder

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
  entries = entries[_pathfinder_split(n, split)]
  if not entries:
    raise ValueError(f"the {split} split of {folder} is empty: it has {n} images in all, "
                     "split 80/10/10 in metadata order; generate more with --num")
  written = (read_manifest(folder) or {}).get("sizes", {}).get("num")
  expected = None
  if written is not None:
    split_of_written = _pathfinder_split(written, split)
    expected = (split_of_written.stop - split_of_written.start, folder / MANIFEST_NAME)
  files = meta_files + [path for path, _ in entries]
  return Source(files, lambda: _read_pathfinder_images(entries, resolution, max_len, split,
                                                       root), str(folder), expected=expected)


def _pathfinder_split(n: int, split: str) -> slice:
  """The split's images among n: a deterministic 80/10/10, in metadata order."""
  return slice(*{"train": (0, n * 8 // 10), "validation": (n * 8 // 10, n * 9 // 10),
                 "test": (n * 9 // 10, n)}[split])


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


def _read_pathfinder_images(entries, resolution: int, max_len: int, split: str,
                            root: Path) -> dict:
  """The images of `entries`; empty or unreadable ones are left out and counted
  (`num_skipped`), the first few named relative to `root` (`skipped_examples`)."""
  images = np.empty((len(entries), resolution, resolution), np.uint8)
  targets, skipped = [], []
  for path, label in tqdm(entries, desc=f"pathfinder{resolution}/{split}", disable=None):
    pixels = _read_image(path, resolution)
    if pixels is None:
      skipped.append(path)
      continue
    images[len(targets)] = pixels
    targets.append(label)
  if not targets:
    raise ValueError(f"none of the {len(entries)} Pathfinder images of the {split} split "
                     f"could be read (e.g. {skipped[0]})")
  named = [str(path.relative_to(root)) for path in skipped[:MAX_SKIPPED_LISTED]]
  return {**_pixels(images[:len(targets)], max_len), "targets": np.array(targets, np.int32),
          "num_skipped": np.int64(len(skipped)), "skipped_examples": np.array(named, str)}
