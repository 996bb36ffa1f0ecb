"""The context-parallel check: a registered variant or mixer whose spec says
`supports_context_parallel` gives, on a mesh whose `context` axis splits the sequence, the
outputs and gradients (of its inputs and of every parameter) it gives on one device, f32, within
`TOL` relative to the largest value.

Simulated CPU devices must be asked for before JAX starts
(`--xla_force_host_platform_device_count`), so the check runs in a child process:
`run_in_child(names)` starts `python -m attention_zoo.testing.context_parallel NAME ...` with
DEVICES devices and returns one `CaseResult` per (name, case). The cases together cover what
context parallelism must get right:

  context4_causal_packed   4 shards of several chunks each, causal, padded rows, packed
                           sequences whose segments cross shard boundaries
  context2_partial_chunk   2 shards that each end in a partial chunk, not causal (causal where
                           the module is causal only), padded rows
  data2_context2           the batch over `data` and the sequence over `context` at once, causal

A case that the module cannot run (packed sequences without `supports_segment_ids`, a variant
that cannot be causal) is run without that part, and the result says so.

Float32 rounding: where a module's float32 results on the mesh and on one device differ by
more than `TOL` (`FLOAT32_TOL` names them and their bound), the same case run in float64
(`FLOAT64_CASES`: module, parameters and inputs in float64, `jax_enable_x64`) must agree to
`FLOAT64_TOL`: the split computes the same function, and only the float32 summation differs.

Equality alone cannot show that a module splits its work (XLA's partitioner would gather a
sharded input and compute the whole sequence on every device, correctly): `profile(name, ...)`
reads a compiled forward+backward (never run) for its per-device memory against one device's
and the collectives it contains, the shapes they move included; `check_in_child` runs the cases
and the profiles in one child.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from attention_zoo import registry
from attention_zoo.ops.context import CONTEXT_AXIS, DATA_AXIS
from attention_zoo.testing import conformance

TOL = 1e-5
# Modules whose float32 split differs from one device by more than TOL, all of it float32
# rounding (their FLOAT64_CASES agree to FLOAT64_TOL): RetNet, 2.7e-5 in data2_context2, where
# one device's float32 is itself 1.6e-5 from the float64 result (the split 1.1e-5); GLA, 9.6e-5
# in context2_partial_chunk, in one value (the first token's input gradient, its reversed
# pass), where one device's float32 is 2.5e-6 from float64 and the split's 9.9e-5.
FLOAT32_TOL = {"retnet": 5e-5, "gla": 2e-4}
FLOAT64_TOL = 1e-12
FLOAT64_CASES = {"retnet": "data2_context2", "gla": "context2_partial_chunk"}
DEVICES = 8
BATCH = 2


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  data: int            # mesh sizes
  context: int
  length: int
  causal: bool
  padded: bool
  packed: bool


CASES = (
    Case("context4_causal_packed", data=1, context=4, length=64, causal=True, padded=True,
         packed=True),
    Case("context2_partial_chunk", data=1, context=2, length=36, causal=False, padded=True,
         packed=False),
    Case("data2_context2", data=2, context=2, length=32, causal=True, padded=False,
         packed=False),
)


@dataclasses.dataclass(frozen=True)
class CaseResult:
  name: str
  case: str
  error: float | None     # the largest relative difference of outputs and gradients
  note: str = ""          # what the case ran without, or the error message of a failure
  tolerance: float = TOL

  @property
  def passed(self) -> bool:
    return self.error is not None and self.error <= self.tolerance


def _segment_ids(length: int) -> np.ndarray:
  """Row 0: three segments whose edges fall inside shards; row 1: two, split off-centre."""
  cuts = ((0, length * 3 // 8 + 1, length * 5 // 8 + 3, length), (0, length // 2 - 3, length))
  return np.stack([np.repeat(np.arange(len(c) - 1) + 7 * row, np.diff(c))
                   for row, c in enumerate(cuts)]).astype(np.int32)


def _padding_mask(length: int) -> np.ndarray:
  mask = np.ones((BATCH, length), bool)
  mask[1, length - 5:] = False
  mask[1, 2] = False
  return mask


def _build(name: str, causal: bool, length: int, dtype=jnp.float32):
  spec = registry.spec(name)
  if spec.kind == "mixer":
    return conformance.build_mixer(name, causal=causal, dtype=dtype)
  # a variant sized by its longest sequence (linformer) is built for the case's length
  return conformance.build(name, causal=causal, max_len=max(length, conformance.MAX_LEN))


def _to_float64(module, arrays):
  """The module with float64 parameters, and the floating arrays of the tree `arrays` in
  float64."""
  widen = lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  return nnx.merge(graphdef, jax.tree.map(widen, params), rest), jax.tree.map(widen, arrays)


def _inputs(name: str, case: Case, packed: bool) -> dict:
  """The call's array arguments, by keyword."""
  keys = jax.random.split(jax.random.key(case.length), 3)
  normal = partial(jax.random.normal, dtype=jnp.float32)   # float32 values under x64 too
  if registry.spec(name).kind == "mixer":
    args = {"x": normal(keys[0], (BATCH, case.length, conformance.EMB_DIM))}
  else:
    q_shape = (BATCH, case.length, conformance.NUM_HEADS, conformance.HEAD_DIM)
    kv_shape = (BATCH, case.length, conformance.NUM_KV_HEADS, conformance.HEAD_DIM)
    args = {"q": normal(keys[0], q_shape), "k": normal(keys[1], kv_shape),
            "v": normal(keys[2], kv_shape)}
  if case.padded:
    mask = jnp.asarray(_padding_mask(case.length))
    args.update({"mask": mask} if "x" in args else {"q_mask": mask, "kv_mask": mask})
  if packed:
    segment_ids = jnp.asarray(_segment_ids(case.length))
    args.update({"segment_ids": segment_ids} if "x" in args
                else {"q_segment_ids": segment_ids, "kv_segment_ids": segment_ids})
  return args


