"""Tests of the Pathfinder / Path-X generator (lra/pathfinder_generator.py)."""

import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import lra
from lra import pathfinder_generator as pg


# --------------------------------------------------------------------------- helpers

def _read_dataset(root):
  """{(batch, n): (label, image uint8)} read through the metadata, checking the layout."""
  root = Path(root)
  items = {}
  for meta in sorted((root / "metadata").iterdir()):
    batch = int(meta.stem)
    assert meta.suffix == ".npy"
    for line in meta.read_text().splitlines():
      fields = line.split()
      assert len(fields) == 11
      n = int(fields[2])
      assert fields[0] == f"imgs/{batch}" and fields[1] == f"sample_{n}.png"
      assert fields[3] in ("0", "1")
      with Image.open(root / fields[0] / fields[1]) as png:
        assert png.mode == "L"
        items[batch, n] = int(fields[3]), np.asarray(png)
  return items


def _all_files(root):
  """Every file's bytes; the manifest's without its date, which is the only thing that varies."""
  files = {p.relative_to(root): p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}
  manifest = json.loads(files.pop(Path("generated.json")))
  del manifest["created"]
  files[Path("generated.json, undated")] = json.dumps(manifest, sort_keys=True).encode()
  return files


def _segment_gaps(tails, heads):
  """[P, P] exact distances between segments (a crossing counts as 0)."""
  a, b = tails[:, None], heads[:, None]
  c, d = tails[None, :], heads[None, :]
  gaps = np.minimum.reduce([pg._distance_to_segment(a, c, d), pg._distance_to_segment(b, c, d),
                            pg._distance_to_segment(c, a, b), pg._distance_to_segment(d, a, b)])

  def side(p, q, r):
    return np.sign(((q - p).conjugate() * (r - p)).imag)

  crossing = ((side(a, b, c) * side(a, b, d) < 0) & (side(c, d, a) * side(c, d, b) < 0))
  return np.where(crossing, 0.0, gaps)


def _marker_paddle(scene, marker):
  ends = np.minimum(np.abs(scene.tails - marker), np.abs(scene.heads - marker))
  assert ends.min() < 1e-9           # a marker sits exactly on a paddle end
  return int(np.argmin(ends))


def _reachable(adjacent, start, goal):
  """Breadth-first search over a boolean adjacency (matrix or image with 8-neighbours)."""
  seen, queue = {start}, deque([start])
  while queue:
    node = queue.popleft()
    if node == goal:
      return True
    if isinstance(node, int):
      neighbours = np.flatnonzero(adjacent[node]).tolist()
    else:
      y, x = node
      neighbours = [(y + dy, x + dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)
                    if 0 <= y + dy < adjacent.shape[0] and 0 <= x + dx < adjacent.shape[1]
                    and adjacent[y + dy, x + dx]]
    for nxt in neighbours:
      if nxt not in seen:
        seen.add(nxt)
        queue.append(nxt)
  return False


def _disk_dilate(mask, radius):
  k = int(radius)
  padded = np.pad(mask, k)
  out = np.zeros_like(mask)
  h, w = mask.shape
  for dy in range(-k, k + 1):
    for dx in range(-k, k + 1):
      if dy * dy + dx * dx <= radius * radius:
        out |= padded[k + dy:k + dy + h, k + dx:k + dx + w]
  return out


def _markers_linked_in_image(image, markers, params, margin, threshold=100, up=2):
  """Do the markers connect through bright pixels, bridging gaps narrower than
  2 * margin - thickness / 2 (gaps inside a contour are at most 2 * margin - thickness,
  between contours at least 2 * margin)? Marker discs are taken out before the bridging
  and put back slightly shrunk, so a disc cannot bridge to a neighbouring contour."""
  res = image.shape[0]
  big = np.asarray(Image.fromarray(image).resize((res * up, res * up), Image.BILINEAR))
  yy, xx = np.mgrid[:res * up, :res * up]
  to_marker = np.minimum(*[np.hypot((xx + 0.5) / up - z.real, (yy + 0.5) / up - z.imag)
                           for z in markers])
  ink = (big >= threshold) & (to_marker > params.marker_radius + 0.5)
  mask = (_disk_dilate(ink, (margin - params.paddle_thickness / 4) * up)
          | (to_marker <= params.marker_radius - 0.5))
  start, goal = [(int(z.imag * up), int(z.real * up)) for z in markers]
  return _reachable(mask, start, goal)


def _box_sums(image, width):
  """Sums over all width x width windows, and the window centres (x + 1j * y)."""
  c = np.pad(image.astype(np.int64), ((1, 0), (1, 0))).cumsum(0).cumsum(1)
  h = image.shape[0] - width + 1
  sums = c[width:, width:] - c[:h, width:] - c[width:, :h] + c[:h, :h]
  ys, xs = np.mgrid[:h, :h] + width / 2
  return sums, xs + 1j * ys


