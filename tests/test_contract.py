"""Registry, contract, plug-in loader, reference and the face: the public contract every variant and
plug-in relies on."""
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attention_zoo as az
from attention_zoo import plugins, reference
from helpers import random_qkv

PACKAGE = Path(az.__file__).parent


@pytest.fixture
def scratch_registry():
  """Lets a test register variants and removes them afterwards."""
  with az.scoped_registry():
    yield


def test_available_is_sorted_and_has_full():
  names = az.available()
  assert list(names) == sorted(names) and "full" in names


def test_unknown_name_lists_available():
  with pytest.raises(ValueError, match="unknown attention 'nope'.*full"):
    az.create("nope", num_heads=2, head_dim=4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="available: .*full"):
    az.spec("nope")
  with pytest.raises(ValueError, match=r"unknown attention 'sliding_windw' \(did you mean "
                                       r"'sliding_window'\?\)"):
    az.create("sliding_windw", num_heads=2, head_dim=4, rngs=nnx.Rngs(0))


def test_unknown_option_names_it_and_the_accepted_ones():
  with pytest.raises(ValueError, match=r"unknown option\(s\) bogus; accepted: "
                                       r"dropout_rate=0.0, impl='auto', scale=None"):
    az.create("full", num_heads=2, head_dim=4, rngs=nnx.Rngs(0), bogus=3)


def test_spec_fields():
  spec = az.spec("full")
  assert spec.exact and spec.supports_causal and spec.supports_cross and spec.can_decode
  assert spec.options == {"scale": None, "dropout_rate": 0.0, "impl": "auto", "softcap": None,
                          "sink": False}
  assert spec.supports_softcap and spec.supports_segment_ids
  assert "Vaswani" in spec.paper and spec.complexity == "O(n²)"


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    (dict(num_heads=0), "positive"),
    (dict(num_heads=2, dropout_rate=1.0), "dropout_rate"),
])
def test_bad_construction(kwargs, message):
  with pytest.raises(ValueError, match=message):
    az.create("full", head_dim=4, rngs=nnx.Rngs(0), **kwargs)


def test_bad_call_shapes_are_named():
  attn = az.create("full", num_heads=4, head_dim=8, num_kv_heads=2, rngs=nnx.Rngs(0))
  q, k, v = random_qkv(0, q_len=6)
  with pytest.raises(ValueError, match="expected q"):
    attn(q, k[:, :, :1], v)
  with pytest.raises(ValueError, match=r"kv_mask must be bool \[batch, len\]"):
    attn(q, k, v, kv_mask=jnp.ones((2, 5), bool))
  with pytest.raises(ValueError, match=r"\[batch, len, heads, head_dim\]"):
    attn(q[0], k, v)


def test_cudnn_needs_a_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
    az.create("full", num_heads=2, head_dim=4, rngs=nnx.Rngs(0), impl="cudnn")


def test_register_rejects_non_attention_and_duplicates(scratch_registry):
  with pytest.raises(TypeError, match="subclass of attention_zoo.Attention"):
    az.register("thing", exact=False, supports_causal=False, supports_cross=False, complexity="",
                paper="")(object)

  class Other(az.Attention):
    pass

  with pytest.raises(ValueError, match="already registered"):
    az.register("full", exact=False, supports_causal=False, supports_cross=False, complexity="",
                paper="")(Other)


def test_unregistered_subclass_is_refused():
  class Loose(az.Attention):
    pass

  with pytest.raises(TypeError, match="not registered"):
    Loose(num_heads=1, head_dim=2, rngs=nnx.Rngs(0))


