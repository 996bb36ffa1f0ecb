"""MAD's compression (synthetic.mad) for a causal decoder; see configs/mad/__init__.py."""
from configs import mad

VALUES = mad.values("compression")


def get_config(arg=None):
  return mad.task_config(VALUES, arg)
