"""MAD's fuzzy in-context recall (synthetic.mad), a causal LM; see configs/mad/__init__.py."""
from configs import mad

VALUES = mad.values("fuzzy_in_context_recall")


def get_config(arg=None):
  return mad.task_config(VALUES, arg)
