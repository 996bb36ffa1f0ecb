"""Synthesizer attention (Tay, Bahri, Metzler, Juan, Zhao & Zheng 2021): synthesized logits.

The attention logits over positions are produced without (only) token-token interaction:

    dense:              B_i = W_2 relu(W_1 q_i + b_1) + b_2   (a per-position MLP, B_i ∈ R^max_len)
    random:             B = R                                 (learned [max_len, max_len] per head)
    factorized_random:  B = R_1 R_2                           (R_1 [max_len, k], R_2 [k, max_len])

    Y = softmax(B[:n, :n]) V                                   (mix_dot_product=False)
    Y = softmax(α_1 B[:n, :n] + α_2 Q Kᵀ / sqrt(d)) V          (mix_dot_product=True)

with causal and padding masks applied to the logits before the softmax. The mixture weights
are the paper's learned α (Σ α = 1): α = softmax(a) over two learnable logits a, initialised
equal (α = 1/2 each), shared by the heads. `mixture="sum"` uses α = (1, 1) instead, a plain
sum with no parameter; without the dot product `mixture` has nothing to mix. Parameters are
sized by `max_len` and sliced to the input length, so self-attention only (the logits index
positions of one sequence). O(n²) time and memory by nature; `random` also holds O(max_len²)
parameters per head (at max_len = 16K: 268M per head), `factorized_random` O(max_len·k).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo.contract import Attention, register
from attention_zoo.ops import softmax
from attention_zoo.options import Bool, Choice, Int

MODES = ("dense", "random", "factorized_random")
MIXTURES = ("learned", "sum")


@register("synthesizer", exact=False, supports_causal=True, supports_cross=False,
          complexity="O(n²)",
          paper="Tay, Bahri, Metzler, Juan, Zhao & Zheng 2021, Synthesizer: Rethinking "
                "Self-Attention in Transformer Models (arXiv:2005.00743)",
          needs_max_len=True)
class SynthesizerAttention(Attention):
  # mixture: "learned" (softmax-normalised weights) or "sum" (a plain sum); k: the rank of
  # factorized_random.
  OPTIONS = {"mode": Choice("random", MODES), "mix_dot_product": Bool(True),
             "mixture": Choice("learned", MIXTURES), "k": Int(32, minimum=1)}
  TEST_OPTIONS = dict(k=4)

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    mode, rank = self.options["mode"], self.options["k"]
    self.mode, self.mix_dot_product = mode, self.options["mix_dot_product"]
    learned = self.mix_dot_product and self.options["mixture"] == "learned"
    # logits of α = (synthesized, dot product); zeros: equal weights
    self.mixture_logits = nnx.Param(jnp.zeros((2,))) if learned else None
    h, d, length = self.num_heads, self.head_dim, self.max_len
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    key = self.rngs.params
    if mode == "random":
      self.random = nnx.Param(init(key(), (h, length, length)))        # [h, max_len, max_len]
    elif mode == "factorized_random":
      self.random_left = nnx.Param(init(key(), (h, length, rank)))     # [h, max_len, k]
      self.random_right = nnx.Param(init(key(), (h, rank, length)))    # [h, k, max_len]
    else:
      self.hidden_kernel = nnx.Param(init(key(), (h, d, d)))           # [h, d, d]
      self.hidden_bias = nnx.Param(jnp.zeros((h, d)))
      self.logit_kernel = nnx.Param(init(key(), (h, d, length)))       # [h, d, max_len]
      self.logit_bias = nnx.Param(jnp.zeros((h, length)))

  def synthesized_logits(self, q):
    """q [b, n, h, d] -> B[:n, :n], f32 [b or 1, h, n, n]."""
    n = q.shape[1]
    if n > self.max_len:
      raise ValueError(f"synthesizer: sequence length {n} exceeds max_len={self.max_len} "
                       f"(its logits are parameters over positions); build it with max_len >= {n}")
    if self.mode == "random":
      return self.random[...][None, :, :n, :n].astype(jnp.float32)
    if self.mode == "factorized_random":
      return jnp.einsum("hqr,hrk->hqk", self.random_left[...][:, :n],
                        self.random_right[...][:, :, :n],
                        preferred_element_type=jnp.float32)[None]      # [1, h, n, n]
    hidden = jax.nn.relu(jnp.einsum("bqhd,hde->bqhe", q, self.hidden_kernel[...],
                                    preferred_element_type=jnp.float32) + self.hidden_bias[...])
    return jnp.einsum("bqhe,hek->bhqk", hidden, self.logit_kernel[...][:, :, :n],
                      preferred_element_type=jnp.float32) + self.logit_bias[...][None, :, None, :n]

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    b, n, h, d = q.shape
    kvh = self.num_kv_heads
    logits = self.synthesized_logits(q)
    scores = logits.reshape(logits.shape[0], kvh, h // kvh, n, n)      # [b, kvh, g, q, k]
    if self.mix_dot_product:
      dot = jnp.einsum("bqkgd,bskd->bkgqs", softmax.group_heads(q, kvh), k,
                       preferred_element_type=jnp.float32) * self.scale  # [b, kvh, g, q, k]
      if self.mixture_logits is None:
        scores = scores + dot
      else:
        alpha = jax.nn.softmax(self.mixture_logits[...])
        scores = alpha[0] * scores + alpha[1] * dot
    allowed = kv_mask[:, None, None, None, :]
    if self.causal:
      allowed = allowed & softmax.causal_allowed(jnp.arange(n)[:, None],
                                                   jnp.arange(n)[None, :], n, n)
    weights = self.dropout(softmax.masked_softmax(scores, allowed), deterministic)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)                # [b, q, kvh, g, d]
    return out.reshape(b, n, h, d)
