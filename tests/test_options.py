"""Typed options: one declaration per option, one validation, one message shape for every
variant."""
import re

import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo.options import Bool, Choice, Float, Int, invalid, validate

DECLARED = {"block_size": Int(8, minimum=1), "seed": Int(None, minimum=0, optional=True),
            "odd": Int(3, minimum=1, where=("odd", lambda n: n % 2 == 1)),
            "rate": Float(0.0, minimum=0, below=1), "temperature": Float(1.0, above=0),
            "flag": Bool(True), "mode": Choice("a", ("a", "b"))}


@pytest.mark.parametrize("option, expected", [
    (Int(8, minimum=1), "an integer >= 1"),
    (Int(8), "an integer"),
    (Int(5, minimum=0, maximum=10), "an integer in [0, 10]"),
    (Int(None, minimum=0, optional=True), "an integer >= 0, or None"),
    (Int(3, minimum=1, where=("odd", lambda n: n % 2 == 1)), "an integer >= 1 that is odd"),
    (Float(0.0, minimum=0, below=1), "a number in [0, 1)"),
    (Float(1.0, above=0), "a number > 0"),
    (Float(None, above=0, optional=True), "a number > 0, or None"),
    (Float(0.5, above=0, maximum=1), "a number in (0, 1]"),
    (Float(-2.0), "a number"),
    (Bool(False), "True or False"),
    (Choice("a", ("a", "b")), "one of 'a', 'b'"),
])
def test_what_each_option_allows_is_described(option, expected):
  assert option.describe() == expected


def test_validate_fills_defaults_and_normalises_types():
  values = validate("v", DECLARED, {"block_size": np.int64(16), "seed": np.int32(0),
                                    "temperature": 2, "flag": np.bool_(False),
                                    "rate": np.float32(0.5)})
  assert values == {"block_size": 16, "seed": 0, "odd": 3, "rate": 0.5, "temperature": 2.0,
                    "flag": False, "mode": "a"}
  assert ([type(values[k]) for k in ("block_size", "seed", "temperature", "flag")]
          == [int, int, float, bool])
  assert validate("v", DECLARED, {"seed": None})["seed"] is None


@pytest.mark.parametrize("name, value, expected", [
    ("block_size", True, "an integer >= 1"),            # a bool is never an integer
    ("block_size", 2.0, "an integer >= 1"),             # nor is a float, however round
    ("block_size", 0, "an integer >= 1"),
    ("block_size", None, "an integer >= 1"),            # None only where optional
    ("seed", -1, "an integer >= 0, or None"),
    ("odd", 4, "an integer >= 1 that is odd"),
    ("rate", 1.0, "a number in [0, 1)"),
    ("rate", False, "a number in [0, 1)"),
    ("temperature", 0, "a number > 0"),
    ("temperature", float("nan"), "a number > 0"),
    ("temperature", "1.0", "a number > 0"),
    ("flag", 1, "True or False"),
    ("mode", "c", "one of 'a', 'b'"),
    ("mode", 0, "one of 'a', 'b'"),
])
def test_validate_rejects_with_one_message_shape(name, value, expected):
  message = f"v: option {name}={value!r} is invalid: expected {expected}"
  assert str(invalid("v", name, value, expected)) == message
  with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
    validate("v", DECLARED, {name: value})


def test_unknown_options_are_listed_with_the_accepted_ones():
  with pytest.raises(ValueError, match=r"^v: unknown option\(s\) bogus, other; accepted: "
                                       r"block_size=8, flag=True, mode='a', odd=3, rate=0.0, "
                                       r"seed=None, temperature=1.0$"):
    validate("v", DECLARED, {"bogus": 1, "other": 2})


@pytest.mark.parametrize("make, message", [
    (lambda: Int(None), "a default of None needs optional=True"),
    (lambda: Int(0, minimum=1), "the default is not an integer >= 1"),
    (lambda: Float(0.5, minimum=0, above=0), "give minimum or above, not both"),
    (lambda: Choice("a", ()), "choices must be a non-empty tuple of strings"),
    (lambda: Choice("c", ("a", "b")), "the default is not one of 'a', 'b'"),
])
def test_bad_declarations_fail_where_they_are_written(make, message):
  with pytest.raises(TypeError, match=re.escape(message)):
    make()


