"""Whether a workdir's checkpoints are of the run a config describes: what a checkpoint records
of its run (the model, and the settings beside it) and the comparison that refuses another
run's checkpoints, naming the fields that differ and the ways out."""
from __future__ import annotations

import json
from pathlib import Path

from attention_zoo.models import TransformerConfig
from experiments.common.errors import HarnessError
from experiments.train import build, mesh

# Model fields that change how the model is computed, not what it is or what a checkpoint holds:
# a run may resume with them changed (check_memory suggests both to make a run fit).
COMPUTE_ONLY_FIELDS = ("dtype", "remat")
# Fields of the rest of a config that say how a run is carried out or where its data lies, not
# what it trains: a run may resume with them changed too. Every other field must match.
HOW_FIELDS = ("check_memory", "checkpoint_every", "data_dir", "generate_data",
              "grad_accum_steps", "keep_checkpoints", "length_bucket", "log_every",
              *(f"mesh.{axis}" for axis in mesh.AXES))   # a run may resume on another mesh
def model_differences(saved: dict, current: dict) -> list[str]:
  """"model.<field> is <saved> there, <current> in this config" for each field of two recorded
  models (build.describe) that differs, compute-only fields aside."""
  def flat(model: dict, prefix: str = "model") -> dict:
    fields = {}
    for name, value in model.items():
      if isinstance(value, dict):
        fields.update(flat(value, f"{prefix}.{name}"))
      elif name not in COMPUTE_ONLY_FIELDS or prefix != "model":
        fields[f"{prefix}.{name}"] = value
    return fields

  return field_differences(flat(saved), flat(current))


def field_differences(saved: dict, current: dict) -> list[str]:
  """"<field> is <saved> there, <current> in this config" for each field whose values differ."""
  return [f"{name} is {saved.get(name, 'unset')} there, {current.get(name, 'unset')} in this "
          "config" for name in sorted(saved.keys() | current.keys())
          if saved.get(name) != current.get(name)]


def settings_record(config) -> dict:
  """What a run trains beside its model, as a checkpoint records it: every field of the config
  but the model's (the model record) and HOW_FIELDS, as JSON reads it back."""
  return json.loads(json.dumps({field: value for field, value in build.fields(config).items()
                                if not field.startswith("model.") and field not in HOW_FIELDS}))


def model_record(model: TransformerConfig) -> dict:
  """A resolved model as a checkpoint records it (build.describe, as JSON reads it back)."""
  return json.loads(json.dumps(build.describe(model)))


def check_same_run(directory: Path, step: int, saved: dict, model: dict, settings: dict) -> None:
  """HarnessError if the checkpoint record `saved` is of another run than the one of `model`
  (model_record) and `settings` (settings_record), compute-only and HOW_FIELDS aside, naming
  the fields and the ways out. A record written before a key was recorded is not compared on
  it."""
  differences = []
  if "model" in saved:
    differences += model_differences(saved["model"], model)
  if "settings" in saved:
    differences += field_differences(saved["settings"], settings)
  if differences:
    raise HarnessError(
        f"{directory} holds checkpoints of another run (step {step}): "
        f"{'; '.join(differences)}. To train this one, use a new workdir, or start this one "
        "again from step 0 with --restart (Trainer(..., restart=True)), which keeps the "
        "earlier run's files and checkpoints as <name>.1")
