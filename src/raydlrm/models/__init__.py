"""Recommendation models written unsharded: an embedding-bag collection plus dense arches.

The names load lazily (``raydlrm._lazy``): a config module imports no torch."""

from __future__ import annotations

from raydlrm._lazy import lazy_exports

# The public names by the submodule that defines them (imported on first use).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "config": ("ModelConfig",),
    "dhen": ("DHENDense",),
    "din": ("DINDense",),
    "dlrm": (
        "DCNv2Dense",
        "DLRMDense",
        "RecModel",
        "build_model",
    ),
    "embedding": (
        "EmbeddingBagCollection",
        "EmbeddingBagConfig",
    ),
    "layers": ("CrossNet",),
    "sasrec": ("SASRecDense", "sampled_softmax_loss"),
    "towers": ("TowerDense", "TowerModule"),
    "wukong": ("WukongDense",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
