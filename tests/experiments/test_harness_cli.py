"""The command lines: one-line errors, a 2-device data-parallel run with a plugin variant, a
2-process run resumed by one process, and the reproduce grid with its report."""
import json
import os
import re
import shlex
import shutil
import gc
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from command_runner import free_port, run_commands
from experiments import reproduce
from experiments.common import task_configs
from experiments.common.errors import CtrlC, HarnessError
from experiments.train import trainer
from experiments.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
SMALL = {"model.num_layers": 1, "model.emb_dim": 16, "model.num_heads": 2, "model.mlp_dim": 32,
         "model.max_len": 32, "model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0,
         "batch_size": 4, "num_train_steps": 3, "eval_every": 3, "log_every": 1,
         "schedule.steps_per_cycle": 100}
PLUGIN = '''
import attention_zoo as az
from attention_zoo.variants.full import FullAttention

@az.register("harness_cli_plugin", exact=True, supports_causal=True, supports_cross=True,
             complexity="O(n^2)", paper="full attention under another name")
class SameAsFull(FullAttention):
  pass
'''


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("plugin")
  (root / "harness_cli_plugin.py").write_text(textwrap.dedent(PLUGIN))
  return root


# XLA ends a process whose CPU devices wait more than 40 s for each other in a collective; a
# loaded test machine can be that slow.
COLLECTIVE_TIMEOUT = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def start(args, *, plugin_dir=None, devices=1, env=None):
  env = {**os.environ, **(env or {}),
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {COLLECTIVE_TIMEOUT}",
         "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_dir or ""), str(REPO),
                                                     os.environ.get("PYTHONPATH", "")]))}
  return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(process, timeout=300):
  stdout, stderr = process.communicate(timeout=timeout)
  return process.returncode, stdout, stderr


def overrides(flag, values):
  return [f"{flag}{k}={v}" for k, v in values.items()]


def test_bad_names_exit_with_one_clear_line(tmp_path, plugin_dir):
  train = ["experiments.train", f"--workdir={tmp_path}"]
  cases = {
      "attention": (train + ["--config=configs/lra/listops.py:nosuch,tiny"],
                    ["unknown attention 'nosuch'", "full", "--plugins"]),
      "task": (train + ["--config=configs/lra/cifar.py:full"],
               ["config file 'configs/lra/cifar.py' not found", "listops, text, retrieval"]),
      "field": (train + ["--config=configs/lra/listops.py:full,tiny", "--config.model.layers=2"],
                ["unknown config field 'model.layers'", "num_layers"]),
      "preset": (train + ["--config=configs/lra/listops.py:full,huge"],
                 ["listops has no preset 'huge'", "paper, fair, tiny"]),
      "fixed": (train + ["--config=configs/lra/listops.py:full", "--config.preset=tiny"],
                ["config.preset cannot be overridden", "<attention>,<preset>"]),
      "paper data": (train + ["--config=configs/lra/listops.py:full",
                              f"--config.data_dir={tmp_path}/nothing_here"],
                     ["listops data for the paper preset", "python -m lra.generate listops"]),
      "plugin": (train + ["--config=configs/lra/listops.py:full", "--plugins=no_such_plugin"],
                 ["plugin module 'no_such_plugin' not found"]),
      "reproduce": (["experiments.reproduce", "--tasks=listops,cifar", f"--out={tmp_path}"],
                    ["unknown task 'cifar'", "pathfinder"]),
      # once, before any run: not per run, then "no results.json" for the empty report
      "reproduce config": (["experiments.reproduce", "--tasks=listops", "--attentions=full",
                            f"--out={tmp_path}", "--override=num_train_steps=0"],
                           ["config.num_train_steps must be >= 1, got 0"]),
  }
  processes = {name: start(args, plugin_dir=plugin_dir) for name, (args, _) in cases.items()}
  for name, process in processes.items():
    code, stdout, stderr = finish(process)
    # Progress lines (absl's "I<date> ...": what a run is loading) may come before the error.
    lines = [line for line in stderr.strip().splitlines() if not re.match(r"I\d{4} ", line)]
    assert code != 0 and "Traceback" not in stderr, (name, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), (name, stderr)
    for expected in cases[name][1]:
      assert expected in lines[0], (name, lines[0])


