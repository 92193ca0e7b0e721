"""A learned compute cost model of a rank's embedding tables (NeuroShard, Zha et al., MLSys 2023).

The analytic cost model (:mod:`raydlrm.sharding.planner.cost`) charges a rank the sum of its tables'
times. A fused kernel's time is not that sum: tables share one launch, one sort of the ids and
one backward pass, and how many distinct rows a batch touches (the access distribution) decides
how much of them the caches serve. NeuroShard learns the cost of a *set* of tables instead:

* each table is a vector of :data:`NUM_FEATURES` features (:class:`TableStats`): log10 of its
  rows, its dim, its mean pooling factor (ids per bag) and a :data:`HISTOGRAM_BINS`-bin
  histogram of how often each distinct index of a batch is looked up (bin ``b``: the fraction of
  distinct indices looked up ``2^b`` to ``2^(b+1) - 1`` times; the last bin holds the rest);
* :class:`SetCostNet`: a per-table MLP (features -> 128 -> 32) **summed over the tables of a
  shard** (so the prediction does not depend on their order), then a head (32 -> 64 -> 1)
  predicting the log of the fused forward + backward time of the shard's tables;
* trained (:func:`train_cost_model`) on measured samples (:func:`collect_samples`: random sets
  of 1-15 synthetic tables whose rows, dims, pooling factors and access skew span the ranges
  below, each timed with the job's kernel on this machine), Adam on the squared error of the log
  time, features z-normalised with the training set's mean and deviation.

Samples are Parquet (one row per measured set: the tables' features, flattened, the seconds,
kernel, batch size, device -- ``cpu``, or ``cuda`` for GPU workers -- and machine); a trained
model is a safetensors file of its weights plus a JSON file of everything else (normalisation,
kernel, device, machine, the features' ranges, held-out errors): nothing is unpickled.
:func:`train_cost_model` reports the held-out mean absolute percentage error of the learned
model beside that of the analytic model's form (a sum of the tables' bytes looked up over a
throughput, plus a constant, fitted to the same training samples), so the two are compared on
the same sets.

By concern: :mod:`~raydlrm.sharding.planner.learned_cost.features` (a table's features),
:mod:`~raydlrm.sharding.planner.learned_cost.samples` (measuring and storing samples),
:mod:`~raydlrm.sharding.planner.learned_cost.model` (the net and the trained model, saved and
loaded), :mod:`~raydlrm.sharding.planner.learned_cost.training` (training and held-out errors).
The names load lazily (``raydlrm._lazy``).
"""

from __future__ import annotations

from raydlrm._lazy import lazy_exports

# The public names by the submodule that defines them (imported on first use).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "features": (
        "HISTOGRAM_BINS",
        "NUM_FEATURES",
        "CostModelError",
        "TableStats",
        "access_histogram",
        "histogram_of_counts",
    ),
    "model": ("LearnedCostModel", "SetCostNet"),
    "samples": (
        "SyntheticTable",
        "collect_samples",
        "draw_ids",
        "load_samples",
        "sample_sets",
        "save_samples",
        "stored_samples",
        "time_tables",
    ),
    "training": ("fit_analytic", "train_cost_model"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
