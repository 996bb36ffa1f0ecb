"""The code passes the repository's ruff configuration (ruff.toml; ruff is in the test extras),
and its modules import one another in layers (docs/architecture.md).

Only the files git tracks are linted: a plug-in module a user writes in the checkout's root
(docs/adding_an_attention.md) is theirs to format. Outside a git checkout, the project's folders.
"""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT_FOLDERS = ("attention_zoo", "configs", "examples", "experiments", "lra", "synthetic",
                   "tests")


def python_files(root: Path) -> list[str]:
  """The .py files git tracks under `root`, or the project's folders when it is not a checkout."""
  try:
    listed = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], capture_output=True,
                            text=True, cwd=root)
  except FileNotFoundError:   # no git
    listed = None
  if listed is None or listed.returncode != 0:
    return [name for name in (*PROJECT_FOLDERS, "setup.py") if (root / name).exists()]
  return [name for name in listed.stdout.split("\0") if name and (root / name).exists()]


def ruff_check(root: Path) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                         *python_files(root)], capture_output=True, text=True, cwd=root)


def test_ruff_check_passes():
  run = ruff_check(REPO)
  assert run.returncode == 0, run.stdout + run.stderr


def test_untracked_files_are_not_linted(tmp_path):
  shutil.copy(REPO / "ruff.toml", tmp_path)
  (tmp_path / "tracked.py").write_text("x = 1\n")
  (tmp_path / "my_plugin.py").write_text("y = 1  # " + "a long line " * 10 + "\n")   # E501
  subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
  subprocess.run(["git", "add", "tracked.py"], cwd=tmp_path, check=True)
  assert python_files(tmp_path) == ["tracked.py"]
  run = ruff_check(tmp_path)
  assert run.returncode == 0, run.stdout + run.stderr
  subprocess.run(["git", "add", "my_plugin.py"], cwd=tmp_path, check=True)
  assert "E501" in ruff_check(tmp_path).stdout   # tracked, it is the project's code


def test_outside_a_git_checkout_the_project_folders_are_linted(tmp_path, monkeypatch):
  monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))   # no checkout above it
  (tmp_path / "lra").mkdir()
  (tmp_path / "my_plugin.py").write_text("y = 1\n")
  assert python_files(tmp_path) == ["lra"]


# -- the layers -----------------------------------------------------------------------------

PACKAGES = ("attention_zoo", "configs", "experiments", "lra", "synthetic")
# Public paths users import that re-export modules under ops/, variants/ and testing/: the
# library itself imports the real modules, never these.
PUBLIC_FACES = ("attention_zoo.flex", "attention_zoo.reference", "attention_zoo.conformance")
# The library's layers, lowest first: a module imports only from its own layer and those below.
# Each entry names modules and packages (a package stands for everything in it); the face,
# attention_zoo/__init__.py, is the top: it imports every public name, on first use.
LAYERS = [
    ("ops", ["attention_zoo.ops"]),
    ("name table", ["attention_zoo.options", "attention_zoo.registry", "attention_zoo.plugins"]),
    ("contract", ["attention_zoo.contract"]),
    ("parts", ["attention_zoo.positions", "attention_zoo.convolution", "attention_zoo.norms",
               "attention_zoo.dropout"]),
    ("variants and mixers", ["attention_zoo.variants", "attention_zoo.mixers"]),
    ("layers", ["attention_zoo.layers"]),
    ("models", ["attention_zoo.models"]),
    ("interop", ["attention_zoo.interop"]),
    ("testing", ["attention_zoo.testing"]),
    ("public faces", list(PUBLIC_FACES)),
    ("face", ["attention_zoo"]),
]
HARNESS = {"configs", "experiments", "lra", "synthetic", "ml_collections"}
# The tasks' data, lowest first: each package imports none of the project's packages but those
# before it here (lra knows only LRA; synthetic builds on lra's TaskSpec, Dataset and checks).
DATA_LAYERS = ["lra", "synthetic"]
HARNESS_COMMON = "experiments.common"   # what every command shares: it imports no job


