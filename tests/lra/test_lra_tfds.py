"""The TFDS readers (Text from imdb_reviews, Image from cifar10) under tfds.testing.mock_data.

They need tensorflow-datasets and TensorFlow, which the `test` extra installs
(`pip install -e ".[test]"`); without them these tests are reported as skipped.
"""
import numpy as np
import pytest

import lra
from lra_fixtures import decode_bytes, independent_grayscale, write_imdb

tfds = tf = None
NEEDS = 'TFDS reader tests need the test extra: pip install -e ".[test]"'


@pytest.fixture(autouse=True)
def tensorflow_modules():
  """TFDS and TensorFlow, imported when a test here runs rather than when the suite is collected
  (TensorFlow takes seconds to import, and the fast lane collects this file without running it)."""
  global tfds, tf
  tfds = pytest.importorskip("tensorflow_datasets", reason=NEEDS)
  tf = pytest.importorskip("tensorflow", reason=NEEDS)


def read_raw(name, split):
  """The examples TFDS serves for a split, read here independently of lra."""
  batches = list(tfds.as_numpy(tfds.load(name, split=split).batch(1000)))
  return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}


def check_arrays(ds, num_examples, max_len, num_classes, vocab):
  assert len(ds) == num_examples
  assert ds.inputs.dtype == np.int32 and ds.inputs.shape == (num_examples, max_len)
  assert ds.masks.dtype == bool and ds.masks.shape == (num_examples, max_len)
  assert ds.targets.dtype == np.int32 and ds.targets.shape == (num_examples,)
  assert ((ds.targets >= 0) & (ds.targets < num_classes)).all()
  lengths = ds.masks.sum(1)
  np.testing.assert_array_equal(ds.masks, np.arange(max_len) < lengths[:, None])  # a prefix
  assert (ds.inputs[~ds.masks] == 0).all() and (ds.inputs < vocab).all()


# -------------------------------------------------------------------------------------- Image

def test_image_from_tfds_cifar10(tmp_path):
  with tfds.testing.mock_data(num_examples=13):
    train_raw, test_raw = read_raw("cifar10", "train"), read_raw("cifar10", "test")
    loaded = {split: lra.load("image", split, data_dir=tmp_path) for split in lra.SPLITS}
    padded = lra.load("image", "test", data_dir=tmp_path, max_len=1100)
  parts = {"train": slice(0, 11), "validation": slice(11, 13), "test": slice(0, 13)}  # 90/10
  for split, part in parts.items():
    raw = test_raw if split == "test" else train_raw
    ds = loaded[split]
    check_arrays(ds, part.stop - part.start, 1024, 10, 256)
    assert ds.masks.all() and ds.source == f"TFDS cifar10 ({split} split)"
    np.testing.assert_array_equal(ds.inputs, independent_grayscale(raw["image"][part])
                                  .reshape(-1, 1024))  # grayscale, row-major pixels
    assert ds.targets.tolist() == raw["label"][part].tolist()
  check_arrays(padded, 13, 1100, 10, 256)
  assert padded.masks.sum(1).tolist() == [1024] * 13 and padded.spec.has_padding
  np.testing.assert_array_equal(padded.inputs[:, :1024], loaded["test"].inputs)


# --------------------------------------------------------------------------------------- Text

TRAIN = [f"review {i}: {'great' if i % 2 else 'dull'} film, ünïcode ✓".encode()
         for i in range(30)]
SHARED = [b"a review in train and in test", b"another one in both"]
TEST = SHARED + [b"test only 1", b"test only 2", b"x" * 300]
IMDB = {"train": (TRAIN + SHARED, [i % 2 for i in range(32)]),
        "test": (TEST, [0, 1, 1, 0, 1])}


