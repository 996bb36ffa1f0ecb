"""What the command-line entry points share: one-line errors instead of tracebacks.

A mistake on the command line (an unknown attention, task, preset or config field, a plugin
that does not import, missing data) prints one line `error: ...` naming it and the valid
choices, and exits with status 1. Bugs still raise with a traceback.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

from absl import app, flags
from absl import logging as absl_logging

TASK_CONFIGS = "configs/lra/<task>.py"


class HarnessError(Exception):
  """An error the user can fix; entry points print its message as one line."""


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
  current = os.environ.get("XLA_FLAGS", "")
  if CPU_SCHEDULER_FLAG.split("=")[0] in current:
    return
  flags_with = f"{current} {CPU_SCHEDULER_FLAG}".strip()
  probe = subprocess.run([sys.executable, "-c",
                          "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"],
                         env={**os.environ, "XLA_FLAGS": flags_with, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=300)
  if probe.returncode == 0:
    os.environ["XLA_FLAGS"] = flags_with
  else:
    print(f"note: this XLA refuses {CPU_SCHEDULER_FLAG}; running without it", file=sys.stderr)


def run(main, *, preload_plugins: bool = True) -> None:
  """`absl.app.run(main)` with one-line errors; `--plugins` modules are imported first, so
  config files see the variants they register."""
  from experiments import plugins

  avoid_cpu_scheduler_deadlock()

  absl_logging.get_absl_handler().addFilter(_OwnInfoOnly())
  if preload_plugins:
    try:
      plugins.preload_from_argv(sys.argv)
    except plugins.PluginError as e:
      fail(str(e))

  def wrapped(argv):
    try:
      return main(argv)
    except (HarnessError, plugins.PluginError) as e:
      fail(str(e))

  app.run(wrapped, flags_parser=_parse_flags)


# Config fields fixed by the config file (the task) and its argument (the preset): an override
# would leave every value they chose behind, so it is refused.
FIXED_FIELDS = {"task": "the config file is the task: --config=configs/lra/<task>.py:...",
                "preset": "the preset is part of the config argument: "
                          "--config=configs/lra/<task>.py:<attention>,<preset>"}


def check_not_fixed(field: str) -> None:
  """HarnessError if `field` (dotted) is one that only the config file or argument sets."""
  if field in FIXED_FIELDS:
    raise HarnessError(f"config.{field} cannot be overridden: {FIXED_FIELDS[field]}")


def _parse_flags(argv: list[str]) -> list[str]:
  for item in argv:
    if item.startswith("--config."):
      try:
        check_not_fixed(item[len("--config."):].split("=", 1)[0])
      except HarnessError as e:
        fail(str(e))
  try:
    rest = flags.FLAGS(argv)
    if "config" in flags.FLAGS:
      dict(flags.FLAGS.config)  # a config file that failed to load raises here
    return rest
  except Exception as e:  # noqa: BLE001 - turned into one line below
    fail(_explain_config_error(argv) or str(e).strip().splitlines()[0])


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

    return (f"config file {path!r} not found; the LRA task configs are {TASK_CONFIGS} for "
            f"task in: {', '.join(lra.available_tasks())}")
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


def unknown_field(config, dotted: str) -> str | None:
  """None if `config.<dotted>` exists, else a message naming the valid fields at that level."""
  node, walked = config, []
  for part in dotted.split("."):
    keys = list(node.keys()) if hasattr(node, "keys") else []
    if part not in keys:
      where = "config" + "".join(f".{w}" for w in walked)
      return (f"unknown config field {dotted!r}: {where} has no field {part!r}; its fields: "
              f"{', '.join(sorted(keys)) or '(none)'}")
    node, walked = node[part], walked + [part]
  return None
