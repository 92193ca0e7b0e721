"""Recommendation models written unsharded: an embedding-bag collection plus dense arches."""

from raydlrm.models.config import ModelConfig
from raydlrm.models.dhen import DHENDense
from raydlrm.models.dlrm import DCNv2Dense, DLRMDense, RecModel, build_model
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.models.layers import CrossNet
from raydlrm.models.wukong import WukongDense

__all__ = [
    "CrossNet",
    "DCNv2Dense",
    "DHENDense",
    "DLRMDense",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "ModelConfig",
    "RecModel",
    "WukongDense",
    "build_model",
]
