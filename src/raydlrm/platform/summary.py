"""The short summary printed at the end of ``raydlrm train``."""

from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from raydlrm.platform.launch import TrainResult

__all__ = ["mlflow_command", "print_summary"]


def _fmt(value: float | None, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def mlflow_command() -> str:
    """How to run MLflow's command line here: ``mlflow`` when it is on ``PATH``, else the
    ``mlflow`` beside this Python (a virtual environment that is not activated), relative to
    the working directory when it is under it."""
    beside = Path(sys.executable).parent / "mlflow"
    if shutil.which("mlflow") or not beside.is_file():
        return "mlflow"
    relative = os.path.relpath(beside)
    return str(beside) if relative.startswith("..") else relative


def _dedup_line(metrics: dict[str, float]) -> str | None:
    """What deduplication (RecD) saved, from the ``dedup/<table>/*`` metrics; None without."""
    tables = sorted(
        {k.split("/")[1] for k in metrics if k.startswith("dedup/") and k.endswith("/ratio")}
    )
    if not tables:
        return None
    ratio = sum(metrics[f"dedup/{t}/ratio"] for t in tables) / len(tables)
    lookups = sum(metrics.get(f"dedup/{t}/lookups_saved", 0.0) for t in tables)
    saved = sum(metrics.get(f"dedup/{t}/a2a_bytes_saved", 0.0) for t in tables) / 2**20
    return (
        f"deduplicated (RecD): {len(tables)} tables, {ratio:.2f} samples per unique row; "
        f"{lookups:,.0f} lookups and {saved:,.1f} MiB of all-to-all saved (dedup/* in the run)"
    )


def _metrics_table(m: dict[str, float]) -> Table:
    """The metrics by data set: train, valid (with a validation set) and eval."""
    table = Table(title="raydlrm training summary", show_header=True)
    ranked = {
        k.split("/", 1)[1] for k in m if k.startswith(("eval/", "valid/")) and "_at_" in k
    }  # a retrieval model's hr_at_K, ndcg_at_K
    names = ["auc", "log_loss", "normalized_entropy"]
    if ranked:
        by_cut = sorted(ranked, key=lambda n: (n.split("_at_")[0], int(n.split("_at_")[1])))
        names = by_cut
    parts = ["train", *(["valid"] if "valid/num_samples" in m else []), "eval"]
    table.add_column("metric")
    for part in parts:
        table.add_column(part, justify="right")
    for name in names:
        table.add_row(name, *(_fmt(m.get(f"{part}/{name}")) for part in parts))
    samples = {"train": "samples_seen", "valid": "valid/num_samples", "eval": "eval/num_samples"}
    table.add_row("samples", *(_fmt(m.get(samples[part]), ".0f") for part in parts))
    return table


def print_summary(result: TrainResult, *, console: Console | None = None) -> None:
    """Prints metrics, throughput, the sharding plan and where to find the MLflow run."""
    console = console or Console()
    m = result.metrics
    console.print(_metrics_table(m))
    if result.stop_reason and "early_stopping/best_step" in m:
        console.print(f"training ended: {result.stop_reason}")
    if m.get("rows_unaccounted"):
        console.print(f"rows unaccounted for: {int(m['rows_unaccounted'])} (see the log)")
    if m.get("data/rows_quarantined") or m.get("data/files_quarantined"):
        console.print(
            f"quarantined: {int(m.get('data/rows_quarantined', 0))} rows while reading, "
            f"{int(m.get('data/files_quarantined', 0))} files "
            f"({int(m.get('data/rows_in_quarantined_files', 0))} rows) at validation"
        )
    kernel = ""
    if "sharding/torch_kernel_ranks" in m:
        torch_ranks = int(m["sharding/torch_kernel_ranks"])
        workers = result.plan.world_size
        kernel = {0: ", fbgemm kernels", workers: ", torch kernels"}.get(
            torch_ranks, f", torch kernels on {torch_ranks} of {workers} workers"
        )
    console.print(
        f"throughput: {_fmt(m.get('train/samples_per_second'), ',.0f')} samples/s in the "
        f"{int(m.get('step', 0))} training steps (not start-up, evaluation or reports){kernel}"
    )
    wire = {k: v for k, v in m.items() if k.startswith("comm/")}
    if wire:
        total = sum(wire.values()) / 2**20
        console.print(
            f"embedding all-to-all traffic: {total:,.1f} MiB "
            f"(by direction and codec in the MLflow run, comm/*)"
        )
    dedup = _dedup_line(m)
    if dedup:
        console.print(dedup)
    console.print("sharding plan:")
    # Plain print: the plan is a fixed-width table that must not be re-wrapped.
    print(result.plan.format_table(), file=console.file, flush=True)
    console.print(f"MLflow run: {result.run_id}  ({result.tracking_uri})", soft_wrap=True)
    if result.registered_model_name:
        console.print(
            f"registered model: {result.registered_model_name} "
            f"version {result.registered_model_version}"
        )
    console.print(f"checkpoint: {result.checkpoint_path}", soft_wrap=True)
    console.print(
        f"open the MLflow UI: {mlflow_command()} ui --backend-store-uri {result.tracking_uri}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
