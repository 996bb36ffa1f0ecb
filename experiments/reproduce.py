"""Reproduce LRA Table 1: train every (task, attention, seed) of a grid, then write the report.

    python -m experiments.reproduce --preset=tiny --tasks=listops
    python -m experiments.reproduce --preset=paper --tasks=listops,text,retrieval,image,pathfinder \
        --attentions=full,performer --seeds=1,2,3 --out=results/paper
    python -m experiments.reproduce --preset=tiny --tasks=mad --attentions=full --seeds=0,1

`--override=field=value` changes every config of the grid; an attention option
(`--override=model.attention_options.nb_features=16`) applies to the variants that have it
and is skipped, with a log line, for the others (docs/harness.md, Configs).

Runs go to OUT/runs/<task>/<attention>/seed<seed>; a run whose results.json exists is
skipped and an interrupted one resumes, so the same command continues a grid (a finished run
with other --override values is an error naming them: another grid needs its own --out). The report
(table.md, table.csv, PNGs) covers the asked preset, tasks, attentions and seeds and goes to a
folder named by the asked tasks, OUT/<tasks joined by +> (OUT/mqar, OUT/mad; OUT/lra for the six
LRA tasks): a report of other runs found there is kept as <name>.1. A value every run would
refuse (e.g. --override=num_train_steps=0) is one error before any run.
`python -m experiments.report --runs=OUT/runs --out=OUT` reports every run under OUT/runs.

`--tune=FIELD=V1,V2,...` (repeatable: a grid) trains the grid at every point into
OUT/tune/<field>=<value>,.../ and reports, per task and variant, the test accuracy at the point
of best mean validation accuracy: OUT/tuning.md, tuning.json and tuning.csv
(experiments/tuning.py).

    python -m experiments.reproduce --preset=tiny --tasks=mad --attentions=full,gla \
        --tune=schedule.base_learning_rate=1e-4,5e-4,1e-3 --tune=optimizer.weight_decay=0,0.1
"""
from __future__ import annotations

import json

import time
from pathlib import Path

from absl import flags, logging

import attention_zoo as az
import lra
import synthetic
from experiments.common import tasks as task_names
from configs.lra.common import PRESETS
from experiments import report, tuning
from experiments.common import command_line, dry_run, task_configs
from experiments.common.errors import HarnessError, did_you_mean
from experiments.common.records import write_json
from experiments.common.task_configs import task_config
from experiments.common.variant_names import attention_names, check_attention

FLAGS = flags.FLAGS


def drop_options_of_other_variants(configs: dict) -> None:
  """An --override of model.attention_options.<name> applies to the variants that have that
  option: removed, with a log line, from the configs of those that do not. HarnessError if no
  variant of the grid has it (a misspelt name)."""
  dropped, accepted = {}, set()
  for key, config in configs.items():
    options = config.model.attention_options
    own = az.spec(config.model.attention).options
    accepted |= set(own)
    for name in [name for name in options if name not in own]:
      dropped.setdefault(name, set()).add(config.model.attention)
      with options.unlocked():
        del options[name]
  for name, variants in dropped.items():
    if variants >= {config.model.attention for config in configs.values()}:
      raise HarnessError(
          f"--override model.attention_options.{name}: no variant of the grid "
          f"({', '.join(sorted(variants))}) has an option {name!r}"
          f"{did_you_mean(name, accepted)}")
    logging.info("model.attention_options.%s skipped for %s: no such option there", name,
                 ", ".join(sorted(variants)))


def all_tasks() -> tuple[str, ...]:
  return task_names.available_tasks()


# Names that stand for several tasks in --tasks.
TASK_GROUPS = {"mad": synthetic.family_tasks("mad")}


def expand_tasks(tasks) -> list[str]:
  """--tasks with each group name ("mad") replaced by its tasks, in order, without repeats."""
  expanded = [t for task in tasks for t in TASK_GROUPS.get(task, (task,))]
  return list(dict.fromkeys(expanded))


