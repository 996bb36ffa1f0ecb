"""`--plugins=MODULE[,MODULE]`: load user modules or .py files that register attention variants.

The loading is the library's (`attention_zoo.load_plugins`); this module reads the flag:

    from experiments.plugins import load_plugins
    load_plugins(["my_project.cosine_attention"])   # -> ["cosine"], the names it registered
"""
from __future__ import annotations

import attention_zoo as az
from attention_zoo.plugins import PluginError

__all__ = ["PluginError", "load_plugins", "preload_from_argv", "split_modules"]


def split_modules(text: str | list[str] | None) -> list[str]:
  """"a,b" or ["a,b", "c"] -> ["a", "b", "c"]."""
  if not text:
    return []
  items = [text] if isinstance(text, str) else list(text)
  return [name.strip() for item in items for name in item.split(",") if name.strip()]


def load_plugins(modules: str | list[str] | None) -> list[str]:
  """Loads each plug-in named (comma-separated names allowed); returns the attention names they
  newly registered, sorted. PluginError (an ImportError) says which one failed and why."""
  return az.load_plugins(split_modules(modules))


def preload_from_argv(argv: list[str]) -> list[str]:
  """Loads the modules named by `--plugins` in argv before absl parses the flags, so config
  files (parsed with the flags) already see the variants they register."""
  values = []
  for i, arg in enumerate(argv):
    if arg.startswith("--plugins="):
      values.append(arg.split("=", 1)[1])
    elif arg == "--plugins" and i + 1 < len(argv):
      values.append(argv[i + 1])
  return load_plugins(values)
