"""Tuning on validation (--tune, experiments/tuning.py): the grid's parsing and its errors, the
choice on planted runs whose test and validation rankings disagree, tuning.json and the tables,
the dry run's listing, skipping and resuming runs; one real tune through reproduce (slow)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import lra
from experiments import reproduce, sweep, tuning
from experiments.common import task_configs
from experiments.common.errors import HarnessError
from experiments.train import trainer

REPO = Path(__file__).resolve().parents[2]
LR = "schedule.base_learning_rate"
WD = "optimizer.weight_decay"


def mqar_config():
  return task_configs.task_config("mqar", "full", "tiny")


def test_values_parse_as_the_field_type_into_a_grid_first_field_slowest():
  tune = tuning.parse([f"{LR}=1e-4, 5e-4,1e-3", f"{WD}=0,0.1", "model.num_layers=1,2",
                       "model.pre_ln=true,False", "model.remat=none,block",
                       "model.attention_options.window=8,16"], mqar_config())
  assert tune == {LR: [1e-4, 5e-4, 1e-3], WD: [0.0, 0.1], "model.num_layers": [1, 2],
                  "model.pre_ln": [True, False], "model.remat": ["none", "block"],
                  "model.attention_options.window": [8, 16]}
  assert [type(v) for v in tune[WD] + tune["model.num_layers"]] == [float, float, int, int]
  grid = tuning.points({LR: tune[LR], WD: tune[WD]})
  assert grid == [{LR: 1e-4, WD: 0.0}, {LR: 1e-4, WD: 0.1}, {LR: 5e-4, WD: 0.0},
                  {LR: 5e-4, WD: 0.1}, {LR: 1e-3, WD: 0.0}, {LR: 1e-3, WD: 0.1}]
  assert tuning.points({}) == [{}]
  # Each point is a folder and overrides that parse back to its values.
  point = {LR: 1e-4, "model.pre_ln": False}
  assert tuning.point_dir("out", point) == Path(
      "out/tune/schedule.base_learning_rate=0.0001,model.pre_ln=false")
  config = task_configs.task_config("mqar", "full", "tiny", overrides=tuning.overrides(point))
  assert config.schedule.base_learning_rate == 1e-4 and config.model.pre_ln is False
  assert tuning.point_dir("out", {}) == Path("out")
  grids = tuning.grids({"tasks": ["mqar"], "out": "out", "overrides": ["model.num_layers=1"]},
                       {LR: [1e-3, 1e-2]})
  assert grids == [({LR: 1e-3}, {"tasks": ["mqar"], "out": Path(f"out/tune/{LR}=0.001"),
                                 "overrides": ["model.num_layers=1", f"{LR}=0.001"]}),
                   ({LR: 1e-2}, {"tasks": ["mqar"], "out": Path(f"out/tune/{LR}=0.01"),
                                 "overrides": ["model.num_layers=1", f"{LR}=0.01"]})]


@pytest.mark.parametrize("specs, taken, message", [
    ([f"{LR[:-1]}=1"], {}, "--tune: unknown config field 'schedule.base_learning_rat': "
                           "config.schedule has no field 'base_learning_rat' (did you mean "
                           "'base_learning_rate'?)"),
    (["model.num_layer=1"], {}, "(did you mean 'num_layers'?)"),
    (["model.num_layers=1,two"], {}, "--tune: model.num_layers=two: invalid literal for int()"),
    (["model.pre_ln=true,maybe"], {}, "model.pre_ln=maybe: expected true or false"),
    ([f"{WD}=0,0.0"], {}, f"--tune {WD}: 0.0 repeats the value 0.0"),
    ([f"{LR}=1", f"{LR}=2"], {}, f"--tune {LR} is given twice"),
    ([LR], {}, f"--tune takes FIELD=V1,V2,... (values separated by commas), got '{LR}'"),
    ([f"{LR}=1,,2"], {}, "--tune takes FIELD=V1,V2,..."),
    (["seed=1,2"], {}, "--tune seed: the seeds are --seeds"),
    (["model.attention=full,performer"], {}, "the variants are --attentions"),
    (["task=mqar"], {}, "config.task cannot be overridden"),
    (["data_dir=a/b"], {}, "a value cannot hold '/'"),
    ([f"{LR}=1"], tuning.overridden([f"{LR}=0.1"]), f"--override sets it ({LR}=0.1)"),
])
def test_grid_errors_name_the_field(specs, taken, message):
  with pytest.raises(HarnessError) as error:
    tuning.parse(specs, mqar_config(), taken)
  assert message in str(error.value)


def test_an_empty_grid_cannot_be_tuned():
  assert tuning.parse([], None) == {}
  with pytest.raises(HarnessError, match="--tune: the grid is empty"):
    tuning.parse([f"{LR}=1"], None)


def plant(out, point: str, task, attention, seed, validation, test, *, validation_final=None,
          test_final=None, model=None, folder=None, **fields):
  """A finished run's results.json at OUT/tune/<point>/runs/<task>/<attention>/seed<seed>
  (or <folder>); `fields` are added to it."""
  workdir = Path(out) / "tune" / point / "runs" / task / attention / (folder or f"seed{seed}")
  workdir.mkdir(parents=True)
  results = {"task": task, "attention": attention, "preset": "tiny", "seed": seed, **fields}
  if "not_applicable" not in fields:
    results.update(best_eval_accuracy=validation, test_accuracy_best_validation=test,
                   validation_accuracy_final=validation if validation_final is None
                   else validation_final,
                   test_accuracy_final=test if test_final is None else test_final,
                   model=model or {}, majority_accuracy=0.1)
  (workdir / "results.json").write_text(json.dumps(results))


# listops / full: per point (learning rate) and seed (0, 1): (best validation accuracy, its test
# accuracy, final validation accuracy, final test accuracy). By test accuracy 1e-4 would win
# under either policy; by validation 1e-3 wins at the best-validation step and 1e-2 at the final
# step.
FULL = {"1e-4": [(0.50, 0.70, 0.50, 0.90), (0.52, 0.72, 0.50, 0.90)],
        "1e-3": [(0.60, 0.40, 0.30, 0.10), (0.64, 0.44, 0.30, 0.10)],
        "1e-2": [(0.55, 0.60, 0.80, 0.20), (0.57, 0.60, 0.80, 0.30)]}
LRS = {"1e-4": 1e-4, "1e-3": 1e-3, "1e-2": 1e-2}


@pytest.fixture
def planted(tmp_path):
  """The runs of a learning-rate grid (see FULL); performer ties 1e-4 with 1e-2 and is missing
  seed 1 at 1e-3 (the best validation there); linformer cannot run mqar."""
  out = tmp_path / "out"
  for name, rows in FULL.items():
    for seed, (validation, test, validation_final, test_final) in enumerate(rows):
      plant(out, f"{LR}={LRS[name]}", "listops", "full", seed, validation, test,
            validation_final=validation_final, test_final=test_final)
  for name, (validation, test) in {"1e-4": (0.5, 0.3), "1e-2": (0.5, 0.9)}.items():
    for seed in (0, 1):
      plant(out, f"{LR}={LRS[name]}", "listops", "performer", seed, validation, test)
  plant(out, f"{LR}=0.001", "listops", "performer", 0, 0.99, 0.99)
  # Not asked: another seed, another preset; both would win.
  plant(out, f"{LR}=0.0001", "listops", "performer", 7, 0.999, 0.999)
  plant(out, f"{LR}=0.01", "listops", "performer", 0, 0.999, 0.999, preset="fair",
        folder="seed0_fair")
  for name in LRS:
    for seed in (0, 1):
      plant(out, f"{LR}={LRS[name]}", "mqar", "linformer", seed, None, None,
            not_applicable="linformer cannot be causal")
  return out


ASKED = {"preset": ["tiny"], "task": ["listops", "mqar"], "attention": ["full", "performer",
                                                                        "linformer"],
         "seed": [0, 1]}
TUNE = {LR: [1e-4, 1e-3, 1e-2]}


def test_the_choice_follows_validation_not_test(planted, caplog):
  with caplog.at_level("INFO"):
    records = {(r["task"], r["attention"]): r
               for r in tuning.records(planted, TUNE, ASKED, tuning.TESTED)}
  assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("tuning: ")] == [
      f"tuning: reading the runs of point {i}/3 ({LR}={value})"
      for i, value in enumerate(LRS.values(), start=1)]
  full = records["listops", "full"]
  assert full["chosen"] == {LR: 1e-3}   # best validation (0.62), worst test
  assert [p["mean"] for p in full["validation"]] == pytest.approx([51.0, 62.0, 56.0])
  assert (full["test_mean"], full["test_std"]) == pytest.approx((42.0, 2 ** 0.5 * 2))
  performer = records["listops", "performer"]
  assert performer["chosen"] == {LR: 1e-4}   # of equals the first, though 1e-2 tests higher
  assert performer["validation"][1] == {"values": {LR: 1e-3}, "mean": None, "missing_seeds": [1]}
  assert performer["test_mean"] == pytest.approx(30.0)
  assert records["mqar", "linformer"] == {"task": "mqar", "attention": "linformer",
                                          "not_applicable": "linformer cannot be causal"}
  # Nothing ran for these.
  assert records["listops", "linformer"]["chosen"] is None
  assert records["mqar", "full"]["test_mean"] is None
  # The final model's: its own validation accuracy decides.
  final = tuning.records(planted, TUNE, {**ASKED, "task": ["listops"], "attention": ["full"]},
                         "test_accuracy_final")
  assert final[0]["chosen"] == {LR: 1e-2} and final[0]["test_mean"] == pytest.approx(25.0)


def test_a_run_without_the_validation_accuracy_is_named(tmp_path):
  plant(tmp_path, f"{LR}=0.1", "listops", "full", 0, 0.5, 0.5)
  (path,) = tmp_path.rglob("results.json")
  path.write_text(json.dumps({**json.loads(path.read_text()), "validation_accuracy_final": None}))
  with pytest.raises(HarnessError, match="seed0/results.json records no "
                                             "validation_accuracy_final.*delete it"):
    tuning.records(tmp_path, {LR: [0.1]}, {**ASKED, "seed": [0]}, "test_accuracy_final")


def test_tuning_json_and_table(planted):
  records = tuning.records(planted, TUNE, ASKED, tuning.TESTED)
  text = tuning.write_report(records, TUNE, planted, preset="tiny")
  assert (planted / "tuning.md").read_text() == text
  written = json.loads((planted / "tuning.json").read_text())
  assert written == json.loads(json.dumps(records))
  full = written[0]
  assert list(full) == ["task", "attention", "tested", "chosen", "validation", "test_mean",
                        "test_std", "seeds", "provenance"]
  assert (full["task"], full["attention"], full["tested"], full["seeds"]) == (
      "listops", "full", "test_accuracy_best_validation", [0, 1])
  assert [p["values"] for p in full["validation"]] == [{LR: v} for v in TUNE[LR]]
  assert [(r["task"], r["attention"]) for r in written] == [
      (t, a) for t in ASKED["task"] for a in ASKED["attention"]]
  chosen_table, every_point = text.split("Every point: validation / test accuracy (%)")
  rows = {tuple(line.split(" | ")[:2]): line for line in chosen_table.splitlines()
          if line.startswith("| ")}
  assert rows["| Task", "Model"] == f"| Task | Model | Test | Validation | {LR} |"
  assert rows["| listops", "full"] == "| listops | full | 42.00 ± 2.83 | 62.00 | 0.001 |"
  assert rows["| listops", "performer"] == "| listops | performer | 30.00 ± 0.00 | 50.00 | 0.0001 |"
  assert rows["| mqar", "linformer"] == "| mqar | linformer | n/a |  |  |"
  assert rows["| mqar", "full"] == "| mqar | full | — |  |  |"
  assert "n/a: linformer on mqar: linformer cannot be causal" in text
  assert (f"performer on listops: {LR}=0.001 left out of the choice: no run for seed(s) 1"
          in text)
  assert f"Grid: {LR} ∈ {{0.0001, 0.001, 0.01}} (3 points)" in text
  # A chosen value at an end of a numeric range of three or more is flagged; one inside is not.
  assert (f"performer on listops: {LR}=0.0001 is the grid's smallest value: a better one may "
          "lie beyond it" in text)
  assert "full on listops: " + LR not in text
  assert tuning.at_edge({LR: 0.01, "wd": 0.1, "name": "b"},
                        {LR: [1e-4, 1e-3, 1e-2], "wd": [0.0, 0.1], "name": ["a", "b", "c"]}) == [
      (LR, "largest")]
  # Planted without an environment: where the runs ran is "unknown", never guessed.
  assert (planted / "tuning.csv").read_text().splitlines() == [
      f"variant,task,{LR},seeds,test_mean,test_std,device,commit,jax,date",
      "full,listops,0.001,2,42.00,2.83,unknown,unknown,unknown,unknown",
      "performer,listops,0.0001,2,30.00,0.00,unknown,unknown,unknown,unknown"]
  # Every point, the chosen one in bold, the one left out as "—"; the runs not asked (seed 7,
  # preset fair) stay out of the means.
  assert [line for line in every_point.splitlines() if line.startswith("| ")] == [
      f"| Task | Model | {LR}=0.0001 | {LR}=0.001 | {LR}=0.01 |",
      "| listops | full | 51.00 / 71.00 | **62.00 / 42.00** | 56.00 / 60.00 |",
      "| listops | performer | **50.00 / 30.00** | — | 50.00 / 90.00 |"]


def test_the_chosen_points_in_the_published_layout(tmp_path):
  """MAD's table of the runs at each task's own chosen point: a task per column and the
  average; the runs of the points not chosen stay out of it."""
  for name, lr in LRS.items():
    for seed in (0, 1):
      best = {"1e-3": "compression", "1e-2": "memorization"}.get(name)
      for task in ("compression", "memorization"):
        accuracy = 0.6 + 0.1 * seed if task == best else 0.2
        plant(tmp_path, f"{LR}={lr}", task, "gla", seed, accuracy, accuracy)
  asked = {"preset": ["tiny"], "task": ["compression", "memorization"], "attention": ["gla"],
           "seed": [0, 1]}
  records = tuning.records(tmp_path, TUNE, asked, tuning.TESTED)
  assert [r["chosen"] for r in records] == [{LR: 1e-3}, {LR: 1e-2}]
  text = tuning.write_report(records, TUNE, tmp_path, preset="tiny")
  layout = text.split("a task per column (the chosen point may differ from cell to cell):")[1]
  assert "### MAD, preset `tiny`, best validation step" in layout
  assert "| Model | compression | memorization | Avg |" in layout
  assert "| gla | 65.00 ± 7.07 | 65.00 ± 7.07 | 65.00 |" in layout


def test_the_sweep_reports_each_values_choice(tmp_path):
  """Each swept value chooses on its own; the cell names the chosen values and the state size
  is that of the chosen runs' model."""
  def model(emb_dim):
    return {"attention": "full", "emb_dim": emb_dim, "qkv_dim": None, "num_heads": 2,
            "num_kv_heads": 2, "max_len": 32, "attention_options": {}}

  def environment(commit, day):
    return {"git_commit": commit, "device": "1 x cpu (cpu)", "versions": {"jax": "0.10.2"},
            "date": f"2026-12-0{day}T10:00:00+00:00"}

  validation = {"4": {0.001: 0.9, 0.01: 0.5}, "8": {0.001: 0.2, 0.01: 0.3}}
  for value, by_lr in validation.items():
    for lr, accuracy in by_lr.items():
      plant(tmp_path / f"data.num_pairs={value}", f"{LR}={lr}", "mqar", "full", 0, None, None,
            validation_final=accuracy, test_final=1 - accuracy, model=model(int(1 / lr)),
            environment=environment(f"{value}bcdef0123", int(value)))
  asked = {"preset": ["tiny"], "task": ["mqar"], "attention": ["full"], "seed": [0]}
  table, states, chosen, records = sweep.collect_tuned(tmp_path, "data.num_pairs", ["4", "8"],
                                                       {LR: [0.001, 0.01]}, asked)
  assert table == {"full": {"4": pytest.approx(10.0), "8": pytest.approx(70.0)}}
  assert chosen == {"full": {"4": {LR: 0.001}, "8": {LR: 0.01}}}
  assert states == {"full": {"4": 2 * 32 * 1000, "8": 2 * 32 * 100}}   # 2 · max_len · emb_dim
  assert [r["swept"] for r in records] == [{"data.num_pairs": "4"}, {"data.num_pairs": "8"}]
  assert all(r["tested"] == "test_accuracy_final" for r in records)
  text = sweep.write(table, states, tmp_path, "data.num_pairs", ["4", "8"], "mqar",
                     x="state_size", chosen=chosen)
  assert "best mean validation accuracy" in text.splitlines()[0]
  assert (f"| full | 10.0 (64,000) at {LR}=0.001 | 70.0 (6,400) at {LR}=0.01 |"
          in text.splitlines())
  # tuning.csv: a row per swept value, its state size and where its chosen runs ran.
  assert tuning.csv_text(records, {LR: [0.001, 0.01]}, states).splitlines() == [
      f"variant,task,data.num_pairs,state_size,{LR},seeds,test_mean,test_std,device,commit,jax,"
      "date", "full,mqar,4,64000,0.001,1,10.00,,1 x cpu (cpu),4bcdef0,0.10.2,2026-12-04",
      "full,mqar,8,6400,0.01,1,70.00,,1 x cpu (cpu),8bcdef0,0.10.2,2026-12-08"]


