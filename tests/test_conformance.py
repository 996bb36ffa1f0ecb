"""The conformance suite over every registered variant and mixer: a new one is tested on
registering."""
import pytest

import attention_zoo as az
from attention_zoo import conformance


@pytest.mark.parametrize("prop", list(conformance.CHECKS))
@pytest.mark.parametrize("name", az.available("attention"))
def test_conformance(name, prop):
  result = conformance.run_check(prop, name)
  assert result.status != "fail", result.describe()


# Every mixer's checks compile its chunked op a dozen times (minutes on 2 cores), so the fast
# lane checks one mixer and the full suite all of them.
FAST_MIXER = "gated_deltanet"


@pytest.mark.parametrize("prop", list(conformance.MIXER_CHECKS))
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == FAST_MIXER else pytest.mark.slow)
                                  for n in az.available("mixer")])
def test_mixer_conformance(name, prop):
  result = conformance.run_check(prop, name)
  assert result.status != "fail", result.describe()
