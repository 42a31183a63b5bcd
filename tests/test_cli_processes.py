"""The ``zmqsync`` command as users run it: real processes, real sockets, real files.

- ``zmqsync demo`` finishes by itself, shows every worker at the last version, and
  leaves no process behind (also when interrupted).
- ``zmqsync serve`` + two ``zmqsync worker`` processes: ``status --json`` sees both at
  the current version; a changed checkpoint reaches both; a killed worker is reported
  (silent, then behind) and ``status`` exits 1.

Every process is started through :class:`Cli` and killed in a fixture's teardown, so a
failing test leaves nothing running. Endpoints are tcp on 127.0.0.1 with free ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _prom import one, scrape

from zmqsync import checksum

pytestmark = pytest.mark.slow

_SCRIPT = Path(sys.executable).with_name("zmqsync")
#: The installed console script when there is one (what a user runs), else the module.
ZMQSYNC = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "zmqsync_cli"]
#: Every process a test starts carries this in its environment (and passes it to its
#: children), so the test can prove none is left over.
MARKER = "ZMQSYNC_TEST_RUN"
#: A row of the status table: worker, version, lag.
ROW = re.compile(r"^\s*[│|]\s*(\d+)\s*[│|]\s*(\d+)\s*[│|]\s*(\d+)\s*[│|]", re.MULTILINE)


def _env(run_id: str) -> dict[str, str]:
    env = dict(os.environ)
    env[MARKER] = run_id
    env["COLUMNS"] = "160"  # wide enough that captured tables never fold
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("ZMQSYNC_DEBUG", None)
    return env


def _marked_pids(run_id: str) -> list[int]:
    """Live processes whose environment carries this run's marker."""
    needle = f"{MARKER}={run_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":  # zombies are already dead
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def _wait_no_marked(run_id: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = _marked_pids(run_id)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


class Cli:
    """A ``zmqsync`` subprocess whose output lines are collected by a reader thread."""

    def __init__(self, args: list[str], *, cwd: Path, env: dict[str, str]) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [*ZMQSYNC, *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))

    def expect(self, pattern: str, timeout: float) -> re.Match[str]:
        """Wait for an output line matching ``pattern``; fail with the output so far."""
        regex = re.compile(pattern)
        for line in self.lines:
            m = regex.search(line)
            if m:
                return m
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"no line matching {pattern!r} within {timeout}s from zmqsync "
                    f"{' '.join(self.args)} (exit {self.proc.poll()}); output:\n"
                    + "\n".join(self.lines)
                )
            try:
                line = self._queue.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                if self.proc.poll() is not None and not self._reader.is_alive():
                    deadline = 0.0  # it exited and said everything it will say
                continue
            self.lines.append(line)
            m = regex.search(line)
            if m:
                return m

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Signal the process, wait, and kill it if it does not go; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._reader.join(timeout)
        while not self._queue.empty():
            self.lines.append(self._queue.get())
        return self.proc.returncode


