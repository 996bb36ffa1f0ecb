"""Parity, as Grazzi et al.'s released code generates it
(synthetic/formal_languages.py); see configs/formal_languages.py."""
from configs import formal_languages

VALUES = formal_languages.values("parity_check")


def get_config(arg=None):
  return formal_languages.task_config(VALUES, arg)
