"""The code keeps to the project's style: ruff-clean, ruff-formatted and mypy-clean.

CI runs only the test command, so these checks live here: a lint or type error fails
the suite like any other defect. The tools' versions are pinned in the ``test`` extra,
so a new release cannot change the verdict on unchanged code.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _check(*command: str, timeout: float) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (
        f"`python -m {' '.join(command)}` found problems (fix them, or run "
        f"`ruff format .` for formatting):\n{done.stdout}{done.stderr}"
    )


def test_ruff_finds_nothing() -> None:
    _check("ruff", "check", ".", timeout=60)


def test_the_code_is_ruff_formatted() -> None:
    _check("ruff", "format", "--check", ".", timeout=60)


@pytest.mark.timeout(300)
def test_mypy_finds_nothing_in_the_library_cli_and_benchmarks() -> None:
    _check("mypy", "zmqsync", "cli", "benchmarks", timeout=280)
