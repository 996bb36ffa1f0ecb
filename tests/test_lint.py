"""The code passes the repository's ruff configuration (ruff.toml; ruff is in the test extras)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
  run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)],
                       capture_output=True, text=True, cwd=REPO)
  assert run.returncode == 0, run.stdout + run.stderr
