"""Configuration of the dense architecture and the embedding dimension."""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from raydlrm._config import config_dataclass

__all__ = ["DhenModule", "ModelConfig", "tower_name"]

DhenModule = Literal["dot", "cross", "attention", "linear", "conv"]
"""The interaction modules a DHEN layer can hold (:mod:`raydlrm.models.dhen`)."""


def tower_name(index: int) -> str:
    """The name of ``model.towers[index]``: ``tower<index>``."""
    return f"tower{index}"


@config_dataclass
class ModelConfig:
    """Which model, and its sizes."""

    arch: Literal["dlrm", "dcnv2", "wukong", "dhen"] = "dlrm"
    """``dlrm``: bottom MLP, dot interaction, top MLP. ``dcnv2``: the MLPerf DLRMv2 model (low-rank
    cross layers over the concatenated bottom output and embeddings, then the top MLP).
    ``wukong``: stacked factorization machine and linear compress blocks
    (:mod:`raydlrm.models.wukong`). ``dhen``: layers of an ensemble of interaction modules
    (:mod:`raydlrm.models.dhen`). For ``wukong`` and ``dhen`` the bottom MLP's output is cut into
    ``embedding_dim``-wide vectors that join the embeddings."""
    embedding_dim: int = 16
    """Dimension of every embedding table (a multiple of 4, as fbgemm's kernels require)."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    """Bottom MLP layer sizes; the last must equal ``embedding_dim`` for ``dlrm`` and be a multiple
    of it for ``wukong`` and ``dhen``."""
    top_mlp: list[int] = field(default_factory=lambda: [64, 32])
    """Top MLP hidden sizes (a final 1-unit logit layer is added)."""
    dcn_num_layers: int = 3
    """Cross layers (``dcnv2``)."""
    dcn_low_rank: int = 64
    """Rank of each cross layer's factorized weight (``dcnv2``; ``dhen``'s ``cross`` modules)."""
    wukong_num_layers: int = 2
    """Wukong layers (``wukong``)."""
    wukong_num_fm: int = 8
    """``n_F``: vectors out of each factorization machine block (``wukong``)."""
    wukong_num_lc: int = 8
    """``n_L``: vectors out of each linear compress block (``wukong``)."""
    wukong_rank: int = 8
    """``k``: rank of the factorization machine's low-rank projection (``wukong``)."""
    wukong_fm_mlp: list[int] = field(default_factory=lambda: [64])
    """Hidden sizes of each factorization machine block's MLP (``wukong``)."""
    dhen_layers: list[list[DhenModule]] = field(
        default_factory=lambda: [["dot", "cross", "attention", "linear", "conv"]] * 2
    )
    """Each DHEN layer's interaction modules: ``dot``, ``cross``, ``attention``, ``linear``,
    ``conv`` (``dhen``)."""
    dhen_ensemble: Literal["concat", "sum"] = "concat"
    """How a DHEN layer combines its modules' outputs (``dhen``)."""
    dhen_attention_heads: int = 2
    """Heads of the ``attention`` modules; must divide ``embedding_dim`` (``dhen``)."""
    towers: list[list[str]] | Literal["auto"] | None = None
    """Disaggregated Multi-Tower: the sparse features of each tower (every feature in exactly
    one, a table's features together). Tower ``i`` is looked up on host ``i % H`` (``H`` hosts
    of ``scaling.ranks_per_host`` workers): its tables are sharded over that host's workers,
    its module runs there, and only its output crosses hosts. The towers' outputs replace the
    features at the dense architecture's input. ``"auto"``: the tower partitioner groups the
    features by their interaction strength in a warm-up of the flat model, balanced by
    lookups (``raydlrm.platform.auto_towers``). None: no towers (one flat all-to-all)."""
    num_towers: int = 0
    """Towers ``"auto"`` makes; 0: one per host. Set without ``towers = "auto"``, refused (it
    would be ignored)."""
    tower_warmup_steps: int = 100
    """Steps of ``data.batch_size`` the flat model trains in the driver before ``"auto"``
    measures the interactions (on the next batch). ``"auto"`` only, like ``num_towers``."""
    tower_dim: int = 0
    """Each tower module's output width, a multiple of ``embedding_dim``: the tower's pooled
    embeddings and their pairwise dot products projected to it (what crosses hosts). 0: identity
    towers (the pooled embeddings themselves, regrouped)."""

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
        if self.arch in ("wukong", "dhen") and self.bottom_mlp[-1] % self.embedding_dim:
            raise ValueError(
                f"model.bottom_mlp[-1] ({self.bottom_mlp[-1]}) must be a multiple of "
                f"model.embedding_dim ({self.embedding_dim}) for arch {self.arch!r} (it is cut "
                "into embedding-wide vectors)"
            )
        for name in ("wukong_num_layers", "wukong_num_fm", "wukong_num_lc", "wukong_rank"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if any(n <= 0 for n in self.wukong_fm_mlp):
            raise ValueError(
                f"model.wukong_fm_mlp must be positive sizes, got {self.wukong_fm_mlp}"
            )
        if not self.dhen_layers or any(not modules for modules in self.dhen_layers):
            raise ValueError(
                f"model.dhen_layers must be non-empty lists of modules, got {self.dhen_layers}"
            )
        self._check_towers()
        if self.dhen_attention_heads <= 0 or self.embedding_dim % self.dhen_attention_heads:
            raise ValueError(
                f"model.dhen_attention_heads ({self.dhen_attention_heads}) must be positive and "
                f"divide model.embedding_dim ({self.embedding_dim})"
            )

    def _check_towers(self) -> None:
        if self.tower_dim < 0 or self.tower_dim % self.embedding_dim:
            raise ValueError(
                f"model.tower_dim ({self.tower_dim}) must be 0 (identity towers) or a positive "
                f"multiple of model.embedding_dim ({self.embedding_dim})"
            )
        if self.num_towers < 0 or self.tower_warmup_steps <= 0:
            raise ValueError(
                f"model.num_towers ({self.num_towers}) must be >= 0 and "
                f"model.tower_warmup_steps ({self.tower_warmup_steps}) positive"
            )
        if self.towers is None:
            if self.tower_dim:
                raise ValueError("model.tower_dim is set but model.towers is not")
            return
        if self.towers == "auto":
            return
        if not self.towers:
            raise ValueError("model.towers is empty: list each tower's features, or unset it")
        for i, features in enumerate(self.towers):
            if not features:
                raise ValueError(f"model.towers[{i}] (tower{i}) has no features")
