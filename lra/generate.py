"""Generate LRA data in the official layout under a data_dir root.

    python -m lra.generate listops --out DIR [--num_train=96000 --num_val=2000 --num_test=2000]
    python -m lra.generate pathfinder --resolution=32|64|128|256 \
        --difficulty=easy|intermediate|hard --num=N --out=DIR
    (both: [--seed=S] [--workers=W] [--noprogress] [--dry_run])

Afterwards `lra.load(task, split, data_dir=DIR)` reads what was written. Like the harness's
entry points, an absl app: a bad option prints one line `error: ...` and exits with status 1;
`--dry_run` checks the options and prints what would be written, writing nothing.
"""
from __future__ import annotations

import os
import sys

from absl import app, flags

from lra.tasks import PATHFINDER_DIFFICULTIES, PATHFINDER_RESOLUTIONS, pathfinder_dir

FLAGS = flags.FLAGS
TASKS = ("listops", "pathfinder")


def plan(task: str) -> str:
  """What `generate(task)` would write, in one line (a dry run's)."""
  if task == "listops":
    from lra.listops import DIR_NAME

    return (f"listops: {FLAGS.num_train} / {FLAGS.num_val} / {FLAGS.num_test} expressions, seed "
            f"{FLAGS.seed} -> {os.path.join(FLAGS.out, DIR_NAME)}")
  _check_num()
  return (f"pathfinder: {FLAGS.num} images, {FLAGS.resolution}px, {FLAGS.difficulty}, seed "
          f"{FLAGS.seed} -> {pathfinder_dir(FLAGS.out, int(FLAGS.resolution), FLAGS.difficulty)}")


def _check_num() -> None:
  if FLAGS.num is None:
    raise ValueError("pathfinder needs --num, the number of images (LRA: 200000)")


def generate(task: str) -> str:
  """Writes the data of `task` with the flags' settings; returns the folder written."""
  if task == "listops":
    from lra.listops import generate_listops

    return generate_listops(FLAGS.out, num_train=FLAGS.num_train, num_val=FLAGS.num_val,
                            num_test=FLAGS.num_test, seed=FLAGS.seed, workers=FLAGS.workers,
                            progress=FLAGS.progress)
  from lra.pathfinder_generator import generate_pathfinder

  _check_num()
  return generate_pathfinder(FLAGS.out, resolution=int(FLAGS.resolution),
                             difficulty=FLAGS.difficulty, num=FLAGS.num, seed=FLAGS.seed,
                             workers=FLAGS.workers, progress=FLAGS.progress)


def main(argv):
  if len(argv) != 2 or argv[1] not in TASKS:
    return _fail(f"expected one task, {' or '.join(TASKS)}: python -m lra.generate TASK "
                 f"--out=DIR ...; got {' '.join(argv[1:]) or 'none'}")
  try:
    print(plan(argv[1]) if FLAGS.dry_run else f"wrote {generate(argv[1])}")
  except ValueError as e:  # bad sizes or options: a usage error, not a traceback
    return _fail(str(e))
  except KeyboardInterrupt:
    print("interrupted: nothing was written (a generator renames its files into place only "
          "when all are complete)", file=sys.stderr)
    return 130
  return 0


def _fail(message: str) -> int:
  print(f"error: {' '.join(message.split())}", file=sys.stderr)
  return 1


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "data_dir root to write into.", required=True)
  flags.DEFINE_integer("seed", 0, "Random seed: the same seed writes the same files.")
  flags.DEFINE_integer("workers", os.cpu_count() or 1, "Processes to use.")
  flags.DEFINE_boolean("progress", True, "Show a progress bar.")
  flags.DEFINE_integer("num_train", 96_000, "listops: training expressions.")
  flags.DEFINE_integer("num_val", 2_000, "listops: validation expressions.")
  flags.DEFINE_integer("num_test", 2_000, "listops: test expressions.")
  flags.DEFINE_enum("resolution", "32", [str(r) for r in PATHFINDER_RESOLUTIONS],
                    "pathfinder: image side in pixels.")
  flags.DEFINE_enum("difficulty", "hard", list(PATHFINDER_DIFFICULTIES),
                    "pathfinder: contour length (LRA: hard).")
  flags.DEFINE_integer("num", None, "pathfinder: number of images (LRA: 200000).")
  flags.DEFINE_bool("dry_run", False, "Check the options and print what would be written, "
                    "then exit without writing anything.")
  app.run(main)