# --------------------------------------------------------------------------- the dataset files

def test_layout_metadata_and_balanced_labels(tmp_path):
  root = pg.generate_pathfinder(tmp_path, num=26, seed=3, images_per_batch=10,
                                progress=False)
  assert Path(root) == tmp_path / "pathfinder32" / "curv_contour_length_14"
  assert sorted(os.listdir(root)) == ["generated.json", "imgs", "metadata"]
  assert sorted(os.listdir(Path(root) / "imgs")) == ["0", "1", "2"]
  assert sorted(os.listdir(Path(root) / "metadata")) == ["0.npy", "1.npy", "2.npy"]
  items = _read_dataset(root)
  assert sorted(items) == [(k // 10, k % 10) for k in range(26)]
  assert sum(len(os.listdir(Path(root) / "imgs" / b)) for b in "012") == 26
  for label, image in items.values():
    assert image.shape == (32, 32) and image.dtype == np.uint8
  labels = [items[k // 10, k % 10][0] for k in range(26)]
  assert sum(labels) == 13
  assert all(labels[i] != labels[i + 1] for i in range(0, 26, 2))   # one of each per pair
  assert labels[:8] != [0, 1] * 4 and labels[:8] != [1, 0] * 4      # but not alternating
  first = (Path(root) / "metadata" / "0.npy").read_text().splitlines()[0].split()
  assert first[4:] == ["1", "14", "4", "2", "0.5", "1", "1"]  # continuity ... margin


def test_metadata_cut_short_is_refused_by_the_manifest(tmp_path):
  root = Path(pg.generate_pathfinder(tmp_path, num=20, images_per_batch=10, progress=False))
  metadata = root / "metadata" / "1.npy"
  metadata.write_text("".join(metadata.read_text().splitlines(keepends=True)[:5]))
  # 15 images listed: 12 for train where the manifest's 20 make 16
  with pytest.raises(ValueError, match=rf"^{root} holds 12 train examples, but "
                                       rf"{root}/generated.json says the generator wrote 16"):
    lra.load("pathfinder", "train", data_dir=tmp_path)


def test_difficulty_and_resolution_directories(tmp_path):
  assert pg.generate_pathfinder(tmp_path, resolution=128, difficulty="easy", num=2,
                                progress=False).endswith("pathfinder128/curv_baseline")
  root = pg.generate_pathfinder(tmp_path, resolution=64, difficulty="intermediate", num=2,
                                progress=False)
  assert root.endswith("pathfinder64/curv_contour_length_9")
  assert {img.shape for _, img in _read_dataset(root).values()} == {(64, 64)}


def test_deterministic_and_independent_of_workers(tmp_path):
  kwargs = dict(num=12, seed=5, images_per_batch=5, progress=False)
  one = _all_files(pg.generate_pathfinder(tmp_path / "a", **kwargs))
  assert one == _all_files(pg.generate_pathfinder(tmp_path / "b", **kwargs))
  assert one == _all_files(pg.generate_pathfinder(tmp_path / "c", workers=2, **kwargs))
  other_seed = _all_files(pg.generate_pathfinder(tmp_path / "d", **{**kwargs, "seed": 6}))
  assert one.keys() == other_seed.keys() and one != other_seed
  # An image depends on its index only, not on how many are generated.
  longer = _all_files(pg.generate_pathfinder(tmp_path / "e", **{**kwargs, "num": 14}))
  assert all(longer[name] == data for name, data in one.items() if "imgs" in name.parts)


def test_refuses_non_empty_target_unless_overwrite(tmp_path):
  root = Path(pg.generate_pathfinder(tmp_path, num=2, progress=False))
  with pytest.raises(ValueError, match="not empty.*overwrite=True"):
    pg.generate_pathfinder(tmp_path, num=2, progress=False)
  (root / "stray.txt").write_text("old")
  pg.generate_pathfinder(tmp_path, num=4, progress=False, overwrite=True)
  assert not (root / "stray.txt").exists() and len(_read_dataset(root)) == 4
  assert os.listdir(root.parent) == [root.name]                 # nothing left beside it
  empty = tmp_path / "x" / "pathfinder32" / "curv_baseline"
  empty.mkdir(parents=True)                                      # an empty target is fine
  pg.generate_pathfinder(tmp_path / "x", difficulty="easy", num=2, progress=False)


def test_interrupted_run_leaves_no_partial_dataset(tmp_path, monkeypatch):
  written = []
  real_write = pg._write_png

  def write_then_interrupt(path, image):
    if len(written) == 5:
      raise KeyboardInterrupt
    written.append(path)
    real_write(path, image)

  monkeypatch.setattr(pg, "_write_png", write_then_interrupt)
  with pytest.raises(KeyboardInterrupt):
    pg.generate_pathfinder(tmp_path, num=20, progress=False)
  assert len(written) == 5
  assert os.listdir(tmp_path) == []     # no target, no staging, not the folder above it


def test_staging_of_a_killed_run_is_removed(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  target = tmp_path / "pathfinder32" / "curv_contour_length_14"
  stale = target.parent / f"{pg._staging_glob(target)}{dead.pid}-abc"
  (stale / "imgs").mkdir(parents=True)
  pg.generate_pathfinder(tmp_path, num=2, progress=False)
  assert sorted(os.listdir(target.parent)) == [target.name]


@pytest.mark.parametrize("kwargs, message", [
    (dict(difficulty="medium"), "unknown difficulty 'medium'; valid values are 'easy', "
                                "'intermediate', 'hard'"),
    (dict(resolution=48), "unknown resolution 48; valid values are 32, 64, 128, 256"),
    (dict(num=0), "num must be an integer >= 1, got 0"),
    (dict(num=2.5), "num must be an integer >= 1"),
    (dict(seed=-1), "seed must be an integer >= 0"),
    (dict(workers=0), "workers must be an integer >= 1"),
    (dict(images_per_batch=True), "images_per_batch must be an integer >= 1"),
])
def test_argument_validation(tmp_path, kwargs, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    pg.generate_pathfinder(tmp_path, **{"num": 2, "progress": False, **kwargs})
  assert not (tmp_path / "pathfinder32").exists() or not os.listdir(tmp_path / "pathfinder32")


def test_render_sample_validation():
  with pytest.raises(ValueError, match="label must be 0 or 1, got 2"):
    pg.render_sample(np.random.default_rng(0), label=2)
  with pytest.raises(ValueError, match="unknown difficulty"):
    pg.render_sample(np.random.default_rng(0), difficulty="Hard", label=0)


# --------------------------------------------------------------------------- the images

@pytest.mark.parametrize("resolution, difficulty", [(32, "easy"), (32, "hard"), (64, "hard"),
                                                    (128, "hard"), (256, "intermediate")])
def test_contours_follow_the_paddle_rules(resolution, difficulty):
  params = pg.pathfinder_params(resolution, difficulty)
  for i in range(4):
    scene = pg.sample_scene(np.random.default_rng([1, i]), params)
    clearance = 2 * scene.margin + params.paddle_thickness
    lengths = np.abs(scene.heads - scene.tails)
    np.testing.assert_allclose(lengths, params.paddle_length)
    for end in (scene.tails, scene.heads):
      low = params.padding + scene.margin + params.paddle_thickness / 2 - 1e-9
      assert np.all(np.minimum(end.real, end.imag) >= low)
      assert np.all(np.maximum(end.real, end.imag) <= resolution - low)
    counts = np.bincount(scene.contour)
    assert counts[0] == counts[1] == params.contour_length
    assert np.all(counts[2:] == params.distractor_length)
    assert len(counts) - 2 <= params.num_distractors
    gaps = _segment_gaps(scene.tails, scene.heads)
    successor = np.zeros_like(gaps, bool)
    for c in range(len(counts)):
      chain = np.flatnonzero(scene.contour == c)
      for a, b in zip(chain, chain[1:]):
        successor[a, b] = successor[b, a] = True
        step = scene.tails[b] - scene.heads[a]             # 2 * margin, turned
        assert abs(abs(step) - 2 * scene.margin * np.cos(
            np.angle((scene.heads[b] - scene.tails[b])
                     / (scene.heads[a] - scene.tails[a])) / 2)) < 1e-9
        turn = np.angle((scene.heads[b] - scene.tails[b])
                        / (scene.heads[a] - scene.tails[a]))
        assert abs(turn) <= np.pi / (2 * params.continuity) + 1e-9
    np.fill_diagonal(successor, True)
    # Point-sampled clearance: at most 0.15 px short (see the module docstring).
    assert gaps[~successor].min() > clearance - 0.15


@pytest.mark.parametrize("resolution, num", [(32, 100), (128, 20)])
def test_markers_sit_on_same_contour_only_for_label_1(resolution, num):
  """Link paddles whose centre lines are closer than 2 * margin + thickness / 2 (consecutive
  paddles of a contour: at most 2 * margin; paddles of different contours: at least
  2 * margin + thickness, less 0.15 px). Label-1 markers must be linked, label-0 markers
  never: measured 100 % / 0 % on 1000 scenes at 32, 200 at 64 and 200 at 128."""
  params = pg.pathfinder_params(resolution, "hard")
  for i in range(num):
    label = i % 2
    image, scene, markers = pg.render_sample(np.random.default_rng([2, i]),
                                             resolution=resolution, label=label,
                                             return_scene=True)
    linked = _segment_gaps(scene.tails, scene.heads) < (2 * scene.margin
                                                        + params.paddle_thickness / 2)
    start, goal = (_marker_paddle(scene, z) for z in markers)
    assert scene.contour[start] < 2 and scene.contour[goal] < 2
    assert _reachable(linked, start, goal) == bool(label)


def test_markers_connected_through_ink_in_path_x_images():
  """Pixel-level: threshold, bridge the dash gaps, flood fill. Measured on 200 Path-X
  images (seeds [3, i]): label 1 connected 100 %, label 0 0 %. At 32 and 64 pixels the
  gaps inside and between contours (1.5 vs 2 px, 1 vs 2 px) are not resolved by pixels,
  so only the geometric test above applies there."""
  params = pg.pathfinder_params(128, "hard")
  connected = {0: [], 1: []}
  for i in range(24):
    label = i % 2
    image, scene, markers = pg.render_sample(np.random.default_rng([3, i]), resolution=128,
                                             label=label, return_scene=True)
    connected[label].append(_markers_linked_in_image(image, markers, params, scene.margin))
  assert np.mean(connected[1]) >= 0.9
  assert np.mean(connected[0]) <= 0.2


@pytest.mark.parametrize("resolution, num", [(32, 120), (128, 12)])
def test_two_marker_discs_are_the_two_brightest_blobs(resolution, num):
  """Measured (300 images at 32, 40 at 128, seeds [4, i]): the weaker marker's window sum
  is at least 1.55x (32) / 2.3x (128) the brightest window away from the markers."""
  params = pg.pathfinder_params(resolution, "hard")
  width = 2 * int(params.marker_radius) + 1
  for i in range(num):
    image, scene, markers = pg.render_sample(np.random.default_rng([4, i]),
                                             resolution=resolution, label=i % 2,
                                             return_scene=True)
    sums, centres = _box_sums(image, width)
    sums = sums.astype(float)
    found = []
    for _ in range(2):                           # the two peaks, suppressing around each
      k = np.unravel_index(np.argmax(sums), sums.shape)
      found.append(centres[k])
      sums[np.abs(centres - centres[k]) < 2 * params.marker_radius] = -1
    distances = np.abs(np.array(found)[:, None] - markers[None, :])     # [found, true]
    assert distances.min(axis=0).max() <= params.marker_radius           # both found
    assert abs(markers[0] - markers[1]) < 2 * params.marker_radius or (
        set(distances.argmin(axis=0)) == {0, 1})                          # distinct blobs


def test_labels_differ_only_where_the_markers_go():
  """The same contours with label 0 and label 1 differ only inside the marker discs."""
  params = pg.pathfinder_params(32, "hard")
  ys, xs = np.mgrid[:32, :32] + 0.5
  for i in range(30):
    rng_state = np.random.default_rng([5, i]).bit_generator.state
    images, markers = [], []
    for label in (0, 1):
      rng = np.random.default_rng()
      rng.bit_generator.state = rng_state
      image, scene, where = pg.render_sample(rng, label=label, return_scene=True)
      images.append(image.astype(int))
      markers.extend(where)
    near = np.min([np.hypot(xs - z.real, ys - z.imag) for z in markers], axis=0)
    changed = images[0] != images[1]
    assert changed.any() and np.all(near[changed] < params.marker_radius + 1)


def test_ink_does_not_reveal_the_label():
  """Measured on these 400 images: mean ink 25,057 (label 0) vs 25,165 (label 1), 0.4 %
  apart with a standard deviation of 7.8 %; the best single threshold on total ink is right
  for 54 %, on the bright-pixel count for 53 % (chance level for n = 400). A leak of one
  marker disc of ink (about 1 sd) would show as about 69 %."""
  params = pg.pathfinder_params(32, "hard")
  ink, bright, labels = [], [], []
  for i in range(400):
    label = pg._label(0, params, i)
    rng = pg._image_rng(0, params, i)
    scene = pg.sample_scene(rng, params)
    image = pg.render_scene(scene, params, pg.marker_positions(scene, label,
                                                               int(rng.integers(2))))
    ink.append(image.sum(dtype=np.int64))
    bright.append(np.count_nonzero(image > 128))
    labels.append(label)
  labels = np.array(labels)
  assert labels.sum() == 200
  for values in (np.array(ink), np.array(bright)):
    means = values[labels == 0].mean(), values[labels == 1].mean()
    assert abs(means[0] - means[1]) / np.mean(means) < 0.03
    best = max(max(np.mean((values >= t) == labels), np.mean((values < t) == labels))
               for t in np.unique(values))
    assert best < 0.62


def test_example_grid(tmp_path):
  path = pg.save_example_grid(tmp_path / "grid.png", resolutions=(32, 64), per_class=2)
  with Image.open(path) as grid:
    assert grid.mode == "L" and grid.size[0] == 2 * (128 + 6) + 6
