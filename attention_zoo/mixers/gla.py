r"""GLA, gated linear attention (Yang et al. 2023, arXiv:2312.06635): linear attention whose
state decays per key channel by a data-dependent gate.

    S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ,     o_t = S_tᵀ (d_k^{-1/2} q_t)      S_t [d_k, d_v]
    α_t = σ(x_t W_1 W_2 + b)^{1/τ},  i.e.  log α_t = logsigmoid(x_t W_1 W_2 + b) / τ,  τ = 16

The layer as flash-linear-attention defines it (fla/layers/gla.py): q, k, v linear projections
(d_k = expand_k · head dim = 1/2, d_v = expand_v · head dim = 1), optionally each through a
kernel-4 causal conv and SiLU (off by default); the low-rank gate W_1 [d, 16] (no bias),
W_2 [16, key_dim] (with bias), normalised by τ = 16, so at init α ≈ 0.5^{1/16} ≈ 0.96 (a memory
of tens of tokens); the output per head RMS-normalised times SiLU(W_g x), then projected
back. Chunkwise by `attention_zoo.ops.chunk_gla` (per-channel decays by halves,
every exponent <= 0).

Where ours differs: head dimensions come from the model's (fla: expand · hidden / heads, the
same with qkv_dim = emb_dim); q, k, v share one projection (and one convolution, which has a
bias, fla's none); no feature map and no clamp on the gate (fla's options, off by default).
num_kv_heads < num_heads shares k, v and the gate between query heads (GQA), as fla's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo import ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.mixers import parts
from attention_zoo.options import Float, Int


@register_mixer("gla", complexity="O(n·C·d + n·d²)",
                paper="Yang et al. 2023, Gated Linear Attention Transformers with "
                      "Hardware-Efficient Training (arXiv:2312.06635)",
                supports_segment_ids=True, supports_context_parallel=True)
class GLA(Mixer):
  OPTIONS = parts.linear_attention_options(
      expand_k=0.5, expand_v=1.0, gate_low_rank_dim=Int(16, minimum=1),
      gate_logit_normalizer=Float(16.0, above=0))
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8)
  state_size = classmethod(parts.key_value_state_size)

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    self.d_k, self.d_v = parts.checked_dims(self)
    h, kvh, d_k, d_v = self.num_heads, self.num_kv_heads, self.d_k, self.d_v
    emb, dtype, rank = self.emb_dim, self.dtype, self.options["gate_low_rank_dim"]
    self.qkv, self.conv = parts.qkv_projection(emb, h * d_k + kvh * (d_k + d_v), self.options,
                                               dtype=dtype, rngs=rngs)          # q | k | v
    # the forget gate's logits: W_up W_down x + b, low-rank
    self.gate_down = parts.linear(emb, rank, dtype=dtype, rngs=rngs)
    self.gate_up = parts.linear(rank, kvh * d_k, dtype=dtype, rngs=rngs, bias=True)
    self.gate_proj, self.norm, self.out = parts.gated_output_layers(
        emb, h, d_v, eps=self.options["norm_eps"], dtype=dtype, rngs=rngs,
        use_gate=self.options["use_output_gate"])                                # W_g: SiLU

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, kvh, d_k, d_v = self.num_heads, self.num_kv_heads, self.d_k, self.d_v
    qkv = parts.short_conv(self.conv, self.qkv(x), mask, decode=state is not None,
                            segment_ids=segment_ids)
    q, k, v = jnp.split(qkv, [h * d_k, (h + kvh) * d_k], axis=-1)
    q = q.reshape(b, n, h, d_k)                                                  # [b, n, h, dk]
    k = parts.repeat_kv(k.reshape(b, n, kvh, d_k), h)                            # [b, n, h, dk]
    v = parts.repeat_kv(v.reshape(b, n, kvh, d_v), h)                            # [b, n, h, dv]
    logits = self.gate_up(self.gate_down(x)).astype(jnp.promote_types(x.dtype, jnp.float32))
    g = jax.nn.log_sigmoid(logits) / self.options["gate_logit_normalizer"]
    g = parts.repeat_kv(g.reshape(b, n, kvh, d_k), h)                            # [b, n, h, dk]
    o, state = parts.recurrence(ops.chunk_gla, ops.recurrent_gla, q, k, v, g, mask=mask,
                                state=state, chunk_size=self.options["chunk_size"],
                                segment_ids=segment_ids)
    return parts.gated_output(self, x, o), state

  def empty_state(self, batch_size, max_len, dtype):
    return jnp.zeros((batch_size, self.num_heads, self.d_k, self.d_v), jnp.float32)
