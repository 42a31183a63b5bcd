"""What the commands share: consoles, error reporting, and the status table.

No sync logic lives here: the table only lays out a :class:`~zmqsync.SenderStatus` (what
:func:`zmqsync.tools.status.query_status` or ``scheme.status()`` returned, read by its
``from_dict``), and what :func:`zmqsync.tools.status.assess` judged.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, NoReturn

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from zmqsync.endpoints import reachable_from_other_hosts
from zmqsync.errors import ZMQSyncError
from zmqsync.security import (
    CurveClient,
    CurveServer,
    curve_client_from_files,
    curve_server_from_files,
    exposed_secret_file,
)
from zmqsync.status_types import SenderStatus, WorkerStatus
from zmqsync.tools.status import RankRow, worker_problem
from zmqsync.vocabulary import MODES, STRATEGIES

#: Width of output that goes to a file or a pipe (rich would pick 80 columns, which
#: folds the status table); a terminal's own width wins.
PIPE_WIDTH: Final = 120
SILENT_HELP: Final = "Report a worker unheard for this many seconds as silent."


#: The library logger that warns about key files; commands print those warnings
#: themselves (see :func:`warn_if_exposed`), so they silence it while loading keys.
_SECURITY_LOGGER: Final = "zmqsync.security"


def warn_if_exposed(path: Path | None) -> Path | None:
    """Print a warning when a secret key file given on the command line is open to other
    users (it still works: refusing would break fleets already deployed)."""
    if path is not None:
        why = exposed_secret_file(path)
        if why is not None:
            console(stderr=True).print(Text(f"warning: {why}", style="yellow"), soft_wrap=True)
    return path


#: CURVE options, shared by the commands that connect (status, watch, worker) and serve.
CurveSecret = Annotated[
    Path | None,
    typer.Option(
        "--curve-secret",
        envvar="ZMQSYNC_CURVE_SECRET",
        dir_okay=False,
        callback=warn_if_exposed,
        help="This side's CURVE secret key file (NAME.key_secret from `zmqsync "
        "keys`), for a sender that other hosts can reach.",
    ),
]
CurveServerKey = Annotated[
    Path | None,
    typer.Option(
        "--curve-server-key",
        envvar="ZMQSYNC_CURVE_SERVER_KEY",
        dir_okay=False,
        help="The sender's CURVE public key file (NAME.key); goes with --curve-secret.",
    ),
]

#: --curve-relays, for the commands that listen (serve, relay).
CurveRelays = Annotated[
    Path | None,
    typer.Option(
        "--curve-relays",
        envvar="ZMQSYNC_CURVE_RELAYS",
        help="The public key file (NAME.key), or a directory of them, of the clients "
        "allowed to act as relays: only they may say which workers are below them (so "
        "that a send to those workers goes through them). Without it, with CURVE, no "
        "client may: relays still forward every version. Needs --curve-secret.",
    ),
]

Failover = Annotated[
    list[str] | None,
    typer.Option(
        "--failover",
        envvar="ZMQSYNC_FAILOVER",
        help="Another upstream (a relay, or the learner) to follow when this one goes "
        "silent; repeat it for several, tried in turn. The same CURVE keys serve all.",
    ),
]

# The choices of --strategy and --mode, made from zmqsync's own vocabulary: typer offers
# an Enum's members as an option's choices (mypy cannot see members made from a tuple).
StrategyChoice = enum.Enum(  # type: ignore[misc]
    "StrategyChoice", [(s, s) for s in STRATEGIES], type=str
)
ModeChoice = enum.Enum("ModeChoice", [(m, m) for m in MODES], type=str)  # type: ignore[misc]
#: --strategy, for the commands that follow a learner (worker, relay).
StrategyOption = Annotated[
    StrategyChoice,
    typer.Option(help="Must match the learner's; `zmqsync serve` sends state_dict."),
]
#: --mode, for the commands that run a learner (serve, demo).
ModeOption = Annotated[
    ModeChoice,
    typer.Option(
        help="pubsub: one send fans out to every worker; router: one addressed send per worker."
    ),
]
#: --timeout, for the commands that follow an upstream (worker, relay).
ConnectTimeout = Annotated[
    float,
    typer.Option(
        min=0.1, help="Seconds to wait for the upstream (the learner, or a relay) when connecting."
    ),
]
#: --workers, for the commands that serve workers (serve, relay).
Workers = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="Wait for workers 0..N-1: each version is done once they hold it, and status "
        "reports any missing. Default: the workers that have connected.",
    ),
]
#: Rows shown under each relay in the status table (the furthest behind first).
BELOW_ROWS: Final = 20
MetricsPort = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        min=0,
        envvar="ZMQSYNC_METRICS_PORT",
        help="Serve Prometheus metrics (versions, lag and state per worker, latency "
        "histogram, bytes, timeouts, rejections) on http://ADDR:PORT/metrics.",
        show_default=False,
    ),
]
MetricsAddr = Annotated[
    str,
    typer.Option(
        "--metrics-addr",
        envvar="ZMQSYNC_METRICS_ADDR",
        help="The address --metrics-port listens on (0.0.0.0 for a scraper on another host).",
    ),
]


@dataclass
class State:
    """Options of the top-level ``zmqsync`` command, seen by every subcommand."""

    debug: bool = False


#: Set by the root command for the subcommand it runs (one command per process, or one
#: at a time under CliRunner).
_STATE = State()


def set_state(new: State) -> None:
    """Record the root command's options (called by ``zmqsync_cli.main``)."""
    global _STATE
    _STATE = new


