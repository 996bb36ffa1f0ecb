"""One Transformer for every attention variant and sequence mixer: encoder, decoder (with KV cache
or recurrent state), encoder-decoder, classifier and dual-encoder heads. The attention is known
only by its registry name.

    config = TransformerConfig(vocab_size=257, max_len=1000, attention="performer")
    model = Classifier(config, rngs=nnx.Rngs(0))
    logits = model(tokens, mask)          # tokens int [b, n], mask bool [b, n] (True = real)

Padding comes only from the masks passed in, never from token values.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo import positions, registry
from attention_zoo.dropout import Dropout
from attention_zoo.convolution import Canon, ShortConv
from attention_zoo.layers import MLP, OUTPUT_GATES, MultiHeadAttention, create_mixer
from attention_zoo.ops import fsdp
from attention_zoo.ops.autodiff import autodiff_modes
from attention_zoo.ops.segments import positions_in_segments

POOLINGS = ("cls", "mean", "padded_mean")
INTERACTIONS = ("nli", "concat")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Activation rematerialisation per block (jax.checkpoint): what a block keeps for the backward.
# "none" keeps every activation; "block" keeps only the block's input and recomputes the rest;
# "dots" keeps the outputs of matmuls without batch dimensions (the projections and the MLP)
# and recomputes the rest (attention's own products, norms, activations).
REMAT_POLICIES = {"none": None, "block": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
# Canon layers' points in a block (Allen-Zhu 2025; convolution.Canon): A before the
# self-attention (after its norm), B on its q/k/v projections, C before the MLP (after its
# norm), D on the MLP's up projection.
CANON_POINTS = "ABCD"
# What the block keeps under "none" when the mesh cuts the parameters over fsdp: every activation
# but the outputs of these operations, which the backward recomputes. A parameter gathered over
# fsdp (a sharding constraint), and a cast or a change of shape of one, is then gathered again
# in the backward pass rather than kept whole from the forward: one block's parameters whole at
# a time. An activation's cast or change of shape is recomputed too, at no cost worth counting.
_RECOMPUTED_UNDER_FSDP = frozenset({"sharding_constraint", "convert_element_type", "reshape",
                                    "transpose", "broadcast_in_dim", "squeeze", "expand_dims"})


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Everything a model needs; passed down to every layer.

  `attention` names an attention variant or a sequence mixer (`az.available("mixer")`); a
  block builds it with `az.create_mixer`. Positions "rope" and "alibi" act on attention scores,
  so a block with a recurrent mixer takes none from them (the recurrence is ordered; RetNet
  rotates its own q and k); "sinusoidal" and "learned" are added to the embeddings either way.
  `cross_attention` is always an attention variant.
  """
  vocab_size: int = 256
  max_len: int = 512
  num_layers: int = 2
  emb_dim: int = 64
  num_heads: int = 4
  num_kv_heads: int | None = None          # None = num_heads (MHA); 1 = MQA
  qkv_dim: int | None = None               # None = emb_dim
  mlp_dim: int = 128
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.0
  attention: str = "full"
  attention_options: dict[str, Any] = dataclasses.field(default_factory=dict)
  cross_attention: str = "full"            # encoder-decoder cross-attention
  positions: str = "sinusoidal"            # sinusoidal | learned | rope | alibi | none
  pooling: str = "cls"                     # cls | mean | padded_mean (classifiers; see pool)
  num_classes: int = 2
  interaction: str = "nli"                 # dual encoder: nli = [u, v, u*v, u-v], concat = [u, v]
  pre_ln: bool = True
  dtype: str = "float32"                   # compute dtype; parameters stay float32
  embed_init_std: float | None = None      # token embeddings ~ N(0, std²); None = 1/sqrt(emb_dim)
  short_conv: int = 0                      # kernel of a causal depthwise conv branch before
                                           # attention in every block (Zoology's); 0 = none
  gelu_approximate: bool = True            # the MLP's GELU: tanh approximation, or exact (erf)
  layer_norm_epsilon: float = 1e-6         # of every LayerNorm of the blocks and the final one
  # Every block's attention variant uses the first block's own parameters (e.g. Linformer's E,
  # not the q/k/v/out projections): Linformer's layerwise sharing.
  share_attention_across_layers: bool = False
  # Switches that recreate the released LRA encoders (off by default; see docs/lra_fidelity.md):
  zero_token_is_padding: bool = False      # attention also masks token id 0 (LRA's `inputs > 0`)
  attention_ignores_padding: bool = False  # attention gets no padding masks (pooling still does)
  remat: str = "none"                      # none | block | dots: see REMAT_POLICIES
  # The self-attention's output gate (layers.MultiHeadAttention; attention variants only):
  # none | headwise | elementwise
  output_gate: str = "none"
  canon: str = ""                          # Canon layers at these of CANON_POINTS, e.g. "ABCD"

  def __post_init__(self):
    registry.get(self.attention)            # unknown names -> ValueError listing the choices
    if registry.spec(self.cross_attention, "attention").kind != "attention":
      raise ValueError(f"cross_attention={self.cross_attention!r} is a sequence mixer; "
                       f"cross-attention needs an attention variant: "
                       f"{', '.join(registry.available('attention'))}")
    positions.check_kind(self.positions)
    for field, value, choices in (("pooling", self.pooling, POOLINGS),
                                  ("interaction", self.interaction, INTERACTIONS),
                                  ("dtype", self.dtype, tuple(DTYPES)),
                                  ("remat", self.remat, tuple(REMAT_POLICIES)),
                                  ("output_gate", self.output_gate, OUTPUT_GATES)):
      if value not in choices:
        raise ValueError(f"TransformerConfig.{field}={value!r}; choose one of {', '.join(choices)}")
    if set(self.canon) - set(CANON_POINTS) or len(set(self.canon)) != len(self.canon):
      raise ValueError(f"TransformerConfig.canon={self.canon!r}; give each of the points "
                       f"{CANON_POINTS} at most once (e.g. 'ABCD', 'AC', or '' for none)")

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]


