"""The interface every sharded embedding collection implements, and its per-batch context.

The shape is TorchRec's ``ShardedModule``: a forward pass is ``input_dist`` (route the batch's
ids to the shards that own their rows: the input all-to-all), then ``compute_and_output_dist``
(look the routed ids up and send every rank the pooled rows of its samples: the output
all-to-all). A pipeline runs ``input_dist`` of the next batch ahead, during the current step
(:meth:`ShardedTables.prefetch`); the routed batch waits in a :class:`PrefetchQueue` as a
:class:`Routed` context that knows its own tensors, so it can record them on the stream that
reads them.

:class:`~raydlrm.sharding.embedding.ShardedEmbeddingBagCollection` derives from
:class:`ShardedTables`, which runs the forward pass and the prefetching; checkpoints
(:mod:`raydlrm.sharding.embedding_checkpoint`), the telemetry
(:mod:`raydlrm.sharding.telemetry`) and the training loop use nothing else of it.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup

from raydlrm.batch import DedupGroup, KeyedJaggedTensor, KeyedTensor
from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.models.managed_ids import IdMap
from raydlrm.sharding.plan import Shard, ShardingPlan
from raydlrm.sharding.quantized import QuantizedRows

__all__ = ["EmbeddingCut", "PrefetchQueue", "Routed", "ShardedTables"]


class Routed(Protocol):
    """A batch's ids routed to their shards, ready for ``compute_and_output_dist``.

    Attributes:
        features: the batch's features the routing was made for (the same object).
    """

    features: KeyedJaggedTensor

    def tensors(self) -> Iterator[torch.Tensor | None]:
        """Every tensor the routing holds (to record on the stream that reads them)."""
        ...


class PrefetchQueue:
    """Routed batches waiting for their forward pass, oldest first.

    A training forward pass takes the oldest routing, which must have been made for the very
    features it is given: a pipeline routes each batch once, in step order, so the oldest is
    always the one due, and any other is a bug (a routing left behind, or a batch routed twice).
    """

    def __init__(self) -> None:
        self._queue: deque[Routed] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, routed: Routed) -> None:
        self._queue.append(routed)

    def take(self, features: KeyedJaggedTensor) -> Routed | None:
        """The routing made for ``features`` (removed from the queue), or None when the queue
        is empty. On a GPU its tensors, made on the pipeline's stream, are recorded on the
        current one, which reads them: their memory is not reused before this step is done
        with them.

        Raises:
            RuntimeError: the oldest routing was made for other features.
        """
        if not self._queue:
            return None
        if self._queue[0].features is not features:
            raise RuntimeError(
                f"the oldest of {len(self._queue)} batch(es) routed ahead was routed for other "
                f"features ({list(self._queue[0].features.keys)[:4]}...) than this training "
                "step's: every batch routed ahead must be trained next, in order"
            )
        routed = self._queue.popleft()
        if features.values.device.type == "cuda":
            stream = torch.cuda.current_stream(features.values.device)
            for t in routed.tensors():
                if t is not None:
                    t.record_stream(stream)
        return routed

    def clear(self) -> None:
        self._queue.clear()


class EmbeddingCut:
    """Splits a training step's backward pass at the embedding lookups' output, so that a
    decision taken between its two halves (fp16's overflow check, :mod:`raydlrm.trainers.precision`)
    can hold back the fused embedding update, which the lookups' backward applies.

    A collection given a cut (:meth:`ShardedTables.cut_embeddings`) hands the rest of the model
    a detached copy of each training forward's pooled rows (a leaf that requires grad) and keeps
    the pair. ``loss.backward()`` then stops at those copies: it runs everything above the
    lookups (the dense side, tower modules and their collectives) and leaves the gradient
    of the pooled rows in :meth:`gradients`. :meth:`backward` runs the lookups' backward (the
    output all-to-all's and the kernels' fused update) with them; :meth:`discard` drops the
    step's lookups unapplied. Every rank must do the same, since the lookups' backward is a
    collective.
    """

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """The copy of ``pooled`` (``B x sum(D_f)``) the model goes on with."""
        copy = pooled.detach().requires_grad_()
        self._pairs.append((pooled, copy))
        return copy

    def gradients(self) -> list[torch.Tensor]:
        """The gradient of each copy handed out since the last :meth:`backward` (zeros for a
        copy the loss did not reach)."""
        return [torch.zeros_like(c) if c.grad is None else c.grad for _, c in self._pairs]

    def backward(self, gradients: Sequence[torch.Tensor]) -> None:
        """Runs the lookups' backward with ``gradients`` (one per copy, in order)."""
        pooled = [p for p, _ in self._pairs]
        self._pairs = []
        if pooled:
            torch.autograd.backward(pooled, list(gradients))

    def discard(self) -> None:
        """Forgets the step's lookups: their backward never runs, nothing is updated."""
        self._pairs = []


