"""ruff and mypy stay clean (both come with the `test` extra)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# mypy does not install on a free-threaded interpreter (.ci/free-threaded leaves it out);
# the static checks are the same on either, and CI runs them on the normal one.
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", [["ruff", "check", "."], ["mypy"]], ids=["ruff", "mypy"])
def test_static_checks(command: list[str]) -> None:
    if importlib.util.find_spec(command[0]) is None:
        if not FREE_THREADED:
            pytest.fail(f"{command[0]} is not installed: pip install -e '.[test]'")
        pytest.skip(f"{command[0]} does not install on a free-threaded interpreter")
    result = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
