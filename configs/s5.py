"""State tracking: the running product of permutations of 5 items (synthetic/state_tracking.py);
see configs/state_tracking.py."""
from configs import state_tracking

VALUES = state_tracking.values("s5", vocab_size=120)


def get_config(arg=None):
  return state_tracking.task_config(VALUES, arg)
