"""Training-state checkpoints (DCP) on gloo ranks: a checkpoint written by N ranks with one plan
loads into M ranks with another plan, weights and optimizer state included, and training goes
on as if it had never stopped."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import safetensors.torch
import torch

from raydlrm.ids import ManagedIds
from raydlrm.ingestion import Preprocessor
from raydlrm.ingestion.loader import arrow_to_batch
from raydlrm.models import build_model
from raydlrm.sharding import plan_sharding
from raydlrm.sharding.planner.tower_plan import plan_towers
from raydlrm.sharding.topology import Topology
from raydlrm.sharding.tower_spec import model_towers
from raydlrm.trainers.checkpoints import (
    CheckpointReader,
    load_training_state,
    read_state_file,
    save_training_state,
)
from raydlrm.trainers.loop import Trainer
from raydlrm.trainers.model_delta import apply_model_delta, write_model_delta
from raydlrm.trainers.model_dir import (
    ModelWeights,
    load_model_checkpoint,
    save_model_metadata,
    write_model_dir,
    write_model_weights,
)
from raydlrm.trainers.model_prune import prune_model_dir, prune_rules
from tests._multiprocess import run_distributed
from tests._tolerance import sum_order_tol
from tests.sharding._fixtures import (
    gather_full_optimizer_states,
    gather_full_tables,
    gather_id_maps,
)
from tests.trainers._fixtures import trained_tol, unsharded_state_dict
from tests.trainers.test_loop import NEW_ARCHS, _spec

GLOBAL_BATCH = 48  # divisible by 1, 2, 3 and 4 ranks
# Managed tables: C10 small enough to evict (LRU) within the run (72 rows for its 94 ids in
# the run's 5 steps), C2 admitting ids seen twice.
MANAGED = {
    "C10": ManagedIds(buckets=3, probe_window=16),
    "C2": ManagedIds(buckets=6, admit_after=2),
}
STEPS_BEFORE, STEPS_AFTER = 3, 2
EVAL_ROWS = 240


def _global_batches(data_dir: str, spec) -> list[pa.Table]:
    table = Preprocessor(spec.data)(pq.read_table(Path(data_dir) / "train"))
    return [table.slice(i * GLOBAL_BATCH, GLOBAL_BATCH) for i in range(STEPS_BEFORE + STEPS_AFTER)]


def _trainer(
    rank: int,
    world_size: int,
    data_dir: str,
    types: str,
    optimizer: str,
    seed: int,
    model: dict | None = None,
    checkpoint: dict | None = None,
    report: Any = None,
    ranks_per_host: int | None = None,
    training: dict | None = None,
    gain_one: bool = False,
):
    """A trainer sharding every table ``types`` (``"row_wise+fp16"``: with fp16 tables;
    ``"row_wise@torch"``: on the torch kernel; ``"row_wise!ssd"``: on the SSD tier (``!host``:
    host tables); ``"row_wise^managed"``: :data:`MANAGED` tables; ``"...~dedup"``: C3..C10 a
    dedup group); with ``model.towers`` and
    ``ranks_per_host``, the towers on hosts of that many ranks; ``training``: training keys.
    ``gain_one``: every update's gain at most 1 (the fused optimizer's eps its learning rate,
    the dense part trained by SGD; see ``tests/_tolerance.py``), for runs compared across
    summation orders."""
    spec = _spec(
        Path(data_dir), batch_size=GLOBAL_BATCH // world_size, optimizer=optimizer, model=model
    )
    types, _, dedup = types.partition("~")  # "~dedup": C3..C10 a RecD dedup group
    if dedup:
        spec.data.dedup_groups = [[f"C{i}" for i in range(3, 11)]]
    types, _, managed = types.partition("^")
    if managed:
        spec.data.table_sizes = {"C10": 72}
        spec.data.managed_ids = MANAGED
    spec.training.seed = seed
    if gain_one:
        spec.sharding.eps = spec.sharding.learning_rate
        spec.training.dense_optimizer = "sgd"
    for key, value in (training or {}).items():
        setattr(spec.training, key, value)
    for key, value in (checkpoint or {}).items():
        setattr(spec.checkpoint, key, value)
    types, _, placement = types.partition("!")  # "row_wise!ssd": tables on the SSD tier
    spec.sharding.default_placement = placement or "dram"
    types, _, kernel = types.partition("@")
    types, _, precision = types.partition("+")
    spec.sharding.kernel = kernel or "fbgemm"
    spec.sharding.default_type = types
    spec.sharding.weights_precision = precision or "fp32"
    # Every row cache: half the rows (an ssd table's at least 65,536: its whole shard here).
    spec.sharding.cache_load_factor = 0.5
    topology = Topology.of(world_size, ranks_per_host)
    if spec.model.towers is not None and topology.num_hosts > 1:
        towers = model_towers(spec.model.towers, topology.num_hosts)
        plan = plan_towers(spec.tables(), towers, topology, config=spec.sharding)
    else:
        plan = plan_sharding(spec.tables(), world_size=world_size, config=spec.sharding)
    trainer = Trainer(
        spec,
        plan=plan,
        rank=rank,
        device=torch.device("cpu"),
        report=report,
        topology=topology,
    )
    assert trainer.model.embedding_bags.kernel == spec.sharding.kernel
    return trainer


def _steps(trainer: Trainer, batches: list[pa.Table], world_size: int) -> None:
    b = GLOBAL_BATCH // world_size
    for table in batches:
        part = table.slice(trainer.rank * b, b)
        trainer.train_step(arrow_to_batch(part, config=trainer.spec.data))


def _snapshot(trainer: Trainer, data_dir: str, world_size: int) -> dict:
    """The full model, full fused optimizer state and this rank's eval logits."""
    evaluation = Preprocessor(trainer.spec.data)(pq.read_table(Path(data_dir) / "eval"))
    share = EVAL_ROWS // world_size
    batch = arrow_to_batch(evaluation.slice(trainer.rank * share, share), config=trainer.spec.data)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(batch)
    state = unsharded_state_dict(trainer)  # on CPU these alias the live dense parameters
    return {
        "state": None if state is None else {k: v.clone() for k, v in state.items()},
        "optimizer": gather_full_optimizer_states(trainer.model.embedding_bags, dst=0),
        "logits": logits,
    }


