"""The harness on a device mesh (experiments/train/mesh.py): config.mesh's checks, FSDP's train step
against the replicated one, performer's context-parallel form trained as one device, and a
sharded checkpoint of two processes (fsdp 2 × context 2) resumed on 4, 2 and 1 devices. A device
count is fixed when JAX starts, so every run on simulated devices is a child process with
--xla_force_host_platform_device_count."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from command_runner import free_port

import attention_zoo as az
from attention_zoo.registry import scoped_registry
from attention_zoo.variants.full import FullAttention
from experiments.common import task_configs
from experiments.common.errors import HarnessError
from experiments.train import build, mesh, trainer
from experiments.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[3]
SMALL = {"model.num_layers": 1, "model.emb_dim": 16, "model.num_heads": 2, "model.mlp_dim": 32,
         "model.max_len": 32, "model.dropout_rate": 0.0, "batch_size": 4, "log_every": 1,
         "schedule.steps_per_cycle": 100}


def resolved(attention="full", **values):
  checked, _ = build.check(task_configs.task_config(
      "listops", attention, "tiny", 0, [f"{k}={v}" for k, v in {**SMALL, **values}.items()]))
  return checked


def mesh_config(**sizes):
  return {**{axis: 1 for axis in mesh.AXES}, "data": -1, **sizes}


# -- the checks, before anything is built -------------------------------------------------------

def test_sizes_fill_in_the_rest_and_shard_specs_cut_the_largest_divisible_axis():
  assert mesh.sizes(mesh_config(), 8) == {"data": 8, "fsdp": 1, "context": 1}
  assert mesh.sizes(mesh_config(fsdp=2, context=2), 8) == {"data": 2, "fsdp": 2, "context": 2}
  assert mesh.sizes(mesh_config(data=2, fsdp=-1), 8) == {"data": 2, "fsdp": 4, "context": 1}
  assert mesh.shard_spec((16, 64), 4) == mesh.PartitionSpec(None, "fsdp")
  assert mesh.shard_spec((64, 10), 4) == mesh.PartitionSpec("fsdp", None)
  assert mesh.shard_spec((10,), 4) == mesh.PartitionSpec()
  assert mesh.shard_spec((16, 64), 1) == mesh.PartitionSpec()


@pytest.mark.parametrize("sizes, devices, message", [
    (dict(data=3), 4, r"config.mesh: mesh.data=3 × mesh.fsdp=1 × mesh.context=1 is 3 devices but "
                      r"this run has 4; make the product 4"),
    (dict(fsdp=3), 4, r"mesh.fsdp=3 × mesh.context=1 needs 3 devices, which do not divide the 4 "
                      r"devices.*divides 4: 1, 2, 4"),
    (dict(data=-1, fsdp=-1), 4, r"config.mesh.data and config.mesh.fsdp are both -1"),
    (dict(context=0), 4, r"config.mesh.context=0: a mesh size is a number of devices dividing 4 "
                         r"\(1, 2, 4\), or -1"),
])
def test_a_mesh_that_is_not_the_device_count_is_refused_naming_the_field(sizes, devices,
                                                                         message):
  with pytest.raises(HarnessError, match=message) as error:
    mesh.sizes(mesh_config(**sizes), devices)
  assert "\n" not in str(error.value)


def test_a_batch_or_length_the_mesh_does_not_divide_is_refused():
  with pytest.raises(HarnessError, match=r"batch_size / grad_accum_steps = 4 is not divisible by "
                     r"the 8 devices of mesh.data × mesh.fsdp \(2 × 4\).*multiple of 8"):
    mesh.check(resolved(**{"mesh.fsdp": 4}), 8)
  with pytest.raises(HarnessError, match=r"eval_batch_size = 6 .* 4 devices"):
    mesh.check(resolved(eval_batch_size=6, **{"mesh.fsdp": 2}), 4)
  with pytest.raises(HarnessError, match=r"model.max_len=30 is not divisible by mesh.context=4.*"
                     r"use model.max_len=28 or 32, or a mesh.context dividing 30: 1, 2, 3, 5, "
                     r"6, 10, 15, 30"):
    mesh.check(resolved("performer", **{"model.max_len": 30, "mesh.context": 4,
                                        "model.pooling": "mean"}), 4)
  # A classifier's CLS token is one more position for the layers to split.
  with pytest.raises(HarnessError, match=r"model.pooling=cls prepends a token, so the layers see "
                     r"max_len \+ 1 = 33 positions, which mesh.context=2 cannot split as it "
                     r"splits the 32 of the batch; use model.pooling=mean"):
    mesh.check(resolved("performer", **{"mesh.context": 2, "model.pooling": "cls"}), 2)


def test_context_parallelism_asked_of_a_variant_without_it_names_the_variants_with_it():
  config = resolved("synthesizer", **{"mesh.context": 2, "model.pooling": "mean"})
  with scoped_registry():
    az.register("mesh_test_ring", exact=True, supports_causal=True, supports_cross=True,
                complexity="O(n^2)", paper="-", supports_context_parallel=True)(
                    type("Ring", (FullAttention,), {}))
    with pytest.raises(HarnessError, match=r"mesh.context=2 splits the sequence, which synthesizer "
                       r"cannot \(its spec has no supports_context_parallel\); variants that "
                       r"can: .*mesh_test_ring.*; or mesh.context=1"):
      mesh.check(config, 2)
    config.model.attention = "mesh_test_ring"
    assert mesh.check(config, 2) == {"data": 1, "fsdp": 1, "context": 2}
    config.length_bucket = 8
    with pytest.raises(HarnessError, match="length_bucket=8 .* mesh.context=2 .* use 0"):
      mesh.check(config, 2)


# -- on simulated devices, each run a child process ---------------------------------------------

# XLA ends a process whose CPU devices wait more than 40 s for each other in a collective; a
# loaded test machine can be that slow.
COLLECTIVE_TIMEOUT = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def start(args, *, devices, env=None, code=None):
  """`python -m args...` (or `python -c code`) on `devices` simulated CPU devices."""
  env = {**os.environ, **(env or {}),
         "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                      f"--xla_force_host_platform_device_count={devices} {COLLECTIVE_TIMEOUT}",
         "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
  command = ["-c", code] if code is not None else ["-m", *args]
  return subprocess.Popen([sys.executable, *command], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(process, timeout=600):
  stdout, stderr = process.communicate(timeout=timeout)
  assert process.returncode == 0, stderr
  return stdout


def test_a_bad_mesh_ends_the_command_in_one_line_before_anything_compiles(tmp_path):
  process = start(["experiments.train", "--config=configs/lra/listops.py:full,tiny",
                   f"--workdir={tmp_path}", "--config.mesh.fsdp=3"], devices=2)
  stdout, stderr = process.communicate(timeout=300)
  assert process.returncode != 0
  lines = stderr.strip().splitlines()
  assert lines[-1].startswith("error: config.mesh: mesh.fsdp=3 × mesh.context=1 needs 3 devices")
  assert "compiling" not in stderr and not any("Traceback" in line for line in lines)


def test_the_dry_run_prints_the_mesh_and_each_arrays_sharding(tmp_path):
  stdout = finish(start(["experiments.train", "--config=configs/lra/listops.py:full,tiny",
                         f"--workdir={tmp_path}", "--config.mesh.fsdp=2", "--dry_run",
                         *(f"--config.{k}={v}" for k, v in SMALL.items())], devices=4))
  assert "mesh data 2 × fsdp 2 × context 1 (4 devices)" in stdout
  assert "mesh: data 2 × fsdp 2 × context 1 (4 devices)" in stdout
  assert "params cut over fsdp: the model gathers a layer's whole just before it runs" in stdout
  assert re.search(r"params\['encoder'\]\['embed'\]\['embedding'\] \[\d+, 16\] float32: "
                   r"P\(None, 'fsdp'\)", stdout)
  assert re.search(r"opt_state.*\.mu\['encoder'\]\['embed'\]\['embedding'\] .*P\(None, 'fsdp'\)",
                   stdout)
  assert "batch['inputs'] [4, 32] int32: P(('data', 'fsdp'), 'context')" in stdout


FSDP_STEP = """
import json
import jax, numpy as np
from flax import nnx
from experiments.common import task_configs
from experiments.train import build, data as data_lib, mesh, trainer, steps as train_steps

