"""The harness without training: configs for every task x attention, schedules, overrides,
plugins, the short ListOps generator, and the report on results written here."""
import ast
import dataclasses
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import attention_zoo as az
import lra
import synthetic
from attention_zoo.models import TransformerConfig
from configs import presets
from configs.lra import common
from configs.lra.paper_tables import TABLE1 as LRA_TABLE1
from configs.task_values import TaskValues
from experiments import report, reproduce, sweep
from experiments.benchmark import capacity, outputs
from experiments.benchmark.outputs import ENVIRONMENT
from experiments.benchmark.settings import Status
from experiments.common import command_line, overrides, plots, task_configs, tasks, variant_names
from experiments.common.errors import HarnessError
from experiments.train import build, optimizer
from experiments.train import data as data_lib

REPO = Path(__file__).resolve().parents[2]
TASKS = lra.available_tasks()


def get_config(task, arg):
  return importlib.import_module(f"configs.lra.{task}").get_config(arg)


def check(config):
  """The config as the run uses it (build.check)."""
  return build.check(config)[0]


def resolved(task, arg):
  """The config as the run sees it."""
  return check(get_config(task, arg))


# ------------------------------------------------------------------------------------ configs

# The light presets are the Nyströmformer paper's ListOps protocol (tests/test_light_preset.py).
TASK_PRESETS = [(task, preset) for task in TASKS for preset in common.LRA_PRESETS
                if task == "listops" or preset not in common.LIGHT_PRESETS]


@pytest.mark.parametrize("task, preset", TASK_PRESETS)
@pytest.mark.parametrize("attention", az.available())
def test_every_task_attention_config_builds(attention, task, preset):
  config = get_config(task, f"{attention},{preset}")
  spec, task_spec = az.spec(attention), lra.task_spec(task)
  if not spec.supports_bidirectional:   # an LRA model is an encoder
    with pytest.raises(HarnessError, match=f"{attention} is causal only, and {task}'s model"):
      check(config)
    return
  for field in ("data_dir", "batch_size", "num_train_steps", "eval_every", "checkpoint_every",
                "seed", "model", "optimizer", "schedule"):
    assert field in config
  assert (config.task, config.preset, config.model.attention) == (task, preset, attention)
  assert config.data_dir == common.DATA_DIRS[preset]
  assert config.model.num_classes == task_spec.num_classes
  # the light protocol's embedding table has 32 rows (ids above the task's are never fed)
  assert config.model.vocab_size == (32 if preset in common.LIGHT_PRESETS
                                     else task_spec.vocab_size)
  # The variant's settings are applied by get_config itself, and recorded as such.
  assert config.made.variant == attention
  model = build.model_config(config)
  assert set(model.attention_options) <= set(spec.options)
  if not spec.supports_dropout:
    assert model.attention_dropout_rate == 0
  # The model builds at this length (abstractly: no memory).
  nnx.eval_shape(lambda: build.model_class(task)(model, rngs=nnx.Rngs(0)))


def test_a_grid_marks_a_variant_that_cannot_run_a_task_not_applicable_with_the_reason():
  assert reproduce.not_applicable("mqar", "linformer").startswith("linformer cannot be causal")
  assert reproduce.not_applicable("listops", "stick_breaking").startswith(
      "stick_breaking is causal only: the stick is broken")
  assert reproduce.not_applicable("mqar", "stick_breaking") is None
  assert reproduce.not_applicable("listops", "linformer") is None


