"""The examples shown in the README run and pass their own checks."""
import os
import subprocess
import sys
from pathlib import Path

import anchorkv

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_quickstart_runs():
    # The example imports the anchorkv these tests import (source tree or installed).
    package_parent = str(Path(anchorkv.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [package_parent, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "anchorkv python:" in result.stdout and "cosine to exact attention" in result.stdout
