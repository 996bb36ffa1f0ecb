"""Overrides of a config's fields from the command line (`--config.<field>=value` in train,
`--override=<field>=value` in reproduce and sweep, `--tune=<field>=...`): each value parsed as
its field's type, a misspelt field named with the closest valid one."""
from __future__ import annotations

import ast

from configs.presets import parent_and_name
from experiments.common.errors import HarnessError, did_you_mean

# Config fields fixed by the config file (the task) and its argument (the preset): an override
# would leave every value they chose behind, so it is refused.
FIXED_FIELDS = {"task": "the config file is the task: --config=configs/lra/<task>.py:...",
                "preset": "the preset is part of the config argument: "
                          "--config=configs/lra/<task>.py:<attention>,<preset>",
                # get_config applied the variant's settings (configs/presets.py)
                "model.attention": "the variant is part of the config argument, which applies "
                                   "its settings: --config=configs/lra/<task>.py:<attention>,"
                                   "<preset>",
                "made": "config.made records what get_config applied (configs/presets.py)"}
# The variant's options: an open set of names (the variant's, known once it is imported),
# checked when the model is built.
OPTIONS_FIELD = "model.attention_options"


def check_not_fixed(field: str) -> None:
  """HarnessError if `field` (dotted) is one that only the config file or argument sets."""
  group = field.split(".")[0]
  if field in FIXED_FIELDS or group in FIXED_FIELDS:
    raise HarnessError(f"config.{field} cannot be overridden: "
                       f"{FIXED_FIELDS.get(field, FIXED_FIELDS.get(group))}")


def unknown_field(config, dotted: str) -> str | None:
  """None if `config.<dotted>` exists (any name under model.attention_options), else a message
  naming the closest and the valid fields at that level."""
  if dotted.startswith(f"{OPTIONS_FIELD}."):
    dotted = OPTIONS_FIELD
  node, walked = config, []
  for part in dotted.split("."):
    keys = list(node.keys()) if hasattr(node, "keys") else []
    if part not in keys:
      where = "config" + "".join(f".{w}" for w in walked)
      return (f"unknown config field {dotted!r}: {where} has no field {part!r}"
              f"{did_you_mean(part, keys)}; its fields: {', '.join(sorted(keys)) or '(none)'}")
    node, walked = node[part], walked + [part]
  return None


def set_field(config, dotted: str, text: str) -> None:
  """config.<dotted> = field_value(config, dotted, text): "model.num_layers", "2" -> 2."""
  value = field_value(config, dotted, text)
  node, name = parent_and_name(config, dotted)
  with node.unlocked():
    node[name] = value


def field_value(config, dotted: str, text: str):
  """Command-line text for config.<dotted>, parsed as the field's type; HarnessError naming the
  field (the closest if it is unknown). A name under model.attention_options is new to the
  config: its value is read as a Python literal (8, 0.5, true, "relu"), and the variant checks
  it when the model is built."""
  check_not_fixed(dotted)
  problem = unknown_field(config, dotted)
  if problem:
    raise HarnessError(problem)
  node, name = parent_and_name(config, dotted)
  is_option = dotted.rpartition(".")[0] == OPTIONS_FIELD
  try:
    return parse_value(text, None if is_option else node.get_type(name))
  except (ValueError, TypeError, SyntaxError) as e:
    raise HarnessError(f"{dotted}={text}: {e}") from None


def parse_value(text: str, kind: type | None):
  """Command-line text as a value of `kind` (a None placeholder keeps its type); for no kind, a
  Python literal, or the text itself."""
  if kind is bool or (kind is None and text.lower() in ("true", "false")):
    if text.lower() not in ("true", "false", "1", "0"):
      raise ValueError("expected true or false")
    return text.lower() in ("true", "1")
  if kind in (int, float, str):
    return kind(text)
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    if kind is None:
      return text
    raise
