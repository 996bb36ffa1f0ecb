"""README.md and docs/ stay true: the variants table is the registry, the Python example runs,
every command shown passes a dry run, every relative link resolves, the layout names every entry
point, and CI runs the README's test command."""
import importlib.util
import re
import runpy
import shlex
from pathlib import Path

import pytest
import setuptools

import attention_zoo as az
from command_runner import run_commands

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def code_blocks(language: str, text: str = README) -> list[str]:
  return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_readme_is_short():
  size = len(README.encode("utf-8"))   # in bytes, as the repository's own check counts it
  assert size < 15_000, f"README.md has {size} bytes: move details to docs/"


def test_readme_tables_list_exactly_the_registry():
  """The README's short tables (attention, then mixers) name every registered class once."""
  names = re.findall(r"^\| `(\w+)` \|", README, flags=re.M)
  assert sorted(names) == sorted(az.available())


@pytest.mark.parametrize("kind, page", [("attention", "docs/variants.md"),
                                        ("mixer", "docs/mixers.md")])
def test_variants_table_lists_exactly_the_registry(kind, page):
  text = (REPO / page).read_text(encoding="utf-8")
  table_names = re.findall(r"^\| `(\w+)` \|", text, flags=re.M)
  assert sorted(table_names) == sorted(az.available(kind))
  for name in az.available(kind):
    row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
    spec = az.spec(name)
    assert spec.complexity in row, f"{name}: the {page} row disagrees with the spec"
    defaults = [f"`{option}={value}`" for option, value in spec.options.items()
                if option not in ("scale", "dropout_rate", "softcap", "sink")]
    assert ", ".join(defaults) in row, f"{name}: the {page} options are not {defaults}"


@pytest.mark.slow
def test_python_example_runs():
  (example,) = code_blocks("python")[:1]
  namespace = {}
  exec(compile(example, "README.md", "exec"), namespace)   # noqa: S102 - our own README
  assert namespace["out"].shape == (2, 1000, 8, 64)
  assert namespace["logits"].shape == (2, 10)
  assert namespace["tokens"].shape == (1, 24)


def shown_commands() -> list[tuple[str, list[str]]]:
  """(page, [module, *args]) of every `python -m` command in the bash blocks of README.md and
  docs/: continued lines joined; comments, what runs it (environment variables, taskset, srun)
  and a trailing `&` dropped."""
  commands = []
  for page in PAGES:
    for block in code_blocks("bash", page.read_text(encoding="utf-8")):
      for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        starts = [i for i in range(len(words) - 1) if words[i:i + 2] == ["python", "-m"]]
        if starts:
          argv = words[starts[0] + 2:]
          commands.append((page.name, argv[:-1] if argv[-1] == "&" else argv))
  return commands


def test_commands_name_existing_modules_and_configs():
  commands = shown_commands()
  modules = {argv[0] for _, argv in commands}
  assert {"experiments.reproduce", "experiments.train", "attention_zoo.conformance"} <= modules
  for module in modules:
    assert importlib.util.find_spec(module) is not None, module
  for config in [word.split("=", 1)[1].partition(":")[0] for _, argv in commands
                 for word in argv if word.startswith("--config=")]:
    assert (REPO / config).is_file(), config