def _call(graphdef, params, rest, arrays: dict):
  module = nnx.merge(graphdef, params, rest)
  if "x" in arrays:
    arrays = dict(arrays)
    return module(arrays.pop("x"), **arrays)
  arrays = dict(arrays)
  return module(arrays.pop("q"), arrays.pop("k"), arrays.pop("v"), **arrays)


def _outputs_and_grads(module, arrays: dict, cotangent):
  """(output, gradient of <output, cotangent> by the floating inputs and every parameter)."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  floating = {k: v for k, v in arrays.items() if jnp.issubdtype(v.dtype, jnp.floating)}
  fixed = {k: v for k, v in arrays.items() if k not in floating}

  def loss(params, floating):
    out = _call(graphdef, params, rest, {**floating, **fixed})
    return jnp.sum(out * cotangent), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      params, floating)
  return out, grads


def _relative_error(a, b) -> float:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  worst = 0.0
  for x, y in zip(leaves_a, leaves_b, strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    worst = max(worst, float(np.max(np.abs(x - y)) / max(1.0, float(np.max(np.abs(y))))))
  return worst


def _shard(arrays: dict, mesh) -> dict:
  """Each [batch, length, ...] array split: the batch over `data`, the sequence over `context`."""
  return {k: jax.device_put(v, NamedSharding(mesh, P(DATA_AXIS, CONTEXT_AXIS)))
          for k, v in arrays.items()}


def run_case(name: str, case: Case, float64: bool = False) -> CaseResult:
  """One case: the module on one device, then on the case's mesh, compared (float64: the
  module, its parameters and inputs in float64; needs jax_enable_x64)."""
  spec = registry.spec(name)
  notes = []
  causal = case.causal
  if causal and not spec.supports_causal:
    causal = False
    notes.append("not causal (the variant cannot be)")
  packed = case.packed and spec.supports_segment_ids
  if case.packed and not packed:
    notes.append("not packed (no segment ids)")
  module = _build(name, causal, case.length, jnp.float64 if float64 else jnp.float32)
  arrays = _inputs(name, case, packed)
  out = jax.eval_shape(lambda a: _call(*nnx.split(module, nnx.Param, ...), a), arrays)
  cotangent = jax.random.normal(jax.random.key(1), out.shape, jnp.float32)
  if float64:   # the float32 case's values, widened
    module, (arrays, cotangent) = _to_float64(module, (arrays, cotangent))
  reference = _outputs_and_grads(module, arrays, cotangent)
  mesh = jax.make_mesh((case.data, case.context), (DATA_AXIS, CONTEXT_AXIS),
                       axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:case.data * case.context])
  with jax.set_mesh(mesh):
    sharded = _outputs_and_grads(module, _shard(arrays, mesh), cotangent)
  tolerance = FLOAT64_TOL if float64 else FLOAT32_TOL.get(name, TOL)
  return CaseResult(name, case.name + ("_float64" if float64 else ""),
                    _relative_error(sharded, reference), "; ".join(notes), tolerance)


def _lowered_step(name: str, *, length: int, context: int, causal: bool):
  """One device's forward+backward of `name` (batch 1, the suite's heads) at `length` on a
  mesh of `context` devices splitting the sequence (1: one device, no mesh), lowered."""
  module = _build(name, causal, length)
  case = Case("memory", data=1, context=context, length=length, causal=causal, padded=False,
              packed=False)
  arrays = jax.eval_shape(lambda: _inputs(name, case, packed=False))
  arrays = {k: jax.ShapeDtypeStruct((1, *v.shape[1:]), v.dtype) for k, v in arrays.items()}
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)

  def loss(params, arrays):
    return jnp.sum(_call(graphdef, params, rest, arrays))

  step = jax.jit(jax.grad(loss, argnums=(0, 1)))
  if context == 1:
    return step.lower(params, arrays)
  mesh = jax.make_mesh((1, context), (DATA_AXIS, CONTEXT_AXIS), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:context])
  with jax.set_mesh(mesh):
    sharding = NamedSharding(mesh, P(DATA_AXIS, CONTEXT_AXIS))
    arrays = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
              for k, v in arrays.items()}
    return step.lower(params, arrays)


def temp_bytes_per_device(name: str, *, length: int, context: int, causal: bool = True) -> int:
  """XLA's temp memory of one device's compiled forward+backward of `name` (batch 1, the
  suite's heads) at `length` on a mesh of `context` devices splitting the sequence (1: one
  device, no mesh). Compiled only, never run. Equality alone cannot show that a module splits
  its work (XLA's partitioner would gather a sharded input and compute the whole sequence on
  every device, correctly): this memory can."""
  lowered = _lowered_step(name, length=length, context=context, causal=causal)
  return lowered.compile().memory_analysis().temp_size_in_bytes


def compile_step(name: str, *, length: int, context: int):
  """`name`'s compiled forward+backward as `profile` reads it (causal where it can be), for a
  caller that reads both its memory and its `collectives`. Compiled only, never run."""
  return _lowered_step(name, length=length, context=context,
                       causal=registry.spec(name).supports_causal).compile()


# A collective in compiled HLO: its result shape(s), then its opcode (async ones as -start).
_COLLECTIVE = re.compile(r"= \(?((?:[a-z0-9]+\[[0-9,]*\][^ ]*(?:, )?)+)\)? "
                         r"(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
                         r"(?:-start)?\(")


@dataclasses.dataclass(frozen=True)
class Profile:
  """What one compiled forward+backward of `name` at `length` needs on a `context` mesh."""
  name: str
  length: int
  context: int
  one_device_bytes: int      # temp memory on one device, no mesh
  bytes: int                 # temp memory per device on the mesh
  collectives: list          # [opcode, [shape of each result]] of the mesh's program
  manual_regions: int        # shard_map regions in the program: an op's own context form ran


def collectives(compiled) -> list:
  """[opcode, [shape of each result]] of every collective in a compiled program."""
  return [[opcode, [[int(n) for n in dims.split(",") if n]
                    for dims in re.findall(r"\[([0-9,]*)\]", shapes)]]
          for shapes, opcode in _COLLECTIVE.findall(compiled.as_text())]


def profile(name: str, *, length: int, context: int) -> Profile:
  """Memory and collectives of `name`'s compiled step (causal where it can be), never run."""
  step = partial(_lowered_step, name, length=length, causal=registry.spec(name).supports_causal)
  lowered = step(context=context)
  sharded = lowered.compile()
  return Profile(name, length, context,
                 step(context=1).compile().memory_analysis().temp_size_in_bytes,
                 sharded.memory_analysis().temp_size_in_bytes, collectives(sharded),
                 lowered.as_text().count("sdy.manual_computation"))


