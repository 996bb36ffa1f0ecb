r"""RetNet's multi-scale retention (Sun et al. 2023, arXiv:2307.08621): linear attention with a
fixed decay per head.

    S_t = γ_h S_{t-1} + k_t v_tᵀ,   o_t = S_tᵀ (d_k^{-1/2} q_t),   γ_h = 1 - 2^{-5-h}
    (parallel form: O = (Q Kᵀ d_k^{-1/2} ⊙ D) V with D_nm = γ^{n-m} for n >= m)

The layer as flash-linear-attention defines it (fla/layers/multiscale_retention.py): q, k, v
linear projections (d_k = expand_k · head dim = 1, d_v = expand_v · head dim = 2), RoPE on q
and k (the block adds no positions of its own), optionally a kernel-4 causal conv with SiLU
(off by default), the output per head RMS-normalised times SiLU(W_g x), then projected back.
Chunkwise by `attention_zoo.ops.chunk_simple_gla` with the constant log-decay log γ_h.

`decay_exponent` (5 in the paper) moves every head's decay: γ_h = 1 - 2^{-decay_exponent-h}.
With few heads the paper's decays are short (2 heads: 0.969 and 0.984, which keep 13% and 36% of
a token 64 steps on); a larger exponent lengthens them to measure what the decay costs.

Where ours differs: head dimensions come from the model's (fla: expand · hidden / heads);
q, k, v share one projection. The paper's xPos rotation, GroupNorm and two normalisations (of
the decay mask by its row sums, of the scores by max(|Σ|, 1)) are fla's RoPE and RMSNorm:
both normalisations multiply each head's output row by a positive scalar, which the per-head
norm removes (up to its eps). A masked token neither decays the state nor writes to it, while
RoPE counts every position: across a hole in the mask the decay covers the real tokens only.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attention_zoo import ops, positions
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.mixers import parts
from attention_zoo.ops.segments import positions_in_segments
from attention_zoo.options import Float


@register_mixer("retnet", complexity="O(n·C·d + n·d²)",
                paper="Sun et al. 2023, Retentive Network: A Successor to Transformer for Large "
                      "Language Models (arXiv:2307.08621)",
                supports_segment_ids=True, supports_context_parallel=True)
class RetNet(Mixer):
  OPTIONS = parts.linear_attention_options(expand_k=1.0, expand_v=2.0,
                                           decay_exponent=Float(5.0, above=0))
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8)
  state_size = classmethod(parts.key_value_state_size)

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    self.d_k, self.d_v = parts.checked_dims(self)
    if self.d_k % 2:
      raise self.option_error("expand_k", f"a value giving an even d_k for RoPE (got {self.d_k})")
    h, kvh, d_k, d_v = self.num_heads, self.num_kv_heads, self.d_k, self.d_v
    emb, dtype = self.emb_dim, self.dtype
    self.qkv, self.conv = parts.qkv_projection(emb, h * d_k + kvh * (d_k + d_v), self.options,
                                               dtype=dtype, rngs=rngs)          # q | k | v
    self.gate_proj, self.norm, self.out = parts.gated_output_layers(
        emb, h, d_v, eps=self.options["norm_eps"], dtype=dtype, rngs=rngs,
        use_gate=self.options["use_output_gate"])                                # W_g: SiLU
    exponents = self.options["decay_exponent"] + np.arange(self.num_heads)
    self.log_gamma = np.log1p(-2.0 ** -exponents)                                # [h], fixed

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, kvh, d_k, d_v = self.num_heads, self.num_kv_heads, self.d_k, self.d_v
    qkv = parts.short_conv(self.conv, self.qkv(x), mask, decode=state is not None,
                            segment_ids=segment_ids)
    q, k, v = jnp.split(qkv, [h * d_k, (h + kvh) * d_k], axis=-1)
    offset = 0 if state is None else state["position"]
    position_ids = (jnp.arange(n) + offset if segment_ids is None
                    else positions_in_segments(segment_ids))                     # [n] | [b, n]
    q = positions.rope(q.reshape(b, n, h, d_k), position_ids)                    # [b, n, h, dk]
    k = parts.repeat_kv(positions.rope(k.reshape(b, n, kvh, d_k), position_ids), h)
    v = parts.repeat_kv(v.reshape(b, n, kvh, d_v), h)                            # [b, n, h, dv]
    g = jnp.broadcast_to(jnp.asarray(self.log_gamma, jnp.promote_types(x.dtype, jnp.float32)),
                         (b, n, h))
    o, kv_state = parts.recurrence(ops.chunk_simple_gla, ops.recurrent_simple_gla, q, k, v, g,
                                   mask=mask, state=None if state is None else state["state"],
                                   chunk_size=self.options["chunk_size"],
                                   segment_ids=segment_ids)
    new_state = None if state is None else {"state": kv_state, "position": offset + n}
    return parts.gated_output(self, x, o), new_state

  def empty_state(self, batch_size, max_len, dtype):
    return {"state": jnp.zeros((batch_size, self.num_heads, self.d_k, self.d_v), jnp.float32),
            "position": jnp.zeros((), jnp.int32)}
