"""The attention mode: the attention module alone as the LRA Text model holds it (its heads,
head_dim and options), forward and forward+backward (the gradients of q, k, v and of its
parameters), on random q, k, v; plus jax.nn.dot_product_attention(implementation="xla") as a
baseline from outside this code base.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import attention_zoo as az
from experiments.benchmark import pairs, programs
from experiments.benchmark.programs import Program, Workload
from experiments.benchmark.settings import JAX_BASELINE, Settings
from experiments.train import build


class JaxDotProductAttention(nnx.Module):
  """jax.nn.dot_product_attention with XLA's implementation, called as a variant is."""

  def __call__(self, q, k, v, *, q_mask, kv_mask):
    del q_mask   # a padded query's output is unused; masking keys is what the variants do
    return jax.nn.dot_product_attention(q, k, v, mask=kv_mask[:, None, None, :],
                                        implementation="xla")


def attention_workload(name: str, length: int, settings: Settings) -> Workload:
  """The attention module of the Text model alone: forward, and forward+backward."""
  config = settings.config(name, length)
  model = build.model_config(config)
  heads = model.num_heads
  head_dim = (model.qkv_dim or model.emb_dim) // heads
  kv_heads = model.num_kv_heads or heads
  spec = az.spec(model.attention)
  baseline = name == JAX_BASELINE

  def make_attention():
    if baseline:
      return JaxDotProductAttention()
    return az.create(name, num_heads=heads, head_dim=head_dim, num_kv_heads=kv_heads,
                     max_len=length, rngs=nnx.Rngs(config.seed), **model.attention_options)

  graphdef, params, rest = nnx.split(nnx.eval_shape(make_attention), nnx.Param, ...)
  b, dtype = config.batch_size, jnp.dtype(config.model.dtype)
  q_shape, kv_shape = (b, length, heads, head_dim), (b, length, kv_heads, head_dim)

  def fwd(params, rest, q, k, v, mask):
    attention = nnx.merge(graphdef, params, rest)
    return attention(q, k, v, q_mask=mask, kv_mask=mask), nnx.split(attention, nnx.Param, ...)[2]

  def fwd_bwd(params, rest, q, k, v, mask):
    def loss_of(params, q, k, v):
      out, rest_after = fwd(params, rest, q, k, v, mask)
      return jnp.sum(out.astype(jnp.float32)), rest_after
    (loss, rest_after), grads = jax.value_and_grad(loss_of, argnums=(0, 1, 2, 3), has_aux=True)(
        params, q, k, v)
    return (loss, grads), rest_after

  def create():
    _, params, rest = nnx.split(make_attention(), nnx.Param, ...)
    keys = jax.random.split(jax.random.key(config.seed), 3)
    q = jax.random.normal(keys[0], q_shape, dtype)
    k, v = (jax.random.normal(key, kv_shape, dtype) for key in keys[1:])
    return params, rest, q, k, v, jnp.ones((b, length), bool)

  def step(program, compiled, inputs):
    params, rest, *data = inputs
    result, rest = programs.call(compiled, params, rest, *data)
    return result, (params, rest, *data)

  shapes = (params, rest, jax.ShapeDtypeStruct(q_shape, dtype),
            *(jax.ShapeDtypeStruct(kv_shape, dtype),) * 2, jax.ShapeDtypeStruct((b, length), bool))
  exact, nominal = baseline or spec.exact, None
  if exact:
    kept = None if baseline else pairs.kept_pairs(fwd, *shapes, batch=b, heads=heads)
    if kept is None and not (baseline or spec.complexity.startswith("O(n²)")):
      raise ValueError(f"{name} ({spec.complexity}) hands the block-sparse engine no block mask "
                       "the benchmark sees (experiments/benchmark/pairs.py): its FLOPs cannot be "
                       "counted; call the engine through attention_zoo.flex")
    nominal = ((pair_flops(kept, head_dim), "nominal 3.5·4·pairs·d, pairs of the block masks")
               if kept is not None else   # dense: n² pairs a head
               (attention_flops(b, heads, length, head_dim, causal=False, backward=True),
                "nominal 3.5·4·b·h·n²·d"))
  return Workload(
      programs={"fwd": Program(jax.jit(fwd), shapes), "fwd_bwd": Program(jax.jit(fwd_bwd), shapes)},
      resident_bytes=programs.nbytes(params), create=create, step=step,
      options={} if baseline else dict(model.attention_options), exact=exact,
      nominal_flops=nominal)


def attention_flops(batch: int, heads: int, length: int, head_dim: int, *, causal: bool,
                    backward: bool) -> float:
  """The nominal FLOPs of exact softmax attention as the FlashAttention papers count them:
  4·b·h·n²·d for the forward (two n x n x d products), halved when causal; the backward is
  2.5 x the forward (its recomputation included), so forward+backward is 3.5 x."""
  forward = pair_flops(batch * heads * length ** 2, head_dim, backward=False)
  return forward / (2 if causal else 1) * (3.5 if backward else 1.0)


def pair_flops(pairs: int, head_dim: int, *, backward: bool = True) -> float:
  """attention_flops over `pairs` (query, key) pairs (summed over batch rows and heads): 4·d a
  pair forward (a score and its weighted value), 3.5 x that forward+backward."""
  return 4 * pairs * head_dim * (3.5 if backward else 1.0)
