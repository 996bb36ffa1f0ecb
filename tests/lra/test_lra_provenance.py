"""Generator manifests and lra.provenance: where a run's data came from."""
import datetime
import json
import os
import sys

import numpy as np
import pytest

import lra
from lra import cache, listops
from lra import pathfinder_generator as pg
from lra_fixtures import write_imdb, write_pathfinder, write_retrieval

SIZES = dict(num_train=6, num_val=2, num_test=2)
SHORT = dict(min_length=16, max_length=64)


def read_json(path):
  return json.loads(path.read_text(encoding="utf-8"))


def check_created(manifest):
  created = datetime.datetime.fromisoformat(manifest["created"])
  assert created.utcoffset() == datetime.timedelta(0)
  assert abs(datetime.datetime.now(datetime.timezone.utc) - created).total_seconds() < 600


def test_listops_manifest(tmp_path):
  folder = lra.generate_listops(tmp_path, seed=4, progress=False, **SIZES, **SHORT)
  manifest = read_json(tmp_path / "listops-1000" / "generated.json")
  check_created(manifest)
  assert {k: v for k, v in manifest.items() if k != "created"} == {
      "generator": "lra.generate_listops", "rules_version": listops.RULES_VERSION, "seed": 4,
      "sizes": {"train": 6, "validation": 2, "test": 2},
      "parameters": {"min_length": 16, "max_length": 64, "max_depth": 10, "subtree_p": 0.25,
                     "max_args": 10, "files": listops.SPLIT_FILES}}
  assert sorted(os.listdir(folder)) == ["basic_test.tsv", "basic_train.tsv", "basic_val.tsv",
                                        "generated.json"]  # no temporary file left


def test_interrupted_listops_run_keeps_the_old_files_and_manifest(tmp_path, monkeypatch):
  lra.generate_listops(tmp_path, seed=1, progress=False, **SIZES, **SHORT)
  folder = tmp_path / "listops-1000"
  before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
  real = listops._unique_samples

  def interrupted(*args):
    for i, sample in enumerate(real(*args)):
      if i == 9:  # the last sample of the test file
        raise KeyboardInterrupt
      yield sample

  monkeypatch.setattr(listops, "_unique_samples", interrupted)
  with pytest.raises(KeyboardInterrupt):
    lra.generate_listops(tmp_path, seed=2, progress=False, **SIZES, **SHORT)
  assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before


def test_pathfinder_manifest(tmp_path):
  folder = lra.generate_pathfinder(tmp_path, num=3, seed=2, difficulty="easy", progress=False)
  manifest = read_json(tmp_path / "pathfinder32" / "curv_baseline" / "generated.json")
  assert folder == str(tmp_path / "pathfinder32" / "curv_baseline")
  check_created(manifest)
  params = pg.pathfinder_params(32, "easy")
  assert manifest["generator"] == "lra.generate_pathfinder"
  assert manifest["rules_version"] == pg.RULES_VERSION and manifest["seed"] == 2
  assert manifest["sizes"] == {"num": 3, "images_per_batch": 1000}
  assert manifest["parameters"]["resolution"] == 32
  assert manifest["parameters"]["difficulty"] == "easy"
  assert manifest["parameters"]["contour_length"] == params.contour_length == 6
  assert manifest["parameters"]["paddle_margins"] == list(params.paddle_margins)
  assert set(manifest["parameters"]) == {field.name for field in
                                         pg.dataclasses.fields(pg.PathfinderParams)}