# -- every registered variant, every option ----------------------------------------------------

def build(name, **options):
  if az.spec(name).kind == "mixer":
    return az.create_mixer(name, emb_dim=16, num_heads=2, max_len=16, rngs=nnx.Rngs(0),
                           **options)
  return az.create(name, num_heads=2, head_dim=8, max_len=16, rngs=nnx.Rngs(0),
                   causal=not az.spec(name).supports_bidirectional, **options)


def wrong_values(option):
  """Values of the wrong type, and below the lower bound where there is one."""
  if isinstance(option, Choice):
    return ["no_such_choice", 1]
  if isinstance(option, Bool):
    return ["yes", 1]
  wrong = ["a string", True]
  if isinstance(option, Int):
    wrong.append(2.0)
  low = getattr(option, "minimum", None)
  low = getattr(option, "above", None) if low is None else low
  if low is not None and low >= 0:
    wrong.append(-1)
  return wrong


ALL_OPTIONS = [(name, option) for name in az.available() for option in az.spec(name).options]


@pytest.mark.parametrize("name, option", ALL_OPTIONS)
def test_every_option_rejects_wrong_values_naming_variant_option_and_what_is_allowed(name, option):
  declared = az.spec(name).option_specs[option]
  for value in wrong_values(declared):
    expected = (f"{name}: option {option}={value!r} is invalid: "
                f"expected {declared.describe()}")
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
      build(name, **{option: value})


INT_OPTIONS = [(name, option) for name, option in ALL_OPTIONS
               if az.spec(name).option_types[option] is int]


@pytest.mark.parametrize("name, option", INT_OPTIONS)
def test_numpy_integers_are_integers(name, option):
  declared = az.spec(name).option_specs[option]
  value = declared.default if declared.default is not None else max(1, declared.minimum or 0)
  attn = build(name, **{option: np.int64(value)})
  assert attn.options[option] == value and type(attn.options[option]) is int


def test_every_option_has_a_type_also_when_its_default_is_none():
  for name in az.available():
    spec = az.spec(name)
    assert set(spec.option_types) == set(spec.options)
    assert set(spec.option_types.values()) <= {int, float, bool, str}
  assert az.spec("reformer").option_types["n_buckets"] is int
  assert az.spec("bigbird").option_types["seed"] is int
  assert az.spec("flash").option_types["block_q"] is int
  assert az.spec("full").option_types["scale"] is float
  assert az.spec("full").options == {"scale": None, "dropout_rate": 0.0, "impl": "auto",
                                     "softcap": None, "sink": False}
  assert az.spec("full").option_types["softcap"] is float
  assert az.spec("full").option_types["sink"] is bool


def test_ints_are_accepted_for_floats():
  attn = build("full", scale=1)
  assert attn.scale == 1.0 and type(attn.scale) is float


@pytest.mark.parametrize("name, options, message", [
    ("sparse_transformer", dict(block_size=4, num_summary=5),
     r"option num_summary=5 is invalid: expected an integer <= block_size \(4\)"),
    ("performer", dict(features="deterministic"),
     r"option features='deterministic' is invalid: expected 'random' with kernel='softmax'"),
    ("performer", dict(kernel="relu", features="deterministic", nb_features=64),
     r"option nb_features=64 is invalid: expected no nb_features with features='deterministic'"),
    ("reformer", dict(chunk_len=8, num_chunks=2),
     r"option num_chunks=2 is invalid: expected None when chunk_len is given \(chunk_len=8\)"),
    ("linear_transformer", dict(scale=0.5), r"option scale=0.5 is invalid: expected None \("),
    ("flash", dict(dropout_rate=0.1), r"option dropout_rate=0.1 is invalid: expected 0 \("),
    ("flash", dict(impl="pallas", block_k=24),
     r"option block_k=24 is invalid: expected a power of two .*for impl='pallas'"),
])
def test_rules_relating_options_raise_in_the_same_shape(name, options, message):
  with pytest.raises(ValueError, match=f"^{name}: {message}"):
    build(name, **options)
