"""The recurrence engine split over a mesh's `context` axis (ops/context_recurrence.py): every op
family equal to one device, forward and gradients; the split visible in the compiled program
(its summary all_gather, nothing gathered that grows with the length); per-device memory
linear in the length and a fraction of one device's.

Simulated devices must be asked for before JAX starts, so the checks run in one child process
per lane (this file run as a script); the tests read its JSON lines.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# One child per lane serves every test here: keep them on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("context_parallel_ops")

DEVICES = 8
TOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]
# The ops split over context: the fast lane runs the first (the delta rule with a gate: WY pieces
# and a decay). Every chunk op is also checked inside its mixer, forward and gradients, by the
# registry-wide check (tests/testing/test_context_parallel.py: simple_gla in retnet and
# lightning, gla, the delta rule in deltanet, kda, the delta product, its erase gate in
# gated_deltanet2, dplr in rwkv7), so the slow lane runs only the forms no declared mixer calls
# (DPLR with a scalar gate: comba, whose layer's float32 split is 1.01e-5 from one device).
OPS = ("chunk_gated_delta_rule", "recurrent_gla", "chunk_comba")
# (op whose per-device memory is measured, lane)
MEMORY_OPS = {"fast": ("chunk_gla",), "slow": ("chunk_delta_rule",)}
MEMORY_LENGTH, MEMORY_CONTEXT = 32768, 8   # at the ops' default chunk size
# Whole layers, in the slow lane: their memory, and what their compiled programs move across
# devices (retnet, gla: the op's split; based: the split and the ring of its window)
MEMORY_MIXERS = ("gated_deltanet", "retnet", "gla", "based")
# Chunks of 8: the equality cases' shards hold several and a partial one
EQUAL_CHUNK = 8


def _child(lane: str) -> dict:
  env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
  env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} "
                      f"--xla_force_host_platform_device_count={DEVICES}").strip()
  child = subprocess.run([sys.executable, __file__, lane], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=1200)
  assert child.returncode == 0, child.stderr[-4000:]
  return {tuple(r["key"]): r for r in map(json.loads, child.stdout.splitlines())}


@pytest.fixture(scope="module")
def fast():
  return _child("fast")


@pytest.fixture(scope="module")
def slow():
  return _child("slow")


def _check_equal(results, op):
  for case in ("context4_packed", "data2_context2"):
    result = results[("equal", op, case)]
    assert result["error"] <= TOL, (op, case, result)


def test_the_gated_delta_rule_split_over_context_equals_one_device(fast):
  _check_equal(fast, OPS[0])


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS[1:])
def test_each_op_split_over_context_equals_one_device(slow, op):
  _check_equal(slow, op)


def test_the_split_gathers_only_the_shard_summaries(fast):
  """The compiled forward+backward at two lengths: the all_gathers are the same (none grows
  with the length: no q/k/v or activation is gathered), among them the transitions Φ
  [C, B, H, K, K] of the summary scan, and the segment ids cross shard edges by a
  collective-permute."""
  short, long = fast[("hlo", OPS[0], "short")], fast[("hlo", OPS[0], "long")]
  assert short["all_gather"] == long["all_gather"], (short, long)
  assert [4, 2, 2, 4, 4] in short["all_gather"], short
  assert short["collective_permute"] >= 1, short


def test_a_length_the_context_axis_does_not_divide_is_refused_in_one_line(fast):
  assert fast[("refusal",)]["message"] == (
      "a sequence split over the mesh's context axis (4 devices) needs a length divisible by "
      "4, got 38")


def _check_memory(results, op):
  """Linear in the length at fixed context (quadratic would be 4x), and at 32K on context 8 at
  most 1/4 of one device's."""
  half, full, alone = (results[("memory", op, key)]["bytes"] for key in ("half", "full", "one"))
  assert full <= 2.2 * half, (op, half, full)
  assert full <= alone / 4, (op, full, alone)


def test_per_device_memory_of_gla_is_linear_and_a_fraction(fast):
  _check_memory(fast, MEMORY_OPS["fast"][0])


@pytest.mark.slow
def test_per_device_memory_of_the_delta_rule_is_linear_and_a_fraction(slow):
  _check_memory(slow, MEMORY_OPS["slow"][0])