def test_paper_preset_has_the_released_hyperparameters():
  listops = get_config("listops", "performer")  # preset paper is the default
  assert listops.preset == "paper"
  assert (listops.model.num_layers, listops.model.emb_dim, listops.model.num_heads,
          listops.model.mlp_dim, listops.model.max_len) == (4, 512, 8, 1024, 2000)
  assert (listops.batch_size, listops.num_train_steps, listops.eval_every) == (32, 5000, 50)
  lra_schedule = ("factors", "base_learning_rate", "warmup_steps", "steps_per_cycle")
  assert {name: listops.schedule[name] for name in lra_schedule} == {
      "factors": common.RSQRT, "base_learning_rate": 0.05, "warmup_steps": 1000,
      "steps_per_cycle": 0}
  assert not listops.schedule.cycle_b1   # one_cycle's fields are unused
  assert (listops.optimizer.b1, listops.optimizer.b2, listops.optimizer.eps,
          listops.optimizer.weight_decay) == (0.9, 0.98, 1e-9, 0.1)
  # The released quirks, each a named field.
  assert listops.model.embed_init_std == 1.0 and listops.model.zero_token_is_padding
  # FAVOR+ softmax with 2 features on ListOps; a ReLU kernel without random features elsewhere.
  assert build.model_config(listops).attention_options["nb_features"] == 2
  text_performer = build.model_config(resolved("text", "performer"))
  assert text_performer.attention_options["kernel"] == "relu"
  assert text_performer.attention_options["features"] == "deterministic"
  assert text_performer.attention_ignores_padding
  reformer = build.model_config(resolved("text", "reformer"))
  assert reformer.attention_options["num_chunks"] == 10
  assert reformer.attention_options["scale"] == pytest.approx(math.sqrt(256 // 4))
  longformer = build.model_config(resolved("listops", "longformer"))
  assert longformer.attention_options["num_global_tokens"] == 0
  retrieval = resolved("retrieval", "full")
  assert (retrieval.model.interaction, retrieval.model.max_len) == ("nli", 4000)
  # Image: qkv 64 (not emb 128), and each model's released dimensions.
  image = resolved("image", "full")
  assert (image.model.emb_dim, image.model.qkv_dim, image.model.num_heads) == (128, 64, 8)
  assert (image.batch_size, image.num_train_steps, image.schedule.factors) == (256, 35_000,
                                                                             common.COSINE)
  assert (image.model.dropout_rate, image.model.attention_dropout_rate) == (0.3, 0.2)
  local = resolved("image", "local")
  assert (local.model.num_heads, local.model.pooling) == (2, "mean")
  assert build.model_config(local).attention_options["block_size"] == 64
  reformer = resolved("image", "reformer").model
  assert (reformer.num_layers, reformer.emb_dim, reformer.mlp_dim) == (4, 64, 64)
  assert resolved("image", "longformer").model.num_layers == 4
  sinkhorn = resolved("image", "sinkhorn")
  assert sinkhorn.optimizer.weight_decay == 0.7 and sinkhorn.model.pooling == "mean"
  assert build.model_config(sinkhorn).attention_options["block_size"] == 64
  assert resolved("image", "bigbird").model.num_heads == 1   # the misspelt num_head
  pathfinder = resolved("pathfinder", "full")
  assert (pathfinder.batch_size, pathfinder.num_train_steps, pathfinder.model.pooling) == (
      512, 62_400, "mean")
  assert (pathfinder.model.dropout_rate, pathfinder.model.qkv_dim) == (0.2, 16)
  assert resolved("pathfinder", "performer").model.emb_dim == 128   # LRA issue #37
  assert resolved("pathx", "full").model.max_len == 128 * 128


def test_fair_preset_fixes_the_quirks_on_the_same_budget():
  for task in TASKS:
    for attention in common.LRA_VARIANTS:
      paper, fair = (resolved(task, f"{attention},{p}") for p in ("paper", "fair"))
      transformer = resolved(task, "full,paper")
      for field in ("batch_size", "num_train_steps", "eval_every"):
        assert fair[field] == paper[field]
      assert dict(fair.schedule) == dict(paper.schedule)
      for field in ("num_layers", "emb_dim", "qkv_dim", "mlp_dim", "num_heads", "pooling",
                    "dropout_rate", "max_len"):
        assert fair.model[field] == transformer.model[field], (task, attention, field)
      model = build.model_config(fair)
      assert model.embed_init_std is None and not model.zero_token_is_padding
      assert not model.attention_ignores_padding
  fair_performer = build.model_config(resolved("text", "performer,fair")).attention_options
  assert (fair_performer["kernel"], fair_performer["nb_features"]) == ("softmax", 256)
  assert build.model_config(resolved("listops", "longformer,fair")).attention_options[
      "num_global_tokens"] == 1


def test_length_options_scale_with_the_built_max_len():
  paper = get_config("listops", "sparse_transformer")
  tiny = get_config("listops", "sparse_transformer,tiny")
  ratio = tiny.model.max_len / paper.model.max_len
  assert tiny.model.max_len <= 512 and tiny.data_dir != paper.data_dir
  assert build.model_config(paper).attention_options["block_size"] == 50
  options = build.model_config(tiny).attention_options
  assert options["block_size"] == max(4, round(50 * ratio))
  assert options["num_summary"] <= options["block_size"]
  # max_len overridden after get_config: the check step scales the preset's option again.
  paper.model.max_len = 500
  assert check(paper).model.attention_options["block_size"] == round(50 * 500 / 2000)
  # An option set in the config is taken as it is.
  tiny.model.attention_options.block_size = 7
  assert build.model_config(tiny).attention_options["block_size"] == 7
  assert (presets.scale_length_options({"block_size": 64, "k": 16}, 0.25)
          == {"block_size": 16, "k": 16})
  assert presets.scale_length_options({"window": 256}, 1.0) == {"window": 256}
  # Pixel tasks keep their length, and so their blocks.
  assert build.model_config(get_config("image", "local,tiny")).attention_options["block_size"] == 64


def test_the_variant_and_its_options_come_from_the_config_argument():
  """get_config applied the variant's settings: another variant is named in the argument, not
  overridden; an option the variant lacks is refused by the check."""
  config = task_configs.task_config("listops", "local", "paper", 0,
                                    ["model.attention_options.nb_features=8"])
  with pytest.raises(HarnessError, match="local has no option 'nb_features'; its options: "
                                             "block_size"):
    check(config)
  for fixed in ("preset=tiny", "task=text", "model.attention=local", "made.variant=local"):
    with pytest.raises(HarnessError, match="cannot be overridden"):
      task_configs.task_config("listops", "full", "paper", 0, [fixed])


def test_config_argument_errors_and_late_registered_names():
  assert presets.parse_arg("listops", None, common.PRESETS) == ("full", "paper")
  assert presets.parse_arg("listops", "performer, tiny", common.PRESETS) == ("performer", "tiny")
  with pytest.raises(ValueError, match="listops has no preset 'huge'; its presets: paper, fair"):
    get_config("listops", "full,huge")
  with pytest.raises(ValueError, match=r"has no preset 'tnyi' \(did you mean 'tiny'\?\)"):
    get_config("listops", "full,tnyi")
  with pytest.raises(ValueError, match="expected '<attention>\\[,<preset>\\]'"):
    get_config("listops", "full,tiny,extra")
  # A name a plugin registers later still builds a config (checked by the trainer).
  config = get_config("listops", "not_registered_yet,tiny")
  assert config.model.attention == "not_registered_yet"
  assert dict(config.model.attention_options) == {}


def test_unknown_field_names_the_valid_ones():
  config = get_config("listops", "full,tiny")
  assert overrides.unknown_field(config, "model.num_layers") is None
  message = overrides.unknown_field(config, "model.nope")
  assert "unknown config field 'model.nope'" in message and "num_layers" in message
  assert "config has no field 'optimiser'" in overrides.unknown_field(config, "optimiser.b1")


def test_no_config_file_imports_the_project():
  """configs/ is data: it may import ml_collections, the standard library and other configs,
  never the library, the data package or the harness."""
  project = {"attention_zoo", "lra", "experiments"}
  paths = sorted(REPO.joinpath("configs").rglob("*.py"))
  assert paths, "no config file found under configs/"
  for path in paths:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      for name in names:
        assert name.split(".")[0] not in project, f"{path.relative_to(REPO)} imports {name}"


def test_every_task_config_file_declares_its_values():
  """configs/task_values.py's protocol: each task's config file declares VALUES, the TaskValues
  of that task, which the build step reads (an LRA task's released values, a diagnostic's
  attention settings)."""
  for task in TASKS + synthetic.available_tasks():
    values = task_configs.task_values(task)
    assert isinstance(values, TaskValues) and values.task == task, task
    assert values.is_lra == (task in TASKS), task
    assert values.is_lra or values.attention_settings, task
  with pytest.raises(ValueError, match="under 'shared'"):
    TaskValues("listops", released={"full": {}})
  with pytest.raises(ValueError, match="not attention_settings"):
    TaskValues("listops", released={"shared": {}}, attention_settings={"local": {}})


def test_config_model_fields_are_the_transformer_config_fields():
  model = common.base_config("listops", "full", "tiny").model
  fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
  assert set(model) == set(fields)
  # Each default is the library's.
  for name, field in fields.items():
    if field.default is not dataclasses.MISSING:
      assert model[name] == field.default, name
  assert model.get_type("qkv_dim") is int


def test_the_variants_settings_are_in_get_config_and_the_users_values_win():
  # Under paper, the dimensions that a variant's released file changes are the variant's.
  config = get_config("image", "local,paper")
  assert (config.model.num_heads, config.model.pooling) == (2, "mean")
  assert presets.source_of(config, "model.num_heads") == "variant settings"
  baseline = get_config("image", "local,paper")
  assert build.overrides(config, baseline) == {}   # the run is exactly image.py:local,paper
  overrides.set_field(config, "model.num_heads", "4")
  overrides.set_field(config, "model.attention_options.block_size", "16")
  assert check(config).model.num_heads == 4
  assert build.overrides(config, baseline) == {"model.num_heads": 4,
                                               "model.attention_options.block_size": 16}
  assert build.sources(config, baseline)["model.num_heads"] == presets.COMMAND_LINE
  # The config names only this variant's options.
  assert dict(get_config("listops", "performer,tiny").model.attention_options) == {
      "kernel": "softmax", "nb_features": 256}


def test_unknown_names_suggest_the_closest():
  config = get_config("listops", "performer,tiny")
  assert "(did you mean 'num_layers'?)" in overrides.unknown_field(config, "model.num_layer")
  assert "(did you mean 'schedule'?)" in overrides.unknown_field(config, "schedul.factors")
  assert overrides.unknown_field(config, "model.attention_options.anything") is None
  assert "(did you mean 'performer'?)" in variant_names.unknown_attention("perfomer")
  overrides.set_field(config, "model.attention_options.nb_feature", "16")
  with pytest.raises(HarnessError, match="performer has no option 'nb_feature' "
                                             "\\(did you mean 'nb_features'\\?\\)"):
    check(config)


def test_the_names_read_from_source_are_the_registry():
  assert list(variant_names.names_in_source()) == list(az.available())


def test_an_option_override_applies_to_the_variants_that_have_it(caplog):
  grid = reproduce.grid_configs(preset="tiny", tasks=["listops"],
                                attentions=["full", "performer"], seeds=[0],
                                overrides=["model.attention_options.nb_features=16"])
  with caplog.at_level("INFO"):
    reproduce.drop_options_of_other_variants(grid)
  assert dict(grid["listops", "performer", 0].model.attention_options) == {
      "kernel": "softmax", "nb_features": 16}
  assert dict(grid["listops", "full", 0].model.attention_options) == {}
  assert "model.attention_options.nb_features skipped for full: no such option" in caplog.text
  misspelt = reproduce.grid_configs(preset="tiny", tasks=["listops"],
                                    attentions=["full", "performer"], seeds=[0],
                                    overrides=["model.attention_options.nb_feature=16"])
  with pytest.raises(HarnessError, match="no variant of the grid \\(full, performer\\) has an "
                                             "option 'nb_feature' \\(did you mean 'nb_features'"):
    reproduce.drop_options_of_other_variants(misspelt)


# Runs an entry point as `python -m`, then says on stderr whether it imported JAX.
RUN_AND_REPORT_JAX = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
  runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
finally:
  print("jax imported:", "jax" in sys.modules, file=sys.stderr)
"""


def test_config_and_flag_errors_come_before_jax_is_imported(tmp_path):
  train = ["experiments.train", f"--workdir={tmp_path}"]
  cases = {
      "field": (train + ["--config=configs/lra/listops.py:full,tiny", "--config.model.num_layer=1"],
                "did you mean 'num_layers'"),
      # The option of the variant is accepted; the misspelt field is not.
      "field after an option": (train + ["--config=configs/lra/listops.py:local,tiny",
                                         "--config.model.attention_options.block_size=8",
                                         "--config.num_train_step=1"],
                                "did you mean 'num_train_steps'"),
      "attention": (train + ["--config=configs/lra/listops.py:perfomer,tiny"],
                    "unknown attention 'perfomer' (did you mean 'performer'?)"),
      "overridden attention": (train + ["--config=configs/lra/listops.py:full,tiny",
                                        "--config.model.attention=local"],
                               "config.model.attention cannot be overridden: the variant is "
                               "part of the config argument"),
      # One wording for a misspelt preset, in train and in reproduce.
      "preset": (train + ["--config=configs/lra/listops.py:full,tnyi"],
                 "listops has no preset 'tnyi' (did you mean 'tiny'?)"),
      "preset flag": (["experiments.reproduce", "--preset=tnyi", "--tasks=listops"],
                      "listops has no preset 'tnyi' (did you mean 'tiny'?)"),
      "override": (["experiments.reproduce", "--tasks=listops", "--attentions=full",
                    f"--out={tmp_path}", "--override=model.num_layer=1"],
                   "did you mean 'num_layers'"),
      "tune": (["experiments.reproduce", "--tasks=listops", "--attentions=full",
                f"--out={tmp_path}", "--tune=model.num_layers=1,2", "--tune=model.num_layer=1"],
               "--tune: unknown config field 'model.num_layer'"),
  }
  processes = {name: subprocess.Popen([sys.executable, "-c", RUN_AND_REPORT_JAX, *args], cwd=REPO,
                                      text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for name, (args, _) in cases.items()}
  for name, process in processes.items():
    _, stderr = process.communicate(timeout=120)
    lines = stderr.strip().splitlines()
    assert process.returncode == 1 and len(lines) == 2, (name, stderr)
    assert lines[0].startswith("error: ") and cases[name][1] in lines[0], (name, lines[0])
    assert lines[1] == "jax imported: False", name


def test_misspelt_tasks_and_config_files_get_a_did_you_mean(monkeypatch):
  with pytest.raises(HarnessError, match=r"unknown task 'listop' \(did you mean 'listops'\?\)"):
    reproduce.check_names(["listop"], ["full"])
  with pytest.raises(HarnessError, match=r"unknown task 'mda' \(did you mean 'mad'\?\)"):
    reproduce.check_names(["mda"], ["full"])
  with pytest.raises(ValueError, match=r"unknown task 'mqr' \(did you mean 'mqar'\?\)"):
    tasks.task_spec("mqr")
  monkeypatch.chdir(REPO)   # config paths are relative to where a command runs
  assert "not found (did you mean 'configs/lra/listops.py'?)" in command_line._explain_config_error(
      ["--config=configs/lra/listop.py:full,tiny"])


def test_overrides_parse_as_the_field_type():
  config = task_configs.task_config("listops", "performer", "tiny", 3, [
      "model.num_layers=3", "schedule.base_learning_rate=1e-3", "model.pre_ln=false",
      "model.attention_options.nb_features=32", "model.qkv_dim=16", "data_dir=/x",
      "model.attention_options.kernel=relu",
      "model.remat=block"])
  assert config.seed == 3 and config.model.num_layers == 3 and config.model.pre_ln is False
  assert config.model.remat == "block"
  assert config.schedule.base_learning_rate == 1e-3 and config.model.qkv_dim == 16
  assert config.model.attention_options.nb_features == 32 and config.data_dir == "/x"
  assert config.model.attention_options.kernel == "relu"   # read as a literal, else text
  with pytest.raises(HarnessError, match="unknown config field 'model.layers'"):
    task_configs.task_config("listops", "full", "tiny", 0, ["model.layers=2"])
  with pytest.raises(HarnessError, match="takes field=value"):
    task_configs.task_config("listops", "full", "tiny", 0, ["model.num_layers"])
  with pytest.raises(HarnessError, match="model.num_layers=two"):
    task_configs.task_config("listops", "full", "tiny", 0, ["model.num_layers=two"])
  with pytest.raises(HarnessError, match="unknown attention 'nope'; registered: .*full"):
    reproduce.check_names(["listops"], ["nope"])
  with pytest.raises(HarnessError, match="unknown task 'cifar'; tasks: listops"):
    reproduce.check_names(["cifar"], ["full"])


# ----------------------------------------------------------------------- schedules, optimiser

def test_lra_schedules_follow_the_reference_formulas():
  rsqrt = optimizer.learning_rate_schedule(common.RSQRT, base_learning_rate=0.05, warmup_steps=100,
                                       steps_per_cycle=1000)
  for count in (0, 49, 99, 100, 399, 9999):
    step = count + 1
    expected = 0.05 * min(1, step / 100) / math.sqrt(max(step, 100))
    assert float(rsqrt(count)) == pytest.approx(expected, rel=1e-6)
  cosine = optimizer.learning_rate_schedule(common.COSINE, base_learning_rate=1e-3, warmup_steps=10,
                                        steps_per_cycle=100)
  for count in (0, 9, 10, 59, 109):
    step = count + 1
    progress = max(0.0, (step - 10) / 100)
    expected = 1e-3 * min(1, step / 10) * 0.5 * (1 + math.cos(math.pi * (progress % 1)))
    assert float(cosine(count)) == pytest.approx(expected, rel=1e-5, abs=1e-12)
  with pytest.raises(HarnessError, match="unknown schedule factor.*'exp_decay'.*rsqrt_decay"):
    optimizer.learning_rate_schedule("constant * exp_decay", base_learning_rate=1, warmup_steps=1,
                                 steps_per_cycle=1)


def pytorch_one_cycle(step, *, max_lr=1e-4, total_steps=5000, pct_start=0.2, div_factor=25.0,
                      final_div_factor=1e4, base_momentum=0.85, max_momentum=0.95):
  """(lr, β1) of torch.optim.lr_scheduler.OneCycleLR (two phases, anneal_strategy="linear",
  cycle_momentum=True) at scheduler step `step`, transcribed from its get_lr."""
  initial = max_lr / div_factor
  phases = [(pct_start * total_steps - 1, initial, max_lr, max_momentum, base_momentum),
            (total_steps - 1, max_lr, initial / final_div_factor, base_momentum, max_momentum)]
  start = 0
  for i, (end, lr_start, lr_end, m_start, m_end) in enumerate(phases):
    if step <= end or i == len(phases) - 1:
      pct = (step - start) / (end - start)
      return (lr_end - lr_start) * pct + lr_start, (m_end - m_start) * pct + m_start
    start = end


def test_one_cycle_schedule_and_b1_follow_pytorch():
  """The light preset's schedule: the rate and Adam's β1 at every phase boundary and between."""
  config = task_configs.task_config("listops", "full", "light")
  resolved = check(config)
  _, schedule = optimizer.from_config(resolved)
  b1 = optimizer.b1_schedule({**resolved.schedule, "steps_per_cycle": 5000})
  for step in (0, 1, 500, 999, 1000, 2999, 4998, 4999):
    lr, momentum = pytorch_one_cycle(step)
    assert float(schedule(step)) == pytest.approx(lr, rel=1e-5), step
    assert float(b1(step)) == pytest.approx(momentum, rel=1e-6), step
  assert float(schedule(0)) == pytest.approx(4e-6) and float(schedule(4999)) == pytest.approx(4e-10)
  assert float(b1(0)) == pytest.approx(0.95) and float(b1(999)) == pytest.approx(0.85)
  with pytest.raises(HarnessError, match="2 <= schedule.warmup_steps < schedule.steps_per"):
    optimizer.learning_rate_schedule("one_cycle", base_learning_rate=1, warmup_steps=10,
                                 steps_per_cycle=10)
  with pytest.raises(HarnessError, match="cycle_b1 follows the one_cycle factor"):
    optimizer.b1_schedule({**resolved.schedule.to_dict(), "factors": common.RSQRT})


def test_cycled_b1_is_the_current_beta_of_pytorchs_adam():
  """With a β1 schedule, each update is PyTorch Adam's with that step's β1, its bias
  correction 1 - β1_t^t included (AdamW, weight decay 0, eps added to the corrected sqrt(v))."""
  options = type("O", (), dict(name="adamw", b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0,
                               grad_clip_norm=0.0))
  lrs, betas = [1e-2, 2e-2, 3e-2], [0.95, 0.9, 0.85]
  tx = optimizer.make_optimizer(options, lambda count: jnp.asarray(lrs)[count],
                            b1=lambda count: jnp.asarray(betas)[count])
  params = {"w": jnp.array([1.0, -2.0])}
  state = tx.init(params)
  m = v = np.zeros(2)
  w = np.array([1.0, -2.0])
  for t, grad in enumerate([np.array([0.5, -1.0]), np.array([2.0, 0.1]), np.array([-1.0, 3.0])]):
    updates, state = tx.update({"w": jnp.asarray(grad, jnp.float32)}, state, params)
    params = optax.apply_updates(params, updates)
    b1 = betas[t]
    m = b1 * m + (1 - b1) * grad
    v = 0.999 * v + 0.001 * grad ** 2
    w = w - lrs[t] * (m / (1 - b1 ** (t + 1))) / (np.sqrt(v / (1 - 0.999 ** (t + 1))) + 1e-6)
    np.testing.assert_allclose(params["w"], w, rtol=1e-5)


def test_optimizers_weight_decay_and_clipping():
  params = {"w": jnp.ones(3)}
  grads = {"w": jnp.array([30.0, 40.0, 0.0])}
  config = lambda **kw: type("O", (), {**dict(name="adamw", b1=0.9, b2=0.98, eps=1e-9,
                                              weight_decay=0.0, grad_clip_norm=0.0), **kw})
  constant = lambda count: 0.1
  for name in optimizer.OPTIMIZERS:
    tx = optimizer.make_optimizer(config(name=name, weight_decay=0.0), constant)
    update, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(update["w"], [-0.1, -0.1, 0.0], atol=1e-6)  # Adam's first step
  decoupled = optimizer.make_optimizer(config(weight_decay=0.5), constant)
  update, _ = decoupled.update({"w": jnp.zeros(3)}, decoupled.init(params), params)
  np.testing.assert_allclose(update["w"], -0.1 * 0.5 * np.ones(3), atol=1e-6)  # lr * wd * w
  clipped = optimizer.make_optimizer(config(grad_clip_norm=1.0, name="adam", weight_decay=0.1),
                                 constant)
  state = clipped.init(params)
  clipped.update(grads, state, params)  # runs with clipping and L2 decay
  with pytest.raises(HarnessError, match="unknown optimizer.name 'sgd'"):
    optimizer.make_optimizer(config(name="sgd"), constant)



@pytest.mark.parametrize("name", optimizer.OPTIMIZERS)
def test_decay_rate_parameters_of_the_mixers_are_not_weight_decayed(name):
  """Mamba2's and Gated DeltaNet's A_log, dt_bias (and Mamba2's D) keep their values under
  weight decay alone, as their authors train them; every other parameter decays."""
  model = az.create_mixer("mamba2", emb_dim=16, num_heads=2, causal=True, max_len=8,
                          rngs=nnx.Rngs(0))
  _, params = nnx.split(model, nnx.Param)
  params = jax.tree.map(jnp.ones_like, params)   # zero-initialised biases would not show decay
  options = type("O", (), dict(name=name, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.5,
                               grad_clip_norm=0.0))
  tx = optimizer.make_optimizer(options, lambda count: 0.1)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  moved = {jax.tree_util.keystr(path): bool(jnp.any(u != 0)) for path, u in
           jax.tree_util.tree_flatten_with_path(updates)[0]}
  kept = sorted(path for path, changed in moved.items() if not changed)
  assert kept == ["['D'].value", "['decay']['A_log'].value", "['decay']['dt_bias'].value"], kept
  assert sum(moved.values()) == len(moved) - 3 > 0

# ------------------------------------------------------------------------------------ plugins

def test_plugins_flag_items_split_into_module_names():
  """--plugins=a,b --plugins=c: each item may be a list; the modules load in command_line.run (the
  library's az.load_plugins, tested in test_contract.py)."""
  assert command_line.split_names(["a,b", " c "]) == ["a", "b", "c"]
  assert command_line.split_names("x") == ["x"] and command_line.split_names(None) == []


# ------------------------------------------------------------------------ tiny data generation

def test_tiny_data_is_generated_only_into_its_own_folder_unless_asked(tmp_path, monkeypatch):
  """A mistyped data_dir is an error naming it, not a fresh dataset trained on in silence."""
  class Generating(Exception):
    pass

  def generate(config):
    raise Generating(config.data_dir)

  monkeypatch.setattr(data_lib, "generate", generate)
  monkeypatch.chdir(tmp_path)   # the preset's own folder, data/lra_tiny, is missing here
  tiny = lambda *overrides: task_configs.task_config("listops", "full", "tiny", 0, overrides)
  with pytest.raises(Generating, match="data/lra_tiny"):
    data_lib.load_splits(tiny())
  with pytest.raises(Generating, match="data/lra_tiny"):
    data_lib.load_splits(tiny(f"data_dir={tmp_path}/data/../data/lra_tiny"))
  mistyped = tmp_path / "data" / "lra_tyni"
  with pytest.raises(HarnessError, match=(
      rf"listops data is missing from {mistyped} .*basic_train.tsv.*only into its own folder "
      r"data/lra_tiny.*--config.generate_data=True")):
    data_lib.load_splits(tiny(f"data_dir={mistyped}"))
  assert not mistyped.exists()
  with pytest.raises(Generating, match="lra_tyni"):
    data_lib.load_splits(tiny(f"data_dir={mistyped}", "generate_data=True"))
  # a dry run's data line says the same
  assert data_lib.describe(tiny()).endswith("(missing: generated first)")
  assert "the run stops" in data_lib.describe(tiny(f"data_dir={mistyped}"))
  assert "generated first" in data_lib.describe(tiny(f"data_dir={mistyped}", "generate_data=True"))
  assert data_lib.describe(tiny(f"data_dir={tmp_path}")) == f"data {tmp_path}"


# -------------------------------------------------------------------------- ListOps lengths

@pytest.mark.slow
def test_listops_generator_length_bounds(tmp_path):
  lra.generate_listops(tmp_path, num_train=30, num_val=5, num_test=5, min_length=10,
                       max_length=40, progress=False)
  for split in lra.SPLITS:
    ds = lra.load("listops", split, data_dir=tmp_path, max_len=64, cache=False)
    lengths = ds.masks.sum(1)
    assert ((lengths > 10) & (lengths < 40)).all()
  with pytest.raises(ValueError,
                     match="no ListOps expression has min_length=10 < length < max_length=11"):
    lra.generate_listops(tmp_path, num_train=1, num_val=0, num_test=0, min_length=10, max_length=11)
  with pytest.raises(ValueError, match="max_length must be an integer"):
    lra.generate_listops(tmp_path, num_train=1, num_val=0, num_test=0, max_length=2.5)


# ------------------------------------------------------------------------------------- report

def write_results(root, task, attention, seed, accuracy, majority, preset="tiny"):
  """A results.json whose best-validation accuracy is 0.01 above its final one."""
  workdir = root / task / attention / f"seed{seed}"
  workdir.mkdir(parents=True)
  (workdir / "results.json").write_text(json.dumps({
      "task": task, "attention": attention, "preset": preset, "seed": seed,
      "test_accuracy_final": accuracy, "test_accuracy_best_validation": accuracy + 0.01,
      "majority_accuracy": majority}))
  (workdir / "metrics.jsonl").write_text("".join(
      json.dumps({"step": s, "train_loss": 2.0 - s / 10, "eval_accuracy": accuracy * s / 3}) + "\n"
      for s in (1, 2, 3)))


def test_an_accuracy_rounds_alike_in_every_table(tmp_path, monkeypatch):
  """1,132 of 8,000 asked tokens (MQAR's linear_transformer) is 14.15%: 14.2 at one decimal,
  in the sweep's table as in a reader's rounding of the report's 14.15, not format()'s 14.1."""
  recall = 100 * (1132 / 8000)
  assert f"{recall:.1f}" == "14.1"   # the binary value, 14.149999999999999, rounded
  assert report.rounded(recall, 1) == "14.2" and report._cell(recall, None, None) == "14.15"
  assert report._cell(100 * (1130 / 8000), 0.005, None) == "14.13 ± 0.01"   # halves go up
  monkeypatch.setattr(sweep, "_plot", lambda *args: None)
  text = sweep.write({"linear_transformer": {"8": recall}}, {}, tmp_path, "data.num_pairs", ["8"],
                     "mqar")
  assert "| linear_transformer | 14.2 |" in text


def test_reports_of_other_tasks_go_to_their_own_folders():
  assert reproduce.report_dir("r", ["mqar"]) == Path("r/mqar")
  assert reproduce.report_dir("r", ["mad"]) == Path("r/mad")
  assert reproduce.report_dir("r", ["listops", "text", "listops"]) == Path("r/listops+text")
  assert reproduce.report_dir("r", list(lra.available_tasks())) == Path("r/lra")


def test_a_report_of_other_runs_is_kept_not_overwritten(tmp_path, monkeypatch, caplog):
  """The same runs again: the report is rewritten as it was. Other runs: the earlier table,
  CSV and plots are renamed <name>.1 (then .2), with a warning."""
  def plot(tables, runs, out):   # a stand-in plot that records which runs it drew
    (out / "bars_tiny_listops.png").write_text(" ".join(r["attention"] for r in runs))
  monkeypatch.setattr(report, "plot", plot)
  runs, out = tmp_path / "runs", tmp_path / "out"
  for attention in ("full", "performer"):
    write_results(runs, "listops", attention, 0, 0.3, 0.17)
  first = report.write_report(runs, out, only={"attention": ["full"]})
  report.write_report(runs, out, only={"attention": ["full"]})
  assert sorted(p.name for p in out.iterdir()) == ["bars_tiny_listops.png", "table.csv",
                                                   "table.md"]
  with caplog.at_level("WARNING"):
    second = report.write_report(runs, out)
  assert f"{out} held a report of other runs: kept as table.md.1, table.csv.1, " in caplog.text
  assert (out / "table.md.1").read_text() == first and (out / "table.md").read_text() == second
  assert (out / "bars_tiny_listops.png.1").read_text() == "full"
  assert (out / "bars_tiny_listops.png").read_text() == "full performer"
  report.write_report(runs, out, only={"attention": ["performer"]})
  assert (out / "table.md.2").read_text() == first and (out / "table.md.1").read_text() == second


def test_report_bars_tell_one_seed_the_paper_and_the_variants_apart(tmp_path, monkeypatch):
  """One seed draws no error bar (its caps would be a line at the bar's top, like a marker); the
  paper's number is not drawn as a line either; ten variants get ten distinct colours, none a
  second blue."""
  import matplotlib.colors
  from matplotlib.container import BarContainer
  from matplotlib.markers import MarkerStyle

  figures = {}

  def keep(fig, path):
    figures[Path(path).name] = fig
  monkeypatch.setattr(report, "save_figure", keep)
  variants = ["full", "sliding_window", "linear_transformer", "performer", "deltanet",
              "gated_deltanet", "mamba2", "gla", "retnet", "fox"]
  runs = tmp_path / "runs"
  for attention in variants:
    write_results(runs, "listops", attention, 0, 0.3, 0.17)
    write_results(runs, "compression", attention, 0, 0.3, 0.17)
  found = report.read_runs(runs)
  report.plot(report.summarize(found), found, tmp_path)

  def bar_groups(ax):
    return [c for c in ax.containers if isinstance(c, BarContainer)]

  def no_error_bar(group):   # the caps of every bar at NaN: not drawn
    return all(np.isnan(np.asarray(cap.get_ydata(), float)).all()
               for cap in group.errorbar.lines[1])

  (bars,) = figures["bars_tiny_listops.png"].axes
  (group,) = bar_groups(bars)
  assert no_error_bar(group)
  paper = next(c for c in bars.collections if c.get_label() == "paper")
  assert paper.get_paths()[0] != MarkerStyle("_").get_path()
  (profile,) = figures["mad_tiny.png"].axes
  groups = bar_groups(profile)
  assert all(no_error_bar(group) for group in groups)
  colors = [matplotlib.colors.to_rgb(g.patches[0].get_facecolor()) for g in groups]
  assert len(colors) == 10 and matplotlib.colors.to_rgb("tab:cyan") not in colors
  for i, a in enumerate(colors[:9]):   # nine hues, no two alike; the tenth repeats one, hatched
    assert all(np.abs(np.subtract(a, b)).sum() > 0.3 for b in colors[i + 1:9])
  assert [bool(g.patches[0].get_hatch()) for g in groups] == [False] * 9 + [True]
  for fig in figures.values():
    plots.pyplot().close(fig)


def report_plots(tmp_path):
  runs = tmp_path / "runs"
  for task in ("listops", "compression", "memorization"):
    for attention, accuracy in (("full", 0.40), ("performer", 0.20), ("local", 0.3)):
      write_results(runs, task, attention, 0, accuracy, 0.17)
  found = report.read_runs(runs)
  report.plot(report.summarize(found), found, tmp_path)


def sweep_plot(tmp_path):
  table = {name: {"4": 90.0 - i, "8": 60.0 - i} for i, name in enumerate(("full", "local"))}
  sweep.write(table, {}, tmp_path, "data.num_pairs", ["4", "8"], "mqar")


def benchmark_plots(tmp_path):
  env = dict.fromkeys(ENVIRONMENT, "cpu 2026-12-02")
  rows = [{**env, "attention": name, "length": length, "step_ms": length * k, "temp_bytes": 1e6,
           "status": Status.OK} for k, name in enumerate(("full", "local"), 1)
          for length in (1024, 2048, 4096)]
  outputs.plot_lengths(rows, "step_ms", "ms", tmp_path / "time.png", "train")


def capacity_plot(tmp_path):
  results = [capacity.Capacity(name, remat, "float32", longest=length)
             for name, length in (("full", 4096), ("local", 65536)) for remat in ("none", "block")]
  facts = {"lengths": [1024, 4096, 65536], "device_memory_bytes": 8e9, "device": "cpu",
           "jax_version": "0"}
  capacity.plot(results, tmp_path / "capacity.png", facts)


@pytest.mark.parametrize("write", [report_plots, sweep_plot, benchmark_plots, capacity_plot],
                         ids=["report", "sweep", "benchmark", "capacity"])
def test_plot_legends_cover_no_bars_or_curves(write, tmp_path, monkeypatch):
  """Every legend of the harness's plots sits outside every axes of its figure."""
  checked = []

  def inspect(fig, path):
    fig.canvas.draw()
    for legend in [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
      box = legend.get_window_extent()
      assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes), Path(path).name
      checked.append(Path(path).name)
    plots.pyplot().close(fig)

  for writer in (report, sweep, outputs, capacity):   # each saves its figures
    monkeypatch.setattr(writer, "save_figure", inspect)
  write(tmp_path)
  assert checked, "no legend drawn"
  if write is report_plots:
    assert sorted(checked) == sorted(f"{kind}_tiny_{task}.png" for kind in ("bars", "curves")
                                     for task in ("compression", "listops", "memorization")
                                     ) + ["mad_tiny.png"]


def test_the_report_can_read_only_the_asked_runs(tmp_path):
  """reproduce reports the comparison it was asked for, not every run in its output folder."""
  runs = tmp_path / "runs"
  for task, attention, seed in (("listops", "full", 0), ("listops", "softmax_temp", 0),
                                ("listops", "performer", 0), ("listops", "full", 1),
                                ("mqar", "full", 0)):
    write_results(runs, task, attention, seed, 0.3, 0.17)
  write_results(tmp_path / "fair", "listops", "full", 0, 0.3, 0.17, preset="fair")
  asked = {"preset": ["tiny"], "task": ["listops"], "attention": ["full", "softmax_temp"],
           "seed": [0]}
  found = report.read_runs(tmp_path, only=asked)
  assert sorted((r["task"], r["attention"], r["seed"]) for r in found) == [
      ("listops", "full", 0), ("listops", "softmax_temp", 0)]
  assert len(report.read_runs(tmp_path)) == 6


@pytest.mark.slow
def test_report_table_csv_and_plots(tmp_path, capsys):
  runs = tmp_path / "runs"
  for seed, (full, performer) in enumerate([(0.40, 0.20), (0.30, 0.22)]):
    write_results(runs, "listops", "full", seed, full, 0.17)
    write_results(runs, "listops", "performer", seed, performer, 0.17)
    write_results(runs, "text", "full", seed, 0.6 + seed / 100, 0.5)
  write_results(runs, "pathx", "full", 0, 0.5, 0.5)
  write_results(runs, "listops", "zz_unpublished", 0, 0.25, 0.17)
  text = report.write_report(runs, tmp_path / "out")
  final, best = text.split("### ")[1:]
  assert final.startswith("LRA Table 1, preset `tiny`, final step")
  assert "released LRA code's" in final
  assert best.startswith("LRA Table 1, preset `tiny`, best validation step")
  assert "| 26.00 |" in best   # zz_unpublished: 0.25 + 0.01
  lines = {line.split(" | ")[0].strip("| "): line for line in final.splitlines()
           if line.startswith("|")}
  assert lines["Model"] == "| Model | listops | text | pathx | Avg |"
  paper = LRA_TABLE1["full"]
  listops_full = f"35.00 ± 7.07 ({paper['listops']:.2f}, {35 - paper['listops']:+.2f})"
  assert listops_full in lines["full"] and "50.00 (FAIL)" in lines["full"]
  assert f"60.50 ± 0.71 ({paper['text']:.2f}" in lines["full"]
  average = (35 + 60.5) / 2, (paper["listops"] + paper["text"]) / 2
  assert lines["full"].endswith(
      f"{average[0]:.2f} ({average[1]:.2f}, {average[0] - average[1]:+.2f}) |")
  assert "21.00 ± 1.41 (18.01, +2.99)" in lines["performer"] and lines["performer"].endswith("— |")
  assert "| 25.00 |" in lines["zz_unpublished"]  # no paper number: ours only
  assert lines["*majority class*"] == "| *majority class* | 17.00 | 50.00 | 50.00 |  |"
  rows = [name for name in lines if name != "Model" and not name.startswith("-")]
  # the paper's order first
  assert rows == ["full", "performer", "zz_unpublished", "*majority class*"]
  out = tmp_path / "out"
  assert (out / "table.md").read_text() == text
  csv_rows = (out / "table.csv").read_text().splitlines()
  assert csv_rows[0] == "preset,tested,attention,task,num_seeds,mean,std,paper,difference"
  assert (f"tiny,test_accuracy_final,full,listops,2,35.0000,7.0711,{paper['listops']},"
          f"{35 - paper['listops']:.4f}") in csv_rows
  assert "tiny,test_accuracy_best_validation,majority class,listops,,17.0000,,," in csv_rows
  for task in ("listops", "text", "pathx"):
    for kind in ("bars", "curves"):
      assert (out / f"{kind}_tiny_{task}.png").stat().st_size > 1000
  with pytest.raises(HarnessError, match="no results.json under"):
    report.write_report(tmp_path / "empty", tmp_path / "out2")
