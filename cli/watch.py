"""``zmqsync watch ENDPOINT``: the status table, refreshed live until Ctrl-C."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.console import RenderableType
from rich.live import Live
from rich.text import Text

from zmqsync.endpoints import check_connectable
from zmqsync.errors import ZMQSyncError
from zmqsync.security import CurveClient
from zmqsync.status_types import SenderStatus
from zmqsync.tools.status import (
    DEFAULT_SILENT_AFTER,
    DEFAULT_STATUS_TIMEOUT,
    assess,
    query_ranks,
    query_status,
    rank_problems,
)

from ._common import (
    SILENT_HELP,
    CurveSecret,
    CurveServerKey,
    client_keys,
    console,
    sigterm_as_interrupt,
    status_view,
    user_errors,
)


def _snapshot(
    endpoint: str, timeout: float, silent_after: float, curve: CurveClient | None
) -> RenderableType:
    try:
        state = SenderStatus.from_dict(query_status(endpoint, timeout, curve=curve))
    except ZMQSyncError as exc:  # a malformed status too (FrameError)
        # A learner restarting is what watch is for: say so and keep asking.
        return Text(f"{time.strftime('%H:%M:%S')}  no answer: {exc}", style="red")
    problems = assess(state, silent_after=silent_after)
    ranks = query_ranks(state, timeout, curve=curve)  # a sharded learner's: a row per rank
    return status_view(
        state, problems, silent_after=silent_after, ranks=ranks, rank_problems=rank_problems(ranks)
    )


def watch(
    endpoint: Annotated[str, typer.Argument(help="The sender's endpoint, as it printed it.")],
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between refreshes.")] = 1.0,
    timeout: Annotated[
        float, typer.Option(min=0.01, help="Seconds to wait for each answer.")
    ] = DEFAULT_STATUS_TIMEOUT,
    silent_after: Annotated[float, typer.Option(min=0, help=SILENT_HELP)] = DEFAULT_SILENT_AFTER,
    count: Annotated[
        int | None,
        typer.Option(min=1, help="Stop after this many refreshes (default: until Ctrl-C)."),
    ] = None,
    curve_secret: CurveSecret = None,
    curve_server_key: CurveServerKey = None,
) -> None:
    """Watch a sender's sync state live: the `status` table, refreshed until Ctrl-C.

    A sender that stops answering is shown as such, and watched until it is back; a
    sharded learner's ranks are shown a row each, as by `status`.
    """
    out = console()
    with user_errors(code=2):
        check_connectable(endpoint)  # a malformed endpoint is an error, not a retry loop
        curve = client_keys(curve_secret, curve_server_key)
    refreshes = 0
    try:
        with sigterm_as_interrupt():
            if out.is_terminal:
                with Live(console=out, auto_refresh=False, transient=False) as live:
                    while count is None or refreshes < count:
                        live.update(_snapshot(endpoint, timeout, silent_after, curve), refresh=True)
                        refreshes += 1
                        if count is None or refreshes < count:
                            time.sleep(interval)
            else:
                # Piped or captured: one table after another, each stamped.
                while count is None or refreshes < count:
                    out.rule(time.strftime("%H:%M:%S"))
                    out.print(_snapshot(endpoint, timeout, silent_after, curve))
                    refreshes += 1
                    if count is None or refreshes < count:
                        time.sleep(interval)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how watch ends
