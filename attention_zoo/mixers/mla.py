r"""Multi-head Latent Attention (MLA; DeepSeek-AI 2024, DeepSeek-V2, arXiv:2405.04434, §2.1):
softmax attention whose keys and values are up-projected per head from one low-rank latent per
token, so that decoding caches the latent instead of K and V.

    c_t^KV = RMSNorm(W^DKV h_t)                  the KV latent, kv_lora_rank = d_c channels
    k_{t,i}^C = W_i^UK c_t^KV,   v_{t,i}^C = W_i^UV c_t^KV                        head i
    c_t^Q = RMSNorm(W^DQ h_t)                    the query latent, q_lora_rank = d_c' channels
                                                 (q_lora_rank=0: c_t^Q = h_t, V2-Lite's plain
                                                 query projection)
    q_{t,i}^C = W_i^UQ c_t^Q,   q_{t,i}^R = RoPE(W_i^QR c_t^Q),   k_t^R = RoPE(W^KR h_t)
    q_{t,i} = [q_{t,i}^C; q_{t,i}^R],   k_{t,i} = [k_{t,i}^C; k_t^R]   (one RoPE key for all heads)
    o_{t,i} = Σ_{j <= t} softmax_j(q_{t,i}ᵀ k_{j,i} / sqrt(d_h + d_h^R)) v_{j,i}^C
    u_t = W^O [o_{t,1}; ...; o_{t,n_h}]

d_h = nope_head_dim (the no-RoPE part of q and k), d_h^R = rope_head_dim, v_head_dim the
value's. The parallel form materialises k_{j,i} and v_{j,i} and runs the softmax on
attention_zoo.ops.flex (flash's causal or full block mask, tiles of `block_size`, None: flash's
defaults; memory linear in the length).

Decoding absorbs the up-projections (the paper's §2.1.2):

    q_{t,i}ᵀ k_{j,i} = (W_i^UKᵀ q_{t,i}^C)ᵀ c_j^KV + q_{t,i}^Rᵀ k_j^R,
    o_{t,i} = W_i^UV Σ_j p_{t,i,j} c_j^KV,

so a step is multi-query attention over the cache, every head reading one key [c_j^KV; k_j^R]
and one value c_j^KV per token, and the cache holds only c^KV and k^R: kv_lora_rank +
rope_head_dim floats per token and layer (`state_size`), where multi-head attention keeps
2·n_h·d_h. RoPE counts every position, masked ones included (as RetNet's).

Why a mixer: MLA owns its projections (an RMSNorm sits between x and its keys and values, and
decoding needs W^UK and W^UV themselves), so there are no q, k, v for an `Attention` to
receive. Registered as a `Mixer`, a layer on x, it is `attention="mla"` in every model
(`create_mixer`, `DecoderLM.generate` with its cache, encoders, padding masks) with no case of
its own in the models. Two class facts of the contract make it attention rather than a
recurrence: ONE_PASS_ENCODER (an encoder's form, bidirectional=True, is one softmax over every
token, not the mean of two causal passes) and WHY_NO_GQA (num_kv_heads must equal num_heads:
every head up-projects its own key and value from the one shared latent, so there are no
key/value heads to share and fewer would not shrink the cache). As a mixer it takes no
attention dropout and no positions from the model (its RoPE is its own, as RetNet's); packed
sequences keep each query to its own run, and RoPE restarts at each.

Where ours differs: the sizes follow the model's head_dim d = qkv_dim / heads by default:
nope_head_dim = v_head_dim = d, rope_head_dim = d / 2 (rounded down to an even number, at least
2) and kv_lora_rank = 4·d, the paper's ratios (d_h^R = d_h / 2, d_c = 4·d_h); q_lora_rank = 0 as
V2-Lite (V2: 1536 = 12·d_h). Projections are bias-free (as DeepSeek's); W^DKV and W^KR are one
matmul, as are W^UK and W^UV. No YaRN (a context-extension rescaling of RoPE).

DeepSeek Sparse Attention over the latent cache (DeepSeek-V3.2-Exp, as the paper pairs them;
option `dsa_top_k` > 0, 0 = off): a lightning indexer,

    I_ts = Σ_{j < H_I} w_tj · ReLU(q^I_tj · k^I_s),   q^I_tj = W^IQ_j c_t^Q,  w_t = W^Iw h_t,
    k^I_s = LayerNorm(W^IK h_s)              H_I = dsa_indexer_heads, e = dsa_indexer_dim

picks each query's top dsa_top_k keys (causally s <= t; all it sees when fewer), and the
attention runs over those only, in the absorbed (MQA) form in training as in decoding: one
selection per token for every head, as the paper's. The cache keeps k^I too. The indexer gets no
gradient (the selection is integers; the paper's KL loss that trains it is not implemented here,
see variants/dsa.py); no RoPE on the indexer (the paper rotates part of q^I and k^I). Tiled as
`dsa` (ops/top_k_selection.py: a running top-k, then a gather). Not with packed sequences or
context parallelism.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from attention_zoo import positions
from attention_zoo.contract import Mixer, register_mixer
from attention_zoo.mixers import parts
from attention_zoo.norms import GatedRMSNorm
from attention_zoo.ops import flex, ring
from attention_zoo.ops.context import context_size
from attention_zoo.ops.flash import chunked
from attention_zoo.ops.top_k_selection import attend_selected, lightning_top_k
from attention_zoo.ops.segments import positions_in_segments, segment_runs
from attention_zoo.options import Float, Int


@dataclasses.dataclass(frozen=True)
class Sizes:
  """MLA's sizes per head (nope, rope, v) and of its latents (kv_rank, q_rank; q_rank 0: no
  query latent)."""
  nope: int
  rope: int
  v: int
  kv_rank: int
  q_rank: int


def sizes_of(head_dim: int, options: dict) -> Sizes:
  """The sizes the options give (None: derived from head_dim, see the module docstring)."""
  given = lambda name, default: default if options[name] is None else options[name]
  return Sizes(nope=given("nope_head_dim", head_dim),
              rope=given("rope_head_dim", max(2, head_dim // 4 * 2)),
              v=given("v_head_dim", head_dim), kv_rank=given("kv_lora_rank", 4 * head_dim),
              q_rank=options["q_lora_rank"])


_SIZE = Int(None, minimum=1, optional=True)   # None: derived from head_dim


@register_mixer("mla", complexity="O(n²) time, O(n) memory",
                paper="DeepSeek-AI 2024, DeepSeek-V2: A Strong, Economical, and Efficient "
                      "Mixture-of-Experts Language Model (arXiv:2405.04434)",
                supports_segment_ids=True, supports_context_parallel=True)
class MultiHeadLatentAttention(Mixer):
  OPTIONS = {"kv_lora_rank": _SIZE, "q_lora_rank": Int(0, minimum=0),
             "rope_head_dim": Int(None, minimum=2, optional=True), "nope_head_dim": _SIZE,
             "v_head_dim": _SIZE, "block_size": _SIZE, "norm_eps": Float(1e-6, above=0),
             "dsa_top_k": Int(0, minimum=0), "dsa_indexer_heads": Int(4, minimum=1),
             "dsa_indexer_dim": Int(32, minimum=1)}
  # Tiles of 8 at the suite's length 20 (several, a partial last one); a query latent; sizes
  # that differ from each other, so a mixed-up axis fails.
  TEST_OPTIONS = dict(block_size=8, q_lora_rank=12, kv_lora_rank=10, rope_head_dim=4,
                      nope_head_dim=6, v_head_dim=5)
  WHY_NO_GQA = ("every head up-projects its own key and value from the one latent all heads "
                "share, which is all decoding caches, so there are no key/value heads to share "
                "(the cache is set by kv_lora_rank)")
  ONE_PASS_ENCODER = True

  @classmethod
  def state_size(cls, *, head_dim, seq_len, options, **dims) -> int:
    """The cache: the KV latent and the shared RoPE key of every token."""
    size = sizes_of(head_dim, options)
    index_key = options["dsa_indexer_dim"] if options["dsa_top_k"] else 0
    return seq_len * (size.kv_rank + size.rope + index_key)

  def __init__(self, *, rngs, **kwargs):
    super().__init__(rngs=rngs, **kwargs)
    self.sizes = size = sizes_of(self.head_dim, self.options)
    if size.rope % 2:
      raise self.option_error("rope_head_dim", "an even number (RoPE rotates pairs)")
    h, emb, eps = self.num_heads, self.emb_dim, self.options["norm_eps"]
    linear = lambda i, o: parts.linear(i, o, dtype=self.dtype, rngs=rngs)
    self.q_down = linear(emb, size.q_rank) if size.q_rank else None              # W^DQ
    self.q_norm = GatedRMSNorm(size.q_rank, eps=eps) if size.q_rank else None
    self.query = linear(size.q_rank or emb, h * (size.nope + size.rope))        # W^UQ | W^QR
    self.kv_down = linear(emb, size.kv_rank + size.rope)                        # W^DKV | W^KR
    self.kv_norm = GatedRMSNorm(size.kv_rank, eps=eps)
    self.kv_up = linear(size.kv_rank, h * (size.nope + size.v))                 # W^UK | W^UV
    self.out = linear(h * size.v, emb)                                          # W^O
    self.scale = (size.nope + size.rope) ** -0.5
    self.dsa_top_k = self.options["dsa_top_k"]
    if self.dsa_top_k:
      heads, dim = self.options["dsa_indexer_heads"], self.options["dsa_indexer_dim"]
      self.index_query = linear(size.q_rank or emb, heads * dim)                 # W^IQ
      self.index_weight = linear(emb, heads)                                     # W^Iw
      self.index_key = linear(emb, dim)                                          # W^IK
      self.index_key_norm = nnx.LayerNorm(dim, rngs=rngs)

  def forward(self, x, mask, state, segment_ids=None):
    b, n, _ = x.shape
    h, size = self.num_heads, self.sizes
    offset = 0 if state is None else state["position"]
    position_ids = (jnp.arange(n) + offset if segment_ids is None
                    else positions_in_segments(segment_ids))                  # [n] | [b, n]
    c_q = x if self.q_down is None else self.q_norm(self.q_down(x)).astype(self.dtype)
    q_nope, q_rope = jnp.split(self.query(c_q).reshape(b, n, h, size.nope + size.rope),
                               [size.nope], axis=-1)                  # [b, n, h, nope], [.., rope]
    q_rope = positions.rope(q_rope, position_ids)
    latent, rope_key = jnp.split(self.kv_down(x), [size.kv_rank], axis=-1)  # [b, n, r], [.., rope]
    latent = self.kv_norm(latent).astype(self.dtype)
    rope_key = positions.rope(rope_key[:, :, None], position_ids)[:, :, 0]   # [b, n, rope]
    if self.dsa_top_k:
      if segment_ids is not None or context_size() > 1:
        raise ValueError("mla with dsa_top_k > 0 takes neither packed sequences (segment_ids) "
                         "nor a sequence split over the mesh; use dsa_top_k=0 for them")
      index_q = self.index_query(c_q).reshape(b, n, 1, self.options["dsa_indexer_heads"], -1)
      index = (index_q, self.index_weight(x)[:, :, None],             # [b, n, 1, H_I, e], [.., H_I]
               self.index_key_norm(self.index_key(x)))                # k^I [b, n, e]
    if state is None and self.dsa_top_k:
      o = self._absorbed(q_nope, q_rope, latent, rope_key, mask, causal=not self.bidirectional,
                         index=index)
    elif state is None:
      o = self._attend(q_nope, q_rope, latent, rope_key, mask, segment_ids)
    else:
      o, state = self._decode(q_nope, q_rope, latent, rope_key, mask, state,
                              index if self.dsa_top_k else None)
    return self.out(o.reshape(b, n, h * size.v).astype(self.dtype)), state

  def _attend(self, q_nope, q_rope, latent, rope_key, mask, segment_ids=None):
    """The parallel form: per-head keys and values from the latent -> o [b, n, h, v]."""
    b, n, h, _ = q_nope.shape
    k_nope, v = jnp.split(self.kv_up(latent).reshape(b, n, h, -1), [self.sizes.nope], axis=-1)
    shared = jnp.broadcast_to(rope_key[:, :, None], (b, n, h, self.sizes.rope))  # [b, n, h, rope]
    q = jnp.concatenate([q_nope, q_rope], axis=-1)                      # [b, n, h, nope + rope]
    k = jnp.concatenate([k_nope, shared], axis=-1)                      # [b, n, h, nope + rope]
    return self._softmax(q, k, v, mask, causal=not self.bidirectional, segment_ids=segment_ids)

  def _decode(self, q_nope, q_rope, latent, rope_key, mask, cache, index=None):
    """n new tokens against the cache, the up-projections absorbed -> (o [b, n, h, v], cache).
    The cache is right-aligned (the newest token in the last slot), so the bottom-right causal
    rule places the new queries; slots never written are not `filled`. index: DSA's indexer
    (q^I, w, k^I of the new tokens), whose keys the cache keeps."""
    n, length = latent.shape[1], cache["latent"].shape[1]
    if n > length:
      raise ValueError(f"mla: {n} tokens do not fit a cache of {length} (init_cache's max_len)")
    shift = lambda buffer, new: jnp.concatenate([buffer[:, n:], new.astype(buffer.dtype)], 1)
    cache = {**cache, "latent": shift(cache["latent"], latent),
             "rope_key": shift(cache["rope_key"], rope_key),
             "filled": shift(cache["filled"], mask), "position": cache["position"] + n}
    if index is not None:
      cache["index_key"] = shift(cache["index_key"], index[2])
      index = (*index[:2], cache["index_key"])
    o = self._absorbed(q_nope, q_rope, cache["latent"], cache["rope_key"], cache["filled"],
                       causal=True, index=index)
    return o, cache

  def _absorbed(self, q_nope, q_rope, latent, rope_key, kv_mask, *, causal: bool, index=None):
    """Multi-query attention over the latents, the up-projections absorbed: every head reads
    one key [c^KV; k^R] and one value c^KV per token -> o [b, n, h, v]. index: None (every
    visible key), or DSA's (q^I [b, n, 1, H_I, e], w [b, n, 1, H_I], k^I [b, L, e]): each query
    attends to its top dsa_top_k keys by I only."""
    r, h, size = self.sizes.kv_rank, self.num_heads, self.sizes
    up = self.kv_up.kernel[...].reshape(r, h, size.nope + size.v).astype(q_nope.dtype)
    w_uk, w_uv = jnp.split(up, [size.nope], axis=-1)                   # [r, h, nope], [r, h, v]
    q_latent = jnp.einsum("bnhd,rhd->bnhr", q_nope, w_uk)              # [b, n, h, r]
    q = jnp.concatenate([q_latent, q_rope], axis=-1)                   # [b, n, h, r + rope]
    k = jnp.concatenate([latent, rope_key], -1)[:, :, None].astype(q.dtype)  # [b, L, 1, r+rope]
    values = latent[:, :, None].astype(q.dtype)                        # [b, L, 1, r]
    if index is None:
      o_latent = self._softmax(q, k, values, kv_mask, causal=causal)  # [b, n, h, r]
    else:
      block = self.options["block_size"] or 128
      chosen = lightning_top_k(index[0], index[1], index[2][:, :, None], kv_mask=kv_mask,
                               top_k=self.dsa_top_k, causal=causal, block_size=block)
      o_latent = attend_selected(q, k, values, chosen, scale=self.scale, block_size=block)
    return jnp.einsum("bnhr,rhd->bnhd", o_latent.astype(q.dtype), w_uv)  # [b, n, h, v]

  def _softmax(self, q, k, v, kv_mask, *, causal: bool, segment_ids=None):
    """softmax(q kᵀ · scale) v over kv_mask's keys on the engine (bottom-right causal; with
    segment_ids, within each run)."""
    block = self.options["block_size"]
    if context_size() > 1:   # the sequence split over the mesh: ring attention (ops/ring.py)
      return ring.packed_ring_attention(q, k, v, kv_mask=kv_mask, causal=causal, scale=self.scale,
                                        segment_ids=segment_ids, block_size=block)
    block_mask = chunked.block_mask(q.shape[1], k.shape[1], causal=causal, block_q=block,
                                    block_k=block)
    if segment_ids is not None:
      runs = segment_runs(segment_ids)                                  # [b, n]
      block_mask = flex.with_segments(block_mask, runs, runs)
    return flex.flex_attention(q, k, v, block_mask=block_mask, scale=self.scale, kv_mask=kv_mask)

  def empty_state(self, batch_size, max_len, dtype):
    return {"latent": jnp.zeros((batch_size, max_len, self.sizes.kv_rank), dtype),
            "rope_key": jnp.zeros((batch_size, max_len, self.sizes.rope), dtype),
            "filled": jnp.zeros((batch_size, max_len), bool),
            "position": jnp.zeros((), jnp.int32),
            **({"index_key": jnp.zeros((batch_size, max_len, self.options["dsa_indexer_dim"]),
                                       dtype)} if self.dsa_top_k else {})}
