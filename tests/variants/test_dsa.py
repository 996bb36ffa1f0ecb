"""DSA against a float64 oracle written from its definition: the lightning indexer's dense
score matrix I in numpy float64 (from the variant's own indexer weights), each query's top_k
visible keys by I (ties to the lower position), then softmax attention over them in float64
(output and gradients, f32 within 1e-5; the choice itself has no gradient). Also: the tiled
running top-k equals a dense top-k (ties included), fewer visible keys than top_k is causal
`full`, bottom-right causal cross-attention, decoding, the indexer's missing gradient, no n×n
array. The contract (causality, padding, GQA, bf16, dropout) is the conformance suite's;
compiled memory linear in the length, test_scaling.py's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo.ops.top_k_selection import lightning_top_k
from mixers.test_mla import mla64, parameters
from helpers import (assert_decoding_equals_forward, attention64, create_variant,
                     largest_backward_array, normal, out_and_grads, padding_mask, random_qkv)


def build(causal, num_kv_heads=2, **options):
  options = {"top_k": 5, "indexer_heads": 3, "indexer_dim": 4, "block_size": 4, **options}
  return create_variant("dsa", num_kv_heads=num_kv_heads, causal=causal, **options)


def index_scores64(attn, q, k):
  """I [b, kvh, m, n] in float64 from the definition, with the variant's indexer weights."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  w_q, w_w, w_k = (np.asarray(layer.kernel[...], np.float64)
                   for layer in (attn.index_query, attn.index_weight, attn.index_key))
  batch, m, heads, _ = q.shape
  kv_heads, n = k.shape[2], k.shape[1]
  grouped = q.reshape(batch, m, kv_heads, -1)                        # q̄ [b, m, kvh, g·d]
  index_q = (grouped @ w_q).reshape(batch, m, kv_heads, attn.indexer_heads, -1)
  weights = grouped @ w_w                                            # [b, m, kvh, H]
  index_k = k @ w_k                                                  # [b, n, kvh, e]
  scores = np.zeros((batch, kv_heads, m, n))
  for j in range(attn.indexer_heads):
    dots = np.einsum("bqce,bkce->bcqk", index_q[:, :, :, j], index_k)
    scores += np.moveaxis(weights[..., j], 1, 2)[..., None] * np.maximum(dots, 0)
  return scores


def oracle_pattern(scores, kv_mask, *, heads, top_k, causal):
  """bool [b, h, m, n]: each query's top_k visible keys by `scores` [b, kvh, m, n], ties to the
  lower position, all visible keys when fewer."""
  batch, kv_heads, m, n = scores.shape
  kv_mask = np.asarray(kv_mask)
  allowed = np.zeros((batch, kv_heads, m, n), bool)
  for b in range(batch):
    for c in range(kv_heads):
      for t in range(m):
        visible = [s for s in range(n) if kv_mask[b, s] and (not causal or s <= t + n - m)]
        ranked = sorted(visible, key=lambda s: (-scores[b, c, t, s], s))
        allowed[b, c, t, ranked[:top_k]] = True
  return np.repeat(allowed, heads // kv_heads, axis=1)


def assert_matches_oracle(causal, num_kv_heads, m, n, top_k, padded, seed=0):
  attn = build(causal, num_kv_heads=num_kv_heads, top_k=top_k)
  q, k, v = random_qkv(seed, q_len=m, kv_len=n, num_kv_heads=num_kv_heads)
  kv_mask = padding_mask(2, n, hole=2, tail=3) if padded else jnp.ones((2, n), bool)
  q_mask = padding_mask(2, m, hole=1, tail=2) if padded else jnp.ones((2, m), bool)
  allowed = oracle_pattern(index_scores64(attn, q, k), kv_mask, heads=q.shape[2], top_k=top_k,
                           causal=causal)
  cotangent = normal(seed + 7, q.shape)
  got = jax.jit(out_and_grads, static_argnums=0)(
      lambda q, k, v: attn(q, k, v, q_mask=q_mask, kv_mask=kv_mask), q, k, v, cotangent)
  with jax.enable_x64(True):
    want = out_and_grads(lambda q, k, v: attention64(q, k, v, allowed, q_mask), q, k, v,
                         cotangent)
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))), what
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=0, err_msg=what)
  return allowed


