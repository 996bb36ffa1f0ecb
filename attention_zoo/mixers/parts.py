"""Pieces the sequence mixers share: projections (full and low-rank, the output gate's), the
short convolution on masked inputs, the gated output (norms.GatedRMSNorm), the delta rule's
q, k, v and β, Mamba2's decay gate (also Gated DeltaNet's, and per key channel KDA's), GQA head
repetition, and the choice between an op's chunk and token forms.

Each mixer builds its own submodules in its `__init__` (these functions return modules; none
sets an attribute on the mixer), so a mixer's file lists every parameter it has."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo.convolution import ShortConv
from attention_zoo.norms import GatedRMSNorm, l2_normalise
from attention_zoo.options import Bool, Float, Int


def linear_attention_options(*, expand_k: float, expand_v: float, **own) -> dict:
  """The options the gated linear-attention layers (GLA, RetNet) share: key and value widths
  per head, the short convolution, the output gate, the chunk size, the output norm's ε; `own`
  adds the layer's own."""
  return {"expand_k": Float(expand_k, above=0), "expand_v": Float(expand_v, above=0),
          "use_short_conv": Bool(False), "conv_size": Int(4, minimum=1),
          "use_output_gate": Bool(True), "chunk_size": Int(64, minimum=1),
          "norm_eps": Float(1e-5, above=0), **own}


def linear(in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, bias: bool = False):
  """A projection (the authors' are bias-free unless said otherwise); parameters float32."""
  return nnx.Linear(in_features, out_features, use_bias=bias, dtype=dtype, rngs=rngs)


def low_rank(in_features: int, rank: int, out_features: int, *, dtype, rngs: nnx.Rngs,
             bias: bool = False, activation=None):
  """x -> act(x W_down) W_up, W_down [in, rank] bias-free, W_up [rank, out] (bias: on W_up);
  act none, or a function between the two (RWKV-7's tanh and sigmoid)."""
  return nnx.Sequential(linear(in_features, rank, dtype=dtype, rngs=rngs),
                        *([activation] if activation else []),
                        linear(rank, out_features, dtype=dtype, rngs=rngs, bias=bias))


def expanded_dims(head_dim: int, options: dict) -> tuple[int, int]:
  """(d_k, d_v) per head: head_dim scaled by the options expand_k and expand_v (1 if absent)."""
  return (int(head_dim * options.get("expand_k", 1.0)),
          int(head_dim * options.get("expand_v", 1.0)))


def checked_dims(mixer) -> tuple[int, int]:
  """`expanded_dims` of a built mixer; its option error for a factor that leaves no channel."""
  dims = expanded_dims(mixer.head_dim, mixer.options)
  for option, dim in zip(("expand_k", "expand_v"), dims):
    if dim < 1:
      raise mixer.option_error(option, f"a value giving at least 1 channel per head "
                                       f"(head_dim {mixer.head_dim})")
  return dims


def key_value_state_size(cls, *, num_heads: int, head_dim: int, options: dict, **dims) -> int:
  """Mixer.state_size of a state S [d_k, d_v] per head: num_heads · d_k · d_v."""
  d_k, d_v = expanded_dims(head_dim, options)
  return num_heads * d_k * d_v


def qkv_projection(emb_dim: int, channels: int, options: dict, *, dtype, rngs: nnx.Rngs):
  """(qkv, conv): the projection x -> `channels` (q | k | v, as the caller splits them) and a
  ShortConv over them (kernel: the option conv_size) when the option use_short_conv is on, else
  None (`short_conv` then passes its input through). The mixer keeps them as self.qkv and
  self.conv (the name the contract prepares a decode cache for)."""
  qkv = linear(emb_dim, channels, dtype=dtype, rngs=rngs)
  if not options["use_short_conv"]:
    return qkv, None
  return qkv, ShortConv(channels, options["conv_size"], dtype=dtype, rngs=rngs)