def _save(rank, world_size, data_dir, ckpt, types, optimizer, model=None, hosts=None) -> dict:
    trainer = _trainer(
        rank, world_size, data_dir, types, optimizer, seed=7, model=model, ranks_per_host=hosts
    )
    batches = _global_batches(data_dir, trainer.spec)
    _steps(trainer, batches[:STEPS_BEFORE], world_size)
    trainer.epoch = 1
    save_training_state(
        ckpt,
        parts=trainer.parts(),
        loop_state=trainer.state_dict(),
        position={"epoch": 1, "consumed": {"3": 5}, "totals": {}},
    )
    before = _snapshot(trainer, data_dir, world_size)
    _steps(trainer, batches[STEPS_BEFORE:], world_size)
    after = _snapshot(trainer, data_dir, world_size)
    return {"before": before, "after": after}


def _load(rank, world_size, data_dir, ckpt, types, optimizer, model=None, hosts=None) -> dict:
    # Another seed: everything the run continues with must come from the checkpoint.
    trainer = _trainer(
        rank, world_size, data_dir, types, optimizer, seed=99, model=model, ranks_per_host=hosts
    )
    state = load_training_state(ckpt, parts=trainer.parts())
    trainer.load_state_dict(state)
    assert (trainer.step, trainer.epoch) == (STEPS_BEFORE, 1)
    assert state["position"]["consumed"] == {"3": 5}
    before = _snapshot(trainer, data_dir, world_size)
    _steps(trainer, _global_batches(data_dir, trainer.spec)[STEPS_BEFORE:], world_size)
    after = _snapshot(trainer, data_dir, world_size)
    return {"before": before, "after": after}


def _logits(results: list[dict], when: str) -> torch.Tensor:
    return torch.cat([r[when]["logits"] for r in results])


def _check_continued(a: list[dict], b: list[dict], ckpt: str) -> None:
    """The loaded run predicts as the saving run did at the checkpoint, holds its weights and
    optimizer state exactly, and two more steps give the saving run's weights and logits."""
    # Unsharded in one process, one tensor at a time: one tensor per table, the model as saved.
    plain = dict(ModelWeights(ckpt).items())
    assert plain.keys() == a[0]["before"]["state"].keys()
    assert all(torch.equal(plain[k], v) for k, v in a[0]["before"]["state"].items())
    for when in ("before", "after"):
        sa, sb = a[0][when]["state"], b[0][when]["state"]
        assert sa.keys() == sb.keys()
        steps = 0 if when == "before" else STEPS_AFTER
        for key in sa:
            if when == "before":  # loading copies: exactly equal
                assert torch.equal(sa[key], sb[key]), key
            else:  # the next steps reduce over another number of ranks: equal to rounding
                torch.testing.assert_close(
                    sa[key], sb[key], **trained_tol(sa[key], steps=steps), msg=key
                )
        for table, states in a[0][when]["optimizer"].items():
            got = b[0][when]["optimizer"][table][0]
            torch.testing.assert_close(states[0], got, **trained_tol(got, steps=steps), msg=table)
        logits = _logits(a, when)
        torch.testing.assert_close(logits, _logits(b, when), **trained_tol(logits, steps=steps))


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ((2, "table_wise"), (3, "row_wise")),
        ((3, "row_wise"), (2, "table_wise")),
        ((2, "table_wise"), (2, "row_wise!host")),
        ((4, "table_wise"), (2, "row_wise")),
        ((2, "row_wise!host"), (1, "table_wise")),
    ],
)
def test_reshard_and_continue(data_dir: Path, tmp_path: Path, saved, loaded) -> None:
    """Loaded into another world size and plan, the model predicts as before saving, its
    optimizer state is the same, and two more steps give the saving run's weights; also
    from and into ``host`` tables (their rows behind a row cache of half of them)."""
    ckpt = str(tmp_path / "ckpt")
    a = run_distributed(
        _save, world_size=saved[0], args=(str(data_dir), ckpt, saved[1], "rowwise_adagrad")
    )
    if loaded[0] == 1:
        b = [_load(0, 1, str(data_dir), ckpt, loaded[1], "rowwise_adagrad")]
    else:
        b = run_distributed(
            _load, world_size=loaded[0], args=(str(data_dir), ckpt, loaded[1], "rowwise_adagrad")
        )
    assert read_state_file(ckpt)["world_size"] == saved[0]
    _check_continued(a, b, ckpt)