def fake_training(calls):
  """trainer.train_and_evaluate that records (workdir, learning rate) and writes a results.json
  whose validation accuracy grows with the learning rate and test accuracy falls."""
  def train_and_evaluate(config, workdir):
    lr = config.schedule.base_learning_rate
    calls.append((Path(workdir), lr))
    results = {"task": config.task, "attention": config.model.attention, "preset": config.preset,
               "seed": config.seed, "best_eval_accuracy": lr, "test_accuracy_best_validation":
               1 - lr, "test_accuracy_final": 0.5, "validation_accuracy_final": 0.5}
    Path(workdir).mkdir(parents=True, exist_ok=True)
    (Path(workdir) / "results.json").write_text(json.dumps(results))
    return results
  return train_and_evaluate


def test_finished_runs_are_skipped_and_missing_ones_trained_again(tmp_path, monkeypatch):
  out = tmp_path / "out"
  grid = dict(preset="tiny", tasks=["mqar"], attentions=["full", "linformer"], seeds=[0, 1],
              out=out, overrides=["model.num_layers=1"])
  point_grids = tuning.grids(grid, {LR: [0.25, 0.5]})
  plant(out, f"{LR}=0.25", "mqar", "full", 0, 0.25, 0.75)   # finished before
  calls = []
  monkeypatch.setattr(trainer, "train_and_evaluate", fake_training(calls))
  assert reproduce.run_points(point_grids) == []
  run = lambda lr, seed: out / "tune" / f"{LR}={lr}" / "runs" / "mqar" / "full" / f"seed{seed}"
  assert calls == [(run(0.25, 1), 0.25), (run(0.5, 0), 0.5), (run(0.5, 1), 0.5)]
  linformer = out / "tune" / f"{LR}=0.5" / "runs" / "mqar" / "linformer" / "seed1"
  assert "not_applicable" in json.loads((linformer / "results.json").read_text())
  calls.clear()
  assert reproduce.run_points(point_grids) == [] and calls == []   # all finished: skipped
  (run(0.5, 1) / "results.json").unlink()   # interrupted: its workdir is trained (resumed)
  reproduce.run_points(point_grids)
  assert calls == [(run(0.5, 1), 0.5)]
  asked = {"preset": ["tiny"], "task": ["mqar"], "attention": ["full", "linformer"],
           "seed": [0, 1]}
  full, linformer_record = tuning.records(out, {LR: [0.25, 0.5]}, asked, tuning.TESTED)
  assert full["chosen"] == {LR: 0.5} and full["test_mean"] == pytest.approx(50.0)
  assert "not_applicable" in linformer_record