def gated_output_layers(emb_dim: int, num_heads: int, d_v: int, *, eps: float, dtype,
                        rngs: nnx.Rngs, use_gate: bool, gate_rank: int | None = None,
                        activation: str = "silu"):
  """(gate_proj, norm, out) for `gated_output`: gate_proj x -> the per-head gate's logits
  [h·d_v] (W_g x; with gate_rank the low-rank W_up W_down x + b, KDA's; None without a gate),
  norm an RMSNorm per head over d_v times activation(gate), out h·d_v -> emb."""
  if not use_gate:
    gate_proj = None
  elif gate_rank is None:
    gate_proj = linear(emb_dim, num_heads * d_v, dtype=dtype, rngs=rngs)
  else:
    gate_proj = low_rank(emb_dim, gate_rank, num_heads * d_v, dtype=dtype, rngs=rngs, bias=True)
  return (gate_proj, GatedRMSNorm(d_v, eps=eps, activation=activation),
          linear(num_heads * d_v, emb_dim, dtype=dtype, rngs=rngs))


def gated_output(mixer, x, o):
  """o [b, n, h, d_v] -> out(norm(o, gate_proj x)) [b, n, emb], by the mixer's gate_proj (None:
  no gate), norm and out (`gated_output_layers`)."""
  b, n, h, d_v = o.shape
  gate = None if mixer.gate_proj is None else mixer.gate_proj(x).reshape(b, n, h, d_v)
  y = mixer.norm(o, gate)                                                        # [b, n, h, dv]
  return mixer.out(y.reshape(b, n, h * d_v).astype(mixer.dtype))


def softmax_mixer_qkv(mixer, x):
  """q [b, n, h, d], k and v [b, n, kvh, d] from the fused projection `mixer.qkv` (q | k | v), q
  and k through `mixer.q_norm` / `mixer.k_norm` when the mixer has them (the softmax mixers:
  FoX, PaTH)."""
  b, n, _ = x.shape
  h, kvh, d = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
  q, k, v = jnp.split(mixer.qkv(x), [h * d, (h + kvh) * d], axis=-1)
  q, k, v = q.reshape(b, n, h, d), k.reshape(b, n, kvh, d), v.reshape(b, n, kvh, d)
  if mixer.q_norm is not None:
    q, k = mixer.q_norm(q).astype(v.dtype), mixer.k_norm(k).astype(v.dtype)
  return q, k, v


def short_conv(conv, x, mask, decode: bool, segment_ids=None):
  """SiLU(conv(x)) with masked tokens entering as zeros (so the convolution never sees a padded
  token's content), or x unchanged when conv is None. x [b, n, c], mask bool [b, n];
  segment_ids int [b, n] or None (packed sequences: no tap crosses into another)."""
  if conv is None:
    return x
  return jax.nn.silu(conv(jnp.where(mask[..., None], x, 0), decode=decode,
                          segment_ids=segment_ids))


def delta_rule_inputs(mixer, x, mask, *, decode: bool, segment_ids=None, steps: int | None = None,
                      beta_per_key_channel: bool = False):
  """The delta rule's inputs from a mixer's qkv, conv and beta_proj, as flash-linear-attention's
  delta layers make them: q, k, v through the short convolution and SiLU (SiLU alone without
  it), q and k L2-normalised per head, k and v repeated to the query heads (GQA),
  β = σ(w_βᵀ x) (with the option allow_neg_eigval 2σ: in (0, 2), so that the eigenvalue 1 - β
  of I - β k kᵀ reaches down to -1). steps None: one (k, v, β) per token, k [b, n, h, d_k],
  v [b, n, h, d_v], β float32 [b, n, h]; steps s: s of them, with a step axis after n
  (Gated DeltaProduct's). beta_per_key_channel: β [b, n, h, d_k] (Gated DeltaNet-2's erase
  gate; one step). q [b, n, h, d_k]."""
  b, n, _ = x.shape
  h, kvh, d_k, d_v, s = mixer.num_heads, mixer.num_kv_heads, mixer.d_k, mixer.d_v, steps or 1
  qkv = short_conv(mixer.conv, mixer.qkv(x), mask, decode=decode, segment_ids=segment_ids)
  if mixer.conv is None:
    qkv = jax.nn.silu(qkv)                               # fla: SiLU with or without the conv
  q, k, v = jnp.split(qkv, [h * d_k, h * d_k + s * kvh * d_k], axis=-1)
  q = l2_normalise(q.reshape(b, n, h, d_k))                                      # [b, n, h, dk]
  k = repeat_kv(l2_normalise(k.reshape(b, n, s, kvh, d_k)), h)                  # [b, n, s, h, dk]
  v = repeat_kv(v.reshape(b, n, s, kvh, d_v), h)                                # [b, n, s, h, dv]
  beta = jax.nn.sigmoid(mixer.beta_proj(x).astype(jnp.float32)).reshape(
      b, n, s, h, *((d_k,) if beta_per_key_channel else ()))
  if mixer.options["allow_neg_eigval"]:
    beta = 2 * beta                                      # in (0, 2): eigenvalues 1 - β down to -1
  if steps is None:
    return q, k[:, :, 0], v[:, :, 0], beta[:, :, 0]
  return q, k, v, beta


