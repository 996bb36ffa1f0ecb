"""Writers of small LRA data sets in the official file formats, shared by the tests, and an
independent grayscale conversion to check the Image readers against.

Each writer puts files under `root` exactly where `lra.load(task, split, data_dir=root)`
looks for them (docs/data.md lists the files).
"""
import pickle
import struct

import numpy as np
from PIL import Image


def independent_grayscale(rgb):
  """TF's formula written out per channel: float32 x/255 weighted, then *255.5, truncated."""
  out = np.zeros(rgb.shape[:-1], np.float32)
  for channel, weight in enumerate((0.2989, 0.5870, 0.1140)):
    out = out + (rgb[..., channel].astype(np.float32) * np.float32(1.0 / 255.0)) \
        * np.float32(weight)
  return np.floor(out * np.float32(255.5)).astype(np.uint8)


def decode_bytes(ds):
  """The byte string of each example of a byte-level dataset (ids are byte + 1)."""
  return [bytes((row[:length] - 1).astype(np.uint8).tolist())
          for row, length in zip(ds.inputs, ds.masks.sum(1))]


def write_listops(root, split_file, rows, header="Source\tTarget"):
  """rows: "Source<TAB>Target" lines -> root/listops-1000/<split_file>."""
  folder = root / "listops-1000"
  folder.mkdir(parents=True, exist_ok=True)
  (folder / split_file).write_text(header + "\n" + "".join(r + "\n" for r in rows),
                                   encoding="utf-8")
  return folder / split_file


def write_retrieval(root, split_file, rows):
  """rows: b"label<TAB>id1<TAB>id2<TAB>text1<TAB>text2" -> root/tsv_data/<split_file>."""
  folder = root / "tsv_data"
  folder.mkdir(parents=True, exist_ok=True)
  (folder / split_file).write_bytes(b"".join(row + b"\n" for row in rows))
  return folder / split_file


def write_imdb(root, reviews):
  """reviews: {(folder, label): [bytes, ...]} written as aclImdb/<folder>/<label>/<i>_7.txt."""
  for (folder, label), texts in reviews.items():
    d = root / "aclImdb" / folder / label
    d.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
      (d / f"{i}_7.txt").write_bytes(text)


def write_cifar(root, rng, sizes=(4, 4, 4, 4, 4), test_size=3, python2=False):
  """CIFAR-10 python pickles (data_batch_1..5, test_batch) of random images; python2: pickled
  byte for byte as the released files. Returns {batch name: (images uint8 [N, 32, 32, 3],
  labels)}."""
  folder = root / "cifar-10-batches-py"
  folder.mkdir(parents=True)
  batches = {}
  names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
  for name, n in zip(names, list(sizes) + [test_size]):
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)  # [N, H, W, C]
    labels = rng.integers(0, 10, n).tolist()
    data = images.transpose(0, 3, 1, 2).reshape(n, 3072)  # channel-major rows
    with open(folder / name, "wb") as f:
      if python2:
        f.write(python2_cifar_pickle(data, labels, name.encode()))
      else:  # protocol 4: numpy arrays need the same globals as in the released files
        pickle.dump({b"data": data, b"labels": labels, b"batch_label": b"x"}, f, protocol=4)
    batches[name] = (images, labels)
  return batches


def python2_cifar_pickle(data, labels, batch_label=b"batch"):
  """A CIFAR-10 batch pickled as the released files are (Python 2, protocol 2): dict keys
  and strings as Python 2 str, numpy arrays by `numpy.core.multiarray._reconstruct`.
  data: uint8 [N, 3072]; labels: N ints."""
  out = bytearray(b"\x80\x02}(")  # PROTO 2, EMPTY_DICT, MARK

  def string(value: bytes):  # SHORT_BINSTRING / BINSTRING: Python 2 str
    out.extend(b"U" + bytes([len(value)]) if len(value) < 256
               else b"T" + struct.pack("<I", len(value)))
    out.extend(value)

  def integer(value: int):  # BININT1 / BININT2 / BININT
    out.extend(b"K" + bytes([value]) if 0 <= value < 256 else
               b"M" + struct.pack("<H", value) if 0 <= value < 65536 else
               b"J" + struct.pack("<i", value))

  def listing(items, put):  # EMPTY_LIST, MARK, items, APPENDS
    out.extend(b"](")
    for item in items:
      put(item)
    out.extend(b"e")

  string(b"batch_label")
  string(batch_label)
  string(b"labels")
  listing(labels, integer)
  string(b"data")  # _reconstruct(ndarray, (0,), 'b'), then ndarray.__setstate__
  out.extend(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
             b"K\x00\x85U\x01b\x87R(K\x01")
  integer(data.shape[0])
  integer(data.shape[1])
  out.extend(b"\x86cnumpy\ndtype\nU\x02u1K\x00K\x01\x87R"  # dtype('u1') and its state
             b"(K\x03U\x01|NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89")
  string(np.ascontiguousarray(data, np.uint8).tobytes())
  out.extend(b"tb")
  string(b"filenames")
  listing([f"img_{i}.png".encode() for i in range(len(labels))], string)
  out.extend(b"u.")  # SETITEMS, STOP
  return bytes(out)


def write_pathfinder(root, rng, resolution=32, per_file=(7, 7, 6), broken=None,
                     folder_name=None):
  """Official layout: imgs/<k>/sample_<n>.png and text metadata/<k>.npy, one line per image.
  broken: {(k, n): bytes written instead of a PNG}. Returns [(pixels or None, label)] in
  metadata order."""
  broken = broken or {}
  folder = root / f"pathfinder{resolution}" / (folder_name or "curv_contour_length_14")
  (folder / "metadata").mkdir(parents=True)
  entries = []
  # Metadata files 0, 1, 10...: numeric order must put 10 last.
  for k, count in zip((0, 1, 10), per_file):
    (folder / "imgs" / str(k)).mkdir(parents=True)
    lines = []
    for n in range(count):
      pixels = rng.integers(0, 256, (resolution, resolution), dtype=np.uint8)
      pixels[0, 0] = 0  # a black pixel: a real token, never padding
      label = int(rng.integers(0, 2))
      path = folder / "imgs" / str(k) / f"sample_{n}.png"
      if (k, n) in broken:
        path.write_bytes(broken[k, n])
        pixels = None
      else:
        Image.fromarray(pixels, mode="L").save(path)
      lines.append(f"imgs/{k} sample_{n}.png {n} {label} 14 1.5 2\n")
      entries.append((pixels, label))
    (folder / "metadata" / f"{k}.npy").write_text("".join(lines))
  return entries
