"""The examples shown in docs/bindings.md run and pass their own checks."""
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_quickstart_runs():
    result = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "anchorkv python:" in result.stdout and "cosine to exact attention" in result.stdout
