"""The code passes the repository's ruff configuration (ruff.toml; ruff is in the test extras).

Only the files git tracks are linted: a plug-in module a user writes in the checkout's root
(docs/adding_an_attention.md) is theirs to format. Outside a git checkout, the project's folders.
"""
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT_FOLDERS = ("attention_zoo", "configs", "examples", "experiments", "lra", "tests")


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
