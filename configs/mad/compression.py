"""MAD's compression (lra.mad) for a causal decoder; see configs/mad/__init__.py."""
from configs import mad

ATTENTION_SETTINGS = mad.ATTENTION_SETTINGS


def get_config(arg=None):
  return mad.task_config("compression", arg)
