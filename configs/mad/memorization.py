"""MAD's memorization (synthetic.mad) for a causal decoder; see configs/mad/__init__.py."""
from configs import mad

VALUES = mad.values("memorization")


def get_config(arg=None):
  return mad.task_config(VALUES, arg)
