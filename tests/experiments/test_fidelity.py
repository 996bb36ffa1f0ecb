"""docs/lra_fidelity.md agrees with the configs, and every difference it lists has a reason."""
from pathlib import Path

import pytest

import lra
from configs.lra import common
from experiments import fidelity

DOC = Path(__file__).resolve().parents[2] / fidelity.OUT


def test_the_committed_table_is_the_one_the_configs_generate():
  assert DOC.read_text(encoding="utf-8") == fidelity.render(), (
      "docs/lra_fidelity.md is out of date: run python -m experiments.fidelity")


@pytest.mark.parametrize("task", lra.available_tasks())
def test_every_difference_has_a_reason(task):
  rows = fidelity.rows(task)
  assert {r["variant"] for r in rows} == set(common.LRA_VARIANTS)
  unexplained = [(r["variant"], r["field"], r["released"], r["paper"], r["fair"])
                 for r in rows if fidelity.differs(r) and not r["reason"]]
  assert not unexplained


def test_the_quirks_and_released_settings_are_rows():
  image = {(r["variant"], r["field"]): r for r in fidelity.rows("image")}
  assert image["full", "model.zero_token_is_padding"]["paper"] is True
  assert image["full", "model.zero_token_is_padding"]["fair"] is False
  assert image["full", "model.embed_init_std"]["paper"] == 1.0
  assert image["full", "model.qkv_dim"]["released"] == 64
  assert image["bigbird", "model.num_heads"]["note"]
  assert image["performer", "model.attention_options.kernel"]["paper"] == "relu"
  listops = {(r["variant"], r["field"]): r for r in fidelity.rows("listops")}
  assert listops["performer", "model.attention_options.nb_features"]["paper"] == 2
  assert listops["reformer", "model.attention_options.num_chunks"]["paper"] == 10
  assert listops["longformer", "model.attention_options.num_global_tokens"]["paper"] == 0


def test_light_is_the_released_code_and_light_fair_says_what_each_difference_fixes():
  rows = fidelity.light_rows()
  assert {r["variant"] for r in rows} == set(fidelity.LIGHT_VARIANTS)
  assert not [(r["variant"], r["field"]) for r in rows if fidelity.light_departs(r)]
  assert all(r["source"] for r in rows)   # every value says where the released code sets it
  unexplained = [(r["variant"], r["field"]) for r in rows
                 if not fidelity._same(r["light"], r["light_fair"]) and not r["fix"]]
  assert not unexplained
  by_key = {(r["variant"], r["field"]): r for r in rows}
  performer_scale = by_key["performer", "model.attention_options.scale"]
  assert (performer_scale["released"], performer_scale["light"]) == ("1/head_dim", 1 / 32)
  assert by_key["full", "model.pooling"]["light_fair"] == "mean"
  assert by_key["nystromformer", "model.attention_options.landmarks"]["fix"]