def test_plugin_variant_follows_the_contract(scratch_registry):
  """The extension contract (README: Adding a variant), used as a plug-in would use it."""
  @az.register("plain", exact=True, supports_causal=True, supports_cross=True, complexity="O(n^2)",
               paper="-")
  class Plain(az.Attention):
    OPTIONS = {"temperature": az.Float(1.0, above=0)}

    def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
      return az.reference.masked_softmax_attention(
          q, k, v, q_mask=q_mask, kv_mask=kv_mask, causal=self.causal,
          scale=self.scale / self.options["temperature"])

    def pattern(self, q_len, kv_len):
      return np.ones((1, q_len, kv_len), bool)

  assert "plain" in az.available() and az.spec("plain").options["temperature"] == 1.0
  attn = az.create("plain", num_heads=4, head_dim=8, num_kv_heads=2, rngs=nnx.Rngs(0),
                   temperature=2.0)
  q, k, v = random_qkv(0, q_len=6)
  q_mask = jnp.ones((2, 6), bool).at[1, 2].set(False)
  out = attn(q, k, v, q_mask=q_mask)
  assert float(jnp.abs(out[1, 2]).max()) == 0.0        # the base zeroes masked query rows
  expected = reference.dense_attention(q, k, v, True, scale=8 ** -0.5 / 2)
  np.testing.assert_allclose(out[0], expected[0], atol=1e-5)


def test_dense_attention_rows_without_keys_are_zero_with_finite_gradients():
  q, k, v = random_qkv(0, q_len=6)
  allowed = jnp.ones((2, 1, 6, 6), bool).at[1].set(False)

  def loss(q, k, v):
    return reference.dense_attention(q, k, v, allowed).sum()

  out = reference.dense_attention(q, k, v, allowed)
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  assert float(jnp.abs(out[1]).max()) == 0.0
  assert all(bool(jnp.isfinite(g).all()) for g in grads)


def test_masked_softmax_attention_matches_dense_oracle():
  q, k, v = random_qkv(0, q_len=5, kv_len=9)
  kv_mask = jnp.ones((2, 9), bool).at[0, 7:].set(False)
  out = reference.masked_softmax_attention(q, k, v, kv_mask=kv_mask, causal=True)
  allowed = (reference.causal_allowed(jnp.arange(5)[:, None], jnp.arange(9)[None, :], 5, 9)
             & kv_mask[:, None, None, :])                                  # [b, 1, q, k]
  np.testing.assert_allclose(out, reference.dense_attention(q, k, v, allowed), atol=1e-5)


def test_causal_alignment_is_bottom_right():
  allowed = np.asarray(reference.causal_allowed(np.arange(2)[:, None], np.arange(5)[None, :], 2, 5))
  np.testing.assert_array_equal(allowed, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])


# -- the contract on the base class ---------------------------------------------------------

REGISTER = dict(supports_causal=True, supports_cross=True, complexity="O(n²)", paper="-")


def test_exact_variants_must_define_pattern(scratch_registry):
  class NoPattern(az.Attention):
    def attend(self, q, k, v, *, q_mask, kv_mask, deterministic):
      return q

  with pytest.raises(TypeError, match="NoPattern is registered with exact=True but defines no "
                                      r"pattern\(q_len, kv_len\)"):
    az.register("no_pattern", exact=True, **REGISTER)(NoPattern)
  assert "no_pattern" not in az.available()
  az.register("no_pattern", exact=False, **REGISTER)(NoPattern)   # approximations need none
  attn = az.create("no_pattern", num_heads=2, head_dim=4, rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="no_pattern is not exact"):
    attn.pattern(3, 3)


def test_attend_is_abstract_with_alibi_slopes_in_its_signature(scratch_registry):
  import inspect
  assert "alibi_slopes" in inspect.signature(az.Attention.attend).parameters

  @az.register("no_attend", exact=False, **REGISTER)
  class NoAttend(az.Attention):
    pass

  q = jnp.ones((1, 3, 2, 4))
  with pytest.raises(NotImplementedError, match=r"NoAttend does not implement attend\(\)"):
    az.create("no_attend", num_heads=2, head_dim=4, rngs=nnx.Rngs(0))(q, q, q)


def test_options_must_be_typed(scratch_registry):
  class Untyped(az.Attention):
    OPTIONS = {"temperature": 1.0, "window": az.Int(4, minimum=0)}

  with pytest.raises(TypeError, match=r"Untyped.OPTIONS must map each name to an option type .*"
                                      r"got temperature=1.0 \("):
    az.register("untyped", exact=False, **REGISTER)(Untyped)


