"""``raydlrm data`` (generate a synthetic data set, inspect a data set, cluster one by
session for RecD, build examples with user histories from an interaction log) and
``raydlrm config`` (show or validate the resolved config)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from raydlrm.ingestion.sequences_config import SequenceBuildConfig
from raydlrm.platform._cli_common import (
    ConfigOption,
    SetOption,
    VerboseOption,
    bad_input_errors,
    config_app,
    data_app,
    fail,
    run_failed,
    setup_logging,
)
from raydlrm.platform.config import ConfigError, load_config
from raydlrm.storage import redact


@data_app.command(
    "generate",
    short_help="Generate the synthetic data set data.synthetic describes: Criteo-shaped, "
    "daily partitions with id churn (kind = churn) or user histories (kind = sequences).",
)
def data_generate(
    config: ConfigOption = None,
    set_: SetOption = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Output directory (train/ and eval/ inside; churn data: train/ only). "
            "Default: the parent of data.train_path."
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing data set.")] = False,
) -> None:
    """Generate the synthetic data set the config's data.synthetic section describes:
    data.synthetic.kind = "criteo" (the default), a Criteo-shaped data set with a planted
    model (train/, eval/); kind = "churn", daily partitions for retraining
    (train/<partition_key>=<YYYY-MM-DD>/) where each day a share of every id column's ids is
    new (data.synthetic.churn.new_id_share) and id popularity (Zipf) drifts, with labels from
    per-id biases and user-item latent vectors, so that ids which collide lose signal; its
    distinct ids per column, per day and in total, are printed and kept in metadata.json
    (e.g. --set data.synthetic.kind=churn --set data.synthetic.churn.num_days=7); kind =
    "sequences", user histories (train/, eval/): one row per user, a target item and a
    history of 50 to 1,000 Zipf-distributed items (data.synthetic.sequences)."""
    setup_logging()
    from raydlrm.ingestion import SyntheticConfig, generate_synthetic
    from raydlrm.ingestion.synthetic import SyntheticDataExistsError

    try:
        job = load_config(config, overrides=set_ or [])
    except ConfigError as e:
        fail(str(e))
    synthetic = job.data.synthetic or SyntheticConfig()
    target = out or Path(job.data.train_path).parent
    try:
        info = generate_synthetic(synthetic, out_dir=target, overwrite=overwrite)
    except SyntheticDataExistsError as e:
        fail(f"{e.out_dir} holds {e.what}: --overwrite replaces it")
    if info.churn is None:
        rows = f"{info.num_train_rows} train and {info.num_eval_rows} eval rows"
        auc = (
            "no eval rows to measure the planted model on"
            if info.planted_auc is None
            else f"planted-model eval AUC {info.planted_auc:.4f}"
        )
    else:
        days = info.churn.days
        key = synthetic.partition_key
        rows = f"{info.num_train_rows} rows in {len(days)} days {key}={days[0]}..{days[-1]}"
        auc = f"planted-model AUC on the newest day {info.planted_auc:.4f}"
    if info.kept:
        typer.echo(f"{target} already holds this data set ({rows}, {auc}): kept, nothing written")
    else:
        typer.echo(f"wrote {rows} to {target} ({auc})")
    _echo_ids(info)


def _echo_ids(info: Any) -> None:
    """The ids of churn data or the histories of sequence data (a
    :class:`~raydlrm.ingestion.SyntheticInfo`)."""
    if info.sequences is not None:
        seq = info.sequences
        typer.echo(
            f"  histories: {seq.history_ids} events, {seq.mean_history_length:.1f} per user "
            f"({seq.min_history_length}..{seq.max_history_length}); {seq.num_items} items"
        )
    if info.churn is not None:
        for column, total in info.churn.total_distinct_ids.items():
            per_day = ", ".join(map(str, info.churn.distinct_ids[column]))
            new = ", ".join(map(str, info.churn.new_ids[column]))
            typer.echo(
                f"  {column}: {total} distinct ids over all days; per day {per_day}; "
                f"first seen per day {new}"
            )


@data_app.command("inspect")
def data_inspect(
    config: ConfigOption = None,
    set_: SetOption = None,
    path: Annotated[
        str | None,
        typer.Option("--path", help="The data set to inspect (default: data.train_path)."),
    ] = None,
    max_rows: Annotated[
        int, typer.Option("--max-rows", help="Rows read for the column statistics.")
    ] = 200_000,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Inspect a data set through the config: files, rows, schema, bad rows, id cardinalities
    and table use per sparse column, events per row per sequence, dedup ratio per dedup group,
    what the file order is correlated with (runs of ids, label drift, time)."""
    from raydlrm.ingestion.inspect import inspect_data

    try:
        job = load_config(config, overrides=set_ or [])
        report = inspect_data(path or job.data.train_path, job.data, max_rows=max_rows)
    except bad_input_errors() as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(
        f"{report['path']}: {report['rows']} rows in {report['files']} files "
        f"({report['row_groups']} row groups); label rate {report['label_rate']:.4f}; "
        f"{report['bad_rows_in_sample']} bad of {report['sampled_rows']} rows read"
    )
    for column, c in report["sparse"].items():
        typer.echo(
            f"  {column:<12} table {c['table']:<12} distinct ids {c['distinct_ids']:>9}  "
            f"table rows used {c['table_rows_used']:>9}/{c['table_size']:<9} "
            f"mean length {c['mean_length']:.2f}  nulls {c['nulls']}"
        )
    for column, c in report["dense"].items():
        if c["nulls"] or c["non_finite"]:
            typer.echo(
                f"  {column:<12} nulls {c['nulls']} ({c['missing_share']:.1%} missing)  "
                f"non-finite {c['non_finite']}"
            )
    for c in report["dense"].values():
        if c["flag"]:
            typer.echo(f"  warning: {c['flag']}")
    for group in report["dedup"]:
        typer.echo(f"  dedup {'+'.join(group['columns'])}: ratio {group['ratio']:.2f}")
    _echo_sequences(report["sequences"])
    r = report["recd"]
    typer.echo(
        f"  recd: {r['layout']} layout; dedup factor {r['dedup_factor']:.2f} over all sparse "
        f"features; user features {'+'.join(r['user_columns']) or 'none'} "
        f"({r['user_columns_from']}) {r['user_lookup_share']:.1%} of lookups"
    )
    typer.echo("  file order:" + ("" if report["file_order"] else " no order found"))
    for finding in report["file_order"]:
        typer.echo(f"    {finding['kind']} {finding['message']}")