config, _ = build.check(task_configs.task_config("listops", "full", "tiny", 0, {overrides!r}))
rng = np.random.default_rng(0)
batch = {{"inputs": rng.integers(1, config.model.vocab_size, (8, 32)).astype(np.int32),
          "masks": np.ones((8, 32), bool), "targets": rng.integers(0, 10, (8,)).astype(np.int32),
          "weights": np.ones((8,), np.float32)}}
graphdef = nnx.split(trainer.abstract_model(config), nnx.Param, ...)[0]
results = {{}}
for name, sizes in {{"replicated": {{"data": 4}}, "fsdp": {{"fsdp": 4}}}}.items():
  layout = mesh.Layout(sizes)
  with jax.set_mesh(layout.mesh):
    steps = train_steps.make_steps(config, graphdef, layout)
    def initial():
      _, params, rest = nnx.split(trainer.build_model(config)[0], nnx.Param, ...)
      return train_steps.initial_state(steps, params, rest)
    state = steps.create(initial)
    on_device = data_lib.to_device(batch, layout)
    compiled = steps.train.lower(state, on_device).compile()
    batch_bytes = sum(x.addressable_shards[0].data.nbytes for x in on_device.values())
    state_bytes = compiled.memory_analysis().argument_size_in_bytes - batch_bytes
    state, metrics = compiled(state, on_device)
    state, metrics = compiled(state, on_device)   # a second step: the first one's output fed back
  params = jax.tree.leaves(state.params)
  results[name] = {{"loss": float(metrics["train_loss"]), "state_bytes": int(state_bytes),
                   "params": np.concatenate([np.ravel(p) for p in params]).tolist(),
                   "specs": sorted({{str(p.sharding.spec) for p in params}})}}