class ShardedTables(nn.Module, abc.ABC):
    """A sharded embedding-bag collection (see the module docstring): its forward pass is
    :meth:`input_dist` then :meth:`compute_and_output_dist`, starting from a routing made ahead
    (:meth:`prefetch`) when there is one.

    Input and output are those of the unsharded collection: a KJT of shape ``(F, B, L[f][b])``
    holding this rank's ``B`` samples (``B`` may differ across ranks) and the batch's dedup
    groups, and a :class:`KeyedTensor` of shape ``B x sum(D_f)`` in ``feature_names`` order.

    Attributes:
        kernel: the kernel this rank runs (``fbgemm`` or ``torch``; ``sharding.kernel``
            resolved).
        tables: every table of the collection, in collection order.
        feature_names: the features of its output, in order.
        plan: where each table lives.
        prefetched: batches routed ahead of their forward pass.
    """

    kernel: str
    tables: list[EmbeddingBagConfig]
    feature_names: list[str]
    plan: ShardingPlan

    def __init__(self) -> None:
        super().__init__()
        self.prefetched = PrefetchQueue()

    @abc.abstractmethod
    def input_dist(
        self,
        features: KeyedJaggedTensor,
        dedup_groups: Sequence[DedupGroup] = (),
        *,
        pg: ProcessGroup | None = None,
    ) -> Routed:
        """Routes a batch's ids to the shards that own them (the input all-to-all, on ``pg``:
        default the collection's). Every rank must route the same batches in the same order.

        Raises:
            ValueError: naming the table of an id outside ``[0, num_embeddings)``.
        """

    @abc.abstractmethod
    def compute_and_output_dist(self, routed: Routed) -> KeyedTensor:
        """Looks up and pools the routed ids and returns this rank's samples' pooled rows
        (``B x sum(D_f)`` in ``feature_names`` order; the output all-to-all)."""

    def forward(
        self, features: KeyedJaggedTensor, dedup_groups: Sequence[DedupGroup] = ()
    ) -> KeyedTensor:
        """Pooled embeddings of this rank's samples.

        Args:
            features: KJT of shape ``(F, B, L[f][b])`` holding at least every feature of the
                collection not in ``dedup_groups``; ``weights`` (if present) weight each id.
            dedup_groups: the batch's deduplicated features (unique rows and inverse index).

        Returns:
            KeyedTensor of shape ``B x sum(D_f)``, features in ``feature_names`` order.

        Raises:
            ValueError: naming the table of an id outside ``[0, num_embeddings)``.
        """
        # An evaluation's batches (eval mode) are never routed ahead: a training batch routed
        # ahead meanwhile stays queued for its step.
        routed = self.prefetched.take(features) if self.training else None
        if routed is None:
            routed = self.input_dist(features, dedup_groups)
        return self.compute_and_output_dist(routed)

    embedding_cut: EmbeddingCut | None = None
    """Where training forwards hand out their pooled rows (:meth:`cut_embeddings`)."""

    def cut_embeddings(self, cut: EmbeddingCut | None) -> None:
        """Hands the pooled rows of every training forward from now on through ``cut`` (None:
        no cut), the output of the lookups, wherever that is inside the collection."""
        self.embedding_cut = cut

    def prefetch(
        self,
        features: KeyedJaggedTensor,
        dedup_groups: Sequence[DedupGroup] = (),
        *,
        pg: ProcessGroup | None = None,
    ) -> None:
        """Routes a coming batch now, on ``pg`` (a pipeline's background thread passes a
        process group of its own, so that its exchanges overlap the current step's), and
        queues it: the forward pass on the same ``features`` object starts from it. Every rank
        must prefetch the same batches in the same order.

        Raises:
            ValueError: naming the table of an id outside ``[0, num_embeddings)``.
        """
        self.prefetched.put(self.input_dist(features, dedup_groups, pg=pg))

    def discard_prefetched(self) -> None:
        """Drops batches routed ahead that will not be trained (a pipeline stopped early)."""
        self.prefetched.clear()

    def dedup_stats(self) -> dict[str, dict[str, float]]:
        """Per deduplicated table: ``ratio``, ``lookups_saved``, ``a2a_bytes_saved`` (empty
        without dedup groups)."""
        return {}

    def id_maps(self) -> dict[str, IdMap]:
        """Table name -> the id map of this rank's shard, each managed table it holds (none
        without managed tables, :mod:`raydlrm.models.managed_ids`)."""
        return {}

    managed_day: int = 0
    """The data's day (days since 1970-01-01, ``data.data_date``; 0: none) of the managed
    tables' clock (:func:`raydlrm.ids.clock`)."""

    managed_clock: tuple[int, int] = (0, 0)
    """The managed tables' clock: (training lookups so far, the seed of the fresh values of
    rows given to new ids); saved and restored with the maps, so a resumed run goes on as the
    saving one would have, whatever its own seed."""

    @abc.abstractmethod
    def comm_bytes(self) -> dict[str, dict[str, int]]:
        """Cumulative bytes this rank sent through the all-to-alls, by direction and codec."""

    @abc.abstractmethod
    def local_tables(self) -> dict[str, torch.Tensor | QuantizedRows]:
        """Table name -> this rank's shard of it (views, or the quantized rows of an ``int8`` /
        ``int4`` table; caches flushed first)."""

    @abc.abstractmethod
    def local_shards(self) -> dict[str, Shard]:
        """Table name -> the :class:`Shard` this rank holds."""

    @abc.abstractmethod
    def weight_precisions(self) -> dict[str, str]:
        """Table name -> its ``sharding.weights_precision`` (``fp32``, ``fp16``, ``int8``,
        ``int4``), every table."""

    @abc.abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of memory this rank's tables hold (weights, optimizer state, caches; not
        mapped files)."""

    def host_bytes(self) -> int:
        """Bytes of the host's memory this rank's ``host`` tables hold (rows and state)."""
        return 0

    def cache_hit_rates(self) -> dict[str, tuple[int, int]]:
        """Per ``int8`` / ``int4`` or ``host`` table of this rank: (distinct ids found in its
        fp32 or GPU cache, distinct ids looked up) so far."""
        return {}

    @abc.abstractmethod
    def optimizer_states(self) -> dict[str, list[torch.Tensor]]:
        """Table name -> the fused optimizer state of this rank's shard (views)."""

    @abc.abstractmethod
    def track_modified_rows(self) -> None:
        """Starts flagging the rows that training steps look up (differential checkpoints)."""

    @abc.abstractmethod
    def modified_rows(self) -> dict[str, torch.Tensor]:
        """Table name -> the shard-local rows (sorted, CPU int64) training steps looked up since
        the last :meth:`clear_modified_rows`, every table of the rank; every rank must call."""

    @abc.abstractmethod
    def clear_modified_rows(self) -> None:
        """Forgets the rows flagged so far."""

    @abc.abstractmethod
    def ssd_tables(self) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
        """This rank's ``ssd`` shards as they are: rows in the file, DRAM cache hits."""
