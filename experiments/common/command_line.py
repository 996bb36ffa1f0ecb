"""How every command starts: `run(main)` parses the flags and checks the config before anything
imports JAX, so that a mistake is one line `error: ...` (experiments/common/errors.py); it adds
`--dry_run` (experiments/common/dry_run.py), sets XLA's flags and loads the `--plugins`.
"""
from __future__ import annotations

import importlib.util
import logging
import shlex
import sys
from pathlib import Path

from absl import app, flags
from absl import logging as absl_logging

import attention_zoo as az
import lra
from experiments.common import dry_run, xla_flags
from experiments.common.errors import HarnessError, Interrupted, did_you_mean, fail, first_line
from experiments.common.overrides import OPTIONS_FIELD, check_not_fixed, set_field, unknown_field
from experiments.common.task_configs import TASK_CONFIGS
from experiments.common.variant_names import check_attention


class _OwnInfoOnly(logging.Filter):
  """Info lines from this project only; libraries (orbax, jax) speak at warning level."""

  OWN = tuple(f"/{package}/" for package in ("experiments", "lra", "attention_zoo", "configs"))

  def filter(self, record):
    return record.levelno >= logging.WARNING or any(p in record.pathname for p in self.OWN)


def run(main) -> None:
  """`absl.app.run(main)` with one-line errors. The flags and the config are checked before
  anything imports JAX (a mistake is reported at once); then XLA's flags are set and the
  `--plugins` modules imported (the one place plug-ins are loaded: `main` finds their variants
  registered), and the attention the config names is checked again against the variants they
  register. Ctrl-C ends the command with one line (status 130), naming, for a training run,
  where it stopped and the command that resumes it."""
  absl_logging.get_absl_handler().addFilter(_OwnInfoOnly())
  if "dry_run" not in flags.FLAGS:
    flags.DEFINE_bool("dry_run", False, dry_run.HELP)
  resume = resume_command(sys.argv)   # before the flags' parsing edits sys.argv

  def wrapped(argv):
    try:
      return main(argv)
    except HarnessError as e:
      fail(str(e))
    except dry_run.Planned:
      return 0
    except Interrupted as e:
      print(f"{e}; to resume: {resume}", file=sys.stderr)
      sys.exit(130)
    except KeyboardInterrupt:
      print("interrupted", file=sys.stderr)
      sys.exit(130)

  app.run(wrapped, flags_parser=_parse_flags)


def resume_command(argv: list[str]) -> str:
  """The command line `argv` as `python -m <module> ...`, less --restart: run again, a training
  command resumes where it stopped (and skips what has finished)."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  module = spec and spec.name.removesuffix(".__main__")   # a package's command: the package
  program = ["python", "-m", module] if module else ["python", argv[0]]
  return shlex.join(program + [arg for arg in argv[1:]
                               if arg.lstrip("-").partition("=")[0] != "restart"])


def _parse_flags(argv: list[str]) -> list[str]:
  option_flags = [item for item in argv if item.startswith(f"--config.{OPTIONS_FIELD}.")]
  argv = [item for item in argv if item not in option_flags]
  sys.argv[:] = [item for item in sys.argv if item not in option_flags]   # config_flags reads it
  try:
    for item in argv:
      if item.startswith("--config."):
        check_not_fixed(item[len("--config."):].split("=", 1)[0])
    try:
      rest = flags.FLAGS(argv)
      if "config" in flags.FLAGS:
        dict(flags.FLAGS.config)  # a config file that failed to load raises here
    except Exception as e:  # noqa: BLE001 - turned into one line below
      raise HarnessError(_explain_config_error(argv) or _explain_choice_error(argv)
                         or first_line(e)) from None
    config = flags.FLAGS.config if "config" in flags.FLAGS else None
    for item in option_flags:
      field, sep, value = item[len("--config."):].partition("=")
      if not sep:
        raise HarnessError(f"{item}: write --config.{field}=VALUE")
      set_field(config, field, value)
    plugins = flags.FLAGS.plugins if "plugins" in flags.FLAGS else []
    if config is not None and not plugins:
      check_attention(config.model.attention)
    if not dry_run.requested():   # its probe starts JAX in a child; a dry run executes nothing
      xla_flags.avoid_cpu_scheduler_deadlock()
    if plugins:
      az.load_plugins(split_names(plugins))
      if config is not None:
        check_attention(config.model.attention)
  except (HarnessError, ImportError) as e:
    fail(str(e))
  return rest


def _config_flag(argv: list[str]) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _explain_config_error(argv: list[str]) -> str | None:
  """Why `--config=FILE[:ARG]` and its `--config.<field>` overrides fail, in one line."""
  value = _config_flag(argv)
  if value is None:
    return None
  path, _, arg = value.partition(":")
  if not Path(path).is_file():
    existing = [p.as_posix() for p in sorted(Path("configs").rglob("*.py"))]
    return (f"config file {path!r} not found{did_you_mean(path, existing)}; the LRA task configs "
            f"are {TASK_CONFIGS} for task in: {', '.join(lra.available_tasks())}")
  try:
    spec = importlib.util.spec_from_file_location("_config_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except Exception as e:  # noqa: BLE001
    return f"{path}: {e}"
  for item in argv:
    if item.startswith("--config."):
      field = item[len("--config."):].split("=", 1)[0]
      problem = unknown_field(config, field)
      if problem:
        return problem
  return None


def _explain_choice_error(argv: list[str]) -> str | None:
  """absl's error for a value outside an enum flag's choices (--preset=tnyi), in one line with
  the closest choice."""
  for item in argv:
    name, sep, value = item.lstrip("-").partition("=")
    choices = getattr(flags.FLAGS[name].parser, "enum_values", None) if (
        sep and name in flags.FLAGS) else None
    if choices and value not in choices:
      return (f"--{name}={value}: not one of {', '.join(choices)}"
              f"{did_you_mean(value, choices)}")
  return None


def split_names(text: str | list[str] | None) -> list[str]:
  """"a,b" or ["a,b", "c"] -> ["a", "b", "c"] (a list flag's items, each maybe a list too)."""
  if not text:
    return []
  items = [text] if isinstance(text, str) else list(text)
  return [name.strip() for item in items for name in item.split(",") if name.strip()]


def integers(items, flag: str) -> list[int]:
  """A list flag's items as integers (--seeds=0,1,2 -> [0, 1, 2]); HarnessError naming the flag
  for anything that is not an integer."""
  try:
    return [int(item) for item in items]
  except ValueError:
    raise HarnessError(f"--{flag} must be integers, got {','.join(items)}") from None
