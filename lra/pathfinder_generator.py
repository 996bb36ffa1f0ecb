"""Pathfinder / Path-X image generator, a re-implementation of Linsley et al. 2018.

"Learning long-range spatial dependencies with horizontal gated recurrent units" (NeurIPS
2018) built Pathfinder: dark images holding dashed curvy contours and two bright circular
markers; label 1 when the markers sit on the two ends of the same contour, label 0 when they
sit on ends of two different contours. The Long Range Arena uses the 32x32 "hard" set as
Pathfinder and the 128x128 one as Path-X. `generate_pathfinder` writes the files of the
released archive:

    pathfinder{res}/{curv_baseline|curv_contour_length_9|curv_contour_length_14}/
        imgs/<k>/sample_<n>.png     8-bit grayscale, res x res
        metadata/<k>.npy            TEXT despite the name, one line per image:
            imgs/<k> sample_<n>.png <n> <label> <continuity> <contour_length>
            <distractor_length> <paddle_length> <paddle_thickness> <paddle_margin> 1

How an image is made (the original algorithm, in continuous coordinates):
  * A contour is a chain of paddles: segments of `paddle_length` and width
    `paddle_thickness`. After a paddle that ends at `head` going in direction `u`, the next
    one turns about the pivot `q = head + margin * u`: it runs from `q + margin * u'` to
    `q + (margin + paddle_length) * u'`, so paddles of a contour are `2 * margin` apart. The
    turn delta from `u` to `u'` is drawn with weight cos(min(continuity * |delta|, pi/2))^2:
    at most pi / (2 * continuity), mostly straight.
  * A paddle keeps its centre line `2 * margin + paddle_thickness` away from every paddle
    but its predecessor (the original's rule: paddles dilated by `margin` may not overlap),
    and `padding + margin` away from the image edge. So ink of different contours is at
    least `2 * margin` apart, more than the gaps inside a contour. Turns that break the rule
    are never drawn.
  * Two target contours of `contour_length` paddles grow in lock-step from seed paddles
    whose tails are `seed_distance` apart in the central square [2 * seed_distance,
    res - 2 * seed_distance]^2. Then `distractor_budget // distractor_length` distractor
    contours of `distractor_length = contour_length // 3` paddles are seeded in free space,
    each tried at most 5 times and otherwise left out (as in the original).
  * Markers (discs of `marker_radius`) go on the tail of one target contour and on the head
    of the same contour (label 1) or of the other one (label 0). Both classes draw the same
    kind of scene (the label is used only after the contours are drawn) and differ only in
    where the second marker goes, so ink statistics cannot tell them apart.
  * Rendering: exact coverage of round-capped paddles and discs on an `antialias` x finer
    grid, box-averaged down. Target paddles have intensity `snake_contrast *
    paddle_contrast`, distractors `snake_contrast` (as the original code does), markers 1;
    intensities saturate at 1 and map to 0..255.

Parameters per resolution are those the LRA TFDS builders document for the released data; a
value they leave unset takes the original script's default (`paddle_length` 5 except 2 at
32, `padding` 22 and `seed_distance` 27 at 256). Deliberate differences from the original
code: continuous coordinates instead of integer pixels; clearance measured on points sampled
along the paddles (at most clearance / 2 apart, so two paddles may come closer than the
clearance by at most (spacing / 2)^2 / (2 * clearance): 0.05 px at 32, 0.14 px at 128)
instead of blurred pixel masks; the last paddle of the first target contour also counts (the
original forgot it); a box filter instead of Lanczos. And where the original restarts both
target contours whenever one reaches a dead end (no allowed turn), this one first backs the
stuck contour out of it (drops its last d paddles at its d-th dead end and grows on), so
that 14-paddle contours at 64 and 128 px, which fit in under 1 % of fresh starts, cost
milliseconds. This barely changes where contours run: the share of target paddles within
res / 8 of the border is 0.340 against 0.357 with plain restarts at 32, 0.482 against 0.486
at 128.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import math
import multiprocessing
import os
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np
import tqdm
from PIL import Image

from lra.fileio import ignore_interrupts, made_folder, write_manifest
from lra.tasks import PATHFINDER_DIFFICULTIES, PATHFINDER_RESOLUTIONS, pathfinder_dir

__all__ = [
    "PathfinderParams",
    "Scene",
    "pathfinder_params",
    "sample_scene",
    "marker_positions",
    "render_scene",
    "render_sample",
    "generate_pathfinder",
    "save_example_grid",
]

# Per resolution in lra.tasks.PATHFINDER_RESOLUTIONS: the LRA TFDS builders' docstrings
# (Pathfinder32/64/128/256), plus script defaults.
_RESOLUTION_PARAMS = {
    32: dict(paddle_length=2.0, paddle_thickness=0.5, paddle_margins=(1.0,), seed_distance=7.0,
             continuity=1.0, marker_radius=1.5, padding=1.0, snake_contrast=2.0,
             paddle_contrast=0.75, distractor_budget=20),
    64: dict(paddle_length=5.0, paddle_thickness=1.0, paddle_margins=(1.0,), seed_distance=12.0,
             continuity=1.8, marker_radius=2.5, padding=1.0, snake_contrast=0.8,
             paddle_contrast=1.0, distractor_budget=22),
    128: dict(paddle_length=5.0, paddle_thickness=1.5, paddle_margins=(2.0, 3.0),
              seed_distance=20.0, continuity=1.8, marker_radius=3.0, padding=1.0,
              snake_contrast=0.9, paddle_contrast=1.0, distractor_budget=35),
    256: dict(paddle_length=5.0, paddle_thickness=2.0, paddle_margins=(3.0,), seed_distance=27.0,
              continuity=1.8, marker_radius=5.0, padding=22.0, snake_contrast=1.0,
              paddle_contrast=1.0, distractor_budget=30),
}
RULES_VERSION = 1  # bump whenever the generation rules change what is written

_TURN_STEP = math.radians(5.0)       # spacing of candidate turns (plus a per-step sub-shift)
_TURN_SHIFTS = 8                     # sub-shifts of the turn grid, so turns are not on a grid
_SEED_CANDIDATES = 64                # random spots tried per distractor seed attempt
_DISTRACTOR_ATTEMPTS = 5             # original: max_distractor_contour_retrial 4, i.e. 5 tries
_TARGET_DEAD_ENDS = 28               # dead ends the target pair may back out of per start
_TARGET_STARTS = 1000                # fresh starts before giving up (never needed in practice)
_FAR = complex(1e9, 1e9)             # where an empty paddle slot lies: never near anything
_DIFFICULTY_IDS = {name: i for i, name in enumerate(PATHFINDER_DIFFICULTIES)}


@dataclasses.dataclass(frozen=True)
class PathfinderParams:
  """Generator parameters for one (resolution, difficulty); lengths in output pixels."""

  resolution: int
  difficulty: str
  contour_length: int
  paddle_length: float
  paddle_thickness: float
  paddle_margins: tuple          # one is drawn per image
  seed_distance: float
  continuity: float
  marker_radius: float
  padding: float
  snake_contrast: float
  paddle_contrast: float
  distractor_budget: int
  antialias: int = 2

  @property
  def difficulty_dir(self) -> str:
    return PATHFINDER_DIFFICULTIES[self.difficulty].folder

  @property
  def distractor_length(self) -> int:
    return self.contour_length // 3

  @property
  def num_distractors(self) -> int:
    return self.distractor_budget // self.distractor_length


def _check_choice(name, value, valid):
  if value not in valid:
    raise ValueError(f"unknown {name} {value!r}; valid values are "
                     f"{', '.join(map(repr, valid))}")


def _check_int(name, value, minimum):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@functools.lru_cache(maxsize=None)
def pathfinder_params(resolution: int = 32, difficulty: str = "hard") -> PathfinderParams:
  """The parameters for `resolution` in lra.tasks.PATHFINDER_RESOLUTIONS and `difficulty` in
  lra.tasks.PATHFINDER_DIFFICULTIES."""
  _check_choice("resolution", resolution, PATHFINDER_RESOLUTIONS)
  _check_choice("difficulty", difficulty, tuple(PATHFINDER_DIFFICULTIES))
  return PathfinderParams(resolution=resolution, difficulty=difficulty,
                          contour_length=PATHFINDER_DIFFICULTIES[difficulty].contour_length,
                          **_RESOLUTION_PARAMS[resolution])


# --------------------------------------------------------------------------- contours
# Points are complex numbers x + 1j * y (x = column, y = row; pixel i spans [i, i + 1)).

@dataclasses.dataclass
class Scene:
  """The paddles of one image, before the markers are placed.

  tails, heads: complex [P], paddle centre lines; contour: int [P], 0 and 1 for the target
  contours, 2, 3, ... for distractors; origins, terminals: complex [2], the free tail and the
  free head of target contours 0 and 1; margin: this image's paddle margin.
  """

  tails: np.ndarray
  heads: np.ndarray
  contour: np.ndarray
  origins: np.ndarray
  terminals: np.ndarray
  margin: float


@functools.lru_cache(maxsize=None)
def _turn_tables(continuity, reach_offsets):
  """Candidate turns: cells of about _TURN_STEP over the allowed range, moved by one of
  _TURN_SHIFTS sub-steps. Returns (weights [S, K], offsets [S, K, samples]) where offsets
  are the sampled paddle points relative to the pivot for heading 1 (+x)."""
  max_turn = math.pi / (2 * continuity)
  cells = 2 * math.ceil(max_turn / _TURN_STEP)
  cell = 2 * max_turn / cells
  shifts = cell * ((np.arange(_TURN_SHIFTS) + 0.5) / _TURN_SHIFTS - 0.5)
  turns = -max_turn + cell * (np.arange(cells) + 0.5) + shifts[:, None]        # [S, K]
  offsets = np.exp(1j * turns)[:, :, None] * np.array(reach_offsets)            # [S, K, n]
  return np.cos(continuity * turns) ** 2, offsets


class _ContourGrower:
  """Places paddles one by one, each kept clear of all paddles already placed.

  A paddle is stored as `samples` points along its centre line (tail first, head last),
  at most clearance / 2 apart; clearance is checked between those points.
  """

  def __init__(self, params: PathfinderParams, margin: float, rng: np.random.Generator):
    self.p, self.margin, self.rng = params, margin, rng
    self.clearance = 2 * margin + params.paddle_thickness
    samples = math.ceil(params.paddle_length / (self.clearance / 2)) + 1
    self.along = np.linspace(0.0, params.paddle_length, samples)
    capacity = 2 * params.contour_length + params.num_distractors * params.distractor_length
    self.points = np.full((capacity, samples), _FAR)                  # [paddles, samples]
    self.flat = self.points.reshape(-1)
    self.contour = np.zeros(capacity, np.int64)
    self.n = 0                                                        # slots in use
    # Paddle centre lines stay in the square [low, high]^2.
    low = params.padding + margin + params.paddle_thickness / 2
    self.low, self.high = low, params.resolution - low
    self.centre, self.half_side = params.resolution / 2, params.resolution / 2 - low
    self.reach = margin + params.paddle_length                        # pivot to head
    self.near = self.reach + self.clearance
    self.turn_weights, self.turn_offsets = _turn_tables(params.continuity,
                                                        tuple(margin + self.along))

  def _inside(self, z):
    return (np.maximum(np.abs(z.real - self.centre), np.abs(z.imag - self.centre))
            <= self.half_side)

  def _too_close(self, candidates, points):
    """bool [K]: candidate paddles (complex [K, samples]) within clearance of points [M]."""
    gaps = np.abs(candidates.reshape(-1, 1) - points)                 # [K * samples, M]
    return (gaps < self.clearance).reshape(len(candidates), -1).any(axis=1)

  def _put(self, slot, points, contour):
    """Stores a paddle; returns the state (pivot, heading, slot) to continue after it."""
    self.points[slot] = points
    self.contour[slot] = contour
    tail, head = points[0], points[-1]
    heading = (head - tail) / self.p.paddle_length
    return head + self.margin * heading, heading, slot

  def _extend(self, state):
    """The next paddle after `state` (complex [samples]), or None at a dead end."""
    (pivot, heading, previous), rng = state, self.rng
    shift = int(rng.random() * _TURN_SHIFTS)
    candidates = pivot + heading * self.turn_offsets[shift]         # [K, samples]
    weights = self.turn_weights[shift]
    if (max(abs(pivot.real - self.centre), abs(pivot.imag - self.centre)) + self.reach
            > self.half_side):
      weights = weights * self._inside(candidates[:, ::len(self.along) - 1]).all(axis=1)
    placed = self.flat[:self.n * len(self.along)]
    nearby = np.abs(placed - pivot) < self.near
    nearby[previous * len(self.along):(previous + 1) * len(self.along)] = False
    if nearby.any():
      weights = weights * ~self._too_close(candidates, placed[nearby])
    cumulative = np.cumsum(weights)
    if cumulative[-1] <= 0:
      return None
    k = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return candidates[min(k, len(cumulative) - 1)]

  def _paddles(self, tails, directions):
    return tails[:, None] + directions[:, None] * self.along          # [N, samples]

  def place_targets(self):
    """Grows the two target contours; returns their (origins, terminals), complex [2].

    Paddle k of target contour c lives in slot 2 * k + c. At its d-th dead end a contour
    drops its last d paddles (never its seed) and grows on; after _TARGET_DEAD_ENDS dead
    ends of the pair, or when the seeds do not fit, it starts over.
    """
    p, rng, length = self.p, self.rng, self.p.contour_length
    low, high = 2 * p.seed_distance, p.resolution - 2 * p.seed_distance
    self.n = 2 * length
    for _ in range(_TARGET_STARTS):
      self.points[:2 * length] = _FAR
      u = rng.random(5)
      tail0 = complex(low + (high - low) * u[0], low + (high - low) * u[1])
      tails = np.array([tail0, tail0 + p.seed_distance * np.exp(2j * np.pi * u[2])])
      seeds = self._paddles(tails, np.exp(2j * np.pi * u[3:]))
      if (not self._inside(seeds[:, ::len(self.along) - 1]).all()
              or self._too_close(seeds[1:], seeds[0])[0]):
        continue
      grown = [[self._put(c, seeds[c], c)] for c in (0, 1)]    # states, paddle by paddle
      dead_ends, budget = [0, 0], _TARGET_DEAD_ENDS
      while budget > 0 and len(grown[0]) + len(grown[1]) < 2 * length:
        for c, states in enumerate(grown):
          if len(states) == length:
            continue
          paddle = self._extend(states[-1])
          if paddle is not None:
            states.append(self._put(2 * len(states) + c, paddle, c))
            continue
          dead_ends[c] += 1
          budget -= 1
          for _ in range(min(dead_ends[c], len(states) - 1)):
            self.points[states.pop()[2]] = _FAR
      if budget > 0:
        return tails, self.points[[2 * length - 2, 2 * length - 1], -1]
    raise RuntimeError(f"could not place the two target contours in {_TARGET_STARTS} "
                       f"starts for {p}")

  def place_distractor(self, contour):
    """Tries to add one distractor contour; returns whether it was placed."""
    p, rng, start = self.p, self.rng, self.n
    for _ in range(_DISTRACTOR_ATTEMPTS):
      u = rng.random((3, _SEED_CANDIDATES))
      tails = self.low * (1 + 1j) + (self.high - self.low) * (u[0] + 1j * u[1])
      seeds = self._paddles(tails, np.exp(2j * np.pi * u[2]))
      free = (self._inside(seeds[:, -1])
              & ~self._too_close(seeds, self.flat[:start * len(self.along)]))
      if not free.any():
        continue
      self.n = start + 1
      state = self._put(start, seeds[int(np.argmax(free))], contour)
      for _ in range(p.distractor_length - 1):
        paddle = self._extend(state)
        if paddle is None:
          break
        self.n += 1
        state = self._put(self.n - 1, paddle, contour)
      else:
        return True
      self.points[start:self.n] = _FAR
      self.n = start
    return False


def sample_scene(rng: np.random.Generator, params: PathfinderParams) -> Scene:
  """Samples the contours of one image (the same distribution for both labels)."""
  margin = float(params.paddle_margins[int(rng.integers(len(params.paddle_margins)))])
  grower = _ContourGrower(params, margin, rng)
  origins, terminals = grower.place_targets()
  contour = 2
  for _ in range(params.num_distractors):
    contour += grower.place_distractor(contour)
  points = grower.points[:grower.n]
  return Scene(tails=points[:, 0].copy(), heads=points[:, -1].copy(),
               contour=grower.contour[:grower.n].copy(), origins=origins,
               terminals=terminals, margin=margin)


def marker_positions(scene: Scene, label: int, origin: int) -> np.ndarray:
  """complex [2]: the tail of target contour `origin` (0 or 1), and the head of the same
  contour (label 1) or of the other target contour (label 0)."""
  terminal = origin if label == 1 else 1 - origin
  return np.array([scene.origins[origin], scene.terminals[terminal]])


# --------------------------------------------------------------------------- rendering

def _distance_to_segment(points, tails, heads):
  """Distance from points to segments [tails, heads] (complex, broadcast; tails != heads)."""
  direction = heads - tails
  t = ((points - tails) * direction.conjugate()).real / np.abs(direction) ** 2
  return np.abs(points - tails - np.clip(t, 0.0, 1.0) * direction)


def _stamp(canvas, centres, half, aa, offset, coverage):
  """Max-combines coverage(sub-pixel centres, complex [P, S, S]) -> [P, S, S] into the
  supersampled canvas, on the S x S sub-pixels (S = 2 * half + 1) around each centre."""
  cx = np.floor(centres.real * aa).astype(np.int64)
  cy = np.floor(centres.imag * aa).astype(np.int64)
  steps = np.arange(-half, half + 1)
  xs = (cx[:, None] + steps + 0.5) / aa                                     # [P, S]
  ys = (cy[:, None] + steps + 0.5) / aa                                     # [P, S]
  values = coverage(xs[:, None, :] + 1j * ys[:, :, None])                   # [P, S(y), S(x)]
  size = 2 * half + 1
  for value, x0, y0 in zip(values, cx - half + offset, cy - half + offset):
    window = canvas[y0:y0 + size, x0:x0 + size]
    np.maximum(window, value, out=window)


def render_scene(scene: Scene, params: PathfinderParams, markers) -> np.ndarray:
  """uint8 [res, res]: the scene's paddles plus marker discs centred at `markers`."""
  aa, res = params.antialias, params.resolution
  half_width = params.paddle_thickness / 2
  paddle_half = math.ceil((params.paddle_length / 2 + half_width) * aa) + 2
  marker_half = math.ceil(params.marker_radius * aa) + 2
  offset = max(paddle_half, marker_half) + 1
  canvas = np.zeros((res * aa + 2 * offset,) * 2)

  contrast = np.where(scene.contour < 2, params.snake_contrast * params.paddle_contrast,
                      params.snake_contrast)[:, None, None]
  tails, heads = scene.tails[:, None, None], scene.heads[:, None, None]
  centres = np.asarray(markers)[:, None, None]

  def paddle_coverage(points):          # share of each sub-pixel inside the paddle
    distance = _distance_to_segment(points, tails, heads)
    return contrast * np.clip((half_width - distance) * aa + 0.5, 0.0, 1.0)

  def marker_coverage(points):
    return np.clip((params.marker_radius - np.abs(points - centres)) * aa + 0.5, 0.0, 1.0)

  _stamp(canvas, (scene.tails + scene.heads) / 2, paddle_half, aa, offset, paddle_coverage)
  _stamp(canvas, np.asarray(markers), marker_half, aa, offset, marker_coverage)
  fine = canvas[offset:offset + res * aa, offset:offset + res * aa]
  image = fine.reshape(res, aa, res, aa).mean(axis=(1, 3))
  return np.rint(np.minimum(image, 1.0) * 255).astype(np.uint8)