def repeat_kv(x, num_heads: int):
  """[..., kvh, d] -> [..., num_heads, d]: query head i reads kv head i // (num_heads / kvh)."""
  return jnp.repeat(x, num_heads // x.shape[-2], axis=-2)


def dt_bias_init(key, shape, dtype=jnp.float32, *, dt_range=(1e-3, 0.1), dt_floor=1e-4):
  """softplus⁻¹(dt), dt log-uniform in dt_range and floored at dt_floor: the bias whose
  softplus is the step Δ at init (Mamba's dt_proj bias, Mamba2's dt_bias; the authors')."""
  log_dt = jax.random.uniform(key, shape, minval=jnp.log(dt_range[0]),
                              maxval=jnp.log(dt_range[1]))
  dt = jnp.maximum(jnp.exp(log_dt), dt_floor)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class DecayGate(nnx.Module):
  """Mamba2's data-dependent decay, also Gated DeltaNet's (Dao & Gu 2024; Yang et al. 2024):

      Δ_t = softplus(a_t + dt_bias),   g_t = log α_t = -exp(A_log) · Δ_t      per head

  A_log = log A with A ~ U(a_range) (Mamba2 (1, 16), GDN (0, 16)); dt_bias = softplus⁻¹(dt) with
  dt log-uniform in [1e-3, 0.1], floored at 1e-4 (the authors'). At init α = exp(-A·Δ) lies
  between about 0.2 and 0.999: most heads remember for tens to hundreds of tokens. Both carry
  `weight_decay=False`, which the harness's optimiser honours (as the authors' code does).
  With key_dim (KDA's gate, fla's initialisation of it) a and dt_bias hold one value per key
  channel [h, d_k] and A one per head, so each channel of the state decays at its own rate.
  """

  def __init__(self, num_heads: int, *, a_range: tuple[float, float], rngs: nnx.Rngs,
               key_dim: int | None = None, dt_range: tuple[float, float] = (1e-3, 0.1),
               dt_floor: float = 1e-4):
    key_a, key_dt = jax.random.split(rngs.params())
    # A > 0 (floored at 1e-4 when the range starts at 0, so that log A is finite)
    a = jnp.maximum(jax.random.uniform(key_a, (num_heads,), minval=a_range[0],
                                       maxval=a_range[1]), 1e-4)
    shape = (num_heads,) if key_dim is None else (num_heads, key_dim)
    # Excluded from weight decay, as the authors train them: decay would pull A_log and dt_bias
    # towards 0, that is towards α = exp(-softplus(0)) = 0.5, a memory of about one token.
    self.A_log = nnx.Param(jnp.log(a), weight_decay=False)
    self.dt_bias = nnx.Param(dt_bias_init(key_dt, shape, dt_range=dt_range, dt_floor=dt_floor),
                             weight_decay=False)

  def __call__(self, a):
    """a [b, n, h] (with key_dim [b, n, h, d_k]) -> (Δ, g), both of a's shape, float32."""
    delta = jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias[...])
    rate = jnp.exp(self.A_log[...])                                              # A [h]
    return delta, -rate.reshape(rate.shape + (1,) * (self.dt_bias.ndim - 1)) * delta


def recurrence(chunk_op, step_op, *inputs, mask, state, chunk_size: int | None, scale=None,
               segment_ids=None):
  """One of the ops in `attention_zoo.ops`: the whole sequence by chunks from the empty state
  (state None), or in decoding from the carried state: one token by the token form, several (a
  prefill) by chunks; chunk_size None: always the token form. segment_ids: packed sequences
  (whole sequences only). -> (o [b, n, h, dv], final state float32 [b, h, dk, dv])."""
  if chunk_size is None or (state is not None and inputs[0].shape[1] == 1):
    return step_op(*inputs, scale=scale, initial_state=state, mask=mask, segment_ids=segment_ids)
  return chunk_op(*inputs, scale=scale, initial_state=state, mask=mask, chunk_size=chunk_size,
                  segment_ids=segment_ids)
