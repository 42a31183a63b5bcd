"""The ``zmqsync`` commands' arguments and errors, in-process with typer's CliRunner.

Senders and workers here are real (ZeroMQ over tcp on 127.0.0.1, free ports), running
in this process; ``tests/test_cli_processes.py`` runs the same commands as processes.
"""

from __future__ import annotations

import json
import pickle
import re
import socket
import stat
import sys
import threading
import time
import uuid
import zipfile
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.auth
from _ranks import ShardedFleet
from typer.testing import CliRunner

from zmqsync import ZMQWeightSyncScheme, checksum
from zmqsync.errors import EndpointError, SchemaMismatchError, SyncTimeout
from zmqsync.tools.client import (
    CheckpointError,
    CheckpointPublisher,
    FactoryError,
    ModelWorker,
    assess,
    build_model,
    curve_client_from_files,
    curve_server_from_files,
    demo_model,
    load_checkpoint,
    query_status,
)
from zmqsync_cli.main import app

ROW = re.compile(r"^\s*[│|]\s*(\d+)\s*[│|]\s*(\d+)\s*[│|]\s*(\d+)\s*[│|]", re.MULTILINE)
COMMANDS = ["demo", "status", "watch", "serve", "worker", "relay", "keys"]


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.delenv("ZMQSYNC_DEBUG", raising=False)
    return CliRunner()


def _one_error_line(result: Any) -> str:
    """The command failed with exactly one line on stderr and no traceback."""
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


class Fleet:
    """A sender over tcp and N receivers in this process (each with its own model)."""

    def __init__(self, n: int, *, fixed: bool = True) -> None:
        self.model = demo_model(0.01)
        self.scheme = ZMQWeightSyncScheme("state_dict", endpoint="tcp://127.0.0.1:*", timeout=10)
        self.scheme.init_on_sender("policy", model=self.model, num_workers=n if fixed else None)
        self.workers: list[ZMQWeightSyncScheme] = []
        for i in range(n):
            worker = pickle.loads(pickle.dumps(self.scheme))
            worker.init_on_receiver(model_id="policy", model=demo_model(0.01, seed=9), worker_idx=i)
            self.workers.append(worker)
        for worker in self.workers:
            worker.connect(timeout=10)
            worker.start_receiver_thread()

    @property
    def endpoint(self) -> str:
        return str(self.scheme.endpoint)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheme.shutdown()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet(2)
    try:
        yield f
    finally:
        f.close()


def _free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


# --- the app -------------------------------------------------------------------------


def test_console_script_points_at_the_app() -> None:
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "zmqsync"]
    assert script.value == "zmqsync_cli.main:main"