class Block(nnx.Module):
  """Self-attention, optional cross-attention, MLP; each a residual branch (pre- or post-LN)."""

  def __init__(self, config: TransformerConfig, *, causal: bool, cross: bool, max_len: int,
               rngs: nnx.Rngs):
    dtype = config.compute_dtype
    is_mixer = registry.spec(config.attention).kind == "mixer"
    attention_options = dict(config.attention_options)
    if config.attention_dropout_rate:
      if is_mixer:
        raise ValueError(f"attention_dropout_rate={config.attention_dropout_rate} cannot apply to "
                         f"the mixer {config.attention!r}: it forms no attention weights (use 0)")
      attention_options.setdefault("dropout_rate", config.attention_dropout_rate)
    dims = dict(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                qkv_dim=config.qkv_dim, max_len=max_len, dtype=dtype, rngs=rngs)
    norm = lambda: nnx.LayerNorm(config.emb_dim, epsilon=config.layer_norm_epsilon, dtype=dtype,
                                 rngs=rngs)
    # rope / alibi act on attention scores; a recurrent mixer has none (RetNet rotates its own)
    score_positions = config.positions in ("rope", "alibi") and not is_mixer
    self.pre_ln, self.is_mixer = config.pre_ln, is_mixer
    self.short_conv = (ShortConv(config.emb_dim, config.short_conv, dtype=dtype, rngs=rngs)
                       if config.short_conv else None)
    self.conv_norm = norm() if config.short_conv else None
    canon = lambda point: (Canon(config.emb_dim, dtype=dtype, rngs=rngs)
                           if point in config.canon else None)
    self.canon_attention, self.canon_mlp = canon("A"), canon("C")
    self.self_attention = create_mixer(
        config.attention, emb_dim=config.emb_dim, causal=causal,
        position_kind=config.positions if score_positions else "none",
        output_gate=config.output_gate, canon="B" in config.canon, **dims, **attention_options)
    self.self_norm = norm()
    self.cross_attention = (MultiHeadAttention(config.emb_dim, attention=config.cross_attention,
                                               **dims) if cross else None)
    self.cross_norm = norm() if cross else None
    self.mlp = MLP(config.emb_dim, config.mlp_dim, dropout_rate=config.dropout_rate,
                   approximate_gelu=config.gelu_approximate, canon="D" in config.canon,
                   dtype=dtype, rngs=rngs)
    self.mlp_norm = norm()
    self.dropout = Dropout(config.dropout_rate, rngs=rngs)

  def __call__(self, x, mask, *, context=None, context_mask=None, deterministic=True, decode=False,
               packing=None):
    """packing: None, or (segment_ids, position_ids) int [b, n] of packed sequences."""
    segment_ids = None if packing is None else packing[0]
    # a mixer restarts its own positions (if any) at each segment; attention is handed them
    packed = ({} if packing is None else {"segment_ids": segment_ids} if self.is_mixer
              else dict(zip(("segment_ids", "position_ids"), packing)))
    if self.short_conv is not None:
      x = self._residual(self.conv_norm, x, deterministic,
                         lambda h: self.short_conv(h, decode=decode, segment_ids=segment_ids))
    canon = lambda layer, h: h if layer is None else layer(h, mask, decode=decode,
                                                           segment_ids=segment_ids)
    x = self._residual(self.self_norm, x, deterministic, lambda h: self.self_attention(
        canon(self.canon_attention, h), mask=mask, deterministic=deterministic, decode=decode,
        **packed))
    if self.cross_attention is not None:
      x = self._residual(self.cross_norm, x, deterministic, lambda h: self.cross_attention(
          h, context, mask=mask, context_mask=context_mask, deterministic=deterministic))
    return self._residual(self.mlp_norm, x, deterministic, lambda h: self.mlp(
        canon(self.canon_mlp, h), deterministic=deterministic, mask=mask, decode=decode,
        segment_ids=segment_ids))

  def init_cache(self, batch_size: int, max_len: int, dtype):
    """Prepares one-token decoding: the self-attention's cache and the convolutions'."""
    self.self_attention.init_cache(batch_size, max_len, dtype)
    self.mlp.init_cache(batch_size, dtype)
    for conv in (self.short_conv, self.canon_attention, self.canon_mlp):
      if conv is not None:
        conv.init_cache(batch_size, dtype)

  def _residual(self, norm, x, deterministic, branch):
    if self.pre_ln:
      return x + self.dropout(branch(norm(x)), deterministic=deterministic)
    return norm(x + self.dropout(branch(x), deterministic=deterministic))