def test_ctrl_c_prints_one_line_with_the_step_checkpoint_and_resume_command(listops_dir,
                                                                           tmp_path):
  """SIGINT to a training process once it has saved a checkpoint: no traceback, status 130, a
  last line naming the step, the checkpoint and the command that resumes (without --restart,
  which would start again); that command's dry run resumes from the checkpoint."""
  workdir = tmp_path / "run"
  args = ["experiments.train", "--config=configs/lra/listops.py:full,tiny", f"--workdir={workdir}",
          "--restart", *overrides("--config.", {**SMALL, "data_dir": listops_dir,
                                                 "num_train_steps": 100_000, "eval_every": 20})]
  process = start(args)
  deadline = time.time() + 300
  while not list(workdir.glob("checkpoints/*/checksums.json")) and time.time() < deadline:
    time.sleep(0.5)
  process.send_signal(signal.SIGINT)
  code, _, stderr = finish(process)
  assert code == 130 and "Traceback" not in stderr, stderr[-3000:]
  last = stderr.strip().splitlines()[-1]
  # Only finished saves count: Ctrl-C during a save leaves `<step>.orbax-checkpoint-tmp`.
  saved = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  match = re.fullmatch(rf"listops / full / seed 0 interrupted at step (\d+) of 100000; the last "
                       rf"checkpoint is step {saved} in {workdir}/checkpoints; to resume: "
                       r"python -m (experiments\.train .*)", last)
  assert match and int(match[1]) >= saved, last
  resume = shlex.split(match[2])
  assert "--restart" not in resume and resume[1:] == [a for a in args[1:] if a != "--restart"]
  (planned,) = run_commands([resume + ["--dry_run"]], cwd=REPO)
  assert planned["code"] == 0 and f"resumes from step {saved} -> " in planned["stdout"]


@pytest.fixture
def python_ctrl_c_handler():
  """Python's own SIGINT handler for the test, whatever the suite was launched with (a job a
  script starts in the background has SIGINT ignored); the launcher's is back afterwards."""
  launched_with = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, launched_with)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # the dropped one
def test_ctrl_c_inside_a_gc_callback_is_not_lost(python_ctrl_c_handler):
  """Python's own handler raises KeyboardInterrupt in whatever runs when Ctrl-C arrives; inside
  a garbage-collection callback (JAX registers one) Python drops it and training went on (a CI
  run timed out so). CtrlC records it and raises at the next check; a second Ctrl-C raises at
  once; the previous handler is back afterwards."""
  fired = []

  def ctrl_c_during_collection(phase, info):
    if phase == "start" and not fired:
      fired.append(phase)
      os.kill(os.getpid(), signal.SIGINT)
      sum(range(1000))   # Python runs the handler here, inside the callback

  gc.callbacks.append(ctrl_c_during_collection)
  try:
    gc.collect()   # Python's handler: raised inside the callback and dropped
    assert fired
    fired.clear()
    ctrl_c = CtrlC()
    with pytest.raises(KeyboardInterrupt), ctrl_c.deferred():
      gc.collect()
      assert fired and ctrl_c.requested
      ctrl_c.check()
      pytest.fail("check() did not raise")
  finally:
    gc.callbacks.remove(ctrl_c_during_collection)
  with pytest.raises(KeyboardInterrupt), ctrl_c.deferred():
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(1000))
    assert ctrl_c.requested
    os.kill(os.getpid(), signal.SIGINT)   # the second one
    sum(range(1000))
    pytest.fail("a second Ctrl-C did not raise at once")
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_batch_not_divisible_by_devices(listops_dir, tmp_path, monkeypatch):
  monkeypatch.setattr(trainer.jax, "device_count", lambda: 2)
  config = task_configs.task_config("listops", "full", "tiny", 0,
                                 [f"data_dir={listops_dir}", "batch_size=3"])
  with pytest.raises(HarnessError,
                     match="batch_size / grad_accum_steps = 3 is not divisible "
                           "by the 2 devices.*use a multiple of 2"):
    trainer.Trainer(config, tmp_path)


