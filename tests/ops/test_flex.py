"""flex_attention against a dense float64 softmax oracle over the same mask_mod and score_mod
(output, gradients, forward mode and Hessian-vector products, f32 within 1e-5 or 2e-5), the block
metadata against its definition, dropout's backward against its forward, and compiled memory
linear in length (backward and forward mode)."""
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_zoo as az
from attention_zoo import flex
from attention_zoo.testing import conformance
from helpers import normal, out_and_grads

BATCH, HEADS, HEAD_DIM = 2, 4, 8
BLOCKS = dict(block_q=8, block_k=8)


def grid(batch, heads, q_len, kv_len):
  """Index arrays b, h, q, kv broadcasting to [batch, heads, q_len, kv_len]."""
  return (np.arange(batch)[:, None, None, None], np.arange(heads)[None, :, None, None],
          np.arange(q_len)[None, None, :, None], np.arange(kv_len)[None, None, None, :])


def dense_oracle(q, k, v, *, mask_mod=None, score_mod=None, kv_mask=None, scale=None):
  """Plain softmax attention in float64 over every entry that mask_mod allows; rows that see no
  key give 0. Differentiable in q, k, v (and arrays score_mod closes over)."""
  with jax.enable_x64(True):
    b, q_len, h, d = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
    k, v = (jnp.repeat(x, h // kv_heads, axis=2) for x in (k, v))
    index = grid(b, h, q_len, kv_len)
    scale = d ** -0.5 if scale is None else scale
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if score_mod is not None:
      scores = jnp.broadcast_to(score_mod(scores, *index), scores.shape)
    allowed = jnp.ones(scores.shape, bool)
    if mask_mod is not None:
      allowed = jnp.broadcast_to(mask_mod(*index), scores.shape)
    if kv_mask is not None:
      allowed = allowed & jnp.asarray(kv_mask)[:, None, None, :]
    scores = jnp.where(allowed, scores, -jnp.inf)
    top = jnp.max(jnp.where(allowed, scores, 0.0), axis=-1, keepdims=True)
    weights = jnp.where(allowed, jnp.exp(scores - jax.lax.stop_gradient(top)), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def assert_matches(ours, oracle, q_len, kv_len, kv_heads, seed=0, tol=1e-5):
  q = normal(seed, (BATCH, q_len, HEADS, HEAD_DIM))
  k = normal(seed + 1, (BATCH, kv_len, kv_heads, HEAD_DIM))
  v = normal(seed + 2, (BATCH, kv_len, kv_heads, HEAD_DIM))
  cotangent = normal(seed + 3, q.shape)
  got = jax.jit(out_and_grads, static_argnums=0)(ours, q, k, v, cotangent)
  with jax.enable_x64(True):
    want = jax.jit(out_and_grads, static_argnums=0)(oracle, q, k, v, cotangent)
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))), what
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tol, rtol=0, err_msg=what)
  return got


def aligned(q_len, kv_len):
  """q -> its bottom-right aligned position (the zoo's causal convention)."""
  return lambda q: q + (kv_len - q_len)


# name -> (q_len, kv_len) -> mask_mod (None: no mask); lengths not multiples of the blocks
def causal(q_len, kv_len):
  at = aligned(q_len, kv_len)
  return lambda b, h, q, kv: kv <= at(q)


def sliding_window(q_len, kv_len, window=6):
  at = aligned(q_len, kv_len)
  return lambda b, h, q, kv: jnp.abs(at(q) - kv) <= window


def strided(q_len, kv_len, stride=3):
  at = aligned(q_len, kv_len)
  return lambda b, h, q, kv: (kv <= at(q)) & ((at(q) - kv) % stride == 0)