def imdb_as_dataset(builder, split, decoders=None, read_config=None, shuffle_files=False):
  """Serves IMDB's texts for each split, as TFDS would after decoding."""
  texts, labels = IMDB[split]
  return tf.data.Dataset.from_tensor_slices({"text": tf.constant(texts, tf.string),
                                             "label": tf.constant(labels, tf.int64)})


def test_text_from_tfds_imdb_reviews(tmp_path):
  with tfds.testing.mock_data(as_dataset_fn=imdb_as_dataset):
    loaded = {split: lra.load("text", split, data_dir=tmp_path, max_len=64)
              for split in lra.SPLITS}
  train, validation, test = (loaded[s] for s in lra.SPLITS)
  check_arrays(train, 29, 64, 2, 257)
  check_arrays(validation, 3, 64, 2, 257)  # 10% of the 32 training reviews
  check_arrays(test, 5, 64, 2, 257)
  assert decode_bytes(test) == [t[:64] for t in TEST] and test.targets.tolist() == [0, 1, 1, 0, 1]
  assert test.num_truncated == 1 and test.source == "TFDS imdb_reviews (test split)"
  train_rows, validation_rows = decode_bytes(train), decode_bytes(validation)
  assert sorted(train_rows + validation_rows) == sorted(TRAIN + SHARED)
  assert not set(validation_rows) & set(train_rows)
  assert not set(validation_rows) & set(TEST)
  label = dict(zip(*IMDB["train"]))
  assert validation.targets.tolist() == [label[t] for t in validation_rows]
  assert train.targets.tolist() == [label[t] for t in train_rows]

  # The local aclImdb reader carves the same validation reviews out of the same texts.
  write_imdb(tmp_path / "local", {
      ("train", "neg"): [t for t, y in zip(*IMDB["train"]) if y == 0],
      ("train", "pos"): [t for t, y in zip(*IMDB["train"]) if y == 1],
      ("test", "neg"): [t for t, y in zip(*IMDB["test"]) if y == 0],
      ("test", "pos"): [t for t, y in zip(*IMDB["test"]) if y == 1]})
  local = lra.load("text", "validation", data_dir=tmp_path / "local", max_len=64)
  assert sorted(decode_bytes(local)) == sorted(validation_rows)


def test_text_from_tfds_default_mock(tmp_path):
  """TFDS's own random examples; its mock serves the same ones for train and test, so every
  training review is also a test review and no validation review can be chosen."""
  with tfds.testing.mock_data(num_examples=9):
    raw = read_raw("imdb_reviews", "test")
    test = lra.load("text", "test", data_dir=tmp_path, max_len=50)
    train = lra.load("text", "train", data_dir=tmp_path, max_len=50)
    with pytest.raises(ValueError, match="validation split of text read from TFDS imdb_reviews "
                                         r"\(validation split\) has no examples"):
      lra.load("text", "validation", data_dir=tmp_path, max_len=50)
  check_arrays(test, 9, 50, 2, 257)
  check_arrays(train, 9, 50, 2, 257)
  assert decode_bytes(test) == [bytes(t)[:50] for t in raw["text"]]
  assert test.targets.tolist() == raw["label"].tolist()


# ------------------------------------------------------------------------ errors, provenance

def test_tfds_not_prepared_says_how_to_prepare(tmp_path, monkeypatch):
  monkeypatch.setattr(tfds.core.constants, "DATA_DIR", str(tmp_path / "tfds"))
  with pytest.raises(FileNotFoundError, match=r"TFDS 'cifar10' is not prepared .*"
                                              r"download=True.*cifar-10-batches-py"):
    lra.load("image", "test", data_dir=tmp_path)


def test_provenance_of_tfds(tmp_path):
  with tfds.testing.mock_data(num_examples=2):
    record = lra.provenance("text", tmp_path)
    version = str(tfds.builder("imdb_reviews").version)
  assert record["kind"] == "tfds" and record["files"] == {}
  assert record["tfds"]["name"] == "imdb_reviews" and record["tfds"]["version"] == version
