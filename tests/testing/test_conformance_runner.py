"""`python -m attention_zoo.conformance`: plug-ins from outside the package, the report, the exit
code.

One plug-in source with one bug switched in at a time: the correct version passes, and each bug
fails exactly the property it breaks (a future leak, ignored padding, NaN on rows that see no key).
"""
import os
import subprocess
import sys
import textwrap

import pytest

import attention_zoo as az
from attention_zoo.testing import conformance
from attention_zoo.variants.local import LocalAttention

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PLUGIN = '''
import jax
import jax.numpy as jnp
import attention_zoo as az
from attention_zoo import reference


@az.register({name!r}, exact=False, supports_causal=True, supports_cross=True,
             complexity="O(n²)", paper="a test plug-in")
class Plugin(az.Attention):
  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
{body}
'''

BODIES = {
    "correct": """
    return reference.masked_softmax_attention(q, k, v, q_mask=q_mask, kv_mask=kv_mask,
                                              causal=self.causal, scale=self.scale)""",
    # Claims causal (supports_causal=True) but always attends to every key.
    "leaks_future": """
    return reference.masked_softmax_attention(q, k, v, q_mask=q_mask, kv_mask=kv_mask,
                                              scale=self.scale)""",
    # Never looks at kv_mask: padded keys get weight.
    "ignores_padding": """
    return reference.masked_softmax_attention(q, k, v, q_mask=q_mask, causal=self.causal,
                                              scale=self.scale)""",
    # softmax over -inf scores: a row that may see no key gives exp(-inf + inf) = NaN.
    "nan_on_masked_rows": """
    grouped = reference.group_heads(q, self.num_kv_heads)                    # [b, q, kvh, g, d]
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, k) * self.scale     # [b, kvh, g, q, k]
    q_len, kv_len = q.shape[1], k.shape[1]
    allowed = kv_mask[:, None, None, None, :]
    if self.causal:
      allowed = allowed & reference.causal_allowed(jnp.arange(q_len)[:, None], jnp.arange(kv_len),
                                                   q_len, kv_len)
    weights = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhgqk,bkhd->bqhgd", weights, v).reshape(q.shape)""",
}
FAILS = {"correct": None, "leaks_future": "causal", "ignores_padding": "padding",
         "nan_on_masked_rows": "masked_rows"}


def write_plugin(folder, bug):
  name = f"plugin_{bug}"
  body = textwrap.indent(textwrap.dedent(BODIES[bug]).strip("\n"), "    ")
  (folder / f"{name}.py").write_text(PLUGIN.format(name=name, body=body))
  return name


@pytest.fixture
def scratch(tmp_path, monkeypatch):
  """A folder on sys.path for plug-ins; their registrations and modules are removed afterwards."""
  monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
  with az.scoped_registry():
    yield tmp_path
  for name, module in list(sys.modules.items()):   # also modules that registered nothing
    if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
      del sys.modules[name]


def run_cli(args, cwd):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("PYTHONPATH", None)   # the module must be found from the working directory alone
  return subprocess.run([sys.executable, "-m", "attention_zoo.conformance", *args], cwd=cwd,
                        env=env, capture_output=True, text=True, timeout=600)


def status_lines(report):
  """{property: status} from the report lines `  PASS padding  err=...`."""
  lines = [line.split() for line in report.splitlines() if line.startswith("  ")]
  return {words[1]: words[0] for words in lines}


CHECKED = ["padding", "causal", "masked_rows"]


@pytest.mark.parametrize("bug", list(BODIES))
def test_each_bug_fails_exactly_its_property(bug, scratch, capsys):
  module = write_plugin(scratch, bug)
  code = conformance.main([module, f"--checks={','.join(CHECKED)}"])
  report = capsys.readouterr().out
  broken = FAILS[bug]
  expected = {prop: "FAIL" if prop == broken else "PASS" for prop in CHECKED}
  assert status_lines(report) == expected, report
  assert code == (1 if broken else 0), report
  if broken:
    assert report.strip().endswith(f"1 failed: {module}.{broken}"), report


def test_a_leaky_plugin_in_the_working_directory_fails_from_the_command_line(tmp_path):
  module = write_plugin(tmp_path, "leaks_future")
  result = run_cli([module, "--checks=causal"], cwd=tmp_path)
  assert result.returncode == 1, result.stdout + result.stderr
  assert "FAIL causal" in result.stdout and "changing later tokens" in result.stdout, result.stdout
  assert f"0 passed, 0 not applicable, 1 failed: {module}.causal" in result.stdout
  assert "RuntimeWarning" not in result.stderr, result.stderr   # the package did not import it


