"""Makers the tests share: random inputs drawn with numpy (cheaper than compiling a random
kernel for each shape), a padding mask, a variant built at test size, the relative error of an
approximation, the shapes of every array a traced function forms, a packed model row against
its sequences run apart, the overrides of a tiny harness run, a mixer's decoding checked
against its parallel forward, float64 softmax attention over a given pattern (the sparse
variants' oracle), and the release of compiled programs before a process runs out of memory
maps."""
import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import attention_zoo as az
from ops_reference import assert_close


def normal(seed, shape, scale=1.0):
  """N(0, scale²) float32 of `shape`, one numpy generator per seed."""
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def random_qkv(seed, *, batch=2, q_len, kv_len=None, num_heads=4, num_kv_heads=2, head_dim=8,
               std=1.0):
  """q [batch, q_len, num_heads, head_dim], k, v [batch, kv_len (default q_len), num_kv_heads,
  head_dim], float32, drawn in that order from one generator: q, k ~ N(0, std²), v ~ N(0, 1)."""
  kv_len = q_len if kv_len is None else kv_len
  rng = np.random.default_rng(seed)
  draw = lambda length, heads, scale: jnp.asarray(
      scale * rng.standard_normal((batch, length, heads, head_dim)), jnp.float32)
  return (draw(q_len, num_heads, std), draw(kv_len, num_kv_heads, std),
          draw(kv_len, num_kv_heads, 1.0))


def padding_mask(batch, length, *, hole, tail):
  """bool [batch, length], True = real: every row whole but row 1, whose position `hole` and
  last `tail` positions are padding (a gap inside the sequence and a padded end)."""
  mask = np.ones((batch, length), bool)
  mask[1, length - tail:] = False
  mask[1, hole] = False
  return jnp.asarray(mask)


def create_variant(name, *, num_heads=4, num_kv_heads=2, head_dim=8, causal=False, model_seed=0,
                   **options):
  """`az.create(name, ...)` at test size, its parameters drawn from nnx.Rngs(model_seed)
  (`seed` stays free for the variants that take one as an option)."""
  return az.create(name, num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads,
                   causal=causal, rngs=nnx.Rngs(model_seed), **options)


def rel_err(a, b):
  """max |a - b| / max |b|, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def array_shapes(jaxpr):
  """The shape of every array `jaxpr` forms, those of the jaxprs nested in it (loops, calls)
  included."""
  for eqn in jaxpr.eqns:
    yield from (tuple(var.aval.shape) for var in eqn.outvars)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from array_shapes(inner)


def packed_vs_apart(model_class, config, *, atol=2e-5, **kwargs):
  """Two sequences of 9 and 7 tokens packed in one row of 20 (then 4 padding) against each
  run alone: the model's outputs on each sequence's tokens must agree."""
  model = model_class(config, rngs=nnx.Rngs(0), **kwargs)
  run = nnx.jit(lambda model, *args, **kw: model(*args, **kw))   # eager flex ops are slow
  tokens = jax.random.randint(jax.random.key(1), (1, 20), 1, config.vocab_size)
  segments = jnp.asarray(np.repeat([0, 1, 2], [9, 7, 4]))[None]
  mask = jnp.arange(20)[None] < 16
  packed = run(model, tokens, mask, segment_ids=segments)
  packed = packed[0] if isinstance(packed, tuple) else packed
  for start, stop in ((0, 9), (9, 16)):
    alone = run(model, tokens[:, start:stop])
    alone = alone[0] if isinstance(alone, tuple) else alone
    np.testing.assert_allclose(packed[:, start:stop], alone, atol=atol)


def tiny_run_overrides(*, examples=(32, 8, 8), steps=2, width=16):
  """`--override` values for a run of a few steps of a one-layer model on a generated task of
  `examples` = (train, validation, test) examples; width None keeps the preset's emb_dim."""
  num_train, num_validation, num_test = examples
  widths = [] if width is None else [f"model.emb_dim={width}", f"model.qkv_dim={width}"]
  return [f"data.num_train={num_train}", f"data.num_validation={num_validation}",
          f"data.num_test={num_test}", "model.num_layers=1", *widths, "model.mlp_dim=32",
          "batch_size=8", f"num_train_steps={steps}", "eval_every=1", "log_every=1"]


def assert_decoding_equals_forward(mixer, x, mask):
  """Each decode step of a causal mixer (the token form from the carried state) equals its
  parallel (chunked) forward at that position, and the state after the last step a prefill's.
  x [b, n, emb], mask bool [b, n]."""
  want = mixer(x, mask=mask)
  step = nnx.jit(lambda mixer, x, mask: mixer(x, mask=mask, decode=True))
  mixer.init_cache(*mask.shape)
  for t in range(x.shape[1]):
    assert_close(step(mixer, x[:, t:t + 1], mask[:, t:t + 1]), want[:, t:t + 1], 1e-5,
                 f"step {t}")
  stepped = mixer.cache.get_value()
  mixer.init_cache(*mask.shape)
  assert_close(step(mixer, x, mask), want, 1e-5, "prefill")
  for part, (a, b) in enumerate(zip(jax.tree.leaves(stepped),               # a tuple: mLSTM's
                                     jax.tree.leaves(mixer.cache.get_value()), strict=True)):
    assert_close(a, b, 1e-5, f"final state, part {part}")


