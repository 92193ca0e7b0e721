"""Column runs of the output distribution (the multi-rank behaviour is covered by the parity
tests of every sharding type)."""

from raydlrm.sharding._output_dist import ColumnRun, column_runs


def test_runs_merge_contiguous_columns_and_split_at_gaps() -> None:
    # Block 0 holds output columns 4..7 then 0..1; block 1 holds 2..3.
    runs = column_runs([[4, 5, 6, 7, 0, 1], [2, 3]])
    assert runs == [
        ColumnRun(block=0, src=0, dst=4, width=4, accumulate=False),
        ColumnRun(block=0, src=4, dst=0, width=2, accumulate=False),
        ColumnRun(block=1, src=0, dst=2, width=2, accumulate=False),
    ]


def test_row_split_partial_sums_accumulate_after_the_first_writer() -> None:
    # Two row shards of one 3-wide table (blocks 0 and 1), one more table in block 1.
    runs = column_runs([[0, 1, 2], [0, 1, 2, 3]])
    assert runs == [
        ColumnRun(block=0, src=0, dst=0, width=3, accumulate=False),
        ColumnRun(block=1, src=0, dst=0, width=3, accumulate=True),
        ColumnRun(block=1, src=3, dst=3, width=1, accumulate=False),
    ]
    # Every output column is written by exactly one non-accumulating run.
    first = sorted(c for r in runs if not r.accumulate for c in range(r.dst, r.dst + r.width))
    assert first == [0, 1, 2, 3]


def test_empty_blocks_give_no_runs() -> None:
    assert column_runs([[], [0, 1], []]) == [ColumnRun(1, 0, 0, 2, False)]
