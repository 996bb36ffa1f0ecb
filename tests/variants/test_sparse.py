"""The sparse family (local, sliding_window, sparse_transformer, longformer, bigbird): flex engine
results against the dense oracle over their own pattern, and the patterns against their
definitions, written out here entry by entry."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_zoo import reference
from attention_zoo.models import Classifier, TransformerConfig
from helpers import largest_backward_array, create_variant, normal, padding_mask, random_qkv

HEADS, HEAD_DIM = 4, 8


def build(name, **options):
  return create_variant(name, num_heads=HEADS, head_dim=HEAD_DIM, **options)


def qkv(seed, q_len, kv_len, num_kv_heads):
  return random_qkv(seed, q_len=q_len, kv_len=kv_len, num_heads=HEADS,
                    num_kv_heads=num_kv_heads, head_dim=HEAD_DIM)


def padding(length, seed):
  """Batch row 0 whole; row 1 with a masked tail and a masked position inside."""
  return padding_mask(2, length, hole=(3 * seed) % length, tail=1 + seed % 3)


def vjp_of(f):
  """Compiled (q, k, v, cotangent) -> (f(q, k, v), its vjp for q, k, v)."""
  return jax.jit(lambda q, k, v, ct: (lambda out, back: (out, back(ct)))(*jax.vjp(f, q, k, v)))


# name, options, q_len, kv_len, num_kv_heads, causal: lengths mostly not multiples of the block
ORACLE_CASES = [
    ("local", dict(block_size=5), 23, 23, 2, False),
    ("local", dict(block_size=4), 16, 16, 1, True),
    ("local", dict(block_size=5), 9, 23, 2, True),        # cross: queries at the last positions
    ("local", dict(block_size=5), 23, 9, 4, False),       # cross: more queries than keys
    ("sliding_window", dict(window=3), 23, 23, 2, True),
    ("sliding_window", dict(window=4), 37, 37, 1, False),
    ("sliding_window", dict(window=50), 13, 13, 2, False),  # window longer than the sequence
    ("sliding_window", dict(window=3), 9, 23, 2, False),
    ("sliding_window", dict(window=3), 23, 9, 4, True),
    # 3 loop steps in the first case, one step in the second
    ("sparse_transformer", dict(block_size=5, num_summary=2, query_chunk=10), 23, 23, 2, False),
    ("sparse_transformer", dict(block_size=4, num_summary=1), 37, 37, 1, True),
    ("sparse_transformer", dict(block_size=5, num_summary=2, query_chunk=5), 9, 23, 2, True),
    # summaries = whole blocks
    ("sparse_transformer", dict(block_size=5, num_summary=5), 23, 9, 4, False),
    ("longformer", dict(window=3, dilation=1, num_global_tokens=1), 23, 23, 2, True),
    ("longformer", dict(window=2, dilation=3, num_global_tokens=2), 29, 29, 1, False),
    ("longformer", dict(window=4, dilation=2, num_global_tokens=0), 17, 17, 4, True),
    ("longformer", dict(window=2, num_global_tokens=2, global_projections=False), 19, 19, 2, True),
    ("bigbird", dict(block_size=3, num_window_blocks=3, num_random_blocks=2, seed=1),
     35, 35, 2, False),
    ("bigbird", dict(block_size=4, num_window_blocks=1, num_random_blocks=3, seed=2),
     30, 30, 1, True),
    ("bigbird", dict(block_size=2, num_window_blocks=5, num_random_blocks=4, seed=3),
     13, 13, 4, False),  # few to draw
]


def oracle_params():
  """ORACLE_CASES with ALiBi in every other case; each variant's first case in the fast lane."""
  seen = set()
  for i, (name, options, q_len, kv_len, num_kv_heads, causal) in enumerate(ORACLE_CASES):
    yield pytest.param(name, options, q_len, kv_len, num_kv_heads, causal, i % 2 == 0,
                       marks=pytest.mark.slow if name in seen else (),
                       id=f"{name}-{q_len}x{kv_len}-{'causal' if causal else 'bidir'}"
                          f"{'-alibi' * (i % 2 == 0)}")
    seen.add(name)


@pytest.mark.parametrize("name, options, q_len, kv_len, num_kv_heads, causal, alibi",
                         list(oracle_params()))
