r"""Comba (Hu et al. 2025, Comba: Improving Bilinear RNNs with Closed-loop Control,
arXiv:2506.02475): the delta rule with a scalar-plus-low-rank (SPLR) transition, its feedback
read from the state before the decay, and a closed-loop output correction.

    S_t = (α_t I - β_t k_t p_tᵀ) S_{t-1} + β_t k_t v_tᵀ,     p_t = σ(λ) k_t
    o_t = S_tᵀ (d_k^{-1/2} (q_t - d p_t))                      λ, d one per head

Where Gated DeltaNet's transition is α_t (I - β_t k_t k_tᵀ) (the feedback decayed too), Comba's
subtracts the feedback β_t k_t p_tᵀ from the undecayed state; p = σ(λ) k weakens the feedback
against the write (the "inner decay", σ(λ) = σ(1) at init), and the output reads with the query
corrected by the key, q - d p (d = correction_factor at init). For a unit key the transition's
eigenvalue along k is α - β σ(λ) (with allow_neg_eigval β = 2σ(·): down to -1).

The layer as flash-linear-attention defines it (fla/layers/comba.py; the authors' code went into
fla): Gated DeltaNet's q, k, v (`attention_zoo.gated_deltanet`: projections through a kernel-4
causal conv and SiLU, L2-normalised q and k), its β = σ(w_βᵀ x) and its decay per head
(`parts.DecayGate`, A ~ U(0, 16)); λ initialised to 1, d to correction_factor (fla's default 1;
its authors find 0.02 sometimes better for small models), d without weight decay; the output
per head RMS-normalised times σ(W_g x), then the output projection; d_v = 2 d_k. Chunkwise by
`attention_zoo.ops.chunk_comba` (the DPLR engine with a scalar gate: one triangular inverse per
chunk), decoded token by token.

Where ours differs: fla L2-normalises q, k and p inside its kernels after forming p = σ(λ) k
and q - d p from the unnormalised q and k, which makes p = k̂ (λ has no effect) and normalises
the corrected query; here q and k are normalised first and p = σ(λ) k̂, q̂ - d p as the equations
above. fla's token-by-token reference (naive_recurrent_comba) decays the state before the
feedback read, α_t (I - β_t k_t p_tᵀ), where its chunk kernels and the paper's SPLR transition
read the undecayed state: we follow the latter. fla's head_dim 256 and GVA are not built
(d_k = qkv_dim / num_heads; num_kv_heads < num_heads shares k, v with λ, d, β, α per query head).
The rest as DeltaNet's "where ours differs".

Context parallelism: the op splits exactly (chunk_comba over 4 shards equals one device to
3e-16 in float64, tests/ops/test_context_parallel_ops.py in float32), but the layer is not
declared: its float32 split in the registry check's packed case is 1.01e-5 from one device, just
over that check's 1e-5 (Gated DeltaNet-2's: 8e-7).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attention_zoo import ops
from attention_zoo.contract import register_mixer
from attention_zoo.mixers import parts
from attention_zoo.mixers.gated_deltanet import GatedDeltaNet
from attention_zoo.options import Bool, Float


@register_mixer("comba", complexity="O(n·C·d + n·d²)",
                paper="Hu et al. 2025, Comba: Improving Bilinear RNNs with Closed-loop Control "
                      "(arXiv:2506.02475)",
                supports_segment_ids=True)
class Comba(GatedDeltaNet):
  OPTIONS = {**GatedDeltaNet.OPTIONS, "use_output_correction": Bool(True),
             "correction_factor": Float(1.0), "use_inner_decay": Bool(True)}
  # Chunks of 8 at the suite's length 20: several chunks and a partial last one.
  TEST_OPTIONS = dict(chunk_size=8)

  def __init__(self, *, rngs, **kwargs):
    # Gated DeltaNet's q, k, v, β and decay; the output gate σ(W_g x)
    super().__init__(rngs=rngs, gate_activation="sigmoid", **kwargs)
    h = self.num_heads
    self.inner_decay = (nnx.Param(jnp.ones((h,), jnp.float32))                   # λ
                        if self.options["use_inner_decay"] else None)
    self.correction = (nnx.Param(jnp.full((h,), self.options["correction_factor"], jnp.float32),
                                 weight_decay=False)                             # d
                       if self.options["use_output_correction"] else None)

  def forward(self, x, mask, state, segment_ids=None):
    q, k, v, beta = self.delta_inputs(x, mask, state, segment_ids)
    _, g = self.decay(self.decay_proj(x))                                        # [b, n, h]
    p = k if self.inner_decay is None else (
        jax.nn.sigmoid(self.inner_decay[...])[:, None] * k).astype(k.dtype)      # [b, n, h, dk]
    if self.correction is not None:
      q = (q - self.correction[...][:, None] * p).astype(q.dtype)               # q - d p
    o, state = parts.recurrence(ops.chunk_comba, ops.recurrent_comba, q, k, v, p, g, beta,
                                mask=mask, state=state, chunk_size=self.options["chunk_size"],
                                segment_ids=segment_ids)
    return parts.gated_output(self, x, o), state