class Stack(nnx.Module):
  """Token embedding + positions + blocks (+ final LayerNorm when pre-LN).

  tokens int [b, n], mask bool [b, n] -> (hidden [b, n', emb], mask [b, n']) where n' = n + 1
  with a CLS token prepended.

  Packed sequences: segment_ids int [b, n] (contiguous runs, one per packed sequence) keep every
  token's self-attention inside its run, and positions (sinusoidal, learned, RoPE) restart at 0
  at each run, so a packed row computes what its sequences would separately: a sequence mixer
  starts each run from its empty state, and no short convolution reaches across a run's start.
  Names with spec.supports_segment_ids only (the exact attention variants and the mixers); not
  with a CLS token or cross-attention.
  """

  def __init__(self, config: TransformerConfig, *, causal: bool = False, cross: bool = False,
               cls_token: bool = False, rngs: nnx.Rngs):
    self.config, self.causal = config, causal
    max_len = config.max_len + int(cls_token)
    dtype = config.compute_dtype
    embed_init = ({} if config.embed_init_std is None
                  else {"embedding_init": nnx.initializers.normal(config.embed_init_std)})
    self.embed = nnx.Embed(config.vocab_size, config.emb_dim, dtype=dtype, rngs=rngs, **embed_init)
    self.cls = (nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (config.emb_dim,)))
                if cls_token else None)
    self.learned_positions = (positions.LearnedPositions(max_len, config.emb_dim, rngs=rngs)
                              if config.positions == "learned" else None)
    self.dropout = Dropout(config.dropout_rate, rngs=rngs)
    self.blocks = nnx.List([Block(config, causal=causal, cross=cross, max_len=max_len, rngs=rngs)
                            for _ in range(config.num_layers)])
    if config.share_attention_across_layers:
      self.share_attention_parameters()
    self.final_norm = (nnx.LayerNorm(config.emb_dim, epsilon=config.layer_norm_epsilon,
                                     dtype=dtype, rngs=rngs) if config.pre_ln else None)
    self.decode_position = nnx.data(None)   # set by init_cache

  def share_attention_parameters(self) -> None:
    """Points every block's attention variant at the first block's own parameters (the
    variant's nnx.Param attributes, e.g. Linformer's E; the q/k/v/out projections stay per
    block). NNX keeps one copy of a shared parameter, and its gradient sums every block's use."""
    config = self.config
    if registry.spec(config.attention).kind == "mixer":
      raise ValueError(f"share_attention_across_layers shares an attention variant's own "
                       f"parameters; {config.attention!r} is a sequence mixer")
    layers = [block.self_attention for block in self.blocks]
    first = layers[0].attention
    names = [name for name, value in vars(first).items() if isinstance(value, nnx.Param)]
    if not names:
      raise ValueError(f"share_attention_across_layers: {config.attention!r} has no parameters "
                       "of its own to share (only its q/k/v/out projections, which stay per "
                       "layer)")
    for layer in layers[1:]:
      for name in names:
        setattr(layer.attention, name, getattr(first, name))

  def __call__(self, tokens, mask=None, *, context=None, context_mask=None, deterministic=True,
               segment_ids=None):
    b, n = tokens.shape
    if n > self.config.max_len:
      raise ValueError(f"input length {n} exceeds config.max_len={self.config.max_len}")
    packing = None
    if segment_ids is not None:
      if self.cls is not None or context is not None:
        raise ValueError("segment_ids (packed sequences) cannot be combined with a CLS token or "
                         "cross-attention")
      packing = (segment_ids, positions_in_segments(segment_ids))
    mask = jnp.ones((b, n), bool) if mask is None else jnp.asarray(mask, bool)
    attention_mask = mask & (tokens != 0) if self.config.zero_token_is_padding else mask
    x = _gathered(self.embed)(tokens)
    if self.cls is not None:
      cls = jnp.broadcast_to(fsdp.gathered(self.cls[...]).astype(x.dtype), (b, 1, x.shape[-1]))
      x = jnp.concatenate([cls, x], axis=1)
      mask, attention_mask = (jnp.concatenate([jnp.ones((b, 1), bool), m], axis=1)
                              for m in (mask, attention_mask))
    if self.config.attention_ignores_padding:
      attention_mask = None
    position_ids = jnp.arange(x.shape[1]) if packing is None else packing[1]
    x = self.dropout(self._add_positions(x, position_ids), deterministic=deterministic)
    # Parameters cut over fsdp are gathered block by block (_gathered), and the backward pass
    # gathers them again rather than keep them (_rematerialised with _remat_policy).
    remat, gathering = self.config.remat, fsdp.fsdp_size() > 1
    for block in self.blocks:
      if remat == "none" and not gathering:
        x = block(x, attention_mask, context=context, context_mask=context_mask,
                  deterministic=deterministic, packing=packing)
      else:
        x = _rematerialised(block, _remat_policy(remat, gathering), x, attention_mask, context,
                            context_mask, packing, deterministic=deterministic)
    return self._finish(x), mask

  def init_cache(self, batch_size: int, max_len: int):
    for block in self.blocks:
      block.init_cache(batch_size, max_len, self.config.compute_dtype)
    self.decode_position = nnx.Cache(jnp.zeros((), jnp.int32))

  def decode_step(self, token, *, context=None, context_mask=None):
    """One token [b, 1] through the cached causal stack -> hidden [b, 1, emb]."""
    if self.decode_position is None:
      raise ValueError("decode_step needs a cache: call init_cache(batch_size, max_len) first "
                       "(generate() does it for you)")
    x = self._add_positions(self.embed(token), self.decode_position[...][None])
    self.decode_position[...] += 1
    mask = jnp.ones(token.shape, bool)
    for block in self.blocks:
      x = block(x, mask, context=context, context_mask=context_mask, decode=True)
    return self._finish(x)

  def _add_positions(self, x, position_ids):
    kind = self.config.positions
    if kind == "sinusoidal":
      x = x + positions.sinusoidal(position_ids, x.shape[-1]).astype(x.dtype)
    elif kind == "learned":
      x = x + _gathered(self.learned_positions)(position_ids).astype(x.dtype)
    return x

  def _finish(self, x):
    return x if self.final_norm is None else _gathered(self.final_norm)(x)


