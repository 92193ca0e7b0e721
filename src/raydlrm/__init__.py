"""raydlrm: train large deep-learning recommendation models (DLRMs) on Ray.

The public Python API: :func:`train` runs a training job from a config (a path, a dict or a
:class:`JobConfig`), :func:`load_config` reads a TOML run file with overrides, :func:`score`
and :func:`evaluate` score a Parquet data set with a trained model on Ray Data, :func:`retrain`
runs one slot of scheduled retraining (warm start from the champion, promote only if better).
They are loaded lazily so that worker-side modules (``raydlrm.batch``, ``raydlrm.sharding``)
import without Ray or MLflow.
"""

from typing import Any

__all__ = [
    "JobConfig",
    "RetrainResult",
    "ScoreResult",
    "TrainResult",
    "evaluate",
    "load_config",
    "retrain",
    "score",
    "train",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in __all__:
        import raydlrm.platform as platform_api

        return getattr(platform_api, name)
    raise AttributeError(f"module 'raydlrm' has no attribute {name!r}")
