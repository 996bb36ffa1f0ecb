"""The tokenised-split cache: hit, invalidation when the source changes, atomic writes."""
import os

import numpy as np
import pytest

import lra
from lra import readers
from lra_fixtures import write_listops

TRAIN_FILE = "basic_train.tsv"
ROWS = ["( ( ( [MAX 2 ) 9 ) ] )\t9", "( ( ( [MIN 4 ) 7 ) ] )\t4"]


@pytest.fixture
def count_parses(monkeypatch):
  calls = []
  real = readers._parse_listops

  def counting(*args):
    calls.append(args)
    return real(*args)

  monkeypatch.setattr(readers, "_parse_listops", counting)
  return calls


def test_hit_and_invalidation(tmp_path, count_parses):
  path = write_listops(tmp_path, TRAIN_FILE, ROWS)
  first = lra.load("listops", "train", data_dir=tmp_path)
  cached = list((tmp_path / ".lra_cache").glob("*.npz"))
  assert len(cached) == 1 and len(count_parses) == 1

  second = lra.load("listops", "train", data_dir=tmp_path)
  assert len(count_parses) == 1  # served from the cache
  np.testing.assert_array_equal(second.inputs, first.inputs)
  np.testing.assert_array_equal(second.masks, first.masks)
  np.testing.assert_array_equal(second.targets, first.targets)

  write_listops(tmp_path, TRAIN_FILE, ROWS + ["( ( ( [SM 4 ) 7 ) ] )\t1"])  # the source changes
  third = lra.load("listops", "train", data_dir=tmp_path)
  assert len(count_parses) == 2 and third.targets.tolist() == [9, 4, 1]

  # Same size, new content and mtime: still detected.
  write_listops(tmp_path, TRAIN_FILE, ROWS[:2] + ["( ( ( [SM 4 ) 8 ) ] )\t2"])
  stat = path.stat()
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
  fourth = lra.load("listops", "train", data_dir=tmp_path)
  assert len(count_parses) == 3 and fourth.targets.tolist() == [9, 4, 2]
  assert len(list((tmp_path / ".lra_cache").glob("*.npz"))) == 1  # replaced, not piled up


def test_parameters_key_separate_entries_and_cache_dir(tmp_path, count_parses):
  write_listops(tmp_path, TRAIN_FILE, ROWS)
  cache_dir = tmp_path / "elsewhere"
  full = lra.load("listops", "train", data_dir=tmp_path, cache_dir=cache_dir)
  short = lra.load("listops", "train", data_dir=tmp_path, cache_dir=cache_dir, max_len=3)
  assert len(count_parses) == 2 and short.inputs.shape == (2, 3)
  assert len(list(cache_dir.glob("*.npz"))) == 2 and not (tmp_path / ".lra_cache").exists()
  again = lra.load("listops", "train", data_dir=tmp_path, cache_dir=cache_dir, max_len=3)
  assert len(count_parses) == 2
  np.testing.assert_array_equal(again.inputs, full.inputs[:, :3])
  lra.load("listops", "train", data_dir=tmp_path, cache=False)
  assert len(count_parses) == 3


def test_interrupted_cache_write_leaves_nothing(tmp_path, monkeypatch):
  write_listops(tmp_path, TRAIN_FILE, ROWS)
  real_savez = np.savez

  def interrupted(file, **arrays):
    file.write(b"PK partial")
    raise KeyboardInterrupt

  monkeypatch.setattr(np, "savez", interrupted)
  with pytest.raises(KeyboardInterrupt):
    lra.load("listops", "train", data_dir=tmp_path)
  assert list((tmp_path / ".lra_cache").iterdir()) == []
  monkeypatch.setattr(np, "savez", real_savez)
  assert lra.load("listops", "train", data_dir=tmp_path).targets.tolist() == [9, 4]


def test_corrupt_or_unwritable_cache_is_rebuilt(tmp_path, count_parses, caplog):
  write_listops(tmp_path, TRAIN_FILE, ROWS)
  lra.load("listops", "train", data_dir=tmp_path)
  (entry,) = (tmp_path / ".lra_cache").glob("*.npz")
  entry.write_bytes(b"not a zip file")
  assert lra.load("listops", "train", data_dir=tmp_path).targets.tolist() == [9, 4]
  assert len(count_parses) == 2 and "unreadable cache" in caplog.text

  blocked = tmp_path / "blocked"
  blocked.write_text("a file where the cache folder should be")
  ds = lra.load("listops", "train", data_dir=tmp_path, cache_dir=blocked)
  assert ds.targets.tolist() == [9, 4] and "could not write the cache" in caplog.text
