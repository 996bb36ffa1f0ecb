"""From a task config to the model it describes: the one place where an LRA model is defined,
for the trainer and the benchmark alike.

Values that depend on the attention variant are resolved here, when the model is built, not when
the config is created (configs/lra/common.py, `resolve_attention`): so an override of the
attention, of one of its options or of `model.max_len` gives what it says.
"""
from __future__ import annotations

import dataclasses

from flax import nnx

import attention_zoo as az
import lra
from attention_zoo.models import (BottleneckLM, Classifier, DecoderLM, DualEncoderClassifier,
                                  TransformerConfig)
from configs.lra import common


def model_config(config) -> TransformerConfig:
  """The TransformerConfig of `config.model`, with the attention's settings resolved."""
  options, attention_fields = common.resolve_attention(config)
  model = {k: v for k, v in config.model.to_dict().items() if k != "attention_options"}
  model.update(attention_fields)
  model["attention_ignores_padding"] = bool(model["attention_ignores_padding"])
  if not az.spec(model["attention"]).supports_dropout:
    model["attention_dropout_rate"] = 0.0   # the variant forms no attention weights to drop
  return TransformerConfig(**model, attention_options=options)


def model_class(task: str) -> type:
  """A causal DecoderLM for a token task (the diagnostics; a BottleneckLM when the task reads
  every position from the last one, MAD's compression), else a classifier (a dual encoder for
  Retrieval)."""
  spec = lra.task_spec(task)
  if spec.objective == "next_token":
    return BottleneckLM if spec.readout == "last_position" else DecoderLM
  return DualEncoderClassifier if spec.dual else Classifier


def build_model(config, rngs: nnx.Rngs) -> nnx.Module:
  """The model of config.task (see model_class)."""
  return model_class(config.task)(model_config(config), rngs=rngs)


def describe(model: TransformerConfig) -> dict:
  """The resolved model as plain JSON values (for results.json)."""
  return dataclasses.asdict(model)
