"""The batch types every layer shares.

Sparse features travel in the layout fbgemm's table-batched embedding (TBE) kernels read:
feature-major jagged arrays. For ``F`` features and a batch of ``B`` samples, sample ``b`` of
feature ``f`` has ``L[f][b]`` ids; ``lengths`` has shape ``(F * B,)`` in the order
``(f0,b0), (f0,b1), ..., (f1,b0), ...`` and ``values`` holds the ids of all bags back to back in
the same order (shape ``(sum L,)``). ``offsets`` (shape ``(F * B + 1,)``) is the exclusive
cumulative sum of ``lengths``; it is what TBE takes.

Deduplicated features (RecD) travel as a :class:`DedupGroup`: the unique rows of a group of
features (a :class:`KeyedJaggedTensor` whose batch size is the number of unique rows ``U``) and an
inverse index of shape ``(B,)`` mapping each sample to its unique row.

Sequence features (a user's history, read position by position) come out of an embedding
lookup unpooled: a :class:`JaggedTensor` per feature, one row per position (``values``, shape
``(sum L, D)``) and the number of positions of each sample (``lengths``, shape ``(B,)``), never
padded to the longest. A :class:`KeyedTensor` carries them beside the pooled features
(:attr:`KeyedTensor.jagged`). Their ids travel in :attr:`Batch.sparse` like any feature's
(oldest event first); the numeric values that go with each event (a timestamp, a rating) travel
beside them in :attr:`Batch.sequence_values`, one value per id of the feature they follow.

Validation of shapes and dtypes runs on construction when debug mode is on (environment
variable ``RAYDLRM_DEBUG=1``, or :func:`set_debug`); it is off by default because it syncs and
costs time on the hot path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

__all__ = [
    "Batch",
    "DedupGroup",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "bag_positions",
    "is_debug",
    "lengths_to_offsets",
    "set_debug",
]

_DEBUG = os.environ.get("RAYDLRM_DEBUG", "0") not in ("", "0", "false", "False")


def set_debug(enabled: bool) -> None:
    """Turns construction-time validation of batch types on or off."""
    global _DEBUG
    _DEBUG = enabled


def is_debug() -> bool:
    """Whether construction-time validation of batch types is on."""
    return _DEBUG


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``(n,)`` lengths -> ``(n + 1,)`` int64 offsets (exclusive cumulative sum)."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


def bag_positions(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The positions, in a jagged ``values``, of the bags that start at ``starts`` with
    ``lengths`` ids, bag after bag: every bag's start plus its ids' ranks inside it
    (vectorized: no Python loop over bags). Gathers (and so repeats) bags."""
    offsets = lengths_to_offsets(lengths)
    total = int(offsets[-1])
    within = torch.arange(total, device=lengths.device) - torch.repeat_interleave(
        offsets[:-1], lengths, output_size=total
    )
    return torch.repeat_interleave(starts, lengths, output_size=total) + within


