"""What the command-line entry points share: one-line errors instead of tracebacks.

A mistake on the command line (an unknown attention, task, preset or config field, a plugin
that does not import, missing data) prints one line `error: ...` naming it and the valid
choices, and exits with status 1. Bugs still raise with a traceback.

`--dry_run`, on every entry point `run` starts: the command is checked as the real run checks
it (flags, configs resolved, plug-ins loaded), then `plan` prints one line per run it would
start and the command exits 0 before it trains, measures, writes or downloads anything.
"""
from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

from absl import app, flags
from absl import logging as absl_logging

TASK_CONFIGS = "configs/lra/<task>.py"


class HarnessError(Exception):
  """An error the user can fix; entry points print its message as one line."""


class Interrupted(KeyboardInterrupt):
  """Ctrl-C during a training run. Its message says where the run stopped (the step, the last
  checkpoint); the entry point prints it in one line with the command that resumes the run. A
  KeyboardInterrupt, so that what stops at Ctrl-C (a grid, `except Exception`) stops at it."""


DRY_RUN_HELP = ("Check the command and print what it would run, one line per run, then exit "
                "without training, writing or downloading anything.")


class _Planned(Exception):
  """Raised by `plan` under --dry_run: the command ends there, successfully."""


def dry_run() -> bool:
  return "dry_run" in flags.FLAGS and flags.FLAGS.dry_run


def plan(make_lines) -> None:
  """Under --dry_run: prints the lines `make_lines()` returns (what would run; the checks it
  makes are the real run's) and ends the command with status 0; otherwise does nothing."""
  if not dry_run():
    return
  for line in make_lines():
    print(line)
  raise _Planned


def count(number: int, noun: str) -> str:
  """"1 layer", "2 layers": a plan line's sizes."""
  return f"{number:,} {noun}{'' if number == 1 else 's'}"


def options_text(attention: str, options: dict) -> str:
  """A plan line's attention options: "options k=v, ...", or that the variant's defaults apply
  (its options the config does not set take their defaults in any case)."""
  if not options:
    return f"{attention}'s default options"
  return "options " + ", ".join(f"{k}={v}" for k, v in sorted(options.items()))


def rounded(percent: float, decimals: int = 2) -> str:
  """A percentage as text, rounded half up from its shortest decimal form, as a reader rounds a
  printed number, so that every table rounds one accuracy alike: 1,132 of 8,000 is 14.15%, which
  100 * 0.1415 gives as 14.149999999999999; format() would show it as 14.1 at one decimal."""
  shortest = Decimal(repr(round(percent, 9)))
  return str(shortest.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP))


def fail(message: str) -> None:
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
  sys.exit(1)


class _OwnInfoOnly(logging.Filter):
  """Info lines from this project only; libraries (orbax, jax) speak at warning level."""

  OWN = tuple(f"/{package}/" for package in ("experiments", "lra", "attention_zoo", "configs"))

  def filter(self, record):
    return record.levelno >= logging.WARNING or any(p in record.pathname for p in self.OWN)


# XLA's CPU scheduler that runs independent ops concurrently can deadlock (seen with jax 0.10.2 on
# 2 cores): a multi-layer train step of Performer with redraw=True (several LAPACK QR calls among
# matmuls) then blocks forever in its first call. Turning it off, for every variant alike, avoids
# that. It is an XLA_FLAGS entry, read when the backend starts, and an XLA that does not know it
# aborts the process: so it is tried in a child process first.
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def avoid_cpu_scheduler_deadlock() -> None:
  """Adds CPU_SCHEDULER_FLAG to XLA_FLAGS (before JAX starts) unless set already or XLA refuses
  it."""
  if not add_xla_flag(CPU_SCHEDULER_FLAG):
    print(f"note: this XLA refuses {CPU_SCHEDULER_FLAG}; running without it", file=sys.stderr)