def test_the_dry_run_lists_every_point_and_its_runs(tmp_path):
  out = tmp_path / "out"
  grid = dict(preset="tiny", tasks=["mqar"], attentions=["full", "linformer"], seeds=[0],
              out=out, overrides=["model.num_layers=1"])
  plant(out, f"{LR}=0.001,{WD}=0.1", "mqar", "full", 0, 0.5, 0.5)
  before = sorted(tmp_path.rglob("*"))
  lines = reproduce.plan_points(tuning.grids(grid, {LR: [1e-3, 1e-2], WD: [0.0, 0.1]}))
  assert sorted(tmp_path.rglob("*")) == before   # nothing written
  assert len(lines) == 4 * 3
  headers = lines[::3]
  folder = lambda lr, wd: out / "tune" / f"{LR}={lr},{WD}={wd}"
  assert headers == [f"tuning point {i}/4: {LR}={lr}, {WD}={wd} -> {folder(lr, wd)}"
                     for i, (lr, wd) in enumerate([(0.001, 0.0), (0.001, 0.1), (0.01, 0.0),
                                                   (0.01, 0.1)], start=1)]
  assert lines[1].endswith(f"-> {folder(0.001, 0.0)}/runs/mqar/full/seed0")
  assert lines[4] == (f"mqar / full / seed 0: {folder(0.001, 0.1)}/runs/mqar/full/seed0/"
                      "results.json exists: skipped")
  assert "mqar / linformer / seed 0: not applicable" in lines[2]