def assert_mixer_equals_float64(mixer, equations, x, mask, w, rtol):
  """The mixer's output, dx and every parameter's gradient (float32, one compiled program)
  equal `equations(params, x, mask)` run in float64 on the same parameters, for the loss Σ y·w;
  no parameter's float64 gradient is zero."""
  graph, params = nnx.split(mixer, nnx.Param)

  def loss(params, x):
    y = nnx.merge(graph, params)(x, mask=mask)
    return jnp.sum(y * w), y
  (_, y), (dparams, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      params, x)
  with jax.enable_x64(True):
    def loss64(p, x):
      y = equations(p, x, mask)
      return jnp.sum(y * w), y
    params64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params.to_pure_dict())
    (_, y64), (dparams64, dx64) = jax.jit(jax.value_and_grad(loss64, argnums=(0, 1),
                                                             has_aux=True))(
        params64, jnp.asarray(x, jnp.float64))
  assert_close(y, y64, rtol, "output")
  assert_close(dx, dx64, rtol, "dx")
  got = jax.tree_util.tree_leaves_with_path(dparams.to_pure_dict())
  want = jax.tree_util.tree_leaves_with_path(dparams64)
  assert [path for path, _ in got] == [path for path, _ in want]
  for (path, g), (_, g64) in zip(got, want):
    assert np.abs(np.asarray(g64)).max() > 0, f"d{jax.tree_util.keystr(path)} is zero"
    assert_close(g, g64, rtol, f"d{jax.tree_util.keystr(path)}")


def largest_backward_array(attn, n, num_heads, head_dim) -> int:
  """Elements of the largest array in the traced forward+backward of `attn` at length n (one kv
  head): below n² means no dense score or mask matrix."""
  q, kv = jnp.zeros((1, n, num_heads, head_dim)), jnp.zeros((1, n, 1, head_dim))
  grad = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)), argnums=(0, 1, 2))
  return max(int(np.prod(s)) for s in array_shapes(jax.make_jaxpr(grad)(q, kv, kv).jaxpr))


def decode_token_by_token(attn, q, k, v, cache):
  """One compiled decode step a token from `cache`: the outputs [b, n, h, d] concatenated, and
  the last cache."""
  step = nnx.jit(lambda m, q, k, v, cache: m.decode(q, k, v, cache))
  outs = []
  for t in range(q.shape[1]):
    out, cache = step(attn, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache)
    outs.append(out)
  return jnp.concatenate(outs, axis=1), cache


def out_and_grads(f, q, k, v, cotangent):
  """f(q, k, v) and its gradients in q, k, v for the cotangent."""
  out, back = jax.vjp(f, q, k, v)
  return (out, *back(cotangent.astype(out.dtype)))


def assert_attention_equals_float64(attn, oracle, q, k, v, cotangent, q_mask, kv_mask, *,
                                    relative=True):
  """attn's output and q/k/v gradients (float32, compiled) equal oracle(q, k, v) run in float64
  with masked query rows zeroed: each within 1e-5 of its largest value (or of 1), or within 1e-5
  absolutely (relative=False)."""
  got = jax.jit(out_and_grads, static_argnums=0)(
      lambda q, k, v: attn(q, k, v, q_mask=q_mask, kv_mask=kv_mask), q, k, v, cotangent)
  with jax.enable_x64(True):
    zero_padded = lambda out: out if q_mask is None else jnp.where(
        q_mask[:, :, None, None], out, 0)
    want = out_and_grads(lambda q, k, v: zero_padded(oracle(q, k, v)), q, k, v, cotangent)
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))), what
    scale = max(1.0, float(np.abs(np.asarray(w)).max())) if relative else 1.0
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5 * scale, rtol=0,
                               err_msg=what)


def mixer_temp_bytes(name, length, *, emb_dim=64, num_heads=2, **options) -> int:
  """XLA's temp bytes for a causal mixer's compiled forward+backward at `length` (batch 1;
  nothing runs)."""
  mixer = az.create_mixer(name, emb_dim=emb_dim, num_heads=num_heads, causal=True,
                          rngs=nnx.Rngs(0), **options)
  graph, params = nnx.split(mixer)
  loss = lambda params, x: jnp.sum(nnx.merge(graph, params)(x))
  x = jax.ShapeDtypeStruct((1, length, emb_dim), jnp.float32)
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def attention64(q, k, v, allowed, q_mask):
  """Softmax attention over `allowed` bool [b, h, q_len, kv_len] in float64 (scale d^-1/2, K/V
  heads repeated for GQA); masked query rows and rows that see no key give 0."""
  with jax.enable_x64(True):
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5     # [b, h, q, k]
    scores = jnp.where(allowed, scores, -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, scores, 0.0), -1, keepdims=True))
    weights = jnp.where(allowed, jnp.exp(scores - top), 0.0)
    total = weights.sum(-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights / jnp.where(total > 0, total, 1.0), v)
    return jnp.where(jnp.asarray(q_mask)[:, :, None, None], out, 0.0)


def memory_maps() -> int | None:
  """How many memory mappings this process holds (Linux), or None where that cannot be read."""
  try:
    with open(f"/proc/{os.getpid()}/maps", encoding="ascii", errors="replace") as maps:
      return sum(1 for _ in maps)
  except OSError:
    return None


def release_compiled_programs(limit: int) -> bool:
  """Drops JAX's compiled programs when this process holds more than `limit` memory maps; True
  if it did. Each program XLA:CPU compiles keeps about three maps, and a process that reaches
  the kernel's vm.max_map_count (65,530 by default) dies in LLVM's next compilation ("Cannot
  allocate memory", then a segmentation fault): a long test worker compiles tens of thousands
  of programs (docs/xla_cpu_fault.md)."""
  count = memory_maps()
  if count is None or count <= limit:
    return False
  jax.clear_caches()
  gc.collect()
  return True

