r"""Based (Arora et al. 2024, Simple linear attention language models balance the
recall-throughput tradeoff, arXiv:2402.18668): normalised linear attention whose feature map is
the 2nd-order Taylor expansion of exp, beside a small sliding window of softmax attention.

    φ(x) = [1, x / f^{1/4}, (x ⊗ x) / (√2 √f)],   so  φ(q)ᵀφ(k) = 1 + s + s²/2 ≈ e^s,  s = qᵀk/√f
    S_t = S_{t-1} + φ(k_t) v_tᵀ,   z_t = z_{t-1} + φ(k_t),   o_t = S_tᵀφ(q_t) / (z_tᵀφ(q_t) + ε)
    u_t = Σ_{t-w <= j <= t} softmax_j(d^{-1/2} q̃_tᵀ k̃_j) ṽ_j                (the window, RoPE)
    y_t = W_o [o_t ; u_t] = W_lin o_t + W_win u_t

q and k are projected to a small feature dimension f (16) per head, so φ has 1 + f + f(f+1)/2
features (x ⊗ x is symmetric: each pair x_i x_j, i < j, is kept once with weight 1/√f, the
squares with 1/(√2 √f); 153 for f = 16, the inner product unchanged). 1 + s + s²/2 >= 1/2, so
the normaliser never vanishes on a real token. The state is S and z ([F, d + 1] per head: z is
the column a value of ones writes, `attention_zoo.ops.chunk_simple_gla` without a decay) plus
the window's keys and values of the last w positions, so decoding is O(1) in the length.

The linear attention as its authors define it (based/models/mixers/linear_attention.py, fla's
BasedLinearAttention): q, k [d, h·f] and v [d, h·d_v] projections without bias, the Taylor
map above, causal normalised sums with ε = 1e-12, the output projection; no output norm or
gate. The window: softmax attention over the current token and the w before it (the zoo's
`sliding_window` convention; the authors' 64), its own q, k, v projections, RoPE on q and k,
blockwise on `attention_zoo.ops.flex` (O(n·w), no n x n matrix); decoding keeps the last w keys
and values in position order (a rolling buffer) with a flag per slot for masked tokens.

Where ours differs: the paper's Based model interleaves separate layers (mostly gated short
convolutions, BaseConv, with linear attention layers and a few sliding-window layers). One zoo
mixer instead runs the linear attention and the window side by side on the same input and
sums their projected outputs, so every block of a zoo model has both (window=0: the linear
attention layer alone; BaseConv is not built: the nearest is the models' `short_conv` option,
an ungated depthwise convolution beside the mixer). The authors' window layer
(based/models/mixers/slide_attention.py: flash-attn with window_size = (its option // 2, 0)
keys back) has qkv and output biases and optional rotary embeddings; ours has no biases and
always RoPE. Head dimensions come from the model's (v and the window: qkv_dim / heads);
num_kv_heads < num_heads shares the k and v of both parts between query heads (GQA).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attention_zoo import ops, positions
from attention_zoo.ops import flex, ring
from attention_zoo.ops import softmax
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.mixers import parts
from attention_zoo.ops.context import context_size
from attention_zoo.ops.segments import positions_in_segments, segment_runs
from attention_zoo.options import Int

EPS = 1e-12   # the authors' ε in the normaliser


def taylor_size(feature_dim: int) -> int:
  """Features of φ: 1 + f + f(f+1)/2."""
  return 1 + feature_dim + feature_dim * (feature_dim + 1) // 2


def taylor_features(x):
  """φ(x) [..., taylor_size(f)] float32 of x [..., f]: 1, x / f^{1/4}, the squares over
  √2 √f and the products x_i x_j (i < j) over √f."""
  f = x.shape[-1]
  x = x.astype(jnp.float32)
  i, j = np.triu_indices(f, 1)
  return jnp.concatenate([jnp.ones_like(x[..., :1]), x * f ** -0.25, x * x * (2 * f) ** -0.5,
                          x[..., i] * x[..., j] * f ** -0.5], axis=-1)


@register_mixer("based", complexity="O(n·f²·(C + d) + n·w·d)",
                paper="Arora et al. 2024, Simple linear attention language models balance the "
                      "recall-throughput tradeoff (arXiv:2402.18668)",
                supports_segment_ids=True, supports_context_parallel=True)
class Based(Mixer):
  OPTIONS = {"feature_dim": Int(16, minimum=1), "window": Int(64, minimum=0),
             "chunk_size": Int(64, minimum=1)}
  # A window of 3 and chunks of 8 at the suite's length 20; f = 4 keeps φ small (15 features).
  TEST_OPTIONS = dict(chunk_size=8, window=3, feature_dim=4)

  @classmethod
  def state_size(cls, *, num_heads, num_kv_heads, head_dim, seq_len, options, **dims) -> int:
    """S and z per head, and per window slot k, v per kv head and its flag."""
    window = min(options["window"], seq_len)
    return (num_heads * taylor_size(options["feature_dim"]) * (head_dim + 1)
            + window * (2 * num_kv_heads * head_dim + 1))

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    h, kvh, d, emb, dtype = (self.num_heads, self.num_kv_heads, self.head_dim, self.emb_dim,
                             self.dtype)
    f, self.window = self.options["feature_dim"], self.options["window"]
    self.taylor_qkv = parts.linear(emb, (h + kvh) * f + kvh * d, dtype=dtype, rngs=rngs)
    if self.window and d % 2:
      raise self.option_error("window", f"0 (no window) with an odd head_dim {d}: the "
                                        f"window's RoPE needs an even one")
    self.window_qkv = (parts.linear(emb, (h + 2 * kvh) * d, dtype=dtype, rngs=rngs)
                       if self.window else None)
    self.out = parts.linear((2 if self.window else 1) * h * d, emb, dtype=dtype, rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, kvh, d, f = self.num_heads, self.num_kv_heads, self.head_dim, self.options["feature_dim"]
    q, k, v = jnp.split(self.taylor_qkv(x), [h * f, (h + kvh) * f], axis=-1)
    q = taylor_features(q.reshape(b, n, h, f))                                  # [b, n, h, F]
    k = parts.repeat_kv(taylor_features(k.reshape(b, n, kvh, f)), h)            # [b, n, h, F]
    v = parts.repeat_kv(v.reshape(b, n, kvh, d).astype(jnp.float32), h)         # [b, n, h, d]
    ones = jnp.ones_like(v[..., :1])                 # its column of the state sums φ(k): z
    o, taylor_state = parts.recurrence(
        ops.chunk_simple_gla, ops.recurrent_simple_gla, q, k, jnp.concatenate([v, ones], -1),
        None, mask=mask, state=None if state is None else state["taylor"],
        chunk_size=self.options["chunk_size"], scale=1.0,
        segment_ids=segment_ids)                                                # [b, n, h, d+1]
    outputs = [o[..., :d] / (o[..., d:] + EPS)]                                 # [b, n, h, d]
    new_state = None if state is None else {"taylor": taylor_state}
    if self.window:
      window_out, window_state = self._window(x, mask, state, segment_ids)
      outputs.append(window_out.astype(jnp.float32))                            # [b, n, h, d]
      new_state = None if state is None else {**new_state, **window_state}
    y = jnp.concatenate(outputs, axis=-1).reshape(b, n, -1)
    return self.out(y.astype(self.dtype)), new_state

  def _window(self, x, mask, state, segment_ids=None):
    """The window's output [b, n, h, d], and with a decode state the state's window part:
    the buffer of the last w positions' keys (rotated), values and flags, and the position.
    segment_ids (whole sequences): a query sees the keys of its own run only."""
    b, n, _ = x.shape
    h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
    q, k, v = jnp.split(self.window_qkv(x), [h * d, (h + kvh) * d], axis=-1)
    offset = 0 if state is None else state["position"]
    position_ids = (jnp.arange(n) + offset if segment_ids is None
                    else positions_in_segments(segment_ids))                    # [n] | [b, n]
    q = positions.rope(q.reshape(b, n, h, d), position_ids)                     # [b, n, h, d]
    k = positions.rope(k.reshape(b, n, kvh, d), position_ids)                   # [b, n, kvh, d]
    v = v.reshape(b, n, kvh, d)                                                 # [b, n, kvh, d]
    keys, values, filled = k, v, mask
    runs = None if segment_ids is None else (segment_runs(segment_ids),) * 2
    if state is not None:   # the buffer's positions come just before these tokens
      keys = jnp.concatenate([state["key"], k.astype(state["key"].dtype)], axis=1)
      values = jnp.concatenate([state["value"], v.astype(state["value"].dtype)], axis=1)
      filled = jnp.concatenate([state["filled"], mask], axis=1)                # [b, m + n]
    window = softmax.window_allowed(self.window, n, keys.shape[1], causal=True)
    attend = ring.ring_attention if context_size() > 1 else flex.pattern_attention
    o = attend(q, keys.astype(q.dtype), values.astype(q.dtype), window, kv_mask=filled,
               scale=d ** -0.5, segment_ids=runs)
    if state is None:
      return o, None
    m = state["key"].shape[1]
    return o, {"key": keys[:, -m:], "value": values[:, -m:], "filled": filled[:, -m:],
               "position": offset + n}

  def empty_state(self, batch_size, max_len, dtype):
    h, d = self.num_heads, self.head_dim
    state = {"taylor": jnp.zeros((batch_size, h, taylor_size(self.options["feature_dim"]),
                                  d + 1), jnp.float32)}
    if self.window:
      m = min(self.window, max_len)
      buffer = (batch_size, m, self.num_kv_heads, d)
      state.update(key=jnp.zeros(buffer, dtype), value=jnp.zeros(buffer, dtype),
                   filled=jnp.zeros((batch_size, m), bool), position=jnp.zeros((), jnp.int32))
    return state
