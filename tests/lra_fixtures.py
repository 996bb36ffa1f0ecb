"""Writers of small LRA data sets in the official file formats, shared by the tests.

Each writer puts files under `root` exactly where `lra.load(task, split, data_dir=root)`
looks for them (the README's Data section lists the files).
"""
import pickle

import numpy as np
from PIL import Image


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


def write_cifar(root, rng, sizes=(4, 4, 4, 4, 4), test_size=3):
  """CIFAR-10 python pickles (data_batch_1..5, test_batch) of random images.
  Returns {batch name: (images uint8 [N, 32, 32, 3], labels)}."""
  folder = root / "cifar-10-batches-py"
  folder.mkdir(parents=True)
  batches = {}
  names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
  for name, n in zip(names, list(sizes) + [test_size]):
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)  # [N, H, W, C]
    labels = rng.integers(0, 10, n).tolist()
    data = images.transpose(0, 3, 1, 2).reshape(n, 3072)  # channel-major rows
    with open(folder / name, "wb") as f:
      pickle.dump({b"data": data, b"labels": labels, b"batch_label": b"x"}, f)
    batches[name] = (images, labels)
  return batches


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
