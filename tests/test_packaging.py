"""What ``pip install`` installs: a wheel built from a copy of the checkout holds every
package under ``zmqsync/`` and the command line as ``zmqsync_cli``, every module of them,
and no other top-level package (not ``tests``, ``benchmarks`` or ``cli``).

The wheel is built offline with the setuptools already installed (``--no-build-isolation
--no-deps --no-index``), in a copy, so that the build leaves nothing in the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Final

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: seconds the build may take (a second or two on an idle machine)
BUILD_TIMEOUT_S: Final = 90.0
#: what the build does not read, and what a build or a test run leaves in the checkout
_NOT_COPIED: Final = shutil.ignore_patterns(
    ".git", ".venv", ".pyshim", "build", "dist", "site", "*.egg-info", "__pycache__", ".*_cache"
)


def _modules(folder: Path, package: str) -> set[str]:
    """The wheel paths of the modules under ``folder``, installed as ``package``."""
    return {
        f"{package}/{path.relative_to(folder).as_posix()}"
        for path in folder.rglob("*.py")
        if "__pycache__" not in path.parts
    }


def _packages(folder: Path, package: str) -> set[str]:
    """The wheel folders of the packages under ``folder`` (those holding an __init__.py)."""
    return {
        f"{package}/{init.parent.relative_to(folder).as_posix()}".rstrip("/.")
        for init in folder.rglob("__init__.py")
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source") / "zmqsync"
    shutil.copytree(ROOT, source, ignore=_NOT_COPIED)
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    command += ["--no-index", "--quiet", "--wheel-dir", str(out), str(source)]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"`pip wheel` took over {BUILD_TIMEOUT_S:.0f} s:\n{expired.output}")
    assert done.returncode == 0, f"`pip wheel` failed:\n{done.stdout}{done.stderr}"
    # A deprecation the build warns of today is a build that breaks on a later setuptools
    # (the TOML table `license` did: it stops building in February 2027).
    said = done.stdout + done.stderr
    assert "deprecat" not in said.lower(), f"`pip wheel` warns:\n{said}"
    (built,) = out.glob("zmqsync-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_the_wheel_holds_every_package_and_module_of_the_library_and_cli(
    wheel_names: set[str],
) -> None:
    expected = _modules(ROOT / "zmqsync", "zmqsync") | _modules(ROOT / "cli", "zmqsync_cli")
    missing = sorted(expected - wheel_names)
    assert not missing, f"the wheel lacks: {', '.join(missing)}"
    folders = {name.rsplit("/", 1)[0] for name in wheel_names if name.endswith(".py")}
    packages = _packages(ROOT / "zmqsync", "zmqsync") | _packages(ROOT / "cli", "zmqsync_cli")
    assert folders == packages
    # the subpackages a hand-kept list once had to name, one by one
    for sub in ("transport/_zmq", "transport/pipe", "transport/ray", "transport/shm", "fleet"):
        assert f"zmqsync/{sub}" in folders


def test_the_wheel_holds_no_other_top_level_package(wheel_names: set[str]) -> None:
    top = {name.split("/", 1)[0] for name in wheel_names}
    dist_info = {name for name in top if name.endswith(".dist-info")}
    assert len(dist_info) == 1
    assert top - dist_info == {"zmqsync", "zmqsync_cli"}


def test_the_license_is_an_spdx_expression(wheel: Path, wheel_names: set[str]) -> None:
    (metadata,) = {name for name in wheel_names if name.endswith(".dist-info/METADATA")}
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(metadata).decode()
    assert "License-Expression: BSD-3-Clause" in text.splitlines()


def test_the_zmqsync_command_runs_the_cli_main(wheel: Path, wheel_names: set[str]) -> None:
    (entry_points,) = {name for name in wheel_names if name.endswith(".dist-info/entry_points.txt")}
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(entry_points).decode()
    assert "zmqsync = zmqsync_cli.main:main" in text.splitlines()
