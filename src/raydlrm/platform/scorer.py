"""The scoring actors: a pool of Ray Data actors (:class:`Scorer`) each holding the unsharded
model, and one actor (:class:`UnknownIds`) summing their counts of ids unknown to managed tables.

On a single-node cluster the actors map the driver's ``model.safetensors`` (every actor shares
the page cache; a model larger than RAM scores, its hot rows in memory); on several nodes the
model's files travel to the actors through Ray's object store (:func:`model_for_actors`), so the
actors need neither MLflow nor the driver's disk (the model must then fit the object store).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pyarrow as pa

from raydlrm.ingestion.badinput import BadInputError, first_unscorable_row
from raydlrm.platform.model_files import ModelFiles
from raydlrm.platform.score_source import PATH_COLUMN
from raydlrm.storage import scratch_directory
from raydlrm.trainers.model_dir import METADATA_FILES, WEIGHTS_FILE

__all__ = [
    "PREDICTION_COLUMN",
    "Scorer",
    "UnknownIds",
    "model_for_actors",
]

PREDICTION_COLUMN = "prediction"


def model_for_actors(files: ModelFiles) -> dict[str, Any]:
    """How the scoring actors get the model: its directory, and on a cluster of several nodes
    (where an actor may not see the driver's disk) its files through the object store."""
    import ray

    weights = files.directory / WEIGHTS_FILE
    shipped = None
    if sum(1 for node in ray.nodes() if node.get("Alive")) > 1:
        blobs = {
            p.name: p.read_bytes()
            for p in files.directory.iterdir()
            if p.name in (WEIGHTS_FILE, *METADATA_FILES)
        }
        shipped = [ray.put(blobs)]  # in a list: Ray Data passes the reference, not its value
    return {
        "directory": str(files.directory),
        "weights_bytes": weights.stat().st_size,
        "files_ref": shipped,
    }


class UnknownIds:
    """A Ray actor summing the scoring actors' counts of ids unknown to managed tables."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, counts: dict[str, int]) -> None:
        for table, n in counts.items():
            self.counts[table] = self.counts.get(table, 0) + n

    def total(self) -> dict[str, int]:
        return dict(self.counts)


class Scorer:
    """A Ray Data actor: the unsharded model, scoring raw Arrow batches; the lookups of ids
    its managed tables do not know are added to ``unknown`` (an :class:`UnknownIds` actor)
    after each batch."""

    def __init__(self, model: dict[str, Any], keep: list[str], unknown: Any = None) -> None:
        import torch

        from raydlrm.ingestion import Preprocessor
        from raydlrm.trainers.model_dir import load_model_checkpoint

        torch.set_num_threads(1)
        weights = Path(model["directory"], WEIGHTS_FILE)
        if weights.is_file() and weights.stat().st_size == model["weights_bytes"]:
            # The driver's file, mapped: actors on this node share its pages.
            loaded = load_model_checkpoint(model["directory"])
        else:
            import ray

            if model["files_ref"] is None:
                raise FileNotFoundError(f"scoring actor: no model at {weights}")
            files: dict[str, bytes] = ray.get(model["files_ref"][0])
            with scratch_directory("scorer") as tmp:
                for name, blob in files.items():
                    Path(tmp, name).write_bytes(blob)
                loaded = load_model_checkpoint(tmp)  # mapped; the mapping outlives the file
        self.model = loaded.model
        # Every row is scored or the job stops: nothing is set aside.
        self.data = dataclasses.replace(loaded.spec.data, bad_input="fail")
        self.k = max(loaded.spec.model.retrieval_k)  # a retrieval model's items per row
        self.preprocess = Preprocessor(self.data)
        self.keep = keep
        self.unknown, self._counted = unknown, None

    def __call__(self, table: pa.Table) -> pa.Table:
        from raydlrm.platform.export import retrieve_table, score_table

        retrieval = getattr(self.model, "retrieval", None) is not None
        try:
            if retrieval:
                found = retrieve_table(self.model, self.preprocess, self.data, table, k=self.k)
            else:
                probs = score_table(self.model, self.preprocess, self.data, table)
        except BadInputError:
            # A batch may span files: the one of the first bad row (the driver finds its row).
            found = first_unscorable_row(table, self.data)
            assert found is not None, "the preprocessor refuses what find_bad_rows finds"
            row, reason = found
            raise BadInputError(f"{table.column(PATH_COLUMN)[row].as_py()}: {reason}") from None
        self._count_unknown()
        out = table.select([c for c in self.keep if c in table.column_names])
        if retrieval:
            for name in found.column_names:
                out = out.append_column(name, found.column(name))
            return out
        return out.append_column(PREDICTION_COLUMN, pa.array(probs, pa.float32()))

    def _count_unknown(self) -> None:
        """Adds the unknown-id lookups of the batch just scored to the job's count (waiting
        for it: the driver reads the count once the output is written)."""
        if self.unknown is None:
            return
        import ray

        now = self.model.embedding_bags.id_maps.unknown()
        before = self._counted or dict.fromkeys(now, 0)
        self._counted = now
        ray.get(self.unknown.add.remote({t: n - before[t] for t, n in now.items()}))
