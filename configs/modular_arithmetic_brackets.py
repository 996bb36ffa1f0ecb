"""Modular arithmetic with brackets, as Grazzi et al.'s released code generates it
(synthetic/formal_languages.py); see configs/formal_languages.py."""
from configs import formal_languages

VALUES = formal_languages.values("modular_arithmetic_brackets")


def get_config(arg=None):
  return formal_languages.task_config(VALUES, arg)