def not_applicable(task: str, attention: str) -> str | None:
  """Why `attention` cannot run `task` (a causal task needs a causal variant, an encoder task
  one with a bidirectional form), or None."""
  spec = az.spec(attention)
  causal_task = task_names.task_spec(task).objective == "next_token"
  if causal_task and not spec.supports_causal:
    return f"{attention} cannot be causal: {az.registry.get(attention).WHY_NOT_CAUSAL}"
  if not causal_task and not spec.supports_bidirectional:
    return f"{attention} is causal only: {az.registry.get(attention).WHY_NOT_BIDIRECTIONAL}"
  return None


def check_names(tasks: list[str], attentions: list[str]) -> None:
  for task in tasks:
    if task not in all_tasks():
      groups = ", ".join(f"{name} ({', '.join(members)})" for name, members in TASK_GROUPS.items())
      raise HarnessError(f"unknown task {task!r}"
                         f"{did_you_mean(task, [*all_tasks(), *TASK_GROUPS])}; tasks: "
                         f"{', '.join(all_tasks())}; groups: {groups}")
  for attention in attentions:
    check_attention(attention)


def grid_configs(*, preset: str, tasks: list[str], attentions: list[str], seeds: list[int],
                 overrides=()) -> dict:
  """{(task, attention, seed): config} of the grid (a group name in `tasks` expanded);
  HarnessError for an unknown name or field, before anything imports JAX."""
  tasks = expand_tasks(tasks)
  check_names(tasks, attentions)
  return {(task, attention, seed): task_config(task, attention, preset, seed=seed,
                                                  overrides=overrides)
          for task in tasks for attention in attentions for seed in seeds}


def grid_with_own_options(**grid) -> dict:
  """grid_configs(**grid) with the options of other variants dropped."""
  configs = grid_configs(**grid)
  drop_options_of_other_variants(configs)   # imports jax: after the cheap checks
  return configs


def checked_grid(**grid) -> dict:
  """grid_with_own_options(**grid), every config that applies checked as the trainer will
  before its first step (trainer.check_run: a bad value is one error now, not one per run)."""
  from experiments.train import trainer

  configs = grid_with_own_options(**grid)
  logging.info("checking the %d configs of the grid as the trainer will", len(configs))
  for (task, attention, _), config in configs.items():
    if not not_applicable(task, attention):
      trainer.check_run(config)
  return configs


def run_dir(out, task: str, attention: str, seed: int) -> Path:
  return Path(out) / "runs" / task / attention / f"seed{seed}"


def check_finished(workdir: Path, config) -> None:
  """A finished run is skipped only if it ran with the overrides asked now: its folder is named
  by task, variant and seed alone, so a grid with another --override would otherwise take its
  results as its own. HarnessError naming the fields that differ."""
  from experiments.train import build

  recorded = json.loads((workdir / "results.json").read_text()).get("overrides")
  if recorded is None:   # a not-applicable record
    return
  asked = json.loads(json.dumps(build.overrides(config, task_configs.baseline(config))))
  differ = sorted(f for f in recorded.keys() | asked.keys() if recorded.get(f) != asked.get(f))
  if differ:
    value = lambda values, f: repr(values[f]) if f in values else "the config file's value"
    raise HarnessError(
        f"{workdir} holds a finished run with other settings ("
        + "; ".join(f"{f}: {value(recorded, f)} there, {value(asked, f)} now" for f in differ)
        + "): give this grid its own --out, or remove that folder to run it again")


def report_dir(out, tasks) -> Path:
  """The report's folder of a grid over `tasks` (as asked, group names kept): OUT/<the tasks
  joined by +>, e.g. OUT/mqar, OUT/mad, OUT/listops+text; OUT/lra for the six LRA tasks. So
  comparisons on other tasks never write over each other's tables."""
  tasks = list(dict.fromkeys(tasks))
  lra_only = sorted(expand_tasks(tasks)) == sorted(lra.available_tasks())
  return Path(out) / ("lra" if lra_only else "+".join(tasks))


