r"""Gated linear attention: the additive rule with a data-dependent decay (no normalisation).

    S_t = Diag(exp g_t) S_{t-1} + k_t v_tᵀ,    o_t = S_tᵀ (scale · q_t)

`*_simple_gla`: one scalar log-decay per head and token, g [B, T, H] (Mamba2's SSD; RetNet is a
constant g; g = 0 is plain causal linear attention, o = tril(Q Kᵀ) V). `*_gla`: one per key
channel, g [B, T, H, K] (GLA, Yang et al. 2023, arXiv:2312.06635). q, k [B, T, H, K],
v [B, T, H, V]; scale None = K^-1/2; initial_state [B, H, K, V] or None (zeros); mask bool
[B, T] or None: a False token leaves the state untouched and outputs 0; segment_ids int [B, T]
or None: packed sequences, each run of equal ids processed as if alone, from a zero state
(initial_state is the first run's). Returns (o [B, T, H, V] in v's dtype, final state
[B, H, K, V] float32: the last run's). The chunk form and the numerics are described in
attention_zoo/ops/engine.py; `recurrent_*` is the token-by-token scan (the decode path: T = 1
with the carried state).
"""
from __future__ import annotations

from attention_zoo.ops.engine import DEFAULT_CHUNK_SIZE, run


def chunk_simple_gla(q, k, v, g, *, scale=None, initial_state=None, mask=None, segment_ids=None,
                     chunk_size=DEFAULT_CHUNK_SIZE):
  """Scalar-gated linear attention, chunkwise parallel."""
  return run("chunk_simple_gla", q, k, v, g, None, per_channel_gate=False, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids,
             chunk_size=chunk_size)


def recurrent_simple_gla(q, k, v, g, *, scale=None, initial_state=None, mask=None,
                         segment_ids=None):
  """Scalar-gated linear attention, token by token."""
  return run("recurrent_simple_gla", q, k, v, g, None, per_channel_gate=False, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids, chunk_size=None)


def chunk_gla(q, k, v, g, *, scale=None, initial_state=None, mask=None, segment_ids=None,
              chunk_size=DEFAULT_CHUNK_SIZE):
  """Per-key-channel gated linear attention, chunkwise parallel."""
  return run("chunk_gla", q, k, v, g, None, per_channel_gate=True, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids,
             chunk_size=chunk_size)


def recurrent_gla(q, k, v, g, *, scale=None, initial_state=None, mask=None, segment_ids=None):
  """Per-key-channel gated linear attention, token by token."""
  return run("recurrent_gla", q, k, v, g, None, per_channel_gate=True, scale=scale,
             initial_state=initial_state, mask=mask, segment_ids=segment_ids, chunk_size=None)
