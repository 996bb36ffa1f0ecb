"""README.md and docs/ stay true: the variants table is the registry, the Python example runs,
the commands shown name existing configs and modules, every relative link resolves, the layout
names every entry point, and CI runs the README's test command."""
import importlib.util
import re
import runpy
from pathlib import Path

import pytest
import setuptools

import attention_zoo as az

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_blocks(language: str, text: str = README) -> list[str]:
  return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_readme_is_short():
  assert len(README) <= 15_000, f"README.md has {len(README)} characters: move details to docs/"


@pytest.mark.parametrize("kind, page", [("attention", "README.md"), ("mixer", "docs/mixers.md")])
def test_variants_table_lists_exactly_the_registry(kind, page):
  text = (REPO / page).read_text(encoding="utf-8")
  table_names = re.findall(r"^\| `(\w+)` \|", text, flags=re.M)
  assert sorted(table_names) == sorted(az.available(kind))
  for name in az.available(kind):
    row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
    spec = az.spec(name)
    assert spec.complexity in row, f"{name}: the README row disagrees with the spec"
    defaults = [f"`{option}={value}`" for option, value in spec.options.items()
                if option not in ("scale", "dropout_rate")]
    assert ", ".join(defaults) in row, f"{name}: the README's options are not {defaults}"


@pytest.mark.slow
def test_python_example_runs():
  (example,) = code_blocks("python")[:1]
  namespace = {}
  exec(compile(example, "README.md", "exec"), namespace)   # noqa: S102 - our own README
  assert namespace["out"].shape == (2, 1000, 8, 64)
  assert namespace["logits"].shape == (2, 10)
  assert namespace["tokens"].shape == (1, 24)


def test_commands_name_existing_modules_and_configs():
  commands = " ".join(block for page in PAGES
                      for block in code_blocks("bash", page.read_text(encoding="utf-8")))
  commands = commands.replace("\\\n", " ")
  modules = set(re.findall(r"python -m ([\w.]+)", commands))
  assert {"experiments.reproduce", "experiments.train", "attention_zoo.conformance"} <= modules
  for module in modules:
    assert importlib.util.find_spec(module) is not None, module
  for config in re.findall(r"--config=(\S+?\.py)", commands):
    assert (REPO / config).is_file(), config


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


def test_layout_names_every_entry_point_and_bench_part():
  layout = README.split("## Layout", 1)[1].split("\n## ", 1)[0]
  entry_points = [p.stem for p in (REPO / "experiments").glob("*.py")
                  if '__name__ == "__main__"' in p.read_text(encoding="utf-8")]
  bench_parts = [p.stem for p in (REPO / "experiments" / "bench").glob("*.py")
                 if p.stem != "__init__"]
  missing = [name for name in entry_points + bench_parts if not re.search(rf"\b{name}\b", layout)]
  assert not missing, f"README's Layout does not name {missing}"


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
