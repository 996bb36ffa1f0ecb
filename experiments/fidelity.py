"""docs/lra_fidelity.md: for every LRA task and variant, each hyper-parameter as the released
LRA code ran it, as our `paper` preset sets it and as our `fair` preset sets it, with the reason
for every difference; then ListOps under the Nyströmformer paper's light protocol: each value
of its released code with where the code sets it, as `light` and `light_fair` set it, and the
quirk each difference fixes. Generated from the configs, so the tables cannot drift from them:

    python -m experiments.fidelity --out=docs/lra_fidelity.md

tests/experiments/test_fidelity.py regenerates it and compares, and checks that every difference
has a reason.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from absl import flags

import attention_zoo as az
import lra
from configs import presets
from configs.lra import common
from experiments.common import command_line, dry_run
from experiments.common.errors import HarnessError
from experiments.common.records import write_text
from experiments.common.task_configs import task_config, task_values
from experiments.train import build

FLAGS = flags.FLAGS
OUT = "docs/lra_fidelity.md"

# Why a value differs between the released code and a preset, most specific key first:
# (task, variant, field), (variant, field), field. A task's paper changes (configs/task_values.py)
# carry their own.
REASONS = {
    "model.embed_init_std": "quirk fixed in `fair`: the released encoders drew token embeddings "
                            "from N(0, 1); ours use the library's N(0, 1/emb_dim) scale",
    "model.zero_token_is_padding": "quirk fixed in `fair`: the released mask `inputs > 0` made "
                                   "id 0 padding, so every black pixel was masked out; padding "
                                   "now comes only from the data's masks",
    "model.attention_ignores_padding": "quirk fixed in `fair`: the released variant ignored the "
                                       "padding mask, so padded keys entered its attention",
    "model.attention_dropout_rate": "the variant forms no attention weights to drop (the released "
                                    "code ignored the rate too)",
    "model.attention_options.dropout_rate":
        "quirk fixed in `fair`: the released variant skipped attention dropout; `fair` applies "
        "the model's rate like every other variant",
    ("longformer", "model.attention_options.num_global_tokens"):
        "quirk fixed in `fair`: the released Longformer had no global token; `fair` makes the "
        "CLS token global, the Longformer paper's setup for classification",
    ("linformer", "model.attention_options.share"):
        "quirk fixed in `fair`: the released Linformer shared one projection across keys, values "
        "and heads; `fair` uses per-head E_i, F_i, the Linformer paper's default",
    ("reformer", "model.attention_options.num_chunks"):
        "quirk fixed in `fair`: the released Reformer cut every sequence into 10 chunks; `fair` "
        "uses fixed-length chunks as in the Reformer paper",
    ("reformer", "model.attention_options.n_buckets"):
        "`fair` uses the Reformer paper's rule (2 x length / chunk_len buckets) instead of the "
        "released 10",
    ("reformer", "model.attention_options.scale"):
        "quirk fixed in `fair`: the released Reformer multiplied its logits by sqrt(head_dim) "
        "instead of dividing by it",
    ("performer", "model.attention_options.kernel"):
        "quirk fixed in `fair`: FAVOR+ with the softmax kernel, the Performer paper's method; the "
        "released code ran a ReLU kernel on four tasks",
    ("performer", "model.attention_options.features"):
        "quirk fixed in `fair`: random orthogonal features; the released ReLU kernel used none "
        "(φ(x) = relu(x) + 0.001)",
    ("performer", "model.attention_options.scale"):
        "quirk fixed in `fair`: the released ReLU kernel read the unscaled q and k (the "
        "d^-1/4 normaliser was never passed); `fair` scales them as FAVOR+ does",
    ("performer", "model.attention_options.nb_features"):
        "quirk fixed in `fair`: 256 random features (the Performer paper's default); the released "
        "ListOps config used 2",
    ("synthesizer", "model.attention_options.mixture"):
        "quirk fixed in `fair`: learned mixture weights over the random and dot-product logits, "
        "as in the Synthesizer paper; the released code summed them",
}
# Values that the released configs leave unknown or contested, explained once.
NOTES = {
    ("image", "bigbird", "model.num_heads"):
        "the released file sets `num_head = 4`, a misspelling: the base's single head stays "
        "(and the released encoder would reject the unknown argument)",
    ("image", "reformer", "model.qkv_dim"):
        "the released file says 32, but the released Reformer ignores qkv_dim and projects to "
        "emb_dim",
    ("pathfinder", "reformer", "model.qkv_dim"):
        "the released file says 32, but the released Reformer ignores qkv_dim and projects to "
        "emb_dim",
    ("text", "linformer", "model.attention_options.k"):
        "the released file sets `low_rank_features = 32` where train.py never reads it: 16 ran",
    ("image", "sinkhorn", "model.emb_dim"):
        "the released file keeps the base dimensions (emb 32, 1 head)",
    **{(task, "performer", "model.attention_options.nb_features"):
       "unused by `paper`'s deterministic features: there is no projection"
       for task in ("text", "retrieval", "image", "pathfinder", "pathx")},
}

# Differences that are not config values: what the released code did, what both presets do,
# whether `paper` recreates it, and why.
NOT_CONFIG_VALUES = (
    ("Test accuracy reported", "the final checkpoint's", "both, labelled: the final step's and the "
     "best-validation step's (`test_accuracy_final`, `test_accuracy_best_validation`)",
     "compare the final step's with the paper"),
    ("Text validation split", "the IMDb test set (so checkpoints were chosen on test)",
     "a fixed part of the training reviews (lra.load), disjoint from test",
     "never recreated: no number is chosen on the test set"),
    ("ListOps vocabulary", "built from a Python set: ids changed between processes",
     "a fixed, sorted vocabulary", "not recreated: it made checkpoints unreadable by another "
     "process, not a different model"),
    ("Retrieval model", "single-tower encoders at HEAD (train.py fails for every model but "
     "TLB); the earlier dual encoders pooled the first token and classified concat[u, v] through "
     "two hidden layers", "one shared tower per document with a CLS token, NLI interaction "
     "[u, v, u*v, u-v], the paper's stated head", "not recreated: the released file cannot run"),
    ("CLS token", "initialised to zeros; its padding mask copied token 0's",
     "initialised N(0, 0.02); always a real token", "not recreated (with pixel 0 masked, the "
     "released CLS could be masked itself; ours never is)"),
    ("Projections", "attention q/k/v/out without bias, Xavier-uniform kernels",
     "with bias, the library's default init", "not recreated: initialisation details"),
    ("Sinkhorn head", "mean pooling straight into the logits layer (no hidden layer)",
     "the same head as every variant (hidden layer of mlp_dim)", "not recreated"),
    ("Local attention blocks", "a strided reshape: a block held positions b, b+n, b+2n, ... "
     "(and the padding mask was reshaped contiguously)", "contiguous blocks",
     "not recreated: a bug of the released reshape, not the method"),
    ("Sinkhorn sort", "the sorting einsum summed over both block indices: every query block saw "
     "the sum of all key blocks, so the learned sort had no effect; the blocks were strided as "
     "in local", "Sinkhorn balancing of a learned sort over contiguous blocks, with Gumbel noise "
     "in training", "not recreated: the released sort did not sort"),
    ("Sparse Transformer", "the fixed pattern intersected with a causal mask, even for "
     "classification (the CLS token saw everything)", "bidirectional fixed pattern",
     "not recreated: a causal encoder would leave our CLS token blind"),
    ("Reformer", "no self-mask, no causal or padding mask, one fixed hashing key for every "
     "call and layer, no output projection", "self-mask, masks, fresh hashes in training, an "
     "output projection", "padding: recreated (`model.attention_ignores_padding`); the rest not"),
    ("BigBird random blocks", "drawn from the first 1024 tokens only",
     "drawn from the whole sequence, per layer", "not recreated (matters only above 1024 tokens: "
     "ListOps, Retrieval)"),
    ("Path-X", "only the Transformer's config was released", "every variant runs it",
     "no other values exist"),
)


# The light protocol (configs/lra/listops.py, VALUES.light): the rows of the Nyströmformer paper's
# Table 1, and what is not a config value: the released code, both light presets, whether
# `light` recreates it.
LIGHT_TASK = "listops"
LIGHT_VARIANTS = ("full", "reformer", "linformer", "performer", "nystromformer")
LIGHT_NOT_CONFIG_VALUES = (
    ("Precision", "fp16 autocast around the model with a GradScaler (attention cores in fp32); "
     "a step the scaler skipped still advanced the schedule", "float32 throughout",
     "the one value that cannot be kept: no fp16 autocast with loss scaling here"),
    ("Seeds", "none: initialisation, data order, Performer's projection, Reformer's hashes and "
     "the dropped test examples all differed between runs", "`seed` (reproduce --seeds=0,1,2)",
     "not recreated: every run here repeats exactly"),
    ("Test accuracy reported", "the best-validation checkpoint's (saved when the mean dev "
     "accuracy was strictly greater than the best so far)", "both, labelled; "
     "`test_accuracy_best_validation` is the released policy (strictly greater too)",
     "compare the best-validation step's with the paper"),
    ("ListOps vocabulary", "ids from a Python set (changing with PYTHONHASHSEED), 14 symbols "
     "and an out-of-vocabulary id in a 32-row table", "a fixed sorted vocabulary (`]` one id of "
     "16, unused without closing brackets) in a 32-row table",
     "not recreated: ids are names; the table has the released 32 rows"),
    ("Data order", "shuffled at load and after each pass (`random.shuffle`), train and dev "
     "streams endless", "each pass a permutation drawn from (seed, pass)", "recreated in "
     "distribution"),
    ("Initialisation", "PyTorch's defaults: Linear kernels Kaiming-uniform with biases "
     "U(±1/sqrt(fan_in)); Nyström's convolution U(±1/sqrt(35))", "flax's LeCun-normal kernels "
     "and zero biases; the convolution as released", "not recreated: initialisation details "
     "(embeddings, positions and Linformer's E are recreated)"),
    ("Reformer internals", "HuggingFace 3.x LSHSelfAttention: query_key and value share W_q's "
     "and W_v's weights without their biases (W_k unused); all hash rounds sorted as one "
     "sequence, chunk 0 looking back to the last chunk of the last round", "q and v "
     "projections with biases, no key projection; each round chunked apart",
     "not recreated: the wrapped-in chunk holds only padding for every ListOps row under "
     "1985 tokens"),
    ("Reformer hashes at evaluation", "new rotations at every forward call: every test batch "
     "hashed anew", "eval_rotations=fresh: drawn from the model's dropout stream; one "
     "evaluation's batches share a draw, each evaluation (and each training step) draws anew",
     "recreated per evaluation, not per batch"),
    ("Performer projection", "one Ω for both heads; QR blocks without the sign fix (not exactly "
     "Haar)", "one Ω per head, Haar-distributed blocks", "not recreated: the same distribution "
     "per head"),
    ("Linformer E", "a class attribute: shared by both layers and by every model built in the "
     "process", "share_attention_across_layers: shared by the layers of one model",
     "recreated within a model"),
    ("Data parallelism", "nn.DataParallel over the visible GPUs: Nyström's batch-global "
     "pseudo-inverse init and Performer's key max taken over each GPU's share of the batch",
     "over the whole batch of 32", "recreated for one device"),
)


def _preset(task: str, variant: str, preset: str, fields: set[str]) -> dict:
  """The preset's values of `fields` for (task, variant) as the trainer builds them: the model's
  as the built model has them, the rest as the checked config does."""
  config, _ = build.check(task_config(task, variant, preset))
  model = dataclasses.asdict(build.model_config(config))
  options = {**az.spec(variant).options, **model["attention_options"]}
  values = {}
  for field in fields:
    if field.startswith(build.OPTIONS):
      name = field[len(build.OPTIONS):]
      if name == "dropout_rate" and name not in config.model.attention_options:
        values[field] = model["attention_dropout_rate"]   # the model's rate reaches it
      else:
        values[field] = options.get(name, "—")
    elif field.startswith("model."):
      values[field] = model[field[len("model."):]]
    else:
      node, name = presets.parent_and_name(config, field)
      values[field] = node[name]
  return values


def _reason(task: str, variant: str, field: str, paper_changes: dict) -> str | None:
  if field in paper_changes.get(variant, {}):
    return paper_changes[variant][field][1]
  for key in ((task, variant, field), (variant, field), field):
    if key in REASONS:
      return REASONS[key]
  return None


def rows(task: str) -> list[dict]:
  """One row per (variant, field): released, paper and fair values, reason and note."""
  paper_changes = task_values(task).paper_changes
  table = []
  for variant in common.LRA_VARIANTS:
    shipped = common.released_values(task_values(task), variant)
    fields = set(shipped)
    fields |= {field for preset in ("paper", "fair")
               for _, layer in common.task_layers(task_values(task), variant, preset)[1:]
               for field in layer if preset == "paper" or field.startswith(build.OPTIONS)}
    paper, fair = (_preset(task, variant, p, fields) for p in ("paper", "fair"))
    for field in sorted(fields):
      row = {"variant": variant, "field": field, "released": shipped.get(field, "—"),
             "paper": paper[field], "fair": fair[field],
             "note": NOTES.get((task, variant, field))}
      row["reason"] = (_reason(task, variant, field, paper_changes) if differs(row) else None)
      if differs(row) and row["reason"] is None and _dimension_change(field, row):
        row["reason"] = ("`fair` runs every variant on the task's Transformer dimensions and "
                         "optimiser settings")
      table.append(row)
  return table


def differs(row: dict) -> bool:
  """True where a preset departs from the released value (one the released code set) or the
  two presets disagree."""
  released_set = row["released"] != "—"
  return (released_set and not _same(row["released"], row["paper"])) or not _same(
      row["paper"], row["fair"])


def _same(a, b) -> bool:
  numbers = (int, float)
  if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool):
    return abs(float(a) - float(b)) < 1e-12
  return a == b


def _dimension_change(field: str, row: dict) -> bool:
  """True where only `fair` differs and it does so by taking the Transformer's value."""
  return _same(row["released"], row["paper"]) and not field.startswith(build.OPTIONS)


