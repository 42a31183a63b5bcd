"""The ``zmqsync`` command: one typer app, one command per module of this package."""

from __future__ import annotations

from typing import Annotated

import typer

from . import demo, keys, relay, serve, status, watch, worker
from ._common import State, set_state, setup_logging

app = typer.Typer(
    name="zmqsync",
    help="Sync versioned neural-network weights from a learner to a fleet of workers, "
    "and see where every worker stands.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # errors are one line (see _common.user_errors)
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from zmqsync import __version__

        typer.echo(f"zmqsync {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    debug: Annotated[
        bool, typer.Option("--debug", envvar="ZMQSYNC_DEBUG", help="Show the traceback of errors.")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Sync versioned neural-network weights from a learner to a fleet of workers."""
    ctx.obj = State(debug=debug)
    set_state(ctx.obj)
    setup_logging(debug)


app.command("demo")(demo.demo)
app.command("status")(status.status)
app.command("watch")(watch.watch)
app.command("serve")(serve.serve)
app.command("worker")(worker.worker)
app.command("relay")(relay.relay)
app.command("keys")(keys.keys)


def main() -> None:
    """Entry point of the ``zmqsync`` console script."""
    app()