def render_sample(rng: np.random.Generator, *, resolution: int = 32, difficulty: str = "hard",
                  label: int, return_scene: bool = False):
  """One Pathfinder image with the given label (0 or 1): uint8 [resolution, resolution].

  The contours are drawn from `rng` before the label is used, so the same generator state
  gives the same contours for both labels. With `return_scene`, returns
  (image, scene, markers), markers being complex [2] (x + 1j * y, in pixels).
  """
  if label not in (0, 1):
    raise ValueError(f"label must be 0 or 1, got {label!r}")
  params = pathfinder_params(resolution, difficulty)
  scene = sample_scene(rng, params)
  markers = marker_positions(scene, label, int(rng.integers(2)))
  image = render_scene(scene, params, markers)
  return (image, scene, markers) if return_scene else image


# --------------------------------------------------------------------------- dataset writer

def _image_rng(seed, params, index):
  return np.random.default_rng([seed, params.resolution, _DIFFICULTY_IDS[params.difficulty],
                               index])


def _label(seed, params, index):
  """Images 2j and 2j + 1 get labels 0 and 1 in a seeded order: exactly balanced over any
  even prefix, and an image never depends on how many are generated."""
  flip = np.random.default_rng([seed, params.resolution, _DIFFICULTY_IDS[params.difficulty],
                                index // 2, 1]).integers(2)
  return int((index % 2) ^ flip)


def _write_png(path, image):
  Image.fromarray(image, mode="L").save(path)


def _generate_chunk(task):
  """Worker: writes images [start, stop) under root; returns their metadata rows."""
  root, resolution, difficulty, seed, start, stop, per_batch = task
  params = pathfinder_params(resolution, difficulty)
  rows = []
  for index in range(start, stop):
    label = _label(seed, params, index)
    rng = _image_rng(seed, params, index)
    scene = sample_scene(rng, params)
    markers = marker_positions(scene, label, int(rng.integers(2)))
    batch, n = divmod(index, per_batch)
    _write_png(os.path.join(root, "imgs", str(batch), f"sample_{n}.png"),
               render_scene(scene, params, markers))
    rows.append((batch, n, label, scene.margin))
  return rows


def _metadata_line(params, n, label, margin, batch):
  return (f"imgs/{batch} sample_{n}.png {n} {label} {params.continuity:g} "
          f"{params.contour_length} {params.distractor_length} {params.paddle_length:g} "
          f"{params.paddle_thickness:g} {margin:g} 1")


def _staging_glob(target: Path) -> str:
  return f".{target.name}.partial-{socket.gethostname()}-"


def _remove_stale_staging(target: Path):
  """Deletes staging directories of earlier runs on this host whose process was killed."""
  for path in target.parent.glob(_staging_glob(target) + "*"):
    pid = path.name.rsplit("-", 2)[-2]
    if not pid.isdigit():
      continue
    try:
      os.kill(int(pid), 0)
    except ProcessLookupError:
      shutil.rmtree(path, ignore_errors=True)
    except PermissionError:            # alive, another user's
      pass


def generate_pathfinder(out_dir, *, resolution: int = 32, difficulty: str = "hard", num: int,
                        seed: int = 0, workers: int = 1, progress: bool = True,
                        images_per_batch: int = 1000, overwrite: bool = False) -> str:
  """Generates `num` Pathfinder images in the official layout; returns the dataset directory
  `out_dir/pathfinder{resolution}/{curv_baseline|curv_contour_length_9|curv_contour_length_14}`.

  Images are grouped `images_per_batch` to a folder `imgs/<k>`, listed in
  `metadata/<k>.npy` (text). Each image depends only on (seed, resolution, difficulty) and
  its index, so the output does not depend on `workers`; labels are exactly balanced for
  even `num`. Everything is written into a hidden staging directory next to the target and
  renamed into place at the end: an interrupted run leaves no partial dataset (staging left
  by a killed process is deleted by the next run on the same host). A non-empty target is
  refused unless `overwrite`, which replaces it once the new data is complete. `workers` > 1
  runs that many processes, started with spawn (not fork: the caller may run JAX threads).
  The directory also gets `generated.json`, the manifest of the run (generator, version of its
  rules, seed, sizes, parameters, date), renamed into place with the images.
  """
  params = pathfinder_params(resolution, difficulty)
  _check_int("num", num, 1)
  _check_int("seed", seed, 0)
  _check_int("workers", workers, 1)
  _check_int("images_per_batch", images_per_batch, 1)
  target = pathfinder_dir(out_dir, resolution, difficulty)
  if target.exists() and not target.is_dir():
    raise ValueError(f"{target} exists and is not a directory")
  if target.is_dir() and any(target.iterdir()) and not overwrite:
    raise ValueError(f"{target} already exists and is not empty; delete it or pass "
                     f"overwrite=True to replace it")
  with made_folder(target.parent):   # removed again if the run fails
    _remove_stale_staging(target)
    staging = Path(tempfile.mkdtemp(prefix=f"{_staging_glob(target)}{os.getpid()}-",
                                    dir=target.parent))
    try:
      num_batches = -(-num // images_per_batch)
      for batch in range(num_batches):
        (staging / "imgs" / str(batch)).mkdir(parents=True)
      (staging / "metadata").mkdir()
      chunk = max(1, min(100, -(-num // (4 * workers))))
      tasks = []
      for batch in range(num_batches):         # a chunk never straddles two batches
        batch_stop = min((batch + 1) * images_per_batch, num)
        for start in range(batch * images_per_batch, batch_stop, chunk):
          tasks.append((str(staging), resolution, difficulty, seed, start,
                        min(start + chunk, batch_stop), images_per_batch))
      rows = []
      with tqdm.tqdm(total=num, disable=not progress, unit="img",
                     desc=f"pathfinder{resolution}/{params.difficulty_dir}") as bar:
        if workers == 1:
          for task in tasks:
            rows += _generate_chunk(task)
            bar.update(task[5] - task[4])
        else:
          # A worker that dies (say, the caller's script lacks a __main__ guard, which
          # spawn needs) raises BrokenProcessPool here instead of hanging.
          with concurrent.futures.ProcessPoolExecutor(
                  workers, mp_context=multiprocessing.get_context("spawn"),
                  initializer=ignore_interrupts) as pool:
            futures = [pool.submit(_generate_chunk, task) for task in tasks]
            try:
              for future in concurrent.futures.as_completed(futures):
                rows += future.result()
                bar.update(len(future.result()))
            except BaseException:
              for future in futures:
                future.cancel()
              raise
      rows.sort()
      for batch, batch_rows in itertools.groupby(rows, key=lambda row: row[0]):
        lines = [_metadata_line(params, n, label, margin, batch)
                 for _, n, label, margin in batch_rows]
        (staging / "metadata" / f"{batch}.npy").write_text("\n".join(lines) + "\n")
      write_manifest(staging, generator="lra.generate_pathfinder", rules_version=RULES_VERSION,
                     seed=seed, sizes={"num": num, "images_per_batch": images_per_batch},
                     parameters=dataclasses.asdict(params))
      if target.is_dir() and any(target.iterdir()):           # overwrite=True
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        target.rename(old / target.name)
        staging.rename(target)
        shutil.rmtree(old)
      else:
        if target.is_dir():
          target.rmdir()
        staging.rename(target)
    except BaseException:
      shutil.rmtree(staging, ignore_errors=True)
      raise
  return str(target)


# --------------------------------------------------------------------------- example figure

def save_example_grid(png_path, *, resolutions=(32, 128), per_class: int = 4, seed: int = 0,
                      difficulty: str = "hard", tile: int = 128) -> str:
  """Draws `per_class` generated images of each label at each resolution into one labelled
  grayscale PNG (each image resized to `tile` pixels); returns the path."""
  from PIL import ImageDraw, ImageFont

  _check_int("per_class", per_class, 1)
  font = ImageFont.load_default(size=13)
  caption, gap = 20, 6
  rows = [(res, label) for res in resolutions for label in (1, 0)]
  sheet = Image.new("L", (per_class * (tile + gap) + gap,
                          len(rows) * (caption + tile + gap) + gap), 96)
  draw = ImageDraw.Draw(sheet)
  for r, (res, label) in enumerate(rows):
    rng = np.random.default_rng([seed, res, label])
    y = gap + r * (caption + tile + gap)
    what = "the same contour" if label else "two different contours"
    draw.text((gap, y + 2), f"{res}x{res} {difficulty}, label {label}: markers on {what}",
              fill=255, font=font)
    for c in range(per_class):
      image = render_sample(rng, resolution=res, difficulty=difficulty, label=label)
      resample = Image.NEAREST if res <= tile else Image.LANCZOS
      sheet.paste(Image.fromarray(image, mode="L").resize((tile, tile), resample),
                  (gap + c * (tile + gap), y + caption))
  Path(png_path).parent.mkdir(parents=True, exist_ok=True)
  sheet.save(png_path, optimize=True)
  return str(png_path)
