"""Configuration of the dense architecture and the embedding dimension."""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from raydlrm._config import config_dataclass


@config_dataclass
class ModelConfig:
    """Which model, and its sizes."""

    arch: Literal["dlrm", "dcnv2"] = "dlrm"
    """``dlrm``: bottom MLP, dot interaction, top MLP. ``dcnv2``: the MLPerf DLRMv2 model (low-rank
    cross layers over the concatenated bottom output and embeddings, then the top MLP)."""
    embedding_dim: int = 16
    """Dimension of every embedding table (a multiple of 4, as fbgemm's kernels require)."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    """Bottom MLP layer sizes; for ``dlrm`` the last must equal ``embedding_dim``."""
    top_mlp: list[int] = field(default_factory=lambda: [64, 32])
    """Top MLP hidden sizes (a final 1-unit logit layer is added)."""
    dcn_num_layers: int = 3
    """Cross layers (``dcnv2``)."""
    dcn_low_rank: int = 64
    """Rank of each cross layer's factorized weight (``dcnv2``)."""

    def __post_init__(self) -> None:
        if self.embedding_dim <= 0 or self.embedding_dim % 4:
            raise ValueError(
                f"model.embedding_dim must be a positive multiple of 4, got {self.embedding_dim}"
            )
        if not self.bottom_mlp or any(n <= 0 for n in self.bottom_mlp):
            raise ValueError(f"model.bottom_mlp must be positive sizes, got {self.bottom_mlp}")
        if any(n <= 0 for n in self.top_mlp):
            raise ValueError(f"model.top_mlp must be positive sizes, got {self.top_mlp}")
        if self.arch == "dlrm" and self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"model.bottom_mlp[-1] ({self.bottom_mlp[-1]}) must equal model.embedding_dim "
                f"({self.embedding_dim}) for arch 'dlrm' (dot interaction)"
            )
        if self.dcn_num_layers < 0 or self.dcn_low_rank <= 0:
            raise ValueError("model.dcn_num_layers must be >= 0 and model.dcn_low_rank > 0")
