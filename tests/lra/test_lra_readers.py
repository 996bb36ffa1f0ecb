"""lra.load on small fixtures written here in each official LRA format, checked value by value."""
import pickle
import sys

import numpy as np
import pytest
from PIL import Image

import lra
from lra import readers
from lra_fixtures import (decode_bytes, independent_grayscale, write_cifar, write_imdb,
                          write_listops, write_pathfinder, write_retrieval)

LISTOPS_IDS = {tok: i for i, tok in enumerate(
    ["<pad>", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
     "[MAX", "[MED", "[MIN", "[SM", "]"])}


def byte_ids(text: bytes, max_len):
  ids = np.zeros(max_len, np.int32)
  ids[:min(len(text), max_len)] = [b + 1 for b in text[:max_len]]
  return ids


# -------------------------------------------------------------------------------- task specs

def test_tasks_and_specs():
  assert lra.available_tasks() == ("listops", "text", "retrieval", "image", "pathfinder",
                                   "pathx")
  expected = {  # num_classes, max_len, vocab_size, dual, has_padding
      "listops": (10, 2000, 16, False, True), "text": (2, 1000, 257, False, True),
      "retrieval": (2, 4000, 257, True, True), "image": (10, 1024, 256, False, False),
      "pathfinder": (2, 1024, 256, False, False), "pathx": (2, 16384, 256, False, False)}
  for name, values in expected.items():
    spec = lra.task_spec(name)
    assert (spec.num_classes, spec.max_len, spec.vocab_size, spec.dual,
            spec.has_padding) == values
    with pytest.raises(Exception):
      spec.max_len = 3  # frozen


def test_unknown_task_and_split(tmp_path):
  with pytest.raises(ValueError, match="listops, text, retrieval, image, pathfinder, pathx"):
    lra.task_spec("cifar")
  with pytest.raises(ValueError, match="unknown LRA task 'cifar'"):
    lra.load("cifar", "train", data_dir=tmp_path)
  with pytest.raises(ValueError, match="train, validation, test"):
    lra.load("listops", "val", data_dir=tmp_path)
  with pytest.raises(ValueError, match="max_len"):
    lra.load("listops", "train", data_dir=tmp_path, max_len=0)
  with pytest.raises(ValueError, match="only to"):
    lra.load("listops", "train", data_dir=tmp_path, resolution=32)


# ------------------------------------------------------------------------------------ ListOps

def test_listops_ids_masks_targets_and_max_len(tmp_path):
  write_listops(tmp_path, "basic_train.tsv", [
      "( ( ( [MAX 2 ) 9 ) ] )\t9",
      "( ( ( ( [SM 8 ) ( ( ( [MIN 4 ) 0 ) ] ) ) 7 ) ] )\t5",
  ])
  ds = lra.load("listops", "train", data_dir=tmp_path)
  assert ds.inputs.dtype == np.int32 and ds.inputs.shape == (2, 2000)
  assert ds.masks.dtype == bool and ds.targets.dtype == np.int32
  first = [LISTOPS_IDS[t] for t in ["[MAX", "2", "9", "]"]]
  second = [LISTOPS_IDS[t] for t in ["[SM", "8", "[MIN", "4", "0", "]", "7", "]"]]
  assert ds.inputs[0, :4].tolist() == first and not ds.inputs[0, 4:].any()
  assert ds.inputs[1, :8].tolist() == second and not ds.inputs[1, 8:].any()
  assert ds.masks.sum(1).tolist() == [4, 8]
  assert ds.masks[0, :4].all() and not ds.masks[0, 4:].any()
  assert ds.targets.tolist() == [9, 5]

  short = lra.load("listops", "train", data_dir=tmp_path, max_len=6)
  assert short.inputs.shape == (2, 6)
  assert short.inputs[1].tolist() == second[:6] and short.masks[1].all()