# causal, kv heads, q_len, kv_len, top_k, padded: lengths not multiples of the block (4)
@pytest.mark.parametrize("causal, num_kv_heads, m, n, top_k, padded", [
    (True, 2, 15, 15, 5, False),     # GQA: each K/V head selects for its group
    (True, 2, 15, 15, 5, True),      # a hole and a padded tail: never chosen, rows zero
    (False, 2, 13, 13, 4, True),     # bidirectional: the top-k of every real key
    (True, 1, 7, 13, 3, False),      # MQA, causal cross-attention aligned bottom-right
    pytest.param(False, 4, 9, 17, 6, True, marks=pytest.mark.slow),      # MHA, cross
])
def test_forward_and_gradients_equal_the_float64_oracle(causal, num_kv_heads, m, n, top_k,
                                                        padded):
  allowed = assert_matches_oracle(causal, num_kv_heads, m, n, top_k, padded)
  # not degenerate: later queries choose fewer keys than they see, and differently
  seen = allowed.sum(-1)
  assert seen.max() == top_k and (allowed[:, 0, -1] != allowed[:, 0, -2]).any()


def test_a_query_seeing_fewer_keys_than_top_k_sees_them_all_which_is_causal_full():
  q, k, v = random_qkv(1, q_len=11, num_kv_heads=2)
  mask = padding_mask(2, 11, hole=4, tail=2)
  got = build(True, top_k=11)(q, k, v, q_mask=mask, kv_mask=mask)
  full = create_variant("full", causal=True)(q, k, v, q_mask=mask, kv_mask=mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(full), atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_the_running_top_k_equals_a_dense_top_k_ties_to_the_lower_position(causal):
  """Scores rounded to a few values, so most rows hold ties that cross key blocks."""
  rng = np.random.default_rng(3)
  b, m, n, c, heads, e, top_k = 2, 10, 13, 2, 2, 3, 4
  index_q = jnp.asarray(rng.integers(-1, 2, (b, m, c, heads, e)), jnp.float32)
  weights = jnp.asarray(rng.integers(0, 2, (b, m, c, heads)), jnp.float32)
  index_k = jnp.asarray(rng.integers(-1, 2, (b, n, c, e)), jnp.float32)
  kv_mask = padding_mask(b, n, hole=5, tail=2)
  got = lightning_top_k(index_q, weights, index_k, kv_mask=kv_mask, top_k=top_k, causal=causal,
                        block_size=4)
  scores = np.einsum("bqcj,bqcjk->bcqk", np.asarray(weights), np.maximum(
      np.einsum("bqcje,bkce->bqcjk", np.asarray(index_q), np.asarray(index_k)), 0))
  pattern = oracle_pattern(scores, kv_mask, heads=c, top_k=top_k, causal=causal)
  chosen = np.asarray(got)                                             # [b, m, c, top_k]
  for bi in range(b):
    for t in range(m):
      for ci in range(c):
        picked = set(chosen[bi, t, ci][chosen[bi, t, ci] >= 0])
        assert picked == set(np.flatnonzero(pattern[bi, ci, t])), (bi, t, ci)
  assert np.any(np.diff(np.sort(scores, -1), axis=-1) == 0)          # ties exist


def test_the_indexer_gets_no_gradient_and_passes_none_to_q_or_k():
  """As documented: the selection is integers, and no auxiliary loss trains the indexer."""
  attn = build(True)
  q, k, v = random_qkv(2, q_len=12, num_kv_heads=2)
  grads = nnx.grad(lambda m: jnp.sum(m(q, k, v) ** 2))(attn)
  for layer in ("index_query", "index_weight", "index_key"):
    assert float(jnp.abs(grads[layer]["kernel"][...]).max()) == 0.0, layer


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_decoding_token_by_token_equals_the_causal_forward(num_kv_heads):
  attn = build(True, num_kv_heads=num_kv_heads, top_k=3)
  steps = 9
  q, k, v = random_qkv(4, q_len=steps, num_kv_heads=num_kv_heads)
  full = attn(q, k, v)
  cache = attn.init_cache(2, steps + 2)
  step = jax.jit(lambda q, k, v, cache: attn.decode(q, k, v, cache))
  outs = []
  for t in range(steps):
    out, cache = step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache)
    outs.append(out)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), atol=1e-5)