def test_the_example_plugin_passes_every_property_from_its_path():
  """examples/cosine_attention.py, outside the package, given as a path: the whole suite."""
  result = run_cli(["examples/cosine_attention.py"], cwd=REPO)
  assert result.returncode == 0, result.stdout + result.stderr
  statuses = status_lines(result.stdout)
  assert set(statuses) == set(conformance.CHECKS), result.stdout
  # approximate, no decoding or sinks claimed
  assert statuses["exact"] == statuses["decode"] == statuses["sinks"] == "N/A"
  assert all(status == "PASS" for prop, status in statuses.items()
             if prop not in ("exact", "decode", "sinks"))
  assert result.stdout.startswith("cosine  (approximate, O(n²), causal, cross) "
                                  "with init_temperature=0.5\n")   # its TEST_OPTIONS applied


def test_builtin_modules(capsys):
  code = conformance.main(["attention_zoo.variants.full", "attention_zoo.variants.nystromformer",
                           "--checks=padding,causal"])
  report = capsys.readouterr().out
  assert code == 0, report
  assert "full  (exact, O(n²), causal, cross, decode)" in report
  assert "nystromformer  (approximate, O(n·m))" in report
  assert "N/A  causal        spec says supports_causal=False" in report    # nystromformer's
  assert report.strip().endswith("3 passed, 1 not applicable, 0 failed")


def test_usage_errors_exit_2(scratch, capsys):
  (scratch / "plain_module.py").write_text("X = 1\n")
  assert conformance.main(["no_such_module_anywhere"]) == 2
  assert "cannot import 'no_such_module_anywhere'" in capsys.readouterr().err
  assert conformance.main(["plain_module"]) == 2
  assert "'plain_module' registers no attention variant" in capsys.readouterr().err
  assert conformance.main(["attention_zoo.variants.full", "--checks=padding,nope"]) == 2
  assert "unknown check(s) nope; choose from shapes" in capsys.readouterr().err
  assert conformance.main(["--checks=padding"]) == 2
  assert "name at least one module" in capsys.readouterr().err


CONTENT_ROUTED = '''
import jax.numpy as jnp
import attention_zoo as az
from attention_zoo import reference


@az.register("routed", exact=False, supports_causal=True, supports_cross=False,
             complexity="O(n²)", paper="a test plug-in")
class Routed(az.Attention):
  """Causal attention whose keys also depend on a future query, as content routing may: outputs
  before t do not depend on the values at t and after, but do on the queries there."""
  OPTIONS = {"block_size": az.Int(64, minimum=1)}
  TEST_OPTIONS = {"block_size": 4}
  CONTENT_ROUTING = {content_routing}

  def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
    assert self.options["block_size"] == 4, "the suite builds it with its settings"
    k = k * (1 + jnp.mean(q ** 2, axis=(1, 2, 3)))[:, None, None, None]   # every query's norm
    return reference.masked_softmax_attention(q, k, v, q_mask=q_mask, kv_mask=kv_mask,
                                              causal=self.causal, scale=self.scale)
'''


@pytest.mark.parametrize("content_routing", [True, False])
def test_a_plugin_declares_its_suite_settings(content_routing, scratch, capsys):
  """Class attributes: TEST_OPTIONS, the options the suite builds it with, and CONTENT_ROUTING
  for causality; the plug-in imports nothing of the suite."""
  (scratch / "routed_plugin.py").write_text(
      CONTENT_ROUTED.replace("{content_routing}", str(content_routing)))
  code = conformance.main(["routed_plugin", "--checks=shapes,causal"])
  report = capsys.readouterr().out
  assert status_lines(report) == {"shapes": "PASS",
                                  "causal": "PASS" if content_routing else "FAIL"}, report
  assert code == (0 if content_routing else 1)
  assert conformance.settings("routed") == conformance.Settings({"block_size": 4}, content_routing)


def test_registration_checks_the_test_options(scratch):
  class TooSmall(LocalAttention):
    TEST_OPTIONS = {"block_size": 0}

  with pytest.raises(ValueError, match=r"too_small \(TEST_OPTIONS\): option block_size=0 is "
                                       r"invalid"):
    az.register("too_small", exact=True, supports_causal=True, supports_cross=True,
                complexity="O(n·b)", paper="-")(TooSmall)
  assert "too_small" not in az.available()
  with pytest.raises(ValueError, match="unknown attention or mixer 'not_registered'"):
    conformance.settings("not_registered")
  assert conformance.settings("local").options == {"block_size": 6}    # its own, unchanged