print(json.dumps(results))
"""


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "block"])
def test_a_train_step_on_fsdp_4_equals_the_replicated_one_with_a_quarter_of_the_state(remat):
  # Adam divides by the gradient's own size: a gradient that is zero but for rounding (the key
  # bias: softmax ignores a shift) would become a full step of rounding's sign. eps=1 keeps the
  # update proportional to the gradient, so the two steps compare to rounding. Two blocks, each
  # gathered on its own (and under remat "none" gathered again in the backward pass).
  overrides = [f"{k}={v}" for k, v in SMALL.items()] + [
      "batch_size=8", "optimizer.eps=1.0", "model.num_layers=2", f"model.remat={remat}"]
  stdout = finish(start([], devices=4, code=textwrap.dedent(FSDP_STEP.format(
      overrides=overrides))))
  results = json.loads(stdout.strip().splitlines()[-1])
  replicated, fsdp = results["replicated"], results["fsdp"]
  assert fsdp["loss"] == pytest.approx(replicated["loss"], rel=1e-5)
  np.testing.assert_allclose(fsdp["params"], replicated["params"], rtol=1e-5, atol=1e-7)
  assert replicated["specs"] == ["P()"]
  assert "P(None, 'fsdp')" in fsdp["specs"]
  # Per device: parameters, Adam's two moments, the step; a few vectors (10 classes) are copied.
  ratio = fsdp["state_bytes"] / replicated["state_bytes"]
  assert 0.2 < ratio < 0.3, (fsdp["state_bytes"], replicated["state_bytes"])


FSDP_COMPILED = """
import json, re
import jax
from flax import nnx
from experiments.common import task_configs
from experiments.train import build, mesh, trainer, steps as train_steps

config, _ = build.check(task_configs.task_config("listops", "full", "tiny", 0, {overrides!r}))
layout = mesh.Layout({{"fsdp": 4}})
with jax.set_mesh(layout.mesh):
  steps = train_steps.make_steps(config, nnx.split(trainer.abstract_model(config))[0], layout)
  def initial():
    _, params, rest = nnx.split(trainer.build_model(config)[0], nnx.Param, ...)
    return train_steps.initial_state(steps, params, rest)
  state = jax.eval_shape(initial)
  placed = lambda tree, sharding_of: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(x)), tree)
  n = config.model.max_len
  batch = {{"inputs": jax.ShapeDtypeStruct((4, n), "int32"),
           "masks": jax.ShapeDtypeStruct((4, n), bool),
           "targets": jax.ShapeDtypeStruct((4,), "int32"),
           "weights": jax.ShapeDtypeStruct((4,), "float32")}}
  compiled = steps.train.lower(placed(state, layout.state),
                               placed(batch, lambda x: layout.batch(x.ndim))).compile()