@pytest.mark.slow
@pytest.mark.parametrize("mixer", MEMORY_MIXERS)
def test_per_device_memory_of_a_chunk_mixer_is_linear_and_a_fraction(slow, mixer):
  """The whole layer (projections, short convolutions, gates, the op) as the harness runs it;
  its program moves nothing that grows with the length (the same collectives at both lengths:
  the summaries, halos, parameter gradients; a ring's K/V blocks grow with the shard and
  arrive by collective-permute, never by an all-gather)."""
  _check_memory(slow, mixer)
  half, full = (slow[("collectives", mixer, key)]["found"] for key in ("half", "full"))
  gathered = lambda found: sorted(str(c) for c in found if c[0] != "collective-permute")
  assert gathered(half) == gathered(full), (mixer, half, full)


# ---- the child: everything below runs with DEVICES simulated devices -------------------------

def _arguments(op: str, key, B: int, T: int, H: int = 2, K: int = 4, V: int = 3, steps: int = 2):
  """The op's positional arrays (its gates in their ranges) and the extra keyword arguments."""
  import jax
  import jax.numpy as jnp
  keys = iter(jax.random.split(key, 8))
  normal = lambda *shape: jax.random.normal(next(keys), shape)
  per_step = (steps,) if op.endswith("product") else ()
  q, k, v = normal(B, T, H, K), normal(B, T, *per_step, H, K), normal(B, T, *per_step, H, V)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)         # the delta rule's unit keys
  scalar_gate = -jax.nn.softplus(normal(B, T, H))
  channel_gate = -jax.nn.softplus(normal(B, T, H, K))
  beta = jax.nn.sigmoid(normal(B, T, *per_step, H))
  return {"chunk_simple_gla": (q, k, v, scalar_gate), "chunk_gla": (q, k, v, channel_gate),
          "recurrent_gla": (q, k, v, channel_gate), "chunk_delta_rule": (q, k, v, beta),
          "chunk_gated_delta_rule": (q, k, v, scalar_gate, beta),
          "chunk_kda": (q, k, v, channel_gate, beta),
          "chunk_gated_delta_product": (q, k, v, scalar_gate, beta),
          "chunk_dplr_delta_rule": (q, k, v, -beta[..., None] * k, k, channel_gate),
          "chunk_comba": (q, k, v, jax.nn.sigmoid(normal(*k.shape[:-1], 1)) * k, scalar_gate,
                          beta)}[op]


def _segment_ids(T: int):
  """Row 0: a run starting at the third shard's first token (T/2 on context 4) and one inside
  the last; row 1: a run from inside the second shard across the rest."""
  import numpy as np
  ids = np.zeros((2, T), np.int32)
  ids[0, T // 2:], ids[0, T - 5:], ids[1, T // 4 + 3:] = 1, 2, 5
  return ids


def _run_op(op: str, arrays, *, chunk_size: int | None, **kwargs):
  """The op, a chunk form by chunks of chunk_size (None: its default)."""
  from attention_zoo import ops
  chunking = {"chunk_size": chunk_size} if chunk_size and op.startswith("chunk") else {}
  return getattr(ops, op)(*arrays, **kwargs, **chunking)


def _equal(op: str, case: str, data: int, context: int, T: int, packed: bool) -> dict:
  """Outputs, final state and the gradients of every array and the initial state: one device
  against the mesh, the largest difference relative to the largest value."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  B, H, V = 2, 2, 3
  arrays = _arguments(op, jax.random.key(T), B, T)
  mask = np.ones((B, T), bool)
  mask[1, T - 7:], mask[1, 3] = False, False
  fixed = {"mask": jnp.asarray(mask), "initial_state": None}
  if packed:
    fixed["segment_ids"] = jnp.asarray(_segment_ids(T))
  state = jax.random.normal(jax.random.key(7), (B, H, arrays[0].shape[-1], V))
  out = jax.eval_shape(lambda a, s: _run_op(op, a, chunk_size=EQUAL_CHUNK,
                                           **{**fixed, "initial_state": s}), arrays, state)
  cotangents = jax.tree.map(lambda x: jax.random.normal(jax.random.key(3), x.shape), out)

  @jax.jit
  def outputs_and_grads(arrays, state, fixed):
    def loss(arrays, state):
      result = _run_op(op, arrays, chunk_size=EQUAL_CHUNK,
                       **{**fixed, "initial_state": state})
      return sum(jnp.sum(x * c) for x, c in zip(result, cotangents)), result
    (_, result), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(arrays, state)
    return result, grads

  reference = outputs_and_grads(arrays, state, fixed)
  mesh = jax.make_mesh((data, context), ("data", "context"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:data * context])
  with jax.set_mesh(mesh):
    place = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "context")))
    split = outputs_and_grads(jax.tree.map(place, arrays), state, jax.tree.map(place, fixed))
  error = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(1.0, float(np.max(
      np.abs(np.asarray(b)))))) for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(reference)))
  return {"key": ["equal", op, case], "error": error}


def _compiled(op: str, T: int, context: int, *, batch: int, dims: dict, packed: bool,
              chunk_size: int | None):
  """The op's forward+backward compiled at length T (dims: H, K, V) on `context` devices (1: no
  mesh), never run."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  arrays = jax.eval_shape(lambda: _arguments(op, jax.random.key(0), batch, T, **dims))
  fixed = {"segment_ids": jax.ShapeDtypeStruct((batch, T), jnp.int32)} if packed else {}
  step = jax.jit(jax.grad(lambda a, f: jnp.sum(_run_op(op, a, chunk_size=chunk_size, **f)[0])))
  if context == 1:
    return step.lower(arrays, fixed).compile()
  mesh = jax.make_mesh((1, context), ("data", "context"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:context])
  with jax.set_mesh(mesh):
    sharding = NamedSharding(mesh, P("data", "context"))
    on_mesh = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return step.lower(jax.tree.map(on_mesh, arrays), jax.tree.map(on_mesh, fixed)).compile()