@pytest.mark.slow
def test_reproduce_tunes_on_validation_end_to_end(tmp_path):
  """A real tune: two learning rates of tiny ListOps, one seed; the choice and the reported test
  accuracy are those of the runs' own results.json."""
  data = tmp_path / "data"
  lra.generate_listops(data, num_train=24, num_val=8, num_test=8, min_length=4, max_length=30,
                       progress=False)
  small = {"model.num_layers": 1, "model.emb_dim": 16, "model.num_heads": 2, "model.mlp_dim": 32,
           "model.max_len": 32, "batch_size": 4, "num_train_steps": 4, "eval_every": 2,
           "log_every": 2, "data_dir": data}
  out = tmp_path / "out"
  done = subprocess.run(
      [sys.executable, "-m", "experiments.reproduce", "--preset=tiny", "--tasks=listops",
       "--attentions=full", "--seeds=0", f"--out={out}", f"--tune={LR}=1e-3,3e-1",
       *(f"--override={field}={value}" for field, value in small.items())],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  (record,) = json.loads((out / "tuning.json").read_text())
  runs = {lr: json.loads((out / "tune" / f"{LR}={lr}" / "runs" / "listops" / "full" / "seed0"
                          / "results.json").read_text()) for lr in (0.001, 0.3)}
  assert [p["mean"] for p in record["validation"]] == pytest.approx(
      [100 * runs[lr]["best_eval_accuracy"] for lr in runs])
  best = max(runs, key=lambda lr: runs[lr]["best_eval_accuracy"])   # max keeps the first of equals
  assert record["chosen"] == {LR: best}
  assert record["test_mean"] == pytest.approx(100 * runs[best]["test_accuracy_best_validation"])
  assert all(run["validation_accuracy_final"] is not None for run in runs.values())
  assert f"| listops | full | {record['test_mean']:.2f} |" in done.stdout
  assert (out / "tuning.md").read_text() in done.stdout
