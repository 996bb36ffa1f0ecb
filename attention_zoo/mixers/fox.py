r"""FoX, the Forgetting Transformer's attention (Lin et al. 2025, arXiv:2503.02130): causal
softmax attention whose scores decay by a data-dependent forget gate per head.

    f_t = σ(w_fᵀ x_t + b_f),   c_t = Σ_{l <= t} log f_l,
    o_i = Σ_{j <= i} softmax_j(d^{-1/2} q_iᵀ k_j + c_i - c_j) v_j

The layer as flash-linear-attention defines it (fla/layers/forgetting_attn.py): q, k, v linear
projections (no bias), the forget gate f_proj [d, heads] with bias, optionally an RMSNorm per
head on q and k (qk_norm) and a sigmoid output gate o ⊙ σ(W_g x) (use_output_gate), both off by
default, and the output projection; no RoPE. Computed by `attention_zoo.ops.forgetting_attention`
(attention_zoo.ops.flex with the gate as a score_mod: memory linear in n, time quadratic). Decoding
keeps a cache of k, v and log f for every token (its state grows with the length), and each
step attends densely over it (`forgetting_attention_step`).

Where ours differs: head_dim = qkv_dim / num_heads (the model's); the gate's bias starts at 0
(f ≈ 0.5 at init: fla leaves torch's default uniform init); fla's sliding window_size is not
built.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo import norms, ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.mixers import parts
from attention_zoo.ops import ring
from attention_zoo.ops.context import context_size
from attention_zoo.options import Bool, Float, Int


@register_mixer("fox", complexity="O(n²) time, O(n) memory",
                paper="Lin et al. 2025, Forgetting Transformer: Softmax Attention with a Forget "
                      "Gate (arXiv:2503.02130)",
                supports_segment_ids=True, supports_context_parallel=True)
class FoX(Mixer):
  OPTIONS = {"qk_norm": Bool(False), "use_output_gate": Bool(False),
             "block_size": Int(None, minimum=1, optional=True), "norm_eps": Float(1e-5, above=0)}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(block_size=8, qk_norm=True, use_output_gate=True)

  @classmethod
  def state_size(cls, *, num_heads, num_kv_heads, head_dim, seq_len, **dims) -> int:
    """The cache: k and v per kv head, log f per head, for every token."""
    return seq_len * (2 * num_kv_heads * head_dim + num_heads)

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    h, kvh, d, emb, dtype = (self.num_heads, self.num_kv_heads, self.head_dim, self.emb_dim,
                             self.dtype)
    linear = lambda i, o, bias=False: parts.linear(i, o, dtype=dtype, rngs=rngs, bias=bias)
    self.qkv = linear(emb, (h + 2 * kvh) * d)                  # q | k | v
    self.forget_proj = linear(emb, h, bias=True)
    norm = lambda: norms.GatedRMSNorm(d, eps=self.options["norm_eps"])
    self.q_norm, self.k_norm = (norm(), norm()) if self.options["qk_norm"] else (None, None)
    self.gate_proj = linear(emb, h * d) if self.options["use_output_gate"] else None
    self.out = linear(h * d, emb)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, d = self.num_heads, self.head_dim
    q, k, v = parts.softmax_mixer_qkv(self, x)
    log_f = jax.nn.log_sigmoid(self.forget_proj(x).astype(jnp.float32))         # [b, n, h]
    if state is None:
      attention = ring.forgetting_attention_ring if context_size() > 1 else ops.forgetting_attention
      o = attention(q, k, v, log_f, mask=mask, segment_ids=segment_ids,
                    block_size=self.options["block_size"])                      # [b, n, h, d]
    else:
      o, state = self._decode(q, k, v, log_f, mask, state)
    if self.gate_proj is not None:
      o = o * jax.nn.sigmoid(self.gate_proj(x).reshape(b, n, h, d))
    return self.out(o.reshape(b, n, h * d).astype(self.dtype)), state

  def _decode(self, q, k, v, log_f, mask, cache):
    """Writes the n new tokens into the cache at `index`, then attends: one token by the dense
    step, several (a prefill) by the parallel op over the whole cache (queries elsewhere 0)."""
    n, index = q.shape[1], cache["index"]
    write = lambda buffer, new: jax.lax.dynamic_update_slice_in_dim(
        buffer, new.astype(buffer.dtype), index, axis=1)
    cache = {"key": write(cache["key"], k), "value": write(cache["value"], v),
             "log_f": write(cache["log_f"], log_f), "filled": write(cache["filled"], mask),
             "index": index + n}
    if n == 1:
      o = ops.forgetting_attention_step(q[:, 0], cache["key"], cache["value"], cache["log_f"],
                                        cache["filled"])[:, None]              # [b, 1, h, d]
    else:
      queries = write(jnp.zeros(cache["key"].shape[:2] + q.shape[2:], q.dtype), q)
      o = ops.forgetting_attention(queries, cache["key"], cache["value"], cache["log_f"],
                                   mask=cache["filled"], block_size=self.options["block_size"])
      o = jax.lax.dynamic_slice_in_dim(o, index, n, axis=1)                    # [b, n, h, d]
    return o, cache

  def empty_state(self, batch_size, max_len, dtype):
    kv_shape = (batch_size, max_len, self.num_kv_heads, self.head_dim)
    return {"key": jnp.zeros(kv_shape, dtype), "value": jnp.zeros(kv_shape, dtype),
            "log_f": jnp.zeros((batch_size, max_len, self.num_heads), jnp.float32),
            "filled": jnp.zeros((batch_size, max_len), bool), "index": jnp.zeros((), jnp.int32)}