def _gathered(module: nnx.Module) -> nnx.Module:
  """`module` with its state whole on every device, where the active mesh cuts the training
  state over fsdp: a layer's parameters gathered just before it runs (ops/fsdp.py); `module`
  itself otherwise. The copy shares the module's RNG streams, so that what it draws advances
  them."""
  if fsdp.fsdp_size() == 1:
    return module
  graphdef, state, rngs = nnx.split(module, nnx.Not(nnx.RngState), ...)
  return nnx.merge(graphdef, fsdp.gathered(state), rngs)


def _remat_policy(remat: str, gathering: bool):
  """The block's rematerialisation policy: REMAT_POLICIES[remat], or under "none" with the
  parameters cut over fsdp (`gathering`) every activation but _RECOMPUTED_UNDER_FSDP's. The
  other policies keep no gathered parameter already."""
  if remat != "none" or not gathering:
    return REMAT_POLICIES[remat]
  return lambda primitive, *_, **__: primitive.name not in _RECOMPUTED_UNDER_FSDP


def _rematerialised(block: Block, policy, x, mask, context, context_mask, packing=None, *,
                    deterministic: bool):
  """`block(...)` that keeps only what `policy` saves and recomputes the rest in the backward pass.

  jax.checkpoint alone marks what to recompute, but XLA:CPU drops the barriers that keep the
  recomputation apart and merges it back into the forward pass (common-subexpression
  elimination), so every activation is kept. Here the forward and the backward each run inside
  a `lax.cond` whose two branches are the same (_in_branch): XLA never merges across
  computations, so the recomputation stays in the backward pass on every backend, and it moves
  no work out of one, so a block's parameter gathers (fsdp: every block runs here, whatever
  its remat) stay where the block runs instead of all at the program's start. The block runs
  as a pure function of its state's values (parameters and RNG counters); the recomputation
  replays the same RNG keys, so dropout masks are the same. Only the variables the block wrote
  (dropout's RNG counters in training) are written back, as a call without remat would: a
  model merged from `nnx.split` inside plain `jax.grad` holds RNG state of an outer trace,
  which must not be written when nothing drew from it.
  """
  graphdef, state = nnx.split(block)
  # the state's leaves: Variables, and plain arrays a layer holds as constants (RetNet's decays)
  variables_of = lambda state: [leaf for _, leaf in nnx.to_flat_state(state)]
  value_of = lambda leaf: leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf

  def pure(state, x, mask, context, context_mask, packing):
    values = [value_of(leaf) for leaf in variables_of(state)]
    block = nnx.merge(graphdef, state)
    out = _gathered(block)(x, mask, context=context, context_mask=context_mask,
                           deterministic=deterministic, packing=packing)
    # each variable's new value, None where the block left it as it was (the same traced value)
    written = [None if value_of(leaf) is value else value_of(leaf)
               for leaf, value in zip(variables_of(nnx.state(block)), values, strict=True)]
    return out, written

  recomputed = jax.checkpoint(pure, policy=policy)

  @jax.custom_vjp
  def run(*args):   # without differentiation (evaluation)
    return _in_branch(pure, args[1], *args)

  def forward(*args):   # (outputs, pullback holding what policy saved)
    return _in_branch(lambda *args: jax.vjp(recomputed, *args), args[1], *args)

  def backward(pullback, cotangents):
    return _in_branch(lambda p, c: p(c), cotangents[0], pullback, cotangents)

  run.defvjp(forward, backward)
  # Forward-mode autodiff, which a custom_vjp refuses, saves nothing for a backward: plain block.
  call = pure if autodiff_modes()[:1] == ("forward",) else run
  out, written = call(state, x, mask, context, context_mask, packing)
  for variable, value in zip(variables_of(state), written, strict=True):
    if value is not None:
      variable.set_value(value)
  return out