def test_no_intermediate_is_quadratic_in_the_length():
  n = 256
  attn = build(True, num_kv_heads=1, top_k=8, block_size=16)
  biggest = largest_backward_array(attn, n, 4, 8)
  assert biggest < n * n // 4, f"an intermediate has {biggest} elements (n² = {n * n})"


def test_options_out_of_range_are_refused_naming_the_option():
  with pytest.raises(ValueError, match="top_k"):
    build(True, top_k=0)


# -- DSA over MLA's latents (mla's option dsa_top_k), as the paper pairs them -----------------

def build_mla(**options):
  sizes = dict(kv_lora_rank=10, rope_head_dim=4, nope_head_dim=6, v_head_dim=5, block_size=4,
               q_lora_rank=12, dsa_top_k=4, dsa_indexer_heads=2, dsa_indexer_dim=3)
  return az.create_mixer("mla", emb_dim=32, num_heads=4, causal=True, rngs=nnx.Rngs(0),
                         **{**sizes, **options})


def mla_index_scores64(mla, x):
  """I [1, 1, n, n] in float64 from the paper's indexer with the layer's weights: q^I from the
  query latent, w from x, k^I = LayerNorm(W^IK x); x [n, emb]."""
  value = lambda variable: np.asarray(variable[...], np.float64)
  x = np.asarray(x, np.float64)
  down = x @ value(mla.q_down.kernel)
  c_q = down / np.sqrt((down ** 2).mean(-1, keepdims=True) + mla.options["norm_eps"])
  c_q = c_q * value(mla.q_norm.scale)
  index_q = (c_q @ value(mla.index_query.kernel)).reshape(x.shape[0], mla.options[
      "dsa_indexer_heads"], -1)                                       # [n, H_I, e]
  weights = x @ value(mla.index_weight.kernel)                        # [n, H_I]
  key = x @ value(mla.index_key.kernel)
  norm = mla.index_key_norm
  key = (key - key.mean(-1, keepdims=True)) / np.sqrt(key.var(-1, keepdims=True) + norm.epsilon)
  key = key * value(norm.scale) + value(norm.bias)                    # [n, e]
  dots = np.maximum(np.einsum("tje,se->tjs", index_q, key), 0)
  return np.einsum("tj,tjs->ts", weights, dots)[None, None]


def test_mla_with_dsa_equals_the_float64_oracle_of_mla_over_the_chosen_keys():
  """Output and the gradient of x: DeepSeek-V2's MLA (tests/mixers/test_mla.py's oracle)
  restricted to each query's top dsa_top_k keys by the float64 indexer, with padding."""
  mla = build_mla()
  n = 13
  x = normal(0, (2, n, 32))
  mask = padding_mask(2, n, hole=4, tail=3)
  cotangent = normal(1, x.shape)
  out, dx = nnx.jit(lambda mla, x: out_and_grads(
      lambda x, *_: mla(x, mask=mask), x, None, None, cotangent)[:2])(mla, x)
  patterns = [oracle_pattern(mla_index_scores64(mla, x[b]), mask[b:b + 1], heads=1,
                             top_k=4, causal=True)[0, 0] for b in range(2)]
  assert all(p.sum(-1).max() == 4 for p in patterns)                 # the selection bites
  with jax.enable_x64(True):
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), parameters(mla))

    def rows(x):
      return jnp.stack([mla64(p, x[b], mask[b], causal=True, heads=4, sizes=mla.sizes,
                              pattern=patterns[b]) for b in range(2)])

    want, want_dx = jax.jit(lambda x: out_and_grads(lambda x, *_: rows(x), x, None, None,
                                                    cotangent)[:2])(jnp.asarray(x, jnp.float64))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), atol=2e-5, rtol=0)


@pytest.mark.slow
def test_mla_with_dsa_decodes_as_it_runs_and_caches_the_indexer_keys():
  mla = build_mla()
  x = normal(2, (2, 9, 32))
  assert_decoding_equals_forward(mla, x, padding_mask(2, 9, hole=3, tail=1))
  assert mla.cache.get_value()["index_key"].shape == (2, 9, 3)


def test_mla_with_dsa_refuses_packed_sequences_naming_what_works():
  mla = build_mla()
  with pytest.raises(ValueError, match="use dsa_top_k=0"):
    mla(normal(3, (1, 6, 32)), segment_ids=jnp.asarray([[0, 0, 0, 1, 1, 1]]))
