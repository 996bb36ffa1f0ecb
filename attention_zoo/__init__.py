"""attention-zoo: attention variants behind one contract, registered by name.

    import attention_zoo as az
    attn = az.create("performer", num_heads=8, head_dim=64, rngs=nnx.Rngs(0))
    out = attn(q, k, v, kv_mask=kv_mask)

Every module of this package that registers a variant is imported here, so a new variant is
one new file with one `@register` line. Variants outside the package are loaded with
`az.load_plugins([...])` (module names or .py files).
"""
import importlib
import pkgutil

from attention_zoo import reference
from attention_zoo.base import Attention
from attention_zoo.options import Bool, Choice, Float, Int
from attention_zoo.plugins import PluginError, load_plugins
from attention_zoo.registry import (AttentionSpec, available, create, register, scoped_registry,
                                    spec)

# Modules that are not variants (conformance is a command: `python -m attention_zoo.conformance`).
_NOT_VARIANTS = {"base", "registry", "reference", "conformance", "layers", "positions", "models",
                 "options", "plugins", "interop"}

for _module in pkgutil.iter_modules(__path__):
  if _module.name not in _NOT_VARIANTS and not _module.name.startswith("_"):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Attention", "AttentionSpec", "Bool", "Choice", "Float", "Int", "PluginError",
           "available", "create", "load_plugins", "reference", "register", "scoped_registry",
           "spec"]