memory = compiled.memory_analysis()
# The program's computations (each begins with a header line that ends in "{{": the entry's, a
# branch's...), and how many all-gathers each holds.
gathers = []
for line in compiled.as_text().splitlines():
  if line.endswith("{{") and line.startswith(("%", "ENTRY")):
    gathers.append(0)
  elif re.search(r" all-gather(-start)?[(]", line):
    gathers[-1] += 1
print(json.dumps({{
    "temp": memory.temp_size_in_bytes, "arguments": memory.argument_size_in_bytes,
    "parameters": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params)),
    "gathers": gathers}}))
"""


@pytest.mark.slow   # compiles an 8-layer train step on 4 devices: 18 s
def test_fsdp_gathers_the_parameters_block_by_block_so_a_device_never_holds_them_all():
  """Compiled (never run) on fsdp 4, a train step of 8 blocks whose parameters are most of its
  memory: each block's forward and backward gathers its parameters in a computation of its own,
  and the temporaries per device stay below the whole model's parameters, which a device would
  hold at once if they were gathered together (the train step did so before: twice them)."""
  layers = 8
  overrides = [f"{k}={v}" for k, v in {
      **SMALL, "model.num_layers": layers, "model.emb_dim": 256, "model.num_heads": 4,
      "model.mlp_dim": 512, "model.max_len": 16, "model.pooling": "mean"}.items()]
  stdout = finish(start([], devices=4, code=textwrap.dedent(FSDP_COMPILED.format(
      overrides=overrides))))
  compiled = json.loads(stdout.strip().splitlines()[-1])
  assert compiled["temp"] < compiled["parameters"], compiled
  assert sum(count > 0 for count in compiled["gathers"]) >= 2 * layers, compiled["gathers"]


FSDP_MODELS = """
import dataclasses, json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from attention_zoo.models import BottleneckLM, DecoderLM, EncoderDecoder, TransformerConfig
from experiments.train import mesh

config = TransformerConfig(vocab_size=32, max_len=16, num_layers=2, emb_dim=32, num_heads=4,
                           mlp_dim=64, dropout_rate=0.0, positions="learned")
tokens = jnp.asarray(np.random.default_rng(0).integers(1, 32, (4, 16)), jnp.int32)
calls = {"DecoderLM": (DecoderLM, lambda model: model(tokens)),
         "EncoderDecoder": (EncoderDecoder, lambda model: model(tokens, tokens[:, ::-1])),
         "BottleneckLM": (BottleneckLM, lambda model: model(tokens))}
layout = mesh.Layout({"fsdp": 4})
errors = {}
for name, (kind, call) in calls.items():
  for remat in ("none", "block"):
    graphdef, params, rest = nnx.split(
        kind(dataclasses.replace(config, remat=remat), rngs=nnx.Rngs(0)), nnx.Param, ...)
    loss = lambda params: jnp.sum(call(nnx.merge(graphdef, params, rest)) ** 2)
    one = jax.jit(jax.value_and_grad(loss))(params)
    with jax.set_mesh(layout.mesh):
      split = jax.jit(jax.value_and_grad(loss))(
          jax.tree.map(lambda x: jax.device_put(x, layout.state(x)), params))
    # Relative to the largest gradient: one that is zero but for rounding (the key bias:
    # softmax ignores a shift) differs by rounding alone.
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(one[1]))
    errors[f"{name} remat={remat}"] = max(
        [abs(float(one[0] - split[0]) / float(one[0]))]
        + [float(jnp.max(jnp.abs(a - b))) / scale
           for a, b in zip(jax.tree.leaves(one[1]), jax.tree.leaves(split[1]), strict=True)])
