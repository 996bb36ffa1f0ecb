r"""DeltaNet (Schlag et al. 2021; parallelised by Yang et al. 2024, arXiv:2406.06484).

Each token replaces the value stored under its key instead of adding to it (the delta rule):

    S_t = S_{t-1} + β_t k_t (v_t - S_{t-1}ᵀ k_t)ᵀ = (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ
    o_t = S_tᵀ (d_k^{-1/2} q_t)                                   S_t [d_k, d_v] per head

The layer as flash-linear-attention defines it (fla/layers/delta_net.py): q, k, v linear
projections, each through a causal depthwise convolution (kernel 4) and SiLU; q and k
L2-normalised (so I - β k kᵀ has eigenvalues 1 - β and 1: stable, and with β = 1 an exact
overwrite); β_t = σ(w_βᵀ x_t) per head (with allow_neg_eigval 2σ(·) in (0, 2), so the
eigenvalue 1 - β reaches down to -1: Grazzi et al. 2024, arXiv:2411.12537); the output per head
RMS-normalised (with use_gate, gated by SiLU(W_g x)), then projected back. Computed by the
chunkwise WY form (`attention_zoo.ops.chunk_delta_rule`), decoded token by token.

Where ours differs: head dimensions come from the model's (d_k = expand_k · qkv_dim / heads,
d_v = expand_v · qkv_dim / heads; fla: expand · hidden / heads, the same with qkv_dim = emb_dim);
q, k and v share one projection and one depthwise convolution over their concatenated channels
(equal to three, as the convolution is per channel); the convolution has a bias (fla's none);
num_kv_heads < num_heads shares k, v between query heads (GQA), β stays per query head.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_zoo import norms, ops
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.mixers import parts
from attention_zoo.options import Bool, Float, Int

DELTA_OPTIONS = {"expand_v": Float(1.0, above=0), "use_gate": Bool(False),
                 "use_short_conv": Bool(True), "conv_size": Int(4, minimum=1),
                 "allow_neg_eigval": Bool(False), "chunk_size": Int(64, minimum=1),
                 "norm_eps": Float(1e-5, above=0)}


@register_mixer("deltanet", complexity="O(n·C·d + n·d²)",
                paper="Yang et al. 2024, Parallelizing Linear Transformers with the Delta Rule "
                      "over Sequence Length (arXiv:2406.06484); Schlag et al. 2021",
                supports_segment_ids=True, supports_context_parallel=True)
class DeltaNet(Mixer):
  OPTIONS = {"expand_k": Float(1.0, above=0), **DELTA_OPTIONS}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8)
  # the chunk and token forms of the rule (Gated DeltaNet: the gated rule)
  CHUNK_OP, STEP_OP = staticmethod(ops.chunk_delta_rule), staticmethod(ops.recurrent_delta_rule)
  # whether the ops take k, v, β with a step axis [b, n, steps, h, ...] (Gated DeltaProduct)
  STEP_AXIS = False
  # the output gate: act(W_g x), act SiLU (KDA: σ of a low-rank projection of rank d_v)
  GATE_ACTIVATION, LOW_RANK_GATE = "silu", False

  state_size = classmethod(parts.key_value_state_size)

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    self.d_k, self.d_v = parts.checked_dims(self)
    self.steps = self.options.get("num_householder", 1)    # (k, v, β) per token
    parts.add_qkv(self, rngs, steps=self.steps)
    self.beta_proj = parts.linear(self.emb_dim, self.steps * self.num_heads, dtype=self.dtype,
                                  rngs=rngs)
    parts.add_gated_output(self, rngs, use_gate=self.options["use_gate"],
                           gate_rank=self.d_v if self.LOW_RANK_GATE else None,
                           activation=self.GATE_ACTIVATION)

  def log_decay(self, x):
    """g [b, n, h] float32 for the gated rule (KDA: [b, n, h, d_k]); None: no decay."""
    return None

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, kvh, d_k, d_v, s = self.num_heads, self.num_kv_heads, self.d_k, self.d_v, self.steps
    qkv = parts.short_conv(self.conv, self.qkv(x), mask, decode=state is not None,
                            segment_ids=segment_ids)
    if self.conv is None:
      qkv = jax.nn.silu(qkv)                           # fla: SiLU with or without the conv
    q, k, v = jnp.split(qkv, [h * d_k, h * d_k + s * kvh * d_k], axis=-1)
    q = norms.l2_normalise(q.reshape(b, n, h, d_k))                              # [b, n, h, dk]
    k = parts.repeat_kv(norms.l2_normalise(k.reshape(b, n, s, kvh, d_k)), h)     # [b, n, s, h, dk]
    v = parts.repeat_kv(v.reshape(b, n, s, kvh, d_v), h)                         # [b, n, s, h, dv]
    beta = jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32)).reshape(b, n, s, h)
    if self.options["allow_neg_eigval"]:
      beta = 2 * beta                                  # in (0, 2): eigenvalues 1 - β down to -1
    if not self.STEP_AXIS:                             # one (k, v, β) per token
      k, v, beta = k[:, :, 0], v[:, :, 0], beta[:, :, 0]
    g = self.log_decay(x)
    gates = () if g is None else (g,)
    o, state = parts.recurrence(self.CHUNK_OP, self.STEP_OP, q, k, v, *gates, beta, mask=mask,
                                state=state, chunk_size=self.options["chunk_size"],
                                segment_ids=segment_ids)
    return parts.gated_output(self, x, o), state

  def empty_state(self, batch_size, max_len, dtype):
    return jnp.zeros((batch_size, self.num_heads, self.d_k, self.d_v), jnp.float32)
