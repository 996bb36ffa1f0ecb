"""FlashAttention's implementations, each a `flash_attention(q, k, v, kv_mask, alibi_slopes, *,
causal, scale, softcap, segment_ids, block_q, block_k, block_q_bwd, block_k_bwd)`:

  chunked     flex_attention with no mask or the causal block mask (pure JAX, any backend)
  pallas_gpu  Pallas kernels, Triton lowering (run with interpret=True on a CPU)
  pallas_tpu  Pallas kernels, Mosaic lowering

The Pallas kernels read flex's block metadata (block_metadata.py) and share the tile plumbing in
common.py; the tile maths itself is attention_zoo.ops.tiles. The registered variant is
attention_zoo.variants.flash.
"""
from __future__ import annotations

import importlib


def kernel_module(name: str):
  """The module holding `flash_attention` for "chunked", "pallas_gpu" or "pallas_tpu", imported
  on first use: only a Pallas path imports jax.experimental.pallas."""
  return importlib.import_module(f"{__name__}.{name}")
