"""A sharded learner whose ranks and workers are hosts of their own (network namespaces,
see netns.py), over tcp with CURVE on every rank's sockets: gloo's rendezvous and
collectives run over the hosts' links too; workers are given rank 0's endpoint alone and
open sessions with every rank, with the keys the ranks share. ``zmqsync status``, run on
another host, shows a row per rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _sharded_fixtures import Processes, answer, ask
from netns import Topology, why_unavailable

from zmqsync.security import CurveClient, CurveServer, create_curve_keypair

pytestmark = [pytest.mark.slow]

if (reason := why_unavailable()) is not None:
    pytest.fail(reason, pytrace=False)  # CI has both: missing them is an error, not a skip

PORT = 5555
GLOO_PORT = 29511
_SCRIPT = Path(sys.executable).with_name("zmqsync")
ZMQSYNC = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "zmqsync_cli"]


def _answer(conn: Any, what: str) -> Any:
    """A host process's reply (hosts are slower to start: a longer wait)."""
    return answer(conn, what, 120.0, who="a host process")


def _ask(conn: Any, command: str) -> Any:
    return ask(conn, command, 120.0, who="a host process")


def _keys(folder: Path) -> dict[str, Any]:
    """The learner's key pair (every rank binds with it), the allowed clients (the
    workers' and an operator's, for ``zmqsync status``) and a stranger's pair."""
    allowed = folder / "allowed"
    names = ("learner", "worker", "ops", "stranger")
    files = {
        n: create_curve_keypair(allowed if n in ("worker", "ops") else folder, n) for n in names
    }
    server = CurveServer.from_files(files["learner"][1], allowed_clients_dir=allowed)
    client = CurveClient.from_files(files["worker"][1], server_public_file=files["learner"][0])
    stranger = CurveClient.from_files(files["stranger"][1], server_public_file=files["learner"][0])
    return {"server": server, "client": client, "stranger": stranger, "files": files}


def _status(topo: Topology, host: str, endpoint: str, secret: Path, server_key: Path) -> Any:
    """``zmqsync status ENDPOINT --json`` run on ``host``, with that client's keys."""
    command = [
        "ip", "netns", "exec", topo.namespace(host), *ZMQSYNC, "status", endpoint, "--json",
        "--timeout", "3", "--curve-secret", str(secret), "--curve-server-key", str(server_key),
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=os.environ)


@pytest.mark.timeout(420)
def test_ranks_and_workers_on_hosts_of_their_own_over_tcp_with_curve(tmp_path: Path) -> None:
    """Two FSDP2 ranks (hosts r0, r1) and two workers (w0, w1), every socket CURVE:
    every version the workers hold is the gathered full model's; a worker whose key the
    ranks do not accept (host w2) gets nothing; ``zmqsync status`` on an operator's host
    shows both ranks (their endpoints, versions and bytes), a stopped rank as not
    answering, and answers no stranger."""
    from _sharded import run_host_rank, run_host_worker

    mode = "pubsub"  # CURVE on both of each rank's bound sockets (PUB and ROUTER)
    keys = _keys(tmp_path)
    topology = Topology(["r0", "r1", "w0", "w1", "w2", "ops"])
    with topology as topo, Processes(join=15.0, exited=20.0) as hosts:
        endpoints = [f"tcp://{topo.address(f'r{r}')}:{PORT}" for r in range(2)]
        ranks = []
        for r in range(2):
            options = {
                "endpoint": endpoints[r],
                "mode": mode,
                "curve_server": keys["server"],
                "timeout": 60,
                "connect_timeout": 120,
            }
            ranks.append(
                hosts.start(
                    run_host_rank,
                    topo.namespace(f"r{r}"),
                    topo.address("r0"),
                    r,
                    2,
                    GLOO_PORT,
                    options,
                )
            )
        epochs = {_answer(c, "ready")[1] for c in ranks}
        assert len(epochs) == 1  # one learner: rank 0's epoch, agreed over gloo
        workers = []
        for w in range(3):
            client = keys["client"] if w < 2 else keys["stranger"]
            options = {"mode": mode, "curve_client": client, "connect_timeout": 60}
            if w == 2:
                options["connect_timeout"] = 10  # it will not get in
            workers.append(
                hosts.start(run_host_worker, topo.namespace(f"w{w}"), endpoints[0], w, options)
            )
        for c in ranks:
            c.send("connect")  # the rendez-vous: workers 0 and 1 join
        answers = [_answer(c, "connect") for c in ranks]
        expected = answers[0][2]
        assert all(a[2] == expected for a in answers)  # the gathered model, on each rank
        assert _answer(workers[0], "ready")[0] == "ready"
        assert _answer(workers[1], "ready")[0] == "ready"
        for c in workers[:2]:
            assert _ask(c, "state")[:2] == (0, expected)
        for version in (1, 2, 3):
            for c in ranks:
                c.send("send")  # collective: each rank sends its own part
            answers = [_answer(c, "send") for c in ranks]
            assert {a[1] for a in answers} == {version}
            expected = answers[0][2]
            for c in workers[:2]:
                state = _ask(c, "state")
                assert state[:2] == (version, expected) and state[2] > 0
        # The stranger: refused at the handshake, it holds its own weights only.
        refused = _answer(workers[2], "ready")
        assert refused[0] == "refused", refused
        assert _ask(workers[2], "state") == (0, refused[2], 0)
        assert refused[2] != expected
        # Each rank's own status: its rank, every rank's endpoint, both workers.
        for r, c in enumerate(ranks):
            own = _ask(c, "status")[1]
            assert own["rank"] == r and own["ranks"] == endpoints
            assert own["workers_live"] == 2 and own["version"] == 3
        files = keys["files"]
        done = _status(topo, "ops", endpoints[0], files["ops"][1], files["learner"][0])
        assert done.returncode == 0, done.stdout + done.stderr
        doc = json.loads(done.stdout)
        rows = doc["rank_rows"]
        assert [(r["rank"], r["endpoint"], r["answered"], r["version"]) for r in rows] == [
            (0, endpoints[0], True, 3),
            (1, endpoints[1], True, 3),
        ]
        assert all(r["bytes_sent"] > 0 for r in rows) and doc["rank_problems"] == {}
        # Rank 1 stopped: its row says it does not answer, and the command returns.
        os.kill(hosts.procs[1].pid, signal.SIGSTOP)
        try:
            done = _status(topo, "ops", endpoints[0], files["ops"][1], files["learner"][0])
        finally:
            os.kill(hosts.procs[1].pid, signal.SIGCONT)
        assert done.returncode == 1, done.stdout + done.stderr
        rows = json.loads(done.stdout)["rank_rows"]
        assert [r["answered"] for r in rows] == [True, False]
        assert "rank 1 is not answering" in rows[1]["problem"]
        # A stranger's key: no sender answers it.
        done = _status(topo, "ops", endpoints[0], files["stranger"][1], files["learner"][0])
        assert done.returncode == 2 and "no zmqsync sender answered" in done.stderr