def test_equals_dense_oracle_over_own_pattern(name, options, q_len, kv_len, num_kv_heads, causal,
                                              alibi):
  attn = build(name, causal=causal, num_kv_heads=num_kv_heads, **options)
  seed = q_len * 7 + kv_len
  q, k, v = qkv(seed, q_len, kv_len, num_kv_heads)
  q_mask, kv_mask = padding(q_len, seed), padding(kv_len, seed + 1)
  slopes = jnp.linspace(0.3, 0.05, HEADS) if alibi else None
  pattern = attn.pattern(q_len, kv_len)
  assert pattern.dtype == bool and pattern.shape in ((1, q_len, kv_len), (HEADS, q_len, kv_len))
  allowed = (pattern[None] & np.asarray(q_mask)[:, None, :, None]
             & np.asarray(kv_mask)[:, None, None, :])                    # [b, h, q, k]
  bias = None if slopes is None else reference.alibi_bias(
      slopes, jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :], q_len, kv_len)[None]

  def ours(q, k, v):
    return attn(q, k, v, q_mask=q_mask, kv_mask=kv_mask, alibi_slopes=slopes)

  def oracle(q, k, v):
    out = reference.dense_attention(q, k, v, allowed, scale=attn.scale, bias=bias)
    return jnp.where(q_mask[:, :, None, None], out, 0)

  cotangent = normal(seed + 3, q.shape)
  out, grads = vjp_of(ours)(q, k, v, cotangent)
  expected, expected_grads = vjp_of(oracle)(q, k, v, cotangent)
  np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)
  for what, g, eg in zip("qkv", grads, expected_grads):
    np.testing.assert_allclose(g, eg, atol=1e-5, rtol=0, err_msg=f"d{what}")


# -- the patterns against their definitions, entry by entry -----------------------------------

def definition(rule, q_len, kv_len, causal):
  """[q_len, kv_len] from rule(i', j) on the bottom-right aligned query position i'."""
  offset = kv_len - q_len
  return np.array([[rule(i + offset, j) and (not causal or j <= i + offset) for j in range(kv_len)]
                   for i in range(q_len)])


