r"""One linear recurrence behind every op of this package, in two forms.

Per batch row and head, a state S [K, V] evolves over tokens t with a log-decay g_t <= 0 (one
scalar, or one per key channel) and an optional write strength beta_t:

    S̃_t = Diag(exp g_t) S_{t-1}                          decay
    u_t = v_t                  (additive)                  or
    u_t = beta_t (v_t - S̃_tᵀ k_t)   (delta rule)          what is written
    S_t = S̃_t + k_t u_tᵀ                                  write
    o_t = S_tᵀ q_t             (q already scaled)          read, after the write

`token_recurrence` runs this literally, a `lax.scan` over t (the reference form, and decoding).
`chunk_recurrence` splits T into N chunks of C tokens. With chunk-local cumulative gates
G_r = Σ_{s <= r} g_s (never a global cumsum: it would reach -1e4 and lose every digit of
G_i - G_j in float32) and S the state entering the chunk, every chunk satisfies

    O     = (Q ⊙ e^G) S + P U'                   P_ij = Σ_d q_id k_jd e^{G_id - G_jd}, j <= i
    S_out = Diag(e^{G_C}) S + (K ⊙ e^{G_C - G})ᵀ U'

with U' = V for the additive rule. For the delta rule the chunk's C writes unroll to the WY /
UT form (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule"; Gated
DeltaNet folds the decay in):

    A  = strictly lower part of diag(beta) [Σ_d k_id k_jd e^{G_id - G_jd}]_ij      [C, C]
    W  = (I + A)^{-1} diag(beta) (K ⊙ e^G),    U = (I + A)^{-1} diag(beta) V
    U' = U - W S                                 (the "pseudo-values")

Everything that does not involve S (P, A, the triangular solve for W and U, the decayed keys)
is computed for all chunks at once; only U' and S_out run in a `lax.scan` over chunks, whose
body is under `jax.checkpoint`, so the backward pass keeps the N chunk-boundary states and no
per-token state: memory is linear in T. The outputs are then formed for all chunks at once
from the entering states.

Numerics. Every exponent is masked before `exp` (`where(mask, x, -inf)`, never
`where(mask, exp(x), 0)`: exp overflows in the unused branch and its gradient becomes NaN), and
every exponent used is <= 0, so gates of any size underflow (the true value) but never
overflow. An exponent that is identically 0 (G_i - G_i on the diagonal) is written as the
constant 0, and G_C - G_r as a sum: as differences of cumulative sums they would send two
opposite O(1) gradients into the cumulative sum, whose rounding (~1e-7) then swamps the true
dg under strong gates (~e^-20). With a scalar gate the C x C decay e^{G_i - G_j} is formed
directly. With a per-channel gate P (and A) are not one matmul, and factoring
e^{G_i - G_j} = e^{G_i} e^{-G_j} across a chunk overflows for strong gates; they are built from
sub-chunks of c tokens: a pair of sub-chunks I > J is one batched matmul of (Q_I ⊙ e^{G_I - G_f})
and (K_J ⊙ e^{G_l - G_J}) ⊙ e^{G_f - G_l}, with f the first token of I and l the last of J (all
exponents <= 0), a diagonal pair I = J an elementwise product, one key column at a time.
Gates, cumulative sums, states, the solve and all accumulation are float32 (float64 for
float64 inputs), matmuls at Precision.HIGHEST.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attention_zoo.ops.blocks import ceil_div

# chunk_gated_delta_rule forward+backward at T = 8192 (B=1, H=4, K=V=64, f32) on a shared
# 2-core CPU, medians of 7 interleaved calls: chunk 16 568 ms, 32 498 ms, 64 550 ms, 128 772 ms.
# 32 and 64 are within the machine's noise (~10%); 64 is flash-linear-attention's default.
DEFAULT_CHUNK_SIZE = 64
# Tokens per sub-chunk of the per-channel-gate intra-chunk products (at most; a divisor of C).
SUB_CHUNK = 8

_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _pair_exponent(diff, strict: bool):
  """diff = G_i - G_j [..., i, j] kept for j < i; 0 on the diagonal (the constant: see the
  module docstring) unless `strict`; -inf above it."""
  i, j = jnp.arange(diff.shape[-1])[:, None], jnp.arange(diff.shape[-1])[None, :]
  diff = jnp.where(j < i, diff, -jnp.inf)
  return diff if strict else jnp.where(i == j, 0.0, diff)


def _decayed_products_scalar(a, b, G, strict: bool):
  """Σ_d a_id b_jd e^{G_i - G_j} over the causal pairs of each chunk, 0 elsewhere.
  a, b [n, b, h, C, K]; G [n, b, h, C] -> [n, b, h, C, C]."""
  exponent = _pair_exponent(G[..., :, None] - G[..., None, :], strict)
  return _einsum("nbhik,nbhjk->nbhij", a, b) * jnp.exp(exponent)                   # [n,b,h,C,C]


def _decayed_products_vector(a, b, G, strict: bool):
  """As `_decayed_products_scalar` with G [n, b, h, C, K], per channel, by sub-chunks of c
  tokens. The leading dims are merged (M = n·b·h) and no intermediate has more than two axes
  besides M and the channel: a rank-7 broadcast product here made XLA's CPU backward corrupt
  memory on some CPUs (docs/xla_cpu_fault.md)."""
  *lead, C, K = G.shape
  c = next(d for d in range(min(SUB_CHUNK, C), 0, -1) if C % d == 0)
  S = C // c
  a, b, G = (x.reshape(-1, S, c, K) for x in (a, b, G))                     # [M, S, c, K]
  row = jnp.arange(c)[:, None]                                             # [c, 1]
  # diagonal sub-blocks, one column j at a time: e^{G_i - G_j} elementwise over (i, channel)
  columns = []
  for j in range(c):
    exponent = jnp.where(row > j, G - G[:, :, j:j + 1, :], -jnp.inf)        # [M, S, c, K]
    if not strict:
      exponent = jnp.where(row == j, 0.0, exponent)
    columns.append(jnp.sum(a * b[:, :, j:j + 1, :] * jnp.exp(exponent), axis=-1))  # [M, S, c]
  diagonal = jnp.stack(columns, axis=-1)                                    # [M, S, c, c]
  # sub-blocks I > J: e^{G_i - G_j} = e^{G_i - G_first(I)} e^{G_first(I) - G_last(J)}
  # e^{G_last(J) - G_j}, every exponent <= 0 (so no overflow); the identically-zero ones are
  # the constant 0
  first, last = G[:, :, :1, :], G[:, :, -1:, :]                            # [M, S, 1, K]
  a_ref = a * jnp.exp(jnp.where(row == 0, 0.0, G - first))                 # [M, S, c, K]
  b_ref = b * jnp.exp(jnp.where(row == c - 1, 0.0, last - G))              # [M, S, c, K]
  earlier = (jnp.arange(S)[None, :] < jnp.arange(S)[:, None])[:, :, None, None]  # [S,S,1,1] J<I
  between = jnp.where(earlier, first[:, :, None] - last[:, None, :], -jnp.inf)  # [M, S, S, 1, K]
  b_pairs = jnp.exp(between) * b_ref[:, None]                               # [M, S, S, c, K]
  off_diagonal = _einsum("mIik,mIJjk->mIiJj", a_ref, b_pairs)               # [M, S, c, S, c]
  block_diagonal = diagonal[:, :, :, None, :] * jnp.eye(S, dtype=a.dtype)[:, None, :, None]
  return (off_diagonal + block_diagonal).reshape(*lead, C, C)                # [n,b,h,C,C]


def _decayed_products(a, b, G, strict: bool):
  if G.shape[-1] == 1:
    return _decayed_products_scalar(a, b, G[..., 0], strict)
  return _decayed_products_vector(a, b, G, strict)


@jax.custom_vjp
def unit_lower_inverse(A):
  """(I + A)^{-1} for strictly lower-triangular A [..., C, C]. Blocked, as flash-linear-
  attention's solve_tril: blocks of b <= 16 rows inverted by forward substitution, then merged
  pairwise, [[X11, 0], [L21, X22]] -> [[X11, 0], [-X22 L21 X11, X22]]. For 512 chunks of 64
  with K + V = 128 right-hand sides this inverse and the product took 45 ms on a shared 2-core
  CPU where jax.scipy.linalg.solve_triangular took 422 ms (forward)."""
  *lead, C, _ = A.shape
  b = C
  while b > 16 and b % 2 == 0:
    b //= 2
  S = C // b                                                 # a power of two
  blocks = A.reshape(*lead, S, b, S, b)
  diagonal = jnp.stack([blocks[..., s, :, s, :] for s in range(S)], axis=-3)  # [..., S, b, b]
  X = jnp.broadcast_to(jnp.eye(b, dtype=A.dtype), diagonal.shape)
  for i in range(1, b):   # row i of X = e_i - A_i X (rows above already final)
    X = X.at[..., i, :].add(-_einsum("...j,...jk->...k", diagonal[..., i, :], X))
  while S > 1:
    m = X.shape[-1]
    blocks = A.reshape(*lead, S // 2, 2, m, S // 2, 2, m)
    lower = jnp.stack([blocks[..., s, 1, :, s, 0, :] for s in range(S // 2)], axis=-3)
    X11, X22 = X[..., 0::2, :, :], X[..., 1::2, :, :]                  # [..., S/2, m, m]
    X21 = -_einsum("...ij,...jk,...kl->...il", X22, lower, X11)
    top = jnp.concatenate([X11, jnp.zeros_like(X11)], axis=-1)
    X = jnp.concatenate([top, jnp.concatenate([X21, X22], axis=-1)], axis=-2)
    S //= 2
  return X[..., 0, :, :]


def _unit_lower_inverse_fwd(A):
  X = unit_lower_inverse(A)
  return X, X


def _unit_lower_inverse_bwd(X, dX):
  """d(I + A)^{-1} = -X dA X, so dA = -Xᵀ dX Xᵀ, kept strictly lower as A is."""
  dA = -_einsum("...ji,...jk,...lk->...il", X, dX, X)
  return (jnp.where(jnp.tril(jnp.ones(dA.shape[-2:], bool), -1), dA, 0.0),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def chunk_recurrence(q, k, v, g, beta, initial_state, chunk_size: int):
  """The recurrence by chunks. q, k [B, T, H, K] (q scaled), v [B, T, H, V], g [B, T, H, 1]
  (scalar) or [B, T, H, K], beta [B, T, H] or None (additive), initial_state [B, H, K, V]; all
  in the compute dtype, masked tokens already neutral -> (o [B, T, H, V], S_T [B, H, K, V])."""
  B, T, H, _ = k.shape
  C = min(chunk_size, ceil_div(T, SUB_CHUNK) * SUB_CHUNK)   # a short T: one (padded) chunk
  N = ceil_div(T, C)

  def to_chunks(x):  # [B, T, H, D] -> [N, B, H, C, D], T padded with neutral zeros
    x = jnp.pad(x, [(0, 0), (0, N * C - T), (0, 0), (0, 0)])
    return x.reshape(B, N, C, H, x.shape[-1]).transpose(1, 0, 3, 2, 4)

  q, k, v, g = map(to_chunks, (q, k, v, g))
  G = jnp.cumsum(g, axis=-2)                                 # [n, b, h, C, 1|K], chunk-local
  # G_C - G_r = Σ_{s > r} g_s, summed directly (a difference would be a cancelling pair for
  # the last real token, whose later g are padding zeros)
  to_end = jnp.cumsum(g[..., ::-1, :], axis=-2)[..., ::-1, :]  # [n, b, h, C, 1|K], Σ_{s >= r}
  to_end = jnp.concatenate([to_end[..., 1:, :], jnp.zeros_like(to_end[..., :1, :])], axis=-2)
  state_decay = jnp.exp(G[..., -1:, :]).swapaxes(-1, -2)     # [n, b, h, 1|K, 1]
  k_to_end = k * jnp.exp(to_end)                             # [n, b, h, C, K]
  scores = _decayed_products(q, k, G, strict=False)          # [n, b, h, C, C]

  if beta is None:
    values = v
    writes = _einsum("nbhck,nbhcv->nbhkv", k_to_end, v)      # [n, b, h, K, V]

    @jax.checkpoint
    def step(S, xs):
      write, decay = xs
      return decay * S + write, S

    final_state, entering = jax.lax.scan(step, initial_state, (writes, state_decay))
  else:
    beta = to_chunks(beta[..., None])                        # [n, b, h, C, 1]
    strength = beta * _decayed_products(k, k, G, strict=True)  # [n, b, h, C, C], A
    inverse = unit_lower_inverse(strength)                   # [n, b, h, C, C], (I + A)^{-1}
    W = _einsum("nbhij,nbhjk->nbhik", inverse, beta * k * jnp.exp(G))  # [n, b, h, C, K]
    U = _einsum("nbhij,nbhjv->nbhiv", inverse, beta * v)     # [n, b, h, C, V]

    @jax.checkpoint
    def step(S, xs):
      W, U, k_to_end, decay = xs
      pseudo_values = U - _einsum("bhck,bhkv->bhcv", W, S)   # [b, h, C, V], U'
      S_next = decay * S + _einsum("bhck,bhcv->bhkv", k_to_end, pseudo_values)
      return S_next, (S, pseudo_values)

    final_state, (entering, values) = jax.lax.scan(
        step, initial_state, (W, U, k_to_end, state_decay))

  o = (_einsum("nbhck,nbhkv->nbhcv", q * jnp.exp(G), entering)  # [n, b, h, C, V]
       + _einsum("nbhij,nbhjv->nbhiv", scores, values))
  o = o.transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, -1)[:, :T]  # [B, T, H, V]
  return o, final_state


def token_recurrence(q, k, v, g, beta, initial_state):
  """The recurrence token by token; arguments and result as `chunk_recurrence`'s."""
  time_major = lambda x: jnp.moveaxis(x, 1, 0)               # [B, T, ...] -> [T, B, ...]

  def step(S, xs):
    q_t, k_t, v_t, g_t, beta_t = xs          # [B, H, K], [B, H, K], [B, H, V], [B, H, 1|K], [B, H]
    S = jnp.exp(g_t)[..., None] * S                          # [B, H, K, V], S̃_t
    if beta_t is not None:
      v_t = beta_t[..., None] * (v_t - _einsum("bhk,bhkv->bhv", k_t, S))  # [B, H, V], u_t
    S = S + k_t[..., :, None] * v_t[..., None, :]
    return S, _einsum("bhk,bhkv->bhv", q_t, S)               # [B, H, V]

  xs = (q, k, v, g, beta)
  final_state, o = jax.lax.scan(step, initial_state, jax.tree.map(time_major, xs))
  return jnp.moveaxis(o, 0, 1), final_state


