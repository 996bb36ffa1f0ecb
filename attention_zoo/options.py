"""Typed variant options: declared once, with their types and bounds, validated by one function.

A variant declares each option it accepts, its default and what values are allowed:

    OPTIONS = {"block_size": Int(64, minimum=1),
               "temperature": Float(0.75, above=0),
               "redraw": Bool(True),
               "kernel": Choice("softmax", ("softmax", "relu")),
               "seed": Int(None, minimum=0, optional=True)}      # None: drawn from the rngs

`validate(variant, declared, given)` checks what a caller passes against that declaration and
returns every option's value, defaults filled in. Types are strict where Python is loose: a
bool is never an integer or a number (True is not a block size), numpy integers are integers,
and integers are accepted where a float is. Values come back as plain Python types
(np.int64(16) -> 16, 1 -> 1.0 for a Float). Every rejected value raises the same message:

    <variant>: option <name>=<value!r> is invalid: expected <what is allowed>

`invalid(...)` builds that error, so a rule a variant checks itself (one relating two options,
or an option and the backend) reads the same.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Mapping

import numpy as np


def invalid(variant: str, name: str, value, expected: str) -> ValueError:
  """The one error shape for a rejected option value (raise what this returns)."""
  return ValueError(f"{variant}: option {name}={value!r} is invalid: expected {expected}")


@dataclasses.dataclass(frozen=True)
class Option:
  """An option's default and the values it allows (None only when `optional`)."""
  default: Any
  optional: bool = dataclasses.field(default=False, kw_only=True)
  python_type: ClassVar[type]   # what a validated value is (for typed config fields)

  def __post_init__(self):
    if self.default is None and not self.optional:
      raise TypeError(f"{self!r}: a default of None needs optional=True")
    if self.default is not None and not self._allows(self.default):
      raise TypeError(f"{self!r}: the default is not {self._describe()}")

  def allows(self, value) -> bool:
    return self.optional if value is None else self._allows(value)

  def normalise(self, value):
    """An allowed value as a plain Python value."""
    return None if value is None else self.python_type(value)

  def describe(self) -> str:
    """What is allowed, for error messages: "an integer >= 1, or None"."""
    return f"{self._describe()}, or None" if self.optional else self._describe()

  def _allows(self, value) -> bool:
    raise NotImplementedError

  def _describe(self) -> str:
    raise NotImplementedError


def _is_integer(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _interval(low, low_closed: bool, high, high_closed: bool) -> str:
  """" >= 0", " > 0", " in [0, 1)", or "" for no bounds."""
  if low is not None and high is not None:
    return f" in {'[' if low_closed else '('}{low}, {high}{']' if high_closed else ')'}"
  if low is not None:
    return f" {'>=' if low_closed else '>'} {low}"
  if high is not None:
    return f" {'<=' if high_closed else '<'} {high}"
  return ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int(Option):
  """An integer (numpy integers too, bools never) in [minimum, maximum]. `where` is a further
  rule on the value and its description: ("odd", lambda n: n % 2 == 1)."""
  minimum: int | None = None
  maximum: int | None = None
  where: tuple[str, Callable[[int], bool]] | None = None
  python_type: ClassVar[type] = int

  def _allows(self, value) -> bool:
    return (_is_integer(value)
            and (self.minimum is None or value >= self.minimum)
            and (self.maximum is None or value <= self.maximum)
            and (self.where is None or bool(self.where[1](int(value)))))

  def _describe(self) -> str:
    rule = "" if self.where is None else f" that is {self.where[0]}"
    return f"an integer{_interval(self.minimum, True, self.maximum, True)}{rule}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float(Option):
  """A finite number (ints too, bools never) within the bounds given: `minimum` / `maximum`
  inclusive, `above` / `below` exclusive (give at most one of each pair)."""
  minimum: float | None = None
  above: float | None = None
  maximum: float | None = None
  below: float | None = None
  python_type: ClassVar[type] = float

  def __post_init__(self):
    if self.minimum is not None and self.above is not None:
      raise TypeError(f"{self!r}: give minimum or above, not both")
    if self.maximum is not None and self.below is not None:
      raise TypeError(f"{self!r}: give maximum or below, not both")
    super().__post_init__()

  def _allows(self, value) -> bool:
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
      return False
    return (math.isfinite(value)
            and (self.minimum is None or value >= self.minimum)
            and (self.above is None or value > self.above)
            and (self.maximum is None or value <= self.maximum)
            and (self.below is None or value < self.below))

  def _describe(self) -> str:
    low_closed, high_closed = self.above is None, self.below is None
    low = self.minimum if low_closed else self.above
    high = self.maximum if high_closed else self.below
    return f"a number{_interval(low, low_closed, high, high_closed)}"


@dataclasses.dataclass(frozen=True)
class Bool(Option):
  """True or False (numpy bools too; never 0 or 1)."""
  python_type: ClassVar[type] = bool

  def _allows(self, value) -> bool:
    return isinstance(value, (bool, np.bool_))

  def _describe(self) -> str:
    return "True or False"


@dataclasses.dataclass(frozen=True)
class Choice(Option):
  """One of a fixed tuple of strings."""
  choices: tuple[str, ...] = ()
  python_type: ClassVar[type] = str

  def __post_init__(self):
    if not self.choices or not all(isinstance(c, str) for c in self.choices):
      raise TypeError(f"{self!r}: choices must be a non-empty tuple of strings")
    super().__post_init__()

  def _allows(self, value) -> bool:
    return isinstance(value, str) and value in self.choices

  def _describe(self) -> str:
    return "one of " + ", ".join(map(repr, self.choices))


def validate(variant: str, declared: Mapping[str, Option], given: Mapping[str, Any]) -> dict:
  """Every declared option's value: `given` where passed (checked, normalised), else the default.

  ValueError for an option that is not declared (listing those that are) or a value the
  declaration does not allow (`invalid`'s message).
  """
  unknown = sorted(set(given) - set(declared))
  if unknown:
    raise ValueError(f"{variant}: unknown option(s) {', '.join(unknown)}; accepted: "
                     + ", ".join(f"{k}={o.default!r}" for k, o in sorted(declared.items())))
  values = {}
  for name, option in declared.items():
    if name not in given:
      values[name] = option.default
    elif option.allows(given[name]):
      values[name] = option.normalise(given[name])
    else:
      raise invalid(variant, name, given[name], option.describe())
  return values