def _maps(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every managed table's whole id map ``(4, rows)`` (all ranks call)."""
    return gather_id_maps(trainer.model.embedding_bags)


def _save_managed(rank, world_size, data_dir, ckpt, types) -> dict:
    out = _save(rank, world_size, data_dir, ckpt, types, "rowwise_adagrad")
    return {**out, "maps": _maps_after(rank, world_size, data_dir, ckpt, types, resumed=False)}


def _maps_after(rank, world_size, data_dir, ckpt, types, *, resumed: bool) -> dict:
    """The maps at the checkpoint (loaded) and after the run's last steps."""
    trainer = _trainer(rank, world_size, data_dir, types, "rowwise_adagrad", seed=99)
    load_training_state(ckpt, parts=trainer.parts())
    at = _maps(trainer)
    _steps(trainer, _global_batches(data_dir, trainer.spec)[STEPS_BEFORE:], world_size)
    stats = {n: m.stats() for n, m in trainer.model.embedding_bags.id_maps().items()}
    return {"at": at, "after": _maps(trainer), "stats": stats}


def _load_managed(rank, world_size, data_dir, ckpt, types) -> dict:
    out = _load(rank, world_size, data_dir, ckpt, types, "rowwise_adagrad")
    return {**out, "maps": _maps_after(rank, world_size, data_dir, ckpt, types, resumed=True)}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ((2, "row_wise^managed"), (2, "row_wise^managed")),
        ((2, "row_wise^managed"), (1, "table_wise^managed")),
        ((2, "table_wise^managed"), (3, "row_wise^managed")),
    ],
    ids=["resume", "2-to-1", "2-to-3"],
)
def test_managed_tables_resume_and_reshard(data_dir: Path, tmp_path: Path, saved, loaded) -> None:
    """Managed tables (one evicting) saved on 2 ranks load on 2 (bit-identical continuation), 1
    and 3: every id keeps its row's content, the maps are the saved ones, and the next steps
    give the saving run's weights and maps (the maps exactly: one rank decides each id)."""
    ckpt = str(tmp_path / "ckpt")
    a = run_distributed(_save_managed, world_size=saved[0], args=(str(data_dir), ckpt, saved[1]))
    if loaded[0] == 1:
        b = [_load_managed(0, 1, str(data_dir), ckpt, loaded[1])]
    else:
        b = run_distributed(
            _load_managed, world_size=loaded[0], args=(str(data_dir), ckpt, loaded[1])
        )
    _check_continued(a, b, ckpt)
    for when in ("at", "after"):
        ma, mb = a[0]["maps"][when], b[0]["maps"][when]
        assert ma.keys() == mb.keys() == {"t_C10", "t_C2"}
        for name in ma:
            assert torch.equal(ma[name], mb[name]), (when, name)
    assert sum(r["maps"]["stats"]["t_C10"]["evictions"] for r in a if r["maps"]["stats"]) > 0
    if saved == loaded:  # the same plan goes on bit for bit
        for key, value in a[0]["after"]["state"].items():
            assert torch.equal(value, b[0]["after"]["state"][key]), key


def _dedup_pair(rank, world_size, data_dir) -> dict:
    out = {}
    for types in ("row_wise^managed", "row_wise^managed~dedup"):
        trainer = _trainer(rank, world_size, data_dir, types, "adagrad", seed=7, gain_one=True)
        _steps(trainer, _global_batches(data_dir, trainer.spec), world_size)
        out[types] = {
            "maps": _maps(trainer),
            "tables": gather_full_tables(trainer.model.embedding_bags, dst=0),
        }
    return out


@pytest.mark.distributed
def test_managed_tables_in_a_dedup_group_train_as_without(data_dir: Path) -> None:
    """A managed table (C10, evicting) whose column is in a RecD dedup group: its ids reach the
    map as the group's unique rows, and the maps and tables end as without deduplication: the
    ids and last steps (so LRU's evictions) exactly; the lookup counts are per unique row.

    The tables differ by the order of sums alone (the group's duplicates' gradients are summed
    first): a row's gradient sums at most a step's ids of it (48 samples x 8 ids of a list),
    each later step's forward carries the difference on, and every update's gain is at most 1
    (``gain_one``; with Adagrad's eps = 1e-8 one gradient that cancelled to near zero once
    differed by 1.66e-6 on an AVX-512 CPU). The terms are below the tables' own magnitude."""
    results = run_distributed(_dedup_pair, world_size=2, args=(str(data_dir),))
    plain, dedup = results[0]["row_wise^managed"], results[0]["row_wise^managed~dedup"]
    assert torch.equal(plain["maps"]["t_C2"], dedup["maps"]["t_C2"])  # not in the group
    assert torch.equal(plain["maps"]["t_C10"][:2], dedup["maps"]["t_C10"][:2])
    assert int((plain["maps"]["t_C10"][2] > dedup["maps"]["t_C10"][2]).sum()) > 0
    steps = STEPS_BEFORE + STEPS_AFTER
    for name, table in plain["tables"].items():
        tol = sum_order_tol(GLOBAL_BATCH * 8, float(table.abs().max()), k=steps)
        torch.testing.assert_close(dedup["tables"][name], table, **tol, msg=name)