def test_max_len_is_checked():
  with pytest.raises(ValueError, match="full: max_len must be a positive integer or None, got 0"):
    az.create("full", num_heads=2, head_dim=4, max_len=0, rngs=nnx.Rngs(0))
  sized = az.create("full", num_heads=2, head_dim=4, max_len=np.int64(8), rngs=nnx.Rngs(0))
  assert sized.max_len == 8


# -- scoped registration --------------------------------------------------------------------

def test_scoped_registry_undoes_registrations_and_their_modules(tmp_path, monkeypatch):
  (tmp_path / "scoped_plugin.py").write_text(textwrap.dedent("""
      import attention_zoo as az
      from attention_zoo.variants.full import FullAttention

      @az.register("scoped_plugin", exact=True, supports_causal=True, supports_cross=True,
                   complexity="O(n^2)", paper="test")
      class ScopedPlugin(FullAttention):
        pass
      """))
  monkeypatch.syspath_prepend(str(tmp_path))
  before = az.available()
  with az.scoped_registry():
    import scoped_plugin  # noqa: F401
    assert "scoped_plugin" in az.available()
  assert az.available() == before and "scoped_plugin" not in sys.modules
  with az.scoped_registry():   # imported again, it registers again
    assert az.load_plugins(["scoped_plugin"]) == ["scoped_plugin"]
  with pytest.raises(RuntimeError), az.scoped_registry():   # restored on an exception too
    az.register("doomed", exact=False, **REGISTER)(type("Doomed", (az.Attention,), {}))
    raise RuntimeError
  assert az.available() == before


# -- the plug-in loader ---------------------------------------------------------------------

@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
  """A folder with a plug-in file and a broken one; the working directory is elsewhere."""
  folder = tmp_path / "plugins_here"
  folder.mkdir()
  (folder / "file_plugin.py").write_text(textwrap.dedent("""
      import attention_zoo as az
      from attention_zoo.variants.full import FullAttention

      @az.register("file_plugin", exact=True, supports_causal=True, supports_cross=True,
                   complexity="O(n^2)", paper="test")
      class FilePlugin(FullAttention):
        pass
      """))
  (folder / "broken_plugin.py").write_text("import not_a_module_anywhere\n")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  with az.scoped_registry():
    yield folder


def test_the_first_use_of_the_face_imports_every_variant_and_mixer_module():
  """A variant's or mixer's file is registered by being in attention_zoo/variants/ or
  attention_zoo/mixers/, with no list naming it: the face's first use of a public name (here
  az.available) imports every module of the two packages."""
  az.available()
  for package in ("variants", "mixers"):
    package_modules = {module.name for module in pkgutil.iter_modules([str(PACKAGE / package)])}
    imported = {name.rpartition(".")[2] for name in sys.modules
                if name.startswith(f"attention_zoo.{package}.")}
    assert package_modules and package_modules <= imported, package
  registered_in = {az.registry.get(name).__module__.split(".")[1] for name in az.available()}
  assert registered_in == {"variants", "mixers"}


FIRST_USE = textwrap.dedent("""
    import sys
    import attention_zoo.ops
    print("flax" in sys.modules, sorted(m for m in sys.modules if m.startswith("attention_zoo")
                                        and not m.startswith("attention_zoo.ops")))
    import attention_zoo as az
    print(len(az.available()))
    """)


