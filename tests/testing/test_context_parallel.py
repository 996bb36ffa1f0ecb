"""Every registered variant and mixer that declares `supports_context_parallel` equals one device
on a mesh splitting its sequence (attention_zoo/testing/context_parallel.py: outputs and all
gradients, three cases). One child process for the whole file: the fast lane runs one
representative name, the slow lane every name."""
from __future__ import annotations

import pytest

import attention_zoo as az
from attention_zoo.testing import context_parallel

# the fast lane's representative of the recurrent mixers
FAST = {"gated_deltanet"}


def _names():
  return [name if name in FAST else pytest.param(name, marks=pytest.mark.slow)
          for name in az.registry.accepting("supports_context_parallel")]


@pytest.fixture(scope="module")
def results(request):
  """The check of every name selected in this session, in one child."""
  names = sorted({item.callspec.params["name"] for item in request.session.items
                  if item.module is request.module and hasattr(item, "callspec")})
  return context_parallel.run_in_child(names)


@pytest.mark.parametrize("name", _names())
def test_context_parallel_equals_one_device(results, name):
  mine = [r for r in results if r.name == name]
  assert len(mine) == len(context_parallel.CASES), mine
  for result in mine:
    assert result.passed, result
