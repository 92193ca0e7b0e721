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

    arch: Literal["dlrm", "dcnv2", "wukong", "dhen", "din", "sasrec"] = "dlrm"
    """``dlrm``: bottom MLP, dot interaction, top MLP. ``dcnv2``: the MLPerf DLRMv2 model (low-rank
    cross layers over the concatenated bottom output and embeddings, then the top MLP).
    ``wukong``: stacked factorization machine and linear compress blocks
    (:mod:`raydlrm.models.wukong`). ``dhen``: layers of an ensemble of interaction modules
    (:mod:`raydlrm.models.dhen`). For ``wukong`` and ``dhen`` the bottom MLP's output is cut into
    ``embedding_dim``-wide vectors that join the embeddings. Sequence models read the history
    ``sequence`` position by position: ``din`` (Deep Interest Network: the candidate's target
    attention over the history, then an MLP; ranking with the click label,
    :mod:`raydlrm.models.din`) and ``sasrec`` (causal self-attention over the history,
    next-item prediction with a sampled softmax; retrieval, evaluated by HR@K and NDCG@K over
    the whole item table, :mod:`raydlrm.models.sasrec`; it reads no label:
    ``data.label_column`` is unset for it). The other archs pool a sequence's
    columns (mean)."""
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

    sequence: str | None = None
    """The ``data.sequences`` entry a sequence model (``din``, ``sasrec``) reads: its id
    columns are the history, looked up per position."""
    candidate: list[str] = field(default_factory=list)
    """``din``: the candidate's columns (the item being ranked), one per column of
    ``sequence`` in the same order, each sharing that column's table (``data.sparse_specs``
    ``table``). ``sasrec``: one column, the example's target item, in the table of the
    sequence's first (item) column."""
    din_attention_mlp: list[int] = field(default_factory=lambda: [80, 40])
    """Hidden sizes of DIN's activation unit (the attention weight of a history position)."""
    din_attention_normalization: Literal["none", "softmax"] = "none"
    """``none``: the weights are used as they are (the paper: the intensity of the interest is
    kept); ``softmax``: normalized over each history."""
    din_activation: Literal["dice", "prelu"] = "prelu"
    """DIN's activation, in the activation unit and the top MLP. ``dice`` (the paper's)
    normalizes with batch statistics, those of each worker's own batch (as batch norm under
    data parallelism): its training then depends on the per-worker batch size, and a run
    resharded to another number of workers trains another model. ``prelu`` does not."""
    sasrec_num_blocks: int = 2
    """SASRec self-attention blocks."""
    sasrec_num_heads: int = 1
    """Heads per block; must divide ``embedding_dim``."""
    sasrec_dropout: float = 0.2
    """Dropout of the item and position embeddings, attention and feed-forward layers."""
    sasrec_num_negatives: int = 128
    """Items drawn uniformly from the item table each step as negatives of every position
    (beside the batch's other next items)."""
    sasrec_temperature: float = 1.0
    """The sampled softmax's logits are the scores divided by it."""
    retrieval_k: list[int] = field(default_factory=lambda: [10, 50, 200])
    """The cut-offs of the retrieval metrics (``hr@K``, ``ndcg@K``, ``sasrec``) and the top-K
    ``raydlrm score`` writes (the largest)."""

    @property
    def reads_sequences(self) -> bool:
        """Whether the arch reads a history position by position."""
        return self.arch in ("din", "sasrec")

    @property
    def retrieval(self) -> bool:
        """Whether the model retrieves items (next-item prediction) rather than scoring
        clicks."""
        return self.arch == "sasrec"

    def __post_init__(self) -> None:
        self._check_sequence_model()
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

    def _check_sequence_model(self) -> None:
        if not self.reads_sequences:
            if self.sequence is not None or self.candidate:
                raise ValueError(
                    f"model.sequence and model.candidate are read by the sequence models (din, "
                    f"sasrec), not by arch {self.arch!r}: unset them"
                )
            return
        if self.sequence is None:
            raise ValueError(f"arch {self.arch!r} needs model.sequence (a data.sequences entry)")
        if self.arch == "sasrec" and len(self.candidate) != 1:
            raise ValueError(
                f"arch 'sasrec' needs model.candidate = [<target item column>], got "
                f"{self.candidate}"
            )
        if self.towers is not None:
            raise ValueError(f"arch {self.arch!r} does not run with model.towers")
        if any(n <= 0 for n in [*self.din_attention_mlp, *self.retrieval_k]):
            raise ValueError("model.din_attention_mlp and model.retrieval_k must be positive")
        if self.sasrec_num_blocks < 0 or self.sasrec_num_negatives < 0:
            raise ValueError("model.sasrec_num_blocks and sasrec_num_negatives must be >= 0")
        if self.sasrec_num_heads <= 0 or self.embedding_dim % self.sasrec_num_heads:
            raise ValueError(
                f"model.sasrec_num_heads ({self.sasrec_num_heads}) must be positive and divide "
                f"model.embedding_dim ({self.embedding_dim})"
            )
        if not 0.0 <= self.sasrec_dropout < 1.0 or self.sasrec_temperature <= 0:
            raise ValueError(
                "model.sasrec_dropout must be in [0, 1) and model.sasrec_temperature positive"
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
