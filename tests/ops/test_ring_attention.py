"""Ring attention (attention_zoo/ops/ring.py) against one device: outputs and the gradients of
q, k, v, f32, relative 1e-5; the steps it skips; that the compiled program passes K/V around
the ring (collective-permute) and gathers nothing; and its memory per device.

Simulated devices must be asked for before JAX starts, so the checks run in a child process
(this file run as a script) with DEVICES CPU devices: one child for the fast lane's checks, one
for the slow lane's, each started once per session.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

# One child per lane serves every test here: keep them on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("ring_attention")

DEVICES = 8
TOL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 2 ** 20


# -- the checks, run in the child ------------------------------------------------------------

def _setup():
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  return jax, jnp, AxisType, NamedSharding, P


def _inputs(length: int, batch: int = 2, heads: int = 4, kv_heads: int = 2, dim: int = 8):
  """q, k, v, a cotangent, key padding (row 1: a hole and a padded tail) and segment ids whose
  boundaries fall inside shards."""
  jax, jnp, *_ = _setup()
  keys = jax.random.split(jax.random.key(length), 4)
  q = jax.random.normal(keys[0], (batch, length, heads, dim))
  k, v = (jax.random.normal(key, (batch, length, kv_heads, dim)) for key in keys[1:3])
  cotangent = jax.random.normal(keys[3], q.shape)
  kv_mask = np.ones((batch, length), bool)
  kv_mask[1, -5:] = False
  kv_mask[1, 2] = False
  cuts = (0, length * 3 // 8 + 1, length * 5 // 8 + 3, length)
  ids = np.repeat(np.arange(3), np.diff(cuts))[None].repeat(batch, 0).astype(np.int32)
  ids[1] = np.where(np.arange(length) < length // 2 - 3, 7, 8)
  return q, k, v, cotangent, kv_mask, ids


def _value_and_grads(attention, q, k, v, cotangent):
  jax, jnp, *_ = _setup()
  loss = lambda q, k, v: (jnp.sum(attention(q, k, v) * cotangent), attention(q, k, v))
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


def _mesh(context: int, data: int = 1):
  jax, _, AxisType, *_ = _setup()
  return jax.make_mesh((data, context), ("data", "context"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:data * context])


def _relative_error(a, b) -> float:
  jax, *_ = _setup()
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    worst = max(worst, float(np.max(np.abs(x - y)) / max(1.0, float(np.max(np.abs(y))))))
  return worst


def _ring_vs(reference, length: int, context: int, *, data: int = 1, mask_mod=None,
             causal=False, padded=True, packed=False, mask_heads=None, form="ring_attention",
             **ring_options) -> float:
  """Largest relative difference of ring_attention (or another `form` of ops/ring.py) on a
  data x context mesh and
  `reference(q, k, v, kv_mask, segment_ids)` (one device), outputs and q, k, v gradients."""
  jax, jnp, _, NamedSharding, P = _setup()
  from attention_zoo.ops import ring
  q, k, v, cotangent, kv_mask, ids = _inputs(length)
  kv_mask = kv_mask if padded else np.ones_like(kv_mask)
  segment_ids = (ids, ids) if packed else None
  expected = _value_and_grads(lambda q, k, v: reference(q, k, v, kv_mask, segment_ids),
                              q, k, v, cotangent)
  mesh = _mesh(context, data)
  with jax.set_mesh(mesh):
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "context")))
    sharded_ids = None if segment_ids is None else (put(ids), put(ids))
    sharded_mask = put(kv_mask)
    got = _value_and_grads(
        lambda q, k, v: getattr(ring, form)(q, k, v, mask_mod, causal=causal,
                                            kv_mask=sharded_mask, segment_ids=sharded_ids,
                                            heads=mask_heads, **ring_options),
        put(q), put(k), put(v), cotangent)
  return _relative_error(got, expected)


def _dense(causal: bool, **options):
  """The one-device dense path (softmax.py) with the same options."""
  from attention_zoo.ops import softmax
  return lambda q, k, v, kv_mask, segment_ids: softmax.masked_softmax_attention(
      q, k, v, kv_mask=kv_mask, causal=causal, segment_ids=segment_ids, **options)


def _oracle(mask_mod, length: int, heads=None):
  """The oracle (oracle.py) over mask_mod's dense pattern, key padding and segments."""
  from attention_zoo.ops import flex, oracle
  pattern = flex.dense_mask(mask_mod, heads, length, length)[None]              # [1, h, q, k]

  def attention(q, k, v, kv_mask, segment_ids):
    allowed = pattern & kv_mask[:, None, None, :]
    if segment_ids is not None:
      allowed = allowed & (segment_ids[0][:, None, :, None] == segment_ids[1][:, None, None, :])
    return oracle.dense_attention(q, k, v, allowed)
  return attention


