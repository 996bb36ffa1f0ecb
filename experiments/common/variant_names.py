"""The names of the registered attention variants and sequence mixers, known before JAX starts:
a mistyped name is refused at once, naming the closest."""
from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from pathlib import Path

from experiments.common.errors import HarnessError, did_you_mean


def attention_names() -> list[str]:
  """The registered attention variants and mixers. Once the registry is loaded (a plug-in that
  registers a variant loads it), its names; before that, `names_in_source()`: loading the
  built-ins starts JAX, which a mistyped name should not wait for. (Importing attention_zoo
  itself loads nothing: command_line imports it at the top.)"""
  if "attention_zoo.registry" in sys.modules:
    return list(sys.modules["attention_zoo"].available())
  return list(names_in_source())


@functools.cache   # parsing the package's source took 0.2 s, and a grid asks once per run
def names_in_source() -> tuple[str, ...]:
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
  return tuple(sorted(names))


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