def test_no_arguments_shows_help(runner: CliRunner) -> None:
    result = runner.invoke(app, [])
    for command in COMMANDS:
        assert command in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_explains_itself(runner: CliRunner, command: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: zmqsync " + command in " ".join(result.output.split())
    assert len(result.output.split()) > 30  # a description and options, not just usage


def test_version(runner: CliRunner) -> None:
    import zmqsync

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"zmqsync {zmqsync.__version__}"


def test_unknown_command_is_a_usage_error(runner: CliRunner) -> None:
    result = runner.invoke(app, ["stauts"])
    assert result.exit_code == 2
    assert "No such command" in result.output


# --- status --------------------------------------------------------------------------


def test_status_table_when_every_worker_is_current(runner: CliRunner, fleet: Fleet) -> None:
    fleet.scheme.send()
    fleet.scheme.send()
    result = runner.invoke(app, ["status", fleet.endpoint])
    assert result.exit_code == 0, result.output
    rows = {int(w): (int(v), int(lag)) for w, v, lag in ROW.findall(result.stdout)}
    assert rows == {0: (2, 0), 1: (2, 0)}
    assert "all 2 workers hold version 2" in result.stdout
    assert f"endpoint {fleet.endpoint}" in result.stdout
    assert "sent 2 versions" in result.stdout


def test_status_json_and_exit_1_when_a_worker_lags(runner: CliRunner, fleet: Fleet) -> None:
    fleet.scheme.send()
    fleet.scheme.send(worker_ids=[0])  # worker 1 stays at version 1
    result = runner.invoke(app, ["status", fleet.endpoint, "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["version"] == 2
    assert {w["worker"]: (w["version"], w["lag"]) for w in doc["workers"]} == {0: (2, 0), 1: (1, 1)}
    assert doc["problems"] == {"1": "worker 1 holds version 1 of 2 (1 behind)"}
    assert doc["model_id"] == "policy" and doc["endpoint"] == fleet.endpoint

    table = runner.invoke(app, ["status", fleet.endpoint])
    assert table.exit_code == 1
    assert "behind 1" in table.stdout
    assert "1 of 2 workers need attention: worker 1 holds version 1 of 2" in table.stdout


def test_status_exit_1_when_an_expected_worker_never_connected(runner: CliRunner) -> None:
    scheme = ZMQWeightSyncScheme("state_dict", endpoint="tcp://127.0.0.1:*")
    scheme.init_on_sender("policy", model=demo_model(0.01), num_workers=3)
    try:
        result = runner.invoke(app, ["status", str(scheme.endpoint), "--json"])
        assert result.exit_code == 1
        problems = json.loads(result.stdout)["problems"]
        assert problems == {str(w): f"worker {w} has not connected" for w in range(3)}
        table = runner.invoke(app, ["status", str(scheme.endpoint)])
        assert len(re.findall(r"[│|] not connected", table.stdout)) == 3
    finally:
        scheme.shutdown()


def test_status_reports_a_silent_worker(runner: CliRunner, fleet: Fleet) -> None:
    fleet.scheme.send()
    fleet.workers[1].get_receiver().stop()  # alive but no longer heard: no heartbeats
    # A heartbeat is due every second; wait until it has been missed.
    deadline = time.monotonic() + 10
    while True:
        result = runner.invoke(app, ["status", fleet.endpoint, "--json", "--silent-after", "1.5"])
        if result.exit_code == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert result.exit_code == 1, result.output
    problems = json.loads(result.stdout)["problems"]
    assert list(problems) == ["1"] and "silent" in problems["1"]


@pytest.mark.parametrize("fixed", [True, False])
def test_status_shows_a_worker_that_left(runner: CliRunner, fixed: bool) -> None:
    """A worker that closed its receiver is "left": a problem where the fleet has a fixed
    size that counts it, not where the fleet is whoever connected."""
    fleet = Fleet(2, fixed=fixed)
    try:
        fleet.scheme.send()
        fleet.workers[1].shutdown()  # says goodbye
        deadline = time.monotonic() + 10
        while not fleet.scheme.status()["workers"][1]["left"]:
            assert time.monotonic() < deadline, "the goodbye never arrived"
            time.sleep(0.02)
        result = runner.invoke(app, ["status", fleet.endpoint])
        rows = {
            int(m.group(1)): line for line in result.stdout.splitlines() if (m := ROW.match(line))
        }
        assert "left" in rows[1] and "ok" in rows[0], result.stdout
        result = runner.invoke(app, ["status", fleet.endpoint, "--json"])
        problems = json.loads(result.stdout)["problems"]
        if fixed:
            assert result.exit_code == 1
            assert list(problems) == ["1"] and "left" in problems["1"]
        else:
            assert result.exit_code == 0 and problems == {}
    finally:
        fleet.close()


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("localhost:5555", "is not an address"),
        ("tcp://127.0.0.1", "needs a host and a port"),
        ("udp://127.0.0.1:5555", "not supported"),
        ("tcp://127.0.0.1:*", "only a sender can bind"),
    ],
)
def test_status_malformed_endpoint(runner: CliRunner, endpoint: str, says: str) -> None:
    result = runner.invoke(app, ["status", endpoint])
    assert result.exit_code == 2
    assert says in _one_error_line(result)


def test_status_unreachable_endpoint_exits_2(runner: CliRunner) -> None:
    endpoint = _free_tcp_endpoint()
    result = runner.invoke(app, ["status", endpoint, "--timeout", "0.3"])
    assert result.exit_code == 2
    line = _one_error_line(result)
    assert f"no zmqsync sender answered at {endpoint} within 0.3s" in line
    assert "is the learner running" in line


def test_debug_shows_the_traceback(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--debug", "status", _free_tcp_endpoint(), "--timeout", "0.2"])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "SyncTimeout" in result.stderr
    assert "error: no zmqsync sender answered" in result.stderr


def test_status_timeout_must_be_positive(runner: CliRunner) -> None:
    result = runner.invoke(app, ["status", "tcp://127.0.0.1:5555", "--timeout", "0"])
    assert result.exit_code == 2
    assert "--timeout" in result.output


def test_query_status_is_the_senders_own_status(fleet: Fleet) -> None:
    fleet.scheme.send()
    remote, local = query_status(fleet.endpoint), fleet.scheme.status()
    assert remote["epoch"] == local["epoch"] and remote["version"] == local["version"] == 1
    assert [w["worker"] for w in remote["workers"]] == [0, 1]
    assert assess(remote) == {}


def test_query_status_errors() -> None:
    with pytest.raises(EndpointError):
        query_status("nonsense")
    with pytest.raises(SyncTimeout, match="no zmqsync sender answered"):
        query_status(_free_tcp_endpoint(), timeout=0.2)


# --- watch ---------------------------------------------------------------------------


def test_watch_refreshes_count_times(runner: CliRunner, fleet: Fleet) -> None:
    fleet.scheme.send()
    result = runner.invoke(app, ["watch", fleet.endpoint, "--count", "3", "--interval", "0.05"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("all 2 workers hold version 1") == 3
    assert len(ROW.findall(result.stdout)) == 6


def test_watch_keeps_going_while_the_sender_is_away(runner: CliRunner) -> None:
    endpoint = _free_tcp_endpoint()
    result = runner.invoke(
        app, ["watch", endpoint, "--count", "2", "--interval", "0.05", "--timeout", "0.1"]
    )
    assert result.exit_code == 0
    assert result.stdout.count("no answer: no zmqsync sender answered") == 2


def test_status_and_watch_refuse_a_malformed_status_in_one_line(runner: CliRunner) -> None:
    """What answers is not trusted: a status of the wrong shape is one error line (exit
    2) for status, and a line of its own for watch, which keeps asking."""
    from zmqsync.protocol import StatusReply, encode

    reply = encode(StatusReply("policy", 1, 2, {"version": 1, "workers": [{"worker": "0"}]}))
    impostor = zmq.Context.instance().socket(zmq.ROUTER)
    impostor.linger = 0
    endpoint = f"tcp://127.0.0.1:{impostor.bind_to_random_port('tcp://127.0.0.1')}"

    def answer(requests: int) -> None:  # status asks once, watch --count 2 twice
        for _ in range(requests):
            if impostor.poll(10_000):
                peer, *_ = impostor.recv_multipart()
                impostor.send_multipart([peer, *reply])

    answering = threading.Thread(target=answer, args=(3,), daemon=True)
    answering.start()
    try:
        result = runner.invoke(app, ["status", endpoint, "--timeout", "10"])
        assert result.exit_code == 2
        assert "workers[0].worker must be an integer" in _one_error_line(result)
        result = runner.invoke(app, ["watch", endpoint, "--count", "2", "--interval", "0.05"])
        assert result.exit_code == 0
        assert result.stdout.count("workers[0].worker must be an integer") == 2
    finally:
        answering.join(30)
        impostor.close()


def test_watch_malformed_endpoint(runner: CliRunner) -> None:
    result = runner.invoke(app, ["watch", "tcp://nowhere", "--count", "1"])
    assert result.exit_code == 2
    assert "needs a host and a port" in _one_error_line(result)


# --- serve ---------------------------------------------------------------------------


def test_serve_missing_checkpoint(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["serve", str(tmp_path / "nope.pt"), "--endpoint", "tcp://127.0.0.1:*"]
    )
    assert result.exit_code == 1
    line = _one_error_line(result)
    assert "nope.pt does not exist" in line and "torch.save(model.state_dict()" in line


def test_serve_checkpoint_that_is_not_tensors(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": demo_model(0.01).state_dict(), "step": 7}, path)
    result = runner.invoke(app, ["serve", str(path), "--endpoint", "tcp://127.0.0.1:*"])
    assert result.exit_code == 1
    line = _one_error_line(result)
    assert "'step' is a int, not a tensor" in line and "use --key" in line and "model" in line


def test_serve_checkpoint_that_holds_code(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "module.pt"
    torch.save(demo_model(0.01), path)  # a pickled module: weights_only refuses it
    result = runner.invoke(app, ["serve", str(path), "--endpoint", "tcp://127.0.0.1:*"])
    assert result.exit_code == 1
    line = _one_error_line(result)
    assert "weights_only=True" in line and "torch.nn.modules.container.Sequential" in line


def test_serve_garbage_file(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "garbage.pt"
    path.write_bytes(b"not a checkpoint at all")
    result = runner.invoke(app, ["serve", str(path), "--endpoint", "tcp://127.0.0.1:*"])
    assert "cannot read" in _one_error_line(result)


def test_serve_malformed_endpoint_and_mode(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "policy.pt"
    torch.save(demo_model(0.01).state_dict(), path)
    result = runner.invoke(app, ["serve", str(path), "--endpoint", "127.0.0.1:5555"])
    assert result.exit_code == 1
    assert "is not an address" in _one_error_line(result)
    result = runner.invoke(app, ["serve", str(path), "--mode", "broadcast"])
    assert result.exit_code == 2
    assert "broadcast" in result.output


def test_serve_endpoint_in_use(runner: CliRunner, tmp_path: Path, fleet: Fleet) -> None:
    path = tmp_path / "policy.pt"
    torch.save(demo_model(0.01).state_dict(), path)
    result = runner.invoke(app, ["serve", str(path), "--endpoint", fleet.endpoint])
    assert result.exit_code == 1
    assert "another process holds it" in _one_error_line(result)


def test_load_checkpoint_formats_and_key(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = demo_model(0.01)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(tmp_path / "m.safetensors"))
    torch.save({"model": sd, "optim": {"lr": torch.tensor(0.1)}}, tmp_path / "nested.pt")
    loaded = load_checkpoint(tmp_path / "m.safetensors")
    assert checksum(loaded) == checksum(model)
    assert checksum(load_checkpoint(tmp_path / "nested.pt", key="model")) == checksum(model)
    flat = load_checkpoint(tmp_path / "nested.pt")  # all tensors: flattened to dotted names
    assert "model.0.weight" in flat and "optim.lr" in flat
    with pytest.raises(CheckpointError, match="has no entry 'nope'"):
        load_checkpoint(tmp_path / "nested.pt", key="nope")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="as safetensors"):
        load_checkpoint(tmp_path / "bad.safetensors")


def _deflated(src: Path, dst: Path) -> None:
    """``src``'s zip entries deflated into ``dst``: what torch.save never writes."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for info in z.infolist():
            out.writestr(info.filename, z.read(info), compress_type=zipfile.ZIP_DEFLATED)


def test_load_checkpoint_refuses_tensors_larger_than_their_file(tmp_path: Path) -> None:
    """Every tensor must be distinct bytes of the file: views that name more bytes than
    are stored (expanded, overlapping), tensors with no data in the file, entries that
    name one tensor many times, and deflated entries are refused before anything is
    copied; checking them never materialises them."""
    weights = torch.rand(16)
    nested: dict[str, Any] = {str(i): weights for i in range(100)}
    for _ in range(2):  # 100**3 names of one tensor, from a file of about 10 KB
        nested = {str(i): nested for i in range(100)}
    cycle: dict[str, Any] = {"w": torch.zeros(2)}
    cycle["again"] = cycle
    hostile = {
        # 1 GiB of float32 from a file of 1.5 KB
        "expanded": ({"w": torch.zeros(1).expand(2**28)}, "names 1073741824 bytes but its"),
        "overlapping": (
            {"w": torch.rand(10).as_strided((5, 5), (1, 1))},
            "an expanded or overlapping view",
        ),
        "meta": ({"w": torch.empty(2**28, device="meta")}, "on meta, not a dense one"),
        "sparse": ({"w": torch.eye(4).to_sparse()}, "sparse_coo tensor"),
        "aliased": (nested, "add up to more than 4 times its size"),
        "cycle": (cycle, "entry 'again' contains itself"),
    }
    for name, (contents, why) in hostile.items():
        torch.save(contents, tmp_path / f"{name}.pt")
        with pytest.raises(CheckpointError, match=re.escape(why)):
            load_checkpoint(tmp_path / f"{name}.pt")
    torch.save({"w": torch.zeros(2**20)}, tmp_path / "plain.pt")
    _deflated(tmp_path / "plain.pt", tmp_path / "deflated.pt")
    assert (tmp_path / "deflated.pt").stat().st_size < 2**16  # 4 MiB of zeros, deflated
    with pytest.raises(CheckpointError, match="compressed entries"):
        load_checkpoint(tmp_path / "deflated.pt")

    # Views that are distinct stored bytes, and tied weights, still load.
    base = torch.rand(3, 4)
    fine = {"t": base.t(), "part": torch.rand(10)[2:5], "embed": base, "head": base}
    torch.save(fine, tmp_path / "fine.pt")
    loaded = load_checkpoint(tmp_path / "fine.pt")
    assert all(torch.equal(loaded[k], v) for k, v in fine.items())


def test_publisher_and_model_worker_follow_a_changing_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.pt"
    torch.save(demo_model(0.01, seed=1).state_dict(), path)
    with CheckpointPublisher(path, endpoint="tcp://127.0.0.1:*", num_workers=1, timeout=10) as pub:
        first = pub.start()
        assert first.version == 1 and first.targets == [] and not pub.changed()
        with ModelWorker(pub.endpoint, demo_model(0.01, seed=5), worker_idx=0) as worker:
            assert worker.connect(timeout=10) == 1
            assert checksum(worker.model) == checksum(demo_model(0.01, seed=1))
            new = demo_model(0.01, seed=2)
            torch.save(new.state_dict(), tmp_path / "next.pt")
            (tmp_path / "next.pt").replace(path)
            assert pub.changed()
            # The worker must be receiving while the publisher waits for its ack.
            got: list[int | None] = []
            t = threading.Thread(target=lambda: got.append(worker.wait_for_version(10)))
            t.start()
            seen: list[tuple[int, int]] = []
            result = pub.publish(progress=lambda a, n: seen.append((a, n)))
            t.join(15)
            assert result.ok and result.version == 2 and result.targets == [0]
            assert got == [2] and seen[-1] == (1, 1)
            assert checksum(worker.model) == checksum(new)
            assert assess(pub.status()) == {}


def test_publisher_keeps_serving_through_a_bad_file_and_reports_refusals(tmp_path: Path) -> None:
    path = tmp_path / "policy.pt"
    good = demo_model(0.01, seed=1)
    torch.save(good.state_dict(), path)
    with CheckpointPublisher(path, endpoint="tcp://127.0.0.1:*", num_workers=1, timeout=3) as pub:
        pub.start()
        with ModelWorker(pub.endpoint, demo_model(0.01, seed=5), worker_idx=0) as worker:
            worker.connect(timeout=10)
            path.write_bytes(b"half a checkpoi")  # what a non-atomic writer leaves behind
            assert pub.changed()
            with pytest.raises(CheckpointError, match="cannot read"):
                pub.publish()
            assert not pub.changed() and pub.version == 1  # reported once; v1 still served

            # A checkpoint of another architecture: the worker refuses it, keeps its
            # weights, and the publisher says who refused and why.
            torch.save(torch.nn.Linear(3, 3).state_dict(), path)
            got: list[int | None] = []
            t = threading.Thread(target=lambda: got.append(worker.wait_for_version(5)))
            t.start()
            result = pub.publish()
            t.join(10)
            assert not result.ok and result.version == 2
            assert list(result.rejected) == [0] and "weights" in result.rejected[0]
            assert got == [None] and worker.version == 1
            assert checksum(worker.model) == checksum(good)
            assert any("version 2" in r for r in worker.new_rejections())
            problems = assess(pub.status(), silent_after=None)
            assert list(problems) == [0]
            assert problems[0].startswith("worker 0 holds version 1 of 2 (1 behind); it refused:")
            assert "weights" in problems[0]


# --- worker --------------------------------------------------------------------------


@pytest.fixture
def factory_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module in the working directory with factories, under a name unique to this test."""
    name = f"factories_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "from zmqsync.tools.client import demo_model\n"
        "def make_policy():\n    return demo_model(0.01, seed=3)\n"
        "def make_other():\n    return torch.nn.Linear(3, 3)\n"
        "def broken():\n    raise RuntimeError('no GPU here')\n"
        "def not_a_model():\n    return 42\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_factory adds the cwd: undo it
    return name


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_colon_here", "is not MODULE:FACTORY"),
        ("zmqsync_no_such_module:make", "cannot import module 'zmqsync_no_such_module'"),
        ("{m}:make_polcy", "has no attribute 'make_polcy'; did you mean {m}:make_policy?"),
        ("{m}:broken", "calling the factory failed: RuntimeError: no GPU here"),
        ("{m}:not_a_model", "gave a int; the factory must return an nn.Module"),
    ],
)
def test_worker_factory_errors(
    runner: CliRunner, factory_module: str, spec: str, says: str
) -> None:
    result = runner.invoke(
        app, ["worker", "tcp://127.0.0.1:5555", "--model", spec.format(m=factory_module)]
    )
    assert result.exit_code == 1
    assert says.format(m=factory_module) in _one_error_line(result)


def test_worker_unreachable_endpoint(runner: CliRunner, factory_module: str) -> None:
    endpoint = _free_tcp_endpoint()
    result = runner.invoke(
        app, ["worker", endpoint, "--model", f"{factory_module}:make_policy", "--timeout", "0.5"]
    )
    assert result.exit_code == 1
    assert f"no zmqsync sender answered at {endpoint}" in _one_error_line(result)


def test_worker_malformed_endpoint(runner: CliRunner, factory_module: str) -> None:
    result = runner.invoke(
        app, ["worker", "tcp//127.0.0.1:5555", "--model", f"{factory_module}:make_policy"]
    )
    assert "is not an address" in _one_error_line(result)


def test_worker_model_that_does_not_fit_the_checkpoint(
    runner: CliRunner, factory_module: str, tmp_path: Path
) -> None:
    path = tmp_path / "policy.pt"
    torch.save(demo_model(0.01).state_dict(), path)
    with CheckpointPublisher(path, endpoint="tcp://127.0.0.1:*") as pub:
        pub.start()
        result = runner.invoke(
            app,
            ["worker", pub.endpoint, "--model", f"{factory_module}:make_other", "--timeout", "20"],
        )
        assert result.exit_code == 1
        line = _one_error_line(result)
        assert "do not fit this worker's model" in line
        assert "weights lack 'weight'" in line or "which the model lacks" in line
        assert "build the model the learner's weights come from" in line


def test_build_model_and_model_worker_errors(factory_module: str) -> None:
    assert isinstance(build_model(f"{factory_module}:make_policy"), torch.nn.Module)
    with pytest.raises(FactoryError):
        build_model("json:nonexistent_thing")
    with pytest.raises(EndpointError):
        ModelWorker("nowhere", torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="worker_idx"):
        ModelWorker("tcp://127.0.0.1:5555", torch.nn.Linear(1, 1), worker_idx=-1)
    assert issubclass(SchemaMismatchError, ValueError)


def test_worker_strategy_must_be_known(runner: CliRunner) -> None:
    result = runner.invoke(
        app, ["worker", "tcp://127.0.0.1:5555", "--model", "m:f", "--strategy", "pickle"]
    )
    assert result.exit_code == 2


# --- keys ----------------------------------------------------------------------------


def test_keys_writes_a_curve_pair(runner: CliRunner, tmp_path: Path) -> None:
    directory = tmp_path / "certs" / "learner"
    result = runner.invoke(app, ["keys", str(directory), "--name", "learner"])
    assert result.exit_code == 0, result.output
    public, secret = directory / "learner.key", directory / "learner.key_secret"
    assert f"public key: {public}" in result.stdout and f"secret key: {secret}" in result.stdout
    pub, sec = zmq.auth.load_certificate(secret)
    assert len(pub) == 40 and sec is not None and len(sec) == 40
    assert zmq.auth.load_certificate(public) == (pub, None)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600

    again = runner.invoke(app, ["keys", str(directory), "--name", "learner"])
    assert again.exit_code == 1
    assert "already exists" in _one_error_line(again)
    forced = runner.invoke(app, ["keys", str(directory), "--name", "learner", "--force"])
    assert forced.exit_code == 0
    assert zmq.auth.load_certificate(secret)[0] != pub


def test_keys_rejects_a_path_as_name(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["keys", str(tmp_path), "--name", "../escape"])
    assert result.exit_code == 1
    assert "plain file name" in _one_error_line(result)


# --- demo (arguments; the run itself is in test_cli_processes.py) --------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--workers", "0"],
        ["--versions", "0"],
        ["--mode", "fanout"],
        ["--transport", "udp"],
        ["--size-mb", "0"],
    ],
)
def test_demo_argument_errors(runner: CliRunner, args: list[str]) -> None:
    result = runner.invoke(app, ["demo", *args])
    assert result.exit_code == 2
    assert "Invalid value" in result.output


def test_demo_model_size() -> None:
    for mb in (0.5, 1, 4):
        nbytes = sum(p.numel() * 4 for p in demo_model(mb).parameters())
        assert abs(nbytes / 2**20 - mb) / mb < 0.02


# --- CURVE ---------------------------------------------------------------------------


def test_serve_refuses_a_public_address_without_keys(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "policy.pt"
    torch.save(demo_model(0.01).state_dict(), path)
    result = runner.invoke(app, ["serve", str(path), "--endpoint", "tcp://0.0.0.0:*"])
    assert result.exit_code == 1
    line = _one_error_line(result)
    assert "reachable from other hosts" in line and "--curve-secret" in line
    assert "--insecure" in line


def test_curve_options_go_together(runner: CliRunner, tmp_path: Path) -> None:
    assert runner.invoke(app, ["keys", str(tmp_path), "--name", "w"]).exit_code == 0
    result = runner.invoke(
        app, ["status", "tcp://127.0.0.1:5555", "--curve-secret", str(tmp_path / "w.key_secret")]
    )
    assert result.exit_code == 2
    assert "sender's public key file" in _one_error_line(result)
    result = runner.invoke(
        app,
        [
            "worker",
            "tcp://127.0.0.1:5555",
            "--model",
            "m:f",
            "--curve-secret",
            str(tmp_path / "nope.key_secret"),
            "--curve-server-key",
            str(tmp_path / "w.key"),
        ],
    )
    assert result.exit_code == 1
    assert "does not exist; create keys with `zmqsync keys DIR`" in _one_error_line(result)


def test_status_and_worker_with_curve_keys(runner: CliRunner, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    for name, where in (("server", keys), ("worker", keys / "clients"), ("stranger", keys)):
        assert runner.invoke(app, ["keys", str(where), "--name", name]).exit_code == 0
    path = tmp_path / "policy.pt"
    model = demo_model(0.01, seed=4)
    torch.save(model.state_dict(), path)
    server = curve_server_from_files(keys / "server.key_secret", keys / "clients")
    with CheckpointPublisher(path, endpoint="tcp://127.0.0.1:*", curve=server) as pub:
        pub.start()
        client = curve_client_from_files(
            keys / "clients" / "worker.key_secret", keys / "server.key"
        )
        with ModelWorker(pub.endpoint, demo_model(0.01), curve=client) as worker:
            assert worker.connect(timeout=10) == 1
            assert checksum(worker.model) == checksum(model)

            # connect() returns once the worker applied and sent its ack; the sender may
            # hear a status request first, so ask until it has heard the ack.
            deadline = time.monotonic() + 10
            while True:
                allowed = runner.invoke(
                    app,
                    [
                        "status",
                        pub.endpoint,
                        "--json",
                        "--curve-secret",
                        str(keys / "clients" / "worker.key_secret"),
                        "--curve-server-key",
                        str(keys / "server.key"),
                    ],
                )
                if allowed.exit_code != 1 or time.monotonic() > deadline:
                    break
            assert allowed.exit_code == 0, allowed.output
            assert [w["version"] for w in json.loads(allowed.stdout)["workers"]] == [1]

            for extra in (
                [],
                [
                    "--curve-secret",
                    str(keys / "stranger.key_secret"),
                    "--curve-server-key",
                    str(keys / "server.key"),
                ],
            ):
                refused = runner.invoke(app, ["status", pub.endpoint, "--timeout", "0.5", *extra])
                assert refused.exit_code == 2
                # The refused handshake leaves the request unanswered, or (when the
                # learner refused it before the request was queued, as on a busy host)
                # with no connection to queue it to: either way, no status.
                line = _one_error_line(refused)
                assert "no zmqsync sender answered" in line or "could not reach" in line, line
                assert f"{pub.endpoint} within 0.5s" in line
                assert "keys it accepts" in line or "accept these keys" in line, line


def test_the_verdict_counts_every_worker_of_a_trimmed_status() -> None:
    """A large fleet's status carries its furthest-behind rows only: the verdict counts
    the whole fleet and says how many rows it shows."""
    from zmqsync.status_types import SenderStatus
    from zmqsync_cli._common import verdict

    rows = [{"worker": w, "connected": True, "version": 3, "lag": 0} for w in (0, 1)]
    status = SenderStatus.from_dict({"version": 3, "workers": rows, "workers_total": 5000})
    text = verdict(status, {}).plain
    assert text == "all 5000 workers hold version 3 (2 shown, the furthest behind)"
    behind = verdict(status, {1: "worker 1 holds version 2 of 3 (1 behind)"}).plain
    assert behind.startswith("1 of 5000 workers need attention (2 shown, the furthest behind)")


def test_a_torn_worker_is_named_as_such() -> None:
    """A worker whose in-place stream broke is neither ok nor merely behind: the state
    cell says torn (repairing while a repair is under way), and the problem says why."""
    from zmqsync.status_types import WorkerStatus
    from zmqsync.tools.client import assess
    from zmqsync_cli._common import worker_state

    row = {"worker": 0, "connected": True, "version": 3, "lag": 0, "torn": True}
    status = {"version": 3, "workers": [row]}
    assert worker_state(WorkerStatus.from_dict(row), 3, None).plain == "torn"
    repairing = WorkerStatus.from_dict({**row, "repairing": True})
    assert worker_state(repairing, 3, None).plain == "torn, repairing"
    assert "is torn" in assess(status)[0] and "waiting for a repair" in assess(status)[0]
    assert worker_state(WorkerStatus.from_dict({**row, "torn": False}), 3, None).plain == "ok"


def test_relay_refuses_an_open_address_without_keys_and_a_half_pair_of_keys(
    runner: CliRunner, tmp_path: Path
) -> None:
    result = runner.invoke(app, ["relay", "tcp://127.0.0.1:5555", "--endpoint", "tcp://0.0.0.0:*"])
    assert "reachable from other hosts" in _one_error_line(result)
    result = runner.invoke(
        app, ["relay", "tcp://127.0.0.1:5555", "--curve-server-key", str(tmp_path / "x.key")]
    )
    assert "secret key file" in _one_error_line(result)


def test_the_status_table_shows_the_tree_under_a_relay_furthest_behind_first() -> None:
    from rich.console import Console

    from zmqsync.status_types import SenderStatus
    from zmqsync_cli._common import BELOW_ROWS, status_table

    row = {"worker": 0, "connected": True, "live": True, "version": 3, "lag": 0}
    below = {"10": 3, "11": 2, **{str(100 + i): 3 for i in range(BELOW_ROWS)}}
    status = SenderStatus.from_dict({"version": 3, "workers": [{**row, "below": below}]})
    console = Console(record=True, width=200)
    console.print(status_table(status, silent_after=None))
    text = console.export_text()
    lines = [line for line in text.splitlines() if "└ " in line]
    assert "└ 11" in lines[0] and "behind 1" in lines[0] and "via relay 0" in lines[0]
    assert "relay for 22, 1 behind" in text
    assert "└ +2" in lines[-1] and len(lines) == BELOW_ROWS + 1  # the rest are counted


# --- a sharded learner's ranks ---------------------------------------------------------


@pytest.fixture
def sharded() -> Iterator[ShardedFleet]:
    f = ShardedFleet()
    try:
        yield f
    finally:
        f.close()


@pytest.mark.timeout(120)
def test_status_of_a_rank_shows_a_row_per_rank(runner: CliRunner, sharded: ShardedFleet) -> None:
    assert sharded.send() == [] and sharded.send() == []
    own = sharded.senders[1].status()
    assert own["rank"] == 1 and own["ranks"] == sharded.endpoints and own["waiting_ranks"] == {}
    for asked in (0, 2):  # rank 0's endpoint, as users give it, or any other rank's
        result = runner.invoke(app, ["status", sharded.endpoints[asked], "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert doc["rank"] == asked and doc["ranks"] == sharded.endpoints
        rows = doc["rank_rows"]
        assert [(r["rank"], r["endpoint"], r["answered"]) for r in rows] == [
            (r, e, True) for r, e in enumerate(sharded.endpoints)
        ]
        assert [r["version"] for r in rows] == [2, 2, 2] and doc["rank_problems"] == {}
        assert all(r["epoch"] == 11 and r["problem"] is None for r in rows)
        # Each rank's bytes are its own part's: what its own status says it sent.
        sent = [s.status()["totals"]["bytes_sent"] for s in sharded.senders]
        assert [r["bytes_sent"] for r in rows] == sent and all(sent)
    table = runner.invoke(app, ["status", sharded.endpoints[0]])
    assert table.exit_code == 0, table.output
    assert "all 3 ranks answer, at version 2" in table.stdout
    assert all(e in table.stdout for e in sharded.endpoints)
    assert "all 2 workers hold version 2" in table.stdout


@pytest.mark.timeout(120)
def test_status_names_the_rank_a_send_waits_for_and_one_not_answering(runner: CliRunner) -> None:
    """Ranks 0 and 1 send version 2 and rank 2 does not: while they wait, rank 0's
    status says the workers wait for rank 2's part, and rank 2 is a version behind; rank
    2 closed, its row says it is not answering, within the status timeout."""
    fleet = ShardedFleet(timeout=15.0)
    try:
        assert fleet.send() == []
        with torch.no_grad():
            fleet.model["w"].add_(1.0)
        threads, errors = fleet.start_send([0, 1])
        deadline = time.monotonic() + 12
        while fleet.senders[0].status()["waiting_ranks"] != {"2": [0, 1]}:
            assert time.monotonic() < deadline, fleet.senders[0].status()["waiting_ranks"]
            time.sleep(0.05)
        result = runner.invoke(app, ["status", fleet.endpoints[0], "--json"])
        assert result.exit_code == 1, result.output
        doc = json.loads(result.stdout)
        assert doc["waiting_ranks"] == {"2": [0, 1]}
        assert doc["rank_problems"] == {"2": "rank 2 sent version 1 of 2"}
        table = runner.invoke(app, ["status", fleet.endpoints[0]])
        assert "worker(s) 0, 1 wait for its part" in table.stdout, table.stdout
        fleet.senders[2].close()  # its socket gone: nothing answers there
        started = time.monotonic()
        result = runner.invoke(app, ["status", fleet.endpoints[0], "--json", "--timeout", "4"])
        assert time.monotonic() - started < 20  # bounded by the timeout, not by rank 2
        assert result.exit_code == 1, result.output
        rows = json.loads(result.stdout)["rank_rows"]
        assert [r["answered"] for r in rows] == [True, True, False]
        assert rows[2]["problem"].startswith("rank 2 is not answering: no zmqsync sender")
        table = runner.invoke(app, ["status", fleet.endpoints[0], "--timeout", "4"])
        assert "not answering" in table.stdout and "1 of 3 ranks need attention" in table.stdout
        for t in threads:
            t.join(60)
        assert len(errors) == 2 and all(isinstance(e, SyncTimeout) for e in errors), errors
        assert all(e.missing_ranks == [2] for e in errors)  # type: ignore[attr-defined]
    finally:
        fleet.close()


class _FakeRank:
    """A ROUTER socket on 127.0.0.1 that answers each status request with ``frames``
    (made from the request's own frames), or never (``frames`` None): a rank as hostile
    or as broken as it likes."""

    def __init__(self, frames: Any) -> None:
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._frames = frames
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            peer, *_ = self._sock.recv_multipart()
            if self._frames is not None:
                self._sock.send_multipart([peer, *self._frames])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)


def _reply(**status: Any) -> list[bytes]:
    from zmqsync.protocol import StatusReply, encode

    doc = {"model_id": "policy", "epoch": 5, "version": 3, **status}
    return [bytes(f) for f in encode(StatusReply("policy", 3, 5, doc))]


@pytest.mark.timeout(60)
def test_rank_rows_name_every_rank_that_is_silent_lies_or_is_of_another_job() -> None:
    """Rank 0 names six ranks: rank 1 answers as rank 2, rank 2 is of another epoch,
    rank 3 answers garbage, rank 4 never answers, rank 5 answers a reply past the
    protocol's body limit (dropped unread), rank 6 names an address no client can
    connect to. Every row says what is wrong, and one look takes about one timeout."""
    from zmqsync.protocol.limits import MAX_BODY_BYTES
    from zmqsync.tools.client import query_ranks, rank_problems

    fakes = [
        _FakeRank(_reply(rank=2, ranks=[])),
        _FakeRank(_reply(rank=2, epoch=6, ranks=[])),
        _FakeRank([b"not", b"zmqsync"]),
        _FakeRank(None),
        _FakeRank([_reply(rank=5)[0], bytes(MAX_BODY_BYTES + 1)]),
    ]
    try:
        endpoints = ["tcp://127.0.0.1:1", *(f.endpoint for f in fakes), "tcp://127.0.0.1:*"]
        asked = {"model_id": "policy", "epoch": 5, "version": 3, "rank": 0, "ranks": endpoints}
        started = time.monotonic()
        rows = query_ranks(asked, timeout=2.0)
        assert time.monotonic() - started < 2.0 + 10  # one timeout for all, not one each
    finally:
        for fake in fakes:
            fake.close()
    assert [(row.rank, row.endpoint) for row in rows] == list(enumerate(endpoints))
    assert [row.answered for row in rows] == [True, True, True, False, False, False, False]
    problems = rank_problems(rows)
    assert sorted(problems) == [1, 2, 3, 4, 5, 6]
    assert problems[1] == "rank 1 answered as rank 2 of model 'policy'"
    assert problems[2].startswith("rank 2 is of another epoch (6, not 5)")
    assert "not a zmqsync sender" in problems[3]
    assert "no zmqsync sender answered" in problems[4]
    assert "no zmqsync sender answered" in problems[5]
    assert "only a sender can bind" in problems[6]


@pytest.mark.timeout(60)
def test_rank_rows_ask_a_bounded_number_of_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    import zmqsync.tools.status as status_module
    from zmqsync.tools.client import query_ranks

    monkeypatch.setattr(status_module, "STATUS_RANKS", 2)
    fake = _FakeRank(_reply(rank=1))
    try:
        endpoints = ["tcp://127.0.0.1:1", fake.endpoint, _free_tcp_endpoint()]
        asked = {"model_id": "policy", "epoch": 5, "version": 3, "rank": 0, "ranks": endpoints}
        rows = query_ranks(asked, timeout=2.0)
    finally:
        fake.close()
    assert [(row.answered, row.problem) for row in rows] == [
        (True, None),
        (True, None),
        (False, "rank 2 was not asked"),
    ]
    assert query_ranks({"version": 3}) == []  # an unsharded sender has no ranks


@pytest.mark.timeout(120)
def test_watch_shows_the_ranks_too(runner: CliRunner, sharded: ShardedFleet) -> None:
    assert sharded.send() == []
    result = runner.invoke(
        app, ["watch", sharded.endpoints[0], "--count", "2", "--interval", "0.05"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.count("all 3 ranks answer, at version 1") == 2
    assert result.stdout.count(sharded.endpoints[2]) == 2
