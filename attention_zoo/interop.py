"""The zoo inside existing Flax models: an `attention_fn` for Flax's attention layers, and
`swap_attention` for built NNX models.

    attention_fn(name, **options)     -> fn(query, key, value, bias=None, mask=None, ...)
    swap_attention(model, name, ...)  -> the model, each nnx.MultiHeadAttention replaced

`attention_fn` plugs into `flax.nnx.MultiHeadAttention(attention_fn=...)` and
`flax.linen.MultiHeadDotProductAttention(attention_fn=...)` for every variant without
parameters of its own. `swap_attention` also takes those (their parameters are created fresh)
and keeps each layer's query/key/value/output projections, so a trained model keeps its
weights.

Masks. Flax hands the attention a dense mask M [batch..., heads or 1, q_len, kv_len]; the zoo
takes padding masks and a causal flag fixed at construction. The adapter reads

    q_pad[i] = any_{h, j} M[h, i, j],   kv_pad[j] = any_{h, i} M[h, i, j]

and computes attention under R = q_pad ⊗ kv_pad (∧ C, the bottom-right causal triangle, when
causal). R = M exactly when M factors as A ⊗ B (∧ C) for some A, B: that is what Flax's
`make_attention_mask` on padding, `make_causal_mask` and their `combine_masks` build. Whether
a call is causal is static: `causal=True` at construction, or `is_causal=True` from the layer;
it is never guessed from the mask's values. `check_mask=True` (the default) verifies R = M:
on a concrete mask it raises a ValueError; on a traced one (under jit) a `jax.debug.callback`
raises the same message on the host, which aborts the computation with a JaxRuntimeError.
`check_mask=False` assumes it (no callback; a mask that does not factor then gives attention
under R, silently).

Rows of queries that see no key are 0 here; Flax's dot_product_attention gives them the mean
of all values. `precision` is not used (each variant chooses its own matmul precision, f32
accumulation) and dropout masks are drawn per weight (broadcast_dropout is not applied).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import attention_zoo.mixers  # noqa: F401  (registers the built-in mixers)
import attention_zoo.variants  # noqa: F401  (registers the built-in variants, built here by name)
from attention_zoo import registry
from attention_zoo.ops import softmax


# -- attention_fn --------------------------------------------------------------------------

def attention_fn(name: str, *, causal: bool = False, max_len: int | None = None, seed: int = 0,
                 check_mask: bool = True, **options):
  """A Flax `attention_fn` computed by the zoo variant `name` (options as for `az.create`).

  causal: every call is causal (bottom-right aligned), whatever the mask; the layer's
  `is_causal=True` also makes a call causal. max_len as for `az.create`. seed: the key of each
  variant's construction-time draws (performer's fixed features, reformer's evaluation
  rotations, bigbird's random blocks), the same for every call. Fresh draws (performer's
  redraw, reformer's training rotations) and dropout come from the `dropout_rng` the layer
  passes, which Flax does only in training with dropout_rate > 0. `dropout_rate` in options
  overrides the layer's rate.
  """
  spec = registry.spec(name, "attention")
  # A small probe validates the options and the causal request before any call (with a
  # stand-in max_len, so that a variant with parameters hears about swap_attention first).
  probe_len = 8 if max_len is None and spec.needs_max_len else max_len
  probe = registry.create(name, num_heads=1, head_dim=8, causal=causal, max_len=probe_len,
                          rngs=nnx.Rngs(seed), **options)
  if _param_names(probe):
    free = [n for n in registry.available("attention") if not _param_names(_probe(n))]
    raise ValueError(
        f"attention_fn({name!r}): {name} has parameters of its own ("
        f"{', '.join(_param_names(probe))}), which a Flax attention_fn has nowhere to keep; use "
        f"attention_zoo.interop.swap_attention(model, {name!r}) on an NNX model instead, or a "
        f"variant without parameters: {', '.join(free)}")

  def zoo_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                    dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                    precision=None, module=None, is_causal=False):
    del broadcast_dropout, precision   # documented above: not applied
    if bias is not None:
      raise ValueError(f"attention_fn({name!r}): the zoo's variants take no arbitrary score "
                       f"bias; keep Flax's dot_product_attention for a layer given `bias`")
    if module is not None:
      raise ValueError(f"attention_fn({name!r}): sow_weights=True asks for the attention "
                       f"weights, which the zoo's variants do not return (most never form "
                       f"them); call the layer with sow_weights=False")
    dtype = jnp.result_type(query, key, value) if dtype is None else dtype
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    rate = options.get("dropout_rate", dropout_rate)
    if rate and not spec.supports_dropout and "dropout_rate" not in options:
      raise ValueError(f"attention_fn({name!r}): the layer asks for attention dropout "
                       f"(dropout_rate={dropout_rate}), which {name} cannot apply (it never "
                       f"forms attention weights); build the layer with dropout_rate=0, or "
                       f"pass dropout_rate=0.0 to attention_fn to run without it")
    training = dropout_rng is not None and not deterministic
    rngs = nnx.Rngs(params=seed, dropout=dropout_rng if training else seed)
    attention = registry.create(name, num_heads=query.shape[-2], head_dim=query.shape[-1],
                                num_kv_heads=key.shape[-2], causal=causal or is_causal,
                                max_len=max_len, rngs=rngs, **{**options, "dropout_rate": rate})
    _refuse_left_aligned_decode(attention, query.shape[-3], key.shape[-3])
    return attend(attention, query, key, value, mask, check_mask=check_mask,
                  deterministic=not training)

  zoo_attention.__name__ = f"zoo_attention_{name}"
  return zoo_attention


def attend(attention, query, key, value, mask, *, check_mask: bool = True,
           deterministic: bool = True):
  """Runs a zoo module on Flax's layout: q [batch..., q_len, h, d], k/v [batch..., kv_len,
  kvh, d], mask [batch..., h or 1, q_len, kv_len] or None -> [batch..., q_len, h, d]."""
  batch_shape, (q_len, num_heads, head_dim) = query.shape[:-3], query.shape[-3:]
  kv_len = key.shape[-3]
  if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
    raise ValueError(f"{attention.spec.name}: query {query.shape}, key {key.shape} and value "
                     f"{value.shape} must share their batch dimensions")
  flat = lambda x: x.reshape((math.prod(batch_shape),) + x.shape[-3:])   # [b, len, heads, d]
  q_mask = kv_mask = None
  if mask is not None:
    q_mask, kv_mask = padding_from_mask(mask, batch_shape, q_len, kv_len,
                                        causal=attention.causal, check=check_mask,
                                        name=attention.spec.name)
  out = attention(flat(query), flat(key), flat(value), q_mask=q_mask, kv_mask=kv_mask,
                  deterministic=deterministic)                           # [b, q, h, d]
  return out.reshape(batch_shape + (q_len, num_heads, head_dim))


def padding_from_mask(mask, batch_shape, q_len: int, kv_len: int, *, causal: bool, check: bool,
                      name: str):
  """Flax mask [batch..., h or 1, q_len, kv_len] -> q_mask [b, q_len], kv_mask [b, kv_len]
  (b = the flattened batch), verified to rebuild the mask when `check` (module docstring)."""
  mask = jnp.asarray(mask)
  want = len(batch_shape) + 3
  if mask.ndim != want or mask.shape[-2:] != (q_len, kv_len):
    raise ValueError(f"{name}: the attention mask must be [batch..., heads or 1, q_len, kv_len] "
                     f"= [{', '.join(map(str, batch_shape))}, h or 1, {q_len}, {kv_len}] "
                     f"(broadcastable), got {mask.shape}")
  mask = jnp.broadcast_to(mask != 0, batch_shape + mask.shape[-3:])
  mask = mask.reshape((-1,) + mask.shape[-3:])                            # [b, h or 1, q, kv]
  q_mask = jnp.any(mask, axis=(1, 3))                                     # [b, q]
  kv_mask = jnp.any(mask, axis=(1, 2))                                    # [b, kv]
  if check:
    rebuilt = q_mask[:, None, :, None] & kv_mask[:, None, None, :]       # [b, 1, q, kv]
    if causal:
      rebuilt = rebuilt & softmax.causal_pattern(q_len, kv_len, True)[None]
    factors = jnp.all(rebuilt == mask)
    if isinstance(factors, jax.core.Tracer):
      jax.debug.callback(_raise_unless_factors, factors, name, causal)
    else:
      _raise_unless_factors(factors, name, causal)
  return q_mask, kv_mask


def _raise_unless_factors(factors, name: str, causal: bool):
  if not bool(factors):
    shape = ("causal ∧ q_pad ⊗ kv_pad (the bottom-right triangle and padding)" if causal
             else "q_pad ⊗ kv_pad (padding only)")
    hint = ("" if causal else "; a causal mask needs causal=True (attention_fn or "
            "swap_attention) or is_causal=True from the layer")
    raise ValueError(
        f"{name}: the attention mask is not {shape}, the form of Flax's make_attention_mask "
        f"on padding, make_causal_mask and their combine_masks{hint}. No zoo variant takes an "
        f"arbitrary mask (per-head, segment or block masks): keep Flax's dot_product_attention "
        f"for such a layer")


def _refuse_left_aligned_decode(attention, q_len: int, kv_len: int):
  """Flax decodes with a left-aligned cache: one query against max_len slots, the later ones
  masked. A variant whose single query does not see every slot would place its window or
  blocks from the last slot, not from the token being decoded."""
  spec = attention.spec
  if (q_len == 1 < kv_len and spec.supports_cross and spec.exact
      and not attention.pattern(1, kv_len).all()):
    raise ValueError(f"{attention.spec.name}: one query against {kv_len} keys is how Flax's "
                     f"layers decode from their cache, whose later slots are empty; "
                     f"{attention.spec.name} would measure its pattern from the last slot. "
                     f"Decode with a variant whose query sees every key (full, flash, "
                     f"performer, linear_transformer)")


# -- swap_attention ------------------------------------------------------------------------

class ZooMultiHeadAttention(nnx.Module):
  """`nnx.MultiHeadAttention`'s projections (the same modules, so the same weights) around a
  zoo variant, called as `nnx.MultiHeadAttention` is. Made by `swap_attention`.

  Decoding (`init_cache(input_shape)`, then one token per call with decode=True) uses the
  variant's own cache: a right-aligned KV cache, or the recurrent state of the kernelised
  variants (variants whose spec says can_decode, built causal); `nnx.view(model, decode=True,
  batch_size=..., max_length=...)` prepares it too. Not supported: sow_weights, call-time rngs
  (the variant draws from the rngs given to swap_attention).
  """

  def __init__(self, original: nnx.MultiHeadAttention, attention, *, check_mask: bool):
    self.query, self.key, self.value, self.out = (original.query, original.key, original.value,
                                                  original.out)
    self.query_ln, self.key_ln = original.query_ln, original.key_ln
    self.in_features, self.deterministic = original.in_features, original.deterministic
    self.decode = original.decode
    self.attention, self.check_mask = attention, check_mask
    self.cache = nnx.data(None)   # set by init_cache

  def init_cache(self, input_shape, dtype=jnp.float32):
    """Prepares decoding for inputs [batch, max_len, features] (as Flax's layer does)."""
    if len(input_shape) != 3:
      raise ValueError(f"{self.attention.spec.name}: init_cache takes an input shape "
                       f"[batch, max_len, features], got {tuple(input_shape)}")
    self.cache = nnx.Cache(self.attention.init_cache(input_shape[0], input_shape[1], dtype))

  def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
               batch_size: int | None = None, max_length: int | None = None):
    """For `nnx.view(model, deterministic=..., decode=..., batch_size=..., max_length=...)`,
    as on Flax's layer; decode=True with batch_size and max_length prepares the cache."""
    if deterministic is not None:
      self.deterministic = deterministic
    if decode is not None:
      self.decode = decode
      if decode and self.cache is None:
        if batch_size is None or max_length is None:
          raise TypeError("batch_size and max_length must be given to prepare the cache")
        self.init_cache((batch_size, max_length, self.in_features))

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, deterministic=None,
               rngs=None, sow_weights=False, decode=None, is_causal=False, out_sharding=None,
               qkv_sharding=None):
    name = self.attention.spec.name
    if sow_weights or rngs is not None:
      raise ValueError(f"{name} (swapped in by swap_attention): sow_weights and call-time rngs "
                       f"are not supported; the variant draws from the rngs given to "
                       f"swap_attention")
    if is_causal and not self.attention.causal:
      raise ValueError(f"{name} was swapped in with causal=False but the layer is called with "
                       f"is_causal=True: swap with causal=True")
    if inputs_k is None:
      inputs_k = inputs_q
    inputs_v = inputs_k if inputs_v is None else inputs_v
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"{name}: expected inputs with {self.in_features} features, got "
                       f"{inputs_q.shape}")
    query = self.query(inputs_q, out_sharding=qkv_sharding)              # [..., q, h, d]
    key = self.key(inputs_k, out_sharding=qkv_sharding)                  # [..., kv, kvh, d]
    value = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.query_ln is not None:
      query, key = self.query_ln(query), self.key_ln(key)
    if decode if decode is not None else self.decode:
      if self.cache is None:
        raise ValueError(f"{name}: decode=True needs init_cache(input_shape) first")
      if mask is not None or query.shape[-3] != 1 or inputs_k is not inputs_q:
        raise ValueError(f"{name}: decode=True takes one token of self-attention per call, "
                         f"with mask=None (the cache masks what is not yet decoded)")
      out, new_cache = self.attention.decode(query, key, value, self.cache.get_value())
      self.cache.set_value(new_cache)
      return self.out(out, out_sharding=out_sharding)
    if deterministic is None:
      deterministic = self.deterministic
    if deterministic is None:
      if self.attention.dropout_rate:
        raise ValueError(f"{name}: attention dropout needs `deterministic`, from the call or "
                         f"the layer (model.train() / model.eval())")
      deterministic = True
    out = attend(self.attention, query, key, value, mask, check_mask=self.check_mask,
                 deterministic=deterministic)
    return self.out(out, out_sharding=out_sharding)


