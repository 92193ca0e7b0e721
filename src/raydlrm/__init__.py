"""raydlrm: train large deep-learning recommendation models (DLRMs) on Ray.

The public Python API: :func:`train` runs a training job from a config (a path, a dict or a
:class:`JobConfig`), :func:`load_config` reads a TOML run file with overrides, :func:`score`
and :func:`evaluate` score a Parquet data set with a trained model on Ray Data, :func:`retrain`
runs one slot of scheduled retraining (warm start from the champion, promote only if better),
:func:`tune` sweeps hyperparameters (Ray Tune over training jobs), :func:`build_sequences` turns
an interaction log into examples with user histories (Ray Data).
They are loaded lazily so that worker-side modules (``raydlrm.batch``, ``raydlrm.sharding``)
import without Ray or MLflow.
"""

from raydlrm._lazy import lazy_exports

# The public API by the module that defines it (imported on first use).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "platform.config": ("JobConfig", "load_config"),
    "platform.launch": ("TrainResult", "train"),
    "platform.retrain": ("RetrainResult", "retrain"),
    "platform.scoring": ("ScoreResult", "evaluate", "score"),
    "platform.sequences": ("build_sequences",),
    "platform.tune": ("TuneResult", "tune"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
__version__ = "0.1.0"
