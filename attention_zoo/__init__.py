"""attention-zoo: attention variants and sequence mixers behind one contract, registered by name.

    import attention_zoo as az
    attn = az.create("performer", num_heads=8, head_dim=64, rngs=nnx.Rngs(0))
    out = attn(q, k, v, kv_mask=kv_mask)
    layer = az.create_mixer("gated_deltanet", emb_dim=64, num_heads=4, rngs=nnx.Rngs(0))
    y = layer(x, mask=mask)                     # any name: a mixer, or attention with projections

The package's modules are all imported here, so a new variant is one new file with one
`@register` (or `@register_mixer`) line; variants outside the package are loaded with
`az.load_plugins([...])` (module names or .py files). attention_zoo/plugins.py says how.
"""
from attention_zoo import plugins, reference
from attention_zoo.base import Attention
from attention_zoo.options import Bool, Choice, Float, Int
from attention_zoo.plugins import PluginError, load_plugins
from attention_zoo.mixer import Mixer
from attention_zoo.registry import (AttentionSpec, available, create, create_mixer, register,
                                    register_mixer, scoped_registry, spec, state_size)

plugins.import_package_modules(__name__, __path__)

__all__ = ["Attention", "AttentionSpec", "Bool", "Choice", "Float", "Int", "Mixer", "PluginError",
           "available", "create", "create_mixer", "load_plugins", "reference", "register",
           "register_mixer", "scoped_registry", "spec", "state_size"]
