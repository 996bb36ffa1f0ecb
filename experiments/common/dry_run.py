"""`--dry_run`, on every command `command_line.run` starts: the command is checked as the real
run checks it (flags, configs resolved, plug-ins loaded), then `plan` prints one line per run it
would start and the command exits 0 before it trains, measures, writes or downloads anything."""
from __future__ import annotations

from absl import flags

HELP = ("Check the command and print what it would run, one line per run, then exit without "
        "training, writing or downloading anything.")


class Planned(Exception):
  """Raised by `plan` under --dry_run: the command ends there, successfully."""


def requested() -> bool:
  """Whether the command runs under --dry_run."""
  return "dry_run" in flags.FLAGS and flags.FLAGS.dry_run


def plan(make_lines) -> None:
  """Under --dry_run: prints the lines `make_lines()` returns (what would run; the checks it
  makes are the real run's) and ends the command with status 0; otherwise does nothing."""
  if not requested():
    return
  for line in make_lines():
    print(line)
  raise Planned


def count(number: int, noun: str) -> str:
  """"1 layer", "2 layers": a plan line's sizes."""
  return f"{number:,} {noun}{'' if number == 1 else 's'}"


def options_text(attention: str, options: dict) -> str:
  """A plan line's attention options: "options k=v, ...", or that the variant's defaults apply
  (its options the config does not set take their defaults in any case)."""
  if not options:
    return f"{attention}'s default options"
  return "options " + ", ".join(f"{k}={v}" for k, v in sorted(options.items()))