def run(name: str, q, k, v, g, beta, *, per_channel_gate: bool, scale, initial_state, mask,
        chunk_size: int | None):
  """Validates the op `name`'s inputs, neutralises masked tokens and runs the chunk form
  (chunk_size given) or the token form. g None: no decay; beta None: the additive rule.
  -> (o like v, final state [B, H, K, V] float32, float64 for float64 inputs)."""
  out_dtype, dtype = v.dtype, jnp.promote_types(v.dtype, jnp.float32)
  if q.ndim != 4 or k.shape != q.shape:
    raise ValueError(f"{name}: q and k must both be [B, T, H, K], got {q.shape} and {k.shape}")
  B, T, H, K = q.shape
  if v.ndim != 4 or v.shape[:3] != (B, T, H):
    raise ValueError(f"{name}: v must be [B, T, H, V] = ({B}, {T}, {H}, V) like q, got {v.shape}")
  gate_shape = (B, T, H, K) if per_channel_gate else (B, T, H)
  expected = {"g": gate_shape, "beta": (B, T, H), "initial_state": (B, H, K, v.shape[-1]),
              "mask": (B, T)}
  for arg, value in (("g", g), ("beta", beta), ("initial_state", initial_state),
                     ("mask", mask)):
    if value is not None and value.shape != expected[arg]:
      raise ValueError(f"{name}: {arg} must be {list(expected[arg])}, got {list(value.shape)}")
  if mask is not None and mask.dtype != jnp.bool_:
    raise ValueError(f"{name}: mask must be bool (True = real token), got {mask.dtype}")
  if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
    raise ValueError(f"{name}: chunk_size must be a positive integer, got {chunk_size!r}")
  if scale is None:
    scale = K ** -0.5

  keep = jnp.ones((B, T), bool) if mask is None else mask
  def neutral(x):  # a masked token reads nothing and leaves the state as it was
    return None if x is None else jnp.where(
        keep.reshape(B, T, *[1] * (x.ndim - 2)), x.astype(dtype), 0)
  g = jnp.zeros((B, T, H), dtype) if g is None else g
  q, k, v, g, beta = map(neutral, (q, k, v, g if per_channel_gate else g[..., None], beta))
  q = q * scale
  state = (jnp.zeros((B, H, K, v.shape[-1]), dtype) if initial_state is None
           else initial_state.astype(dtype))
  if chunk_size is None:
    o, state = token_recurrence(q, k, v, g, beta, state)
  else:
    o, state = chunk_recurrence(q, k, v, g, beta, state, chunk_size)
  return o.astype(out_dtype), state