@pytest.mark.parametrize("row, message", [
    ("( ( ( [MAX 2 ) 9 ) ] ) 9", r"line 3: expected 2 tab-separated fields"),
    ("( ( ( [MAX 2 ) 9 ) ] )\tnine", r"line 3: Target must be an integer"),
    ("( ( ( [MAX 2 ) 9 ) ] )\t12", r"line 3: Target must be an integer"),
    ("( ( ( [FIRST 2 ) 9 ) ] )\t2", r"line 3: unknown token '\[FIRST'"),
])
def test_listops_malformed_row_names_file_and_line(tmp_path, row, message):
  path = write_listops(tmp_path, "basic_test.tsv", ["( ( ( [MIN 2 ) 9 ) ] )\t2", row])
  with pytest.raises(ValueError, match=message) as info:
    lra.load("listops", "test", data_dir=tmp_path, cache=False)
  assert str(path) in str(info.value)


def test_listops_bad_header(tmp_path):
  write_listops(tmp_path, "basic_val.tsv", ["1\t1"], header="Src\tTgt")
  with pytest.raises(ValueError, match="line 1: expected the header"):
    lra.load("listops", "validation", data_dir=tmp_path)


def test_missing_data_names_path_and_how_to_get_it(tmp_path):
  with pytest.raises(FileNotFoundError) as info:
    lra.load("listops", "validation", data_dir=tmp_path)
  message = str(info.value)
  assert str(tmp_path / "listops-1000" / "basic_val.tsv") in message
  assert f"python -m lra.generate listops --out {tmp_path}" in message
  assert "lra_release.gz" in message and "google-research/long-range-arena" in message

  with pytest.raises(FileNotFoundError) as info:
    lra.load("retrieval", "validation", data_dir=tmp_path)
  assert str(tmp_path / "tsv_data" / "new_aan_pairs.eval.tsv") in str(info.value)
  assert "lra_release.gz" in str(info.value)

  with pytest.raises(FileNotFoundError) as info:
    lra.load("pathfinder", "train", data_dir=tmp_path)
  message = str(info.value)
  assert str(tmp_path / "pathfinder32" / "curv_contour_length_14" / "metadata") in message
  assert "python -m lra.generate pathfinder --resolution 32 --difficulty hard" in message

  for task in ("listops", "retrieval", "pathx"):
    with pytest.raises(ValueError, match="read from data_dir, but data_dir is None"):
      lra.load(task, "train")


# ---------------------------------------------------------------------------------- Retrieval

def test_retrieval_two_towers_byte_encoding(tmp_path):
  text1 = "naïve café – 日本語 ✓".encode("utf-8")
  text2 = b"b'plain ascii text'"
  long_text = bytes(b for b in range(256) if b not in b"\t\n\r") * 50  # 12,650 bytes
  write_retrieval(tmp_path, "new_aan_pairs.train.tsv", [
      b"1.0\tP1\tP2\t" + text1 + b"\t" + text2,
      b"0.0\tP3\tP4\t" + long_text + b"\t" + b"x",
  ])
  ds = lra.load("retrieval", "train", data_dir=tmp_path, max_len=40)
  assert ds.dual and ds.inputs.shape == ds.inputs2.shape == (2, 40)
  assert ds.targets.tolist() == [1, 0]
  np.testing.assert_array_equal(ds.inputs[0], byte_ids(text1, 40))
  np.testing.assert_array_equal(ds.inputs2[0], byte_ids(text2, 40))
  np.testing.assert_array_equal(ds.inputs[1], byte_ids(long_text, 40))
  assert ds.inputs[1, :3].tolist() == [1, 2, 3]  # bytes 0, 1, 2
  assert ds.masks.sum(1).tolist() == [len(text1), 40]
  assert ds.masks2.sum(1).tolist() == [len(text2), 1]
  assert len(text1) > len("naïve café – 日本語 ✓")  # multi-byte characters are exercised

  # Each document is cut to 10,000 bytes before max_len; byte 255 becomes id 256.
  wide = lra.load("retrieval", "train", data_dir=tmp_path, max_len=12_000)
  assert wide.masks.sum(1).tolist() == [len(text1), 10_000]
  np.testing.assert_array_equal(wide.inputs[1, :10_000],
                                np.frombuffer(long_text[:10_000], np.uint8).astype(np.int32) + 1)
  assert wide.inputs.max() == 256