print(json.dumps(errors))
"""


@pytest.mark.slow
def test_every_stack_on_fsdp_4_gives_the_loss_and_gradients_of_one_device():
  """The library's models with their parameters cut over fsdp 4 (each block gathered on its
  own): a decoder LM, an encoder-decoder (both stacks, cross-attention), the bottleneck LM (its
  read-out layers), with learned positions, remat none and block; against no mesh."""
  errors = json.loads(finish(start([], devices=4, code=FSDP_MODELS)).strip().splitlines()[-1])
  assert len(errors) == 6 and max(errors.values()) < 1e-5, errors


@pytest.mark.slow
def test_two_processes_checkpoint_resumes_on_4_2_and_1_devices_with_the_same_losses(
    listops_dir, tmp_path):
  """Two processes of 2 simulated devices each (gloo over the loopback address) train performer
  with fsdp 2 × context 2 (its context-parallel form; parameters split too) and save sharded
  checkpoints; the step-2 one resumes on one process of 4 devices (fsdp 4), of 2 (context 2),
  and in this process on 1, each giving the same losses."""
  settings = {**SMALL, "num_train_steps": 4, "eval_every": 2, "data_dir": listops_dir,
              "model.pooling": "mean"}   # a CLS token would make 33 positions
  flags = [f"--config.{k}={v}" for k, v in settings.items()]
  run = ["experiments.train", "--config=configs/lra/listops.py:performer,tiny",
         f"--workdir={tmp_path}", *flags]
  address = f"127.0.0.1:{free_port()}"
  processes = [start([*run, "--config.mesh.data=1", "--config.mesh.fsdp=2",
                      "--config.mesh.context=2"], devices=2,
                     env={"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2",
                          "JAX_PROCESS_ID": str(i)}) for i in range(2)]
  for process in processes:
    finish(process)
  two = json.loads((tmp_path / "results.json").read_text())
  assert (two["environment"]["process_count"], two["environment"]["device_count"]) == (2, 4)

  def losses():
    return [e["train_loss"] for e in read_metrics(tmp_path) if "train_loss" in e]

  trained = losses()
  assert len(trained) == 4

  def from_step_2():
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    (tmp_path / "results.json").unlink()

  for devices, mesh_flag in ((4, "--config.mesh.fsdp=4"), (2, "--config.mesh.context=2")):
    from_step_2()
    finish(start([*run, mesh_flag], devices=devices))
    resumed = json.loads((tmp_path / "results.json").read_text())
    assert resumed["environment"]["device_count"] == devices
    assert losses() == pytest.approx(trained, rel=1e-5)
    assert resumed["test_loss_final"] == pytest.approx(two["test_loss_final"], rel=1e-5)
  from_step_2()
  config = task_configs.task_config("listops", "performer", "tiny", 0,
                                    [f"{k}={v}" for k, v in settings.items()])
  resumed = trainer.Trainer(config, tmp_path).run()
  assert losses() == pytest.approx(trained, rel=1e-5)
  assert resumed["test_loss_final"] == pytest.approx(two["test_loss_final"], rel=1e-5)


@pytest.mark.slow
def test_a_run_with_the_sequence_split_over_context_equals_one_device(listops_dir, tmp_path):
  """performer's context-parallel form on data 2 × context 2 trains as one device does."""
  settings = {**SMALL, "num_train_steps": 3, "eval_every": 3, "data_dir": listops_dir,
              "model.pooling": "mean"}
  process = start(["experiments.train", "--config=configs/lra/listops.py:performer,tiny",
                   f"--workdir={tmp_path / 'split'}", "--config.mesh.context=2",
                   *(f"--config.{k}={v}" for k, v in settings.items())], devices=4)
  one = trainer.Trainer(task_configs.task_config(
      "listops", "performer", "tiny", 0, [f"{k}={v}" for k, v in settings.items()]),
      tmp_path / "one").run()
  finish(process)
  split = json.loads((tmp_path / "split" / "results.json").read_text())
  assert split["environment"]["device_count"] == 4
  losses = [[e["train_loss"] for e in read_metrics(tmp_path / name) if "train_loss" in e]
            for name in ("one", "split")]
  assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-5)
  assert split["test_loss_final"] == pytest.approx(one["test_loss_final"], rel=1e-5)