def _in_branch(fn, key, *args):
  """fn(*args) run inside a `lax.cond` whose two branches are fn, on a predicate XLA cannot
  fold (read from the array `key`): XLA neither merges the work inside with work outside
  (common subexpressions) nor moves it out (e.g. every block's parameter gathers to the
  program's start)."""
  structure = []

  def branch(*args):
    leaves, treedef = jax.tree.flatten(fn(*args))
    structure.append(treedef)
    return leaves
  leaves = jax.lax.cond(jnp.isnan(key.ravel()[0]), branch, branch, *args)
  return jax.tree.unflatten(structure[0], leaves)


class Encoder(Stack):
  def __init__(self, config: TransformerConfig, *, cls_token: bool = False, rngs: nnx.Rngs):
    super().__init__(config, causal=False, cls_token=cls_token, rngs=rngs)


class Decoder(Stack):
  def __init__(self, config: TransformerConfig, *, cross: bool = False, rngs: nnx.Rngs):
    super().__init__(config, causal=True, cross=cross, rngs=rngs)


class ClassifierHead(nnx.Module):
  """LRA's head: Dense(mlp_dim) -> ReLU -> Dense(num_classes)."""

  def __init__(self, in_dim: int, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(in_dim, config.mlp_dim, rngs=rngs)
    self.out = nnx.Linear(config.mlp_dim, config.num_classes, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x.astype(jnp.float32))))


