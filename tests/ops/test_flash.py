"""flash: the Pallas kernels (GPU kernels interpreted on CPU; TPU kernels in the TPU interpreter)
and the chunked path against the dense oracle, their lowering for GPU and TPU (memory:
test_scaling.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

import attention_zoo as az
from attention_zoo import flex, reference
from attention_zoo.ops.flash import pallas_gpu, pallas_tpu

# Several tiles at n <= 50; the chunked path (flex) runs its backward on the forward's tiles.
# Compiled Triton tiles (on a GPU) are at least 16 wide; interpreted ones may be narrower.
ON_GPU = jax.default_backend() == "gpu"
BLOCKS = {"pallas": dict(block_q=16, block_k=16, block_q_bwd=16 if ON_GPU else 8, block_k_bwd=16),
          "chunked": dict(block_q=16, block_k=8)}
CASES = {
    # cross-attention (q_len < kv_len, neither a multiple of the blocks), GQA, padding, ALiBi
    "cross_gqa_padding_alibi": dict(q_len=21, kv_len=50, num_kv_heads=2, causal=False, alibi=True),
    # causal bottom-right with q_len < kv_len, MQA; batch row 1 has no real key at all
    "causal_cross_mqa_empty_row": dict(q_len=19, kv_len=37, num_kv_heads=1, causal=True,
                                       alibi=False, empty_row=True),
    # causal with q_len > kv_len: the first q_len - kv_len queries see no key; ALiBi
    "causal_q_longer": dict(q_len=45, kv_len=19, num_kv_heads=2, causal=True, alibi=True),
}
NUM_HEADS, HEAD_DIM = 4, 16


def make_inputs(q_len, kv_len, num_kv_heads, empty_row=False, dtype=jnp.float32, seed=0, **_):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (2, q_len, NUM_HEADS, HEAD_DIM), dtype)
  k = jax.random.normal(keys[1], (2, kv_len, num_kv_heads, HEAD_DIM), dtype)
  v = jax.random.normal(keys[2], (2, kv_len, num_kv_heads, HEAD_DIM), dtype)
  d_out = jax.random.normal(keys[3], q.shape, dtype)
  q_mask = np.ones((2, q_len), bool)
  q_mask[1, -3:] = False
  kv_mask = np.ones((2, kv_len), bool)
  kv_mask[1, -7:] = False
  kv_mask[0, 2] = False
  if empty_row:
    kv_mask[1] = False
  return q, k, v, d_out, jnp.asarray(q_mask), jnp.asarray(kv_mask)


def build(impl, case, **options):
  return az.create("flash", num_heads=NUM_HEADS, head_dim=HEAD_DIM,
                   num_kv_heads=case["num_kv_heads"], causal=case["causal"], rngs=nnx.Rngs(0),
                   impl=impl, **options)


def slopes_for(case):
  return jnp.linspace(0.5, 0.0625, NUM_HEADS) if case["alibi"] else None


def oracle(case, q_mask, kv_mask, scale):
  """Dense softmax over pattern & masks (f32), masked query rows zeroed like the base class does."""
  q_len, kv_len = case["q_len"], case["kv_len"]
  allowed = q_mask[:, None, :, None] & kv_mask[:, None, None, :]
  if case["causal"]:
    allowed &= reference.causal_allowed(jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :],
                                        q_len, kv_len)
  slopes = slopes_for(case)
  bias = None if slopes is None else reference.alibi_bias(
      slopes, jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :], q_len, kv_len)[None]

  def attend(q, k, v):
    out = reference.dense_attention(q, k, v, allowed, scale=scale, bias=bias)
    return jnp.where(q_mask[:, :, None, None], out, 0)
  return attend


def output_and_grads(attend, q, k, v, d_out):
  out, vjp = jax.vjp(attend, q, k, v)
  return (out, *vjp(d_out))


def assert_matches_oracle(attend, want_attend, inputs, tol):
  """attend's output and gradients against want_attend's (an oracle) on the f32 inputs."""
  q, k, v, d_out = inputs[:4]
  got = jax.jit(output_and_grads, static_argnums=0)(attend, q, k, v, d_out)
  want = jax.jit(output_and_grads, static_argnums=0)(
      want_attend, *(x.astype(jnp.float32) for x in (q, k, v, d_out)))
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.dtype == q.dtype, what
    assert bool(jnp.all(jnp.isfinite(g))), f"{what} has NaN/Inf"
    err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)))
    assert err <= tol * max(1.0, float(jnp.max(jnp.abs(w)))), f"{what}: max error {err:.2e}"


@pytest.mark.parametrize("impl, case_name", [  # the interpreted Pallas kernels: one case fast
    *[("chunked", name) for name in CASES], ("pallas", "causal_q_longer"),
    *[pytest.param("pallas", name, marks=pytest.mark.slow) for name in CASES
      if name != "causal_q_longer"]])
def test_equals_dense_attention_f32(impl, case_name):
  case = CASES[case_name]
  attn = build(impl, case, **BLOCKS[impl])
  inputs = make_inputs(**case)
  q_mask, kv_mask = inputs[4], inputs[5]
  attend = lambda q, k, v: attn(q, k, v, q_mask=q_mask, kv_mask=kv_mask,
                                alibi_slopes=slopes_for(case))
  assert_matches_oracle(attend, oracle(case, q_mask, kv_mask, attn.scale), inputs, tol=2e-5)


@pytest.mark.parametrize("impl, dtype", [
    pytest.param("pallas", jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param("chunked", jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param("chunked", jnp.float16, marks=pytest.mark.slow)])
def test_equals_dense_attention_low_precision(impl, dtype):
  """bf16/f16 inputs, f32 accumulation: within 2e-2 of the f32 oracle on the same (rounded)
  inputs."""
  case = CASES["causal_q_longer"]
  attn = build(impl, case, **BLOCKS[impl])
  inputs = make_inputs(**case, dtype=dtype, seed=1)
  q_mask, kv_mask = inputs[4], inputs[5]
  attend = lambda q, k, v: attn(q, k, v, q_mask=q_mask, kv_mask=kv_mask,
                                alibi_slopes=slopes_for(case))
  assert_matches_oracle(attend, oracle(case, q_mask, kv_mask, attn.scale), inputs, tol=2e-2)


@pytest.mark.slow
def test_tpu_kernels_in_tpu_interpreter():
  """The Mosaic-TPU kernels (grid reduction, VMEM scratch, SMEM slopes, clamped causal index_maps),
  run by the TPU interpreter, which also raises on out-of-bounds block indices."""
  case = dict(q_len=20, kv_len=29, num_kv_heads=1, causal=True, alibi=True)
  q, k, v, d_out, q_mask, kv_mask = inputs = make_inputs(**case)
  scale = HEAD_DIM ** -0.5

  def attend(q, k, v):
    out = pallas_tpu.flash_attention(q, k, v, kv_mask, slopes_for(case), causal=True, scale=scale,
                                     block_q=8, block_k=16, block_q_bwd=16, block_k_bwd=16,
                                     interpret=pltpu.InterpretParams())
    return jnp.where(q_mask[:, :, None, None], out, 0)
  assert_matches_oracle(attend, oracle(case, q_mask, kv_mask, scale), inputs, tol=2e-5)


SEGMENTS = jnp.asarray(np.repeat([0, 1, 2], [11, 17, 12]))   # documents across block edges
MASK_MODS = {   # over 40 tokens; the kernels also evaluate them on padded indices, hence the clip
    "sliding_window": lambda b, h, q, kv: (kv <= q) & (q - kv < 12),
    "document": lambda b, h, q, kv: ((jnp.take(SEGMENTS, q, mode="clip")
                                      == jnp.take(SEGMENTS, kv, mode="clip")) & (kv <= q)),
}


def mask_oracle(mask_mod, q_mask, kv_mask, scale):
  """Dense softmax over mask_mod & the padding masks (f32), masked query rows zeroed."""
  allowed = q_mask[:, None, :, None] & kv_mask[:, None, None, :]
  allowed &= flex.dense_mask(mask_mod, None, q_mask.shape[1], kv_mask.shape[1])[None]

  def attend(q, k, v):
    out = reference.dense_attention(q, k, v, allowed, scale=scale)
    return jnp.where(q_mask[:, :, None, None], out, 0)
  return attend


@pytest.mark.parametrize("kernels, mask_name", [   # interpreted kernels: one case fast
    pytest.param(pallas_gpu, "sliding_window", marks=pytest.mark.slow), (pallas_gpu, "document"),
    pytest.param(pallas_tpu, "sliding_window", marks=pytest.mark.slow),
    pytest.param(pallas_tpu, "document", marks=pytest.mark.slow)])
def test_kernels_follow_a_block_mask(kernels, mask_name):
  """The kernels visit only the tiles flex's block mask lists (here some are empty) and evaluate
  mask_mod (with the array it closes over, for the document mask) in the partial ones: output and
  gradients equal the dense oracle's; GQA and padding."""
  mask_mod = MASK_MODS[mask_name]
  counts = flex.kernel_lists(mask_mod, 40, 40, block_q=8, block_k=8)[0]
  assert int(counts.max()) < 5                                   # some key blocks skipped
  q, k, v, d_out, q_mask, kv_mask = inputs = make_inputs(40, 40, num_kv_heads=2)
  scale = HEAD_DIM ** -0.5
  interpret = pltpu.InterpretParams() if kernels is pallas_tpu else True

  def attend(q, k, v):
    out = kernels.flash_attention(q, k, v, kv_mask, causal=False, scale=scale, block_q=8,
                                  block_k=8, block_q_bwd=8, block_k_bwd=16, interpret=interpret,
                                  mask_mod=mask_mod)
    return jnp.where(q_mask[:, :, None, None], out, 0)
  assert_matches_oracle(attend, mask_oracle(mask_mod, q_mask, kv_mask, scale), inputs, tol=2e-5)