def state() -> State:
    """The root command's options."""
    return _STATE


def console(*, stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr), made per command so tests can capture it."""
    width = None
    if not (sys.stderr if stderr else sys.stdout).isatty() and "COLUMNS" not in os.environ:
        width = PIPE_WIDTH
    return Console(stderr=stderr, width=width, highlight=False)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` on one line of stderr and exit with ``code``."""
    console(stderr=True).print(Text(f"error: {message}", style="bold red"), soft_wrap=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def user_errors(code: int = 1) -> Iterator[None]:
    """Turn any exception into one line on stderr and exit ``code`` (the traceback with
    ``--debug``). Errors zmqsync raises on purpose already say what to do; anything else
    is a bug, and says how to see the traceback."""
    try:
        yield
    except (typer.Exit, typer.Abort, typer.TyperException):
        raise
    except Exception as exc:
        if state().debug:
            console(stderr=True).print_exception(show_locals=False)
        if isinstance(exc, ZMQSyncError | OSError | ValueError | TimeoutError):
            fail(str(exc) or type(exc).__name__, code)
        hint = "" if state().debug else " (run with --debug for the traceback)"
        fail(f"unexpected {type(exc).__name__}: {exc}{hint}", code)


def setup_logging(debug: bool) -> None:
    """Library log records on stderr, one line each; everything with ``--debug``."""
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Silence a library logger below ERROR while a command reports the same events
    itself (unless ``--debug``)."""
    logger = logging.getLogger(name)
    previous = logger.level
    if not state().debug:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Let SIGTERM (``kill``, ``docker stop``) end a command the way Ctrl-C does, so its
    ``finally`` blocks close sockets and stop child processes."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- formatting --------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KB"`` (binary units, short names)."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"  # pragma: no cover - unreachable


def fmt_seconds(s: float | None) -> str:
    """A duration for people: ``"4.2 ms"``, ``"3.1 s"``, ``"2m05s"``, ``"1h02m"``."""
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.1f} ms"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def fmt_ago(s: float | None) -> str:
    """``12.0`` -> ``"12.0 s ago"``; ``None`` -> ``"never"``."""
    return "never" if s is None else f"{fmt_seconds(s)} ago"


# --- the status view ---------------------------------------------------------------


def worker_state(worker: WorkerStatus, version: int, silent_after: float | None) -> Text:
    """The state cell: ok, behind by N, torn (repairing), not connected, silent, or left;
    and whether it is sent copies instead of shared memory (the blocks it pins)."""
    cell = _worker_state(worker, version, silent_after)
    if worker.shm_copies:
        cell.append(f", sent copies ({worker.shm_pinned or 0} blocks pinned)", style="yellow")
    return cell


def _worker_state(worker: WorkerStatus, version: int, silent_after: float | None) -> Text:
    if not worker.connected:
        return Text("not connected", style="red")
    problem = worker_problem(worker, version, silent_after)
    if worker.left:
        return Text("left", style="red" if problem else "dim")
    if problem is None:
        return Text("ok", style="green")
    if worker.torn:
        return Text("torn, repairing" if worker.repairing else "torn", style="red")
    if worker.lag:
        return Text(f"behind {worker.lag}", style="yellow")
    return Text(f"silent {fmt_seconds(worker.since_last_seen_s)}", style="red")


def status_header(status: SenderStatus) -> Text:
    """Three lines about the sender itself: what, where, which version, totals."""
    totals = status.totals
    lines = [
        f"model {status.model_id!r}  version {status.version}  "
        f"epoch {status.epoch:016x}  {status.mode} ({status.strategy})",
        f"endpoint {status.endpoint}  sender {status.host} pid "
        f"{status.pid}  up {fmt_seconds(status.uptime_s)}",
        f"sent {totals.versions_sent} versions, "
        f"{fmt_bytes(totals.bytes_sent)}  "
        f"sync latency p50 {fmt_seconds(totals.latency_p50_s)}  "
        f"p90 {fmt_seconds(totals.latency_p90_s)}  "
        f"p99 {fmt_seconds(totals.latency_p99_s)}  "
        f"timeouts {totals.timeouts}  rejected frames {totals.rejected_frames}",
    ]
    host = _host_line(totals.transport, totals.lent_go_missed)
    if host:
        lines.append(host)
    return Text("\n".join(lines))


def _host_line(transport: Mapping[str, int], go_missed: int) -> str:
    """What the fleet on the sender's host costs it and how its workers take versions
    (lent tensors, shared and device memory), or "" where its hubs count none of it."""
    parts = []
    lending = transport.get("lent_peers", 0)
    if lending or transport.get("lent_writes", 0):
        who = "1 worker lends its" if lending == 1 else f"{lending} workers lend their"
        parts.append(
            f"{who} tensors, {transport.get('lent_writes', 0)} versions written into "
            f"them, {go_missed} streamed for want of a go"
        )
    if "shm_bytes" in transport:
        parts.append(f"shared memory {fmt_bytes(transport['shm_bytes'])}")
    if transport.get("device_bytes"):
        parts.append(f"device memory {fmt_bytes(transport['device_bytes'])}")
    return ("on this host: " + "; ".join(parts)) if parts else ""


def status_table(status: SenderStatus, *, silent_after: float | None) -> Table:
    """One row per worker: the version it holds and how it got there."""
    version = status.version
    table = Table(show_edge=True, pad_edge=True, expand=False)
    for name, justify in (
        ("worker", "right"),
        ("version", "right"),
        ("lag", "right"),
        ("state", "left"),
        ("last ack", "right"),
        ("last seen", "right"),
        ("latency", "right"),
        ("received", "right"),
        ("rejected", "right"),
        ("host:pid", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for w in status.workers:
        state = worker_state(w, version, silent_after)
        below = w.below or {}
        if below:  # a relay: the workers behind it, from its heartbeats
            behind = sum(1 for v in below.values() if v < version)
            state.append(f"; relay for {max(w.below_total, len(below))}", style="dim")
            if behind:
                state.append(f", {behind} behind", style="yellow")
        table.add_row(
            str(w.worker),
            str(w.version),
            str(w.lag),
            state,
            fmt_ago(w.since_last_ack_s) if w.connected else "-",
            fmt_ago(w.since_last_seen_s) if w.connected else "-",
            fmt_seconds(w.last_latency_s) if w.connected else "-",
            fmt_bytes(w.received_bytes) if w.connected else "-",
            Text(str(w.rejected_frames), style="red" if w.rejected_frames else ""),
            # Text, not a str: what a host calls itself is not rich markup.
            Text(f"{w.host}:{w.pid}") if w.connected else "-",
        )
        _below_rows(table, w.worker, below, version, w.below_total)
    return table


def _below_rows(
    table: Table, relay: int, below: Mapping[str, int], version: int, total: int = 0
) -> None:
    """The tree under a relay: a row per worker behind it (as its heartbeats say), the
    furthest behind first, so that where a version stopped shows. ``total``: how many
    there are (a status row names only the furthest behind)."""
    shown = sorted(below, key=lambda worker: (below[worker], int(worker)))[:BELOW_ROWS]
    for worker in shown:
        held = below[worker]
        lag = max(0, version - held)
        state = Text(f"behind {lag}", style="yellow") if lag else Text("ok", style="green")
        table.add_row(
            f"└ {worker}",
            str(held),
            str(lag),
            state,
            *["-"] * 5,
            Text(f"via relay {relay}", style="dim"),
        )
    more = max(total, len(below)) - len(shown)
    if more > 0:
        table.add_row(f"└ +{more}", *[""] * 8, Text("more behind it", style="dim"))


def verdict(status: SenderStatus, problems: Mapping[int, str]) -> Text:
    """The last line: all good, or what is wrong with whom."""
    workers, version = status.workers, status.version
    # A large fleet's status carries its furthest-behind rows only, and counts them all.
    total = max(status.workers_total, len(workers))
    shown = f" ({len(workers)} shown, the furthest behind)" if total > len(workers) else ""
    if not workers:
        return Text(f"no workers yet (version {version} is ready for them)", style="yellow")
    if not problems:
        return Text(f"all {total} workers hold version {version}{shown}", style="green")
    return Text(
        f"{len(problems)} of {total} workers need attention{shown}: "
        + "; ".join(problems[w] for w in sorted(problems)),
        style="red",
    )


def rank_table(status: SenderStatus, rows: Sequence[RankRow]) -> Table:
    """A sharded learner's ranks, a row each: where it is bound, the version it sent
    last, the bytes it sent, and whether it answered (a rank a waiting send still lacks
    says so, with the workers waiting for it)."""
    waiting = status.waiting_ranks or {}
    table = Table(show_edge=True, pad_edge=True, expand=False)
    for name, justify in (
        ("rank", "right"),
        ("endpoint", "left"),
        ("version", "right"),
        ("sent", "right"),
        ("state", "left"),
        ("host:pid", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in rows:
        if not row.answered:
            state = Text("not answering", style="red")
        elif row.problem is not None:
            state = Text(row.problem, style="yellow")
        else:
            state = Text("ok", style="green")
        waiters = waiting.get(str(row.rank))
        if waiters:
            state.append(
                f"; worker(s) {', '.join(map(str, waiters))} wait for its part", style="red"
            )
        table.add_row(
            str(row.rank),
            Text(row.endpoint),  # what a peer claims is not rich markup
            str(row.version) if row.answered else "-",
            fmt_bytes(row.bytes_sent) if row.answered else "-",
            state,
            Text(f"{row.host}:{row.pid}") if row.answered else "-",
        )
    return table


def rank_verdict(rows: Sequence[RankRow], problems: Mapping[int, str]) -> Text:
    """A line about the ranks: all answering at one version, or what is wrong."""
    if not problems:
        newest = max((row.version for row in rows), default=0)
        return Text(f"all {len(rows)} ranks answer, at version {newest}", style="green")
    return Text(
        f"{len(problems)} of {len(rows)} ranks need attention: "
        + "; ".join(problems[r] for r in sorted(problems)),
        style="red",
    )


def status_view(
    status: SenderStatus,
    problems: Mapping[int, str],
    *,
    silent_after: float | None,
    ranks: Sequence[RankRow] = (),
    rank_problems: Mapping[int, str] | None = None,
) -> Group:
    """Header, worker table and verdict: what ``status``, ``watch`` and ``demo`` show;
    for a sharded learner's rank, its ranks' table and their verdict first."""
    parts: list[Any] = [status_header(status)]
    if ranks:
        parts += [rank_table(status, ranks), rank_verdict(ranks, rank_problems or {})]
    parts += [status_table(status, silent_after=silent_after), verdict(status, problems)]
    return Group(*parts)


def client_keys(secret: Path | None, server_key: Path | None) -> CurveClient | None:
    """The CURVE keys of a command that connects, from its options (``--curve-secret``
    printed its own warning about the file: the library's is silenced)."""
    with quiet_logger(_SECURITY_LOGGER):
        return curve_client_from_files(secret, server_key)


def server_keys(
    secret: Path | None, clients: Path | None, relays: Path | None = None
) -> CurveServer | None:
    """The CURVE keys of a command that listens, from its options (as :func:`client_keys`)."""
    with quiet_logger(_SECURITY_LOGGER):
        return curve_server_from_files(secret, clients, relays)


def refuse_exposed(
    endpoint: str | None, keys: CurveServer | None, insecure: bool, *, who: str, how: str
) -> None:
    """Fail for a command about to listen where other hosts can reach it, with no CURVE
    keys and no ``--insecure``; ``how`` says which options give ``who`` its keys."""
    if keys is None and not insecure and endpoint and reachable_from_other_hosts(endpoint):
        fail(
            f"{endpoint} is reachable from other hosts: give {who} CURVE keys ({how}), or "
            "--insecure on a trusted network"
        )


@contextlib.contextmanager
def serving_metrics(source: Any, port: int | None, addr: str, out: Console) -> Iterator[None]:
    """Serve ``source``'s status as Prometheus metrics while the block runs, if asked to
    (``--metrics-port``)."""
    server = None
    if port is not None:
        from zmqsync.tools.metrics import serve_metrics

        server = serve_metrics(source, port, addr)
        out.print(f"metrics on http://{addr}:{server.port}/metrics", soft_wrap=True)
    try:
        yield
    finally:
        if server is not None:
            server.close()