def add_xla_flag(flag: str) -> bool:
  """Appends `flag` ("--name=value") to XLA_FLAGS before JAX starts, unless the name is set
  already or a child process shows that this XLA refuses it (XLA aborts on a flag it does not
  know); False when refused."""
  current = os.environ.get("XLA_FLAGS", "")
  if flag.split("=")[0] in current:
    return True
  flags_with = f"{current} {flag}".strip()
  probe = subprocess.run([sys.executable, "-c",
                          "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"],
                         env={**os.environ, "XLA_FLAGS": flags_with, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=300)
  if probe.returncode == 0:
    os.environ["XLA_FLAGS"] = flags_with
  return probe.returncode == 0


def run(main) -> None:
  """`absl.app.run(main)` with one-line errors. The flags and the config are checked before
  anything imports JAX (a mistake is reported at once); then XLA's flags are set and the
  `--plugins` modules imported (the one place plug-ins are loaded: `main` finds their variants
  registered), and the attention the config names is checked again against the variants they
  register. Ctrl-C ends the command with one line (status 130), naming, for a training run,
  where it stopped and the command that resumes it."""
  absl_logging.get_absl_handler().addFilter(_OwnInfoOnly())
  if "dry_run" not in flags.FLAGS:
    flags.DEFINE_bool("dry_run", False, DRY_RUN_HELP)
  resume = resume_command(sys.argv)   # before the flags' parsing edits sys.argv

  def wrapped(argv):
    try:
      return main(argv)
    except HarnessError as e:
      fail(str(e))
    except _Planned:
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
  program = ["python", "-m", spec.name] if spec is not None else ["python", argv[0]]
  return shlex.join(program + [arg for arg in argv[1:]
                               if arg.lstrip("-").partition("=")[0] != "restart"])


# Config fields fixed by the config file (the task) and its argument (the preset): an override
# would leave every value they chose behind, so it is refused.
FIXED_FIELDS = {"task": "the config file is the task: --config=configs/lra/<task>.py:...",
                "preset": "the preset is part of the config argument: "
                          "--config=configs/lra/<task>.py:<attention>,<preset>"}
# The variant's options: an open set of names (the variant's, known once it is imported),
# checked when the model is built.
OPTIONS_FIELD = "model.attention_options"


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
    if not dry_run():   # its probe starts JAX in a child; a dry run executes nothing
      avoid_cpu_scheduler_deadlock()
    if plugins:
      import attention_zoo as az

      az.load_plugins(split_names(plugins))
      if config is not None:
        check_attention(config.model.attention)
  except (HarnessError, ImportError) as e:
    fail(str(e))
  return rest


def check_not_fixed(field: str) -> None:
  """HarnessError if `field` (dotted) is one that only the config file or argument sets."""
  if field in FIXED_FIELDS:
    raise HarnessError(f"config.{field} cannot be overridden: {FIXED_FIELDS[field]}")


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
    import lra

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


def task_module(task: str):
  """The config file of a task: configs/lra/<task>.py, configs/mad/<task>.py for a MAD task,
  or configs/<task>.py for another diagnostic."""
  import lra

  tasks = lra.available_tasks() + lra.diagnostic_tasks()
  if task not in tasks:
    raise HarnessError(f"unknown task {task!r}{did_you_mean(task, tasks)}; tasks: "
                       f"{', '.join(tasks)}")
  package = ("configs.lra" if task in lra.available_tasks() else
             "configs.mad" if task in lra.mad_tasks() else "configs")
  return importlib.import_module(f"{package}.{task}")


def task_config(task: str, attention: str, preset: str, seed: int | None = None,
                overrides=()):
  """get_config("<attention>,<preset>") of the task's config file (see task_module), with the
  seed and overrides ("field=value", parsed as the field's type) when given; a bad argument ->
  HarnessError."""
  try:
    config = task_module(task).get_config(f"{attention},{preset}")
  except ValueError as e:
    raise HarnessError(str(e)) from None
  if seed is None and not overrides:
    return config
  if seed is not None:
    config.seed = seed
  config.lock()
  for override in overrides:
    field, sep, value = override.partition("=")
    if not sep:
      raise HarnessError(f"--override takes field=value, got {override!r}")
    set_field(config, field, value)
  return config


def split_names(text: str | list[str] | None) -> list[str]:
  """"a,b" or ["a,b", "c"] -> ["a", "b", "c"] (a list flag's items, each maybe a list too)."""
  if not text:
    return []
  items = [text] if isinstance(text, str) else list(text)
  return [name.strip() for item in items for name in item.split(",") if name.strip()]


def parse_seeds(items) -> list[int]:
  """--seeds=0,1,2 -> [0, 1, 2]; HarnessError for anything that is not an integer."""
  try:
    return [int(s) for s in items]
  except ValueError:
    raise HarnessError(f"--seeds takes integers, got {','.join(items)}") from None


def first_line(error: BaseException, limit: int = 300) -> str:
  """The first line of an error's message (at most `limit` characters), or its type's name
  when it has none."""
  text = str(error).strip()
  return text.splitlines()[0][:limit] if text else type(error).__name__


def did_you_mean(word: str, choices) -> str:
  """" (did you mean 'x'?)" for the closest of `choices`, or "" when none is close."""
  close = difflib.get_close_matches(word, list(choices), n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_field(config, dotted: str) -> str | None:
  """None if `config.<dotted>` exists (any name under model.attention_options), else a message
  naming the closest and the valid fields at that level."""
  if dotted.startswith(f"{OPTIONS_FIELD}."):
    dotted = OPTIONS_FIELD
  node, walked = config, []
  for part in dotted.split("."):
    keys = list(node.keys()) if hasattr(node, "keys") else []
    if part not in keys:
      where = "config" + "".join(f".{w}" for w in walked)
      return (f"unknown config field {dotted!r}: {where} has no field {part!r}"
              f"{did_you_mean(part, keys)}; its fields: {', '.join(sorted(keys)) or '(none)'}")
    node, walked = node[part], walked + [part]
  return None


def set_field(config, dotted: str, text: str) -> None:
  """config.<dotted> = field_value(config, dotted, text): "model.num_layers", "2" -> 2."""
  from configs.lra.common import parent_and_name

  value = field_value(config, dotted, text)
  node, name = parent_and_name(config, dotted)
  with node.unlocked():
    node[name] = value


def field_value(config, dotted: str, text: str):
  """Command-line text for config.<dotted>, parsed as the field's type; HarnessError naming the
  field (the closest if it is unknown). A name under model.attention_options is new to the
  config: its value is read as a Python literal (8, 0.5, true, "relu"), and the variant checks
  it when the model is built."""
  from configs.lra.common import parent_and_name

  check_not_fixed(dotted)
  problem = unknown_field(config, dotted)
  if problem:
    raise HarnessError(problem)
  node, name = parent_and_name(config, dotted)
  is_option = dotted.rpartition(".")[0] == OPTIONS_FIELD
  try:
    return parse_value(text, None if is_option else node.get_type(name))
  except (ValueError, TypeError, SyntaxError) as e:
    raise HarnessError(f"{dotted}={text}: {e}") from None


def parse_value(text: str, kind: type | None):
  """Command-line text as a value of `kind` (a None placeholder keeps its type); for no kind, a
  Python literal, or the text itself."""
  if kind is bool or (kind is None and text.lower() in ("true", "false")):
    if text.lower() not in ("true", "false", "1", "0"):
      raise ValueError("expected true or false")
    return text.lower() in ("true", "1")
  if kind in (int, float, str):
    return kind(text)
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    if kind is None:
      return text
    raise


def attention_names() -> list[str]:
  """The registered attention variants and mixers. Once attention_zoo is imported (a plug-in
  imports it), its registry; before that, `names_in_source()`: importing the package starts
  JAX, which a mistyped name should not wait for."""
  if "attention_zoo" in sys.modules:
    return list(sys.modules["attention_zoo"].available())
  return names_in_source()


def names_in_source() -> list[str]:
  """The names attention_zoo's modules register (`@register("name", ...)`,
  `@register_mixer("name", ...)`), read from their source without importing them."""
  package = Path(importlib.util.find_spec("attention_zoo").origin).parent
  names = []
  for path in sorted(package.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      for decorator in getattr(node, "decorator_list", []):
        if (isinstance(decorator, ast.Call) and decorator.args
            and isinstance(decorator.args[0], ast.Constant)
            and getattr(decorator.func, "id", getattr(decorator.func, "attr", None))
            in ("register", "register_mixer")):
          names.append(decorator.args[0].value)
  return sorted(names)


def unknown_attention(name: str) -> str | None:
  """None if `name` is registered, else the one-line message naming the choices."""
  names = attention_names()
  if name in names:
    return None
  return (f"unknown attention {name!r}{did_you_mean(name, names)}; registered: "
          f"{', '.join(names)} (a variant in your own module: --plugins=MODULE)")


def check_attention(name: str) -> None:
  problem = unknown_attention(name)
  if problem:
    raise HarnessError(problem)