@pytest.mark.parametrize("row, message", [
    (b"1.0\tP1\tP2\tonly four", r"line 2: expected 5 tab-separated fields"),
    (b"2.0\tP1\tP2\ta\tb", r"line 2: label must be 0.0 or 1.0"),
    (b"yes\tP1\tP2\ta\tb", r"line 2: label must be 0.0 or 1.0"),
])
def test_retrieval_malformed_row(tmp_path, row, message):
  path = write_retrieval(tmp_path, "new_aan_pairs.test.tsv", [b"0.0\ta\tb\tc\td", row])
  with pytest.raises(ValueError, match=message) as info:
    lra.load("retrieval", "test", data_dir=tmp_path)
  assert str(path) in str(info.value)


# --------------------------------------------------------------------------------------- Text

def test_text_from_aclimdb(tmp_path):
  accented = "  Ein großartiger Film — 10/10 ♥\n".encode("utf-8")
  write_imdb(tmp_path, {
      ("train", "neg"): [b"Bad.", b"Awful <br /> film"],
      ("train", "pos"): [accented],
      ("test", "neg"): [b"meh"],
      ("test", "pos"): [b"Great", b"Fine"],
  })
  train = lra.load("text", "train", data_dir=tmp_path, max_len=4000)
  assert train.inputs.shape == (3, 4000)
  assert train.targets.tolist() == [0, 0, 1]
  stripped = accented.strip()  # TFDS imdb_reviews strips surrounding whitespace
  np.testing.assert_array_equal(train.inputs[2], byte_ids(stripped, 4000))
  np.testing.assert_array_equal(train.inputs[1], byte_ids(b"Awful <br /> film", 4000))
  assert train.masks.sum(1).tolist() == [4, 17, len(stripped)]

  test = lra.load("text", "test", data_dir=tmp_path)
  assert test.inputs.shape == (3, 1000) and test.targets.tolist() == [0, 1, 1]
  np.testing.assert_array_equal(test.inputs[1], byte_ids(b"Great", 1000))
  # Validation is 10% of train, floor(3 / 10) = 0 reviews here: an empty split is an error.
  with pytest.raises(ValueError, match=r"validation split of text read from .*train.* has no "
                                       "examples"):
    lra.load("text", "validation", data_dir=tmp_path)

  cut = lra.load("text", "train", data_dir=tmp_path, max_len=5)
  np.testing.assert_array_equal(cut.inputs[1], byte_ids(b"Awful", 5))


def imdb_reviews(count, tag):
  """`count` distinct reviews, alternately negative and positive."""
  return [f"{tag} review {i}: {'good' if i % 2 else 'bad'} film".encode() for i in range(count)]