SHAPES = [(14, 14), (5, 14), (14, 5), (1, 9)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_len, kv_len", SHAPES)
def test_local_pattern(q_len, kv_len, causal):
  block = 4
  expected = definition(lambda i, j: i // block == j // block, q_len, kv_len, causal)
  pattern = build("local", causal=causal, block_size=block).pattern(q_len, kv_len)[0]
  np.testing.assert_array_equal(pattern, expected)
  if q_len == kv_len and not causal:   # contiguous blocks on the diagonal, not strided groups
    blocks = [np.ones((min(block, q_len - s), min(block, q_len - s)), bool)
              for s in range(0, q_len, block)]
    np.testing.assert_array_equal(expected, jax.scipy.linalg.block_diag(*blocks))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_len, kv_len", SHAPES)
def test_sliding_window_pattern(q_len, kv_len, causal):
  w = 3
  expected = definition(lambda i, j: abs(i - j) <= w, q_len, kv_len, causal)
  pattern = build("sliding_window", causal=causal, window=w).pattern(q_len, kv_len)[0]
  np.testing.assert_array_equal(pattern, expected)


@pytest.mark.parametrize("length, window, num_kv_heads, causal",
                         [(29, 3, 2, False), (16, 5, 1, True), (12, 20, 4, False),
                          (21, 4, 2, True)])
def test_sliding_window_equals_jax_local_window(length, window, num_kv_heads, causal):
  """An implementation we did not write: jax.nn.dot_product_attention(local_window_size=...)."""
  q, k, v = qkv(length, length, length, num_kv_heads)
  kv_mask = padding(length, 1)
  attn = build("sliding_window", causal=causal, num_kv_heads=num_kv_heads, window=window)
  theirs = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=kv_mask[:, None, None, :], is_causal=causal,
      local_window_size=(window, 0 if causal else window))
  ours = lambda q, k, v: attn(q, k, v, kv_mask=kv_mask)
  np.testing.assert_allclose(*jax.jit(lambda *x: (ours(*x), theirs(*x)))(q, k, v), atol=1e-5,
                             rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_len, kv_len", SHAPES + [(23, 23)])
def test_sparse_transformer_pattern(q_len, kv_len, causal):
  block, c = 5, 2
  own_block = lambda i, j: i // block == j // block
  summary = lambda j: j % block in range(block - c, block)    # the last c positions of a block
  expected = definition(lambda i, j: own_block(i, j) or summary(j), q_len, kv_len, causal)
  attn = build("sparse_transformer", causal=causal, block_size=block, num_summary=c)
  pattern = attn.pattern(q_len, kv_len)[0]
  np.testing.assert_array_equal(pattern, expected)
  if causal and q_len == kv_len:   # causal: own block up to i, and only earlier blocks' summaries
    for i in range(q_len):
      others = [j for j in np.flatnonzero(pattern[i]) if not own_block(i, j)]
      assert all(summary(j) and j // block < i // block for j in others)
      assert len(others) == c * (i // block)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window, dilation, num_global", [(2, 1, 1), (2, 3, 2), (3, 2, 0)])
def test_longformer_pattern(window, dilation, num_global, causal):
  n = 19

  def rule(i, j):
    in_window = abs(i - j) <= window * dilation and (i - j) % dilation == 0
    return in_window or i < num_global or j < num_global

  attn = build("longformer", causal=causal, window=window, dilation=dilation,
               num_global_tokens=num_global)
  np.testing.assert_array_equal(attn.pattern(n, n)[0], definition(rule, n, n, causal))
  if dilation > 1 and num_global == 0 and not causal:   # a row sees 2w + 1 keys, dilation apart
    assert attn.pattern(n, n)[0, n // 2].sum() == 2 * window + 1


def dense_over_pattern(attn, q, k, v, mask, slopes):
  """reference.dense_attention over attn.pattern() and the padding mask (self-attention)."""
  n = q.shape[1]
  real = np.asarray(mask)
  allowed = attn.pattern(n, n)[None] & real[:, None, :, None] & real[:, None, None, :]
  bias = None if slopes is None else reference.alibi_bias(
      slopes, jnp.arange(n)[:, None], jnp.arange(n)[None, :], n, n)[None]
  out = reference.dense_attention(q, k, v, allowed, scale=attn.scale, bias=bias)
  return jnp.where(mask[:, :, None, None], out, 0)


def longformer_oracle(attn, q, k, v, mask, slopes):
  """Rows i >= g: dense attention of the given q, k, v; the global rows i < g: of q W_qg,
  k W_kg, v W_vg (per head / per K/V head)."""
  mapped = lambda x, w: jnp.einsum("bnhd,hde->bnhe", x, w[...], precision="highest")
  global_rows = dense_over_pattern(attn, mapped(q, attn.global_query), mapped(k, attn.global_key),
                                   mapped(v, attn.global_value), mask, slopes)
  is_global = (jnp.arange(q.shape[1]) < attn.num_global)[None, :, None, None]
  return jnp.where(is_global, global_rows, dense_over_pattern(attn, q, k, v, mask, slopes))


@pytest.mark.parametrize("causal, num_kv_heads, alibi", [
    pytest.param(False, 2, True, marks=pytest.mark.slow), (True, 1, False),
    pytest.param(False, 4, False, marks=pytest.mark.slow)])
def test_longformer_global_rows_use_their_own_projections(causal, num_kv_heads, alibi):
  """With W_qg, W_kg, W_vg moved away from the identity: the global rows equal dense attention of
  the mapped q, k, v, every other row (also where it sees a global key) the ordinary one;
  output and gradients, and the maps receive gradients."""
  n, g = 21, 3
  attn = build("longformer", causal=causal, num_kv_heads=num_kv_heads, window=2, dilation=2,
               num_global_tokens=g)
  for i, w in enumerate((attn.global_query, attn.global_key, attn.global_value)):
    np.testing.assert_array_equal(w[...], np.broadcast_to(np.eye(HEAD_DIM), w.shape))  # at init: I
    w[...] = w[...] + 0.3 * normal(50 + i, w.shape)
  q, k, v = qkv(51, n, n, num_kv_heads)
  mask = padding(n, 2)
  slopes = jnp.linspace(0.3, 0.05, HEADS) if alibi else None
  ours = lambda q, k, v: attn(q, k, v, q_mask=mask, kv_mask=mask, alibi_slopes=slopes)
  oracle = lambda q, k, v: longformer_oracle(attn, q, k, v, mask, slopes)
  cotangent = normal(52, q.shape)
  out, grads = vjp_of(ours)(q, k, v, cotangent)
  expected, expected_grads = vjp_of(oracle)(q, k, v, cotangent)
  np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)
  for what, grad, expected_grad in zip("qkv", grads, expected_grads):
    np.testing.assert_allclose(grad, expected_grad, atol=1e-5, rtol=0, err_msg=f"d{what}")
  unmapped = jax.jit(lambda q, k, v: dense_over_pattern(attn, q, k, v, mask, slopes))(q, k, v)
  assert float(jnp.abs(out[:, :g] - unmapped[:, :g]).max()) > 1e-2     # the maps act on global rows
  loss = lambda m: jnp.sum(m(q, k, v, q_mask=mask, kv_mask=mask, alibi_slopes=slopes) * cotangent)
  param_grads = nnx.jit(nnx.grad(loss))(attn)   # one program, not op by op
  for w in (param_grads.global_query, param_grads.global_key, param_grads.global_value):
    assert float(jnp.abs(w[...]).sum()) > 0


def test_longformer_global_projections_switched_off_or_without_global_tokens():
  count = lambda m: len(jax.tree.leaves(nnx.state(m, nnx.Param)))
  assert count(build("longformer", num_global_tokens=2)) == 3
  assert count(build("longformer", num_global_tokens=2, global_projections=False)) == 0
  assert count(build("longformer", num_global_tokens=0)) == 0


def bigbird_blocks_seen(pattern, block):
  """{(head, query block): set of key blocks with any visible entry}; a block is all or nothing."""
  heads, n, _ = pattern.shape
  num_blocks = -(-n // block)
  seen = {}
  for h, a in itertools.product(range(heads), range(num_blocks)):
    rows = pattern[h, a * block:(a + 1) * block]
    seen[h, a] = {b for b in range(num_blocks) if rows[:, b * block:(b + 1) * block].any()}
  return seen


@pytest.mark.parametrize("n, block, window_blocks, r",
                         [(40, 4, 3, 2), (37, 3, 3, 3), (14, 2, 5, 3)])
def test_bigbird_pattern(n, block, window_blocks, r):
  attn = build("bigbird", block_size=block, num_window_blocks=window_blocks, num_random_blocks=r,
               seed=5)
  pattern = attn.pattern(n, n)
  assert pattern.shape == (HEADS, n, n)
  last, half = -(-n // block) - 1, window_blocks // 2
  for (h, a), seen in bigbird_blocks_seen(pattern, block).items():
    if a in (0, last):                           # global rows see everything
      assert seen == set(range(last + 1))
      continue
    window = {b for b in range(last + 1) if abs(a - b) <= half}
    random = seen - window - {0, last}
    assert {0, last} | window <= seen
    eligible = set(range(1, last)) - window
    assert len(random) == min(r, len(eligible)), (h, a, seen)
    assert random == set(attn.random_table(n)[h, a]) - {-1}
  assert pattern[:, :, :block].all() and pattern[:, :, last * block:].all()   # global columns
  tables = attn.random_table(n)
  if r < 5 and last > 8:   # heads draw their own blocks
    assert any(not np.array_equal(tables[0], tables[h]) for h in range(1, HEADS))


def test_bigbird_causal_pattern():
  n, block, half, r = 45, 3, 1, 2
  attn = build("bigbird", causal=True, block_size=block, num_window_blocks=2 * half + 1,
               num_random_blocks=r)
  pattern = attn.pattern(n, n)
  assert not (pattern & ~np.tril(np.ones((n, n), bool))).any()
  for (h, a), seen in bigbird_blocks_seen(pattern, block).items():
    past_window = {b for b in range(a - half, a + 1) if b >= 0}
    assert past_window | {0} <= seen
    random = seen - past_window - {0}
    assert all(b < a - half for b in random)
    assert len(random) == min(r, max(0, a - half - 1))


def test_bigbird_random_blocks_fixed_by_seed_and_drawn_from_whole_sequence():
  make = lambda seed: build("bigbird", block_size=64, seed=seed)
  n = 64 * 64   # 64 blocks
  table = make(0).random_table(n)
  np.testing.assert_array_equal(table, make(0).random_table(n))          # same seed, same table
  assert not np.array_equal(table, make(1).random_table(n))              # another seed, another
  assert table.max() >= 1024 // 64 + 10    # blocks beyond the first 1024 tokens are drawn too
  assert table.shape == (HEADS, 64, 3) and (table[:, 1:-1] >= 1).all()
  q, k, v = qkv(0, 60, 60, 2)
  small = build("bigbird", block_size=4, num_random_blocks=2)
  # two compilations
  first, again = (jax.jit(lambda q, k, v: small(q, k, v))(q, k, v) for _ in range(2))
  np.testing.assert_array_equal(first, again)                             # same every call


def bigbird_layer_patterns(model_seed, n=40, **options):
  """The pattern of each self-attention layer of a 2-layer bigbird Classifier."""
  config = TransformerConfig(vocab_size=8, max_len=n - 1, num_layers=2, emb_dim=16, num_heads=2,
                             mlp_dim=16, attention="bigbird", num_classes=2,
                             attention_options={"block_size": 2, "num_random_blocks": 2, **options})
  model = Classifier(config, rngs=nnx.Rngs(model_seed))   # n - 1 tokens + CLS = n positions
  return [block.self_attention.attention.pattern(n, n) for block in model.encoder.blocks]


def test_bigbird_layers_draw_their_own_random_blocks_from_the_model_seed():
  """seed=None (default): each layer's table comes from the params stream, so the layers of one
  model differ and the same model seed rebuilds the same tables; an int seed is shared."""
  first, second = bigbird_layer_patterns(0)
  assert not np.array_equal(first, second)
  again = bigbird_layer_patterns(0)
  np.testing.assert_array_equal(again[0], first)
  np.testing.assert_array_equal(again[1], second)
  assert not np.array_equal(bigbird_layer_patterns(1)[0], first)
  fixed = bigbird_layer_patterns(0, seed=7)
  np.testing.assert_array_equal(fixed[0], fixed[1])
  abstract = nnx.eval_shape(lambda: build("bigbird"))       # shapes only: the table is unknown
  with pytest.raises(ValueError, match="abstractly"):
    abstract.pattern(8, 8)


# -- options and refusals --------------------------------------------------------------------

@pytest.mark.parametrize("name, options, fragment", [
    ("local", dict(block_size=0), "block_size"),
    ("sliding_window", dict(window=-1), "window"),
    ("sliding_window", dict(window=2.5), "window"),
    ("sparse_transformer", dict(block_size=4, num_summary=5), "num_summary"),
    ("sparse_transformer", dict(query_chunk=0), "query_chunk"),
    ("longformer", dict(dilation=0), "dilation"),
    ("longformer", dict(num_global_tokens=-1), "num_global_tokens"),
    ("longformer", dict(global_projections="yes"), "global_projections"),
    ("bigbird", dict(num_window_blocks=2), "num_window_blocks"),
    ("bigbird", dict(num_random_blocks=-1), "num_random_blocks"),
    ("bigbird", dict(seed=-3), "seed"),
])
def test_bad_options_are_named(name, options, fragment):
  with pytest.raises(ValueError, match=fragment):
    build(name, **options)


@pytest.mark.parametrize("name", ["longformer", "bigbird"])
def test_self_attention_only_variants_say_so(name):
  attn = build(name)
  q, k, v = qkv(0, 8, 12, 2)
  with pytest.raises(ValueError, match="q_len"):
    attn(q, k, v)
  with pytest.raises(ValueError, match="self-attention"):
    attn.pattern(8, 12)


# -- no n x n tensor -------------------------------------------------------------------------

@pytest.mark.parametrize("name, options", [
    ("local", dict(block_size=16)), ("sliding_window", dict(window=16)),
    ("sparse_transformer", dict(block_size=16, num_summary=2, query_chunk=64)),
    ("longformer", dict(window=8, dilation=2, num_global_tokens=2)),
    ("bigbird", dict(block_size=16))])
def test_no_quadratic_intermediate(name, options):
  """Forward and backward hold no tensor with n² or more elements (a dense score or mask)."""
  n = 1024
  attn = build(name, num_kv_heads=1, **options)
  biggest = largest_backward_array(attn, n, HEADS, HEAD_DIM)
  assert biggest < n * n, f"{name}: an intermediate has {biggest} >= n² = {n * n} elements"