def pool(hidden, mask, pooling: str, padded_length: int):
  """[b, n, emb] -> [b, emb] f32: the CLS position ("cls"), the mean over real tokens ("mean"),
  or the sum over real tokens divided by `padded_length` ("padded_mean": the released
  Nyströmformer LRA code padded every sequence to one length, zeroed padded outputs, then
  averaged all positions, so a row of c real tokens is scaled by c / padded_length). The
  classifiers pass their max_len, the length the harness pads to, so that a batch cut short
  of its padding (length buckets) pools as the padded one.

  In f32 whatever the compute dtype: a bf16 token count is already rounded above 256."""
  hidden = hidden.astype(jnp.float32)
  if pooling == "cls":
    return hidden[:, 0]
  weights = mask[..., None].astype(jnp.float32)
  count = padded_length if pooling == "padded_mean" else jnp.maximum(weights.sum(1), 1)
  return (hidden * weights).sum(1) / count


class Classifier(nnx.Module):
  """Sequence classification: tokens [b, n] (+ mask) -> logits [b, num_classes]."""

  head_inputs = 1   # pooled vectors the head reads

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.encoder = Encoder(config, cls_token=config.pooling == "cls", rngs=rngs)
    self.head = ClassifierHead(self.head_inputs * config.emb_dim, config, rngs=rngs)

  def encode(self, tokens, mask=None, *, deterministic=True):
    """Pooled representation [b, emb]."""
    hidden, mask = self.encoder(tokens, mask, deterministic=deterministic)
    return pool(hidden, mask, self.config.pooling, self.config.max_len)

  def _head(self, features):
    return _gathered(self.head)(features)

  def __call__(self, tokens, mask=None, *, deterministic=True):
    return self._head(self.encode(tokens, mask, deterministic=deterministic))