def _echo_sequences(sequences: dict[str, dict]) -> None:
    """One line per sequence of ``raydlrm data inspect``: its events per row."""
    for name, q in sequences.items():
        typer.echo(
            f"  sequence {name} ({'+'.join(q['columns'])}): events per row mean "
            f"{q['mean_length']:.1f}, median {q['median_length']:.0f}, p99 {q['p99_length']:.0f}, "
            f"longest {q['longest']}; {q['empty_share']:.1%} empty, {q['truncated_share']:.1%} "
            f"longer than max_length {q['max_length']}"
        )


@data_app.command("cluster")
def data_cluster(
    out: Annotated[str, typer.Option("--out", help="Directory of the clustered data set.")],
    config: ConfigOption = None,
    set_: SetOption = None,
    path: Annotated[
        str | None,
        typer.Option("--path", help="The sample-level data set (default: data.train_path)."),
    ] = None,
    columns: Annotated[
        list[str] | None,
        typer.Option(
            "--column",
            help="A sparse column to store once per session (repeatable; default: the "
            "data.dedup_groups columns, else those constant within sessions).",
        ),
    ] = None,
) -> None:
    """Convert a sample-level data set to the session-clustered layout (RecD): the user
    features once per session beside the samples, partitions kept; checks that each session
    is contiguous and each user column constant within it (data.bad_input = "quarantine"
    sets such sessions aside)."""
    setup_logging()
    from raydlrm.ingestion.clustering import cluster_data

    try:
        job = load_config(config, overrides=set_ or [])
        result = cluster_data(
            path or job.data.train_path, job.data, out=out, session_columns=columns or None
        )
    except (*bad_input_errors(), FileExistsError, ValueError) as e:
        fail(str(e))
    ratio = result.source_bytes / max(1, result.clustered_bytes)
    typer.echo(
        f"wrote {result.num_samples} samples and {result.num_sessions} session rows "
        f"({'+'.join(result.session_columns)} once per session) in {result.num_files} files to "
        f"{result.out}; {result.source_bytes:,} -> {result.clustered_bytes:,} bytes "
        f"({ratio:.2f}x smaller)"
    )
    if result.quarantined_sessions:
        typer.echo(
            f"set aside {result.quarantined_sessions} sessions ({result.quarantined_samples} "
            "samples) whose user columns differ within the session"
        )


def _option(kind: type, text: str, *names: str) -> Any:
    """A ``data sequences`` option that, when given, overrides its ``data.sequence_build`` key."""
    return Annotated[kind | None, typer.Option(*names, help=text)]


_LogOption = _option(
    str, "The interaction log (Parquet file or directory, local or s3://).", "--log"
)
_UserColumn = _option(str, "The log's user column (default user_id).")
_ItemColumn = _option(str, "The log's item column (default item_id).")
_TimeColumn = _option(str, "The log's time column (default timestamp).")
_ExtraColumns = _option(
    list[str],
    "A log column copied per event: the target's value and the parallel history list "
    "hist_<column> (repeatable).",
    "--extra-columns",
    "--extra-column",
)
_MaxLength = _option(int, "The longest history: the most recent events are kept (default 200).")
_MinHistory = _option(int, "Examples with a shorter history are left out (default 1).")
_Examples = _option(str, "all: one example per event (DIN); last: one per user and split (SASRec).")
_Split = _option(str, "leave_last_out (per user: last test, second last valid) or time.")
_Cut = _option(str, "split = time: events at or after this time are test events.")
_ValidCut = _option(str, "split = time: events from this time to --cutoff-time are validation.")
_Fraction = _option(float, "split = time without --cutoff-time: the latest share of events.")
_LabelColumn = _option(str, "A numeric column: label = 1 where it is >= --label-min.")
_LabelMin = _option(float, "The threshold of --label-column.")
_ItemIds = _option(str, "rows: dense rows 0..N-1 (items.parquet maps them back); raw: as logged.")
_Partitions = _option(int, "User partitions, one Ray task and file per split each (0: auto).")
_RowGroupRows = _option(int, "Rows per output row group (default 8192).")