def cases_of(name: str, without=()) -> list[tuple[Case, bool]]:
  """(case, float64) of each case `run` checks for `name`: every case but those named in
  `without` in float32, and its FLOAT64_CASES entry in float64."""
  cases = [case for case in CASES if case.name not in without]
  widened = [(case, True) for case in cases if case.name == FLOAT64_CASES.get(name)]
  return [(case, False) for case in cases] + widened


def run(names, without=()) -> list[CaseResult]:
  results = []
  for name in names:
    for case, float64 in cases_of(name, without):
      try:
        with jax.enable_x64(float64):
          results.append(run_case(name, case, float64))
      except Exception as e:   # reported per case, so one failure does not hide the others
        results.append(CaseResult(name, case.name, None, f"{type(e).__name__}: {e}"))
  return results


def run_in_child(names, devices: int = DEVICES, timeout: float = 900,
                 without=()) -> list[CaseResult]:
  """`run(names, without)` in a child process with `devices` simulated CPU devices."""
  return check_in_child(names, devices=devices, timeout=timeout, without=without)[0]


def check_in_child(names, *, profile_lengths=(), profile_context: int = 4, devices: int = DEVICES,
                   timeout: float = 900, without=()) -> tuple[list[CaseResult], list[Profile]]:
  """In one child process with `devices` simulated CPU devices: `run(names, without)`, then each
  name's `profile` at each of `profile_lengths` on a mesh of `profile_context` devices."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} "
                      f"--xla_force_host_platform_device_count={devices}").strip()
  lengths = ",".join(map(str, profile_lengths))
  flags = [f"--profile={lengths}@{profile_context}"] if lengths else []
  flags += [f"--without={','.join(without)}"] if without else []
  child = subprocess.run([sys.executable, "-m", __name__, *flags, *names], env=env,
                         capture_output=True, text=True, timeout=timeout)
  if child.returncode != 0:
    raise RuntimeError(f"the context-parallel check of {', '.join(names)} exited "
                       f"{child.returncode}:\n{child.stderr[-4000:]}")
  lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
  return ([CaseResult(**line["case"]) for line in lines if "case" in line],
          [Profile(**line["profile"]) for line in lines if "profile" in line])


def main(argv) -> int:
  """`NAME ...`: each name's cases; `--without=CASE,...`: but those; `--profile=LENGTH,...@CONTEXT
  NAME ...`: then its profiles."""
  if len(jax.devices()) < DEVICES:
    print(f"needs {DEVICES} devices, has {len(jax.devices())}: run with XLA_FLAGS="
          f"--xla_force_host_platform_device_count={DEVICES}", file=sys.stderr)
    return 2
  flags = [arg for arg in argv if arg.startswith("--profile=")]
  without = [arg for arg in argv if arg.startswith("--without=")]
  names = [arg for arg in argv if arg not in flags + without]
  skipped = without[-1].removeprefix("--without=").split(",") if without else ()
  for result in run(names, skipped):
    print(json.dumps({"case": dataclasses.asdict(result)}), flush=True)
  for flag in flags:
    lengths, context = flag.removeprefix("--profile=").split("@")
    for name in names:
      for length in lengths.split(","):
        found = profile(name, length=int(length), context=int(context))
        print(json.dumps({"profile": dataclasses.asdict(found)}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