class DualEncoderClassifier(Classifier):
  """Two inputs through one shared tower (LRA Retrieval): pooled u, v -> interaction -> head."""

  @property
  def head_inputs(self):
    return 4 if self.config.interaction == "nli" else 2

  def __call__(self, tokens1, mask1, tokens2, mask2, *, deterministic=True):
    u = self.encode(tokens1, mask1, deterministic=deterministic)
    v = self.encode(tokens2, mask2, deterministic=deterministic)
    features = [u, v, u * v, u - v] if self.config.interaction == "nli" else [u, v]
    return self._head(jnp.concatenate(features, axis=-1))


class DecoderLM(nnx.Module):
  """Causal language model: tokens [b, n] -> next-token logits [b, n, vocab]."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.decoder = Decoder(config, rngs=rngs)
    self.lm_head = nnx.Linear(config.emb_dim, config.vocab_size, rngs=rngs)

  def __call__(self, tokens, mask=None, *, deterministic=True, segment_ids=None):
    """segment_ids: packed sequences (Stack); each token's logits see its own sequence only."""
    hidden, _ = self.decoder(tokens, mask, deterministic=deterministic, segment_ids=segment_ids)
    return _gathered(self.lm_head)(hidden.astype(jnp.float32))

  def init_cache(self, batch_size: int, max_len: int):
    """Empty caches for `decode_step`, one token at a time up to `max_len` positions."""
    self.decoder.init_cache(batch_size, max_len)

  def decode_step(self, token):
    """One token [b, 1] -> next-token logits [b, vocab]; needs `init_cache` first."""
    return self.lm_head(self.decoder.decode_step(token)[:, 0].astype(jnp.float32))

  def generate(self, prompt, max_new_tokens: int, *, temperature: float = 0.0, rng=None,
               use_cache=None):
    """Greedy (temperature 0) or sampled continuation of `prompt` [b, p] -> tokens [b, p + new].

    With the cache (default when the attention can decode) each step feeds one token;
    without it, each step recomputes the whole prefix (`use_cache=False`).
    """
    return _generate(self, prompt, max_new_tokens, temperature=temperature, rng=rng,
                     use_cache=use_cache, start=self.init_cache,
                     step=_lm_decode_step, forward=_lm_forward)


