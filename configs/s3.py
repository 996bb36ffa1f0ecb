"""State tracking: the running product of permutations of 3 items (synthetic/state_tracking.py);
see configs/state_tracking.py."""
from configs import state_tracking

VALUES = state_tracking.values("s3", vocab_size=6)


def get_config(arg=None):
  return state_tracking.task_config(VALUES, arg)
