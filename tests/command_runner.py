"""Runs many `python -m MODULE ARGS...` commands in one child process, each in-process (as
`runpy` runs a module as __main__, with the absl flags it defined removed afterwards): the
imports are paid once, not per command (5-10 s each in a process of its own).

    run_commands([["experiments.train", "--config=...", "--dry_run"], ...], cwd=tmp_path)
    -> [{"code": 0, "stdout": "...", "stderr": "..."}, ...]
"""
import contextlib
import io
import json
import os
import runpy
import socket
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OWN_PACKAGES = ("experiments.", "lra.", "attention_zoo.", "examples.")


def run_commands(commands: list[list[str]], *, cwd, timeout: float = 600) -> list[dict]:
  """Each command's exit code (an uncaught exception: "exception", its traceback in stderr),
  stdout and stderr, run from `cwd` with the repository importable."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
  done = subprocess.run([sys.executable, __file__], input=json.dumps(commands), cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.rsplit("\n", 2)[-2])


def run_one(argv: list[str]) -> dict:
  from absl import flags

  module, *args = argv
  out, err = io.StringIO(), io.StringIO()
  sys.argv = [module, *args]
  code = 0
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else int(e.code is not None)
  except Exception:  # noqa: BLE001 - reported as this command's result
    code = "exception"
    err.write(traceback.format_exc())
  finally:
    # The flags this project's code defined (a module run as __main__ is named by its file;
    # command_line.run defines --dry_run) and the overrides of its --config's fields
    # (--config.mesh.fsdp, defined by ml_collections for the command that gave them): the next
    # command defines its own. Libraries' flags stay, at their defaults again.
    for defined_by, defined in flags.FLAGS.flags_by_module_dict().items():
      own = defined_by not in sys.modules or defined_by.startswith(OWN_PACKAGES)
      for name in {flag.name for flag in defined} & set(flags.FLAGS):
        if own or name.startswith("config."):
          delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
  return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
  sys.path.insert(0, os.getcwd())   # as `python -m` has it: modules of the working directory
  results = [run_one(argv) for argv in json.loads(sys.stdin.read())]
  sys.stdout.write("\n" + json.dumps(results) + "\n")


def free_port() -> int:
  """A TCP port free on this machine now: the coordinator address of a multi-process test."""
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]
