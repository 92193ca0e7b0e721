"""The quickstart notebook (``notebooks/quickstart.ipynb``), executed top to bottom (a scenario:
``make test-scenarios``), but for the architecture comparison and the sweep.

The notebook runs in a Jupyter kernel of this interpreter (so it imports the raydlrm installed
here) with ``RAYDLRM_NOTEBOOK_DIR`` pointing at a temporary directory. The kernel is a process
of its own: it starts its own small local Ray, next to the test session's. The notebook ends
with a cell printing a JSON summary, which the checks below read along with the cells' outputs.

The comparison (three more trainings) and the sweep (two trials) took 150 of the notebook's
200 s and repeat what other tests run: every architecture trains through Ray in the Ray tests
(DHEN in ``test_resume``, Wukong in ``test_retrain``, DCNv2 in ``test_api`` and
``test_towers``) and on gloo in ``tests/models`` and ``tests/trainers``, and sweeps in
``test_tune``. They are not executed here; a static check (no Ray, seconds) reads them: they
compile, their configs load, and the sweep's search space fits its config.
"""

from __future__ import annotations

import ast
import base64
import copy
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"
CELL_TIMEOUT_S = 600
COVERED_ELSEWHERE = ("compare", "sweep")
"""Tags of the cells the executed notebook skips (see the module docstring)."""


def _cell(nb: Any, tag: str) -> Any:
    cells = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"one cell tagged {tag!r} expected, found {len(cells)}"
    return cells[0]


def _text(cell: Any) -> str:
    """Everything a code cell printed (stdout) and displayed as plain text."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream" and out.name == "stdout":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def _pngs(cell: Any) -> list[bytes]:
    return [
        base64.b64decode(out.data["image/png"])
        for out in cell.outputs
        if out.output_type == "display_data" and "image/png" in out.data
    ]


def test_committed_notebook_has_no_outputs() -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    assert all(not c.outputs and c.execution_count is None for c in code), (
        "commit the notebook with its outputs cleared"
    )


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any], Path]:
    """The notebook after execution, its JSON summary and its run directory."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    workdir = tmp_path_factory.mktemp("notebook")
    run_dir = workdir / "run"
    # A kernel spec of this very interpreter: a "python3" spec found elsewhere (the user's
    # Jupyter directory) could name another Python, one without raydlrm.
    kernels = workdir / "kernels"
    write_kernel_spec(kernels / "raydlrm-test")
    km = KernelManager(
        kernel_name="raydlrm-test",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]),
        connection_file=str(workdir / "kernel.json"),  # not in /tmp, where it stayed
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["RAYDLRM_NOTEBOOK_DIR"] = str(run_dir)
    env["RAY_DATA_DISABLE_PROGRESS_BARS"] = "1"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells = [c for c in nb.cells if not set(c.metadata.get("tags", [])) & set(COVERED_ELSEWHERE)]
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        startup_timeout=180,
        resources={"metadata": {"path": str(workdir)}},  # the kernel's working directory
    )
    try:
        client.execute(env=env)  # raises CellExecutionError on the first cell that fails
    finally:
        if km.has_kernel:  # the client leaves a kernel it was given running
            km.shutdown_kernel()
        km.cleanup_resources()
    summary_lines = _text(_cell(nb, "summary")).strip().splitlines()
    return nb, json.loads(summary_lines[-1]), run_dir


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.scenario
def test_notebook_runs_in_this_interpreter_without_errors(executed) -> None:
    nb, summary, run_dir = executed
    errors = [
        out
        for c in nb.cells
        if c.cell_type == "code"
        for out in c.outputs
        if out.output_type == "error"
    ]
    assert not errors, errors
    assert all(c.execution_count for c in nb.cells if c.cell_type == "code")
    assert Path(summary["python_prefix"]).resolve() == Path(sys.prefix).resolve()
    # Everything went into RAYDLRM_NOTEBOOK_DIR, and the notebook shut its Ray down.
    assert (run_dir / "mlflow.db").is_file()
    assert (run_dir / "data" / "metadata.json").is_file()
    assert any((run_dir / "runs").iterdir())
    assert summary["ray_initialized"] is False


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.scenario
def test_notebook_model_learns(executed) -> None:
    nb, summary, _ = executed
    shown = re.search(r"^eval/auc\s+([0-9.]+)$", _text(_cell(nb, "metrics")), re.MULTILINE)
    assert shown, _text(_cell(nb, "metrics"))
    assert float(shown.group(1)) > 0.55
    assert summary["eval_auc"] > 0.55  # raydlrm.evaluate on the registered model
    assert summary["eval_auc"] == pytest.approx(summary["train_eval_auc"], abs=0.02)
    assert 0 < summary["eval_log_loss"] < 0.69
    assert summary["eval_rows"] == 4000
    assert re.search(r"^AUC\s+0\.\d{4}", _text(_cell(nb, "evaluate")), re.MULTILINE)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.scenario