def test_two_device_run_with_a_plugin_variant_matches_one_device(listops_dir, plugin_dir, tmp_path):
  """The plugin variant is full attention under another name, so the 2-device run must match
  an in-process 1-device run of full."""
  settings = {**SMALL, "data_dir": listops_dir}
  process = start(["experiments.train", "--config=configs/lra/listops.py:harness_cli_plugin,tiny",
                   f"--workdir={tmp_path / 'two'}", "--plugins=harness_cli_plugin",
                   *overrides("--config.", settings)], plugin_dir=plugin_dir, devices=2)
  # Alongside: a variant named in the config argument gets its own settings, and takes its
  # options from the command line.
  swapped = start(["experiments.train", "--config=configs/lra/listops.py:sparse_transformer,tiny",
                   "--config.model.attention_options.num_summary=2",
                   f"--workdir={tmp_path / 'swapped'}", *overrides("--config.", settings)])
  one = trainer.Trainer(task_configs.task_config(
      "listops", "full", "tiny", 0, overrides("", settings)), tmp_path / "one").run()
  code, stdout, stderr = finish(process)
  assert code == 0, stderr
  assert "test accuracy" in stdout
  two = json.loads((tmp_path / "two" / "results.json").read_text())
  assert two["attention"] == "harness_cli_plugin"
  assert two["environment"]["device"].startswith("2 x ")
  assert two["test_accuracy_final"] == one["test_accuracy_final"]
  assert two["num_params"] == one["num_params"]
  losses = [[e["train_loss"] for e in read_metrics(tmp_path / name) if "train_loss" in e]
            for name in ("one", "two")]
  assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-5)
  code, _, stderr = finish(swapped)
  assert code == 0, stderr
  results = json.loads((tmp_path / "swapped" / "results.json").read_text())
  assert results["model"]["attention"] == "sparse_transformer"
  assert results["model"]["attention_options"] == {"block_size": 4, "num_summary": 2}
  assert results["config"]["model"]["attention_options"] == {"block_size": 4, "num_summary": 2}
  # The user's changes to configs/lra/listops.py:sparse_transformer,tiny.
  changed = results["overrides"]
  assert set(changed) <= {*settings, "model.attention_options.num_summary"}
  assert changed["model.attention_options.num_summary"] == 2 and changed["model.emb_dim"] == 16


def test_two_processes_match_one_and_their_checkpoint_resumes_in_one(listops_dir, tmp_path, caplog):
  """Two processes on this machine (one CPU device each, gloo over the loopback address) train
  as one process does; one process then resumes their step-2 checkpoint."""
  settings = {**SMALL, "num_train_steps": 4, "eval_every": 2, "data_dir": listops_dir}
  address = f"127.0.0.1:{free_port()}"
  processes = [start(["experiments.train", "--config=configs/lra/listops.py:full,tiny",
                      f"--workdir={tmp_path / 'two'}", *overrides("--config.", settings)],
                     env={"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2",
                          "JAX_PROCESS_ID": str(i)}) for i in range(2)]
  config = task_configs.task_config("listops", "full", "tiny", 0, overrides("", settings))
  one = trainer.Trainer(config, tmp_path / "one").run()
  for process in processes:
    code, _, stderr = finish(process)
    assert code == 0, stderr
  two = json.loads((tmp_path / "two" / "results.json").read_text())
  assert (two["environment"]["process_count"], two["environment"]["device_count"]) == (2, 2)

  def losses(name):
    return [e["train_loss"] for e in read_metrics(tmp_path / name) if "train_loss" in e]

  # The gradient is summed across processes in another order: equal up to rounding.
  assert len(losses("one")) == 4 and losses("two") == pytest.approx(losses("one"), rel=1e-5)
  assert two["test_loss_final"] == pytest.approx(one["test_loss_final"], rel=1e-5)
  shutil.rmtree(tmp_path / "two" / "checkpoints" / "4")
  (tmp_path / "two" / "results.json").unlink()
  with caplog.at_level("INFO"):
    resumed = trainer.Trainer(config, tmp_path / "two").run()
  assert f"resumed {tmp_path / 'two'} from step 2" in caplog.text
  assert losses("two") == pytest.approx(losses("one"), rel=1e-5)
  assert resumed["test_loss_final"] == pytest.approx(one["test_loss_final"], rel=1e-5)
  assert resumed["environment"]["process_count"] == 1


