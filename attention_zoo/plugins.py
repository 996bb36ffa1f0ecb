"""Where registered variants come from: the package's own modules, and plug-ins.

    import attention_zoo as az
    az.load_plugins(["my_package.my_attention", "path/to/cosine.py"])   # -> the names added

The package's own variants and mixers register when their packages, attention_zoo.variants and
attention_zoo.mixers, import every module in them (`import_package_modules`): a new one is a new
file with one `@register` (or `@register_mixer`) line, and no list names it. The package's face
imports those two packages on the first use of a public name (`az.available()`, `az.create`...).

Any other variant is a plug-in: a module whose import registers it, loaded with `load_plugins`,
by its module name (importable from sys.path or the current directory: `my_attention` for
./my_attention.py) or by the path of its .py file. A file under the current directory is
imported by its dotted path from there (`examples/cosine_attention.py` ->
`examples.cosine_attention`, so naming it either way imports it once); any other file, or one
whose folders are not valid module names, is imported from its own folder. Everything that
takes plug-ins goes through this module: the harness's commands import their `--plugins` once,
in `experiments.common.command_line.run`, before the command's main runs (and check the
config's attention against what they register); the conformance runner imports each module it
is given with `import_plugin` and checks the names `registered_by` it.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from typing import Iterable

from attention_zoo.registry import available, get


def import_package_modules(package: str, path) -> None:
  """Imports every module of `package` (its folder list `path`) but private ones, registering
  the variants and mixers they define."""
  for module in pkgutil.iter_modules(path):
    if not module.name.startswith("_"):
      importlib.import_module(f"{package}.{module.name}")


class PluginError(ImportError):
  """A plug-in could not be loaded; the message says which one and why."""


def _module_name_of_file(path: str) -> str:
  """The module name to import the file at `path` (absolute) by, putting its root on sys.path."""
  root = os.getcwd()
  parts = os.path.splitext(os.path.relpath(path, root))[0].split(os.sep)
  if os.path.commonpath([root, path]) != root or not all(p.isidentifier() for p in parts):
    root, parts = os.path.dirname(path), [os.path.splitext(os.path.basename(path))[0]]
  if root not in sys.path:
    sys.path.insert(0, root)
  return ".".join(parts)


def _is_file(target: str) -> bool:
  return target.endswith(".py") or os.sep in target or "/" in target


def import_plugin(target: str) -> str:
  """Imports one plug-in (a module name or a .py path); returns its module name.

  PluginError when it is not found or its import fails (with the cause).
  """
  is_file = _is_file(target)
  if is_file:
    path = os.path.abspath(target)
    if not os.path.isfile(path):
      raise PluginError(f"plugin file {target!r} not found (looked for {path})")
    name, what = _module_name_of_file(path), f"plugin file {target!r}"
  else:
    if "" not in sys.path and os.getcwd() not in sys.path:   # `python -m` puts it there
      sys.path.append("")
    name, what = target, f"plugin module {target!r}"
  try:
    module = importlib.import_module(name)
  except Exception as e:
    missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
    if missing and (name == missing or name.startswith(missing + ".")):
      raise PluginError(f"{what} not found; pass an importable module name (e.g. "
                        f"my_package.my_attention, or my_attention for ./my_attention.py) or "
                        f"the path of a .py file") from e
    raise PluginError(f"{what} failed to import ({type(e).__name__}: {e})") from e
  if is_file:
    loaded = os.path.realpath(getattr(module, "__file__", None) or "")
    if loaded != os.path.realpath(path):
      raise PluginError(f"{what}: a different module named {name!r} is already imported "
                        f"(from {loaded or 'a built-in'}); rename the file")
  return name


def registered_by(module_name: str) -> list[str]:
  """The registered names whose class is defined in `module_name` or a module inside it."""
  return [n for n in available()
          if get(n).__module__ == module_name
          or get(n).__module__.startswith(module_name + ".")]


def load_plugins(targets: Iterable[str]) -> list[str]:
  """Imports each plug-in (module name or .py path); returns the names newly registered, sorted.

  A plug-in imported before adds nothing (its variants are registered already).
  """
  if isinstance(targets, str):
    targets = [targets]
  before = set(available())
  for target in targets:
    import_plugin(target)
  return sorted(set(available()) - before)
