"""int8 / int4 tables in the unsharded model (export, the MLflow model, scoring): exported as
their codes and (scale, bias) pairs, looked up by dequantizing the rows gathered, predicting as
the trained model does. One 2-rank training run (column-wise tables: two column blocks) shared
by the tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from raydlrm.batch import KeyedJaggedTensor
from raydlrm.ingestion import Preprocessor
from raydlrm.ingestion.loader import arrow_to_batch
from raydlrm.models.quantized import dequantize_blocks
from raydlrm.sharding import plan_sharding
from raydlrm.trainers.checkpoints import save_training_state
from raydlrm.trainers.loop import Trainer
from raydlrm.trainers.model_dir import (
    ModelWeights,
    load_model_checkpoint,
    save_model_metadata,
    write_model_dir,
)
from tests._multiprocess import run_distributed
from tests.sharding._fixtures import gather_full_tables
from tests.trainers._fixtures import trained_tol
from tests.trainers.test_checkpoint import GLOBAL_BATCH, _global_batches, _steps
from tests.trainers.test_loop import _spec

PRECISIONS = {"t_C1": "int8", "t_C2": "int4", "t_C3": "int8", "t_C4": "int4", "t_C5": "fp16"}
"""The other tables stay fp32."""
TYPES = {"t_C1": "column_wise", "t_C2": "column_wise", "t_C4": "row_wise"}
DIM = 32
EVAL_ROWS = 96
ROWS = 1000  # _spec's table_size


def _train_and_save(rank: int, world_size: int, data_dir: str, ckpt: str) -> dict:
    """Two training steps, a checkpoint (with the model's config and plan), then the trained
    model's eval logits of this rank's share of the first ``EVAL_ROWS`` rows and the tables as
    it reads them (dequantized)."""
    spec = _spec(
        Path(data_dir),
        batch_size=GLOBAL_BATCH // world_size,
        optimizer="rowwise_adagrad",
        model={"embedding_dim": DIM, "bottom_mlp": [16, DIM]},
    )
    spec.sharding.weights_precision_per_table = dict(PRECISIONS)
    spec.sharding.pinned_types = dict(TYPES)
    spec.sharding.cache_load_factor = 0.5
    plan = plan_sharding(spec.tables(), world_size=world_size, config=spec.sharding)
    trainer = Trainer(spec, plan=plan, rank=rank, device=torch.device("cpu"))
    _steps(trainer, _global_batches(data_dir, spec)[:2], world_size)
    save_training_state(
        ckpt,
        parts=trainer.parts(),
        loop_state=trainer.state_dict(),
        position={"epoch": 0, "consumed": {}, "totals": {}},
    )
    if rank == 0:
        save_model_metadata(ckpt, spec=spec, plan=plan, metrics={})
    evaluation = Preprocessor(spec.data)(pq.read_table(Path(data_dir) / "eval"))
    share = EVAL_ROWS // world_size
    batch = arrow_to_batch(evaluation.slice(rank * share, share), config=spec.data)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(batch)
    return {"logits": logits, "tables": gather_full_tables(trainer.model.embedding_bags, dst=0)}


@pytest.fixture(scope="module")
def trained(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("quantized")
    ckpt = root / "ckpt"
    results = run_distributed(_train_and_save, world_size=2, args=(str(data_dir), str(ckpt)))
    return {
        "ckpt": ckpt,
        "model_dir": write_model_dir(ckpt, root / "model"),  # what export and scoring write
        "logits": torch.cat([r["logits"] for r in results]),
        "tables": results[0]["tables"],
    }


def _header(path: Path) -> dict:
    """A safetensors file's header: name -> dtype, shape, byte range."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


def _bytes(entry: dict) -> int:
    start, end = entry["data_offsets"]
    return end - start


@pytest.mark.distributed
def test_quantized_tables_are_exported_as_their_codes(trained: dict) -> None:
    """The exported file holds an int8 / int4 table as uint8 codes (dim or dim / 2 bytes a
    row), fp16 (scale, bias) pairs, one per column block, and the column blocks: no weight.
    The codes are the checkpoint's byte for byte; an int8 table takes under 0.3 of its fp32
    bytes (dim 32; 1/4 plus 4 bytes a row)."""
    header = _header(trained["model_dir"] / "model.safetensors")
    plan = json.loads((trained["ckpt"] / "trainer_state.json").read_text())["column_blocks"]
    for table, precision in PRECISIONS.items():
        prefix = f"embedding_bags.quantized.{table}."
        if precision == "fp16":
            assert header[f"embedding_bags.weights.{table}"]["dtype"] == "F16"
            assert prefix + "codes" not in header
            continue
        assert f"embedding_bags.weights.{table}" not in header
        blocks = plan[table]
        assert len(blocks) == (2 if TYPES.get(table) == "column_wise" else 1), table
        width = DIM if precision == "int8" else DIM // 2
        assert header[prefix + "codes"] | {"data_offsets": None} == {
            "dtype": "U8",
            "shape": [ROWS, width],
            "data_offsets": None,
        }
        assert header[prefix + "qparams"]["dtype"] == "F16"
        assert header[prefix + "qparams"]["shape"] == [ROWS, 2 * len(blocks)]
        assert header[prefix + "blocks"]["dtype"] == "I64"
        assert _bytes(header[prefix + "codes"]) == ROWS * width
    fp32 = header["embedding_bags.weights.t_C6"]
    assert fp32["dtype"] == "F32" and _bytes(fp32) == ROWS * DIM * 4
    int8 = sum(_bytes(header[f"embedding_bags.quantized.t_C3.{k}"]) for k in ("codes", "qparams"))
    assert int8 == ROWS * (DIM + 4) and int8 < 0.3 * _bytes(fp32)
    exported = ModelWeights(trained["model_dir"])
    assert exported.form == "safetensors"
    saved = ModelWeights(trained["ckpt"])
    assert {t.name for t in saved.tensors} == {t.name for t in exported.tensors}
    for name, tensor in saved.items():
        assert torch.equal(exported.load(name), tensor), name
    blocks = exported.load("embedding_bags.quantized.t_C1.blocks")
    assert blocks.tolist() == [[0, DIM // 2], [DIM // 2, DIM]]


@pytest.mark.distributed
def test_exported_lookup_pools_the_dequantized_rows(trained: dict) -> None:
    """Loaded (mapped) from the export, a quantized table stays codes; its rows are the
    trained model's rows (dequantize_blocks of the file, = the sharded tables dequantized),
    and a lookup equals embedding_bag over them in fp32, exactly: one and two column blocks,
    int8 and int4."""
    model = load_model_checkpoint(trained["model_dir"]).model
    ebc = model.embedding_bags
    expected = {t: "fp32" for t in ebc.precisions()} | PRECISIONS
    assert ebc.precisions() == expected
    header = _header(trained["model_dir"] / "model.safetensors")
    ids = torch.tensor([5, 999, 5, 0, 17, 3, 17, 17])
    lengths = torch.tensor([3, 0, 5])
    offsets = torch.tensor([0, 3, 3])
    features = {t.name: t.feature_names[0] for t in ebc.tables}
    kjt = KeyedJaggedTensor.from_lengths(
        ebc.feature_names,
        ids.repeat(len(ebc.feature_names)),
        lengths.repeat(len(ebc.feature_names)),
    )
    with torch.no_grad():
        pooled = ebc(kjt).to_dict()
    for table, precision in PRECISIONS.items():
        if precision == "fp16":
            continue
        held = ebc.quantized[table]
        assert (held.codes.dtype, held.qparams.dtype) == (torch.uint8, torch.float16)
        blocks = [tuple(b) for b in held.blocks.tolist()]
        assert held.codes.nbytes == _bytes(header[f"embedding_bags.quantized.{table}.codes"])
        rows = dequantize_blocks(held.codes, held.qparams, blocks=blocks, precision=precision)
        assert torch.equal(rows, trained["tables"][table]), table
        bags = torch.nn.functional.embedding_bag(ids, rows, offsets, mode="sum")
        assert torch.equal(pooled[features[table]], bags), table
        # On the codes' device: an exported model moved to a GPU looks its rows up there
        # (they were made on the CPU whatever the device; "meta" stands in for a GPU here).
        on = dequantize_blocks(
            held.codes.to("meta"), held.qparams.to("meta"), blocks=blocks, precision=precision
        )
        assert on.device.type == "meta" and on.shape == rows.shape


@pytest.mark.distributed
def test_exported_mlflow_model_predicts_as_the_trained_model(trained: dict, tmp_path: Path) -> None:
    """``export`` (the MLflow pyfunc model, from the training checkpoint) scores raw rows as
    the trained model does in eval mode (within the rounding of its unsharded forward's sums);
    so does the model directory ``score``'s actors load (load_model_checkpoint +
    score_table)."""
    import mlflow

    from raydlrm.platform.export import export_model, score_table

    out = export_model(trained["ckpt"], output=tmp_path / "exported")
    exported = Path(out["path"])
    weights = next(exported.rglob("model.safetensors"))
    assert "embedding_bags.quantized.t_C2.codes" in _header(weights)
    spec = load_model_checkpoint(trained["model_dir"]).spec
    raw = pq.read_table(Path(spec.data.eval_path)).slice(0, EVAL_ROWS)
    expected = torch.sigmoid(trained["logits"]).numpy()
    columns = [c for c in spec.data.input_columns() if c != spec.data.label_column]
    features = raw.select(columns).to_pandas()
    predicted = np.asarray(mlflow.pyfunc.load_model(str(exported)).predict(features))
    # The unsharded model's forward sums in its own orders; the sigmoid's slope is at most 1/4.
    atol = trained_tol(trained["logits"])["atol"] / 4
    np.testing.assert_allclose(predicted, expected, rtol=0, atol=atol)
    loaded = load_model_checkpoint(weights.parent)
    scored = score_table(loaded.model, Preprocessor(loaded.spec.data), loaded.spec.data, raw)
    np.testing.assert_allclose(scored, expected, rtol=0, atol=atol)