# Towers over the synthetic data's 26 features: 3 towers, so 2 hosts hold 2 and 1.
TOWERS = [
    [f"C{i}" for i in range(1, 9)],
    [f"C{i}" for i in range(9, 18)],
    [f"C{i}" for i in range(18, 27)],
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("model", "types", "loaded"),
    [
        # Identity towers, 2 hosts x 2 ranks -> one host of 2 ranks (flat tables).
        ({"towers": TOWERS}, ("table_wise", "row_wise"), (2, None)),
        # Compressing towers on DCNv2, 2 hosts x 2 ranks -> 2 hosts x 1 rank.
        ({"towers": TOWERS, "tower_dim": 16, "arch": "dcnv2"}, ("row_wise", "table_wise"), (2, 1)),
        # Compressing towers -> one host, where the dense part runs the tower modules: the
        # tower run's modules must have trained as the flat model's do (they once were left
        # out of the dense optimizer when sharded on hosts).
        ({"towers": TOWERS, "tower_dim": 16}, ("table_wise", "row_wise"), (2, None)),
    ],
    ids=[
        "identity-to-one-host",
        "dcnv2-compressed-to-hosts-of-one-rank",
        "compressed-to-one-host",
    ],
)
def test_towers_on_hosts_reshard_and_continue(
    data_dir: Path, tmp_path: Path, model, types, loaded
) -> None:
    """Towers on 2 hosts x 2 ranks (each tower looked up on its host, the tower modules run
    there, replicated in every rank's dense state): the checkpoint loads into another topology
    (one host, or hosts of one rank), predicts as before, and two more steps there give the
    tower run's weights and logits: the tower sharding trains as the flat model does."""
    ckpt = str(tmp_path / "ckpt")
    args = (str(data_dir), ckpt, types[0], "rowwise_adagrad", model, 2)
    a = run_distributed(_save, world_size=4, args=args)
    args = (str(data_dir), ckpt, types[1], "rowwise_adagrad", model, loaded[1])
    b = run_distributed(_load, world_size=loaded[0], args=args)
    assert any(k.startswith("dense.blocks.tower2") for k in a[0]["before"]["state"]) == bool(
        model.get("tower_dim")
    )
    _check_continued(a, b, ckpt)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("optimizer", "saved", "loaded"),
    [
        ("rowwise_adagrad", (2, "column_wise"), (3, "table_wise")),
        # Checkpoints move between the kernels, both ways (same weight and state layouts).
        ("adagrad", (2, "column_wise"), (3, "row_wise@torch")),
        ("sgd", (3, "row_wise@torch"), (2, "data_parallel")),
    ],
)
def test_reshard_column_wise_and_other_optimizers(
    data_dir: Path,
    tmp_path: Path,
    optimizer: str,
    saved,
    loaded,
) -> None:
    """Column-wise row-wise Adagrad momenta become the whole-row momentum (their width-weighted
    mean); Adagrad's per-element state and SGD (no state) reshard like the weights, from the
    fbgemm kernel to the torch kernel and back."""
    ckpt = str(tmp_path / "ckpt")
    a = run_distributed(_save, world_size=saved[0], args=(str(data_dir), ckpt, saved[1], optimizer))
    b = run_distributed(
        _load, world_size=loaded[0], args=(str(data_dir), ckpt, loaded[1], optimizer)
    )
    sa, sb = a[0]["before"]["state"], b[0]["before"]["state"]
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    for table, states in a[0]["before"]["optimizer"].items():
        for x, y in zip(states, b[0]["before"]["optimizer"][table], strict=True):
            torch.testing.assert_close(x, y, **trained_tol(x), msg=table)  # momenta merged
    logits = _logits(a, "before")
    torch.testing.assert_close(logits, _logits(b, "before"), **trained_tol(logits))


@pytest.mark.distributed
def test_checkpoint_moves_between_fp32_and_fp16_tables(data_dir: Path, tmp_path: Path) -> None:
    """fp32 table-wise tables load into fp16 row-wise ones (rounded to nearest; the fp32
    optimizer state exactly); fp16 tables are saved, and unsharded, as fp16."""
    ckpt, ckpt16 = str(tmp_path / "ckpt"), str(tmp_path / "ckpt16")
    a = run_distributed(
        _save, world_size=2, args=(str(data_dir), ckpt, "table_wise", "rowwise_adagrad")
    )
    b = run_distributed(
        _load, world_size=2, args=(str(data_dir), ckpt, "row_wise+fp16", "rowwise_adagrad")
    )
    sa, sb = a[0]["before"]["state"], b[0]["before"]["state"]
    tables = [k for k in sa if k.startswith("embedding_bags.")]
    assert tables
    for key in sa:
        expected = sa[key].half() if key in tables else sa[key]
        assert sb[key].dtype == expected.dtype and torch.equal(sb[key], expected), key
    for table, states in a[0]["before"]["optimizer"].items():
        assert torch.equal(states[0], b[0]["before"]["optimizer"][table][0]), table
    q = run_distributed(
        _load, world_size=2, args=(str(data_dir), ckpt, "row_wise+int8", "rowwise_adagrad")
    )
    for key in tables:  # fp32 -> int8: rounded to nearest, once
        want, got = sa[key], q[0]["before"]["state"][key]
        step = (want.amax(1) - want.amin(1)).unsqueeze(1) / 255
        assert bool(
            ((got - want).abs() <= step * (1 + 2**-9) / 2 + 1e-6).all()
        ) and not torch.equal(got, want)
    c = run_distributed(
        _save, world_size=2, args=(str(data_dir), ckpt16, "table_wise+fp16", "rowwise_adagrad")
    )
    plain = dict(ModelWeights(ckpt16).items())
    assert all(plain[k].dtype == torch.float16 for k in tables)
    assert all(torch.equal(plain[k], v) for k, v in c[0]["before"]["state"].items())