def light_rows() -> list[dict]:
  """One row per (variant, field) of the light protocol: the released value and where the code
  sets it, the resolved `light` and `light_fair` values, and the quirk a difference fixes."""
  values = task_values(LIGHT_TASK)
  table = []
  for variant in LIGHT_VARIANTS:
    keys = ("shared", variant)
    released = {field: entry for key in keys for field, entry in values.light.get(key, {}).items()}
    fixes = {field: entry for key in keys
             for field, entry in values.light_fixes.get(key, {}).items()}
    fields = set(released) | set(fixes)
    light, fair = (_preset(LIGHT_TASK, variant, p, fields) for p in common.LIGHT_PRESETS)
    for field in sorted(fields):
      value, source = released.get(field, ("—", None))
      table.append({"variant": variant, "field": field, "released": value, "source": source,
                    "light": light[field], "light_fair": fair[field],
                    "own": field in {**values.light.get(variant, {}),
                                     **values.light_fixes.get(variant, {})},
                    "fix": fixes[field][1] if field in fixes else None})
  return table


def light_departs(row: dict) -> bool:
  """True where `light` is not the released value (a value computed when the model is built,
  e.g. 1/head_dim, is compared as the number it becomes)."""
  computed = row["released"] in (common.SQRT_HEAD_DIM, common.INVERSE_HEAD_DIM)
  return not computed and not _same(row["released"], row["light"])


