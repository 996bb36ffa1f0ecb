"""Fail-fast checks on loaded splits: empty files, bad rows, labels and ids out of range,
truncation counts, and unreadable Pathfinder images counted, kept in the cache, and capped."""
import numpy as np
import pytest

import lra
from lra import readers
from lra.dataset import Dataset
from lra_fixtures import (write_cifar, write_imdb, write_listops, write_pathfinder,
                          write_retrieval)

LISTOPS_ROW = "( ( ( [MAX 2 ) 9 ) ] )\t9"


def make_dataset(task="listops", tokens=((1, 2, 0), (3, 0, 0)), lengths=(2, 1), targets=(1, 2),
                 **extra):
  return Dataset(spec=lra.task_spec(task), split="train", source="fixture.tsv",
                 tokens=np.array(tokens, np.uint8 if task == "listops" else np.uint16),
                 lengths=np.array(lengths, np.int32), targets=np.array(targets, np.int32),
                 **extra)


# ------------------------------------------------------------------------- files with no rows

def test_header_only_listops_names_the_file(tmp_path):
  path = write_listops(tmp_path, "basic_train.tsv", [])
  with pytest.raises(ValueError, match="no examples: it has the header line and no row") as e:
    lra.load("listops", "train", data_dir=tmp_path)
  assert str(path) in str(e.value)
  assert not list((tmp_path / ".lra_cache").glob("*.npz"))  # nothing empty was cached


def test_empty_or_header_only_retrieval_names_the_file(tmp_path):
  path = write_retrieval(tmp_path, "new_aan_pairs.eval.tsv", [])
  with pytest.raises(ValueError, match="no examples: it has no row") as e:
    lra.load("retrieval", "validation", data_dir=tmp_path)
  assert str(path) in str(e.value)
  write_retrieval(tmp_path, "new_aan_pairs.eval.tsv", [b"label\tid1\tid2\ttext1\ttext2"])
  with pytest.raises(ValueError, match=r"line 1: label must be 0.0 or 1.0, got b'label' \(the "
                                       "AAN files have no header line\\)") as e:
    lra.load("retrieval", "validation", data_dir=tmp_path)
  assert str(path) in str(e.value)


@pytest.mark.parametrize("source, problem", [
    ("( ( ( [MAX 2 ) 9 ) ] ) ]", "the ']' at token 5 closes no '\\[OP'"),
    ("( ( ( [MAX 2 ) 9 ) )", "1 '\\[OP' never closed by ']'"),
    ("( ( [MAX 2 ) 9 ) ] )", "the '\\)' at character 20 closes no '\\('"),
    ("( ( ( ( [MAX 2 ) 9 ) ] )", "1 '\\(' never closed by '\\)'"),
    ("( ( ( [MAX 2 ) ] ) 9 ] )", "the ']' at token 5 closes no '\\[OP'"),
])
def test_listops_unbalanced_brackets_name_file_and_line(tmp_path, source, problem):
  path = write_listops(tmp_path, "basic_test.tsv", [LISTOPS_ROW, LISTOPS_ROW, f"{source}\t9"])
  with pytest.raises(ValueError, match=f"line 4: unbalanced brackets: {problem}") as e:
    lra.load("listops", "test", data_dir=tmp_path)
  assert str(path) in str(e.value)


# ------------------------------------------------------------------------------- truncation

def test_truncated_examples_are_counted(tmp_path):
  write_listops(tmp_path, "basic_train.tsv", [
      LISTOPS_ROW, "( ( ( ( [SM 8 ) ( ( ( [MIN 4 ) 0 ) ] ) ) 7 ) ] )\t5"])  # 4 and 8 tokens
  assert lra.load("listops", "train", data_dir=tmp_path).num_truncated == 0
  assert lra.load("listops", "train", data_dir=tmp_path, max_len=4).num_truncated == 1
  cached = lra.load("listops", "train", data_dir=tmp_path, max_len=3)
  assert cached.num_truncated == 2 and lra.check_dataset(cached)["num_truncated"] == 2

  write_retrieval(tmp_path, "new_aan_pairs.train.tsv", [
      b"1.0\ta\tb\t" + b"x" * 12 + b"\tshort", b"0.0\tc\td\tshort\t" + b"y" * 11,
      b"0.0\te\tf\tshort\tshort"])
  assert lra.load("retrieval", "train", data_dir=tmp_path, max_len=10).num_truncated == 2
  assert lra.load("retrieval", "train", data_dir=tmp_path, max_len=12).num_truncated == 0

  write_imdb(tmp_path, {("test", "neg"): [b"a" * 30], ("test", "pos"): [b"b" * 5],
                        ("train", "neg"): [b"c"], ("train", "pos"): [b"d"]})
  assert lra.load("text", "test", data_dir=tmp_path, max_len=10).num_truncated == 1

  write_cifar(tmp_path, np.random.default_rng(0))
  assert lra.load("image", "test", data_dir=tmp_path, max_len=1000).num_truncated == 3
  assert lra.load("image", "test", data_dir=tmp_path).num_truncated == 0


# ------------------------------------------------------------------------- lra.check_dataset

