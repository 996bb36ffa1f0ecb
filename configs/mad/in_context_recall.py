"""MAD's in-context recall (synthetic.mad) for a causal decoder; see configs/mad/__init__.py."""
from configs import mad

VALUES = mad.values("in_context_recall")


def get_config(arg=None):
  return mad.task_config(VALUES, arg)
