"""What a task's config file declares: the protocol every task config follows.

A task config file (configs/lra/<task>.py, configs/mad/<task>.py, configs/<diagnostic>.py)
provides two names:

    VALUES = TaskValues(...)   # its values, declared once (below)
    def get_config(arg=None)   # its ConfigDict for "<attention>[,<preset>]" (ml_collections)

`get_config` returns the whole run: the task's values, the preset's and the variant's settings,
applied by configs/presets.py (which keeps each field's source); the harness only checks it and
builds from it (experiments/train/build.py), and experiments/fidelity.py tabulates VALUES. Like
every file under configs/, this one imports nothing from the project outside configs/.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TaskValues:
  """A task's values, every table in dotted config field names (`model.emb_dim`,
  `model.attention_options.block_size`, ...).

  task: the task's name, as lra.task_spec knows it.
  fields: what the task sets under every preset (an LRA task: its vocabulary and classes).
  released: an LRA task: what the released LRA code ran, its base config as "shared", then what
      each model's file changes: {"shared": {...}, "<variant>": {...}}. None for a diagnostic.
  paper_changes: {"<variant>": {field: (value, reason)}}: where the `paper` preset departs from
      the released value, and why (the released value cannot run, or its authors corrected it).
  tiny: the tiny preset's values on top of the fair ones.
  light: an LRA task run under the Nyströmformer paper's light protocol: {"shared": {...},
      "<variant>": {...}}, each {field: (value, where the released light code sets it)}.
  light_fixes: what the light_fair preset fixes, {"shared" | "<variant>": {field: (value, the
      quirk fixed)}}.
  length: the task's own sequence length (lra.task_spec's max_len), to which the token-counted
      attention options of the variants' settings refer; an LRA task's is its released
      model.max_len.
  attention_settings: a diagnostic's attention settings per variant, {"<variant>": {field:
      value}}, in every preset. An LRA task takes its variants' settings from the presets'
      tables (configs/lra/common.py) and from `released`.
  """

  task: str
  fields: dict = dataclasses.field(default_factory=dict)
  released: dict | None = None
  paper_changes: dict = dataclasses.field(default_factory=dict)
  tiny: dict = dataclasses.field(default_factory=dict)
  light: dict | None = None
  light_fixes: dict = dataclasses.field(default_factory=dict)
  attention_settings: dict = dataclasses.field(default_factory=dict)
  length: int = 0

  def __post_init__(self):
    if self.released is not None and "shared" not in self.released:
      raise ValueError(f"{self.task}: released needs its base config under 'shared'")
    if self.released is not None and self.attention_settings:
      raise ValueError(f"{self.task}: an LRA task (with released values) takes its attention "
                       "settings from the presets' tables, not attention_settings")

  @property
  def max_len(self) -> int:
    """The task's own length (see `length`)."""
    if self.is_lra:
      return self.released["shared"]["model.max_len"]
    if not self.length:
      raise ValueError(f"{self.task}: a diagnostic declares its length (TaskValues.length)")
    return self.length

  @property
  def is_lra(self) -> bool:
    """An LRA task: the presets paper, fair and tiny come from its released values."""
    return self.released is not None