def random_blocks(q_len, kv_len):
  """A block-level random pattern (blocks of 8 x 8 all in or all out), per head."""
  table = np.random.default_rng(q_len).random((HEADS, -(-q_len // 8), -(-kv_len // 8))) < 0.4
  table = jnp.asarray(table)
  return lambda b, h, q, kv: table[h, q // 8, kv // 8]


def empty_rows(q_len, kv_len):
  """The first query block and every query with q % 5 == 2 see no key."""
  at = aligned(q_len, kv_len)
  return lambda b, h, q, kv: (q >= 8) & (q % 5 != 2) & (kv <= at(q))


MASKS = {"none": lambda q_len, kv_len: None, "causal": causal, "sliding_window": sliding_window,
         "strided": strided, "random_blocks": random_blocks, "empty_rows": empty_rows}
# q_len, kv_len, kv_heads: self, cross both ways, MQA
SHAPES = [(23, 23, 2), (13, 37, 1), (37, 21, 4)]


def mask_cases():
  """Every mask at every shape; in the fast lane each mask at one of them (all shapes covered)."""
  for i, name in enumerate(MASKS):
    for j, shape in enumerate(SHAPES):
      yield pytest.param(name, *shape, marks=() if i % len(SHAPES) == j else pytest.mark.slow,
                         id=f"{name}-{shape[0]}x{shape[1]}-kvh{shape[2]}")


@pytest.mark.parametrize("name, q_len, kv_len, kv_heads", list(mask_cases()))
def test_masks_equal_the_dense_oracle(name, q_len, kv_len, kv_heads):
  mask_mod = MASKS[name](q_len, kv_len)
  heads = HEADS if name == "random_blocks" else None
  block_mask = (None if mask_mod is None
                else flex.create_block_mask(mask_mod, None, heads, q_len, kv_len, **BLOCKS))
  kv_mask = np.ones((BATCH, kv_len), bool)
  kv_mask[1, -5:] = False
  kv_mask[0, 3] = False
  ours = lambda q, k, v: flex.flex_attention(q, k, v, block_mask=block_mask, kv_mask=kv_mask)
  oracle = lambda q, k, v: dense_oracle(q, k, v, mask_mod=mask_mod, kv_mask=kv_mask)
  out = assert_matches(ours, oracle, q_len, kv_len, kv_heads, seed=q_len + kv_len)[0]
  if name == "empty_rows":   # defined as 0
    assert not np.asarray(out[:, :8]).any() and not np.asarray(out[:, 12]).any()


def test_document_mask_from_segment_ids_per_batch_row():
  """Packed sequences: a query sees the keys of its own document (causal), with ids that differ
  per batch row, closed over by mask_mod; the mask is built per batch row."""
  n = 30
  segments = jnp.asarray(np.stack([np.repeat([0, 1, 2], [7, 15, 8]), np.repeat([0, 1], [19, 11])]))
  document = lambda b, h, q, kv: (segments[b, q] == segments[b, kv]) & (kv <= q)
  block_mask = flex.create_block_mask(document, BATCH, None, n, n, **BLOCKS)
  states = np.asarray(block_mask.states())
  assert states.shape == (BATCH, 1, 4, 4) and (states[0] != states[1]).any()
  ours = lambda q, k, v: flex.flex_attention(q, k, v, block_mask=block_mask)
  assert_matches(ours, lambda q, k, v: dense_oracle(q, k, v, mask_mod=document), n, n, 2)


def test_mask_built_inside_jit_from_traced_segment_ids():
  n = 20
  q, k, v = normal(0, (1, n, HEADS, HEAD_DIM)), normal(1, (1, n, 2, HEAD_DIM)), normal(2, (1, n, 2,
                                                                                          HEAD_DIM))
  segments = jnp.asarray(np.repeat([0, 1, 2], [5, 9, 6]))[None]

  @jax.jit
  def ours(q, k, v, segments):
    same = lambda b, h, qi, kv: segments[b, qi] == segments[b, kv]
    mask = flex.create_block_mask(same, 1, None, n, n, **BLOCKS)
    return flex.flex_attention(q, k, v, block_mask=mask)

  expected = dense_oracle(q, k, v, mask_mod=lambda b, h, qi, kv: segments[b, qi] == segments[b, kv])
  np.testing.assert_allclose(ours(q, k, v, segments), expected, atol=1e-5)


def softcap(s, b, h, q, kv):
  return 2.0 * jnp.tanh(s / 2.0)   # Gemma 2's soft-capping (cap 2 so that it bites here)


@pytest.mark.parametrize("q_len, kv_len, kv_heads", [
    SHAPES[0], pytest.param(*SHAPES[1], marks=pytest.mark.slow)])
def test_score_mods_equal_the_dense_oracle(q_len, kv_len, kv_heads):
  """Soft-capping, a learned relative-position bias per head and a per-token key gate (both
  closed over), on a causal mask; the closed-over arrays get their gradients too."""
  at = aligned(q_len, kv_len)
  mask_mod = lambda b, h, q, kv: kv <= at(q)
  block_mask = flex.create_block_mask(mask_mod, None, None, q_len, kv_len, **BLOCKS)
  rel_bias = normal(7, (HEADS, kv_len))          # by distance at(q) - kv, 0 .. kv_len - 1
  key_gate = normal(8, (BATCH, kv_len), 0.5)

  def score_mod(bias, gate):
    return lambda s, b, h, q, kv: (softcap(s, b, h, q, kv)
                                   + bias[h, jnp.clip(at(q) - kv, 0, kv_len - 1)] + gate[b, kv])

  def ours(q, k, v, bias=rel_bias, gate=key_gate):
    return flex.flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mod(bias, gate))

  def oracle(q, k, v, bias=rel_bias, gate=key_gate):
    return dense_oracle(q, k, v, mask_mod=mask_mod, score_mod=score_mod(bias, gate))

  assert_matches(ours, oracle, q_len, kv_len, kv_heads, seed=3)
  q = normal(0, (BATCH, q_len, HEADS, HEAD_DIM))
  k, v = (normal(s, (BATCH, kv_len, kv_heads, HEAD_DIM)) for s in (1, 2))
  loss = lambda f: lambda bias, gate: jnp.sum(jnp.sin(f(q, k, v, bias, gate)))
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(rel_bias, key_gate)
  with jax.enable_x64(True):
    want = jax.jit(jax.grad(loss(oracle), argnums=(0, 1)))(rel_bias, key_gate)
  for what, g, w in zip(("d bias", "d gate"), got, want):
    assert float(jnp.abs(w).max()) > 1e-2
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=0, err_msg=what)



@pytest.mark.slow   # the fast lane: test_forward_mode.py's flash (chunked, on flex) case
def test_forward_mode_and_hessian_vector_products_equal_the_dense_oracle():
  """jax.jvp (the forward as plain JAX: JAX refuses forward mode through the custom VJP) and
  forward over reverse, jax.jvp of jax.grad (the custom VJP's backward differentiated forward),
  along a tangent of q, k, v and the arrays score_mod closes over; a causal mask, padded keys,
  GQA, soft-capping, a relative-position bias and a key gate."""
  q_len, kv_len, kv_heads = SHAPES[0]
  at = aligned(q_len, kv_len)
  mask_mod = lambda b, h, q, kv: kv <= at(q)
  block_mask = flex.create_block_mask(mask_mod, None, None, q_len, kv_len, **BLOCKS)
  kv_mask = np.ones((BATCH, kv_len), bool)
  kv_mask[1, -5:] = False

  def score_mod(bias, gate):
    return lambda s, b, h, q, kv: (softcap(s, b, h, q, kv)
                                   + bias[h, jnp.clip(at(q) - kv, 0, kv_len - 1)] + gate[b, kv])

  ours = lambda q, k, v, bias, gate: flex.flex_attention(
      q, k, v, block_mask=block_mask, score_mod=score_mod(bias, gate), kv_mask=kv_mask)
  oracle = lambda q, k, v, bias, gate: dense_oracle(
      q, k, v, mask_mod=mask_mod, score_mod=score_mod(bias, gate), kv_mask=kv_mask)
  shapes = [(BATCH, q_len, HEADS, HEAD_DIM)] + [(BATCH, kv_len, kv_heads, HEAD_DIM)] * 2 + [
      (HEADS, kv_len), (BATCH, kv_len)]
  args = [normal(seed, shape, 0.5 if seed == 4 else 1.0) for seed, shape in enumerate(shapes)]
  tangents = [normal(10 + seed, shape) for seed, shape in enumerate(shapes)]
  cotangent = normal(20, shapes[0])

  def derivatives(f, args, tangents):
    """(J t, H t) of f and of L = Σ cotangent · f."""
    grad = jax.grad(lambda *args: jnp.sum(f(*args) * cotangent), argnums=tuple(range(5)))
    return jax.jvp(lambda *args: (f(*args), grad(*args)), args, tangents)[1]

  jvp_out, hvp = jax.jit(derivatives, static_argnums=0)(ours, args, tangents)
  with jax.enable_x64(True):
    want_jvp, want_hvp = derivatives(oracle, args, tangents)
  for what, g, w in zip(("J t", "H t: q", "k", "v", "bias", "gate"), (jvp_out, *hvp),
                        (want_jvp, *want_hvp)):
    assert np.abs(np.asarray(w)).max() > 1e-2, what
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=0, err_msg=what)


def test_reverse_over_forward_is_refused_with_the_order_that_works():
  q = normal(0, (BATCH, 16, HEADS, HEAD_DIM))
  f = lambda q: jnp.sum(flex.flex_attention(q, q, q) ** 2)
  with pytest.raises(ValueError, match=r"jax.grad of jax.jvp.*jax.jvp of jax.grad"):
    jax.grad(lambda q: jax.jvp(f, (q,), (q,))[1])(q)

def test_block_mask_states_follow_their_definition():
  """A tile is FULL when mask_mod holds on all its real entries, EMPTY on none, else PARTIAL;
  its lists hold exactly the non-empty blocks, ascending, and take O(blocks) memory."""
  q_len, kv_len = 37, 29
  mask_mod = strided(q_len, kv_len, stride=1)   # causal: full, partial and empty tiles
  block_mask = flex.create_block_mask(mask_mod, None, None, q_len, kv_len, block_q=8, block_k=4)
  allowed = np.asarray(mask_mod(*grid(1, 1, q_len, kv_len)))[0, 0]
  expected = np.zeros((5, 8), int)
  for i in range(5):
    for j in range(8):
      tile = allowed[8 * i:8 * i + 8, 4 * j:4 * j + 4]
      expected[i, j] = flex.FULL if tile.all() else flex.PARTIAL if tile.any() else flex.EMPTY
  np.testing.assert_array_equal(block_mask.states()[0, 0], expected)
  counts, indices = np.asarray(block_mask.kv_num_blocks[0, 0]), np.asarray(block_mask.kv_indices)
  assert indices.shape == (1, 1, 5, counts.max())
  for i in range(5):
    np.testing.assert_array_equal(indices[0, 0, i, :counts[i]], np.flatnonzero(expected[i]))
  # and per key block the query blocks that visit it (the backward's lists), with their states
  q_counts, q_indices = np.asarray(block_mask.q_num_blocks[0, 0]), block_mask.q_indices[0, 0]
  for j in range(8):
    visits = np.flatnonzero(expected[:, j])
    np.testing.assert_array_equal(q_indices[j, :q_counts[j]], visits)
    np.testing.assert_array_equal(block_mask.q_full[0, 0, j, :q_counts[j]],
                                  expected[visits, j] == flex.FULL)


def test_shapes_and_lengths_are_checked():
  q, k = normal(0, (1, 10, 4, 8)), normal(1, (1, 12, 2, 8))
  mask = flex.create_block_mask(causal(10, 10), None, None, 10, 10, **BLOCKS)
  with pytest.raises(ValueError, match="kv_len=10"):
    flex.flex_attention(q, k, k, block_mask=mask)
  with pytest.raises(ValueError, match="block_q"):
    flex.create_block_mask(causal(10, 10), None, None, 10, 10, block_q=0)
  with pytest.raises(ValueError, match="heads=3"):
    flex.flex_attention(q, k, k, block_mask=flex.create_block_mask(
        lambda b, h, q, kv: h >= 0, None, 3, 10, 12, **BLOCKS))


def test_dropout_backward_matches_its_forward():
  """The backward regenerates each tile's dropout draws: the gradient along a random direction
  equals the central difference of the forward; without a key the output is the plain one."""
  n = 19
  q, k, v = normal(0, (1, n, 2, 4)), normal(1, (1, n, 1, 4)), normal(2, (1, n, 1, 4))
  mask = flex.create_block_mask(causal(n, n), None, None, n, n, **BLOCKS)
  key = jax.random.key(3)
  weights = normal(4, q.shape)
  loss = jax.jit(lambda q, k, v: jnp.sum(weights * flex.flex_attention(
      q, k, v, block_mask=mask, dropout_rate=0.3, dropout_rng=key)))
  plain, without_key = jax.jit(lambda q, k, v: (
      flex.flex_attention(q, k, v, block_mask=mask),
      flex.flex_attention(q, k, v, block_mask=mask, dropout_rate=0.3)))(q, k, v)
  assert float(jnp.abs(loss(q, k, v) - jnp.sum(weights * plain))) > 1e-2
  np.testing.assert_array_equal(without_key, plain)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  directions = [normal(5 + i, x.shape) for i, x in enumerate((q, k, v))]
  eps = 1e-2
  moved = lambda sign: loss(*(x + sign * eps * d for x, d in zip((q, k, v), directions)))
  numerical = (moved(1) - moved(-1)) / (2 * eps)
  analytic = sum(jnp.sum(g * d) for g, d in zip(grads, directions))
  np.testing.assert_allclose(analytic, numerical, rtol=1e-3, atol=1e-3)


def lse_oracle(q, k, mask_mod, kv_mask):
  """log Σ_allowed exp(q·k / sqrt(d)) in float64 [b, q_len, h]; -inf where nothing is allowed."""
  with jax.enable_x64(True):
    b, q_len, h, d = q.shape
    k = jnp.repeat(jnp.asarray(k, jnp.float64), h // k.shape[2], axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", jnp.asarray(q, jnp.float64), k) * d ** -0.5
    allowed = jnp.broadcast_to(mask_mod(*grid(b, h, q_len, k.shape[1])), scores.shape)
    allowed = allowed & jnp.asarray(kv_mask)[:, None, None, :]
    lse = jax.nn.logsumexp(jnp.where(allowed, scores, -jnp.inf), axis=-1)   # [b, h, q]
    return jnp.swapaxes(lse, 1, 2)


def test_the_log_sum_exp_and_its_gradient_equal_the_dense_oracle():
  """return_lse: the rows' log-sum-exp (-inf where a row sees no key) and a loss of both outputs
  differentiated through the engine's backward."""
  n = 23
  mask_mod = empty_rows(n, n)
  block_mask = flex.create_block_mask(mask_mod, None, None, n, n, **BLOCKS)
  kv_mask = np.ones((BATCH, n), bool)
  kv_mask[1, -4:] = False
  q, k, v = normal(0, (BATCH, n, HEADS, HEAD_DIM)), *(normal(s, (BATCH, n, 2, HEAD_DIM))
                                                      for s in (1, 2))
  weights, lse_weights = normal(3, q.shape), normal(4, (BATCH, n, HEADS))

  def loss(attend):
    def value(q, k, v):
      out, lse = attend(q, k, v)
      return jnp.sum(weights * out) + jnp.sum(lse_weights * jnp.where(lse > -jnp.inf, lse, 0.0))
    return value

  ours = lambda q, k, v: flex.flex_attention(q, k, v, block_mask=block_mask, kv_mask=kv_mask,
                                             return_lse=True)
  oracle = lambda q, k, v: (dense_oracle(q, k, v, mask_mod=mask_mod, kv_mask=kv_mask),
                            lse_oracle(q, k, mask_mod, kv_mask))
  lse = jax.jit(ours)(q, k, v)[1]
  want = lse_oracle(q, k, mask_mod, kv_mask)
  assert lse.shape == (BATCH, n, HEADS) and lse.dtype == jnp.float32
  np.testing.assert_array_equal(np.isinf(lse), np.isinf(want))
  assert np.isinf(want).any() and np.isfinite(want).any()
  np.testing.assert_allclose(np.where(np.isinf(want), 0, lse), np.where(np.isinf(want), 0, want),
                             atol=1e-5, rtol=0)
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
  with jax.enable_x64(True):
    expected = jax.grad(loss(oracle), argnums=(0, 1, 2))(q, k, v)
  for what, g, w in zip("qkv", got, expected):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=0, err_msg=f"d{what}")


def test_attention_over_disjoint_keys_merges_by_the_log_sum_exp():
  """Even and odd key blocks in two calls, weighed by softmax of their lse: causal attention,
  forward and gradients."""
  n = 29
  halves = [lambda b, h, qi, kv, parity=parity: (kv <= qi) & ((kv // 8) % 2 == parity)
            for parity in (0, 1)]

  def merged(q, k, v):
    parts = [flex.flex_attention(q, k, v, return_lse=True, block_mask=flex.create_block_mask(
        half, None, None, n, n, **BLOCKS)) for half in halves]
    lse = jnp.stack([lse for _, lse in parts], -1)                          # [b, n, h, 2]
    share = az.reference.masked_softmax(lse, lse > -jnp.inf)
    return sum(share[..., i, None] * out for i, (out, _) in enumerate(parts))

  assert_matches(merged, lambda q, k, v: dense_oracle(q, k, v, mask_mod=causal(n, n)), n, n, 2)


def test_block_mask_from_states_equals_create_block_mask():
  mask_mod = sliding_window(37, 29)
  built = flex.create_block_mask(mask_mod, None, None, 37, 29, **BLOCKS)
  given = flex.block_mask_from_states(built.states(), mask_mod, 37, 29, **BLOCKS)
  for field in ("kv_num_blocks", "kv_indices", "kv_full", "q_num_blocks", "q_indices", "q_full"):
    np.testing.assert_array_equal(getattr(given, field), getattr(built, field), err_msg=field)
  with pytest.raises(ValueError, match=r"\[·, ·, 5, 4\]"):
    flex.block_mask_from_states(built.states()[..., :3], mask_mod, 37, 29, **BLOCKS)


def test_mask_data_traced_in_a_loop_body_is_differentiable():
  """Segment ids computed inside a lax.map body and closed over by mask_mod: the backward, traced
  outside that body, gets them as arguments (jax.closure_convert would leave integer arrays in
  the closure, where they leak)."""
  n = 20
  cuts = jnp.asarray([[6, 13], [9, 15]])

  def segment_ids(cut):   # [n]
    return (jnp.arange(n)[:, None] >= cut).sum(-1)

  def ours(q, k, v):
    def row(args):
      q, k, v, cut = args
      ids = segment_ids(cut)
      mask = flex.create_block_mask(lambda b, h, qi, kv: ids[qi] == ids[kv], None, None, n, n,
                                    **BLOCKS)
      return flex.flex_attention(q[None], k[None], v[None], block_mask=mask)[0]
    return jax.lax.map(row, (q, k, v, cuts))

  ids = jnp.stack([segment_ids(cut) for cut in cuts])
  same = lambda b, h, qi, kv: ids[b, qi] == ids[b, kv]
  assert_matches(ours, lambda q, k, v: dense_oracle(q, k, v, mask_mod=same), n, n, 2)


@pytest.mark.slow
def test_compiled_memory_is_linear_in_length():
  """A 128-token sliding window, forward+backward: 8K at most 4.5x 2K in temp bytes."""
  def temp_bytes(n):
    mask_mod = lambda b, h, q, kv: jnp.abs(q - kv) <= 128

    def loss(q, k, v):
      block_mask = flex.create_block_mask(mask_mod, None, None, n, n)
      return jnp.sum(flex.flex_attention(q, k, v, block_mask=block_mask))

    q = jax.ShapeDtypeStruct((1, n, 2, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, n, 1, 32), jnp.float32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  at_2k, at_8k = temp_bytes(2048), temp_bytes(8192)
  assert at_8k <= 4.5 * at_2k, f"{at_8k / 2**20:.1f} MiB at 8K vs {at_2k / 2**20:.1f} MiB at 2K"



@pytest.mark.slow
def test_forward_mode_compiled_memory_is_linear_in_length():
  """jax.jvp through a 128-token sliding window (the plain forward's loops, differentiated by
  JAX): 8K at most 4.5x 2K in temp bytes, as the custom VJP's backward."""
  def temp_bytes(n):
    block_mask = flex.create_block_mask(lambda b, h, q, kv: jnp.abs(q - kv) <= 128, None, None,
                                        n, n)
    attend = lambda q, k, v: flex.flex_attention(q, k, v, block_mask=block_mask)
    q = jax.ShapeDtypeStruct((1, n, 2, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, n, 1, 32), jnp.float32)
    pushforward = jax.jit(lambda args, tangents: jax.jvp(attend, args, tangents))
    compiled = pushforward.lower((q, kv, kv), (q, kv, kv)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  at_2k, at_8k = temp_bytes(2048), temp_bytes(8192)
  assert at_8k <= 4.5 * at_2k, f"{at_8k / 2**20:.1f} MiB at 8K vs {at_2k / 2**20:.1f} MiB at 2K"

def python_block(page: str, marker: str) -> str:
  text = (Path(__file__).resolve().parents[2] / page).read_text(encoding="utf-8")
  return next(block for block in re.findall(r"```python\n(.*?)```", text, flags=re.S)
              if marker in block)


def test_the_readme_example_runs():
  q, kv = normal(0, (2, 1000, 8, 64)), normal(1, (2, 1000, 2, 64))
  namespace = {"q": q, "kv": kv, "jnp": jnp}
  exec(python_block("README.md", "create_block_mask"), namespace)   # noqa: S102 - our own README
  assert namespace["out"].shape == (2, 1000, 8, 64)
  position = np.arange(1024)                          # padded to 8 blocks of 128
  document = np.where(position < 1000, position // 250, -1)
  seen = ((document[:, None] == document[None, :]) & (document[:, None] >= 0)
          & (position[None, :] <= position[:, None]))
  seen_tiles = seen.reshape(8, 128, 8, 128).any(axis=(1, 3))
  np.testing.assert_array_equal(namespace["mask"].states()[0, 0] != flex.EMPTY, seen_tiles)


@pytest.mark.parametrize("check", [pytest.param("exact", marks=pytest.mark.slow), "causal",
                                   "padding"])
def test_the_docs_mask_function_variant_passes_conformance(check):
  """docs/adding_an_attention.md's shortest exact variant, run from the page."""
  with az.scoped_registry():
    exec(python_block("docs/adding_an_attention.md", '"dilated_window"'), {})   # noqa: S102
    result = conformance.run_check(check, "dilated_window")
  assert result.status == "pass", result.describe()
