"""NSA against float64 oracles written from the paper's equations: each branch (compressed
attention over φ of every block, attention over the selected blocks, the sliding window) and the
gated mixture, their outputs and the gradients of a sum of all four with independent cotangents
(f32 within 2e-5; the selection itself has no gradient).
The oracle compresses block by block, ranks the selection blocks query by query with eq. (9)'s
double sum read literally, and attends densely over the keys it allows. Also: a planted key
that dominates one block's compression gets that block selected, causality branch by branch,
few blocks (the selected branch is causal `full`), the options' rules and no n x n array. The
contract (padding, GQA, bf16, dropout, forward mode) is the conformance suite's; compiled memory
linear in the length, test_scaling.py's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_zoo.variants.nsa import choose_blocks
from helpers import (largest_backward_array, attention64, create_variant, normal, padding_mask,
                     random_qkv)

# Length 37: 19 compression blocks of 4 every 2, 7 selection blocks of 6 (each 3 stride
# segments, so eq. (9) sums 3 x 2 terms), 4 selected: the last blocks choose 1 of up to 4.
OPTIONS = dict(block_length=4, block_stride=2, selection_block=6, selected_blocks=4, window=5)


def build(causal, **options):
  return create_variant("nsa", num_kv_heads=2, causal=causal, **{**OPTIONS, **options})


def gelu(x):   # tanh-approximated, as jax.nn.gelu's default
  return 0.5 * x * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def compress64(x, mask, phi, *, length, stride):
  """φ(m ⊙ x_{id .. id+l-1} + P) for every block i < ⌈n/stride⌉ in float64, block by block:
  x [b, n, kvh, d] -> ([b, N, kvh, d], which blocks hold a real key, numpy bool [b, N])."""
  batch, n, kv_heads, head_dim = x.shape
  position, w1, b1, w2, b2 = (jnp.asarray(p[...], jnp.float64) for p in (
      phi.position, phi.hidden.kernel, phi.hidden.bias, phi.out.kernel, phi.out.bias))
  x = jnp.where(jnp.asarray(mask)[:, :, None, None], x, 0.0)
  compressed, real = [], []
  for i in range(-(-n // stride)):
    inside = np.arange(i * stride, i * stride + length)
    inside = inside[inside < n]
    block = jnp.zeros((batch, length, kv_heads, head_dim)).at[:, :len(inside)].set(x[:, inside])
    flat = jnp.moveaxis(block + position[None, :, None], 2, 1).reshape(batch, kv_heads, -1)
    compressed.append(gelu(flat @ w1 + b1) @ w2 + b2)                        # [b, kvh, d]
    real.append(np.asarray(mask)[:, inside].any(1))
  return jnp.stack(compressed, 1), np.stack(real, 1)


def compressed_pattern(real, n, *, length, stride, causal, heads):
  """bool [b, h, n, N]: query t sees block i (real) ending at or before t, eq. (7)."""
  ends = np.arange(real.shape[1]) * stride + length - 1
  sees = (ends[None, :] <= np.arange(n)[:, None]) | (not causal)               # [n, N]
  return np.broadcast_to(real[:, None, None, :] & sees, (real.shape[0], heads, n, real.shape[1]))


def window_pattern(kv_mask, heads, *, window, causal):
  t, s = np.arange(kv_mask.shape[1])[:, None], np.arange(kv_mask.shape[1])[None, :]
  near = (abs(t - s) <= window) & ((s <= t) | (not causal))
  return np.broadcast_to(near & np.asarray(kv_mask)[:, None, None, :],
                         (kv_mask.shape[0], heads) + near.shape)


def selected_pattern(q, k_cmp, seen, kv_mask, *, length, stride, block, count, causal):
  """bool [b, h, n, n] from eqs. (8)-(11), query by query: p = softmax of the scaled scores
  over the compressed blocks it sees, importance of block j = Σ_heads of the group Σ_m Σ_r
  p[(l'/d)·j + m - r], blocks 0, c - 1, c forced, then the rest by importance (ties: lower j).
  Also the smallest gap between a chosen and an unchosen importance (a flip there would be a
  rounding accident, not a bug)."""
  q, k_cmp, kv_mask = np.asarray(q, np.float64), np.asarray(k_cmp, np.float64), np.asarray(kv_mask)
  batch, n, heads, head_dim = q.shape
  group, num_blocks = heads // k_cmp.shape[2], -(-n // block)
  block_of, allowed, gap = np.arange(n) // block, np.zeros((batch, heads, n, n), bool), np.inf
  for b in range(batch):
    for kv_head in range(k_cmp.shape[2]):
      group_heads = range(kv_head * group, (kv_head + 1) * group)
      for t in range(n):
        importance = np.zeros(num_blocks)
        for h in group_heads:
          scores = np.where(seen[b, h, t], k_cmp[b, :, kv_head] @ q[b, t, h] / np.sqrt(head_dim),
                            -np.inf)
          p = np.exp(scores - scores.max()) if seen[b, h, t].any() else np.zeros_like(scores)
          p = p / max(p.sum(), 1e-300)
          for j in range(num_blocks):
            for m in range(block // stride):
              for r in range(length // stride):
                i = (block // stride) * j + m - r
                importance[j] += p[i] if 0 <= i < len(p) else 0.0
        c = t // block
        candidates = [j for j in range(num_blocks)
                      if kv_mask[b, block_of == j].any() and (j <= c or not causal)]
        forced = [j for j in candidates if j in (0, c - 1, c)]
        ranked = sorted((j for j in candidates if j not in forced),
                        key=lambda j: (-importance[j], j))
        free = max(0, count - len(forced))
        if 0 < free < len(ranked) and importance[ranked[free - 1]] > 0:   # zeros tie exactly
          gap = min(gap, importance[ranked[free - 1]] - importance[ranked[free]])
        keys = np.isin(block_of, forced + ranked[:free]) & kv_mask[b]
        allowed[b, group_heads, t] = keys & ((np.arange(n) <= t) | (not causal))
  return allowed, gap


def oracle(attn, q, k, v, q_mask, kv_mask):
  """The branches and their gated sum in float64: f(q, k, v) -> (cmp, slc, win, out), and the
  selection pattern (fixed: no gradient) and its smallest importance gap."""
  o = attn.options
  shape = dict(length=o["block_length"], stride=o["block_stride"])
  heads, causal = q.shape[2], attn.causal
  with jax.enable_x64(True):
    k_cmp, real = compress64(jnp.asarray(k, jnp.float64), kv_mask, attn.compress_key, **shape)
    seen = compressed_pattern(real, q.shape[1], causal=causal, heads=heads, **shape)
    selected, gap = selected_pattern(q, k_cmp, seen, kv_mask, block=o["selection_block"],
                                     count=o["selected_blocks"], causal=causal, **shape)
  window = window_pattern(kv_mask, heads, window=o["window"], causal=causal)
  gate_kernel, gate_bias = (np.asarray(p[...], np.float64) for p in (attn.gate_kernel,
                                                                      attn.gate_bias))

  def f(q, k, v):
    k_cmp, _ = compress64(k, kv_mask, attn.compress_key, **shape)
    v_cmp, _ = compress64(v, kv_mask, attn.compress_value, **shape)
    branches = (attention64(q, k_cmp, v_cmp, seen, q_mask), attention64(q, k, v, selected, q_mask),
                attention64(q, k, v, window, q_mask))
    gates = jax.nn.sigmoid(jnp.einsum("bnhd,hdc->bnhc", q, gate_kernel) + gate_bias)
    return (*branches, sum(gates[..., c, None] * out for c, out in enumerate(branches)))
  return f, selected, gap


def outputs_and_grads(f, q, k, v, cotangents):
  """f(q, k, v) -> outputs; them and the gradients of Σ_c ⟨cotangent_c, output_c⟩ (independent
  cotangents: a wrong gradient of any one output shows)."""
  outs, back = jax.vjp(f, q, k, v)
  return outs, back(tuple(c.astype(out.dtype) for c, out in zip(cotangents, outs)))


@pytest.mark.parametrize("causal, padded", [
    # a hole and a padded tail (slow too: the fast lane checks nsa by the conformance suite)
    pytest.param(True, True, marks=pytest.mark.slow),
    pytest.param(True, False, marks=pytest.mark.slow),
    pytest.param(False, True, marks=pytest.mark.slow),       # the bidirectional form
])
def test_branches_and_mixture_equal_the_float64_oracles(causal, padded):
  n = 37
  attn = build(causal)
  q, k, v = random_qkv(0, q_len=n)
  mask = padding_mask(2, n, hole=9, tail=4) if padded else jnp.ones((2, n), bool)
  cotangents = [normal(7 + c, q.shape) for c in range(4)]

  def variant(q, k, v):   # the branches' padded query rows zeroed, as the call zeroes them
    branches = attn.branches(q, k, v, q_mask=mask, kv_mask=mask)
    return (*(jnp.where(mask[:, :, None, None], out, 0) for out in branches),
            attn(q, k, v, q_mask=mask, kv_mask=mask))

  got_outs, got_grads = jax.jit(outputs_and_grads, static_argnums=0)(variant, q, k, v, cotangents)
  f, selected, gap = oracle(attn, q, k, v, mask, mask)
  assert gap > 1e-4, f"importances within {gap:.1e}: float32 may rank them otherwise"
  # not degenerate: queries of one block (5: 30 .. 35) choose different blocks
  assert (selected[:, :, 30] != selected[:, :, 32]).any()
  with jax.enable_x64(True):
    want_outs, want_grads = jax.jit(outputs_and_grads, static_argnums=0)(f, q, k, v, cotangents)
  for branch, got, want in zip(("compressed", "selected", "window", "mixture"), got_outs,
                               want_outs):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0,
                               err_msg=branch)
    assert np.abs(np.asarray(want)).max() > 0.1, branch
  for what, got, want in zip(("dq", "dk", "dv"), got_grads, want_grads):
    assert got.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(got))), what
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0, err_msg=what)


@pytest.mark.parametrize("planted_block", [1, 2, 3])
def test_a_key_that_dominates_a_compression_gets_its_block_selected(planted_block):
  """Selection blocks of 4 = compression block 2j (4 tokens every 2); a key 30x the others at
  position 4j + 1 dominates that compression. Queries of the last block (7: blocks 0, 6, 7
  forced, one free slot) pointing along it choose block j, whichever j it is."""
  n, block = 32, 4
  attn = build(True, block_length=4, block_stride=2, selection_block=block, selected_blocks=4)
  q, k, v = random_qkv(5, q_len=n, std=0.1)
  planted = 4 * planted_block + 1
  k = k.at[:, planted].set(30 * normal(6, k[:, planted].shape))
  mask = jnp.ones((2, n), bool)
  k_cmp, _, real = attn.compress(k, v, mask)                      # [b, 16, kvh, d], [b, 16]
  target = k_cmp[0, 2 * planted_block, 0]
  assert float(jnp.linalg.norm(target)) > 3 * float(jnp.median(jnp.linalg.norm(k_cmp[0, :, 0],
                                                                            axis=-1)))
  q = q.at[0, -block:, :2].set(10 * target / jnp.linalg.norm(target))   # the group of kv head 0
  chosen = choose_blocks(q[0, :, :2], k[0, :, 0], mask[0], mask[0], k_cmp[0, :, 0], real[0],
                         scale=attn.scale, length=4, stride=2, block=block, count=4, causal=True)
  assert chosen.shape == (n, 2, 4)
  np.testing.assert_array_equal(np.sort(chosen[-block:], -1),
                                np.broadcast_to(sorted([0, planted_block, 6, 7]), (block, 2, 4)))


def test_later_tokens_change_no_earlier_output_of_any_branch():
  n, cut = 37, 20
  attn = build(True)
  q, k, v = random_qkv(1, q_len=n)
  noise = random_qkv(2, q_len=n)
  later = jnp.arange(n)[None, :, None, None] >= cut
  changed = [jnp.where(later, x + 3 * e, x) for x, e in zip((q, k, v), noise)]
  mask = jnp.ones((2, n), bool)
  call = jax.jit(lambda q, k, v: (*attn.branches(q, k, v, q_mask=mask, kv_mask=mask),
                                  attn(q, k, v)))
  for branch, before, after in zip(("compressed", "selected", "window", "mixture"),
                                   call(q, k, v), call(*changed)):
    np.testing.assert_allclose(after[:, :cut], before[:, :cut], atol=1e-6, err_msg=branch)
    assert float(jnp.abs(after[:, cut:] - before[:, cut:]).max()) > 1e-3, branch


@pytest.mark.slow
def test_as_many_selected_blocks_as_blocks_is_causal_full_attention():
  q, k, v = random_qkv(3, q_len=29)
  mask = padding_mask(2, 29, hole=4, tail=3)
  _, selected, _ = build(True, selected_blocks=5).branches(q, k, v, q_mask=mask, kv_mask=mask)
  full = create_variant("full", causal=True)(q, k, v, q_mask=mask, kv_mask=mask)
  np.testing.assert_allclose(selected, full, atol=1e-6)


def test_blocks_must_be_multiples_of_the_stride():
  for bad in (dict(block_length=5), dict(selection_block=7)):
    with pytest.raises(ValueError, match=f"{next(iter(bad))}.*multiple of block_stride=2"):
      build(True, **bad)


@pytest.mark.slow
def test_no_n_by_n_array_forward_or_backward():
  """The largest intermediates are linear in n (a row of d per query, head and selected block:
  n·g·count·d; the engine's 128 x 128 tiles), far from n x n."""
  n = 1024
  attn = create_variant("nsa", num_kv_heads=1, causal=True, block_length=16, block_stride=8,
                        selection_block=16, selected_blocks=4, window=16)
  biggest = largest_backward_array(attn, n, 4, 8)
  assert biggest <= n * 4 * 4 * 8, f"an intermediate has {biggest} elements (n² = {n * n})"
