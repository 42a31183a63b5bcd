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
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
import yaml
from netns import Topology, why_unavailable

from zmqsync.tools.client import demo_model
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


def _parses(args: list[str], env: dict[str, str] | None = None) -> None:
    """Parse args with the real CLI (typer's click command) without running anything,
    in the service's environment (arguments may come from it)."""
    command = typer.main.get_command(app)
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        with command.make_context("zmqsync", list(args), resilient_parsing=False) as ctx:
            sub = command.get_command(ctx, args[0])  # type: ignore[attr-defined]
            assert sub is not None, f"{args[0]!r} is not a zmqsync command"
            sub.make_context(args[0], list(args[1:]), parent=ctx).close()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_dockerfile_builds_the_cli_on_cpu_torch() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+", text, re.M)
    assert re.search(r'pip install .*"torch==\$\{TORCH_VERSION\}" --index-url', text)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    for path in ("pyproject.toml", "zmqsync", "cli"):
        assert re.search(rf"^COPY .*\b{re.escape(path)}\b", text, re.M), path
    assert 'ENTRYPOINT ["zmqsync"]' in text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_what_the_dockerfile_copies_builds_the_cli_and_the_c_extension(tmp_path: Path) -> None:
    """The image's install, without the engine: exactly the paths the Dockerfile copies,
    built into a wheel as its ``pip install`` builds them (setup.py missing from the
    copies once left the command line out of the package)."""
    root = DOCKER.parent
    text = (DOCKER / "Dockerfile").read_text()
    context = tmp_path / "context"
    context.mkdir()
    copied = 0
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        *sources, dest = line.split()
        for source in sources:
            target = context / (source if dest.endswith("/") or dest == "./" else dest)
            if (root / source).is_dir():
                shutil.copytree(
                    root / source, target, ignore=shutil.ignore_patterns("*.so", "__pycache__")
                )
            else:
                shutil.copy(root / source, target)
            copied += 1
    assert copied >= 5
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheels"),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("zmqsync-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "zmqsync_cli/main.py" in names
    assert "zmqsync/sender/lent.py" in names
    assert any(re.fullmatch(r"zmqsync/tensors/_streamcopy\..*\.so", n) for n in names), names


def test_every_compose_command_is_a_valid_cli_command() -> None:
    compose = _compose()
    services = compose["services"]
    assert set(services) == {"learner", "relay", "actor"}
    for service in services.values():
        _parses(service["command"], service["environment"])
        for call in _cli_args(service["healthcheck"]["test"]):
            _parses(call, service["environment"])
    # Without its environment, an actor has no upstream: the check reads it.
    with pytest.raises(typer.TyperException, match="Missing parameter: endpoint"):
        _parses(services["actor"]["command"])
    # The check has teeth: a wrong option is refused.
    with pytest.raises(typer.TyperException, match="no-such-option"):
        _parses(["worker", "tcp://learner:5555", "--no-such-option"])


def test_compose_fleet_is_scalable_and_keyed() -> None:
    services = _compose()["services"]
    learner, relay, actor = services["learner"], services["relay"], services["actor"]
    assert learner["command"][0] == "serve" and actor["command"][0] == "worker"
    assert relay["command"][0] == "relay"
    # Scalable with --scale relay=R --scale actor=N: no fixed name, no host ports, no
    # per-replica id.
    for service, idx in ((relay, "--relay-idx"), (actor, "--worker-idx")):
        assert "container_name" not in service and "ports" not in service
        assert idx not in service["command"]
        assert not {"ZMQSYNC_WORKER_IDX", "ZMQSYNC_RELAY_IDX"} & service["environment"].keys()
    # Actors reach a relay (by its service name), relays the learner.
    assert actor["environment"]["ZMQSYNC_UPSTREAM"] == "tcp://relay:5555"
    assert relay["environment"]["ZMQSYNC_UPSTREAM"] == "tcp://learner:5555"
    assert actor["depends_on"]["relay"]["condition"] == "service_healthy"
    assert relay["depends_on"]["learner"]["condition"] == "service_healthy"
    # CURVE keys from files, mounted read-only, on every hop.
    for service in (learner, relay, actor):
        assert all(v.endswith(":ro") for v in service["volumes"])
        assert service["environment"]["ZMQSYNC_CURVE_SECRET"].startswith("/keys/")
    for service in (learner, relay):
        assert service["environment"]["ZMQSYNC_CURVE_CLIENTS"] == "/keys/clients"
    assert relay["environment"]["ZMQSYNC_CURVE_SERVER_KEY"] == "/keys/learner.key"
    # Only the relays' key may claim the actors below it.
    assert learner["environment"]["ZMQSYNC_CURVE_RELAYS"] == "/keys/clients/relay.key"
    assert actor["environment"]["ZMQSYNC_CURVE_SERVER_KEY"] == "/keys/clients/relay.key"
    # Up to 3 descriptors per peer at the learner and the relays: room for thousands.
    for service in (learner, relay):
        nofile = service["ulimits"]["nofile"]
        assert nofile["soft"] >= 3 * 4096 and nofile["hard"] >= nofile["soft"]
    # Metrics on a documented port, served to the compose network.
    for service in (learner, relay):
        command = service["command"]
        assert command[command.index("--metrics-port") + 1] == "9100"
        assert "9100" in service["expose"]


