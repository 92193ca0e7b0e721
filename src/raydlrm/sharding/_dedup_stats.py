"""What deduplication (RecD) saved on a rank of a sharded collection: per deduplicated table,
samples per unique row, the ids not looked up and the bytes the output all-to-all (and its
gradient) did not send
(:meth:`~raydlrm.sharding.embedding.ShardedEmbeddingBagCollection.dedup_stats`).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from raydlrm.batch import KeyedJaggedTensor
from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding._layout import LookupUnit
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.sizes import wire_bytes_per_vector

__all__ = ["DedupCounters"]


class DedupCounters:
    """What deduplication saved on one rank (see
    :meth:`ShardedEmbeddingBagCollection.dedup_stats`).

    Args:
        tables: every table of the collection.
        class_of: each feature's batch class.
        units: this rank's units.
        config: the codecs of the output all-to-all.
        rank: this rank.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        class_of: dict[str, int],
        units: list[LookupUnit],
        config: ShardingConfig,
        rank: int,
    ) -> None:
        self._rank = rank
        self._table_of = {f: t.name for t in tables for f in t.feature_names}
        self._class_of_table = {
            t.name: class_of[t.feature_names[0]] for t in tables if class_of[t.feature_names[0]]
        }
        self._row_bytes: dict[str, int] = defaultdict(int)  # table -> its units' bytes per row
        for u in units:
            if u.batch_class and not u.replicated:
                precision = config.comm_precision_per_table.get(u.table.name, config.comm_precision)
                self._row_bytes[u.table.name] += wire_bytes_per_vector(u.dim, precision=precision)
        self._rows: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # class -> [B, U]
        self._rows_not_sent: dict[int, int] = defaultdict(int)  # class -> rows
        self._ids_saved: dict[str, int] = defaultdict(int)

    def count(
        self,
        batch_class: int,
        kjt: KeyedJaggedTensor,
        inverse: torch.Tensor,
        batch_sizes: list[list[int]],
    ) -> None:
        """Counts one batch's dedup group: its unique rows ``kjt`` and ``inverse``, and the
        rows of every rank (``batch_sizes[0]`` samples, ``batch_sizes[batch_class]`` unique
        rows)."""
        rows = self._rows[batch_class]
        rows[0] += inverse.numel()
        rows[1] += kjt.batch_size
        lengths = kjt.lengths.view(len(kjt.keys), kjt.batch_size)
        repeats = torch.bincount(inverse, minlength=kjt.batch_size) - 1
        for key, n in zip(kjt.keys, (lengths * repeats).sum(dim=1).tolist(), strict=True):
            self._ids_saved[self._table_of[key]] += int(n)
        self._rows_not_sent[batch_class] += sum(
            b - u
            for r, (b, u) in enumerate(zip(batch_sizes[0], batch_sizes[batch_class], strict=True))
            if r != self._rank
        )

    def stats(self) -> dict[str, dict[str, float]]:
        stats = {}
        for table, c in self._class_of_table.items():
            samples, unique = self._rows.get(c, (0, 0))
            if not samples:  # no batch has carried the group yet
                continue
            stats[table] = {
                "ratio": samples / max(unique, 1),
                "lookups_saved": float(self._ids_saved[table]),
                # the pooled rows and, the same size, their gradient
                "a2a_bytes_saved": 2.0 * self._rows_not_sent[c] * self._row_bytes[table],
            }
        return stats
