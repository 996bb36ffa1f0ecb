"""MAD's selective copying (synthetic.mad) for a causal decoder; see configs/mad/__init__.py."""
from configs import mad

VALUES = mad.values("selective_copying")


def get_config(arg=None):
  return mad.task_config(VALUES, arg)