# The entry points and benchmark modes no bash block shows.
UNSHOWN = {
    "fidelity": ["experiments.fidelity"],
    "flash": ["experiments.benchmark", "--mode=flash", "--lengths=128,256", "--interpret",
              "--out=x"],
}
# Entry points that are a test's child process, not a command for users: none has a dry run.
CHILD_ONLY = {"attention_zoo.testing.context_parallel"}   # run_in_child's child (many devices)
# Commands that must fail under --dry_run as they do without it (a dry run checks as much), with
# a fragment of their error.
INVALID = {
    "bogus flag": (["experiments.train", "--config=configs/lra/listops.py:full,tiny",
                    "--workdir=runs/x", "--no_such_flag=1"], "Unknown command line flag"),
    "unknown task": (["experiments.reproduce", "--tasks=listops,cifar"], "unknown task 'cifar'"),
    "unknown option": (["experiments.sweep", "--attentions=full",
                        "--override=model.attention_options.nb_features=8"],
                       "has an option 'nb_features'"),
    "bad option value": (["experiments.train", "--config=configs/lra/listops.py:performer,tiny",
                          "--workdir=runs/x", "--config.model.attention_options.kernel=cubic"],
                         "cannot build the performer model"),
    # The run's checks before its first step: the data's load options, the optimiser.
    "max_len 0": (["experiments.train", "--config=configs/lra/listops.py:full,tiny",
                   "--workdir=runs/x", "--config.model.max_len=0"],
                  "cannot load listops: max_len must be a positive integer, got 0"),
    "max_len 0 in a grid": (["experiments.reproduce", "--tasks=mqar", "--attentions=full",
                             "--override=model.max_len=0"],
                            "cannot load mqar: max_len must be a positive integer, got 0"),
    "optimizer": (["experiments.train", "--config=configs/mqar.py:full,tiny", "--workdir=runs/x",
                   "--config.optimizer.name=sgd"], "unknown optimizer.name 'sgd'"),
    "benchmark mode": (["experiments.benchmark", "--mode=approximation", "--out=x",
                        "--attentions=nosuch"], "unknown attention 'nosuch'"),
    "generate": (["lra.generate", "pathfinder", "--out=x"], "pathfinder needs --num"),
    "conformance": (["attention_zoo.conformance", "--checks=nosuch",
                     "attention_zoo.variants.full"],
                    "unknown check(s) nosuch"),
}


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
  """{(page, command): result} of every shown command and INVALID's, with --dry_run, all in one
  child process (the imports once), from an empty folder that holds only a link to configs/:
  it must stay so."""
  folder = tmp_path_factory.mktemp("dry_run")
  (folder / "configs").symlink_to(REPO / "configs")
  runs = [*shown_commands(), *UNSHOWN.items(),
          *((name, argv) for name, (argv, _) in INVALID.items())]
  runs = [(key, argv + ["--dry_run"] * ("--dry_run" not in argv)) for key, argv in runs]
  results = run_commands([argv for _, argv in runs], cwd=folder)
  assert sorted(p.name for p in folder.iterdir()) == ["configs"], "a dry run wrote files"
  return {(page, " ".join(argv)): result for (page, argv), result in zip(runs, results)}


def entry_points(folder: str) -> set[str]:
  """`python -m` names of the modules under `folder` that run as a command (a package's
  __main__.py is the package's)."""
  paths = sorted((REPO / folder).rglob("*.py"))
  assert paths, f"no module under {folder}/"
  return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__main__")
          for p in paths
          if re.search(r"^if __name__ == .__main__.:", p.read_text(encoding="utf-8"), flags=re.M)}


def test_every_entry_point_has_a_dry_run_here():
  entry_points_here = set().union(*map(entry_points, ("experiments", "lra", "attention_zoo")))
  assert {"experiments.train", "experiments.benchmark"} <= entry_points_here
  covered = {argv[0] for _, argv in shown_commands()} | {argv[0] for argv in UNSHOWN.values()}
  assert entry_points_here - CHILD_ONLY <= covered, entry_points_here - CHILD_ONLY - covered
  assert CHILD_ONLY <= entry_points_here, CHILD_ONLY - entry_points_here


@pytest.mark.slow   # one subprocess dry-runs every command: 1.5 min of CPU
def test_every_shown_command_passes_a_dry_run(dry_runs):
  shown = {key: r for key, r in dry_runs.items() if key[0] not in INVALID}
  assert len(shown) >= 20, "the command pattern found too little"
  failed = {key: r["stderr"][-1500:] for key, r in shown.items() if r["code"] != 0}
  assert not failed, failed
  for (page, command), result in shown.items():
    assert result["stdout"].strip(), f"{page}: {command} printed no plan"


@pytest.mark.slow   # one subprocess dry-runs every command: 1.5 min of CPU
def test_invalid_commands_fail_their_dry_run(dry_runs):
  for name, (_, error) in INVALID.items():
    (result,) = [r for (key, _), r in dry_runs.items() if key == name]
    assert result["code"] not in (0, "exception"), (name, result)
    assert error in result["stderr"] and "Traceback" not in result["stderr"], (name, result)


def anchors(page: Path) -> set[str]:
  """GitHub's heading anchors: lower case, punctuation dropped, spaces made hyphens."""
  text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
  headings = re.findall(r"^#+ (.+?)\s*$", text, flags=re.M)
  return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def relative_links(page: Path) -> list[str]:
  text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
  text = re.sub(r"`[^`\n]*`", "", text)
  targets = re.findall(r"\]\(([^)\s]+)\)", text)
  return [t for t in targets if not re.match(r"[a-z]+:", t)]


