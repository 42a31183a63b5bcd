"""``zmqsync status ENDPOINT``: one look at a running sender's sync state."""

from __future__ import annotations

import json
from typing import Annotated

import typer

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
    status_view,
    user_errors,
)

#: Exit codes, documented in the help text: scripts branch on them.
EXIT_OK, EXIT_LAGGING, EXIT_NO_SENDER = 0, 1, 2


def status(
    endpoint: Annotated[
        str,
        typer.Argument(
            help="The sender's endpoint, as it printed it (tcp://HOST:PORT or ipc:///PATH)."
        ),
    ],
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="Print the state as JSON (the sender's status() plus 'problems')."
        ),
    ] = False,
    timeout: Annotated[
        float, typer.Option(min=0.01, help="Seconds to wait for the sender to answer.")
    ] = DEFAULT_STATUS_TIMEOUT,
    silent_after: Annotated[float, typer.Option(min=0, help=SILENT_HELP)] = DEFAULT_SILENT_AFTER,
    curve_secret: CurveSecret = None,
    curve_server_key: CurveServerKey = None,
) -> None:
    """Show which version every worker holds, and how syncing has gone.

    Given a rank of a sharded learner (rank 0's endpoint, say), every rank it names is
    asked too, with the same keys, and shown in a row: its endpoint, version and bytes
    sent, or that it is not answering.

    Exit code: 0 when every worker holds the sender's current version (and every rank
    answers at it), 1 when any is behind, has not connected or went silent (or a rank
    does not answer), 2 when no sender answered.
    """
    with user_errors(code=EXIT_NO_SENDER):
        curve = client_keys(curve_secret, curve_server_key)
        state = SenderStatus.from_dict(query_status(endpoint, timeout, curve=curve))
    problems = assess(state, silent_after=silent_after)
    ranks = query_ranks(state, timeout, curve=curve)
    ranks_wrong = rank_problems(ranks)
    if as_json:
        problems_doc = {str(w): p for w, p in sorted(problems.items())}
        doc = {**state.as_dict(), "problems": problems_doc}
        if ranks:
            doc["rank_rows"] = [row.as_dict() for row in ranks]
            doc["rank_problems"] = {str(r): p for r, p in sorted(ranks_wrong.items())}
        typer.echo(json.dumps(doc, indent=2, sort_keys=False))
    else:
        view = status_view(
            state, problems, silent_after=silent_after, ranks=ranks, rank_problems=ranks_wrong
        )
        console().print(view)
    raise typer.Exit(EXIT_LAGGING if problems or ranks_wrong else EXIT_OK)
