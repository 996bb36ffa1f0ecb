"""The synthetic diagnostics: token tasks for a causal model, generated in memory from their
settings (no data_dir) and loaded like the LRA tasks, `lra.load("mqar", "train", num_pairs=8)`.
Their targets are int32 [N, L], the token to emit at each position, IGNORED (-1) where nothing
is asked.

  mqar   multi-query associative recall (Zoology)      lra/diagnostics/mqar.py
  MAD    the six tasks of the MAD suite                 lra/diagnostics/mad.py
  parity, s3, s5   state tracking: running parity and  lra/diagnostics/state_tracking.py
         permutation products, tested at longer lengths

A new diagnostic is a module here: a frozen settings dataclass whose fields are its load options,
with `task`, `check(seq_len)` and `generate(seq_len, split)` (-> {"tokens", "lengths",
"targets"}), and a RULES_VERSION; then its entries in SPECS, SETTINGS and GENERATORS below, where
`lra.load`, `lra.provenance` and the harness find it.
"""
from __future__ import annotations

from lra.diagnostics import mad, mqar, state_tracking
from lra.diagnostics.mqar import IGNORED
from lra.spec import TaskSpec


def _token_task(name: str, vocab_size: int, max_len: int, has_padding: bool = False,
                **fields) -> TaskSpec:
  return TaskSpec(name, num_classes=vocab_size, max_len=max_len, vocab_size=vocab_size,
                  dual=False, has_padding=has_padding, objective="next_token", **fields)


# The MAD suite, in the column order of its published table; vocabularies and lengths are MAD's
# baseline settings.
MAD_SPECS = {
    "compression": _token_task("compression", 16, 32, readout="last_position"),
    "fuzzy_in_context_recall": _token_task("fuzzy_in_context_recall", 16, 128),
    "in_context_recall": _token_task("in_context_recall", 16, 128),
    "memorization": _token_task("memorization", 256, 32),
    "noisy_in_context_recall": _token_task("noisy_in_context_recall", 32, 128),
    "selective_copying": _token_task("selective_copying", 16, 256),
}
# State tracking: the vocabulary is the group (its order), max_len the test length (Grazzi et
# al.'s 256); the train split is shorter, padded (lra/diagnostics/state_tracking.py).
STATE_TRACKING_SPECS = {task: _token_task(task, settings().vocab_size, 256, has_padding=True)
                        for task, settings in state_tracking.SETTINGS.items()}
# Every diagnostic's spec. The vocabulary and lengths here are defaults, changed by the load
# options.
SPECS = {"mqar": _token_task("mqar", 512, 64), **MAD_SPECS, **STATE_TRACKING_SPECS}
# Each task's settings: their fields are its load options.
SETTINGS = {"mqar": mqar.Settings, **mad.SETTINGS, **state_tracking.SETTINGS}
# Each task's generator module: its name and RULES_VERSION go into a run's data provenance.
GENERATORS = {"mqar": mqar, **{task: mad for task in mad.SETTINGS},
              **{task: state_tracking for task in state_tracking.SETTINGS}}


def diagnostic_tasks() -> tuple[str, ...]:
  """The diagnostic task names (associative recall, the MAD suite, state tracking)."""
  return tuple(SPECS)


def mad_tasks() -> tuple[str, ...]:
  """The six MAD task names, in the column order of the MAD table."""
  return tuple(MAD_SPECS)


def state_tracking_tasks() -> tuple[str, ...]:
  """The state-tracking task names: parity, s3, s5."""
  return tuple(STATE_TRACKING_SPECS)


__all__ = ["GENERATORS", "IGNORED", "MAD_SPECS", "SETTINGS", "SPECS", "STATE_TRACKING_SPECS",
           "diagnostic_tasks", "mad", "mad_tasks", "mqar", "state_tracking",
           "state_tracking_tasks"]