def plan_lines(configs: dict, out) -> list[str]:
  """A dry run's line per run of a grid (grid_with_own_options), each config checked as
  checked_grid checks it: skipped, not applicable, or what it trains (trainer.plan_line)."""
  from experiments.train import trainer

  lines = []
  for (task, attention, seed), config in configs.items():
    workdir = run_dir(out, task, attention, seed)
    if (workdir / "results.json").exists():
      if not not_applicable(task, attention):
        trainer.check_run(config)
        check_finished(workdir, config)
      lines.append(f"{task} / {attention} / seed {seed}: {workdir}/results.json exists: skipped")
    elif reason := not_applicable(task, attention):
      lines.append(f"{task} / {attention} / seed {seed}: not applicable ({reason})")
    else:
      lines.append(trainer.plan_line(config, workdir))
  return lines


def plan_points(point_grids: list[tuple[dict, dict]]) -> list[str]:
  """A dry run's lines for each (point, grid) of tuning.grids: the point (under --tune), then
  the lines of its grid (see plan_lines)."""
  lines = []
  for number, (point, grid) in enumerate(point_grids, start=1):
    grid = dict(grid)
    out = grid.pop("out")
    if point:
      lines.append(f"tuning point {number}/{len(point_grids)}: {tuning.describe(point)} -> {out}")
    lines += plan_lines(grid_with_own_options(**grid), out)
  return lines


def run_points(point_grids: list[tuple[dict, dict]]) -> list[str]:
  """Trains every missing run of each (point, grid) of tuning.grids; a line per failed run."""
  failures = []
  for number, (point, grid) in enumerate(point_grids, start=1):
    if point:
      logging.info("tuning point %d/%d: %s", number, len(point_grids), tuning.describe(point))
    failures += run_grid(**grid)
  return failures


def run_grid(*, preset: str, tasks: list[str], attentions: list[str], seeds: list[int], out,
             overrides=()) -> list[str]:
  """Trains every missing run of the grid; returns a line per failed run."""
  configs = checked_grid(preset=preset, tasks=tasks, attentions=attentions, seeds=seeds,
                         overrides=overrides)
  from experiments.train import trainer

  grid = list(configs)
  for (task, attention, seed), config in configs.items():   # before the first run trains
    if (workdir := run_dir(out, task, attention, seed)).joinpath("results.json").exists():
      check_finished(workdir, config)
  failures = []
  for number, (task, attention, seed) in enumerate(grid, start=1):
    workdir = run_dir(out, task, attention, seed)
    if (workdir / "results.json").exists():
      logging.info("[%d/%d] %s exists: skipped", number, len(grid), workdir / "results.json")
      continue
    reason = not_applicable(task, attention)
    if reason:   # recorded, so that the report lists it with the reason
      logging.info("[%d/%d] %s / %s: not applicable (%s)", number, len(grid), task, attention,
                   reason)
      write_json(workdir / "results.json", {
          "task": task, "attention": attention, "preset": preset, "seed": seed,
          "not_applicable": reason})
      continue
    logging.info("[%d/%d] %s / %s / seed %d -> %s", number, len(grid), task, attention, seed,
                 workdir)
    try:
      results = trainer.train_and_evaluate(configs[task, attention, seed], workdir)
      logging.info("%s / %s / seed %d: test accuracy %.4f (final step), %.4f (best validation)",
                   task, attention, seed, results["test_accuracy_final"],
                   results["test_accuracy_best_validation"])
    except HarnessError as e:
      failures.append(f"{task} / {attention} / seed {seed}: {e}")
      logging.error("%s", failures[-1])
    except Exception as e:  # noqa: BLE001 - one broken variant must not stop the grid
      failures.append(f"{task} / {attention} / seed {seed}: {type(e).__name__}: {e}")
      logging.exception("%s / %s / seed %d failed", task, attention, seed)
  return failures


