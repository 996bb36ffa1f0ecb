"""One training at a time in a workdir: an advisory lock (fcntl.flock) on <workdir>/.lock, held
for the run's life. The lock file names its holder (pid, host, start time), so a second run
refuses in one line naming it. The operating system releases a flock when its process ends,
however it ends, so a lock file left by a killed run is stale exactly when its flock can be
taken: the next run takes it over. In a multi-process run only process 0 takes the lock (the
others write nothing of their own into the workdir)."""
from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from absl import logging

from experiments.common.errors import HarnessError

LOCK_FILE = ".lock"


class WorkdirLock:
  """`with WorkdirLock(workdir):` holds the workdir's lock; HarnessError if another process
  holds it. Nested in one process (the entry point's lock around preparing and running, the
  run's own), the inner one does nothing."""

  _held: set[Path] = set()   # the lock files this process holds

  def __init__(self, workdir):
    self.path = (Path(workdir) / LOCK_FILE).absolute()
    self._file = None

  def __enter__(self) -> WorkdirLock:
    if self.path in WorkdirLock._held:
      return self
    self.path.parent.mkdir(parents=True, exist_ok=True)
    file = open(self.path, "a+")  # noqa: SIM115 - held open for the run's life
    try:
      fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      file.seek(0)
      holder = file.read().strip() or "another process"
      file.close()
      raise HarnessError(f"{self.path.parent} is in use by another training ({holder}); wait "
                         "for it to finish or stop it, or train into another workdir") from None
    file.seek(0)
    stale = file.read().strip()
    if stale:   # its holder ended without releasing it (killed): the OS released the flock
      logging.warning("%s: taking over the lock of a run that has ended (%s)", self.path, stale)
    file.seek(0)
    file.truncate()
    file.write(describe_holder() + "\n")
    file.flush()
    self._file = file
    WorkdirLock._held.add(self.path)
    return self

  def __exit__(self, *exc) -> None:
    if self._file is None:   # an inner, nested lock
      return
    WorkdirLock._held.discard(self.path)
    self._file.truncate(0)
    fcntl.flock(self._file, fcntl.LOCK_UN)
    self._file.close()
    self._file = None


def describe_holder() -> str:
  """"pid 123 on host, started 2026-12-07 18:30:00 UTC": this process, as the lock file says."""
  started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
  return f"pid {os.getpid()} on {socket.gethostname()}, started {started}"