def check_causal_packed_alibi_softcap():
  """context 4, causal, padded, packed segments across shard edges, ALiBi and soft-capping."""
  _, jnp, *_ = _setup()
  options = dict(alibi_slopes=jnp.array([0.5, 0.25, 0.125, 0.0625]), softcap=2.0)
  return _ring_vs(_dense(True, **options), 64, 4, causal=True, packed=True, block_q=8,
                  block_k=8, **options)


def check_zigzag_causal_packed():
  """The zigzag layout: the same answer (context 4, causal, padded, packed)."""
  return _ring_vs(_dense(True), 64, 4, causal=True, packed=True, layout="zigzag", block_q=4,
                  block_k=4)


def check_window_not_causal():
  """A window (mask_mod at global positions): context 4, not causal, padded, packed, blocks of
  6 in shards of 16 (partial tiles)."""
  from attention_zoo.ops import softmax
  window = softmax.window_allowed(5, 64, 64, False)
  return _ring_vs(_oracle(window, 64), 64, 4, mask_mod=window, packed=True, block_q=6, block_k=6)


def check_data_and_context():
  """data 2 x context 2, causal, with GQA, and a shard of partial blocks (length 36)."""
  return _ring_vs(_dense(True), 36, 2, data=2, causal=True, block_q=8, block_k=8)


def check_heads_mask_zigzag_window():
  """A mask that differs by head (a per-head window), causal, on the zigzag layout, context 8."""
  _, jnp, *_ = _setup()
  mask = lambda b, h, q, kv: (q - kv <= 3 + 4 * h) & (kv <= q)
  return _ring_vs(_oracle(mask, 64, heads=4), 64, 8, mask_mod=mask, mask_heads=4, packed=True,
                  layout="zigzag", block_q=4, block_k=4)


def check_fox():
  """FoX's op (forget-gate bias from cumulative log-forgets across shards) against its one-device
  op: context 4, padded, packed, strong gates; outputs and the gradients of q, k, v and log f."""
  jax, jnp, _, NamedSharding, P = _setup()
  from attention_zoo.ops import ring
  from attention_zoo.ops.forgetting_attention import forgetting_attention
  q, k, v, cotangent, mask, ids = _inputs(64)
  log_f = jax.nn.log_sigmoid(2 * jax.random.normal(jax.random.key(5), q.shape[:3]))

  def value_and_grads(attention, *arrays):
    loss = lambda *a: (jnp.sum(attention(*a) * cotangent), attention(*a))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*arrays)

  expected = value_and_grads(lambda q, k, v, f: forgetting_attention(
      q, k, v, f, mask=mask, segment_ids=ids, block_size=8), q, k, v, log_f)
  mesh = _mesh(4)
  with jax.set_mesh(mesh):
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "context")))
    sharded_mask, sharded_ids = put(mask), put(ids)
    got = value_and_grads(lambda q, k, v, f: ring.forgetting_attention_ring(
        q, k, v, f, mask=sharded_mask, segment_ids=sharded_ids, block_size=4),
        put(q), put(k), put(v), put(log_f))
  return _relative_error(got, expected)


