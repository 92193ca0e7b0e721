"""The sequence models (DIN, SASRec) in the training loop on gloo ranks: a history looked up per
position through the sharded tables trains, checkpoints, resumes bit for bit on the same ranks
and reshards to another number; SASRec is evaluated by HR@K and NDCG@K over the whole item
table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raydlrm.ingestion import Preprocessor
from raydlrm.ingestion.loader import arrow_to_batch
from raydlrm.sharding import plan_sharding
from raydlrm.sharding.retrieval import retrieval_metrics
from raydlrm.trainers.checkpoints import load_training_state, save_training_state
from raydlrm.trainers.evaluation import Evaluator
from raydlrm.trainers.loop import Trainer
from raydlrm.trainers.spec import WorkerSpec
from tests._multiprocess import run_distributed
from tests.sharding._fixtures import gather_full_optimizer_states
from tests.trainers._fixtures import trained_tol, unsharded_state_dict

ITEMS, CATS, USERS = 60, 7, 50
GLOBAL_BATCH = 24  # divisible by 1, 2 and 3 ranks
STEPS_BEFORE, STEPS_AFTER = 3, 2
MAX_LENGTH = 10


@pytest.fixture(scope="module")
def seq_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Histories of 0-14 items (cut to the last ``MAX_LENGTH`` when read), each with its
    category and time; a candidate item (the next one), its category, a click label."""
    root = tmp_path_factory.mktemp("sequences")
    rng = np.random.default_rng(5)
    for split, rows in (("train", 6 * GLOBAL_BATCH), ("eval", 48)):
        lengths = rng.integers(0, 15, rows)
        hist = [rng.integers(0, ITEMS, n) for n in lengths]
        item = rng.integers(0, ITEMS, rows)
        table = pa.table(
            {
                "label": (rng.random(rows) < 0.4).astype(np.float32),
                "d0": rng.random(rows).astype(np.float32),
                "user": rng.integers(0, USERS, rows),
                "item": item,
                "cat": item % CATS,
                "hist_item": pa.array([h.tolist() for h in hist], pa.list_(pa.int64())),
                "hist_cat": pa.array([(h % CATS).tolist() for h in hist], pa.list_(pa.int64())),
                "hist_time": pa.array(
                    [np.arange(len(h), dtype=np.float32).tolist() for h in hist],
                    pa.list_(pa.float32()),
                ),
            }
        )
        (root / split).mkdir()
        pq.write_table(table, root / split / "part-0.parquet", row_group_size=48)
    return root


def _spec(data_dir: Path, arch: str, world_size: int) -> WorkerSpec:
    candidate = ["item", "cat"] if arch == "din" else ["item"]
    return WorkerSpec(
        data={
            "train_path": str(data_dir / "train"),
            "eval_path": str(data_dir / "eval"),
            "dense_columns": ["d0"],
            "dense_transform": "none",
            "sparse_columns": ["user", "item", "cat", "hist_item", "hist_cat"],
            "sparse_specs": {
                "item": {"table": "t_item", "hash": False},
                "hist_item": {"table": "t_item", "hash": False},
                "cat": {"table": "t_cat", "hash": False},
                "hist_cat": {"table": "t_cat", "hash": False},
            },
            "table_sizes": {"t_item": ITEMS, "t_cat": CATS},
            "table_size": 100,
            "sequences": {
                "hist": {
                    "columns": ["hist_item", "hist_cat"],
                    "value_columns": ["hist_time"],
                    "max_length": MAX_LENGTH,
                }
            },
            "batch_size": GLOBAL_BATCH // world_size,
        },
        model={
            "arch": arch,
            "embedding_dim": 8,
            "bottom_mlp": [8],
            "top_mlp": [16],
            "sequence": "hist",
            "candidate": candidate,
            "din_attention_mlp": [8],
            "sasrec_num_heads": 2,
            "sasrec_dropout": 0.0,
            "sasrec_num_negatives": 16,
            "retrieval_k": [5, 20],
        },
        sharding={"optimizer": "rowwise_adagrad", "learning_rate": 0.05},
        training={"seed": 7, "log_every_steps": 2, "learning_rate": 0.01},
    )