@pytest.fixture
def run_id() -> Iterator[str]:
    """A marker for this test's processes; anything left at teardown is killed."""
    rid = uuid.uuid4().hex
    yield rid
    for pid in _marked_pids(rid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def spawn(tmp_path: Path, run_id: str) -> Iterator[Any]:
    """Start ``zmqsync`` subprocesses in tmp_path; all are stopped at teardown."""
    started: list[Cli] = []

    def start(*args: str) -> Cli:
        cli = Cli(list(args), cwd=tmp_path, env=_env(run_id))
        started.append(cli)
        return cli

    yield start
    for cli in started:
        cli.stop(signal.SIGKILL if cli.proc.poll() is None else signal.SIGTERM, timeout=5)


def _run(
    args: list[str], *, cwd: Path, run_id: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ZMQSYNC, *args],
        cwd=cwd,
        env=_env(run_id),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- zmqsync demo --------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_demo_finishes_by_itself_with_every_worker_at_the_last_version(
    tmp_path: Path, run_id: str
) -> None:
    result = _run(
        ["demo", "--workers", "4", "--versions", "3", "--interval", "0"],
        cwd=tmp_path,
        run_id=run_id,
        timeout=240,
    )
    out = result.stdout
    assert result.returncode == 0, f"demo failed ({result.returncode}):\n{out}\n{result.stderr}"
    for v in (1, 2, 3):
        assert re.search(rf"^version {v}: synced to 4 workers in [\d.]+ (ms|s)$", out, re.M), out
    rows = {int(w): (int(v), int(lag)) for w, v, lag in ROW.findall(out)}
    assert rows == {w: (3, 0) for w in range(4)}, out
    assert "all 4 workers hold version 3" in out
    assert "Traceback" not in out + result.stderr
    assert _wait_no_marked(run_id, 10) == [], "demo left processes behind"


@pytest.mark.timeout(300)
def test_demo_router_mode_over_tcp(tmp_path: Path, run_id: str) -> None:
    result = _run(
        [
            "demo",
            "--workers",
            "2",
            "--versions",
            "2",
            "--mode",
            "router",
            "--transport",
            "tcp",
            "--size-mb",
            "4",
            "--interval",
            "0",
        ],
        cwd=tmp_path,
        run_id=run_id,
        timeout=240,
    )
    out = result.stdout
    assert result.returncode == 0, f"demo failed ({result.returncode}):\n{out}\n{result.stderr}"
    assert "a 4.0 MB MLP, router over tcp" in out
    assert re.search(r"^learner at tcp://127\.0\.0\.1:\d+; 2 workers connected", out, re.M)
    assert "zmq-router" in out
    rows = {int(w): (int(v), int(lag)) for w, v, lag in ROW.findall(out)}
    assert rows == {0: (2, 0), 1: (2, 0)}, out
    assert _wait_no_marked(run_id, 10) == [], "demo left processes behind"


@pytest.mark.timeout(300)
def test_demo_stops_its_workers_on_ctrl_c(spawn: Any, run_id: str) -> None:
    # Run in the background by a shell without job control (`cmd &` in a script), pytest
    # ignores SIGINT, and an ignored signal stays ignored across exec: so would the demo.
    # Python's own handler in this process is not inherited; the default is.
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        demo = spawn("demo", "--workers", "2", "--versions", "1000", "--interval", "0.2")
    finally:
        if previous is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    demo.expect(r"^learner at .*2 workers connected", timeout=240)
    demo.expect(r"^version 1: synced", timeout=30)
    assert len(_marked_pids(run_id)) >= 3  # the learner, its two workers (and a tracker)
    code = demo.stop(signal.SIGINT, timeout=30)
    assert code == 130, "\n".join(demo.lines)
    assert any("interrupted" in line for line in demo.lines)
    assert _wait_no_marked(run_id, 10) == [], "Ctrl-C left demo workers running"


# --- serve + workers + status --------------------------------------------------------

FACTORY = textwrap.dedent(
    """
    import torch

    def make_policy():
        return torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
        )
    """
)


def _save_checkpoint(path: Path, seed: int) -> str:
    """Write a state_dict for FACTORY's model atomically; return its checksum."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    tmp = path.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)  # what the serve help asks of learners: never a half file
    return checksum(model, "state_dict")


def _status(endpoint: str, tmp_path: Path, run_id: str, *extra: str) -> tuple[int, dict[str, Any]]:
    result = _run(
        ["status", endpoint, "--json", "--timeout", "5", *extra],
        cwd=tmp_path,
        run_id=run_id,
        timeout=60,
    )
    assert result.returncode in (0, 1), f"status failed: {result.stdout}\n{result.stderr}"
    return result.returncode, json.loads(result.stdout)


def _versions(doc: dict[str, Any]) -> dict[int, int]:
    return {w["worker"]: w["version"] for w in doc["workers"]}


def _poll_status(
    endpoint: str, tmp_path: Path, run_id: str, until: Any, timeout: float, *extra: str
) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        code, doc = _status(endpoint, tmp_path, run_id, *extra)
        if until(code, doc):
            return code, doc
        if time.monotonic() > deadline:
            raise AssertionError(f"status never got there; last (exit {code}): {doc}")
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_serve_two_workers_status_change_and_a_killed_worker(
    tmp_path: Path, spawn: Any, run_id: str
) -> None:
    (tmp_path / "policy_factory.py").write_text(FACTORY)
    ckpt = tmp_path / "policy.pt"
    first = _save_checkpoint(ckpt, seed=1)

    serve = spawn(
        "serve",
        str(ckpt),
        "--endpoint",
        "tcp://127.0.0.1:*",
        "--workers",
        "2",
        "--poll",
        "0.2",
        "--timeout",
        "3",
    )
    endpoint = serve.expect(r"zmqsync serve: listening on (tcp://127\.0\.0\.1:\d+)", 120)[1]
    workers = [
        spawn(
            "worker",
            endpoint,
            "--model",
            "policy_factory:make_policy",
            "--worker-idx",
            str(i),
            "--checksum",
        )
        for i in range(2)
    ]
    for i, w in enumerate(workers):
        m = w.expect(rf"^worker {i}  version 1  applied on connect .* checksum (\w+)$", 120)
        assert m[1] == first  # the worker holds exactly the checkpoint's bytes

    code, doc = _status(endpoint, tmp_path, run_id)
    assert code == 0, doc
    assert doc["version"] == 1 and _versions(doc) == {0: 1, 1: 1}
    assert doc["problems"] == {}
    assert all(w["connected"] and w["lag"] == 0 for w in doc["workers"])

    # A new checkpoint: both workers apply it, and status says so.
    second = _save_checkpoint(ckpt, seed=2)
    for i, w in enumerate(workers):
        assert w.expect(rf"^worker {i}  version 2  applied in .* checksum (\w+)$", 60)[1] == second
    serve.expect(r"^version 2: .* synced to 2 workers", 30)
    code, doc = _poll_status(
        endpoint, tmp_path, run_id, lambda c, d: _versions(d) == {0: 2, 1: 2}, 30
    )
    assert code == 0 and doc["version"] == 2

    # Worker 1 dies without a word: first it goes silent, then it falls behind.
    workers[1].stop(signal.SIGKILL)
    code, doc = _poll_status(
        endpoint, tmp_path, run_id, lambda c, d: c == 1, 30, "--silent-after", "1.5"
    )
    assert "silent" in doc["problems"]["1"] and "0" not in doc["problems"]

    third = _save_checkpoint(ckpt, seed=3)
    assert workers[0].expect(r"^worker 0  version 3  applied in .* checksum (\w+)$", 60)[1] == third
    serve.expect(r"^version 3: \S+ \S+ reached 1 of 2 workers in .*; no ack from worker 1 ", 30)
    code, doc = _status(endpoint, tmp_path, run_id)
    assert code == 1
    assert _versions(doc) == {0: 3, 1: 2}
    assert doc["workers"][1]["lag"] == 1
    assert doc["problems"] == {"1": "worker 1 holds version 2 of 3 (1 behind)"}
    assert doc["totals"]["timeouts"] >= 1

    # The table a person reads says the same, and the exit code too.
    table = _run(["status", endpoint], cwd=tmp_path, run_id=run_id, timeout=60)
    assert table.returncode == 1
    rows = {int(w): (int(v), int(lag)) for w, v, lag in ROW.findall(table.stdout)}
    assert rows == {0: (3, 0), 1: (2, 1)}, table.stdout
    assert "behind 1" in table.stdout and "1 of 2 workers need attention" in table.stdout

    assert serve.stop(signal.SIGTERM) == 0
    assert workers[0].stop(signal.SIGTERM) == 0
    assert "zmqsync serve: stopped" in serve.lines
    assert not any("Traceback" in line for cli in (serve, *workers) for line in cli.lines)


@pytest.mark.timeout(180)
def test_serve_without_an_endpoint_listens_on_a_private_ipc_path(
    tmp_path: Path, spawn: Any, run_id: str
) -> None:
    """No --endpoint: an ipc path in a directory only this user can enter (a tcp port
    on loopback would be open to every user of the host), printed for the workers, and
    removed when serve stops."""
    ckpt = tmp_path / "policy.pt"
    _save_checkpoint(ckpt, seed=1)
    serve = spawn("serve", str(ckpt), "--poll", "0.2")
    endpoint = serve.expect(r"zmqsync serve: listening on (\S+) \(", 120)[1]
    assert endpoint.startswith("ipc://"), endpoint
    serve.expect(rf"^start workers with: zmqsync worker {re.escape(endpoint)} --model ", 10)
    directory = Path(endpoint.removeprefix("ipc://")).parent
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    code, doc = _status(endpoint, tmp_path, run_id)
    assert code == 0 and doc["version"] == 1 and doc["endpoint"] == endpoint
    assert serve.stop(signal.SIGTERM) == 0
    assert not directory.exists(), "serve left its private ipc directory behind"
    assert not any("Traceback" in line or "WARNING" in line for line in serve.lines)


def _peak_rss(pid: int) -> int:
    """The most resident memory process ``pid`` has held so far, in bytes (VmHWM)."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmHWM:\s+(\d+) kB$", status, re.MULTILINE)
    assert found is not None, status
    return int(found[1]) * 1024