def test_notebook_plots_loss_curve_and_sharding(executed) -> None:
    from mlflow import MlflowClient

    nb, summary, run_dir = executed
    for tag in ("loss-curve", "sharding-plot"):
        pngs = _pngs(_cell(nb, tag))
        assert len(pngs) == 1, f"cell {tag!r} should show one figure"
        assert pngs[0].startswith(b"\x89PNG")
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("raydlrm-notebook").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert summary["loss_points"] == len(history) >= 6
    assert summary["ranks_plotted"] == 2
    assert "rank" in _text(_cell(nb, "sharding-plot"))  # the plan's per-rank table


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.scenario
def test_notebook_scores_raw_rows_with_mlflow(executed) -> None:
    nb, summary, _ = executed
    predictions = summary["predictions"]
    assert summary["rows_scored"] == len(predictions) == 8
    assert all(0.0 < p < 1.0 for p in predictions)
    assert len(set(predictions)) > 1  # the rows differ, so do their scores
    assert "prediction" in _text(_cell(nb, "score"))
    stderr = [o.text for o in _cell(nb, "score").outputs if o.get("name") == "stderr"]
    assert not any("extra inputs" in text for text in stderr), stderr


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.scenario
def test_notebook_builds_histories_and_trains_sasrec(executed) -> None:
    """The sequence section: histories built from an event log with Ray Data, SASRec trained
    on them ranks the next item far above a random ranking (HR@10 of 0.1 over 100 items)."""
    nb, summary, _ = executed
    assert summary["sasrec_examples"]["train"] == 300  # one row per user and split
    assert summary["sasrec_hr_at_10"] > 0.3
    assert re.search(r"^eval/ndcg_at_10\s+0\.\d{4}", _text(_cell(nb, "sequences")), re.MULTILINE)


def test_notebook_scores_the_signatures_columns() -> None:
    """MLflow warns about every column its signature lacks (label, sample id): the scoring cell
    passes the signature's input columns, as README's snippet does."""
    nbformat = pytest.importorskip("nbformat")
    source = _cell(nbformat.read(NOTEBOOK, as_version=4), "score").source
    assert "get_input_schema().input_names()" in source
    assert "model.predict(rows)" not in source


def _statements(source: str) -> list[ast.stmt]:
    """A cell's top-level statements (IPython's ``%`` lines left out)."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith("%")]
    return ast.parse("\n".join(lines)).body


def _calls(node: ast.AST) -> set[str]:
    return {ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}


def _run_until(source: str, call: str, namespace: dict[str, Any]) -> ast.Call | None:
    """Runs a cell's statements up to the first that calls ``call`` (which trains: not run);
    returns that call (None: the cell has none)."""
    for statement in _statements(source):
        if call in _calls(statement):
            return next(
                n
                for n in ast.walk(statement)
                if isinstance(n, ast.Call) and ast.unparse(n.func) == call
            )
        exec(compile(ast.Module([statement], type_ignores=[]), "<cell>", "exec"), namespace)
    return None


def test_skipped_cells_compile_and_fit_the_notebooks_config() -> None:
    """The cells the executed notebook skips (:data:`COVERED_ELSEWHERE`), read without Ray:
    every code cell compiles; each compared architecture's settings load as a config (a
    renamed key or a bad value is a ``ConfigError``); the sweep's search space passes the
    checks ``raydlrm.tune`` makes before any trial, on the sweep's config."""
    nbformat = pytest.importorskip("nbformat")
    from raydlrm.platform.config import load_config
    from raydlrm.platform.search_space import check_space, parse_search

    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            _statements(cell.source)  # a SyntaxError names the cell's line
    namespace: dict[str, Any] = {
        "data": SimpleNamespace(train_path="data/train", eval_path="data/eval"),
        "RUN_DIR": Path("run"),
        "result": SimpleNamespace(metrics={}),  # the first training's
    }
    assert _run_until(_cell(nb, "train").source, "raydlrm.train", namespace) is not None
    assert _run_until(_cell(nb, "compare").source, "raydlrm.train", namespace) is not None
    assert set(namespace["others"]) == {"dcnv2", "wukong", "dhen"}
    for knobs in namespace["others"].values():
        variant = copy.deepcopy(namespace["config"])
        variant["model"].update(knobs)
        assert load_config(variant).model.arch == knobs["arch"]
    tune = _run_until(_cell(nb, "sweep").source, "raydlrm.tune", namespace)
    assert tune is not None
    (search,) = [k.value for k in tune.keywords if k.arg == "search"]
    space = parse_search(ast.literal_eval(search))
    assert set(space) == {"training.learning_rate", "model.top_mlp"}
    check_space(load_config(namespace["sweep_config"]), space)