@pytest.mark.parametrize("platform, kernels, call_target", [
    ("cuda", pallas_gpu, "__gpu$xla.gpu.triton"), ("tpu", pallas_tpu, "tpu_custom_call")])
def test_kernels_lower_for_their_hardware(platform, kernels, call_target):
  """Forward and backward lower through Triton (GPU) / Mosaic (TPU) at bf16, GQA, causal, ALiBi,
  a head_dim that is not a power of two and lengths that need padding. Lowering only: compiling
  the Triton IR to PTX and Mosaic's layout passes need the hardware."""
  q = jax.ShapeDtypeStruct((2, 300, 8, 80), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 700, 2, 80), jnp.bfloat16)

  def fwd_bwd(q, k, v, kv_mask, slopes):
    attend = lambda q, k, v: kernels.flash_attention(q, k, v, kv_mask, slopes, causal=True,
                                                     scale=0.1, interpret=False)
    return output_and_grads(attend, q, k, v, q)
  traced = jax.jit(fwd_bwd).trace(q, kv, kv, jax.ShapeDtypeStruct((2, 700), jnp.bool_),
                                  jax.ShapeDtypeStruct((8,), jnp.float32))
  lowered = traced.lower(lowering_platforms=(platform,))
  assert lowered.as_text().count(call_target) == 3     # forward, dq, dk/dv