def _toml(key: str, value: Any) -> str:
    """A flag's value as the TOML literal of its ``--set`` override; a cut time that reads as
    a number stays one."""
    if key.endswith("cutoff_time"):
        for number in (int, float):
            try:
                return repr(number(value))
            except ValueError:
                pass
    return json.dumps(value)


@data_app.command(
    "sequences",
    short_help="Build examples with user histories from an interaction log (Ray Data).",
)
def data_sequences(
    config: ConfigOption = None,
    set_: SetOption = None,
    log_path: _LogOption = None,
    out: Annotated[
        str | None,
        typer.Option(help="Output directory. Default: the parent of data.train_path."),
    ] = None,
    user_column: _UserColumn = None,
    item_column: _ItemColumn = None,
    time_column: _TimeColumn = None,
    extra_columns: _ExtraColumns = None,
    max_length: _MaxLength = None,
    min_history: _MinHistory = None,
    examples: _Examples = None,
    split: _Split = None,
    cutoff_time: _Cut = None,
    valid_cutoff_time: _ValidCut = None,
    eval_fraction: _Fraction = None,
    label_column: _LabelColumn = None,
    label_min: _LabelMin = None,
    item_ids: _ItemIds = None,
    num_partitions: _Partitions = None,
    row_group_rows: _RowGroupRows = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an earlier build in --out.")] = False,
    verbose: VerboseOption = False,
) -> None:
    """Turn an interaction log of (user, item, time[, extras]) rows into training examples,
    one row per target event with the user's earlier events as its history, split
    leave-last-out per user or by time, as a Ray Data job: train/, valid/ and test/ Parquet,
    items.parquet (item row -> id) and metadata.json in --out. Each option overrides its key
    of data.sequence_build (e.g. --max-length 50 is data.sequence_build.max_length = 50)."""
    setup_logging(verbose)
    # The options named like a field of data.sequence_build, those given, become overrides.
    given = {k: v for k, v in locals().items() if k in _BUILD_FLAGS and v is not None}
    flags = [f"data.sequence_build.{k}={_toml(k, v)}" for k, v in given.items()]
    try:
        job = load_config(config, overrides=[*(set_ or []), *flags])
    except ConfigError as e:
        fail(str(e))
    from raydlrm.ingestion.badinput import BadInputError
    from raydlrm.platform.sequences import build_sequences

    options = job.data.sequence_build or SequenceBuildConfig()
    target = out or str(Path(job.data.train_path).parent)
    try:
        info = build_sequences(
            out=target, config=options, storage=job.data.storage, overwrite=overwrite, job=job
        )
    except (*bad_input_errors(), BadInputError, FileExistsError, ValueError) as e:
        fail(str(e))
    except Exception as e:
        run_failed(e, "the sequence build")
    _echo_build(info)


def _echo_build(info: Any) -> None:
    """The counts of a sequence build (a :class:`~raydlrm.ingestion.SequenceInfo`)."""
    rows = ", ".join(f"{info.rows[s]} {s}" for s in info.rows)
    typer.echo(
        f"wrote {rows} examples of {info.num_users} users ({info.num_items} items, "
        f"{info.num_events} events) to {info.out} in {info.seconds:.1f}s"
    )
    if info.cutoffs is not None:
        valid = info.cutoffs["valid"]
        typer.echo(
            f"  time cuts: test from {info.cutoffs['test']}"
            + ("" if valid is None else f", valid from {valid}")
        )
    short = sum(info.short.values())
    if short:
        typer.echo(f"  left out {short} events with a history under min_history ({info.short})")


_BUILD_FLAGS = frozenset(f.name for f in dataclasses.fields(SequenceBuildConfig))


@config_app.command("show")
def config_show(config: ConfigOption = None, set_: SetOption = None) -> None:
    """Print the fully resolved config (after overrides) as JSON."""
    try:
        job = load_config(config, overrides=set_ or [])
    except ConfigError as e:
        fail(str(e))
    typer.echo(json.dumps(redact(job.to_dict()), indent=2))


@config_app.command("validate")
def config_validate(config: ConfigOption = None, set_: SetOption = None) -> None:
    """Check a config; exit 2 with the offending key if it is invalid."""
    try:
        load_config(config, overrides=set_ or [])
    except ConfigError as e:
        fail(str(e))
    typer.echo("config is valid")
