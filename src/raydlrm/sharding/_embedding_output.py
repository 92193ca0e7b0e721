"""The output distribution of a sharded collection, laid out: where every column of the pooled
blocks a rank receives goes in its output (:class:`~raydlrm.sharding._output_dist.OutputDist`),
per batch class, and the codec of every rank's sharded units' columns
(``sharding.comm_precision``, ``comm_precision_per_table``). Column shards land side by side,
row shards' partial sums add up; a data-parallel unit's rows stay on the rank.
"""

from __future__ import annotations

import warnings
from itertools import accumulate

from torch.distributed import ProcessGroup

from raydlrm.sharding._comm import CommBytes
from raydlrm.sharding._layout import LookupUnit
from raydlrm.sharding._output_dist import ClassLayout, ColumnRun, OutputDist, column_runs
from raydlrm.sharding.codecs import ColumnBlockCodec
from raydlrm.sharding.config import ShardingConfig

__all__ = ["output_dist"]


def output_dist(
    units: list[list[LookupUnit]],
    config: ShardingConfig,
    *,
    feature_names: list[str],
    feature_dims: list[int],
    lookup_features: list[str],
    class_features: list[list[str]],
    rank: int,
    kernel: str,
    pg: ProcessGroup | None,
    comm_bytes: CommBytes,
) -> OutputDist:
    """The output distribution of a collection on ``rank``: per batch class (its features
    ``class_features[c]``), the output column (or the column among the class's own) of every
    column of the blocks received (sharded units of every rank, in rank order), then of this
    rank's replicated units; the codecs of every rank's sharded units, with ``kernel``'s
    operators. The output columns are those of the pooled ``feature_names``; a class of a
    per-position table (features not among them) keeps its own columns, a row per id.
    ``feature_dims`` are the dims of ``lookup_features``, every feature looked up.

    Raises:
        ValueError: if ``config.comm_precision_per_table`` names a table with no units.
    """
    dims = dict(zip(lookup_features, feature_dims, strict=True))
    output = _column_starts(feature_names, dims)
    layouts = [
        _class_layout(units, c, features, dims=dims, output=output, rank=rank)
        for c, features in enumerate(class_features)
    ]
    return OutputDist(
        classes=layouts,
        num_columns=sum(dims[f] for f in feature_names),
        codecs=_output_codecs(units, config, kernel=kernel, num_classes=len(layouts)),
        pg=pg,
        comm_bytes=comm_bytes,
    )


def _class_layout(
    units: list[list[LookupUnit]],
    c: int,
    features: list[str],
    *,
    dims: dict[str, int],
    output: dict[str, int],
    rank: int,
) -> ClassLayout:
    """Where the received columns of batch class ``c`` (its ``features``) go: on the pooled
    output's columns (``output``: each pooled feature's first column) and on the class's own."""

    def runs(start: dict[str, int]) -> list[ColumnRun]:
        def targets(us: list[LookupUnit]) -> list[int]:
            return [
                start[u.feature] + col
                for u in us
                if u.batch_class == c
                for col in range(u.shard.col_start, u.shard.col_end)
            ]

        return column_runs(
            [targets([u for u in us if not u.replicated]) for us in units]
            + [targets([u for u in units[rank] if u.replicated])]
        )

    per_position = not all(f in output for f in features)
    placement = [] if per_position else [output[f] + i for f in features for i in range(dims[f])]
    return ClassLayout(
        width=sum(dims[f] for f in features),
        runs=[] if per_position else runs(output),
        compact_runs=runs(_column_starts(features, dims)),
        placement=column_runs([placement]) if placement else [],
        per_position=per_position,
    )


def _output_codecs(
    units: list[list[LookupUnit]], config: ShardingConfig, *, kernel: str, num_classes: int
) -> list[list[ColumnBlockCodec]]:
    """The codec of the columns of every rank's sharded units of each batch class (per-table
    precision), with ``kernel``'s operators.

    Raises:
        ValueError: if ``config.comm_precision_per_table`` names a table with no units.
    """
    per_table = config.comm_precision_per_table
    names = {u.table.name for us in units for u in us}
    unknown = sorted(set(per_table) - names)
    if unknown:
        raise ValueError(f"sharding.comm_precision_per_table names unknown tables {unknown}")
    replicated = sorted({u.table.name for us in units for u in us if u.replicated} & set(per_table))
    if replicated:
        warnings.warn(
            f"sharding.comm_precision_per_table: data_parallel tables {replicated} have no "
            "output all-to-all; their gradient all-gather stays fp32",
            stacklevel=3,
        )
    return [
        [
            ColumnBlockCodec.from_columns(
                [
                    (per_table.get(u.table.name, config.comm_precision), u.dim)
                    for u in us
                    if not u.replicated and u.batch_class == c
                ],
                kernel=kernel,
            )
            for c in range(num_classes)
        ]
        for us in units
    ]


def _column_starts(features: list[str], dims: dict[str, int]) -> dict[str, int]:
    """The first column of each of ``features`` when their columns are side by side."""
    return dict(zip(features, accumulate((dims[f] for f in features), initial=0), strict=False))
