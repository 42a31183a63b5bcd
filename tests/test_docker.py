"""The docker fleet, checked without a Docker engine (none runs here).

The compose file is parsed and every command it runs (services and healthchecks) is
parsed by the real CLI; then the learner and two actors run with exactly those commands
and environments, as processes in separate network namespaces over tcp, with CURVE keys
made by `zmqsync keys` and mounted paths mapped to a temp dir.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
import yaml
from netns import Topology, why_unavailable

from zmqsync.client import demo_model
from zmqsync_cli.main import app

DOCKER = Path(__file__).resolve().parent.parent / "docker"
ZMQSYNC = str(Path(sys.executable).with_name("zmqsync"))


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())  # type: ignore[no-any-return]


def _cli_args(test: list[str]) -> list[list[str]]:
    """The zmqsync invocations inside a healthcheck test."""
    if test[0] == "CMD":
        return [test[2:]] if test[1] == "zmqsync" else []
    assert test[0] == "CMD-SHELL"
    calls = []
    for part in re.split(r";|&&|\|\|", test[1]):
        words = shlex.split(part)
        if words and words[0] == "zmqsync":
            calls.append(words[1:])
    return calls


def _parses(args: list[str]) -> None:
    """Parse args with the real CLI (typer's click command) without running anything."""
    command = typer.main.get_command(app)
    with command.make_context("zmqsync", list(args), resilient_parsing=False) as ctx:
        sub = command.get_command(ctx, args[0])  # type: ignore[attr-defined]
        assert sub is not None, f"{args[0]!r} is not a zmqsync command"
        sub.make_context(args[0], list(args[1:]), parent=ctx).close()


def test_dockerfile_builds_the_cli_on_cpu_torch() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+", text, re.M)
    assert re.search(r'pip install .*"torch==\$\{TORCH_VERSION\}" --index-url', text)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    for path in ("pyproject.toml", "zmqsync", "cli"):
        assert re.search(rf"^COPY .*\b{re.escape(path)}\b", text, re.M), path
    assert 'ENTRYPOINT ["zmqsync"]' in text


def test_every_compose_command_is_a_valid_cli_command() -> None:
    compose = _compose()
    services = compose["services"]
    assert set(services) == {"learner", "actor"}
    for service in services.values():
        _parses(service["command"])
        for call in _cli_args(service["healthcheck"]["test"]):
            _parses(call)
    # The check has teeth: a wrong option is refused.
    with pytest.raises(typer.TyperException, match="no-such-option"):
        _parses(["worker", "tcp://learner:5555", "--no-such-option"])


def test_compose_fleet_is_scalable_and_keyed() -> None:
    services = _compose()["services"]
    learner, actor = services["learner"], services["actor"]
    assert learner["command"][0] == "serve" and actor["command"][0] == "worker"
    # Scalable with --scale actor=N: no fixed name, no host ports, no per-replica id.
    assert "container_name" not in actor and "ports" not in actor
    assert (
        "--worker-idx" not in actor["command"] and "ZMQSYNC_WORKER_IDX" not in actor["environment"]
    )
    assert actor["depends_on"]["learner"]["condition"] == "service_healthy"
    # CURVE keys from files, mounted read-only.
    for service in (learner, actor):
        assert all(v.endswith(":ro") for v in service["volumes"])
        assert service["environment"]["ZMQSYNC_CURVE_SECRET"].startswith("/keys/")
    assert learner["environment"]["ZMQSYNC_CURVE_CLIENTS"] == "/keys/clients"
    assert actor["environment"]["ZMQSYNC_CURVE_SERVER_KEY"] == "/keys/learner.key"
    # Up to 3 descriptors per actor at the learner: room for thousands of actors.
    nofile = learner["ulimits"]["nofile"]
    assert nofile["soft"] >= 3 * 4096 and nofile["hard"] >= nofile["soft"]


def _mapped(value: str, tmp: Path, learner_address: str) -> str:
    return (
        value.replace("/keys", str(tmp / "keys"))
        .replace("/checkpoints", str(tmp / "checkpoints"))
        .replace("tcp://learner:", f"tcp://{learner_address}:")
    )


def _spawn(
    topo: Topology, host: str, args: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen(
        ["ip", "netns", "exec", topo.namespace(host), ZMQSYNC, *args],
        env={**os.environ, **env},
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen[bytes], within: float) -> None:
    deadline = time.monotonic() + within
    while not re.search(pattern, log.read_text(errors="replace")):
        assert proc.poll() is None, f"{log.name} exited:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"{pattern!r} never in {log.name}:\n{log.read_text()}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fleet_runs_with_the_compose_commands_across_namespaces(tmp_path: Path) -> None:
    if (reason := why_unavailable()) is not None:
        pytest.fail(reason)
    # The README's steps: keys with the CLI, a checkpoint the actors' factory fits.
    for where, name in (("keys", "learner"), ("keys/clients", "actor")):
        subprocess.run(
            [ZMQSYNC, "keys", str(tmp_path / where), "--name", name],
            check=True,
            capture_output=True,
            timeout=60,
        )
    (tmp_path / "checkpoints").mkdir()
    torch.save(demo_model().state_dict(), tmp_path / "checkpoints" / "policy.pt")

    services = _compose()["services"]
    procs: list[subprocess.Popen[bytes]] = []
    with Topology(["learner", "actor1", "actor2"]) as topo:
        address = topo.address("learner")
        try:
            learner = services["learner"]
            env = {k: _mapped(v, tmp_path, address) for k, v in learner["environment"].items()}
            args = [_mapped(a, tmp_path, address) for a in learner["command"]]
            llog = tmp_path / "learner.log"
            procs.append(_spawn(topo, "learner", args, env, llog))
            _wait_for(llog, r"listening on tcp://", procs[0], within=60)

            # The learner's healthcheck, as compose runs it, inside the learner's host.
            (check,) = _cli_args(learner["healthcheck"]["test"])
            check = [_mapped(a, tmp_path, address) for a in check]
            health = subprocess.run(
                ["ip", "netns", "exec", topo.namespace("learner"), ZMQSYNC, *check, "--json"],
                capture_output=True,
                timeout=60,
                env=env,
            )
            assert health.returncode in (0, 1), health.stderr.decode()

            actor = services["actor"]
            aenv = {k: _mapped(v, tmp_path, address) for k, v in actor["environment"].items()}
            aargs = [_mapped(a, tmp_path, address) for a in actor["command"]]
            logs = []
            for host in ("actor1", "actor2"):
                logs.append(tmp_path / f"{host}.log")
                procs.append(_spawn(topo, host, aargs, aenv, logs[-1]))
            for log, proc in zip(logs, procs[1:], strict=True):
                _wait_for(log, r"version 1\b", proc, within=90)

            # A new checkpoint (written, then renamed into place) reaches both actors.
            new = demo_model(seed=7).state_dict()
            torch.save(new, tmp_path / "checkpoints" / "policy.pt.tmp")
            os.replace(
                tmp_path / "checkpoints" / "policy.pt.tmp", tmp_path / "checkpoints" / "policy.pt"
            )
            for log, proc in zip(logs, procs[1:], strict=True):
                _wait_for(log, r"version 2\b", proc, within=60)

            # The actors' healthcheck command, from an actor host, with its environment.
            (acheck,) = _cli_args(actor["healthcheck"]["test"])
            acheck = [_mapped(a, tmp_path, address) for a in acheck]
            status = subprocess.run(
                ["ip", "netns", "exec", topo.namespace("actor1"), ZMQSYNC, *acheck, "--json"],
                capture_output=True,
                timeout=60,
                env={**os.environ, **aenv},
            )
            assert status.returncode == 0, status.stdout.decode() + status.stderr.decode()
            state = json.loads(status.stdout)
            assert state["version"] == 2
            assert sorted(w["worker"] for w in state["workers"]) == [0, 1]  # assigned ids
            assert all(w["version"] == 2 for w in state["workers"])
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