@pytest.mark.distributed
def test_int8_tables_resume_reshard_and_convert(data_dir: Path, tmp_path: Path, caplog) -> None:
    """An int8 checkpoint holds codes and scales (no fp32 weights), loads byte for byte into
    another world size and row-wise shards (the model predicts as saved; continuing is within
    a quantization step of the saving run), and loads into fp32 column-wise tables and int4
    ones when asked, converted once and logged; fp32 tables load into int8 ones."""
    ckpt = str(tmp_path / "ckpt")
    a = run_distributed(
        _save, world_size=2, args=(str(data_dir), ckpt, "table_wise+int8", "rowwise_adagrad")
    )
    keys = CheckpointReader(ckpt).read_metadata().state_dict_metadata
    tables = [k for k in a[0]["before"]["state"] if k.startswith("embedding_bags.")]
    for key in tables:
        name = key.rpartition(".")[2]
        assert keys[f"embedding.{name}.codes"].properties.dtype == torch.uint8
        assert f"embedding.{name}.weight" not in keys
    b = run_distributed(
        _load, world_size=3, args=(str(data_dir), ckpt, "row_wise+int8", "rowwise_adagrad")
    )
    sa, sb = a[0]["before"]["state"], b[0]["before"]["state"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa), "loading copies the codes"
    logits = _logits(a, "before")
    torch.testing.assert_close(logits, _logits(b, "before"), **trained_tol(logits))
    for key in tables:  # the next steps: each write-back rounds a row to a step of its range
        # (at most twice its largest value, over 255 levels) with another seed's noise
        want = a[0]["after"]["state"][key]
        atol = STEPS_AFTER * 2 * float(want.abs().max()) / 255
        torch.testing.assert_close(want, b[0]["after"]["state"][key], atol=atol, rtol=0.0)
    with caplog.at_level(logging.INFO, logger="raydlrm.sharding.embedding_checkpoint"):
        c = [_load(0, 1, str(data_dir), ckpt, "column_wise", "rowwise_adagrad")]
        d = [_load(0, 1, str(data_dir), ckpt, "table_wise+int4", "rowwise_adagrad")]
    assert "the checkpoint holds it in int8 (column blocks" in caplog.text
    assert "the plan in int4" in caplog.text
    sc, sd = c[0]["before"]["state"], d[0]["before"]["state"]
    for key in tables:
        assert torch.equal(sc[key], sa[key]), "dequantized exactly"
        # half a step; the step is the range over 15 rounded up to fp16
        step = (sa[key].amax(1) - sa[key].amin(1)).unsqueeze(1) / 15
        assert bool(((sd[key] - sa[key]).abs() <= step * (1 + 2**-9) / 2 + 1e-6).all()), (
            "rounded to nearest"
        )
    for table, states in a[0]["before"]["optimizer"].items():
        assert torch.equal(states[0], c[0]["before"]["optimizer"][table][0]), table


def _warm(rank, world_size, data_dir, ckpt, types, optimizer) -> dict:
    trainer = _trainer(rank, world_size, data_dir, types, optimizer, seed=99)
    trainer.warm_start(ckpt)
    # A new run: counters and data position start afresh, the saved step is reported.
    assert (trainer.step, trainer.epoch, trainer.samples_seen) == (0, 0, 0)
    assert trainer.resume is None
    assert trainer.reporter.merged({}, loop_state=trainer.state_dict())["warm_start/from_step"] == (
        STEPS_BEFORE
    )
    before = _snapshot(trainer, data_dir, world_size)
    _steps(trainer, _global_batches(data_dir, trainer.spec)[STEPS_BEFORE:], world_size)
    after = _snapshot(trainer, data_dir, world_size)
    return {"before": before, "after": after}