def _replace(path: Path, contents: dict[str, Any]) -> int:
    """torch.save ``contents`` over ``path`` atomically; return the file's size."""
    tmp = path.with_suffix(".tmp")
    torch.save(contents, tmp)
    os.replace(tmp, path)
    return path.stat().st_size


@pytest.mark.timeout(300)
def test_serve_keeps_its_last_version_through_checkpoints_it_cannot_publish(
    tmp_path: Path, spawn: Any, run_id: str
) -> None:
    """A 1.5 KB checkpoint whose tensor is a stride-0 view naming 1 GiB is refused before
    anything is copied (serve's peak memory barely moves); a checkpoint the sender
    refuses (a dtype zmqsync cannot send: not a CheckpointError) does not end serve
    either. Through both it serves version 1, and it publishes the next good file."""
    ckpt = tmp_path / "policy.pt"
    _save_checkpoint(ckpt, seed=1)
    serve = spawn("serve", str(ckpt), "--endpoint", "tcp://127.0.0.1:*", "--poll", "0.1")
    endpoint = serve.expect(r"zmqsync serve: listening on (tcp://127\.0\.0\.1:\d+)", 120)[1]
    serve.expect(r"^watching ", 30)
    peak = _peak_rss(serve.proc.pid)

    logical = 2**28 * 4  # float32; the test never materialises it either
    size = _replace(ckpt, {"0.weight": torch.zeros(1).expand(2**28)})
    assert size < 4096
    serve.expect(
        rf"^warning: .*'0\.weight' .* names {logical} bytes but its storage holds 4: .*; "
        r"still serving version 1$",
        60,
    )
    grown = _peak_rss(serve.proc.pid) - peak
    assert grown < 128 * 2**20, f"serve grew by {grown} bytes for a {size}-byte file"

    # The sender's own refusal (SchemaMismatchError), after the file loaded fine.
    fp4 = torch.zeros(64, 4, dtype=torch.float4_e2m1fn_x2)
    _replace(ckpt, {"0.weight": fp4, "0.bias": torch.zeros(64)})
    serve.expect(
        r"^warning: cannot publish .*: SchemaMismatchError: dtype torch\.float4_e2m1fn_x2 "
        r"cannot be sent by zmqsync; still serving version 1$",
        60,
    )
    assert serve.proc.poll() is None
    code, doc = _status(endpoint, tmp_path, run_id)
    assert code == 0 and doc["version"] == 1, doc

    _save_checkpoint(ckpt, seed=2)
    serve.expect(r"^version 2: .* synced to no workers yet", 60)
    code, doc = _status(endpoint, tmp_path, run_id)
    assert code == 0 and doc["version"] == 2, doc
    assert serve.stop(signal.SIGTERM) == 0
    assert not any("Traceback" in line for line in serve.lines), "\n".join(serve.lines)