PACKED = jnp.asarray(np.stack([np.repeat([0, 1, 2], [11, 17, 12]), np.repeat([3, 4], [25, 15])]))


def capped_oracle(causal, cap, q_mask, kv_mask, scale):
  """Dense softmax of cap · tanh(scores / cap) over causal & same segment (PACKED) & padding."""
  n = q_mask.shape[1]
  allowed = (q_mask[:, None, :, None] & kv_mask[:, None, None, :]
             & (PACKED[:, None, :, None] == PACKED[:, None, None, :]))
  if causal:
    allowed &= jnp.tril(jnp.ones((n, n), bool))

  def attend(q, k, v):
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    weights = reference.masked_softmax(cap * jnp.tanh(scores / cap), allowed)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision="highest")
    return jnp.where(q_mask[:, :, None, None], out, 0)
  return attend


@pytest.mark.parametrize("kernels", [pallas_gpu, pytest.param(pallas_tpu, marks=pytest.mark.slow)])
def test_kernels_softcap_and_segment_ids(kernels):
  """Soft-capping (forward and backward in the kernels) and packed sequences (segment ids read
  block by block), causal, GQA and padding: output and gradients equal the dense oracle's."""
  q, k, v, d_out, q_mask, kv_mask = inputs = make_inputs(40, 40, num_kv_heads=2)
  scale, cap = HEAD_DIM ** -0.5, 1.0
  interpret = pltpu.InterpretParams() if kernels is pallas_tpu else True

  def attend(q, k, v):
    out = kernels.flash_attention(q, k, v, kv_mask, causal=True, scale=scale, softcap=cap,
                                  segment_ids=(PACKED, PACKED), block_q=8, block_k=8,
                                  block_q_bwd=8, block_k_bwd=16, interpret=interpret)
    return jnp.where(q_mask[:, :, None, None], out, 0)
  assert_matches_oracle(attend, capped_oracle(True, cap, q_mask, kv_mask, scale), inputs,
                        tol=2e-5)