def _trainer(rank: int, world_size: int, data_dir: str, arch: str, types: str, seed: int):
    spec = _spec(Path(data_dir), arch, world_size)
    spec.training.seed = seed
    spec.sharding.default_type = types
    plan = plan_sharding(spec.tables(), world_size=world_size, config=spec.sharding)
    return Trainer(spec, plan=plan, rank=rank, device=torch.device("cpu"))


def _batches(trainer: Trainer, data_dir: str, split: str = "train") -> list:
    table = Preprocessor(trainer.spec.data)(pq.read_table(Path(data_dir) / split))
    return [
        table.slice(i * GLOBAL_BATCH, GLOBAL_BATCH) for i in range(table.num_rows // GLOBAL_BATCH)
    ]


def _steps(trainer: Trainer, batches: list, world_size: int) -> list[float]:
    b = GLOBAL_BATCH // world_size
    losses = []
    for table in batches:
        part = arrow_to_batch(table.slice(trainer.rank * b, b), config=trainer.spec.data)
        losses.append(float(trainer.train_step(part).loss))
    return losses


def _snapshot(trainer: Trainer, data_dir: str, world_size: int) -> dict:
    """The whole model on rank 0, and this rank's eval outputs: DIN's logits, SASRec's user
    vectors."""
    table = _batches(trainer, data_dir, "eval")[0]
    b = GLOBAL_BATCH // world_size
    batch = arrow_to_batch(table.slice(trainer.rank * b, b), config=trainer.spec.data)
    trainer.model.eval()
    with torch.no_grad():
        if trainer.model.retrieval is not None:
            out = trainer.model.user_vectors(batch)
        else:
            out = trainer.model(batch)
    state = unsharded_state_dict(trainer)
    return {
        "state": None if state is None else {k: v.clone() for k, v in state.items()},
        "optimizer": gather_full_optimizer_states(trainer.model.embedding_bags, dst=0),
        "out": out,
    }


def _save(rank, world_size, data_dir, ckpt, arch, types) -> dict:
    trainer = _trainer(rank, world_size, data_dir, arch, types, seed=7)
    batches = _batches(trainer, data_dir)
    losses = _steps(trainer, batches[:STEPS_BEFORE], world_size)
    save_training_state(
        ckpt,
        parts=trainer.parts(),
        loop_state=trainer.state_dict(),
        position={"epoch": 0, "consumed": {}, "totals": {}},
    )
    before = _snapshot(trainer, data_dir, world_size)
    losses += _steps(trainer, batches[STEPS_BEFORE:], world_size)
    return {"before": before, "after": _snapshot(trainer, data_dir, world_size), "losses": losses}


def _load(rank, world_size, data_dir, ckpt, arch, types) -> dict:
    # Another seed: what the run continues with must come from the checkpoint (SASRec's
    # negatives are drawn from the training seed, the step and the rank).
    trainer = _trainer(rank, world_size, data_dir, arch, types, seed=99)
    trainer.load_state_dict(load_training_state(ckpt, parts=trainer.parts()))
    assert trainer.step == STEPS_BEFORE
    before = _snapshot(trainer, data_dir, world_size)
    _steps(trainer, _batches(trainer, data_dir)[STEPS_BEFORE:], world_size)
    return {"before": before, "after": _snapshot(trainer, data_dir, world_size)}


def _run(fn, world_size: int, *args) -> list[dict]:
    if world_size == 1:
        return [fn(0, 1, *args)]
    return run_distributed(fn, world_size=world_size, args=args, timeout_s=300)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("arch", "saved", "loaded"),
    [
        ("din", (2, "table_wise"), (2, "table_wise")),
        ("din", (2, "row_wise"), (3, "table_wise")),
        ("sasrec", (2, "table_wise"), (2, "table_wise")),
        ("sasrec", (2, "table_wise"), (1, "row_wise")),
    ],
)
def test_sequence_model_resumes_and_reshards(
    seq_dir: Path, tmp_path: Path, arch: str, saved, loaded
) -> None:
    """Loaded on the same ranks and plan, the run goes on bit for bit; on another number of
    ranks and another plan, it holds the same weights at the checkpoint and two more steps
    give the saving run's weights and outputs within rounding. (Not column-wise: row-wise
    Adagrad keeps a momentum per column shard's row segment, so a column-wise plan trains
    another update by design; its per-position lookups are compared in
    tests/sharding/test_sequence_lookup.py.)"""
    ckpt = str(tmp_path / "ckpt")
    a = _run(_save, saved[0], str(seq_dir), ckpt, arch, saved[1])
    b = _run(_load, loaded[0], str(seq_dir), ckpt, arch, loaded[1])
    assert all(np.isfinite(a[0]["losses"]))
    for when in ("before", "after"):
        sa, sb = a[0][when]["state"], b[0][when]["state"]
        assert sa.keys() == sb.keys()
        outs = [torch.cat([r[when]["out"] for r in run]) for run in (a, b)]
        if when == "before" or saved == loaded:
            for key in sa:
                assert torch.equal(sa[key], sb[key]), (when, key)
            for table, states in a[0][when]["optimizer"].items():
                assert torch.equal(states[0], b[0][when]["optimizer"][table][0]), (when, table)
            if saved == loaded:
                assert torch.equal(outs[0], outs[1]), when
            continue
        if arch == "sasrec":
            # Its in-batch negatives are each rank's batch's next items, and each rank draws
            # its own sampled ones: on another number of ranks the objective differs (as
            # in-batch negatives do in any data-parallel run); the run goes on training.
            changed = [k for k in sa if not torch.equal(sb[k], b[0]["before"]["state"][k])]
            assert "embedding_bags.weights.t_item" in changed
            assert bool(torch.isfinite(outs[1]).all())
            continue
        for key in sa:
            torch.testing.assert_close(
                sa[key], sb[key], **trained_tol(sa[key], steps=STEPS_AFTER), msg=key
            )
        torch.testing.assert_close(outs[0], outs[1], **trained_tol(outs[0], steps=STEPS_AFTER))


