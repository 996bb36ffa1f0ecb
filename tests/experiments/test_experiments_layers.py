"""The harness's layers (docs/harness.md, Layout): experiments/common/ imports no job of
experiments/, and no module of experiments/ imports itself back through others. Every import
counts, a function's late one too: a late import that dodges a circle is a circle."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON = "experiments.common"


def module_names(root: Path, package: str) -> dict[str, Path]:
  """{dotted name: file} of every module of `package` under `root` (a package is its
  __init__.py, a command package's __main__.py is <package>.__main__)."""
  names = {}
  for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return names


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
  """The modules of `known` that the file imports anywhere in it (at module level or in a
  function); `from package import module` imports the module."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:   # relative: from the file's package, one level up per extra dot
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
    else:
      continue
    for target in targets:
      while target and target not in known:   # a name in a module: that module
        target = target.rpartition(".")[0]
      if target:
        found.add(target)
  return found - {name}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
  names = module_names(root, package)
  return {name: imported_modules(path, name, set(names)) for name, path in names.items()}


def common_imports_of_jobs(graph: dict[str, set[str]], common: str) -> list[str]:
  """"a imports b" for each module of `common` that imports a module outside it (the top
  package itself, which holds no job, aside)."""
  inside = lambda name: name == common or name.startswith(common + ".")
  top = common.partition(".")[0]
  return sorted(f"{name} imports {target}" for name, targets in graph.items() if inside(name)
                for target in targets if not inside(target) and target != top)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The import circles, each as the path that closes it (a -> b -> a)."""
  found, done = [], set()

  def visit(name, path):
    if name in path:
      found.append(path[path.index(name):] + [name])
      return
    if name in done:
      return
    for target in sorted(graph.get(name, ())):
      visit(target, path + [name])
    done.add(name)

  for name in sorted(graph):
    visit(name, [])
  return found


def test_common_imports_no_job_and_no_module_imports_itself_back():
  graph = import_graph(REPO, "experiments")
  assert {f"{COMMON}.errors", "experiments.train.trainer", "experiments.benchmark.measuring",
          "experiments.reproduce"} <= set(graph), sorted(graph)
  assert any(graph[name] for name in graph if name.startswith(COMMON)), "no import found"
  assert not common_imports_of_jobs(graph, COMMON)
  assert not circles(graph)


def test_the_checks_see_late_imports_and_circles(tmp_path):
  """The checks above on a made-up package: a function's import of a job from the common part,
  and a circle closed by a late import, are both found."""
  files = {
      "pkg/__init__.py": "",
      "pkg/common/__init__.py": "",
      "pkg/common/errors.py": "def fail():\n  from pkg.job import run\n  run()\n",
      "pkg/common/flags.py": "from pkg.common import errors\n",
      "pkg/job/__init__.py": "",
      "pkg/job/run.py": "from pkg.common.errors import fail\nfrom . import steps\n",
      "pkg/job/steps.py": "def step():\n  from pkg.job import run\n",
  }
  for name, text in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
  graph = import_graph(tmp_path, "pkg")
  assert graph["pkg.common.flags"] == {"pkg.common", "pkg.common.errors"}   # the package too
  assert common_imports_of_jobs(graph, "pkg.common") == ["pkg.common.errors imports pkg.job",
                                                         "pkg.common.errors imports pkg.job.run"]
  assert ["pkg.job.run", "pkg.job.steps", "pkg.job.run"] in circles(graph)
  assert ["pkg.common.errors", "pkg.job.run", "pkg.common.errors"] in circles(graph)
