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
            reading flex's block metadata, so causal tiles above the diagonal are skipped;
            GQA/MQA inside the kernel):
            on a GPU the Triton lowering (ops/flash/pallas_gpu.py), on a TPU the Mosaic
            lowering (ops/flash/pallas_tpu.py); on a CPU the GPU kernels run with
            `interpret=True` (for testing: correct but not fast).
  "chunked" attention_zoo.ops.flex.flex_attention with no mask or the causal block mask
            (ops/flash/chunked.py):
            the engine under every exact variant, pure JAX, linear memory forward and backward.
  "auto"    "pallas" on GPU/TPU, "chunked" on CPU.
Options block_q, block_k (forward tiles) and block_q_bwd, block_k_bwd (backward tiles): None
picks the backend's default (chunked: the backward runs on the forward tiles, so the backward
sizes must be None or equal to them). Lengths are padded to the blocks and the padding masked.
Attention dropout is not supported (the kernels never form the weights as an array); ALiBi slopes
are added inside the tiles (the Pallas kernels give them no gradient); `softcap` is applied in the
tiles, forward and backward; segment ids (packed sequences) are compared in every visited tile
by the Pallas kernels (read block by block like the padding mask) and skip the tiles between
documents on the chunked path; attention sinks (sink=True) scale each finished row by
sigmoid(lse - s_h) on every path (softmax.apply_sinks, with the log-sum-exp's gradient). The
Pallas modules (and jax.experimental.pallas) are imported only when a module that uses them is
built. Forward-mode autodiff (jax.jvp, jax.jacfwd, jax.hessian) works with "chunked" (flex's
forward, plain JAX); "pallas" refuses it with a ValueError (Pallas kernels have no forward-mode
rule).
"""
from __future__ import annotations

import jax

from attention_zoo.contract import Attention, register
from attention_zoo.ops import softmax
from attention_zoo.ops.flash import kernel_module
from attention_zoo.ops.autodiff import autodiff_modes
from attention_zoo.ops.context import context_size
from attention_zoo.variants.masked import attend_all
from attention_zoo.options import Choice, Int
from attention_zoo.registry import available, get

IMPLS = ("auto", "pallas", "chunked")
BLOCK_OPTIONS = ("block_q", "block_k", "block_q_bwd", "block_k_bwd")


@register("flash", exact=True, supports_causal=True, supports_cross=True,
          complexity="O(n²) time, O(n) memory",
          paper="Dao et al. 2022, FlashAttention (arXiv:2205.14135); "
                "Dao 2023, FlashAttention-2 (arXiv:2307.08691)",
          can_decode=True, supports_alibi=True, supports_dropout=False, supports_softcap=True,
          supports_segment_ids=True, supports_context_parallel=True, supports_sinks=True)
class FlashAttention(Attention):
  # Block sizes None: the backend's default.
  OPTIONS = {"impl": Choice("auto", IMPLS),
             **{name: Int(None, minimum=1, optional=True) for name in BLOCK_OPTIONS}}
  # The Pallas kernels (interpreted on CPU) with tiles smaller than the suite's lengths: several
  # tiles, padding to the block and causal tile skipping happen.
  TEST_OPTIONS = dict(impl="pallas", block_q=8, block_k=8, block_q_bwd=8, block_k_bwd=4)
  WHY_NO_DROPOUT = "the flash kernels never materialise the attention weights to drop"

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    backend = jax.default_backend()
    impl = self.options["impl"]
    if impl == "auto":
      impl = "chunked" if backend == "cpu" else "pallas"
    self.impl = impl
    # kernel_module name; the GPU kernels also run (interpreted) on a CPU.
    self.kernels = ("chunked" if impl == "chunked"
                    else f"pallas_{'tpu' if backend == 'tpu' else 'gpu'}")
    if self.kernels == "pallas_gpu":
      self._check_gpu_kernels(compiled=backend == "gpu")

  def _check_gpu_kernels(self, compiled: bool):
    """Refuses, at construction, what the Triton kernels cannot run."""
    pallas_gpu = kernel_module("pallas_gpu")
    if compiled and self.head_dim > pallas_gpu.MAX_COMPILED_HEAD_DIM:
      raise self.option_error(
          "impl", f"'chunked' for head_dim {self.head_dim} on a GPU (impl='pallas' supports "
                  f"head_dim <= {pallas_gpu.MAX_COMPILED_HEAD_DIM}: the tiles must fit one "
                  f"SM's shared memory)")
    expected, allowed = pallas_gpu.block_rule(compiled)
    for name in BLOCK_OPTIONS:
      if self.options[name] is not None and not allowed(self.options[name]):
        raise self.option_error(name, f"{expected}, or None, for impl='pallas'")

  def forward_mode_error(self) -> ValueError:
    """Forward-mode autodiff (JAX would fail inside the Pallas kernels, which have no JVP rule)."""
    built_in = [name for name in available("attention")
                if name != "flash" and get(name).__module__.startswith("attention_zoo.")]
    return ValueError(
        "flash with impl='pallas' cannot be differentiated in forward mode (jax.jvp, jax.jacfwd, "
        "or forward over reverse: jax.hessian, Hessian-vector products): its Pallas kernels "
        "have no forward-mode rule. impl='chunked' computes the same attention in plain JAX and "
        f"supports it, as do the other built-in attention variants ({', '.join(built_in)}) "
        "and every built-in mixer")

  def pattern(self, q_len: int, kv_len: int):
    return softmax.causal_pattern(q_len, kv_len, self.causal)

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic, alibi_slopes=None,
             segment_ids=None):
    if context_size() > 1:   # the sequence split over the mesh: ring attention (ops/ring.py)
      return attend_all(self, q, k, v, kv_mask=kv_mask, deterministic=deterministic,
                        alibi_slopes=alibi_slopes, segment_ids=segment_ids)
    del q_mask, deterministic   # the base zeroes masked query rows; no dropout
    if self.impl == "pallas" and "forward" in autodiff_modes():
      raise self.forward_mode_error()
    blocks = {name: self.options[name] for name in BLOCK_OPTIONS}
    return kernel_module(self.kernels).flash_attention(
        q, k, v, kv_mask, alibi_slopes, causal=self.causal, scale=self.scale,
        softcap=self.softcap, segment_ids=segment_ids, sinks=self.sinks(), **blocks)
