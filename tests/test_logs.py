"""How much a run prints (``raydlrm._logs``): levels from ``RAYDLRM_LOG_LEVEL``, the driver's
formatter, and a worker's quieting of fbgemm (root logger), Ray Data and raydlrm."""

from __future__ import annotations

import logging
import os

import pytest

from raydlrm import _logs


@pytest.fixture
def restore_logging():
    names = ["", "raydlrm", *_logs._LIBRARIES, *_logs._NOTICES]
    levels = {name: logging.getLogger(name).level for name in names}
    root_handlers = list(logging.getLogger().handlers)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger().handlers[:] = root_handlers


@pytest.mark.parametrize(
    ("value", "driver", "worker", "library"),
    [
        (None, logging.INFO, logging.WARNING, logging.WARNING),
        ("info", logging.INFO, logging.INFO, logging.WARNING),
        ("DEBUG", logging.DEBUG, logging.DEBUG, logging.INFO),
        ("WARNING", logging.WARNING, logging.WARNING, logging.WARNING),
    ],
)
def test_levels_follow_the_environment(monkeypatch, value, driver, worker, library) -> None:
    if value is None:
        monkeypatch.delenv(_logs.LOG_LEVEL_ENV, raising=False)
    else:
        monkeypatch.setenv(_logs.LOG_LEVEL_ENV, value)
    assert (_logs.driver_level(), _logs.worker_level(), _logs.library_level()) == (
        driver,
        worker,
        library,
    )


def test_an_unknown_level_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(_logs.LOG_LEVEL_ENV, "loud")
    with pytest.raises(ValueError, match="RAYDLRM_LOG_LEVEL='LOUD'"):
        _logs.log_level()


def test_driver_shows_raydlrm_info_plainly_and_marks_the_rest(
    monkeypatch, restore_logging, capsys
) -> None:
    monkeypatch.delenv(_logs.LOG_LEVEL_ENV, raising=False)
    _logs.configure_driver()
    logging.getLogger("raydlrm.platform.progress").info("training: 10/20 samples")
    logging.getLogger("raydlrm.platform.launch").debug("sharding plan: hidden")
    logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables")
    logging.getLogger("raydlrm.trainers.loop").warning("reports dominate")
    err = capsys.readouterr().err.splitlines()
    assert err == ["training: 10/20 samples", "WARNING raydlrm.trainers.loop: reports dominate"]


def test_verbose_driver_sets_debug_for_the_processes_it_starts(
    monkeypatch, restore_logging
) -> None:
    monkeypatch.setenv(_logs.LOG_LEVEL_ENV, "WARNING")  # restored after the test
    _logs.configure_driver(verbose=True)

    assert os.environ[_logs.LOG_LEVEL_ENV] == "DEBUG"
    assert logging.getLogger("mlflow").level == logging.INFO
    assert logging.getLogger("raydlrm").level == logging.DEBUG


def test_quiet_worker_silences_fbgemm_and_ray_data(restore_logging) -> None:
    import ray.data

    from raydlrm.trainers._ray import configure_data_output

    context = ray.data.DataContext.get_current()
    before = (context.print_on_execution_start, context.use_ray_tqdm)
    try:
        _logs.configure_worker(logging.WARNING, logging.WARNING)
        configure_data_output(logging.WARNING)
        # fbgemm's TBE logs its argument dump with logging.info on the root logger.
        assert not logging.getLogger().isEnabledFor(logging.INFO)
        assert not logging.getLogger("ray.data._internal.progress").isEnabledFor(logging.INFO)
        assert not logging.getLogger("raydlrm.trainers.loop").isEnabledFor(logging.INFO)
        assert logging.getLogger("raydlrm.trainers.loop").isEnabledFor(logging.WARNING)
        # Ray's token-auth notice on every local start: errors only.
        assert not logging.getLogger(_logs._NOTICES[0]).isEnabledFor(logging.WARNING)
        assert not context.print_on_execution_start and not context.use_ray_tqdm
    finally:
        context.print_on_execution_start, context.use_ray_tqdm = before


def test_cli_takes_verbose_and_rejects_an_unknown_level(monkeypatch, restore_logging) -> None:
    from typer.testing import CliRunner

    from raydlrm.platform.cli import app

    monkeypatch.setenv(_logs.LOG_LEVEL_ENV, "WARNING")  # restored after the test
    bad_key = ["--set", "training.learnig_rate=0.1"]  # stops before anything runs
    result = CliRunner().invoke(app, ["train", "--verbose", *bad_key])
    assert result.exit_code == 2 and "training.learnig_rate" in result.output
    assert os.environ[_logs.LOG_LEVEL_ENV] == "DEBUG"
    monkeypatch.setenv(_logs.LOG_LEVEL_ENV, "chatty")
    result = CliRunner().invoke(app, ["score", "m", "d", "o"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: RAYDLRM_LOG_LEVEL='CHATTY': expected one of DEBUG, INFO, WARNING, ERROR"
    )


def test_api_logging_follows_stderr_when_it_is_replaced(monkeypatch) -> None:
    """``raydlrm.train`` from a script with no logging set up logs to stderr; a harness that
    swaps stderr (a notebook, pytest's capture) and closes the old one gets the lines, with no
    'I/O operation on closed file' errors."""
    import io
    import logging

    from raydlrm._logs import configure_api

    package = logging.getLogger("raydlrm")
    monkeypatch.setattr(package, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(package, "level", package.level)
    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    configure_api()
    assert len(package.handlers) == 1
    first.close()
    second = io.StringIO()
    monkeypatch.setattr("sys.stderr", second)
    logging.getLogger("raydlrm.platform.launch").warning("a line")
    assert "a line" in second.getvalue()
    configure_api()  # configured already: no second handler
    assert len(package.handlers) == 1


def test_the_drivers_screen_drops_rays_transient_warnings_with_their_tracebacks() -> None:
    """Ray Train's 'safe to ignore' resource-request warning and its traceback (chained or
    not) are dropped from the workers' output the driver prints; the lines around stay."""
    from raydlrm.platform.ray_init import kept_worker_lines

    warning = "Failed to send resource request for train-1. If this only happens transiently..."
    frames = [
        "Traceback (most recent call last):",
        '  File "client.py", line 58, in send_resource_request',
        "    ray.get(",
        "           ^^^^",
        "ray.exceptions.GetTimeoutError: Get timed out",
    ]
    lines = [
        "epoch 1 step 50",
        warning,
        *frames,
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        *frames,
        "epoch 1 step 100",
        warning,
        "a line of its own after a warning without a traceback",
        "Actor has constructor arguments in the object store and max_restarts > 0 ...",
    ]
    assert kept_worker_lines(lines) == [
        "epoch 1 step 50",
        "epoch 1 step 100",
        "a line of its own after a warning without a traceback",
    ]
