"""Running a Triton kernel on the CPU: a script in a fresh process under Triton's interpreter
(``TRITON_INTERPRET`` must be set before triton is imported), skipped where triton is missing."""

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
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert DONE in result.stdout
