"""Recommendation models written unsharded: an embedding-bag collection plus dense arches."""

from raydlrm.models.config import ModelConfig
from raydlrm.models.dlrm import CrossNet, DCNv2Dense, DLRMDense, RecModel, build_model
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig

__all__ = [
    "CrossNet",
    "DCNv2Dense",
    "DLRMDense",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "ModelConfig",
    "RecModel",
    "build_model",
]