def test_relative_links_resolve():
  assert len(PAGES) > 1, "no page found under docs/"
  assert relative_links(REPO / "README.md"), "the link pattern found nothing"
  broken = []
  for page in PAGES:
    for target in relative_links(page):
      path, _, anchor = target.partition("#")
      file = (page.parent / path).resolve() if path else page
      if not file.exists():
        broken.append(f"{page.name}: {target} (no such file)")
      elif anchor and file.suffix == ".md" and anchor not in anchors(file):
        broken.append(f"{page.name}: {target} (no such heading)")
  assert not broken, broken


def test_anchors_follow_githubs_rule(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("# Results\n## Efficiency (LRA Table 2 layout, CPU)\n"
                  "```\n# not a heading\n```\n### The variants' `impl` choices\n")
  assert anchors(page) == {"results", "efficiency-lra-table-2-layout-cpu",
                           "the-variants-impl-choices"}


def section(page: str, heading: str) -> str:
  """The text of `page` under `## heading`, up to the next heading of that level."""
  return (REPO / page).read_text(encoding="utf-8").split(f"## {heading}", 1)[1].split("\n## ", 1)[0]


def test_layout_names_every_entry_point_and_harness_module_and_points_to_the_layers():
  """README's Layout names every command of experiments/, its modules beside them and its
  folders, and points to docs/architecture.md, whose harness section names every module of
  experiments/."""
  layout = section("README.md", "Layout")
  commands = [name.rpartition(".")[2] for name in entry_points("experiments")]
  beside = [p.stem for p in (REPO / "experiments").glob("*.py") if p.stem != "__init__"]
  folders = sorted({p.parent.name for p in (REPO / "experiments").rglob("*.py")} - {"experiments"})
  assert commands and beside and folders, "the globs found nothing"
  missing = [name for name in commands + beside + [f"{f}/" for f in folders]
             if not re.search(rf"\b{re.escape(name)}", layout)]
  assert not missing, f"README's Layout does not name {missing}"
  assert "docs/architecture.md" in layout and (REPO / "docs" / "architecture.md").is_file()
  modules = [p.stem for p in (REPO / "experiments").rglob("*.py")
             if p.stem not in ("__init__", "__main__")]
  harness = section("docs/architecture.md", "The harness")
  missing = [name for name in modules if not re.search(rf"\b{name}\b", harness)]
  assert not missing, f"docs/architecture.md's harness section does not name {missing}"


def test_ci_runs_the_readme_install_and_test_commands():
  ci = (REPO / ".ci" / "run").read_text()
  assert 'pip install -e ".[test]"' in README and 'pip install -e ".[test]"' in ci
  tests_section = README.split("## Tests", 1)[1]
  test_command = re.search(r"```bash\n(.*?)\n```", tests_section, flags=re.S).group(1).strip()
  assert ci.rstrip().endswith(f"python3 -m {test_command}"), (test_command, ci)


def setup_extras(monkeypatch) -> dict[str, list[str]]:
  """setup.py's extras_require, read by running it with setuptools.setup recording its call."""
  call = {}
  monkeypatch.setattr(setuptools, "setup", lambda **kwargs: call.update(kwargs))
  monkeypatch.chdir(REPO)   # setup.py reads README.md from the working directory
  runpy.run_path(str(REPO / "setup.py"))
  return call["extras_require"]


def test_install_instructions_match_the_extras(monkeypatch):
  """Each install line adds a package the ones before it did not, and the extras README says
  [test] already includes are in it."""
  extras = setup_extras(monkeypatch)
  install = README.split("## Install", 1)[1].split("\n## ", 1)[0]
  installed = set()
  for names in re.findall(r'pip install -e "\.\[([\w,]+)\]"', install):
    wanted = {package for name in names.split(",") for package in extras[name]}
    assert wanted - installed, f'pip install -e ".[{names}]" installs nothing new'
    installed |= wanted
  included = re.search(r"`\[test\]` already includes (.*?);", install, flags=re.S)
  for name in re.findall(r"`\[(\w+)\]`", included.group(1) if included else ""):
    assert set(extras[name]) <= set(extras["test"]), name