def test_reproduce_runs_the_grid_then_skips_finished_runs(listops_dir, tmp_path, monkeypatch):
  out = tmp_path / "out"
  args = ["experiments.reproduce", "--preset=tiny", "--tasks=listops", "--attentions=full",
          "--seeds=0,1", f"--out={out}",
          *overrides("--override=", {**SMALL, "data_dir": listops_dir})]
  earlier = out / "runs" / "listops" / "performer" / "seed0"   # a run of another comparison
  earlier.mkdir(parents=True)
  (earlier / "results.json").write_text(json.dumps({
      "task": "listops", "attention": "performer", "preset": "tiny", "seed": 0,
      "test_accuracy_final": 0.2, "test_accuracy_best_validation": 0.2,
      "majority_accuracy": 0.17}))
  code, stdout, stderr = finish(start(args))
  assert code == 0, stderr
  phases = ["2 run(s) in 1 grid(s): importing JAX and the trainer",
            "checking the 2 configs of the grid", "[1/2] listops / full / seed 0",
            "[2/2] listops / full / seed 1", "the runs are done: the report in",
            "report: reading the runs under", "report: 2 run(s) read",   # not the earlier one
            "report: plots 1/1: listops (tiny)"]
  said = [stderr.find(phase) for phase in phases]
  assert -1 not in said and said == sorted(said), list(zip(phases, said))
  assert "| Model | listops |" in stdout and "*majority class*" in stdout
  assert "performer" not in stdout   # only the asked comparison is reported
  row = next(line for line in stdout.splitlines() if line.startswith("| full |"))
  assert " ± " in row and "(36.37, " in row  # two seeds; the paper's number beside ours
  for seed in (0, 1):
    run = out / "runs" / "listops" / "full" / f"seed{seed}"
    results = json.loads((run / "results.json").read_text())
    assert results["seed"] == seed and results["config"]["model"]["emb_dim"] == 16
  assert {p.name for p in out.iterdir()} == {"listops", "runs"}   # the report named by its task
  assert {p.name for p in (out / "listops").iterdir()} == {
      "table.md", "table.csv", "bars_tiny_listops.png", "curves_tiny_listops.png"}

  def must_not_train(*args, **kwargs):
    raise AssertionError("a finished run was trained again")

  monkeypatch.setattr(trainer, "train_and_evaluate", must_not_train)
  assert reproduce.run_grid(preset="tiny", tasks=["listops"], attentions=["full"], seeds=[0, 1],
                            out=out,
                            overrides=overrides("", {**SMALL, "data_dir": listops_dir})) == []
  # the same folders asked with another override: refused, not taken as that grid's results
  with pytest.raises(HarnessError, match=(
      r"seed0 holds a finished run with other settings \(schedule.base_learning_rate: the "
      r"config file's value there, 0.01 now\): give this grid its own --out")):
    reproduce.run_grid(preset="tiny", tasks=["listops"], attentions=["full"], seeds=[0], out=out,
                       overrides=overrides("", {**SMALL, "data_dir": listops_dir,
                                                "schedule.base_learning_rate": 0.01}))


def test_dry_run_plans_the_grid_without_running_it(tmp_path):
  """One line per run: a finished run skipped, a variant that cannot be causal not applicable,
  the rest with their resolved settings and workdir; a report of runs not made yet is no error.
  Nothing is written."""
  out = tmp_path / "out"
  finished = out / "runs" / "mqar" / "full" / "seed0" / "results.json"
  finished.parent.mkdir(parents=True)
  finished.write_text("{}")
  reproduce_args = ["experiments.reproduce", "--tasks=mqar", "--attentions=full,linformer",
                    "--seeds=0,1", f"--out={out}", "--override=model.num_layers=1", "--dry_run"]
  report_args = ["experiments.report", f"--runs={tmp_path}/none", f"--out={tmp_path}/report",
                 "--dry_run"]
  planned, report_plan = run_commands([reproduce_args, report_args], cwd=REPO)
  assert planned["code"] == 0, planned["stderr"]
  lines = planned["stdout"].splitlines()
  assert lines[0] == f"mqar / full / seed 0: {finished} exists: skipped"
  assert lines[1].startswith("mqar / full / seed 1 (tiny); 1 layer, emb ")
  assert "; full's default options; " in lines[1]
  assert lines[1].endswith(f"-> {out}/runs/mqar/full/seed1")
  assert "mqar / linformer / seed 0: not applicable (linformer cannot be causal" in lines[2]
  assert len(lines) == 5 and lines[4].startswith("then the report of these runs")
  assert report_plan["code"] == 0 and "the report would stop there" in report_plan["stdout"]
  assert sorted(p.name for p in tmp_path.rglob("*")) == ["full", "mqar", "out", "results.json",
                                                        "runs", "seed0"]

