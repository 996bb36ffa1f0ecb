r"""PaTH attention (Yang et al. 2025, "PaTH Attention: Position Encoding via Accumulating
Householder Transformations", arXiv:2505.16381): causal softmax attention whose positions are
the product of data-dependent Householder-like transforms between query and key (no RoPE).

    w_t = L2norm(SiLU(conv(W_w x)_t)) per K/V head,   β_t = 2 σ(w_βᵀ x_t + b_β) in (0, 2)
    H_t = I − β_t w_t w_tᵀ,    s_ij = d^{-1/2} q_iᵀ H_i ⋯ H_{j+1} k_j,
    o_i = Σ_{j<=i} softmax_j(s_ij) v_j

A mixer, not an attention variant: w and β come from the layer input x, which a variant (given
q, k, v) does not see; deriving w from k instead would tie the position transform to the key's
content and is not the paper's model. The layer as flash-linear-attention defines it
(fla/layers/path_attn.py): q, k, v linear projections (no bias); w_proj low-rank (x → 32 → kvh·d)
when num_kv_heads == num_heads, a full linear map under GQA; a short convolution (kernel 3) on
w, then L2 norm per head; β per K/V head with bias; optionally an RMSNorm on q and k (qk_norm)
and PaTH-FoX's forget gate (use_forget_gate: log f_t = log σ(w_fᵀ x_t + b_f) per head, adding
c_i − c_j, c = cumsum(log f), to the scores); the output projection. Computed by
`attention_zoo.ops.path_attention` (the blockwise UT-transform form, memory linear in n, time
quadratic). Decoding keeps every key already transformed by the transforms since it; each new
token multiplies all cached keys by its H_t (O(n·d) per step and K/V head) and attends densely
over the cache (with the gate, as FoX decodes, over a cache of log f too).

Where ours differs: head_dim = qkv_dim / num_heads (the model's); qk_norm is an RMSNorm per head
(fla: over all heads' channels together); the convolution has a bias (fla's none); the forget
gate's bias starts at 0 (f ≈ 0.5; fla: torch's default); packed sequences by segment ids (fla:
cu_seqlens).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo import norms
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.convolution import ShortConv
from attention_zoo.mixers import parts
from attention_zoo.ops.path_attention import DEFAULT_BLOCK_SIZE, path_attention, path_decode_step
from attention_zoo.options import Bool, Float, Int

# fla's rank of the low-rank w projection (full heads; under GQA w_proj is a full linear map).
W_RANK = 32


@register_mixer("path", complexity="O(n²·d) time, O(n·(C + d)) memory",
                paper="Yang et al. 2025, PaTH Attention: Position Encoding via Accumulating "
                      "Householder Transformations (arXiv:2505.16381)",
                supports_segment_ids=True)
class PaTH(Mixer):
  OPTIONS = {"qk_norm": Bool(False), "use_forget_gate": Bool(False), "use_w_shortconv": Bool(True),
             "conv_size": Int(3, minimum=1), "block_size": Int(DEFAULT_BLOCK_SIZE, minimum=1),
             "norm_eps": Float(1e-5, above=0)}
  # Blocks of 8 at the suite's length 20: several blocks and a partial last one.
  TEST_OPTIONS = dict(block_size=8, qk_norm=True, use_forget_gate=True)

  @classmethod
  def state_size(cls, *, num_heads, num_kv_heads, head_dim, seq_len, options, **dims) -> int:
    """The cache: the transformed keys and the values per K/V head (with the forget gate log f
    per head), for every token."""
    gates = num_heads if options["use_forget_gate"] else 0
    return seq_len * (2 * num_kv_heads * head_dim + gates)

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    h, kvh, d, emb, dtype = (self.num_heads, self.num_kv_heads, self.head_dim, self.emb_dim,
                             self.dtype)
    linear = lambda i, o, bias=False: parts.linear(i, o, dtype=dtype, rngs=rngs, bias=bias)
    self.qkv = linear(emb, (h + 2 * kvh) * d)                  # q | k | v
    self.w_proj = (parts.low_rank(emb, W_RANK, kvh * d, dtype=dtype, rngs=rngs) if h == kvh
                   else linear(emb, kvh * d))
    if self.options["use_w_shortconv"]:
      self.conv = ShortConv(kvh * d, self.options["conv_size"], dtype=dtype, rngs=rngs)
    self.beta_proj = linear(emb, kvh, bias=True)
    self.forget_proj = linear(emb, h, bias=True) if self.options["use_forget_gate"] else None
    norm = lambda: norms.GatedRMSNorm(d, eps=self.options["norm_eps"])
    self.q_norm, self.k_norm = (norm(), norm()) if self.options["qk_norm"] else (None, None)
    self.out = linear(h * d, emb)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
    q, k, v = parts.softmax_mixer_qkv(self, x)
    w = parts.short_conv(self.conv, self.w_proj(x), mask, decode=state is not None,
                         segment_ids=segment_ids)
    w = norms.l2_normalise(w.reshape(b, n, kvh, d))                             # [b, n, kvh, d]
    beta = 2 * jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))            # [b, n, kvh]
    log_f = (None if self.forget_proj is None
             else jax.nn.log_sigmoid(self.forget_proj(x).astype(jnp.float32)))    # [b, n, h]
    if state is None:
      o = path_attention(q, k, v, w, beta, log_f=log_f, mask=mask, segment_ids=segment_ids,
                         block_size=self.options["block_size"])
    else:
      o, state = self._decode(q, k, v, w, beta, log_f, mask, state)
    return self.out(o.reshape(b, n, h * d).astype(self.dtype)), state

  def _decode(self, q, k, v, w, beta, log_f, mask, cache):
    """The n new tokens one at a time (`path_decode_step`): each transforms the cached keys,
    is written at the cache's index and attends over the cache."""
    def step(cache, token):
      q_t, k_t, v_t, w_t, beta_t, log_f_t, mask_t = token
      o_t, cache = path_decode_step(q_t, k_t, v_t, w_t, beta_t, cache, log_f=log_f_t,
                                    mask=mask_t)
      return cache, o_t

    tokens = tuple(None if x is None else jnp.moveaxis(x, 1, 0)
                   for x in (q, k, v, w, beta, log_f, mask))
    cache, o = jax.lax.scan(step, cache, tokens)
    return jnp.moveaxis(o, 0, 1), cache                                         # [b, n, h, d]

  def empty_state(self, batch_size, max_len, dtype):
    kv_shape = (batch_size, max_len, self.num_kv_heads, self.head_dim)
    state = {"key": jnp.zeros(kv_shape, jnp.float32), "value": jnp.zeros(kv_shape, dtype),
             "filled": jnp.zeros((batch_size, max_len), bool), "index": jnp.zeros((), jnp.int32)}
    if self.forget_proj is not None:
      state["log_f"] = jnp.zeros((batch_size, max_len, self.num_heads), jnp.float32)
    return state