@pytest.mark.parametrize("platform, kernels, call_target", [
    ("cuda", pallas_gpu, "__gpu$xla.gpu.triton"), ("tpu", pallas_tpu, "tpu_custom_call")])
def test_kernels_lower_with_a_mask_mod_softcap_and_segment_ids(platform, kernels, call_target):
  """Forward and backward lower with a mask_mod (a causal window), softcap and segment ids."""
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
  window = lambda b, h, q, kv: (kv <= q) & (q - kv < 100)

  def fwd_bwd(q, k, v, kv_mask, segment_ids):
    attend = lambda q, k, v: kernels.flash_attention(
        q, k, v, kv_mask, causal=False, scale=0.1, softcap=30.0,
        segment_ids=(segment_ids, segment_ids), interpret=False, mask_mod=window)
    return output_and_grads(attend, q, k, v, q)
  traced = jax.jit(fwd_bwd).trace(q, q, q, jax.ShapeDtypeStruct((2, 256), jnp.bool_),
                                  jax.ShapeDtypeStruct((2, 256), jnp.int32))
  assert traced.lower(lowering_platforms=(platform,)).as_text().count(call_target) == 3


def test_options_and_refusals():
  make = lambda **options: az.create("flash", num_heads=4, head_dim=16, rngs=nnx.Rngs(0), **options)
  assert make().impl == ("chunked" if jax.default_backend() == "cpu" else "pallas")
  with pytest.raises(ValueError, match="impl"):
    make(impl="triton")
  with pytest.raises(ValueError, match="block_k"):
    make(block_k=0)
  with pytest.raises(ValueError, match="block_q_bwd must be None or the forward's block_q=16"):
    make(impl="chunked", block_q=16, block_q_bwd=8)(*[jnp.zeros((1, 40, 4, 16))] * 3)
  with pytest.raises(ValueError, match="dropout"):
    make(dropout_rate=0.1)
  q = jnp.zeros((1, 40, 4, 16))
  mask = jnp.ones((1, 40), bool)
  with pytest.raises(ValueError, match="power of two"):
    pallas_gpu.flash_attention(q, q, q, mask, causal=False, scale=1.0, block_q=24)
  if jax.default_backend() != "tpu":
    with pytest.raises(ValueError, match="needs a TPU"):
      pallas_tpu.flash_attention(q, q, q, mask, causal=False, scale=1.0)