def check_head_parallel():
  """The all-to-all form: context 2 (the heads divide), causal, packed, ALiBi and soft-capping;
  then a per-head window, not causal."""
  _, jnp, *_ = _setup()
  options = dict(alibi_slopes=jnp.array([0.5, 0.25, 0.125, 0.0625]), softcap=2.0)
  mask = lambda b, h, q, kv: jnp.abs(q - kv) <= 3 + 4 * h
  return max(_ring_vs(_dense(True, **options), 64, 2, causal=True, packed=True,
                      form="head_parallel_attention", block_q=8, block_k=8, **options),
             _ring_vs(_oracle(mask, 64, heads=4), 64, 2, mask_mod=mask, mask_heads=4,
                      form="head_parallel_attention", block_q=8, block_k=8))


def check_window_steps():
  """The ring steps taken at context 8 (n = 4096): all for the causal rule, the neighbour shards
  only for a window."""
  from attention_zoo.ops import ring, softmax
  steps = lambda mask_mod, causal, layout: list(ring._plan_ring(
      mask_mod, causal, None, 4096, 8, layout, 128, 128).steps)
  return {"causal": steps(None, True, "contiguous"),
          "window_causal": steps(softmax.window_allowed(100, 4096, 4096, True), False,
                                 "contiguous"),
          "window": steps(softmax.window_allowed(100, 4096, 4096, False), False, "contiguous"),
          "window_zigzag": steps(softmax.window_allowed(100, 4096, 4096, True), False,
                                 "zigzag")}


def check_zigzag_balance():
  """Visible tiles per device under the causal rule at context 8: contiguous, then zigzag."""
  from attention_zoo.ops import ring
  work = lambda layout: (ring._plan_ring(None, True, None, 4096, 8, layout, 128, 128).states
                         != 0).sum(axis=(0, 2, 3)).tolist()
  return {"contiguous": work("contiguous"), "zigzag": work("zigzag")}


def check_hlo():
  """The compiled forward+backward of `full` on context 4: its collectives."""
  jax, jnp, _, NamedSharding, P = _setup()
  import attention_zoo as az
  from flax import nnx
  attention = az.create("full", num_heads=4, num_kv_heads=2, head_dim=8, causal=True,
                        rngs=nnx.Rngs(0))
  q, k, v, *_ = _inputs(64)
  mesh = _mesh(4)
  with jax.set_mesh(mesh):
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "context")))
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v)), argnums=(0, 1, 2)))
    text = step.lower(put(q), put(k), put(v)).compile().as_text()
  return {op: text.count(f" {op}(") + text.count(f" {op}-start(")
          for op in ("collective-permute", "all-gather", "all-to-all", "all-reduce")}


def check_memory():
  """`full`'s compiled forward+backward temp memory per device (MiB), batch 1: the ring on
  context 8 at 16K and 32K, and one device at 32K."""
  from attention_zoo.testing import context_parallel
  memory = lambda length, context: context_parallel.temp_bytes_per_device(
      "full", length=length, context=context) / MIB
  return {"ring": [memory(n, 8) for n in (16384, 32768)], "one_device": memory(32768, 1)}


# The variants whose engine calls rearrange keys (copies of global keys or summaries) and that
# run the ring over their mask_mod when the sequence is split
MASK_VARIANTS = ("longformer", "sparse_transformer")
MASK_LENGTHS = (4096, 8192)


def check_mask_variants():
  """Each of MASK_VARIANTS' compiled forward+backward (testing/context_parallel's shapes) on
  context 8 at MASK_LENGTHS: its temp memory per device and how many collectives of each kind
  it has."""
  from attention_zoo.testing import context_parallel
  found = {}
  for name in MASK_VARIANTS:
    for length in MASK_LENGTHS:
      compiled = context_parallel.compile_step(name, length=length, context=8)
      kinds = [opcode for opcode, _ in context_parallel.collectives(compiled)]
      found[f"{name}@{length}"] = {"bytes": compiled.memory_analysis().temp_size_in_bytes,
                                   **{kind: kinds.count(kind) for kind in set(kinds)}}
  return found


