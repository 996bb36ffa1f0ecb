"""`--plugins=MODULE[,MODULE]`: import user modules that register attention variants.

    from experiments.plugins import load_plugins
    load_plugins(["my_project.cosine_attention"])   # -> ["cosine"], the names it registered

A plugin is any importable module (a package module, or a file `name.py` in the working
directory imported as `name`) whose import runs `@attention_zoo.register(...)`.
"""
from __future__ import annotations

import importlib
import sys

import attention_zoo as az


class PluginError(ImportError):
  """A plugin module could not be imported; the message says which and why."""


def split_modules(text: str | list[str] | None) -> list[str]:
  """"a,b" or ["a,b", "c"] -> ["a", "b", "c"]."""
  if not text:
    return []
  items = [text] if isinstance(text, str) else list(text)
  return [name.strip() for item in items for name in item.split(",") if name.strip()]


def load_plugins(modules: list[str]) -> list[str]:
  """Imports each module; returns the attention names they newly registered, sorted."""
  if "" not in sys.path:  # `python -m` puts the working directory first; scripts may not
    sys.path.append("")
  before = set(az.available())
  for name in split_modules(modules):
    try:
      importlib.import_module(name)
    except Exception as e:
      kind = "not found" if isinstance(e, ModuleNotFoundError) and e.name == name else \
          f"failed to import ({type(e).__name__}: {e})"
      raise PluginError(f"plugin module {name!r} {kind}; pass an importable module name "
                        "(e.g. my_package.my_attention, or my_attention for ./my_attention.py)"
                        ) from e
  return sorted(set(az.available()) - before)


def preload_from_argv(argv: list[str]) -> list[str]:
  """Loads the modules named by `--plugins` in argv before absl parses the flags, so config
  files (parsed with the flags) already see the variants they register."""
  values = []
  for i, arg in enumerate(argv):
    if arg.startswith("--plugins="):
      values.append(arg.split("=", 1)[1])
    elif arg == "--plugins" and i + 1 < len(argv):
      values.append(argv[i + 1])
  return load_plugins(split_modules(values))
