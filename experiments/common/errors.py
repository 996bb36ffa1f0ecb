"""One-line errors: a mistake on the command line (an unknown attention, task, preset or config
field, a plug-in that does not import, missing data) prints one line `error: ...` naming it and
the valid choices, and the command exits with status 1; Ctrl-C, one line and status 130. Bugs
still raise with a traceback."""
from __future__ import annotations

import contextlib
import difflib
import signal
import sys
import threading


class HarnessError(Exception):
  """An error the user can fix; entry points print its message as one line."""


class Interrupted(KeyboardInterrupt):
  """Ctrl-C during a training run. Its message says where the run stopped (the step, the last
  checkpoint); the entry point prints it in one line with the command that resumes the run. A
  KeyboardInterrupt, so that what stops at Ctrl-C (a grid, `except Exception`) stops at it."""


class CtrlC:
  """Ctrl-C taken where the code asks for it (`check()`, between training steps) instead of
  wherever Python happens to be. Python's own handler raises KeyboardInterrupt in whatever runs
  at that moment; inside a garbage-collection callback (JAX registers one) the exception is
  printed as "ignored" and dropped, and the run trains on: CI saw exactly that. Here the first
  Ctrl-C is recorded and raised at the next `check()`; a second one raises at once, for code
  that never reaches a check. Outside the main thread (where no handler can be installed) it
  leaves Python's handler alone."""

  def __init__(self):
    self.requested = False

  def _record(self, signum, frame):
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True

  def check(self) -> None:
    if self.requested:
      self.requested = False
      raise KeyboardInterrupt

  @contextlib.contextmanager
  def deferred(self):
    if threading.current_thread() is not threading.main_thread():
      yield self
      return
    previous = signal.signal(signal.SIGINT, self._record)
    try:
      yield self
    finally:
      signal.signal(signal.SIGINT, previous)
    self.check()   # one that arrived after the last check still stops the caller


def fail(message: str) -> None:
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
  sys.exit(1)


def first_line(error: BaseException, limit: int = 300) -> str:
  """The first line of an error's message (at most `limit` characters), or its type's name
  when it has none."""
  text = str(error).strip()
  return text.splitlines()[0][:limit] if text else type(error).__name__


def did_you_mean(word: str, choices) -> str:
  """" (did you mean 'x'?)" for the closest of `choices`, or "" when none is close."""
  close = difflib.get_close_matches(word, list(choices), n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""