def test_text_validation_is_carved_from_train_by_content(tmp_path):
  train_texts = imdb_reviews(40, "train")
  test_texts = imdb_reviews(5, "test")
  write_imdb(tmp_path, {("train", "neg"): train_texts[0::2], ("train", "pos"): train_texts[1::2],
                        ("test", "neg"): test_texts[0::2], ("test", "pos"): test_texts[1::2]})
  train = lra.load("text", "train", data_dir=tmp_path, max_len=64)
  validation = lra.load("text", "validation", data_dir=tmp_path, max_len=64)
  test = lra.load("text", "test", data_dir=tmp_path, max_len=64)
  assert (len(train), len(validation), len(test)) == (36, 4, 5)  # 10% of the 40 train reviews
  train_rows, validation_rows = decode_bytes(train), decode_bytes(validation)
  assert sorted(train_rows + validation_rows) == sorted(train_texts)  # a partition of train
  assert not set(validation_rows) & set(train_rows)
  assert not set(validation_rows) & set(decode_bytes(test))
  label = {text: i % 2 for i, text in enumerate(train_texts)}
  assert validation.targets.tolist() == [label[t] for t in validation_rows]
  assert train.targets.tolist() == [label[t] for t in train_rows]

  # The choice depends on the texts only: other file names, in another order, choose the same.
  other = tmp_path / "renamed"
  for folder, texts in (("neg", train_texts[0::2]), ("pos", train_texts[1::2])):
    (other / "aclImdb" / "train" / folder).mkdir(parents=True)
    for i, text in enumerate(texts):
      (other / "aclImdb" / "train" / folder / f"{len(texts) - i:05d}_1.txt").write_bytes(text)
  write_imdb(other, {("test", "neg"): test_texts[0::2], ("test", "pos"): test_texts[1::2]})
  again = lra.load("text", "validation", data_dir=other, max_len=64)
  assert sorted(decode_bytes(again)) == sorted(validation_rows)


def test_text_validation_keeps_copies_together_and_away_from_test():
  unique = imdb_reviews(60, "u")
  doubled = imdb_reviews(20, "d")
  shared = imdb_reviews(20, "s")  # also in test
  train_texts = unique + doubled + doubled + shared  # 120 reviews: 12 for validation
  mask = readers.text_validation_mask(train_texts, shared + [b"only in test"])
  chosen = [text for text, keep in zip(train_texts, mask) if keep]
  assert 12 <= len(chosen) <= 13  # one group of 2 copies may straddle the cut
  assert not set(chosen) & set(shared)
  for text in doubled:  # both copies on the same side
    assert train_texts.count(text) == 2 and mask[train_texts.index(text)] == mask[
        len(unique) + len(doubled) + doubled.index(text)]
  assert set(chosen) & set(doubled)  # the copies were exercised
  # Without the test texts some of the shared ones would have been chosen.
  unguarded = readers.text_validation_mask(train_texts, [])
  assert {t for t, keep in zip(train_texts, unguarded) if keep} & set(shared)
  # The same texts in another order choose the same texts.
  order = np.random.default_rng(0).permutation(len(train_texts))
  shuffled = [train_texts[i] for i in order]
  remask = readers.text_validation_mask(shuffled, shared)
  assert sorted(t for t, keep in zip(shuffled, remask) if keep) == sorted(chosen)