def test_check_dataset_report():
  ds = make_dataset(num_truncated=1, num_skipped=0)
  assert lra.check_dataset(ds) == {
      "task": "listops", "split": "train", "source": "fixture.tsv", "num_examples": 2,
      "max_len": 3, "num_truncated": 1, "num_skipped": 0, "skipped_examples": []}


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokens=np.zeros((0, 3)), lengths=(), targets=()),
     "the train split of listops read from fixture.tsv has no examples"),
    (dict(targets=(1, 10)), r"example 1 has target 10, outside \[0, 10\) \(1 such examples\)"),
    (dict(targets=(-1, -2)), r"example 0 has target -1, outside \[0, 10\) \(2 such"),
    (dict(tokens=((1, 2, 0), (3, 16, 0))), r"example 1 has token id 16 at position 1 of inputs, "
                                           r"outside the vocabulary \[0, 16\) of listops"),
    (dict(lengths=(2, 4)), r"example 1 has length 4 in inputs, outside \[0, max_len=3\]"),
])
def test_check_dataset_rejects(kwargs, message):
  with pytest.raises(ValueError, match=message):
    lra.check_dataset(make_dataset(**kwargs))


def test_check_dataset_second_input_and_arguments():
  tokens = np.array([[5, 0], [7, 9]], np.uint16)
  ds = make_dataset("retrieval", tokens=tokens, lengths=(1, 2), targets=(0, 1),
                    tokens2=np.array([[1, 0], [257, 3]], np.uint16),
                    lengths2=np.array([1, 2], np.int32))
  with pytest.raises(ValueError, match=r"example 1 has token id 257 at position 0 of inputs2, "
                                       r"outside the vocabulary \[0, 257\)"):
    lra.check_dataset(ds)
  for bad in (-0.1, 1.5, "1%", True):
    with pytest.raises(ValueError, match="max_skipped_fraction must be a number in"):
      lra.check_dataset(make_dataset(), max_skipped_fraction=bad)


def test_load_runs_the_checks(tmp_path, monkeypatch):
  write_listops(tmp_path, "basic_train.tsv", [LISTOPS_ROW])
  real = readers._parse_listops

  def wrong_targets(*args):
    return {**real(*args), "targets": np.array([12], np.int32)}

  monkeypatch.setattr(readers, "_parse_listops", wrong_targets)
  with pytest.raises(ValueError, match=r"basic_train.tsv: example 0 has target 12"):
    lra.load("listops", "train", data_dir=tmp_path)


# ------------------------------------------------------------------ unreadable Pathfinder images

BROKEN = {(0, 2): b"", (1, 3): b"\x89PNG truncated", (1, 5): b"not a png"}


@pytest.mark.parametrize("cache", [False, True])
def test_skipped_images_are_counted_named_and_capped(tmp_path, monkeypatch, caplog, cache):
  write_pathfinder(tmp_path, np.random.default_rng(1), broken=BROKEN)
  reads = []
  real = readers._read_image
  monkeypatch.setattr(readers, "_read_image", lambda *a: reads.append(a) or real(*a))
  loads = [lra.load("pathfinder", "train", data_dir=tmp_path, cache=cache) for _ in range(2)]
  assert len(reads) == (16 if cache else 32)  # the second load came from the cache
  folder = "pathfinder32/curv_contour_length_14/imgs"
  for ds in loads:
    assert len(ds) == 13 and ds.num_skipped == 3
    assert ds.skipped_examples == (f"{folder}/0/sample_2.png", f"{folder}/1/sample_3.png",
                                   f"{folder}/1/sample_5.png")
  assert caplog.text.count("skipped 3 empty or unreadable examples of the train split") == 2

  with pytest.raises(ValueError, match=r"3 of 16 examples \(18.75%\) were skipped as empty or "
                                       r"unreadable, more than max_skipped_fraction=0.1") as e:
    lra.check_dataset(loads[1], max_skipped_fraction=0.1)
  assert f"{folder}/0/sample_2.png" in str(e.value) and "curv_contour_length_14" in str(e.value)
  with pytest.raises(ValueError, match="3 of 16"):
    lra.check_dataset(loads[1])  # the default ceiling is 1%
  report = lra.check_dataset(loads[1], max_skipped_fraction=0.2)
  assert report["num_skipped"] == 3 and report["num_examples"] == 13
  assert report["skipped_examples"][0] == f"{folder}/0/sample_2.png"
  assert lra.check_dataset(loads[1], max_skipped_fraction=None)["num_skipped"] == 3


def test_skipped_examples_listed_are_capped(tmp_path):
  broken = {(0, n): b"" for n in range(7)}
  write_pathfinder(tmp_path, np.random.default_rng(2), broken=broken)
  ds = lra.load("pathfinder", "train", data_dir=tmp_path)
  assert ds.num_skipped == 7 and len(ds.skipped_examples) == readers.MAX_SKIPPED_LISTED == 5
  clean = lra.load("pathfinder", "test", data_dir=tmp_path)
  assert clean.num_skipped == 0 and clean.skipped_examples == ()
  assert lra.check_dataset(clean, max_skipped_fraction=0)["num_skipped"] == 0
