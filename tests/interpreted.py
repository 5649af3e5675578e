"""Running a Triton kernel on the CPU: a script in a fresh process under Triton's interpreter
(``TRITON_INTERPRET`` must be set before triton is imported), skipped where triton is missing,
and where NumPy is 2.3 or newer: Triton's interpreter (3.5 to 3.9) turns a loop bound loaded
from memory, a one-element array, into a Python int, which newer NumPy refuses ("only
0-dimensional arrays can be converted to Python scalars"); the kernels whose loops run to a
loaded length then fail there for no fault of their own. The ``test`` extra pins NumPy below 2.3."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DONE = "interpreted kernel ok"


def run_interpreted(script: str, timeout: float = 240) -> None:
    """Run ``script``, which prints "interpreted kernel ok" once every check passed, with the repo
    importable."""
    triton = pytest.importorskip("triton")
    numpy = pytest.importorskip("numpy")
    if tuple(int(part) for part in numpy.__version__.split(".")[:2]) >= (2, 3):
        pytest.skip(
            f"Triton {triton.__version__}'s interpreter needs NumPy < 2.3 for loops to a loaded length, "
            f"found NumPy {numpy.__version__}"
        )
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert DONE in result.stdout