def test_text_without_aclimdb_or_tfds_says_what_to_install(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
  with pytest.raises(ImportError) as info:
    lra.load("text", "train", data_dir=tmp_path)
  message = str(info.value)
  assert 'pip install -e ".[data]"' in message and str(tmp_path / "aclImdb") in message
  with pytest.raises(ImportError, match="cifar-10-batches-py"):
    lra.load("image", "test", data_dir=tmp_path)


# -------------------------------------------------------------------------------------- Image

# Colours where tf.image.rgb_to_grayscale (TF 2.21, uint8 input) differs from a BLAS-order or a
# float64 evaluation of its formula, with TF's outputs; plus the primaries.
TF_GRAYSCALE = [
    ((5, 171, 227), 128), ((94, 116, 93), 106), ((129, 174, 9), 142), ((190, 27, 177), 92),
    ((212, 121, 3), 134), ((223, 65, 245), 133), ((254, 12, 209), 107), ((0, 122, 186), 93),
    ((33, 252, 183), 179), ((57, 141, 0), 100), ((192, 210, 210), 205), ((244, 169, 241), 200),
    ((255, 255, 255), 255), ((255, 0, 0), 76), ((0, 255, 0), 149), ((0, 0, 255), 29),
    ((128, 128, 128), 128), ((0, 0, 0), 0), ((1, 1, 1), 1),
]


def test_grayscale_matches_tensorflow_values():
  colours = np.array([c for c, _ in TF_GRAYSCALE], np.uint8)
  assert lra.rgb_to_grayscale(colours).tolist() == [g for _, g in TF_GRAYSCALE]
  rgb = np.random.default_rng(0).integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
  np.testing.assert_array_equal(lra.rgb_to_grayscale(rgb), independent_grayscale(rgb))


def test_image_from_cifar_pickles(tmp_path):
  rng = np.random.default_rng(1)
  batches = write_cifar(tmp_path, rng)
  train_images = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
  train_labels = sum((batches[f"data_batch_{i}"][1] for i in range(1, 6)), [])
  # Rewrite batch 1 with the TF reference colours on the first row of its first image.
  train_images[0, 0, :len(TF_GRAYSCALE)] = [c for c, _ in TF_GRAYSCALE]
  with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "wb") as f:
    pickle.dump({b"data": train_images[:4].transpose(0, 3, 1, 2).reshape(4, 3072),
                 b"labels": train_labels[:4]}, f, protocol=4)

  train = lra.load("image", "train", data_dir=tmp_path)
  validation = lra.load("image", "validation", data_dir=tmp_path)
  test = lra.load("image", "test", data_dir=tmp_path)
  assert (len(train), len(validation), len(test)) == (18, 2, 3)  # 90% / 10% of 20, test
  gray = independent_grayscale(train_images).reshape(20, 1024)  # row-major pixels
  np.testing.assert_array_equal(train.inputs, gray[:18])
  np.testing.assert_array_equal(validation.inputs, gray[18:])
  assert train.inputs[0, :len(TF_GRAYSCALE)].tolist() == [g for _, g in TF_GRAYSCALE]
  assert train.targets.tolist() == train_labels[:18]
  assert validation.targets.tolist() == train_labels[18:]
  test_images, test_labels = batches["test_batch"]
  np.testing.assert_array_equal(test.inputs, independent_grayscale(test_images).reshape(3, -1))
  assert test.targets.tolist() == test_labels
  assert train.masks.all() and train.inputs.dtype == np.int32

  padded = lra.load("image", "test", data_dir=tmp_path, max_len=1100)
  assert padded.masks.sum(1).tolist() == [1024] * 3 and padded.spec.has_padding
  np.testing.assert_array_equal(padded.inputs[:, :1024], test.inputs)


def test_image_missing_batch_and_bad_pickle(tmp_path):
  write_cifar(tmp_path, np.random.default_rng(2))
  (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
  with pytest.raises(FileNotFoundError, match="data_batch_3"):
    lra.load("image", "train", data_dir=tmp_path)
  with open(tmp_path / "cifar-10-batches-py" / "test_batch", "wb") as f:
    pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f, protocol=4)
  with pytest.raises(ValueError, match=r"test_batch: b'data' must be uint8 \[N, 3072\]"):
    lra.load("image", "test", data_dir=tmp_path)


def test_image_from_cifar_pickled_as_released(tmp_path):
  """Batches byte for byte in the format of the released files (Python 2 pickles whose arrays
  name numpy.core.multiarray) load through the restricted unpickler."""
  batches = write_cifar(tmp_path, np.random.default_rng(7), python2=True)
  assert b"cnumpy.core.multiarray\n_reconstruct" in (
      tmp_path / "cifar-10-batches-py" / "test_batch").read_bytes()
  train = lra.load("image", "train", data_dir=tmp_path, cache=False)
  test = lra.load("image", "test", data_dir=tmp_path, cache=False)
  train_images = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
  np.testing.assert_array_equal(train.inputs, independent_grayscale(train_images[:18])
                                .reshape(18, -1))
  test_images, test_labels = batches["test_batch"]
  np.testing.assert_array_equal(test.inputs, independent_grayscale(test_images).reshape(3, -1))
  assert test.targets.tolist() == test_labels


