"""Fixtures the harness's tests share."""
import pytest

import lra


@pytest.fixture(scope="module")
def listops_dir(tmp_path_factory):
  """A small generated ListOps release, for runs through the trainer."""
  root = tmp_path_factory.mktemp("listops")
  lra.generate_listops(root, num_train=24, num_val=8, num_test=8, min_length=4, max_length=30,
                       progress=False)
  return root
