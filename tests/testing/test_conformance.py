"""The conformance suite over every registered variant and mixer: a new one is tested on
registering."""
import pytest

import attention_zoo as az
from attention_zoo.testing import conformance


@pytest.mark.parametrize("prop", list(conformance.CHECKS))
@pytest.mark.parametrize("name", az.available("attention"))
def test_conformance(name, prop):
  result = conformance.run_check(prop, name)
  assert result.status != "fail", result.describe()


# The fast lane checks the representative names only (tests/conftest.py).
@pytest.mark.parametrize("prop", list(conformance.MIXER_CHECKS))
@pytest.mark.parametrize("name", az.available("mixer"))
def test_mixer_conformance(name, prop):
  result = conformance.run_check(prop, name)
  assert result.status != "fail", result.describe()
