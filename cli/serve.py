"""``zmqsync serve CHECKPOINT``: a learner that publishes a checkpoint file's weights."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Final

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from zmqsync.errors import CheckpointError
from zmqsync.tools.checkpoints import CheckpointPublisher, PublishResult

from ._common import (
    CurveRelays,
    CurveSecret,
    MetricsAddr,
    MetricsPort,
    ModeChoice,
    ModeOption,
    Workers,
    console,
    fmt_bytes,
    fmt_seconds,
    refuse_exposed,
    server_keys,
    serving_metrics,
    sigterm_as_interrupt,
    user_errors,
)

#: Sends of at least this many bytes show a progress bar (acks so far) on a terminal.
LARGE_SEND: Final = 64 * 1024 * 1024


def serve(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="A .pt/.pth file (read with torch.load(weights_only=True)) or a .safetensors file."
        ),
    ],
    endpoint: Annotated[
        str | None,
        typer.Option(
            help="Where to listen: tcp://HOST:PORT (the next two ports are used too), "
            "tcp://HOST:* for free ports, or ipc:///PATH. Default: an ipc path in a new "
            "private directory (workers on this host only, and only this user's), "
            "printed at start.",
            show_default=False,
        ),
    ] = None,
    mode: ModeOption = ModeChoice["pubsub"],
    workers: Workers = None,
    poll: Annotated[
        float,
        typer.Option(min=0.05, help="Seconds between checks of the checkpoint file for changes."),
    ] = 1.0,
    key: Annotated[
        str | None,
        typer.Option(
            help="Publish one entry of the checkpoint, e.g. 'model' of {'model': ..., 'step': ...}."
        ),
    ] = None,
    timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds each new version waits for workers' acks.")
    ] = 30.0,
    metrics_port: MetricsPort = None,
    metrics_addr: MetricsAddr = "127.0.0.1",
    curve_secret: CurveSecret = None,
    curve_clients: Annotated[
        Path | None,
        typer.Option(
            envvar="ZMQSYNC_CURVE_CLIENTS",
            file_okay=False,
            help="Accept only the clients whose "
            "public keys (*.key) are in this directory; needs --curve-secret.",
        ),
    ] = None,
    curve_relays: CurveRelays = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Listen on an address other hosts can reach without CURVE keys "
            "(a trusted network only: anyone there can read the weights).",
        ),
    ] = False,
) -> None:
    """Publish the weights of a checkpoint file, and republish them whenever it changes.

    Prints 'zmqsync serve: listening on ENDPOINT' once it listens; start workers with
    `zmqsync worker ENDPOINT --model module:factory`. Without --endpoint it listens on
    an ipc path in a private directory (removed when it stops): workers on other hosts
    need --endpoint tcp://HOST:PORT (with CURVE keys). Write new checkpoints to a
    temporary name and rename them into place, so a half-written file is never read.
    Runs until Ctrl-C.
    """
    out = console()
    with user_errors(), sigterm_as_interrupt():
        curve = server_keys(curve_secret, curve_clients, curve_relays)
        refuse_exposed(
            endpoint,
            curve,
            insecure,
            who="the learner",
            how="--curve-secret, made with `zmqsync keys`",
        )
        publisher = CheckpointPublisher(
            checkpoint,
            endpoint=endpoint,
            mode=mode.value,
            num_workers=workers,
            key=key,
            timeout=timeout,
            curve=curve,
            insecure=insecure,
        )
        try:
            first = publisher.start()
            with serving_metrics(publisher, metrics_port, metrics_addr, out):
                _announce(publisher, first, out, mode=mode.value, curve=curve is not None)
                out.print(f"watching {checkpoint} every {poll:g}s; Ctrl-C to stop", soft_wrap=True)
                serving = first.version
                while True:
                    time.sleep(poll)
                    if not publisher.changed():
                        continue
                    try:
                        result = _publish(publisher, out)
                    except Exception as exc:
                        # Whatever a new file does (unreadable, refused, or tensors the
                        # sender cannot send), keep serving the last good version: the
                        # learner outlives one bad write, and the next change is read again.
                        why = (
                            str(exc)
                            if isinstance(exc, CheckpointError)
                            else f"cannot publish {checkpoint}: {type(exc).__name__}: {exc}"
                        )
                        console(stderr=True).print(
                            f"warning: {why}; still serving version {serving}", soft_wrap=True
                        )
                        continue
                    serving = result.version
                    _report(result, out)
        except KeyboardInterrupt:
            out.print("zmqsync serve: stopped")
        finally:
            publisher.close()


def _announce(
    publisher: CheckpointPublisher, first: PublishResult, out: Console, *, mode: str, curve: bool
) -> None:
    """Say where the learner listens, how workers join it, and what it serves first."""
    secured = ", CURVE" if curve else ""
    out.print(
        f"zmqsync serve: listening on {publisher.endpoint} "
        f"({mode}, state_dict, model 'policy'{secured})",
        soft_wrap=True,
    )
    keys = " --curve-secret KEY_SECRET --curve-server-key SERVER_KEY" if curve else ""
    out.print(
        f"start workers with: zmqsync worker {publisher.endpoint} --model module:factory{keys}",
        soft_wrap=True,
    )
    out.print(
        f"version {first.version}: {publisher.path} ({fmt_bytes(first.nbytes)}) is "
        "ready; workers get it when they connect",
        soft_wrap=True,
    )


def _publish(publisher: CheckpointPublisher, out: Console) -> PublishResult:
    """Publish the changed file; a large one shows a progress bar of acks on a terminal,
    and a line before it starts elsewhere (logs)."""
    size = publisher.path.stat().st_size if publisher.path.exists() else 0
    if size < LARGE_SEND:
        return publisher.publish()
    if not out.is_terminal:
        out.print(f"version {publisher.version + 1}: sending {fmt_bytes(size)}...")
        return publisher.publish()
    with Progress(
        TextColumn("sending {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("workers acked"),
        TimeElapsedColumn(),
        console=out,
        transient=True,
    ) as progress:
        task = progress.add_task(f"version {publisher.version + 1}", total=None)

        def update(acked: int, total: int) -> None:
            progress.update(task, completed=acked, total=total)

        return publisher.publish(progress=update)


def _report(result: PublishResult, out: Console) -> None:
    """One line per version: who has it, how long it took, and who did not take it."""
    targeted = len(result.targets)
    size = fmt_bytes(result.nbytes)
    took = fmt_seconds(result.seconds)
    if result.ok:
        who = f"{targeted} workers" if targeted else "no workers yet"
        out.print(f"version {result.version}: {size} synced to {who} in {took}", soft_wrap=True)
        return
    reached = targeted - len(result.missing) - len(result.rejected)
    line = f"version {result.version}: {size} reached {reached} of {targeted} workers in {took}"
    if result.missing:
        ids = ", ".join(map(str, result.missing))
        line += (
            f"; no ack from worker {ids} (it gets this version when it is back)"
            if len(result.missing) == 1
            else f"; no ack from workers {ids} (they get this version when they are back)"
        )
    if result.rejected:
        line += "; refused by " + "; ".join(
            f"worker {w}: {r}" for w, r in sorted(result.rejected.items())
        )
    out.print(line, style="yellow", soft_wrap=True)