def test_provenance_of_generated_listops(tmp_path):
  lra.generate_listops(tmp_path, seed=4, progress=False, **SIZES, **SHORT)
  record = lra.provenance("listops", tmp_path)
  names = ["basic_test.tsv", "basic_train.tsv", "basic_val.tsv"]
  files = [tmp_path / "listops-1000" / name for name in names]
  assert record["kind"] == "generated" and record["task"] == "listops"
  assert record["files"] == {f"listops-1000/{name}": 1 for name in names}
  assert record["num_files"] == 3 and record["data_dir"] == str(tmp_path)
  assert record["load_options"] == {"max_len": 2000} and record["tfds"] is None
  assert record["generator"] == read_json(tmp_path / "listops-1000" / "generated.json")
  # The fingerprint is the cache's own: files, sizes, modification times and options.
  assert record["fingerprint"] == cache.fingerprint(sorted(files), tmp_path,
                                                    {"task": "listops", "max_len": 2000})
  json.dumps(record)  # ready to be written beside a run's results
  assert lra.provenance("listops", tmp_path) == record
  assert lra.provenance("listops", tmp_path, max_len=100)["fingerprint"] != record["fingerprint"]
  # LRA's pipeline dropped every `]`: a load option that changes what is read, recorded as one
  dropped = lra.provenance("listops", tmp_path, closing_brackets=False)
  assert dropped["load_options"] == {"max_len": 2000, "closing_brackets": False}
  assert dropped["fingerprint"] != record["fingerprint"]
  stat = files[0].stat()
  os.utime(files[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  assert lra.provenance("listops", tmp_path)["fingerprint"] != record["fingerprint"]


def test_provenance_of_official_files(tmp_path):
  for name in ("new_aan_pairs.train.tsv", "new_aan_pairs.eval.tsv", "new_aan_pairs.test.tsv"):
    write_retrieval(tmp_path, name, [b"1.0\ta\tb\tx\ty"])
  record = lra.provenance("retrieval", tmp_path, max_len=64)
  assert record["kind"] == "official files" and record["generator"] is None
  assert record["files"] == {"tsv_data/new_aan_pairs.eval.tsv": 1,
                             "tsv_data/new_aan_pairs.test.tsv": 1,
                             "tsv_data/new_aan_pairs.train.tsv": 1}

  write_imdb(tmp_path, {("train", "neg"): [b"a", b"b"], ("train", "pos"): [b"c"],
                        ("test", "neg"): [b"d"], ("test", "pos"): [b"e"]})
  text = lra.provenance("text", tmp_path)
  assert text["kind"] == "official files" and text["num_files"] == 5
  assert "aclImdb/test/pos/0_7.txt" in text["files"] and "IMDb train" in text["splits"]


def test_provenance_lists_many_files_of_a_folder_as_a_pattern(tmp_path):
  write_pathfinder(tmp_path, np.random.default_rng(0), per_file=(12, 3, 5))
  record = lra.provenance("pathfinder", tmp_path)
  folder = "pathfinder32/curv_contour_length_14"
  expected = {f"{folder}/imgs/0/*.png": 12, f"{folder}/metadata/0.npy": 1,
              f"{folder}/metadata/1.npy": 1, f"{folder}/metadata/10.npy": 1,
              **{f"{folder}/imgs/1/sample_{n}.png": 1 for n in range(3)},
              **{f"{folder}/imgs/10/sample_{n}.png": 1 for n in range(5)}}
  assert record["files"] == expected and record["num_files"] == 23
  assert record["kind"] == "official files"
  assert record["load_options"] == {"resolution": 32, "difficulty": "hard", "max_len": 1024}


def test_provenance_of_generated_pathfinder(tmp_path):
  lra.generate_pathfinder(tmp_path, num=10, seed=1, difficulty="easy", progress=False)
  record = lra.provenance("pathfinder", tmp_path, difficulty="easy")
  assert record["kind"] == "generated" and record["generator"]["seed"] == 1
  assert record["files"]["pathfinder32/curv_baseline/metadata/0.npy"] == 1
  assert record["num_files"] == 11


def test_provenance_of_tfds_and_missing_files(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # not installed
  record = lra.provenance("image", tmp_path)
  assert record["kind"] == "tfds" and record["files"] == {} and record["num_files"] == 0
  assert record["tfds"] == {"name": "cifar10", "version": None, "data_dir": None}
  assert len(record["fingerprint"]) == 64
  with pytest.raises(FileNotFoundError, match="basic_train.tsv"):
    lra.provenance("listops", tmp_path)
  with pytest.raises(ValueError, match="unknown LRA task .cifar."):
    lra.provenance("cifar", tmp_path)