def _collectives(op: str, key: str, T: int) -> dict:
  """The shapes of the all-gathers and the number of collective-permutes in the compiled
  program on context 4."""
  text = _compiled(op, T, 4, batch=2, dims={}, packed=True,
                   chunk_size=EQUAL_CHUNK).as_text()
  gathers = sorted({tuple(int(d) for d in shape.split(",") if d) for shape in re.findall(
      r"= \w+\[([\d,]*)\]\S* all-gather\(", text)})
  return {"key": ["hlo", op, key], "all_gather": [list(s) for s in gathers],
          "collective_permute": len(re.findall(r" collective-permute\(", text))}


MEMORY_SIZES = {"half": (MEMORY_LENGTH // 2, MEMORY_CONTEXT),
                "full": (MEMORY_LENGTH, MEMORY_CONTEXT), "one": (MEMORY_LENGTH, 1)}


def _memory(op: str) -> list[dict]:
  return [{"key": ["memory", op, key],
           "bytes": _compiled(op, T, context, batch=1, dims=dict(H=2, K=16, V=16),
                              packed=False, chunk_size=None).memory_analysis().temp_size_in_bytes}
          for key, (T, context) in MEMORY_SIZES.items()]


def _mixer_memory(name: str) -> list[dict]:
  from attention_zoo.testing.context_parallel import collectives, compile_step
  results = []
  for key, (T, context) in MEMORY_SIZES.items():
    compiled = compile_step(name, length=T, context=context)
    results.append({"key": ["memory", name, key],
                    "bytes": compiled.memory_analysis().temp_size_in_bytes})
    if context > 1:
      results.append({"key": ["collectives", name, key], "found": collectives(compiled)})
  return results


def _refusal() -> dict:
  """The message of a split that cannot be: length 38 on context 4."""
  import jax
  from jax.sharding import AxisType
  mesh = jax.make_mesh((1, 4), ("data", "context"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:4])
  arrays = _arguments(OPS[0], jax.random.key(0), 2, 38)
  try:
    with jax.set_mesh(mesh):
      jax.jit(lambda a: _run_op(OPS[0], a, chunk_size=EQUAL_CHUNK)).trace(arrays)
  except ValueError as e:
    return {"key": ["refusal"], "message": str(e)}
  return {"key": ["refusal"], "message": None}


def _main(lane: str) -> None:
  equal_ops = OPS[:1] if lane == "fast" else OPS[1:]
  results = []
  for op in equal_ops:
    # 4 shards of 20 tokens: two chunks of 8 and a partial one each
    results.append(_equal(op, "context4_packed", 1, 4, 80, packed=True))
    results.append(_equal(op, "data2_context2", 2, 2, 36, packed=False))
  if lane == "fast":
    results += [_collectives(OPS[0], "short", 64), _collectives(OPS[0], "long", 128),
                _refusal()]
  for op in MEMORY_OPS[lane]:
    results += _memory(op)
  if lane == "slow":
    for mixer in MEMORY_MIXERS:
      results += _mixer_memory(mixer)
  for result in results:
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  _main(sys.argv[1])
