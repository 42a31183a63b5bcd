"""The README's first example runs as written: it is taken out of README.md and run as
a script in a process of its own (a learner and 4 spawned workers over ZeroMQ), so the
first code a reader copies cannot go stale."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: seconds the example may take: 4 spawned workers import torch (10 to 20 s on 2 cores)
EXAMPLE_TIMEOUT_S: Final = 120.0

_PYTHON_FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def first_python_example() -> str:
    """The first ```python block of the README."""
    match = _PYTHON_FENCE.search((ROOT / "README.md").read_text())
    assert match, "README.md has no ```python block"
    return match.group(1)


@pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 30)
def test_first_example_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(first_python_example())
    # Its own session, so that on a timeout its workers are killed with it.
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=dict(os.environ),  # PYTHONPATH and all: zmqsync as this test imports it
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=EXAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the README's example ran past {EXAMPLE_TIMEOUT_S:g}s\n{out}\n{err}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out}\n{err}"
    # Every send reached all 4 workers: after step n, each holds version n + 1.
    assert out.splitlines() == [
        f"step {n}: worker versions {{0: {n + 1}, 1: {n + 1}, 2: {n + 1}, 3: {n + 1}}}"
        for n in range(3)
    ], out + err