@pytest.mark.timeout(180)
def test_status_exits_2_when_no_sender_answers(tmp_path: Path, run_id: str) -> None:
    result = _run(
        ["status", f"ipc://{tmp_path}/nobody", "--timeout", "0.5"],
        cwd=tmp_path,
        run_id=run_id,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "no zmqsync sender answered" in result.stderr


@pytest.mark.timeout(180)
def test_a_secret_key_file_others_can_read_is_warned_about_once(
    tmp_path: Path, run_id: str
) -> None:
    """`zmqsync keys` makes the secret file private; one that others can read still
    works, with one warning line that says how to fix it (and no logging duplicate)."""
    made = _run(["keys", str(tmp_path), "--name", "w"], cwd=tmp_path, run_id=run_id, timeout=60)
    assert made.returncode == 0, made.stderr
    secret = tmp_path / "w.key_secret"
    args = ["status", f"ipc://{tmp_path}/nobody", "--timeout", "0.2", "--curve-secret"]
    args += [str(secret), "--curve-server-key", str(tmp_path / "w.key")]
    private = _run(args, cwd=tmp_path, run_id=run_id, timeout=60)
    assert private.returncode == 2
    assert private.stderr.count("\n") == 1 and "no zmqsync sender answered" in private.stderr
    secret.chmod(0o640)
    exposed = _run(args, cwd=tmp_path, run_id=run_id, timeout=60)
    assert exposed.returncode == 2
    lines = exposed.stderr.splitlines()
    assert len(lines) == 2, exposed.stderr
    assert lines[0].startswith("warning: ") and str(secret) in lines[0]
    assert "mode 0640" in lines[0] and f"chmod 600 {secret}" in lines[0]
    assert "no zmqsync sender answered" in lines[1]


# --- zmqsync relay ---------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_serve_a_relay_and_two_workers_behind_it(tmp_path: Path, spawn: Any, run_id: str) -> None:
    (tmp_path / "policy_factory.py").write_text(FACTORY)
    ckpt = tmp_path / "policy.pt"
    first = _save_checkpoint(ckpt, seed=1)
    serve = spawn(
        "serve",
        str(ckpt),
        "--endpoint",
        "tcp://127.0.0.1:*",
        "--workers",
        "1",
        "--poll",
        "0.2",
        "--metrics-port",
        "0",
    )
    endpoint = serve.expect(r"zmqsync serve: listening on (tcp://127\.0\.0\.1:\d+)", 120)[1]
    metrics = int(serve.expect(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", 30)[1])
    relay = spawn(
        "relay",
        endpoint,
        "--endpoint",
        "tcp://127.0.0.1:*",
        "--relay-idx",
        "0",
        "--workers",
        "2",
        "--metrics-port",
        "0",
        "--no-snapshot",  # its workers join late: it fetches version 1 again for them
    )
    below = relay.expect(
        r"zmqsync relay: listening on (tcp://127\.0\.0\.1:\d+) .* as worker 0", 120
    )
    workers = [
        spawn(
            "worker",
            below[1],
            "--model",
            "policy_factory:make_policy",
            "--worker-idx",
            str(i),
            "--checksum",
        )
        for i in range(2)
    ]
    for i, w in enumerate(workers):
        assert (
            w.expect(rf"^worker {i}  version 1  applied on connect .* checksum (\w+)$", 120)[1]
            == first
        )

    # A new checkpoint goes through the relay; the learner's send waits for both workers.
    second = _save_checkpoint(ckpt, seed=2)
    for i, w in enumerate(workers):
        assert w.expect(rf"^worker {i}  version 2  applied in .* checksum (\w+)$", 60)[1] == second
    serve.expect(r"^version 2: .* synced to 1 workers", 30)
    relay.expect(r"^version 2: forwarded to 2 worker", 30)
    # The learner sees the relay and, through its heartbeats, the workers behind it.
    code, doc = _poll_status(
        endpoint,
        tmp_path,
        run_id,
        lambda c, d: (d["workers"][0].get("below") or {}) == {"0": 2, "1": 2},
        30,
    )
    assert code == 0 and _versions(doc) == {0: 2}
    code, doc = _status(below[1], tmp_path, run_id)
    assert code == 0 and _versions(doc) == {0: 2, 1: 2}
    table = _run(["status", endpoint], cwd=tmp_path, run_id=run_id, timeout=60)
    assert table.returncode == 0 and "relay for 2" in table.stdout, table.stdout
    assert "└ 0" in table.stdout and "└ 1" in table.stdout and "via relay 0" in table.stdout
    # Both expose Prometheus metrics: the learner its relay and the workers behind it.
    top = scrape(metrics)
    assert one(top, "zmqsync_version") == 2
    assert {ls["worker"]: v for ls, v in top["zmqsync_below_version"]} == {"0": 2, "1": 2}
    mid = scrape(int(relay.expect(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", 5)[1]))
    assert one(mid, "zmqsync_relay_upstream_version") == 2
    assert one(mid, "zmqsync_relay_refetches_total") >= 1
