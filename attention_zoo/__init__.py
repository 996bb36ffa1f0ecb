"""attention-zoo: attention variants and sequence mixers behind one contract, registered by name.

    import attention_zoo as az
    attn = az.create("performer", num_heads=8, head_dim=64, rngs=nnx.Rngs(0))
    out = attn(q, k, v, kv_mask=kv_mask)
    layer = az.create_mixer("gated_deltanet", emb_dim=64, num_heads=4, rngs=nnx.Rngs(0))
    y = layer(x, mask=mask)                     # any name: a mixer, or attention with projections

Every module of this package that registers a variant or mixer is imported here, so a new one
is one new file with one `@register` (or `@register_mixer`) line. Those outside the package are
loaded with `az.load_plugins([...])` (module names or .py files).
"""
import importlib
import pkgutil

from attention_zoo import reference
from attention_zoo.base import Attention
from attention_zoo.options import Bool, Choice, Float, Int
from attention_zoo.plugins import PluginError, load_plugins
from attention_zoo.mixer import Mixer
from attention_zoo.registry import (AttentionSpec, available, create, create_mixer, register,
                                    register_mixer, scoped_registry, spec, state_size)

# Modules that are not variants (conformance is a command: `python -m attention_zoo.conformance`).
_NOT_VARIANTS = {"base", "registry", "reference", "conformance", "layers", "positions", "models",
                 "options", "plugins", "interop", "mixer", "mixer_parts", "ops"}

for _module in pkgutil.iter_modules(__path__):
  if _module.name not in _NOT_VARIANTS and not _module.name.startswith("_"):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Attention", "AttentionSpec", "Bool", "Choice", "Float", "Int", "Mixer", "PluginError",
           "available", "create", "create_mixer", "load_plugins", "reference", "register",
           "register_mixer", "scoped_registry", "spec", "state_size"]
