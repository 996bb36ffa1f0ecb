"""FlashAttention (Dao et al. 2022; FlashAttention-2, Dao 2023): exact softmax attention in tiles.

    Attention(Q, K, V) = softmax(Q Kᵀ · scale + B) V,   B = -inf outside the allowed keys (+ ALiBi)

computed block by block with an online softmax: for each query block, over the key blocks j it
may see,
    m⁽ʲ⁾ = max(m⁽ʲ⁻¹⁾, rowmax(S⁽ʲ⁾))    ℓ⁽ʲ⁾ = e^(m⁽ʲ⁻¹⁾-m⁽ʲ⁾) ℓ⁽ʲ⁻¹⁾ + rowsum(e^(S⁽ʲ⁾-m⁽ʲ⁾))
    O⁽ʲ⁾ = e^(m⁽ʲ⁻¹⁾-m⁽ʲ⁾) O⁽ʲ⁻¹⁾ + e^(S⁽ʲ⁾-m⁽ʲ⁾) V⁽ʲ⁾,     out = O / ℓ,   lse = m + log ℓ
so the n × n score matrix never reaches device memory. The backward recomputes the tiles of P
from the saved lse (FlashAttention-2, Alg. 2). Exact: equals `reference.dense_attention` over
`pattern()` (all keys, or the bottom-right causal triangle) and the masks.

Option `impl`:
  "pallas"  our `pl.pallas_call` kernels (custom_vjp: forward saving lse, dq and dk/dv kernels;
            causal tiles above the diagonal are skipped; GQA/MQA inside the kernel):
            on a GPU the Triton lowering (pallas_gpu.py), on a TPU the Mosaic lowering
            (pallas_tpu.py); on a CPU the GPU kernels run with `interpret=True` (for testing:
            correct but not fast).
  "chunked" pure JAX loops over the same tiles (chunked.py), linear memory forward and backward.
  "auto"    "pallas" on GPU/TPU, "chunked" on CPU.
Options block_q, block_k (forward tiles) and block_q_bwd, block_k_bwd (backward tiles): None
picks the backend's default (chunked: the backward tiles default to the forward ones). Lengths are padded to the
blocks and the padding masked. Attention dropout is not supported (the kernels never form the
weights as an array); ALiBi slopes are added inside the tiles and get no gradient.
"""
from __future__ import annotations

import jax
import numpy as np

from attention_zoo import reference
from attention_zoo.base import Attention
from attention_zoo.flash import chunked, pallas_gpu, pallas_tpu
from attention_zoo.registry import register

IMPLS = ("auto", "pallas", "chunked")
KERNELS = {"chunked": chunked, "pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu}
BLOCK_OPTIONS = ("block_q", "block_k", "block_q_bwd", "block_k_bwd")


@register("flash", exact=True, supports_causal=True, supports_cross=True,
          complexity="O(n²) time, O(n) memory",
          paper="Dao et al. 2022, FlashAttention (arXiv:2205.14135); Dao 2023, FlashAttention-2 (arXiv:2307.08691)",
          can_decode=True, supports_alibi=True, supports_dropout=False)
class FlashAttention(Attention):
  OPTIONS = {"impl": "auto", **{name: None for name in BLOCK_OPTIONS}}
  # The conformance suite runs the Pallas kernels (interpreted on CPU) with tiles smaller than its
  # length 20 / cross length 12, so several tiles, padding to the block and causal skipping happen.
  WHY_NO_DROPOUT = "the flash kernels never materialise the attention weights to drop"
  TEST_OPTIONS = {"impl": "pallas", "block_q": 8, "block_k": 8, "block_q_bwd": 8, "block_k_bwd": 4}

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    impl = self.options["impl"]
    if impl not in IMPLS:
      raise ValueError(f"flash: impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    for name in BLOCK_OPTIONS:
      value = self.options[name]
      if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"flash: {name} must be a positive int or None (backend default), got {value!r}")
    backend = jax.default_backend()
    if impl == "auto":
      impl = "chunked" if backend == "cpu" else "pallas"
    if impl == "pallas" and backend == "gpu" and self.head_dim > pallas_gpu.MAX_COMPILED_HEAD_DIM:
      raise ValueError(f"flash: impl='pallas' on a GPU supports head_dim <= {pallas_gpu.MAX_COMPILED_HEAD_DIM} "
                       f"(the tiles must fit one SM's shared memory), got {self.head_dim}; use impl='chunked'")
    self.impl = impl
    self.kernels = "chunked" if impl == "chunked" else f"pallas_{'tpu' if backend == 'tpu' else 'gpu'}"  # KERNELS key

  def pattern(self, q_len: int, kv_len: int):
    return reference.causal_pattern(q_len, kv_len, self.causal)

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None):
    del q_mask, deterministic   # the base zeroes masked query rows; no dropout
    blocks = {name: self.options[name] for name in BLOCK_OPTIONS}
    return KERNELS[self.kernels].flash_attention(q, k, v, kv_mask, alibi_slopes, causal=self.causal,
                                                 scale=self.scale, **blocks)