def _fmt(value) -> str:
  if value is None:
    return "default"
  if isinstance(value, float):
    return f"{value:g}"
  return str(value)


def render() -> str:
  lines = [
      "# LRA fidelity: the released code, our `paper` and `fair` presets, and the light "
      "protocol",
      "",
      "Generated by `python -m experiments.fidelity` from `configs/lra/`; "
      "`tests/experiments/test_fidelity.py` checks that this file and the configs agree and that "
      "every difference has a reason. Do not edit by hand.",
      "",
      "- **released**: what the released LRA code (google-research/long-range-arena, per-model "
      "configs at HEAD) ran: the value its config file sets, or where the code ignored the file, "
      "the value that ran (a note says so).",
      "- **paper** (`--config=configs/lra/<task>.py:<variant>,paper`): the released code as it "
      "ran, every quirk that changes results recreated behind a named field; it departs from "
      "the released value only where that value cannot run or its authors corrected it.",
      "- **fair** (`...:<variant>,fair`): the same data, budget, schedule and optimiser with every "
      "quirk fixed and every variant on the task's Transformer dimensions.",
      "- `tiny` is `fair` at CPU size (shorter sequences, a small model, a few hundred steps).",
      "",
      "Fields are config fields (`model.*`, `optimizer.*`, `schedule.*`, ...); "
      "`model.attention_options.*` are the variant's options, resolved when the model is built "
      "(an option a preset leaves unset shows the variant's default). Variants not in the LRA "
      "paper (`flash`, `nystromformer`) run with the Transformer's values in every preset.",
      "",
      "## Differences that are not config values",
      "",
      "| what | released code | both presets | recreated in `paper`? |",
      "|---|---|---|---|",
  ]
  lines += [f"| {what} | {released} | {ours} | {recreated} |"
            for what, released, ours, recreated in NOT_CONFIG_VALUES]
  for task in lra.available_tasks():
    table = rows(task)
    reference = {r["field"]: r for r in table if r["variant"] == "full"}
    lines += ["", f"## {task}", "", "### The Transformer (`full`), and every variant unless listed "
              "below", "", "| field | released | paper | fair | reason for a difference; note |",
              "|---|---|---|---|---|"]
    lines += [_line(r) for r in reference.values()]
    lines += ["", "### Per variant, where it departs from the Transformer's rows", "",
              "| variant | field | released | paper | fair | reason for a difference; note |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} " + _line(r) for r in table
              if r["variant"] != "full" and not _same_row(r, reference.get(r["field"]))]
  return "\n".join(lines + render_light()) + "\n"


