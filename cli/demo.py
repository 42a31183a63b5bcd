"""``zmqsync demo``: a learner and N local workers, synced live in front of you."""

from __future__ import annotations

import contextlib
import enum
import time
from typing import Annotated

import typer
from rich.console import RenderableType
from rich.live import Live

from zmqsync.status_types import SenderStatus
from zmqsync.tools.demo import DEMO_TRANSPORTS, LocalFleet
from zmqsync.tools.status import assess

from ._common import (
    ModeChoice,
    ModeOption,
    console,
    fmt_bytes,
    fmt_seconds,
    sigterm_as_interrupt,
    status_view,
    user_errors,
)

# The choices of --transport (see ModeChoice for why an Enum, and why the ignore).
TransportChoice = enum.Enum(  # type: ignore[misc]
    "TransportChoice", [(t, t) for t in DEMO_TRANSPORTS], type=str
)


def demo(
    workers: Annotated[
        int, typer.Option("--workers", "-n", min=1, max=64, help="Worker processes to start.")
    ] = 4,
    versions: Annotated[
        int, typer.Option("--versions", min=1, help="Versions of the model to send.")
    ] = 3,
    size_mb: Annotated[
        float, typer.Option("--size-mb", min=0.001, help="Size of the demo MLP's weights, in MB.")
    ] = 1.0,
    mode: ModeOption = ModeChoice["pubsub"],
    transport: Annotated[
        TransportChoice,
        typer.Option(help="ipc (unix sockets in a private temp dir) or tcp on 127.0.0.1."),
    ] = TransportChoice["ipc"],
    interval: Annotated[
        float,
        typer.Option(
            min=0, help="Seconds of 'training' between versions, so you can watch the table."
        ),
    ] = 0.5,
    timeout: Annotated[
        float,
        typer.Option(min=1, help="Seconds to wait for workers to start and to ack each version."),
    ] = 120.0,
) -> None:
    """Run a learner and N local workers, send V versions, and show every worker's version.

    The learner runs in this process; each worker is its own process with its own copy
    of the model. Every send returns only when all workers have applied it: the time
    printed per version is that full round trip. Ends by itself; Ctrl-C stops it early.
    """
    out = console()
    silent_after = None  # the workers live exactly as long as the demo: no silence to see
    with user_errors(), sigterm_as_interrupt():
        fleet = LocalFleet(
            workers, size_mb=size_mb, mode=mode.value, transport=transport.value, timeout=timeout
        )
        try:
            out.print(
                f"zmqsync demo: a learner and {workers} workers, a {fmt_bytes(fleet.nbytes)} "
                f"MLP, {mode.value} over {transport.value}"
            )
            started = time.monotonic()

            def view() -> RenderableType:
                state = SenderStatus.from_dict(fleet.status())
                return status_view(
                    state, assess(state, silent_after=silent_after), silent_after=silent_after
                )

            # A live table on a terminal; captured output gets the lines and final table.
            live = (
                Live(console=out, get_renderable=view, refresh_per_second=8, transient=True)
                if out.is_terminal
                else None
            )
            with live if live is not None else contextlib.nullcontext():
                fleet.start()
                out.print(
                    f"learner at {fleet.endpoint}; {workers} workers connected in "
                    f"{fmt_seconds(time.monotonic() - started)}"
                )
                for _ in range(versions):
                    if interval:
                        time.sleep(interval)
                    seconds = fleet.step()
                    out.print(
                        f"version {fleet.status()['version']}: synced to {workers} "
                        f"workers in {fmt_seconds(seconds)}"
                    )
            state = SenderStatus.from_dict(fleet.status())
            problems = assess(state, silent_after=silent_after)
            out.print(status_view(state, problems, silent_after=silent_after))
        except KeyboardInterrupt:
            out.print("interrupted: stopping the workers")
            raise typer.Exit(130) from None
        finally:
            fleet.close()
    if problems:
        raise typer.Exit(1)
