"""What the ``raydlrm`` command modules share: the Typer apps (the top-level ``app`` and its
``data``, ``config`` and ``checkpoint`` groups), the exit codes, the options several commands
take, and how a command sets up logging and stops with one line.

Exit codes: 0 success; 2 bad input (config, data, usage), stopped before training started;
1 a failure during the run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from raydlrm._errors import cause_line
from raydlrm._logs import configure_driver
from raydlrm.platform.config import ConfigError

app = typer.Typer(
    help="Train deep-learning recommendation models (DLRMs) on Ray.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
data_app = typer.Typer(
    help="Data sets: generate synthetic data, inspect a data set, cluster it by session (RecD).",
    no_args_is_help=True,
)
config_app = typer.Typer(
    help="Run configs: show or validate the resolved config.", no_args_is_help=True
)
checkpoint_app = typer.Typer(
    help="Training-state checkpoints: inspect one, or unshard it into a plain state dict.",
    no_args_is_help=True,
)
app.add_typer(data_app, name="data")
app.add_typer(config_app, name="config")
app.add_typer(checkpoint_app, name="checkpoint")

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML run file (defaults if omitted).")
]
VerboseOption = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Show the workers' and libraries' INFO lines too (RAYDLRM_LOG_LEVEL=DEBUG).",
    ),
]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config key: section.key=value (repeatable)."),
]


def setup_logging(verbose: bool = False) -> None:
    try:
        configure_driver(verbose=verbose)
    except ValueError as e:
        fail(str(e))


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def run_failed(exc: BaseException, what: str) -> None:
    """Logs the whole error, then stops with one line and exit code 1."""
    logging.getLogger("raydlrm").error("%s failed", what, exc_info=exc)
    fail(f"{what} failed: {cause_line(exc)}", code=EXIT_FAILED)


def bad_input_errors() -> tuple[type[BaseException], ...]:
    from raydlrm.ingestion import DataValidationError

    return (ConfigError, DataValidationError, FileNotFoundError)
