"""attention-zoo: attention variants and sequence mixers behind one contract, registered by name.

    import attention_zoo as az
    attn = az.create("performer", num_heads=8, head_dim=64, rngs=nnx.Rngs(0))
    out = attn(q, k, v, kv_mask=kv_mask)
    layer = az.create_mixer("gated_deltanet", emb_dim=64, num_heads=4, rngs=nnx.Rngs(0))
    y = layer(x, mask=mask)                     # any name: a mixer, or attention with projections

This module is the package's face: it imports nothing when the package loads and resolves each
public name on first use, so `import attention_zoo.ops` (pure JAX) loads no Flax and no other
part of the package. The first use of a public name imports the built-in variants and mixers
(attention_zoo/variants/, attention_zoo/mixers/: a new one is a new file there with one
`@register` or `@register_mixer` line, and no list names it); variants outside the package are
loaded with `az.load_plugins([...])` (module names or .py files). The modules (az.reference,
az.registry, az.models, ...) are imported when first named, az.registry and az.plugins with the
built-ins. The package's own modules import the registry by its full path (a module the
built-ins import that named it through this face would load them while half-imported).
docs/architecture.md shows the layers.
"""
import importlib
import importlib.util

# Public name -> the module that defines it.
_DEFINED_IN = {
    **dict.fromkeys(("Attention", "Mixer", "register", "register_mixer"), "contract"),
    **dict.fromkeys(("AttentionSpec", "MixerSpec", "Spec", "available", "create",
                     "scoped_registry", "spec", "state_size"), "registry"),
    "create_mixer": "layers",
    **dict.fromkeys(("Bool", "Choice", "Float", "Int"), "options"),
    **dict.fromkeys(("PluginError", "load_plugins"), "plugins"),
}

# Modules whose functions read the name table: naming them loads the built-ins too.
_TABLE_MODULES = ("plugins", "registry")

__all__ = sorted([*_DEFINED_IN, "reference"])


def _load_builtins():
  """Imports the built-in variants and mixers: importing their packages registers them."""
  import attention_zoo.mixers  # noqa: F401
  import attention_zoo.variants  # noqa: F401


def __getattr__(name: str):
  if name in _DEFINED_IN:
    _load_builtins()
    value = getattr(importlib.import_module(f"{__name__}.{_DEFINED_IN[name]}"), name)
  elif importlib.util.find_spec(f"{__name__}.{name}") is not None:   # a module of the package
    if name in _TABLE_MODULES:
      _load_builtins()
    value = importlib.import_module(f"{__name__}.{name}")
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return sorted({*globals(), *__all__})