class RunsCode:
  """Unpickling this calls `action(*args)`: what a crafted pickle does."""

  def __init__(self, action, *args):
    self.action, self.args = action, args

  def __reduce__(self):
    return self.action, self.args


@pytest.mark.parametrize("payload, protocol", [("system", 2), ("system", 4), ("exec", 4),
                                               ("nested", 4)])
def test_cifar_pickle_that_would_run_code_is_refused(tmp_path, payload, protocol):
  import builtins
  import os

  write_cifar(tmp_path, np.random.default_rng(8))
  marker = tmp_path / "ran"
  action = {"system": RunsCode(os.system, f"touch {marker}"),
            "exec": RunsCode(builtins.exec, f"open({str(marker)!r}, 'w').write('ran')")}
  evil = action.get(payload, action["system"])
  batch = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}
  if payload == "nested":  # deep inside an otherwise genuine batch
    batch[b"labels"] = [0, {b"x": [evil]}]
  else:
    batch = evil
  path = tmp_path / "cifar-10-batches-py" / "test_batch"
  path.write_bytes(pickle.dumps(batch, protocol=protocol))  # 2: GLOBAL, 4: STACK_GLOBAL
  refused = f"{evil.action.__module__}.{evil.action.__name__}"
  with pytest.raises(ValueError, match=f"refused to unpickle the global {refused}") as info:
    lra.load("image", "test", data_dir=tmp_path, cache=False)
  assert str(path) in str(info.value) and isinstance(info.value, readers.UnsafePickleError)
  assert not marker.exists()  # the code did not run
  # The same pickle, unpickled without restriction, does run it: the test is meaningful.
  pickle.loads(path.read_bytes())
  assert marker.exists()


def test_cifar_unpickler_admits_only_the_array_globals(tmp_path):
  write_cifar(tmp_path, np.random.default_rng(9))
  path = tmp_path / "cifar-10-batches-py" / "test_batch"
  # Python 3's protocol-2 bytes need _codecs.encode, which the released files never use.
  path.write_bytes(pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [1]},
                                protocol=2))
  with pytest.raises(ValueError, match="refused to unpickle the global _codecs.encode"):
    lra.load("image", "test", data_dir=tmp_path, cache=False)
  assert sorted(readers._CIFAR_GLOBALS) == [
      ("numpy", "dtype"), ("numpy", "ndarray"), ("numpy._core.multiarray", "_reconstruct"),
      ("numpy.core.multiarray", "_reconstruct")]


def test_cifar_labels_out_of_range(tmp_path):
  write_cifar(tmp_path, np.random.default_rng(10))
  path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
  with open(path, "wb") as f:
    pickle.dump({b"data": np.zeros((3, 3072), np.uint8), b"labels": [1, 10, 2]}, f, protocol=4)
  with pytest.raises(ValueError, match=r"data_batch_2: b'labels' must be integers 0-9, got 10 "
                                       "for image 1"):
    lra.load("image", "validation", data_dir=tmp_path)


# --------------------------------------------------------------------------------- Pathfinder

def test_pathfinder_split_pixels_and_empty_image(tmp_path):
  entries = write_pathfinder(tmp_path, np.random.default_rng(3),
                             broken={(0, 2): b"", (1, 3): b"\x89PNG truncated"})
  loaded = {split: lra.load("pathfinder", split, data_dir=tmp_path) for split in lra.SPLITS}
  bounds = {"train": (0, 16), "validation": (16, 18), "test": (18, 20)}  # 80/10/10 of 20
  for split, (start, stop) in bounds.items():
    kept = [(p, label) for p, label in entries[start:stop] if p is not None]
    ds = loaded[split]
    assert len(ds) == len(kept)
    np.testing.assert_array_equal(ds.inputs, np.stack([p.reshape(-1) for p, _ in kept]))
    assert ds.targets.tolist() == [label for _, label in kept]
    assert ds.masks.all() and ds.inputs.shape[1] == 1024
  assert len(loaded["train"]) == 14 and loaded["train"].num_skipped == 2
  assert (loaded["train"].inputs[:, 0] == 0).all() and loaded["train"].masks[:, 0].all()


