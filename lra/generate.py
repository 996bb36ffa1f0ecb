"""Generate LRA data in the official layout under a data_dir root.

    python -m lra.generate listops --out DIR [--num_train 96000 --num_val 2000 --num_test 2000]
        [--seed S] [--workers W]
    python -m lra.generate pathfinder --resolution 32|64|128|256 --difficulty easy|intermediate|hard
        --num N --out DIR [--seed S] [--workers W]

Afterwards `lra.load(task, split, data_dir=DIR)` reads what was written.
"""
from __future__ import annotations

import argparse
import sys

from lra.tasks import PATHFINDER_DIFFICULTIES, PATHFINDER_RESOLUTIONS


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m lra.generate", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  tasks = parser.add_subparsers(dest="task", required=True)

  def common(sub):
    sub.add_argument("--out", required=True, help="data_dir root to write into")
    sub.add_argument("--seed", type=int, default=0)
    sub.add_argument("--workers", type=int, default=1, help="processes to use")
    sub.add_argument("--no_progress", action="store_true", help="hide the progress bar")

  listops = tasks.add_parser("listops", help="ListOps: listops-1000/basic_{train,val,test}.tsv")
  common(listops)
  listops.add_argument("--num_train", type=int, default=96_000)
  listops.add_argument("--num_val", type=int, default=2_000)
  listops.add_argument("--num_test", type=int, default=2_000)

  pathfinder = tasks.add_parser(
      "pathfinder", help="Pathfinder: pathfinder{R}/<difficulty folder>/{imgs,metadata}")
  common(pathfinder)
  pathfinder.add_argument("--resolution", type=int, default=32, choices=PATHFINDER_RESOLUTIONS)
  pathfinder.add_argument("--difficulty", default="hard", choices=tuple(PATHFINDER_DIFFICULTIES))
  pathfinder.add_argument("--num", type=int, required=True, help="number of images")
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  try:
    written = _generate(args)
  except ValueError as e:  # bad sizes or options: a usage error, not a traceback
    parser.error(str(e))
  print(f"wrote {written}")
  return 0


def _generate(args) -> str:
  progress = not args.no_progress
  if args.task == "listops":
    from lra.listops import generate_listops

    return generate_listops(args.out, num_train=args.num_train, num_val=args.num_val,
                            num_test=args.num_test, seed=args.seed, workers=args.workers,
                            progress=progress)
  from lra.pathfinder_generator import generate_pathfinder

  return generate_pathfinder(args.out, resolution=args.resolution, difficulty=args.difficulty,
                             num=args.num, seed=args.seed, workers=args.workers,
                             progress=progress)


if __name__ == "__main__":
  sys.exit(main())