def render_light() -> list[str]:
  table = light_rows()
  lines = [
      "", f"## {LIGHT_TASK} under the Nyströmformer paper's light protocol", "",
      "Xiong et al. 2021 (Nyströmformer, arXiv:2102.03902) ran every LRA variant as a 2-layer "
      "model of width 64 in their own PyTorch code (mlpen/Nystromformer, `LRA/code`; Reformer "
      "from HuggingFace transformers 3.x, Performer from performer-pytorch 0.15).",
      "",
      "- **released**: the value their ListOps run used, and where their code sets it "
      "(`file:line` in `LRA/code/`).",
      "- **light** (`--config=configs/lra/listops.py:<variant>,light`): the released code as it "
      "ran, every quirk that changes results behind a named field.",
      "- **light_fair** (`...:<variant>,light_fair`): the same protocol with each quirk fixed; "
      "the last column says what it fixes.",
      "",
      "The data are generated by `python -m lra.generate listops` at the released sizes "
      "(96,000 / 2,000 / 2,000); docs/data.md compares their statistics with what the LRA paper "
      "and code state.",
      "",
      "### Differences that are not config values", "",
      "| what | released code | both light presets | recreated in `light`? |", "|---|---|---|---|",
  ]
  lines += [f"| {what} | {released} | {ours} | {recreated} |"
            for what, released, ours, recreated in LIGHT_NOT_CONFIG_VALUES]
  header = ("| field | released | light | light_fair | where the code sets it | "
            "what light_fair fixes |")
  lines += ["", "### Every variant", "", header, "|---|---|---|---|---|---|"]
  lines += [_light_line(r) for r in table if r["variant"] == "full"]
  lines += ["", "### Per variant: its own settings", "", "| variant " + header,
            "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['variant']} " + _light_line(r) for r in table
            if r["variant"] != "full" and r["own"]]
  return lines