def swap_attention(model, name: str, *, causal: bool = False, max_len: int | None = None,
                   rngs: nnx.Rngs | None = None, where=None, check_mask: bool = True, **options):
  """Replaces, in place, every `nnx.MultiHeadAttention` inside `model` (those for which
  `where(path, layer)` is true, when given) with a `ZooMultiHeadAttention` computed by `name`.

  Each keeps its layer's query/key/value/output projections (and QK norms): a trained model
  keeps its weights. A variant's own parameters (linformer's projections, synthesizer's
  matrices, ...) and construction-time draws are created fresh from `rngs` (default
  nnx.Rngs(0)); they are model state like any other. `causal` and `max_len` as for `az.create`;
  `dropout_rate` defaults to each layer's. Returns the model; ValueError when it has no layer
  to swap.
  """
  spec = registry.spec(name, "attention")
  rngs = nnx.Rngs(0) if rngs is None else rngs
  found = [(path, layer) for path, layer in nnx.iter_graph(model)
           if isinstance(layer, nnx.MultiHeadAttention) and (where is None or where(path, layer))]
  if not found:
    selected = " selected by `where`" if where is not None else ""
    raise ValueError(f"swap_attention: no nnx.MultiHeadAttention{selected} inside the "
                     f"{type(model).__name__}")
  if any(not path for path, _ in found):
    raise ValueError("swap_attention: the model is itself an nnx.MultiHeadAttention; give a "
                     "model that contains it")
  for path, layer in found:
    layer_options = {"dropout_rate": layer.dropout_rate, **options}
    if layer_options["dropout_rate"] and not spec.supports_dropout:
      raise ValueError(f"swap_attention({name!r}): the layer at {'.'.join(map(str, path))} "
                       f"has attention dropout (dropout_rate={layer.dropout_rate}), which "
                       f"{name} cannot apply; pass dropout_rate=0.0 to swap without it")
    attention = registry.create(name, num_heads=layer.num_heads, head_dim=layer.head_dim,
                                num_kv_heads=layer.num_kv_heads, causal=causal,
                                max_len=max_len, rngs=rngs, **layer_options)
    parent = model
    for key in path[:-1]:   # modules by attribute; nnx.List, nnx.Dict, lists, dicts by item
      parent = parent[key] if hasattr(type(parent), "__getitem__") else getattr(parent, key)
    swapped = ZooMultiHeadAttention(layer, attention, check_mask=check_mask)
    if hasattr(type(parent), "__setitem__"):
      parent[path[-1]] = swapped
    else:
      setattr(parent, path[-1], swapped)
  return model


# -- helpers -------------------------------------------------------------------------------

def _probe(name: str):
  """The variant at its defaults and a small size."""
  spec = registry.spec(name, "attention")
  return registry.create(name, num_heads=1, head_dim=8, causal=not spec.supports_bidirectional,
                         max_len=8 if spec.needs_max_len else None, rngs=nnx.Rngs(0))


def _param_names(module) -> list[str]:
  """The paths of the module's nnx.Param leaves."""
  return sorted(".".join(map(str, path)) for path, node in nnx.iter_graph(module)
                if isinstance(node, nnx.Param))
