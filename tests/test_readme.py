"""README.md stays true: its variants table is the registry, its Python example runs, the
commands it shows name existing configs and modules, and CI runs its test command."""
import importlib.util
import re
from pathlib import Path

import attention_zoo as az

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def code_blocks(language: str) -> list[str]:
  return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_variants_table_lists_exactly_the_registry():
  table_names = re.findall(r"^\| `(\w+)` \|", README, flags=re.M)
  assert sorted(table_names) == sorted(az.available())
  for name in az.available():
    row = next(line for line in README.splitlines() if line.startswith(f"| `{name}` |"))
    assert az.spec(name).complexity in row, f"{name}: the README row disagrees with the spec"


def test_python_example_runs():
  (example,) = code_blocks("python")[:1]
  namespace = {}
  exec(compile(example, "README.md", "exec"), namespace)   # noqa: S102 - our own README
  assert namespace["out"].shape == (2, 1000, 8, 64)
  assert namespace["logits"].shape == (2, 10)
  assert namespace["tokens"].shape == (1, 24)


def test_commands_name_existing_modules_and_configs():
  commands = " ".join(code_blocks("bash")).replace("\\\n", " ")
  modules = set(re.findall(r"python -m ([\w.]+)", commands))
  assert {"experiments.reproduce", "experiments.train", "attention_zoo.conformance"} <= modules
  for module in modules:
    assert importlib.util.find_spec(module) is not None, module
  for config in re.findall(r"--config=(\S+?\.py)", commands):
    assert (REPO / config).is_file(), config


def test_ci_runs_the_readme_install_and_test_commands():
  ci = (REPO / ".ci" / "run").read_text()
  assert 'pip install -e ".[test]"' in README and 'pip install -e ".[test]"' in ci
  tests_section = README.split("## Tests", 1)[1]
  test_command = re.search(r"```bash\n(.*?)\n```", tests_section, flags=re.S).group(1).strip()
  assert ci.rstrip().endswith(f"python3 -m {test_command}"), (test_command, ci)