def _light_line(row: dict) -> str:
  return (f"| `{row['field']}` | {_fmt(row['released'])} | {_fmt(row['light'])} | "
          f"{_fmt(row['light_fair'])} | {row['source'] or ''} | {row['fix'] or ''} |")


def _line(row: dict) -> str:
  return (f"| `{row['field']}` | {_fmt(row['released'])} | {_fmt(row['paper'])} | "
          f"{_fmt(row['fair'])} | {_explain(row)} |")


def _same_row(row: dict, reference: dict | None) -> bool:
  return reference is not None and row["note"] is None and all(
      _same(row[k], reference[k]) for k in ("released", "paper", "fair"))


def _explain(row: dict) -> str:
  parts = [p for p in (row["reason"], row["note"] and f"note: {row['note']}") if p]
  return "; ".join(parts)


def _change(path, text: str) -> str:
  """What writing `text` to `path` would do to it."""
  if not Path(path).is_file():
    return "new"
  return "unchanged" if Path(path).read_text(encoding="utf-8") == text else "changed"


def main(argv):
  if len(argv) > 1:
    raise HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")

  text = render()
  dry_run.plan(lambda: [f"{FLAGS.out}: {len(text.splitlines())} lines, {_change(FLAGS.out, text)}"])
  write_text(FLAGS.out, text)
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  flags.DEFINE_string("out", OUT, "Where to write the fidelity table (markdown).")
  command_line.run(main)
