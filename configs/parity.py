"""State tracking: the running parity of bits (synthetic/state_tracking.py);
see configs/state_tracking.py."""
from configs import state_tracking

VALUES = state_tracking.values("parity", vocab_size=2)


def get_config(arg=None):
  return state_tracking.task_config(VALUES, arg)