def test_pathx_and_difficulty_options(tmp_path):
  entries = write_pathfinder(tmp_path, np.random.default_rng(4), resolution=128,
                             per_file=(10, 0, 0))
  ds = lra.load("pathx", "test", data_dir=tmp_path)
  assert ds.inputs.shape == (1, 16384) and ds.spec.image_size == 128
  np.testing.assert_array_equal(ds.inputs[0], entries[9][0].reshape(-1))

  easy = write_pathfinder(tmp_path, np.random.default_rng(5), per_file=(10, 0, 0),
                          folder_name="curv_baseline")
  ds = lra.load("pathfinder", "validation", data_dir=tmp_path, difficulty="easy")
  np.testing.assert_array_equal(ds.inputs[0], easy[8][0].reshape(-1))
  with pytest.raises(ValueError, match="difficulty must be one of"):
    lra.load("pathfinder", "train", data_dir=tmp_path, difficulty="medium")
  with pytest.raises(ValueError, match="resolution must be one of"):
    lra.load("pathx", "train", data_dir=tmp_path, resolution=100)


def test_pathfinder_malformed_metadata_and_wrong_image(tmp_path):
  write_pathfinder(tmp_path, np.random.default_rng(6), per_file=(10, 0, 0))
  folder = tmp_path / "pathfinder32" / "curv_contour_length_14"
  meta = folder / "metadata" / "1.npy"
  meta.write_text("imgs/1 sample_0.png 0\n")
  with pytest.raises(ValueError, match="line 1: expected whitespace-separated fields") as info:
    lra.load("pathfinder", "train", data_dir=tmp_path)
  assert str(meta) in str(info.value)
  meta.write_text("")
  Image.new("RGB", (32, 32)).save(folder / "imgs" / "0" / "sample_9.png")
  with pytest.raises(ValueError, match="sample_9.png: expected an 8-bit grayscale"):
    lra.load("pathfinder", "test", data_dir=tmp_path)


def test_generated_pathfinder_round_trip(tmp_path):
  """The CLI and lra.generate_pathfinder write what lra.load reads (the generator itself is
  tested in test_pathfinder_generator.py)."""
  import subprocess

  run = subprocess.run([sys.executable, "-m", "lra.generate", "pathfinder", "--resolution",
                        "32", "--difficulty", "easy", "--num", "10", "--out",
                        str(tmp_path / "cli"), "--seed", "1", "--noprogress"],
                       capture_output=True, text=True)
  assert run.returncode == 0, run.stderr
  folder = tmp_path / "cli" / "pathfinder32" / "curv_baseline"
  assert str(folder) in run.stdout
  written = lra.generate_pathfinder(tmp_path / "api", difficulty="easy", num=10, seed=1,
                                    progress=False)
  assert written == str(tmp_path / "api" / "pathfinder32" / "curv_baseline")

  rows = [line.split() for meta in sorted((folder / "metadata").glob("*.npy"))
          for line in meta.read_text().splitlines()]
  assert len(rows) == 10
  pixels = [np.asarray(Image.open(folder / r[0] / r[1])).reshape(-1) for r in rows]
  labels = [int(r[3]) for r in rows]
  for split, (start, stop) in {"train": (0, 8), "validation": (8, 9), "test": (9, 10)}.items():
    cli = lra.load("pathfinder", split, data_dir=tmp_path / "cli", difficulty="easy")
    api = lra.load("pathfinder", split, data_dir=tmp_path / "api", difficulty="easy")
    np.testing.assert_array_equal(cli.inputs, np.stack(pixels[start:stop]))
    assert cli.targets.tolist() == labels[start:stop]
    np.testing.assert_array_equal(api.inputs, cli.inputs)
