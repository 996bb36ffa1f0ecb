"""Packed sequences (segment_ids) in every op of attention_zoo.ops, chunk and token forms and
Forgetting Attention: a packed call equals its segments run apart (each from a zero state, the
first from initial_state; the final state the last segment's), outputs, final state and the
gradients of every input, with segment boundaries off and on the chunk boundaries, a
one-token segment, a masked segment start, and equal ids in separate runs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_zoo import ops
from tests.ops import test_ops
from tests.ops_reference import assert_close

B, T, H, K, V = 2, 37, 2, 8, 6
CHUNK = 16
# Row 0: boundaries at 5, 19, 20 (off the chunks of 16), a one-token segment, ids 7 and 3
# alternating (equal ids in separate runs are separate sequences). Row 1: one boundary at 16
# (on a chunk boundary).
SEGMENTS = ([(7, 5), (3, 14), (7, 1), (3, 17)], [(0, 16), (1, 21)])   # (id, length) per row


def segment_ids():
  return np.stack([np.repeat(*map(np.array, zip(*row))) for row in SEGMENTS]).astype(np.int32)


def padding_mask():
  """Holes inside segments, and the one-token segment (position 19) masked whole."""
  mask = np.ones((B, T), bool)
  mask[0, [2, 19, 30]] = False
  mask[1, 17] = False
  return mask


RECURRENT = [f"{form}_{rule}" for rule in test_ops.OPS for form in ("chunk", "recurrent")]


def split_apart(call, x, mask):
  """The op on each segment alone, one batch row per segment (at its start, right-padded with
  masked tokens): (o [B, T, ...] gathered back, final states [B, ...] of each row's last)."""
  rows, starts, lengths = (np.array(column) for column in zip(*[
      (row, start, length) for row, segments in enumerate(SEGMENTS)
      for start, length in zip(np.cumsum([0] + [n for _, n in segments])[:-1],
                               [n for _, n in segments])]))
  width = lengths.max()
  offset = np.arange(width)
  inside = offset < lengths[:, None]                                  # [segments, width]
  position = np.where(inside, starts[:, None] + offset, 0)
  pieces = {key: value[rows[:, None], position] for key, value in x.items()
            if key != "initial_state"}
  if "initial_state" in x:
    first = (starts == 0).reshape(-1, 1, 1, 1)
    pieces["initial_state"] = jnp.where(first, x["initial_state"][rows], 0.0)
  o, state = call(pieces, mask=jnp.asarray(inside & mask[rows[:, None], position]))
  # each token's segment and offset in it
  segment = np.stack([np.repeat(np.flatnonzero(rows == row), lengths[rows == row])
                      for row in range(B)])                           # [B, T]
  o = o[segment, np.arange(T) - starts[segment]]
  last = [np.flatnonzero(rows == row)[-1] for row in range(B)]
  return o, None if state is None else state[np.array(last)]


def outputs_and_grads(fn, x, do, dS):
  """(o, final state, gradients of Σ o·do + Σ S·dS with respect to every input of x)."""
  def loss(x):
    o, state = fn(x)
    return jnp.sum(o * do) + (0.0 if state is None else jnp.sum(state * dS)), (o, state)
  grads, (o, state) = jax.grad(loss, has_aux=True)(x)
  return o, state, grads


def assert_packed_equals_apart(call, x):
  mask = padding_mask()
  packed_call = lambda x: call(x, mask=jnp.asarray(mask), segment_ids=jnp.asarray(segment_ids()))
  rng = np.random.default_rng(3)
  do = jnp.asarray(rng.normal(size=jax.eval_shape(packed_call, x)[0].shape), jnp.float32)
  dS = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  packed = jax.jit(lambda x: outputs_and_grads(packed_call, x, do, dS))(x)
  apart = jax.jit(lambda x: outputs_and_grads(lambda x: split_apart(call, x, mask), x, do,
                                              dS))(x)
  assert_close(packed[0], apart[0], 1e-5, "o")
  assert np.all(np.asarray(packed[0])[~mask] == 0)
  if packed[1] is not None:
    assert_close(packed[1], apart[1], 1e-5, "final state")
  for key in x:
    assert_close(packed[2][key], apart[2][key], 1e-4, f"d{key}")


@pytest.mark.parametrize("name", RECURRENT)
def test_packed_segments_equal_the_segments_run_apart(name):
  form, rule = name.split("_", 1)
  assert_packed_equals_apart(lambda x, **kw: test_ops.call(rule, form, x, **kw),
                             test_ops.make_inputs(rule))


def test_forgetting_attention_packed_segments_equal_the_segments_run_apart():
  rng = np.random.default_rng(4)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  x = {"q": normal(B, T, H, K), "k": normal(B, T, 1, K), "v": normal(B, T, 1, K),
       "log_f": jax.nn.log_sigmoid(normal(B, T, H) + 2)}           # GQA: one K/V head
  call = lambda x, **kw: (ops.forgetting_attention(x["q"], x["k"], x["v"], x["log_f"],
                                                   block_size=8, **kw), None)
  assert_packed_equals_apart(call, x)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_one_segment_is_no_segments(form):
  """Ids constant along a row (any value) change nothing."""
  x = test_ops.make_inputs("gated_delta_rule")
  ids = jnp.full((B, T), 5, jnp.int32)
  for got, want in zip(test_ops.call("gated_delta_rule", form, x, segment_ids=ids),
                       test_ops.call("gated_delta_rule", form, x)):
    np.testing.assert_array_equal(got, want)


def test_bad_segment_ids_are_refused():
  x = test_ops.make_inputs("gated_delta_rule")
  args = [x[key] for key in ("q", "k", "v", "g", "beta")]
  with pytest.raises(ValueError, match=r"segment_ids must be \[2, 37\]"):
    ops.chunk_gated_delta_rule(*args, segment_ids=jnp.zeros((B, T + 1), jnp.int32))
  with pytest.raises(ValueError, match="segment_ids must be integers"):
    ops.recurrent_gated_delta_rule(*args, segment_ids=jnp.zeros((B, T)))
  with pytest.raises(ValueError, match=r"segment_ids must be int \[B, T\]"):
    ops.forgetting_attention(x["q"], x["k"], x["k"], x["g"], segment_ids=jnp.zeros((B, T)))