@pytest.mark.distributed
def test_warm_start_takes_weights_and_optimizer_state_resharded(
    data_dir: Path, tmp_path: Path
) -> None:
    """A warm start (retraining from the champion) on 3 row-wise ranks from a 2-rank table-wise
    checkpoint: the same weights and optimizer states (fused and dense Adam), so the next steps
    give the saving run's weights; only the counters start at zero."""
    ckpt = str(tmp_path / "ckpt")
    a = run_distributed(
        _save, world_size=2, args=(str(data_dir), ckpt, "table_wise", "rowwise_adagrad")
    )
    b = run_distributed(
        _warm, world_size=3, args=(str(data_dir), ckpt, "row_wise", "rowwise_adagrad")
    )
    sa, sb = a[0]["before"]["state"], b[0]["before"]["state"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for table, states in a[0]["before"]["optimizer"].items():
        got = b[0]["before"]["optimizer"][table][0]
        torch.testing.assert_close(states[0], got, **trained_tol(got), msg=table)
    steps = STEPS_AFTER
    for key, value in a[0]["after"]["state"].items():
        torch.testing.assert_close(
            value, b[0]["after"]["state"][key], **trained_tol(value, steps=steps)
        )
    logits = _logits(a, "after")
    torch.testing.assert_close(logits, _logits(b, "after"), **trained_tol(logits, steps=steps))


def test_load_rejects_other_tables_or_optimizer(data_dir: Path, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    trainer = _trainer(0, 1, str(data_dir), "table_wise", "rowwise_adagrad", seed=7)
    save_training_state(
        ckpt,
        parts=trainer.parts(),
        loop_state=trainer.state_dict(),
        position={"epoch": 0, "consumed": {}, "totals": {}},
    )
    other = _trainer(0, 1, str(data_dir), "table_wise", "sgd", seed=7)
    with pytest.raises(ValueError, match="fused optimizer 'rowwise_adagrad'"):
        load_training_state(ckpt, parts=other.parts())
    bigger = _spec(Path(data_dir), batch_size=8, optimizer="rowwise_adagrad")
    bigger.data.table_size = 2000
    plan = plan_sharding(bigger.tables(), world_size=1, config=bigger.sharding)
    with pytest.raises(ValueError, match="holds tables"):
        load_training_state(
            ckpt, parts=Trainer(bigger, plan=plan, rank=0, device=torch.device("cpu")).parts()
        )
    with pytest.raises(FileNotFoundError, match=r"trainer_state\.json"):
        load_training_state(str(tmp_path), parts=trainer.parts())
    # A hashed table resumed as managed, and the reverse, is refused naming the table.
    managed = _spec(Path(data_dir), batch_size=8, optimizer="rowwise_adagrad")
    managed.data.managed_ids = {"C2": ManagedIds(buckets=6)}
    plan = plan_sharding(managed.tables(), world_size=1, config=managed.sharding)
    parts = Trainer(managed, plan=plan, rank=0, device=torch.device("cpu")).parts()
    with pytest.raises(ValueError, match="table 't_C2' is hashed in the checkpoint but managed"):
        load_training_state(ckpt, parts=parts)
    managed_ckpt = str(tmp_path / "managed")
    save_training_state(
        managed_ckpt,
        parts=parts,
        loop_state={},
        position={"epoch": 0, "consumed": {}, "totals": {}},
    )
    with pytest.raises(ValueError, match="table 't_C2' is managed in the checkpoint but hashed"):
        load_training_state(managed_ckpt, parts=trainer.parts())
    # A smaller probe window would hide the ids placed past it: refused; a larger one loads.
    for window, refused in ((64, True), (256, False)):
        managed.data.managed_ids = {"C2": ManagedIds(buckets=6, probe_window=window)}
        plan = plan_sharding(managed.tables(), world_size=1, config=managed.sharding)
        parts = Trainer(managed, plan=plan, rank=0, device=torch.device("cpu")).parts()
        if refused:
            match = r"table 't_C2' placed its ids within probe windows of 128 rows.*is 64"
            with pytest.raises(ValueError, match=match):
                load_training_state(managed_ckpt, parts=parts)
        else:
            load_training_state(managed_ckpt, parts=parts)
    # Windows past a bucket's slots (166 of its 167 rows) probe the whole bucket alike.
    managed_ckpt = str(tmp_path / "wide")
    position = {"epoch": 0, "consumed": {}, "totals": {}}
    save_training_state(managed_ckpt, parts=parts, loop_state={}, position=position)  # 256
    managed.data.managed_ids = {"C2": ManagedIds(buckets=6, probe_window=170)}
    plan = plan_sharding(managed.tables(), world_size=1, config=managed.sharding)
    cpu = torch.device("cpu")
    load_training_state(managed_ckpt, parts=Trainer(managed, plan=plan, rank=0, device=cpu).parts())


def test_the_managed_clock_never_goes_back_on_a_warm_start(data_dir: Path, tmp_path: Path) -> None:
    """Maps trained on a data day, warm-started without ``data.data_date`` (or on an earlier
    day): the run's clock stays on the maps' day, after every loaded row's last lookup, so LRU
    sees the loaded rows as older than this run's lookups (on day 0 it evicted the hot ones)."""
    from raydlrm.ids import DAY_SHIFT, clock
    from raydlrm.models.managed_ids import LAST

    ckpt = str(tmp_path / "dated")
    dated = _trainer(0, 1, str(data_dir), "row_wise^managed", "rowwise_adagrad", seed=7)
    dated.spec.data.data_date = "2026-01-05"
    dated.model.embedding_bags.managed_day = dated.spec.data.data_day()
    _steps(dated, _global_batches(str(data_dir), dated.spec)[:2], 1)
    save_training_state(
        ckpt,
        parts=dated.parts(),
        loop_state=dated.state_dict(),
        position={"epoch": 0, "consumed": {}, "totals": {}},
    )
    for date in (None, "2026-01-02"):
        warm = _trainer(0, 1, str(data_dir), "row_wise^managed", "rowwise_adagrad", seed=7)
        warm.spec.data.data_date = date
        warm.model.embedding_bags.managed_day = warm.spec.data.data_day()
        warm.warm_start(ckpt)
        collection = warm.model.embedding_bags
        assert collection.managed_day == dated.spec.data.data_day()
        newest = max(int(m.state[LAST].max()) for m in collection.id_maps().values())
        assert newest >> DAY_SHIFT == collection.managed_day
        step, _ = collection.managed_clock
        assert clock(step + 1, collection.managed_day) > newest


def test_checkpoint_cli_shows_and_unshards(data_dir: Path, tmp_path: Path) -> None:
    """Also: a run directory means its newest intact checkpoint (said on stderr); a file that
    ``runs/<run>/checkpoint_*`` also matches (Ray's checkpoint-manager snapshot) is not a
    checkpoint directory, said in one line, not called damaged."""
    from typer.testing import CliRunner

    from raydlrm.platform.cli import app

    ckpt = tmp_path / "run" / "checkpoint_2026-11-24_10-00-00.000000"
    trainer = _trainer(0, 1, str(data_dir), "table_wise", "rowwise_adagrad", seed=7)
    _steps(trainer, _global_batches(str(data_dir), trainer.spec)[:2], 1)
    position = {"epoch": 0, "consumed": {"0": 96}, "totals": {"0": 640}}
    save_training_state(
        ckpt, parts=trainer.parts(), loop_state=trainer.state_dict(), position=position
    )
    runner = CliRunner()
    shown = runner.invoke(app, ["checkpoint", "show", str(ckpt)])
    assert shown.exit_code == 0, shown.output
    assert "step 2, epoch 0" in shown.output and "96 rows of epoch 0" in shown.output
    out = tmp_path / "plain" / "model.safetensors"
    done = runner.invoke(app, ["checkpoint", "unshard", str(ckpt), str(out)])
    assert done.exit_code == 0, done.output
    # Written table by table by our own writer; read by the safetensors library itself.
    plain = safetensors.torch.load_file(out)
    model = build_model(trainer.spec.model, tables=trainer.spec.tables(), num_dense=13)
    model.load_state_dict(plain)  # a plain, unsharded model
    expected = unsharded_state_dict(trainer)
    assert all(torch.equal(plain[k], v) for k, v in expected.items())
    missing = runner.invoke(app, ["checkpoint", "show", str(tmp_path)])
    assert missing.exit_code == 2 and "trainer_state.json" in missing.output
    snapshot = tmp_path / "run" / "checkpoint_manager_snapshot.json"
    snapshot.write_text("{}")
    for command in ("show", "verify"):
        result = runner.invoke(app, ["checkpoint", command, str(snapshot)])
        assert result.exit_code == 2, result.output
        assert "is not a checkpoint directory" in result.stderr
        assert "damaged" not in result.output.lower()
    run = runner.invoke(app, ["checkpoint", "verify", str(tmp_path / "run")])
    assert run.exit_code == 0, run.output
    assert f"using its newest intact checkpoint {ckpt}" in run.stderr


def _row(model, table: str, row: int) -> torch.Tensor:
    """Row ``row`` of ``table`` in an unsharded model: its weights, or an int8/int4 table's
    codes and scales."""
    if table in model.embedding_bags.weights:
        return model.embedding_bags.weights[table][row]
    rows = model.embedding_bags.quantized[table]
    return torch.cat([rows.codes[row].float(), rows.qparams[row].float()])


def _check_pruned(exported: Path, target: Path, batch) -> None:
    """An export cut to 40 rows of t_C10 (of 72) keeps its most recent ids with their rows and
    map entries; rows whose ids it kept predict as before, the others read the fallback."""
    full = load_model_checkpoint(exported).model
    spec = load_model_checkpoint(exported).spec
    with pytest.raises(ValueError, match="not a managed table"):
        prune_rules(spec, {"C3": 40})
    prune_model_dir(exported, target, prune_rules(spec, {"C10": 40}, "recent"))
    pruned = load_model_checkpoint(target).model
    old = full.embedding_bags.id_maps.t_C10.t()
    new = pruned.embedding_bags.id_maps.t_C10.t()
    assert new.shape == (4, 40)
    kept = new[0][new[0] >= 0]
    held = old[0] >= 0
    assert 0 < kept.numel() < int(held.sum())
    dropped = old[1][held & ~torch.isin(old[0], kept)]
    assert old[1][torch.isin(old[0], kept)].float().mean() > dropped.float().mean()  # recent
    for new_row in (new[0] >= 0).nonzero().flatten().tolist():
        old_row = int((old[0] == new[0][new_row]).nonzero())
        assert torch.equal(_row(pruned, "t_C10", new_row), _row(full, "t_C10", old_row))
    c10 = batch.all_sparse().select(["C10"]).values  # one id a sample
    same = torch.isin(c10, kept)
    assert 0 < int(same.sum()) < c10.numel()
    with torch.no_grad():
        # The same rows through the same arithmetic (a matmul's row depends on its own
        # inputs alone, whatever the other rows hold): exactly.
        assert torch.equal(pruned(batch)[same], full(batch)[same])


def _save_model_checkpoint(trainer: Trainer, path: Path) -> None:
    """A final checkpoint of ``trainer`` (its training state and model metadata) at ``path``."""
    save_training_state(
        path,
        parts=trainer.parts(),
        loop_state=trainer.state_dict(),
        position={"epoch": 0, "consumed": {}, "totals": {}},
    )
    save_model_metadata(path, spec=trainer.spec, plan=trainer.plan, metrics={})


def _check_delta(trainer: Trainer, base: Path, tmp_path: Path) -> None:
    """The delta of the model one step later over ``base`` holds only the changed rows (and
    map entries); applied to ``base`` it gives the later model, tensor for tensor."""
    later = tmp_path / "later-ckpt"
    _save_model_checkpoint(trainer, later)
    new = write_model_dir(later, tmp_path / "later")
    info = write_model_delta(new, base, tmp_path / "delta")
    if info["rows"]:  # row deltas of fp32/fp16 tables (int8 tables and their maps go whole)
        assert 0 < info["rows"]["t_C10"] < 72 and 0 < info["rows"]["t_C3"] < 1000
    applied = apply_model_delta(base, tmp_path / "delta", tmp_path / "applied")
    got, want = ModelWeights(applied), ModelWeights(new)
    assert [t.name for t in got.tensors] == [t.name for t in want.tensors]
    for t in want.tensors:
        assert torch.equal(got.load(t.name), want.load(t.name)), t.name
    with pytest.raises(ValueError, match="made over another model"):
        apply_model_delta(new, tmp_path / "delta", tmp_path / "wrong")


@pytest.mark.parametrize(
    ("types", "arch"),
    [
        ("row_wise", "dlrm"),
        ("table_wise+fp16", "wukong"),
        ("column_wise", "dhen"),
        ("row_wise^managed", "dlrm"),
        ("row_wise+int8^managed", "dlrm"),
    ],
)
def test_model_loads_mapped_from_training_state(
    data_dir: Path, tmp_path: Path, types: str, arch: str
) -> None:
    """The model of a final checkpoint (weights only in the training state's shards) rebuilt
    unsharded, its tables memory-mapped from model.safetensors in their precision, predicts as
    the sharded trainer does, as does its exported model.safetensors. For every architecture:
    what export and scoring load. Managed tables carry their id maps: eval ids the map never
    saw read their fallback rows in both, and are counted."""
    model = NEW_ARCHS.get(arch)
    trainer = _trainer(0, 1, str(data_dir), types, "rowwise_adagrad", seed=7, model=model)
    _steps(trainer, _global_batches(str(data_dir), trainer.spec)[:2], 1)
    ckpt = tmp_path / "ckpt"
    _save_model_checkpoint(trainer, ckpt)
    evaluation = Preprocessor(trainer.spec.data)(pq.read_table(Path(data_dir) / "eval"))
    batch = arrow_to_batch(evaluation.slice(0, 64), config=trainer.spec.data)
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(batch)
    maps = trainer.model.embedding_bags.id_maps()
    unknown = {name: m.stats()["unknown"] for name, m in maps.items()}
    assert not maps or unknown["t_C10"] > 0  # eval ids the two training steps did not see
    exported = tmp_path / "exported"
    write_model_weights(ckpt, exported / "model.safetensors")
    for name in ("spec.json", "plan.json"):
        (exported / name).write_bytes((ckpt / name).read_bytes())
    # As a release before the one row-cache key family wrote it (every key, set or not): a
    # stored spec is read without the keys since retired (loaded, scored, pruned).
    spec = json.loads((exported / "spec.json").read_text())
    spec["sharding"].update(ssd_cache_load_factor=0.2, ssd_cache_min_rows=65536)
    (exported / "spec.json").write_text(json.dumps(spec))
    dtype = torch.float16 if types.endswith("fp16") else torch.float32
    for directory in (ckpt, exported):
        model = load_model_checkpoint(directory).model
        dtypes = {w.dtype for w in model.embedding_bags.weights.values()}
        assert dtypes == (set() if "+int8" in types else {dtype})  # int8: codes, no weights
        with torch.no_grad():
            torch.testing.assert_close(model(batch), expected, **trained_tol(expected))
        assert model.embedding_bags.id_maps.unknown() == unknown
    if maps:
        _check_pruned(exported, tmp_path / "pruned", batch)
        _steps(trainer, _global_batches(str(data_dir), trainer.spec)[2:3], 1)
        _check_delta(trainer, exported, tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no model weights"):
        write_model_weights(tmp_path, tmp_path / "x.safetensors")


@pytest.mark.ray
def test_scoring_actors_count_the_ids_unknown_to_managed_tables(
    data_dir: Path, tmp_path: Path, ray_cluster
) -> None:
    """Ray scoring actors (raydlrm score / evaluate) add the lookups of ids a managed table's
    map never saw to one count per job, batch by batch: the in-process model's count over the
    same rows."""
    import ray

    from raydlrm.platform.export import score_table
    from raydlrm.platform.scorer import Scorer, UnknownIds, model_for_actors
    from raydlrm.platform.scoring import model_files

    trainer = _trainer(0, 1, str(data_dir), "row_wise^managed", "rowwise_adagrad", seed=7)
    _steps(trainer, _global_batches(str(data_dir), trainer.spec)[:2], 1)
    ckpt = tmp_path / "ckpt"
    _save_model_checkpoint(trainer, ckpt)
    exported = write_model_dir(ckpt, tmp_path / "model")
    rows = pq.read_table(Path(data_dir) / "eval")
    counter = ray.remote(num_cpus=0)(UnknownIds).remote()
    with model_files(str(exported)) as files:
        scorer = Scorer(model_for_actors(files), keep=[], unknown=counter)
        for part in (rows.slice(0, 100), rows.slice(100)):
            scorer(part)
    counted = ray.get(counter.total.remote())
    ray.kill(counter)
    loaded = load_model_checkpoint(exported)
    score_table(loaded.model, Preprocessor(loaded.spec.data), loaded.spec.data, rows)
    assert counted == loaded.model.embedding_bags.id_maps.unknown()
    assert counted.keys() == {"t_C2", "t_C10"} and counted["t_C10"] > 0


def test_damaged_checkpoints_are_found_named_and_passed_over(
    data_dir: Path, tmp_path: Path
) -> None:
    """A truncated shard or state file, or a rank's missing part, is named (verify, show, load:
    no bare EOFError); a resume takes the newest intact checkpoint: a complete one Ray never
    registered before the registered one, and the one before a damaged one."""
    import ray.train
    from typer.testing import CliRunner

    from raydlrm.platform.cli import app
    from raydlrm.trainers.checkpoints import (
        CheckpointDamagedError,
        CheckpointReader,
        newest_intact,
        verify_checkpoint,
    )

    trainer = _trainer(0, 1, str(data_dir), "table_wise", "rowwise_adagrad", seed=7)
    position = {"epoch": 0, "consumed": {}, "totals": {}}
    runs = tmp_path / "run"
    names = [f"checkpoint_2026-11-23_10-00-0{i}.000000" for i in range(3)]
    for name in names:
        save_training_state(
            runs / name, parts=trainer.parts(), loop_state=trainer.state_dict(), position=position
        )
    old, registered, unregistered = (runs / n for n in names)
    assert verify_checkpoint(old) == []
    shard = max(registered.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    problems = verify_checkpoint(registered)
    assert len(problems) == 1 and shard.name in problems[0] and "bytes" in problems[0]
    with pytest.raises(CheckpointDamagedError, match=rf"{registered}.*{shard.name}"):
        load_training_state(registered, parts=trainer.parts())
    runner = CliRunner()
    verified = runner.invoke(app, ["checkpoint", "verify", str(registered)])
    assert verified.exit_code == 1 and shard.name in verified.output
    assert runner.invoke(app, ["checkpoint", "verify", str(old)]).exit_code == 0
    assert "DAMAGED" in runner.invoke(app, ["checkpoint", "show", str(registered)]).output

    def pick(latest: Path) -> str | None:
        checkpoint = ray.train.Checkpoint(path=str(latest))
        intact = newest_intact(checkpoint)
        with intact as (directory, _):
            return directory

    # The newest complete one wins even though Ray registered an older (here damaged) one.
    assert pick(registered) == str(unregistered)
    (unregistered / "manifest.rank00000.json").unlink()  # rank 0's part never completed
    assert pick(registered) == str(old)  # and the damaged registered one is passed over
    (old / "trainer_state.json").write_text("{not json")
    with pytest.raises(RuntimeError, match="no intact checkpoint"):
        pick(registered)
    with pytest.raises(CheckpointDamagedError, match=r"trainer_state\.json is damaged"):
        load_training_state(old, parts=trainer.parts())
    # DCP's .metadata is a pickle: ours is read by an unpickler that builds DCP's metadata only.
    planted = tmp_path / "planted"
    save_training_state(
        planted, parts=trainer.parts(), loop_state=trainer.state_dict(), position=position
    )
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (planted / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match=r"may not refer to (posix|os)\.system"):
        CheckpointReader(str(planted)).read_metadata()
    assert not marker.exists()
