"""`--plugins=MODULE[,MODULE]`: load user modules or .py files that register attention variants.

The loading is the library's (`attention_zoo.load_plugins`); this module reads the flag, and
imports the library (and so JAX) only when there is a plug-in to load:

    from experiments.plugins import load_plugins
    load_plugins(["my_project.cosine_attention"])   # -> ["cosine"], the names it registered
"""
from __future__ import annotations

__all__ = ["load_plugins", "split_modules"]


def split_modules(text: str | list[str] | None) -> list[str]:
  """"a,b" or ["a,b", "c"] -> ["a", "b", "c"]."""
  if not text:
    return []
  items = [text] if isinstance(text, str) else list(text)
  return [name.strip() for item in items for name in item.split(",") if name.strip()]


def load_plugins(modules: str | list[str] | None) -> list[str]:
  """Loads each plug-in named (comma-separated names allowed); returns the attention names they
  newly registered, sorted. attention_zoo.PluginError (an ImportError) says which one failed
  and why."""
  names = split_modules(modules)
  if not names:
    return []
  import attention_zoo as az

  return az.load_plugins(names)