def _evaluate(rank, world_size, data_dir, types) -> dict:
    trainer = _trainer(rank, world_size, data_dir, "sasrec", types, seed=7)
    _steps(trainer, _batches(trainer, data_dir)[:2], world_size)
    b = GLOBAL_BATCH // world_size
    batches = [
        arrow_to_batch(t.slice(rank * b, b), config=trainer.spec.data)
        for t in _batches(trainer, data_dir, "eval")
    ]
    evaluator = Evaluator(
        trainer.model, data=None, spec=trainer.spec, device=torch.device("cpu"), rank=rank
    )
    metrics = evaluator.evaluate(batches)
    trainer.model.eval()
    with torch.no_grad():
        queries = [trainer.model.user_vectors(batch) for batch in batches]
    state = unsharded_state_dict(trainer)
    return {"metrics": metrics, "queries": queries, "batches": batches, "state": state}


@pytest.mark.distributed
def test_sasrec_retrieval_metrics_rank_every_item(seq_dir: Path) -> None:
    """HR@K and NDCG@K from the sharded item table (row-wise on 2 ranks) equal a brute-force
    ranking of every item with the whole table, and examples without history are left out."""
    results = _run(_evaluate, 2, str(seq_dir), "row_wise")
    table = results[0]["state"]["embedding_bags.weights.t_item"]
    ranks, empty = [], 0
    for r in results:
        for batch, queries in zip(r["batches"], r["queries"], strict=True):
            has = batch.sparse.select(["hist_item"]).lengths > 0
            empty += int((~has).sum())
            targets = batch.sparse.select(["item"]).values
            scores = queries @ table.T
            target = scores.gather(1, targets.unsqueeze(1))
            above = (scores > target).sum(dim=1)
            ranks.append(above[has])
    want = {
        f"eval/{k}": float(v.mean())
        for k, v in retrieval_metrics(torch.cat(ranks), ks=(5, 20)).items()
    }
    got = results[0]["metrics"]
    assert got["eval/empty_histories"] == empty > 0
    assert got["eval/num_samples"] == sum(r.numel() for r in ranks)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=1e-12), name