def main(argv):
  if len(argv) > 1:
    raise HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  started = time.time()
  attentions = command_line.split_names(FLAGS.attentions) or attention_names()
  out = FLAGS.out or f"results/{FLAGS.preset}"
  seeds = command_line.integers(FLAGS.seeds, "seeds")
  grid = dict(preset=FLAGS.preset, tasks=FLAGS.tasks, attentions=attentions, seeds=seeds,
              overrides=FLAGS.override)
  configs = grid_configs(**grid)   # a mistake stops here, before JAX starts
  tune = tuning.parse(FLAGS.tune, next(iter(configs.values()), None),
                      tuning.overridden(FLAGS.override))
  point_grids = tuning.grids({**grid, "out": out}, tune)
  report_out = report_dir(out, FLAGS.tasks)
  then = (f"then per task and variant the point of best mean validation accuracy: "
          f"{out}/tuning.md, tuning.json and tuning.csv" if tune else
          f"then the report of these runs: {report_out}/table.md, table.csv and plots")
  dry_run.plan(lambda: [*plan_points(point_grids), then])
  logging.info("%d run(s) in %d grid(s): importing JAX and the trainer",
               len(point_grids) * len(configs), len(point_grids))
  import jax

  from experiments.train import trainer

  trainer.initialize_distributed()
  failures = run_points(point_grids)
  tasks = expand_tasks(FLAGS.tasks)
  some_finished = len(failures) < len(point_grids) * len(configs)
  if jax.process_index() == 0 and some_finished:   # the asked comparison, not all of out/runs
    asked = {"preset": [FLAGS.preset], "task": tasks, "attention": attentions, "seed": seeds}
    logging.info("the runs are done: %s", "choosing each point on validation, then tuning.md"
                 if tune else f"the report in {report_out}")
    if tune:
      print(tuning.write_report(tuning.records(out, tune, asked, tuning.TESTED), tune, out,
                                preset=FLAGS.preset))
      print(f"wrote {out}/tuning.md, tuning.json and tuning.csv; "
            f"wall time {time.time() - started:.0f} s")
    else:
      print(report.write_report(Path(out) / "runs", report_out, only=asked))
      print(f"wrote {report_out}/table.md, table.csv and plots; wall time "
            f"{time.time() - started:.0f} s")
  if failures:
    raise HarnessError(f"{len(failures)} run(s) failed: " + "; ".join(failures))


if __name__ == "__main__":
  # A string, not an enum: a misspelt preset is refused by the task's get_config, in the words
  # experiments.train uses (configs/presets.py unknown_preset).
  flags.DEFINE_string("preset", "tiny", f"One of {', '.join(PRESETS)}. "
                      "tiny: CPU-sized, minutes; paper: the released LRA code as it ran; "
                      "fair: the same budget with its quirks fixed.")
  flags.DEFINE_list("tasks", list(lra.available_tasks()), "Tasks to run: the LRA tasks "
                    f"({', '.join(lra.available_tasks())}) and synthetic tasks "
                    f"({', '.join(synthetic.available_tasks())}); `mad` stands for the six MAD "
                    "tasks.")
  flags.DEFINE_list("attentions", [], "Attention variants; default: every registered one.")
  flags.DEFINE_list("seeds", ["0"], "Seeds; the table shows mean ± std over them.")
  flags.DEFINE_string("out", None, "Output folder (default results/<preset>).")
  flags.DEFINE_list("plugins", [], "Modules to import first; they may register attention variants.")
  flags.DEFINE_multi_string("override", [],
                            "field=value applied to every config, e.g. model.num_layers=1; "
                            "model.attention_options.<name>=value to the variants that have it.")
  flags.DEFINE_multi_string("tune", [], tuning.HELP)
  command_line.run(main)