def project_modules() -> dict[str, Path]:
  """Dotted name -> file of every module of the project's packages (a package by its
  __init__.py)."""
  modules = {}
  for package in PACKAGES:
    for path in sorted((REPO / package).rglob("*.py")):
      parts = path.relative_to(REPO).with_suffix("").parts
      modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  assert modules and all(any(m.split(".")[0] == p for m in modules) for p in PACKAGES), modules
  return modules


def imported_names(module: str, path: Path, *, module_level_only: bool = False,
                   only: ast.AST | None = None) -> set[str]:
  """Every module name `module` imports: at module level and inside functions (a late import
  that dodges a circle is still a circle), `from a import b` as both a and a.b (b may be a
  module), relative imports resolved. With module_level_only, not those inside functions; with
  `only`, the names of that one import statement."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  nodes = [only] if only else _outside_functions(tree) if module_level_only else ast.walk(tree)
  names = set()
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  for node in nodes:
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
      names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
  return names


def _outside_functions(tree):
  """The nodes of `tree` that are not inside a function or lambda (under if and try too)."""
  stack = [tree]
  while stack:
    node = stack.pop()
    yield node
    stack += [child for child in ast.iter_child_nodes(node)
              if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]


def import_graph(*, module_level_only: bool = False) -> dict[str, set[str]]:
  """Project module -> the project modules importing it runs: `import a.b.c` runs the packages
  a and a.b too. A module's own packages are left out: they are loaded before it, whatever it
  imports, so importing one of them starts nothing. With module_level_only, what loading it
  runs (not the imports inside its functions)."""
  modules = project_modules()
  graph = {}
  for module, path in modules.items():
    own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    runs = set()
    for name in imported_names(module, path, module_level_only=module_level_only):
      parts = name.split(".")
      runs |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    graph[module] = {m for m in runs if m in modules and m != module} - own_packages
  return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, on_stack, stack, found = {}, {}, set(), [], []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for target in sorted(graph[node]):
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def layer_of(module: str) -> int:
  """The index in LAYERS of the entry naming `module` or a package above it (the most specific);
  ValueError for a library module no layer names."""
  matches = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
             if module == prefix or (module.startswith(prefix + ".") and prefix != "attention_zoo")]
  if not matches:
    raise ValueError(f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)")
  return max(matches)[1]


def test_the_import_reader_sees_late_imports_packages_and_circles(tmp_path):
  (tmp_path / "m.py").write_text("import a.b.c\nfrom d import e\n\ndef f():\n  import g\n")
  assert imported_names("m", tmp_path / "m.py") == {"a.b.c", "d", "d.e", "g"}
  assert imported_names("m", tmp_path / "m.py", module_level_only=True) == {"a.b.c", "d", "d.e"}
  (tmp_path / "p.py").write_text("from . import x\nfrom .y import z\n")
  assert imported_names("pkg.sub.p", tmp_path / "p.py") == {"pkg.sub", "pkg.sub.x", "pkg.sub.y",
                                                           "pkg.sub.y.z"}
  assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert circles({"a": {"b"}, "b": set()}) == []


def test_the_library_imports_only_downwards():
  """Every import of a library module, function-level ones included, goes to its own layer or
  one below (LAYERS): the registry imports no variant, the contract no layer, nothing but the
  conformance command the suite."""
  graph = import_graph()
  library = sorted(m for m in graph if m.split(".")[0] == "attention_zoo")
  upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
            for m in library for t in sorted(graph[m])
            if t.split(".")[0] == "attention_zoo" and layer_of(t) > layer_of(m)]
  assert library and not upward, upward


def test_no_import_circles_in_the_library_and_the_data():
  found = [c for c in circles(import_graph()) if not any(m.startswith("experiments") for m in c)]
  assert not found, found


def test_no_import_circles_in_the_harness():
  found = [c for c in circles(import_graph()) if any(m.startswith("experiments") for m in c)]
  assert not found, found


def jobs_imported_by_common(graph: dict[str, set[str]]) -> list[str]:
  """"a imports b" for each module of the harness's common part (experiments/common/) that
  imports a module of experiments/ outside it."""
  common = lambda m: m == HARNESS_COMMON or m.startswith(HARNESS_COMMON + ".")
  return [f"{m} imports {t}" for m in sorted(graph) if common(m) for t in sorted(graph[m])
          if t.split(".")[0] == "experiments" and not common(t)]


def test_the_harness_common_part_imports_no_job():
  """experiments/common/ (errors, flags, overrides, device facts, records, ...) imports none of
  the jobs (train/, benchmark/, the commands beside them), function-level imports included."""
  graph = import_graph()
  assert any(m.startswith(HARNESS_COMMON + ".") for m in graph), sorted(graph)
  assert not jobs_imported_by_common(graph), jobs_imported_by_common(graph)
  late = {"experiments.common.device": {"experiments.benchmark", "experiments.benchmark.ops",
                                        "experiments.common.errors", "jax"}}
  assert jobs_imported_by_common(late) == [
      "experiments.common.device imports experiments.benchmark",
      "experiments.common.device imports experiments.benchmark.ops"]


# A package whose import starts JAX (seconds): the one reason for an import inside a function.
STARTS_JAX = {"jax", "jaxlib", "flax", "optax", "orbax"}


def modules_starting_jax() -> set[str]:
  """The project modules whose loading imports a JAX package, directly or through the project
  modules it loads."""
  modules = project_modules()
  graph = import_graph(module_level_only=True)
  starting = {m for m, path in modules.items()
              if any(n.split(".")[0] in STARTS_JAX
                     for n in imported_names(m, path, module_level_only=True))}
  while grown := {m for m in graph if m not in starting and graph[m] & starting}:
    starting |= grown
  return starting


def needless_late_imports(module: str, path: Path, starting_jax: set[str]) -> list[str]:
  """"module:line imports names" for each import inside a function of project modules none of
  which starts JAX (`starting_jax`): it could stand at the top of the file."""
  modules = project_modules()
  found = []
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      for inner in ast.walk(node):
        if isinstance(inner, (ast.Import, ast.ImportFrom)):
          names = imported_names(module, path, only=inner) & set(modules)
          if names and not names & starting_jax:
            found.append(f"{module}:{inner.lineno} imports {', '.join(sorted(names))}")
  return sorted(set(found))


def test_the_harness_imports_late_only_what_starts_jax():
  """A command checks its flags before JAX starts, so it may import a module that starts JAX
  inside a function; any other project import stands at the top of its file, where a reader
  sees what the module depends on."""
  starting = modules_starting_jax()
  assert "experiments.train.trainer" in starting and "experiments.report" not in starting
  harness = {m: p for m, p in project_modules().items() if m.split(".")[0] == "experiments"}
  found = [line for m, path in harness.items() for line in needless_late_imports(m, path, starting)]
  assert not found, found


def test_the_late_import_reader_tells_a_needless_late_import(tmp_path):
  (tmp_path / "m.py").write_text("def f():\n  from experiments import report\n"
                                 "def g():\n  from experiments.train import trainer\n")
  assert needless_late_imports("experiments.m", tmp_path / "m.py",
                               {"experiments.train.trainer"}) == [
      "experiments.m:2 imports experiments, experiments.report"]


def test_ops_import_only_jax_numpy_the_standard_library_and_themselves():
  """So that a JAX user without Flax can use them; and importing attention_zoo.ops runs the
  face, which imports only the standard library when it loads."""
  allowed = {"jax", "numpy", *sys.stdlib_module_names}
  modules = project_modules()
  ops = {m: path for m, path in modules.items() if m.split(".")[:2] == ["attention_zoo", "ops"]}
  in_ops = lambda name: name.split(".")[:2] == ["attention_zoo", "ops"]
  outside = {m: sorted(n for n in imported_names(m, path)
                       if n.split(".")[0] not in allowed and not in_ops(n))
             for m, path in ops.items()}
  assert ops and not any(outside.values()), outside
  face = imported_names("attention_zoo", modules["attention_zoo"], module_level_only=True)
  assert face and {n.split(".")[0] for n in face} <= set(sys.stdlib_module_names), face


def test_the_library_imports_nothing_from_the_harness():
  """attention_zoo stands alone: no import of experiments, configs, lra, synthetic or
  ml_collections."""
  modules = project_modules()
  found = {m: sorted(n for n in imported_names(m, path) if n.split(".")[0] in HARNESS)
           for m, path in modules.items() if m.split(".")[0] == "attention_zoo"}
  assert found and not any(found.values()), found


def test_the_data_packages_import_only_downwards():
  """lra imports nothing of the project but itself, synthetic only lra and itself: neither the
  library, the configs nor the harness."""
  modules = project_modules()
  found = {}
  for i, package in enumerate(DATA_LAYERS):
    allowed = set(DATA_LAYERS[:i + 1])
    for module, path in modules.items():
      if module.split(".")[0] == package:
        found[module] = sorted(n for n in imported_names(module, path)
                               if n.split(".")[0] in {*PACKAGES, "ml_collections"} - allowed)
  assert set(DATA_LAYERS) <= {m.split(".")[0] for m in found}
  assert not any(found.values()), found


def test_only_the_command_and_tests_import_the_conformance_suite():
  """The suite is for tests: no library module but the command, no plug-in, no harness module
  imports attention_zoo.testing."""
  modules = project_modules()
  sources = {**modules, **{f"examples.{p.stem}": p for p in (REPO / "examples").glob("*.py")}}
  importers = sorted(m for m, path in sources.items()
                     if any(n.startswith("attention_zoo.testing") for n in imported_names(m, path))
                     and not m.startswith("attention_zoo.testing"))
  assert importers == ["attention_zoo.conformance"], importers


def test_no_library_module_imports_a_public_face():
  """attention_zoo.flex, .reference and .conformance are re-exports for users: every module of
  the library imports the module under ops/, variants/ or testing/ they show, function-level
  imports included, so each thing has one name inside the library."""
  modules = project_modules()
  assert all(face in modules for face in PUBLIC_FACES), PUBLIC_FACES
  found = {m: sorted(n for n in imported_names(m, path)
                     if any(n == face or n.startswith(face + ".") for face in PUBLIC_FACES))
           for m, path in modules.items() if m.split(".")[0] == "attention_zoo"}
  assert not any(found.values()), {m: names for m, names in found.items() if names}


def attributes_set_on_arguments(path: Path) -> list[str]:
  """"file:line function: name.attr" for each attribute a function sets (`x.a = ...`,
  `x.a += ...`, `setattr(x, ...)`) on one of its arguments x other than self and cls."""
  found = []
  for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    arguments = function.args
    names = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}
    names -= {"self", "cls"}
    for node in ast.walk(function):
      if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        target = node.value
      elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "setattr" and node.args):
        target = node.args[0]
      else:
        continue
      if isinstance(target, ast.Name) and target.id in names:
        found.append(f"{path.name}:{node.lineno} {function.name}: {target.id}")
  return found


def test_no_library_function_sets_attributes_on_a_module_passed_to_it(tmp_path):
  """A module builds its own submodules (a mixer its projections, gates and norm, in its own
  __init__); the shared parts return modules and set nothing on their caller."""
  (tmp_path / "m.py").write_text("def add(mixer, rngs):\n  mixer.qkv = 1\n"
                                 "def put(layer):\n  setattr(layer, 'a', 1)\n"
                                 "class A:\n  def __init__(self):\n    self.b = 1\n")
  assert attributes_set_on_arguments(tmp_path / "m.py") == ["m.py:2 add: mixer",
                                                           "m.py:4 put: layer"]
  found = [line for path in sorted((REPO / "attention_zoo").rglob("*.py"))
           for line in attributes_set_on_arguments(path)]
  assert not found, found