def test_sasrec_scores_top_items_and_target_ranks(seq_dir: Path, tmp_path: Path) -> None:
    """``raydlrm score``'s actor on a SASRec checkpoint writes each row's top-K items (the
    best first, scored against the whole item table) and its target's rank, equal to a
    brute-force ranking with the unsharded table; ``evaluate``'s metrics follow from the ranks
    (rows without history left out and counted)."""
    from raydlrm.platform.scorer import Scorer
    from raydlrm.platform.scoring import _retrieval_metrics
    from raydlrm.trainers.model_dir import (
        WEIGHTS_FILE,
        load_model_checkpoint,
        save_model_metadata,
        write_model_dir,
    )
    from raydlrm.trainers.retrieval import TARGET_RANK_COLUMN, TOP_ITEMS_COLUMN, TOP_SCORES_COLUMN

    trainer = _trainer(0, 1, str(seq_dir), "sasrec", "table_wise", seed=7)
    _steps(trainer, _batches(trainer, str(seq_dir))[:2], 1)
    ckpt = tmp_path / "ckpt"
    save_training_state(
        str(ckpt),
        parts=trainer.parts(),
        loop_state=trainer.state_dict(),
        position={"epoch": 0, "consumed": {}, "totals": {}},
    )
    save_model_metadata(ckpt, spec=trainer.spec, plan=trainer.plan, metrics={})
    directory = write_model_dir(ckpt, tmp_path / "model")
    size = (directory / WEIGHTS_FILE).stat().st_size
    scorer = Scorer(
        {"directory": str(directory), "weights_bytes": size, "files_ref": None}, ["user"]
    )
    raw = pq.read_table(seq_dir / "eval")
    out = scorer(raw)
    assert out.column_names == ["user", TOP_ITEMS_COLUMN, TOP_SCORES_COLUMN, TARGET_RANK_COLUMN]
    model = load_model_checkpoint(str(directory)).model
    table = model.embedding_bags.weights["t_item"].detach()
    batch = arrow_to_batch(Preprocessor(trainer.spec.data)(raw), config=trainer.spec.data)
    with torch.no_grad():
        scores = model.user_vectors(batch) @ table.T
    top = out.column(TOP_ITEMS_COLUMN).to_pylist()
    assert all(len(row) == 20 for row in top)  # max(model.retrieval_k)
    targets = batch.sparse.select(["item"]).values
    above = (scores > scores.gather(1, targets.unsqueeze(1))).sum(dim=1)
    has = batch.sparse.select(["hist_item"]).lengths > 0
    # Without history the query is zero: every item ties, the lower rows first.
    assert torch.equal(torch.tensor(top)[has], torch.topk(scores[has], 20, dim=1).indices)
    assert all(row == list(range(20)) for row, h in zip(top, has.tolist(), strict=True) if not h)
    ranks = torch.tensor(out.column(TARGET_RANK_COLUMN).to_pylist())
    assert torch.equal(ranks[has], above[has]) and bool((ranks[~has] == -1).all())
    # The MLflow model (pyfunc) returns the same columns for raw rows.
    import mlflow.pyfunc

    from raydlrm.platform.export import save_model

    example = raw.slice(0, 4).to_pandas()
    pyfunc = mlflow.pyfunc.load_model(str(save_model(directory, tmp_path / "mlflow", example)))
    predicted = pyfunc.predict(example)
    assert predicted[TOP_ITEMS_COLUMN].map(list).tolist() == top[:4]
    assert predicted[TARGET_RANK_COLUMN].tolist() == ranks[:4].tolist()
    metrics = _retrieval_metrics(out, ks=[5, 20])
    assert metrics["empty_histories"] == int((~has).sum())
    assert metrics["hr_at_20"] == pytest.approx(float((above[has] < 20).double().mean()))


def _one_rank_empty(rank, world_size, data_dir, arch) -> float:
    trainer = _trainer(rank, world_size, data_dir, arch, "table_wise", seed=7)
    table = _batches(trainer, data_dir)[0]
    part = table.slice(0, GLOBAL_BATCH if rank == 0 else 0)  # rank 1's data ran out
    loss = trainer.train_step(arrow_to_batch(part, config=trainer.spec.data)).loss
    return float(loss)


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["din", "sasrec"])
def test_a_rank_with_an_empty_batch_trains_along(seq_dir: Path, arch: str) -> None:
    """A rank whose data ran out steps with an empty batch: every dense parameter still gets
    a (zero) gradient, so the data-parallel reduction does not wait for it forever."""
    losses = _run(_one_rank_empty, 2, str(seq_dir), arch)
    assert np.isfinite(losses[0]) and losses[1] == 0.0
