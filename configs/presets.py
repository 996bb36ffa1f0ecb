"""How a task file's get_config makes the whole run: layers of values in dotted config fields
(the task's, the preset's, the variant's settings), applied in order, then the token-counted
attention options scaled to the run's model.max_len. Each field's source is kept in the config
(`config.made.sources`), so a dry run can say where every value came from. Imports nothing of
the project: the task files (configs/lra/common.py, configs/mad, configs/mqar.py,
configs/state_tracking.py) give it their tables.

`config.made` records what get_config applied, for the harness's one check step
(experiments/train/build.py `check`):
  variant       the variant whose settings were applied: a config whose model.attention names
                another is refused (name the variant in the config argument instead).
  task_len      the task's own length, to which the declared token-counted options refer.
  scaled_for    the model.max_len the options were scaled to; when model.max_len is set after
                get_config, the check step scales them again from `declared`.
  declared      the token-counted options as the variant's settings declare them (task length).
  sources       {source: [dotted fields]}: which layer set each field last.
"""
from __future__ import annotations

import difflib

import ml_collections

OPTIONS = "model.attention_options."


def attention_options(**options) -> dict:
  """A variant's options as config fields: {"model.attention_options.<name>": value}."""
  return {OPTIONS + name: value for name, value in options.items()}


# Attention options measured in tokens, with the smallest value a shortened sequence scales them
# to: a block or window then covers the same fraction of the sequence as at the task's length.
LENGTH_OPTIONS = {"block_size": 4, "window": 4, "chunk_len": 4, "chunk_size": 4,
                  "query_chunk": 4, "num_summary": 1}
# The source a value set after get_config is shown with (the dry run, results.json).
COMMAND_LINE = "command line"


def unknown_preset(task: str, preset: str, presets) -> ValueError:
  """The one wording of a misspelt or missing preset, for every task and command."""
  close = difflib.get_close_matches(preset, presets, n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  return ValueError(f"{task} has no preset {preset!r}{hint}; its presets: {', '.join(presets)}")


def parse_arg(task: str, arg: str | None, presets) -> tuple[str, str]:
  """"<variant>[,<preset>]" -> (variant, preset); "full" when no variant is named, and the
  first of `presets` (the task's default) when no preset is."""
  parts = [p.strip() for p in (arg or "full").split(",")]
  if len(parts) > 2 or not parts[0]:
    raise ValueError(f"config argument {arg!r}: expected '<attention>[,<preset>]', "
                     f"e.g. 'performer,{presets[-1]}'")
  variant, preset = parts[0], parts[1] if len(parts) == 2 else presets[0]
  if preset not in presets:
    raise unknown_preset(task, preset, presets)
  return variant, preset


def apply(config: ml_collections.ConfigDict, layers, *, task_len: int
          ) -> ml_collections.ConfigDict:
  """Sets `layers` ([(source, {dotted field: value})], in order, later ones winning) on
  `config`, scales the token-counted options to config.model.max_len and records it all in
  config.made (see the module docstring)."""
  sources: dict[str, str] = {}
  for source, fields in layers:
    set_fields(config, fields)
    sources.update(dict.fromkeys(fields, source))
  options = config.model.attention_options
  declared = {name: options[name] for name in LENGTH_OPTIONS if _counts_tokens(options.get(name))}
  scaled = scale_length_options(declared, config.model.max_len / task_len)
  for name, value in scaled.items():
    if value != declared[name]:
      options[name] = value
      sources[OPTIONS + name] = f"{sources[OPTIONS + name]}, scaled to max_len"
  by_source: dict[str, list[str]] = {}
  for field, source in sources.items():
    by_source.setdefault(source, []).append(field)
  config.made = ml_collections.ConfigDict({
      "variant": config.model.attention, "task_len": task_len,
      "scaled_for": config.model.max_len, "declared": declared,
      "sources": {source: sorted(fields) for source, fields in by_source.items()}})
  return config


def source_of(config, field: str) -> str | None:
  """The layer that set `field` in get_config (config.made.sources), or None."""
  for source, fields in config.made.sources.items():
    if field in fields:
      return source
  return None


def _counts_tokens(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def scale_length_options(options: dict, ratio: float) -> dict:
  """Token-counted options times `ratio` (rounded, at least LENGTH_OPTIONS' minimum)."""
  if ratio >= 1:
    return dict(options)
  scaled = dict(options)
  for name, minimum in LENGTH_OPTIONS.items():
    if _counts_tokens(options.get(name)):
      scaled[name] = max(minimum, round(options[name] * ratio))
  return scaled


def set_fields(config: ml_collections.ConfigDict, fields: dict) -> None:
  """config.<dotted> = value for each item; a missing last part is added (data.*, generate.*)."""
  for dotted, value in fields.items():
    node, name = parent_and_name(config, dotted)
    node[name] = value


def parent_and_name(config: ml_collections.ConfigDict, dotted: str):
  """"model.attention_options.scale" -> (config.model.attention_options, "scale")."""
  *parents, name = dotted.split(".")
  node = config
  for parent in parents:
    node = node[parent]
  return node, name