@pytest.mark.slow
def test_the_ops_load_alone_and_the_face_loads_the_builtins_on_first_use():
  """`import attention_zoo.ops` (pure JAX) loads no Flax and no other part of the package; then
  az.available() lists every built-in, as in this process."""
  result = subprocess.run([sys.executable, "-c", FIRST_USE], capture_output=True, text=True,
                          cwd=PACKAGE.parent, env={"JAX_PLATFORMS": "cpu", "PATH": ""},
                          timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout.split("\n")[:2] == ["False ['attention_zoo']", str(len(az.available()))]


EACH_MODULE_FIRST = textwrap.dedent("""
    import importlib, pkgutil, sys
    import attention_zoo
    names = sorted(m.name for m in pkgutil.walk_packages(attention_zoo.__path__, "attention_zoo."))
    failed = []
    for name in names:
      for loaded in [m for m in sys.modules if m.split(".")[0] == "attention_zoo"]:
        del sys.modules[loaded]
      try:
        importlib.import_module(name)
        builtins = importlib.import_module("attention_zoo").available()
      except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
    print(len(names), len(builtins), failed)
    """)


@pytest.mark.slow
def test_every_module_imports_first_on_its_own():
  """Any module of the package can be the first one imported (none relies on another having
  been imported before it, and none half-imported meets the face loading the built-ins), and
  the face then lists every built-in."""
  result = subprocess.run([sys.executable, "-c", EACH_MODULE_FIRST], capture_output=True,
                          text=True, cwd=PACKAGE.parent, env={"JAX_PLATFORMS": "cpu", "PATH": ""},
                          timeout=600)
  assert result.returncode == 0, result.stderr
  modules = sum(1 for _ in PACKAGE.rglob("*.py")) - 1          # the face is imported each time
  assert result.stdout.split("\n")[0] == f"{modules} {len(az.available())} []", result.stdout


def test_load_plugins_by_path_from_the_working_directory(plugin_dir):
  """A file under the working directory is imported by its dotted path from there."""
  assert az.load_plugins(["plugins_here/file_plugin.py"]) == ["file_plugin"]
  assert az.registry.get("file_plugin").__module__ == "plugins_here.file_plugin"
  assert az.load_plugins(["plugins_here.file_plugin"]) == []     # the same module: loaded once
  assert plugins.registered_by("plugins_here") == ["file_plugin"]


def test_load_plugins_by_path_elsewhere(plugin_dir, monkeypatch):
  """A file outside the working directory is imported from its own folder."""
  (plugin_dir.parent / "elsewhere").mkdir()
  monkeypatch.chdir(plugin_dir.parent / "elsewhere")
  assert az.load_plugins([str(plugin_dir / "file_plugin.py")]) == ["file_plugin"]
  assert az.registry.get("file_plugin").__module__ == "file_plugin"


def test_load_plugins_errors_name_the_plugin_and_the_cause(plugin_dir, monkeypatch):
  with pytest.raises(az.PluginError, match=r"plugin file 'plugins_here/nope.py' not found \("):
    az.load_plugins(["plugins_here/nope.py"])
  with pytest.raises(az.PluginError, match="plugin module 'no_such_plugin' not found; pass an "):
    az.load_plugins(["no_such_plugin"])
  with pytest.raises(az.PluginError, match="plugin module 'json.no_such' not found"):
    az.load_plugins(["json.no_such"])
  with pytest.raises(az.PluginError, match=r"plugin file 'plugins_here/broken_plugin.py' failed "
                                           r"to import \(ModuleNotFoundError: .*not_a_module"):
    az.load_plugins(["plugins_here/broken_plugin.py"])
  (plugin_dir / "json.py").write_text("")
  monkeypatch.chdir(plugin_dir)
  with pytest.raises(az.PluginError, match="a different module named 'json' is already imported"):
    az.load_plugins(["json.py"])


# -- what the package imports ---------------------------------------------------------------

@pytest.mark.slow
def test_pallas_is_imported_only_for_a_pallas_path():
  """Building and running full, and flash on its chunked path, leaves Pallas unimported."""
  script = textwrap.dedent("""
      import sys
      import jax.numpy as jnp
      from flax import nnx
      import attention_zoo as az
      q = jnp.ones((1, 8, 2, 4))
      for name, options in [("full", {}), ("flash", {"impl": "chunked"})]:
        az.create(name, num_heads=2, head_dim=4, rngs=nnx.Rngs(0), **options)(q, q, q)
      print(sorted(m for m in sys.modules if m.startswith("jax.experimental.pallas")
                   or m.startswith("attention_zoo.ops.flash.pallas")))
      az.create("flash", num_heads=2, head_dim=4, rngs=nnx.Rngs(0), impl="pallas")
      print("jax.experimental.pallas" in sys.modules,
            "attention_zoo.ops.flash.pallas_gpu" in sys.modules)
      """)
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=PACKAGE.parent, env={"JAX_PLATFORMS": "cpu", "PATH": ""},
                          timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout.split("\n")[:2] == ["[]", "True True"], result.stdout