@dataclass
class KeyedJaggedTensor:
    """Jagged sparse features of shape ``(F, B, L[f][b])``, feature-major.

    Attributes:
        keys: the ``F`` feature names, in the order of the data.
        values: ids, int64, shape ``(sum L,)``.
        lengths: number of ids per (feature, sample), int64, shape ``(F * B,)``.
        batch_size: ``B``.
        weights: optional per-id weights, float32, shape ``(sum L,)`` (weighted bags).
    """

    keys: list[str]
    values: torch.Tensor
    lengths: torch.Tensor
    batch_size: int
    weights: torch.Tensor | None = None
    _offsets: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if _DEBUG:
            self.validate()

    def validate(self) -> None:
        """Checks shapes, dtypes and consistency.

        Raises:
            ValueError: naming the offending field.
        """
        num_keys = len(self.keys)
        if len(set(self.keys)) != num_keys:
            raise ValueError(f"KeyedJaggedTensor keys must be unique, got {self.keys}")
        if self.values.dim() != 1 or self.lengths.dim() != 1:
            raise ValueError("KeyedJaggedTensor values and lengths must be 1-D")
        if self.values.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"KeyedJaggedTensor values must be integer ids, got {self.values.dtype}"
            )
        if self.lengths.numel() != num_keys * self.batch_size:
            raise ValueError(
                f"KeyedJaggedTensor lengths has {self.lengths.numel()} entries, expected "
                f"F * B = {num_keys} * {self.batch_size}"
            )
        if self.lengths.numel() and int(self.lengths.min()) < 0:
            raise ValueError("KeyedJaggedTensor lengths must be non-negative")
        total = int(self.lengths.sum()) if self.lengths.numel() else 0
        if total != self.values.numel():
            raise ValueError(
                f"KeyedJaggedTensor lengths sum to {total} but values has {self.values.numel()}"
            )
        if self.weights is not None and self.weights.shape != self.values.shape:
            raise ValueError(
                f"KeyedJaggedTensor weights shape {tuple(self.weights.shape)} != values shape "
                f"{tuple(self.values.shape)}"
            )

    @classmethod
    def from_lengths(
        cls,
        keys: list[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> KeyedJaggedTensor:
        """Builds a KJT, inferring the batch size from ``lengths`` (shape ``(F * B,)``)."""
        if not keys:
            raise ValueError("KeyedJaggedTensor needs at least one key")
        if lengths.numel() % len(keys):
            raise ValueError(
                f"lengths has {lengths.numel()} entries, not a multiple of {len(keys)} keys"
            )
        return cls(
            keys=list(keys),
            values=values,
            lengths=lengths.to(torch.int64),
            batch_size=lengths.numel() // len(keys),
            weights=weights,
        )

    @classmethod
    def concat(cls, kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Concatenates KJTs with the same batch size along the feature dimension."""
        batch_sizes = {k.batch_size for k in kjts}
        if len(batch_sizes) != 1:
            raise ValueError(f"cannot concatenate KJTs with batch sizes {sorted(batch_sizes)}")
        has_weights = {k.weights is not None for k in kjts}
        if len(has_weights) != 1:
            raise ValueError("cannot concatenate weighted and unweighted KJTs")
        return cls(
            keys=[key for k in kjts for key in k.keys],
            values=torch.cat([k.values for k in kjts]),
            lengths=torch.cat([k.lengths for k in kjts]),
            batch_size=kjts[0].batch_size,
            weights=torch.cat([k.weights for k in kjts]) if kjts[0].weights is not None else None,
        )

    @property
    def offsets(self) -> torch.Tensor:
        """Exclusive cumulative sum of ``lengths``, shape ``(F * B + 1,)``, int64."""
        if self._offsets is None:
            self._offsets = lengths_to_offsets(self.lengths)
        return self._offsets

    def length_per_key(self) -> torch.Tensor:
        """Number of ids per feature, shape ``(F,)``."""
        return self.lengths.view(len(self.keys), self.batch_size).sum(dim=1)

    def offset_per_key(self) -> torch.Tensor:
        """Start of each feature's values, shape ``(F + 1,)``."""
        return lengths_to_offsets(self.length_per_key())

    def select(self, keys: list[str]) -> KeyedJaggedTensor:
        """A KJT holding only ``keys``, in that order (copies values).

        Raises:
            KeyError: naming a key that is not in this KJT.
        """
        index = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in keys if k not in index]
        if missing:
            raise KeyError(f"features {missing} not in batch (has {self.keys})")
        if keys == self.keys:
            return self
        pos = torch.tensor([index[k] for k in keys], dtype=torch.int64)
        starts = self.offset_per_key()
        bounds = [(int(starts[p]), int(starts[p + 1])) for p in pos]
        b = self.batch_size
        lengths = self.lengths.view(len(self.keys), b)[pos].reshape(-1)
        values = torch.cat([self.values[s:e] for s, e in bounds])
        weights = (
            torch.cat([self.weights[s:e] for s, e in bounds]) if self.weights is not None else None
        )
        return KeyedJaggedTensor(
            keys=list(keys), values=values, lengths=lengths, batch_size=b, weights=weights
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        """Moves all tensors to ``device``."""
        return KeyedJaggedTensor(
            keys=self.keys,
            values=self.values.to(device, non_blocking=non_blocking),
            lengths=self.lengths.to(device, non_blocking=non_blocking),
            batch_size=self.batch_size,
            weights=None
            if self.weights is None
            else self.weights.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> KeyedJaggedTensor:
        """A copy in page-locked host memory."""
        return KeyedJaggedTensor(
            keys=self.keys,
            values=self.values.pin_memory(),
            lengths=self.lengths.pin_memory(),
            batch_size=self.batch_size,
            weights=None if self.weights is None else self.weights.pin_memory(),
        )

    def index_rows(self, rows: torch.Tensor) -> KeyedJaggedTensor:
        """Gathers samples: the result has batch size ``rows.numel()`` and sample ``i`` is
        sample ``rows[i]`` of this KJT, for every feature. Used to expand deduplicated rows.

        Args:
            rows: int64 sample indices, shape ``(B',)``, each in ``[0, B)``.
        """
        num_keys, b = len(self.keys), self.batch_size
        bag = torch.arange(num_keys, device=rows.device).unsqueeze(1) * b + rows.unsqueeze(0)
        bag = bag.reshape(-1)
        lengths = self.lengths[bag]
        src = bag_positions(self.offsets[bag], lengths)
        return KeyedJaggedTensor(
            keys=self.keys,
            values=self.values[src],
            lengths=lengths,
            batch_size=rows.numel(),
            weights=None if self.weights is None else self.weights[src],
        )


@dataclass
class DedupGroup:
    """A group of features stored once per unique row (RecD).

    Attributes:
        unique: the unique rows, a KJT over the group's features with batch size ``U``.
        inverse: int64, shape ``(B,)``; sample ``b`` has the features of unique row
            ``inverse[b]``.
    """

    unique: KeyedJaggedTensor
    inverse: torch.Tensor

    def __post_init__(self) -> None:
        if _DEBUG:
            self.validate()

    @property
    def keys(self) -> list[str]:
        return self.unique.keys

    def validate(self) -> None:
        """Checks the inverse index against the unique rows.

        Raises:
            ValueError: naming the group's features.
        """
        self.unique.validate()
        if self.inverse.dim() != 1 or self.inverse.dtype != torch.int64:
            raise ValueError(f"dedup group {self.keys}: inverse must be a 1-D int64 tensor")
        if self.inverse.numel() and (
            int(self.inverse.min()) < 0 or int(self.inverse.max()) >= self.unique.batch_size
        ):
            raise ValueError(
                f"dedup group {self.keys}: inverse index out of range [0, {self.unique.batch_size})"
            )

    def expand(self) -> KeyedJaggedTensor:
        """The group's features for every sample (batch size ``B``)."""
        return self.unique.index_rows(self.inverse)


@dataclass
class JaggedTensor:
    """Per-position rows of ``B`` samples: sample ``b`` has ``lengths[b]`` positions, rows
    ``offsets[b]:offsets[b + 1]`` of ``values`` (oldest first, as in the data).

    Attributes:
        values: shape ``(sum L, D)`` (embeddings) or ``(sum L,)`` (one value per position).
        lengths: int64, shape ``(B,)``.
    """

    values: torch.Tensor
    lengths: torch.Tensor
    _offsets: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if _DEBUG:
            self.validate()

    def validate(self) -> None:
        """Checks that the lengths sum to the rows of ``values``.

        Raises:
            ValueError: naming the mismatch.
        """
        if self.lengths.dim() != 1:
            raise ValueError(f"JaggedTensor lengths must be 1-D, got {tuple(self.lengths.shape)}")
        total = int(self.lengths.sum()) if self.lengths.numel() else 0
        if total != self.values.shape[0]:
            raise ValueError(
                f"JaggedTensor lengths sum to {total} but values has {self.values.shape[0]} rows"
            )

    @property
    def batch_size(self) -> int:
        return self.lengths.numel()

    @property
    def offsets(self) -> torch.Tensor:
        """Exclusive cumulative sum of ``lengths``, shape ``(B + 1,)``, int64."""
        if self._offsets is None:
            self._offsets = lengths_to_offsets(self.lengths)
        return self._offsets

    def segment_ids(self) -> torch.Tensor:
        """The sample of every position, int64, shape ``(sum L,)``."""
        return torch.repeat_interleave(
            torch.arange(self.batch_size, device=self.lengths.device),
            self.lengths,
            output_size=self.values.shape[0],
        )

    def positions(self) -> torch.Tensor:
        """Every position's index inside its sample (0 = oldest), int64, shape ``(sum L,)``."""
        total = self.values.shape[0]
        starts = torch.repeat_interleave(self.offsets[:-1], self.lengths, output_size=total)
        return torch.arange(total, device=self.lengths.device) - starts

    def to_padded(self, max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows padded (with zeros, at the end) to ``(B, max_length, ...)`` and the mask of
        real positions ``(B, max_length)``; ``max_length`` defaults to the longest sample (a
        longer sample is an error, never cut silently)."""
        longest = int(self.lengths.max()) if self.batch_size else 0
        width = longest if max_length is None else max_length
        if longest > width:
            raise ValueError(f"a sample has {longest} positions, more than max_length {width}")
        padded = self.values.new_zeros(self.batch_size, width, *self.values.shape[1:])
        mask = torch.zeros(self.batch_size, width, dtype=torch.bool, device=self.values.device)
        rows, cols = self.segment_ids(), self.positions()
        padded[rows, cols] = self.values
        mask[rows, cols] = True
        return padded, mask

    def last(self) -> torch.Tensor:
        """Each sample's newest row, ``(B, ...)``; zeros for a sample without positions."""
        index = (self.offsets[1:] - 1).clamp(min=0)
        rows = self.values.index_select(0, index) if self.values.shape[0] else None
        if rows is None:
            return self.values.new_zeros(self.batch_size, *self.values.shape[1:])
        keep = (self.lengths > 0).view(-1, *([1] * (self.values.dim() - 1)))
        return rows * keep.to(rows.dtype)

    def index_rows(self, rows: torch.Tensor) -> JaggedTensor:
        """Gathers samples: sample ``i`` of the result is sample ``rows[i]`` (a deduplicated
        history expanded to the batch; differentiable, duplicates' gradients add up)."""
        lengths = self.lengths.index_select(0, rows)
        src = bag_positions(self.offsets.index_select(0, rows), lengths)
        return JaggedTensor(values=self.values.index_select(0, src), lengths=lengths)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        """Moves both tensors to ``device``."""
        return JaggedTensor(
            values=self.values.to(device, non_blocking=non_blocking),
            lengths=self.lengths.to(device, non_blocking=non_blocking),
        )


@dataclass
class KeyedTensor:
    """Pooled embeddings: one ``(B, D_f)`` block per feature, concatenated, and the unpooled
    (per-position) embeddings of the sequence features.

    Attributes:
        keys: pooled feature names, in column order.
        dims: embedding dimension ``D_f`` of each pooled feature.
        values: float tensor of shape ``(B, sum D_f)``.
        jagged: sequence feature name -> its per-position embeddings (``(sum L, D)`` rows,
            lengths ``(B,)``); empty when no table is looked up per position.
    """

    keys: list[str]
    dims: list[int]
    values: torch.Tensor
    jagged: dict[str, JaggedTensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if _DEBUG:
            if len(self.keys) != len(self.dims):
                raise ValueError("KeyedTensor keys and dims differ in length")
            if self.values.dim() != 2 or self.values.shape[1] != sum(self.dims):
                raise ValueError(
                    f"KeyedTensor values shape {tuple(self.values.shape)} does not match dims "
                    f"(sum {sum(self.dims)})"
                )

    def stacked(self) -> torch.Tensor:
        """The pooled embeddings as a tensor of shape ``(B, F, D)``; all dims must be equal."""
        if len(set(self.dims)) != 1:
            raise ValueError(f"cannot stack features of different dims {self.dims}")
        return self.values.view(self.values.shape[0], len(self.keys), self.dims[0])

    def to_dict(self) -> dict[str, torch.Tensor]:
        """Feature name -> pooled embedding of shape ``(B, D_f)``."""
        return dict(zip(self.keys, torch.split(self.values, self.dims, dim=1), strict=True))


@dataclass
class Batch:
    """One training batch of ``B`` samples.

    Attributes:
        dense: float32 dense features, shape ``(B, num_dense)``.
        sparse: the sparse features that are not deduplicated, a KJT of batch size ``B``.
        labels: float32 click labels, shape ``(B,)``.
        dedup_groups: deduplicated feature groups (RecD); their features are not in ``sparse``.
        sample_ids: optional int64 ids of the samples, shape ``(B,)`` (accounting, tests).
        row_groups: the data position a step on this batch advances: row group id -> (its
            rows in this batch, its total rows); None when not tracked. Counted when the batch
            is trained, not when it is read, so that a batch read ahead (pipelined) is not in a
            checkpoint taken before its step.
        sequence_values: the value columns of the sequence features (``data.sequences``):
            column -> float32, shape ``(sum L,)``, one value per id of the feature it follows
            (``sequence_of``), position by position in that feature's order in ``sparse``;
            :meth:`jagged_values` gives it with that feature's lengths.
        sequence_of: value column -> the sparse feature (its sequence's first id column, in
            ``sparse``) whose ids its values are aligned with.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    dedup_groups: list[DedupGroup] = field(default_factory=list)
    sample_ids: torch.Tensor | None = None
    row_groups: dict[int, tuple[int, int]] | None = None
    sequence_values: dict[str, torch.Tensor] = field(default_factory=dict)
    sequence_of: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if _DEBUG:
            self.validate()

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]

    def jagged_values(self, column: str) -> JaggedTensor:
        """The values of sequence value ``column`` with the lengths of the feature they follow
        (``values`` ``(sum L,)`` float32, ``lengths`` ``(B,)``).

        Raises:
            KeyError: ``column`` is not a value column of this batch.
        """
        feature = self.sequence_of[column]
        index = self.sparse.keys.index(feature)
        lengths = self.sparse.lengths.view(len(self.sparse.keys), self.sparse.batch_size)[index]
        return JaggedTensor(values=self.sequence_values[column], lengths=lengths)

    def validate(self) -> None:
        """Checks that every part has batch size ``B``.

        Raises:
            ValueError: naming the offending part.
        """
        b = self.labels.shape[0]
        if self.labels.dim() != 1:
            raise ValueError(f"Batch labels must be 1-D, got shape {tuple(self.labels.shape)}")
        if self.dense.dim() != 2 or self.dense.shape[0] != b:
            raise ValueError(f"Batch dense shape {tuple(self.dense.shape)} != (B={b}, num_dense)")
        if self.sparse.batch_size != b:
            raise ValueError(f"Batch sparse batch size {self.sparse.batch_size} != B={b}")
        self.sparse.validate()
        for group in self.dedup_groups:
            if group.inverse.numel() != b:
                raise ValueError(
                    f"dedup group {group.keys}: inverse has {group.inverse.numel()} rows, B={b}"
                )
            group.validate()
        if self.sample_ids is not None and self.sample_ids.shape != (b,):
            raise ValueError(f"Batch sample_ids shape {tuple(self.sample_ids.shape)} != ({b},)")
        self._validate_sequence_values()

    def _validate_sequence_values(self) -> None:
        if set(self.sequence_values) != set(self.sequence_of):
            raise ValueError(
                f"Batch sequence_values {sorted(self.sequence_values)} and sequence_of "
                f"{sorted(self.sequence_of)} name other value columns"
            )
        counts = dict(zip(self.sparse.keys, self.sparse.length_per_key().tolist(), strict=True))
        for column, values in self.sequence_values.items():
            feature = self.sequence_of[column]
            if feature not in counts:
                raise ValueError(
                    f"Batch sequence values {column!r} follow {feature!r}, not a feature of sparse"
                )
            if values.dim() != 1 or values.dtype != torch.float32:
                raise ValueError(f"Batch sequence values {column!r} must be 1-D float32")
            if values.numel() != counts[feature]:
                raise ValueError(
                    f"Batch sequence values {column!r} has {values.numel()} values, its feature "
                    f"{feature!r} {counts[feature]} ids"
                )

    @property
    def feature_names(self) -> list[str]:
        """All sparse feature names, plain then deduplicated."""
        return self.sparse.keys + [k for g in self.dedup_groups for k in g.keys]

    def all_sparse(self) -> KeyedJaggedTensor:
        """Every sparse feature for every sample (dedup groups expanded), batch size ``B``."""
        if not self.dedup_groups:
            return self.sparse
        return KeyedJaggedTensor.concat([self.sparse] + [g.expand() for g in self.dedup_groups])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Moves all tensors to ``device``."""
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            dedup_groups=[
                DedupGroup(
                    unique=g.unique.to(device, non_blocking=non_blocking),
                    inverse=g.inverse.to(device, non_blocking=non_blocking),
                )
                for g in self.dedup_groups
            ],
            sample_ids=None if self.sample_ids is None else self.sample_ids.to(device),
            row_groups=self.row_groups,
            sequence_values={
                c: v.to(device, non_blocking=non_blocking) for c, v in self.sequence_values.items()
            },
            sequence_of=self.sequence_of,
        )

    def pin_memory(self) -> Batch:
        """A copy in page-locked host memory (for an asynchronous copy to a GPU)."""
        return Batch(
            dense=self.dense.pin_memory(),
            sparse=self.sparse.pin_memory(),
            labels=self.labels.pin_memory(),
            dedup_groups=[
                DedupGroup(unique=g.unique.pin_memory(), inverse=g.inverse.pin_memory())
                for g in self.dedup_groups
            ],
            sample_ids=self.sample_ids,
            row_groups=self.row_groups,
            sequence_values={c: v.pin_memory() for c, v in self.sequence_values.items()},
            sequence_of=self.sequence_of,
        )