FAST_CHECKS = ("check_causal_packed_alibi_softcap", "check_window_steps", "check_hlo")
SLOW_CHECKS = ("check_zigzag_causal_packed", "check_window_not_causal", "check_data_and_context",
               "check_heads_mask_zigzag_window", "check_fox", "check_head_parallel",
               "check_zigzag_balance", "check_memory", "check_mask_variants")


def main(names) -> int:
  import jax
  if len(jax.devices()) < DEVICES:
    print(f"needs {DEVICES} devices", file=sys.stderr)
    return 2
  print(json.dumps({name: globals()[name]() for name in names}))
  return 0


# -- the tests ---------------------------------------------------------------------------------

@functools.cache
def _child(names: tuple[str, ...]) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} "
                      f"--xla_force_host_platform_device_count={DEVICES}").strip()
  env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  child = subprocess.run([sys.executable, os.path.abspath(__file__), *names], env=env,
                         capture_output=True, text=True, timeout=900)
  assert child.returncode == 0, child.stderr[-4000:]
  return json.loads(child.stdout.splitlines()[-1])


fast = lambda name: _child(FAST_CHECKS)[name]
slow = lambda name: _child(SLOW_CHECKS)[name]


def test_ring_equals_one_device():
  assert fast("check_causal_packed_alibi_softcap") <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SLOW_CHECKS if n not in (
    "check_zigzag_balance", "check_memory", "check_mask_variants")])
def test_ring_equals_one_device_slow(name):
  assert slow(name) <= TOL


def test_a_window_skips_the_shards_it_cannot_see():
  steps = fast("check_window_steps")
  assert steps["causal"] == list(range(8))
  assert steps["window_causal"] == [0, 1]          # itself and the previous shard
  assert steps["window"] == [0, 1, 7]              # and the next one
  assert steps["window_zigzag"] == [0, 1, 7]


def test_the_ring_passes_kv_around_and_gathers_nothing():
  collectives = fast("check_hlo")
  assert collectives["collective-permute"] > 0, collectives
  assert collectives["all-gather"] == 0 and collectives["all-to-all"] == 0, collectives


def test_without_a_context_axis_the_ring_says_what_to_use():
  import jax.numpy as jnp
  from attention_zoo.ops import ring
  x = jnp.ones((1, 8, 2, 4))
  for form in (ring.ring_attention, ring.head_parallel_attention):
    with pytest.raises(ValueError, match="pattern_attention"):
      form(x, x, x)


@pytest.mark.slow
def test_zigzag_evens_the_causal_work():
  work = slow("check_zigzag_balance")
  assert max(work["contiguous"]) >= 4 * min(work["contiguous"])
  assert max(work["zigzag"]) == min(work["zigzag"])


@pytest.mark.slow
def test_memory_per_device_is_linear_in_length_and_a_fraction_of_one_device():
  memory = slow("check_memory")
  at_16k, at_32k = memory["ring"]
  assert at_32k <= 2.2 * at_16k, memory                  # linear in the length, not quadratic
  assert at_32k <= memory["one_device"] / 4, memory


@pytest.mark.slow
@pytest.mark.parametrize("name", MASK_VARIANTS)
def test_a_rearranging_mask_variant_takes_the_ring_in_linear_memory(name):
  """Split over the mesh, longformer and sparse_transformer pass K/V around the ring and
  gather nothing, and their memory per device grows linearly with the length."""
  found = slow("check_mask_variants")
  short, long = (found[f"{name}@{length}"] for length in MASK_LENGTHS)
  assert short.get("collective-permute", 0) > 0 and "all-gather" not in short, short
  assert long["bytes"] <= 2.2 * short["bytes"], (short, long)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