def _mapped(value: str, tmp: Path, learner_address: str, relay_address: str = "") -> str:
    return (
        value.replace("/keys", str(tmp / "keys"))
        .replace("/checkpoints", str(tmp / "checkpoints"))
        .replace("tcp://learner:", f"tcp://{learner_address}:")
        .replace("tcp://relay:", f"tcp://{relay_address}:")
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
@pytest.mark.timeout(300)
def test_fleet_runs_with_the_compose_commands_across_namespaces(tmp_path: Path) -> None:
    if (reason := why_unavailable()) is not None:
        pytest.fail(reason)
    # The README's steps: keys with the CLI, a checkpoint the actors' factory fits.
    for where, name in (("keys", "learner"), ("keys/clients", "relay"), ("keys/clients", "actor")):
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
    with Topology(["learner", "relay", "actor1", "actor2"]) as topo:
        address, relay_address = topo.address("learner"), topo.address("relay")

        def mapped(values: list[str]) -> list[str]:
            return [_mapped(v, tmp_path, address, relay_address) for v in values]

        def environment(service: dict[str, Any]) -> dict[str, str]:
            return {
                k: _mapped(v, tmp_path, address, relay_address)
                for k, v in service["environment"].items()
            }

        def health(host: str, service: dict[str, Any]) -> dict[str, Any]:
            (check,) = _cli_args(service["healthcheck"]["test"])
            done = subprocess.run(
                ["ip", "netns", "exec", topo.namespace(host), ZMQSYNC, *mapped(check), "--json"],
                capture_output=True,
                timeout=60,
                env={**os.environ, **environment(service)},
            )
            assert done.returncode in (0, 1), done.stdout.decode() + done.stderr.decode()
            return json.loads(done.stdout)  # type: ignore[no-any-return]

        try:
            learner, relay, actor = services["learner"], services["relay"], services["actor"]
            llog = tmp_path / "learner.log"
            procs.append(
                _spawn(topo, "learner", mapped(learner["command"]), environment(learner), llog)
            )
            _wait_for(llog, r"listening on tcp://", procs[0], within=60)
            health("learner", learner)  # as compose runs it, inside the learner's host

            rlog = tmp_path / "relay.log"
            procs.append(_spawn(topo, "relay", mapped(relay["command"]), environment(relay), rlog))
            _wait_for(rlog, r"zmqsync relay: listening on tcp://", procs[1], within=60)
            health("relay", relay)

            logs = []
            for host in ("actor1", "actor2"):
                logs.append(tmp_path / f"{host}.log")
                procs.append(
                    _spawn(topo, host, mapped(actor["command"]), environment(actor), logs[-1])
                )
            for log, proc in zip(logs, procs[2:], strict=True):
                _wait_for(log, r"version 1\b", proc, within=90)

            # A new checkpoint (written, then renamed into place) reaches both actors
            # through the relay.
            new = demo_model(seed=7).state_dict()
            torch.save(new, tmp_path / "checkpoints" / "policy.pt.tmp")
            os.replace(
                tmp_path / "checkpoints" / "policy.pt.tmp", tmp_path / "checkpoints" / "policy.pt"
            )
            for log, proc in zip(logs, procs[2:], strict=True):
                _wait_for(log, r"version 2\b", proc, within=60)
            _wait_for(llog, r"version 2: .* synced to 1 workers", procs[0], within=30)

            # The actors' healthcheck, from an actor's host: the relay and its actors.
            state = health("actor1", actor)
            assert state["version"] == 2
            assert sorted(w["worker"] for w in state["workers"]) == [0, 1]  # assigned ids
            assert all(w["version"] == 2 for w in state["workers"])
            # The learner sees one peer, the relay, and the two actors behind it.
            deadline = time.monotonic() + 30
            while True:
                top = health("learner", learner)
                below = top["workers"][0].get("below") or {}
                if below == {"0": 2, "1": 2} or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert [w["version"] for w in top["workers"]] == [2] and below == {"0": 2, "1": 2}
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