class BottleneckLM(nnx.Module):
  """A causal decoder read out through its last position only (MAD's compression task): the
  last real position's hidden state h [b, emb] must hold the whole sequence, and an MLP
  reconstructs token i from h + sinusoidal(i):

      logits_i = W_out LN(gelu(W_2 LN(gelu(W_1 LN(h + p_i)))))      # [b, n, vocab]

  Every position's logits see the sequence only through h, so a mixer scores by how much of
  the sequence one state holds."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.decoder = Decoder(config, rngs=rngs)
    dim = config.emb_dim
    self.norms = nnx.List([nnx.LayerNorm(dim, rngs=rngs) for _ in range(3)])
    self.hidden = nnx.List([nnx.Linear(dim, dim, rngs=rngs) for _ in range(2)])
    self.lm_head = nnx.Linear(dim, config.vocab_size, rngs=rngs)

  def __call__(self, tokens, mask=None, *, deterministic=True):
    hidden, mask = self.decoder(tokens, mask, deterministic=deterministic)
    last = jnp.maximum(mask.sum(axis=1) - 1, 0)                                     # [b]
    state = jnp.take_along_axis(hidden.astype(jnp.float32), last[:, None, None], 1)  # [b, 1, emb]
    x = state + positions.sinusoidal(jnp.arange(tokens.shape[1]), self.config.emb_dim)
    norms, hidden = _gathered(self.norms), _gathered(self.hidden)
    for norm, linear in zip(norms[:2], hidden):                                     # [b, n, emb]
      x = nnx.gelu(linear(norm(x)))
    return _gathered(self.lm_head)(norms[2](x))                                     # [b, n, vocab]


class EncoderDecoder(nnx.Module):
  """Encoder over the source, causal decoder with cross-attention to it:
  logits [b, tgt_len, vocab]."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.encoder = Encoder(config, rngs=rngs)
    self.decoder = Decoder(config, cross=True, rngs=rngs)
    self.lm_head = nnx.Linear(config.emb_dim, config.vocab_size, rngs=rngs)

  def __call__(self, source, target, source_mask=None, target_mask=None, *, deterministic=True):
    memory, source_mask = self.encoder(source, source_mask, deterministic=deterministic)
    hidden, _ = self.decoder(target, target_mask, context=memory, context_mask=source_mask,
                             deterministic=deterministic)
    return _gathered(self.lm_head)(hidden.astype(jnp.float32))

  def generate(self, source, prompt, max_new_tokens: int, *, source_mask=None,
               temperature: float = 0.0, rng=None, use_cache=None):
    """Continues the target `prompt` [b, p] (e.g. a BOS token) given `source` [b, s]."""
    memory, source_mask = self.encoder(source, source_mask)

    def start(b, total):
      self.decoder.init_cache(b, total)

    return _generate(self, prompt, max_new_tokens, temperature=temperature, rng=rng,
                     use_cache=use_cache, start=start,
                     step=lambda m, tok: _seq2seq_decode_step(m, tok, memory, source_mask),
                     forward=lambda m, tokens: _seq2seq_forward(m, source, tokens, source_mask))


@nnx.jit
def _lm_decode_step(model, token):
  return model.decode_step(token)


@nnx.jit
def _lm_forward(model, tokens):
  return model(tokens)


@nnx.jit
def _seq2seq_decode_step(model, token, memory, source_mask):
  hidden = model.decoder.decode_step(token, context=memory, context_mask=source_mask)
  return model.lm_head(hidden[:, 0].astype(jnp.float32))


@nnx.jit
def _seq2seq_forward(model, source, tokens, source_mask):
  return model(source, tokens, source_mask)


def _generate(model, prompt, max_new_tokens, *, temperature, rng, use_cache, start, step, forward):
  config = model.config
  prompt = jnp.asarray(prompt, jnp.int32)
  b, p = prompt.shape
  total = p + max_new_tokens
  if p < 1 or total > config.max_len:
    raise ValueError(f"prompt length {p} + max_new_tokens {max_new_tokens} must be in "
                     f"[1, max_len={config.max_len}]")
  can_decode = registry.spec(config.attention).can_decode
  use_cache = can_decode if use_cache is None else use_cache
  if use_cache and not can_decode:
    raise ValueError(f"attention {config.attention!r} cannot decode with a cache "
                     "(spec.can_decode is False); use use_cache=False to recompute the prefix at "
                     "each step")
  if temperature > 0 and rng is None:
    raise ValueError("sampling with temperature > 0 needs rng")

  def pick(logits, t):
    if temperature == 0:
      return jnp.argmax(logits, axis=-1)
    return jax.random.categorical(jax.random.fold_in(rng, t), logits / temperature)

  tokens = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompt)
  if use_cache:
    start(b, total)
    for t in range(total - 1):
      logits = step(model, tokens[:, t:t + 1])
      if t + 1 >= p:
        tokens = tokens.at[:, t + 1].set(pick(logits, t))
  else:
    # causal: logits at t ignore later positions, so one fixed-shape forward serves every step
    for t in range(p - 1, total - 1):
      tokens = tokens.at[:, t + 1].set(pick(forward(model, tokens)[:, t], t))
  return tokens


def num_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
