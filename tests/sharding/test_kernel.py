"""The PyTorch embedding kernel (``sharding.kernel = "torch"``) against fbgemm's TBE and against
a reference written with autograd; the PyTorch codecs and bag permutations against fbgemm's
operators; the kernel choice when fbgemm cannot be imported.

Sharded parity of the torch kernel for every sharding type, optimizer, fp16 and the SSD tier
is in ``test_sharding_types.py`` (its ``/torch`` scenarios).
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from raydlrm.sharding import kernel as kernel_module
from raydlrm.sharding._input_dist import permute_bags
from raydlrm.sharding.codecs import CODECS, codecs_for
from raydlrm.sharding.kernel import TableSpec, build_tbe
from raydlrm.sharding.torch_tbe import TorchTableBatchedEmbedding
from tests._tolerance import EPS16, assert_sums_close
from tests.sharding._fixtures import gather_full_tables, parity_tol

# Adagrad's eps = lr: an update's gain is at most 1, so the kernels' other summation orders
# stay rounding-sized even where a gradient cancels to near zero (tests/_tolerance.py).
LR, EPS, BATCH = 0.1, 0.1, 5
STEPS = 3
# Tables of two dims (the torch kernel looks up each run of equal dims as one matrix); t0 is
# read by two features.
TABLES = [TableSpec(50, 8), TableSpec(30, 8), TableSpec(20, 4), TableSpec(40, 8)]
FEATURE_TABLES = [0, 0, 1, 2, 3, 3]
TERMS = 2 * BATCH * 3
"""The most terms one value sums: a row of t0, read by two features, 3 ids a bag, 5 bags."""


def _close32(got: torch.Tensor, want: torch.Tensor, *, steps: int = STEPS) -> None:
    """The kernels sum a row's gradient in another order: each step carries the difference on
    (through the update, gain at most 1, and the next outputs) without amplifying it."""
    assert_sums_close(got, want, n_terms=TERMS, k=2 * steps)


def _close16(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp16 rows: a rounding-sized difference can round an updated row to the neighbouring
    fp16 value, one spacing (EPS16 at 1) at the largest value, once a step."""
    atol = STEPS * EPS16 * float(want.abs().max())
    torch.testing.assert_close(got, want, atol=atol, rtol=0.0)


def _batch(gen: torch.Generator, feature_tables: list[int], tables: list[TableSpec]):
    """Ids (with repeats and empty bags), feature-major offsets, per-id weights."""
    lengths = torch.randint(0, 4, (len(feature_tables) * BATCH,), generator=gen)
    ids = torch.cat(
        [
            torch.randint(0, tables[feature_tables[i // BATCH]].rows, (int(n),), generator=gen)
            for i, n in enumerate(lengths)
        ]
    )
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return ids, offsets, torch.rand(ids.numel(), generator=gen)


def _build(kernel: str, *, optimizer: str, pooling: str, precision: str, **kwargs):
    return build_tbe(
        kernel,
        tables=kwargs.get("tables", TABLES),
        feature_table_map=kwargs.get("feature_tables", FEATURE_TABLES),
        optimizer=optimizer,
        learning_rate=LR,
        eps=EPS,
        pooling=pooling,
        precision=precision,
        device=torch.device(kwargs.get("device", "cpu")),
    )


def _train(tbe, steps: int, *, weighted: bool, feature_tables=FEATURE_TABLES, tables=TABLES):
    """Outputs of ``steps`` seeded steps (each backward applies the fused update)."""
    gen = torch.Generator().manual_seed(1)
    outputs = []
    for _ in range(steps):
        ids, offsets, weights = _batch(gen, feature_tables, tables)
        out = tbe(ids, offsets, per_sample_weights=weights if weighted else None)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        outputs.append(out.detach())
    return outputs


CASES = [
    (opt, pooling, precision, weighted)
    for opt, pooling, precision, weighted in itertools.product(
        ["rowwise_adagrad", "adagrad", "sgd"], ["sum", "mean"], ["fp32", "fp16"], [False, True]
    )
    # fbgemm's CPU backward of weighted *mean* bags leaves out the 1/length its forward applies
    # (measured with fbgemm-gpu-cpu 1.8.0); the torch kernel follows the forward, see
    # test_weighted_mean_and_any_feature_order_match_autograd.
    if not (weighted and pooling == "mean")
]


@pytest.mark.parametrize(("optimizer", "pooling", "precision", "weighted"), CASES)
def test_torch_kernel_matches_fbgemm(optimizer, pooling, precision, weighted) -> None:
    tbes = [
        _build(k, optimizer=optimizer, pooling=pooling, precision=precision)
        for k in ("fbgemm", "torch")
    ]
    assert isinstance(tbes[1], TorchTableBatchedEmbedding)
    dtype = torch.float16 if precision == "fp16" else torch.float32
    init = [
        torch.randn(t.rows, t.dim, generator=torch.Generator().manual_seed(i))
        for i, t in enumerate(TABLES)
    ]
    for tbe in tbes:
        for weight, values in zip(tbe.split_embedding_weights(), init, strict=True):
            assert weight.dtype == dtype
            weight.copy_(values)
    fb, th = (_train(tbe, STEPS, weighted=weighted) for tbe in tbes)
    close = _close16 if precision == "fp16" else _close32
    for a, b in zip(fb, th, strict=True):
        assert b.dtype == torch.float32
        close(b, a)
    for a, b in zip(*(t.split_embedding_weights() for t in tbes), strict=True):
        close(b.float(), a.float())
    states = [t.split_optimizer_states() for t in tbes]
    assert [len(s) for s in states[1]] == [len(s) for s in states[0]]
    for a, b in zip(*states, strict=True):
        assert a[0].shape == b[0].shape
        _close32(b[0], a[0])  # the gradients do not depend on the rows (a linear loss)


@pytest.mark.parametrize("kernel", ["fbgemm", "torch"])
def test_a_batch_of_no_samples(kernel: str) -> None:
    """B = 0 (offsets of one entry): a (0, dims) output and a backward that changes nothing."""
    tbe = _build(kernel, optimizer="rowwise_adagrad", pooling="mean", precision="fp32")
    before = [w.clone() for w in tbe.split_embedding_weights()]
    out = tbe(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert out.shape == (0, sum(TABLES[t].dim for t in FEATURE_TABLES))
    out.sum().backward()
    for a, b in zip(before, tbe.split_embedding_weights(), strict=True):
        assert torch.equal(a, b)


def _reference_step(weights, grads, states, optimizer: str) -> None:
    for w, g, m in zip(weights, grads, states, strict=True):
        if optimizer == "sgd":
            w -= LR * g
        elif optimizer == "adagrad":
            m += g * g
            w -= LR * g / (m.sqrt() + EPS)
        else:
            m += (g * g).mean(dim=1)
            w -= LR * g / (m.sqrt() + EPS)[:, None]


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad", "sgd"])
def test_weighted_mean_and_any_feature_order_match_autograd(optimizer: str) -> None:
    """Features in any order (a table read by features far apart), weighted mean bags: the
    kernel equals autograd's gradient summed over repeated ids, then one update per row."""
    feature_tables = [2, 0, 1, 0, 3, 2]
    tbe = _build(
        "torch",
        optimizer=optimizer,
        pooling="mean",
        precision="fp32",
        feature_tables=feature_tables,
    )
    ref = [w.clone().requires_grad_() for w in tbe.split_embedding_weights()]
    for w in tbe.split_embedding_weights():
        w.normal_(generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for r, w in zip(ref, tbe.split_embedding_weights(), strict=True):
            r.copy_(w)
    states = [
        torch.zeros(t.rows) if optimizer == "rowwise_adagrad" else torch.zeros(t.rows, t.dim)
        for t in TABLES
    ]
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids, offsets, weights = _batch(gen, feature_tables, TABLES)
        got = tbe(ids, offsets, per_sample_weights=weights)
        pooled = []
        for f, t in enumerate(feature_tables):
            lo, hi = int(offsets[f * BATCH]), int(offsets[(f + 1) * BATCH])
            bag_offsets = offsets[f * BATCH : (f + 1) * BATCH + 1] - lo
            sums = F.embedding_bag(
                ids[lo:hi],
                ref[t],
                bag_offsets,
                mode="sum",
                per_sample_weights=weights[lo:hi],
                include_last_offset=True,
            )
            pooled.append(sums / bag_offsets.diff().clamp(min=1).unsqueeze(1))
        want = torch.cat(pooled, dim=1)
        _close32(got, want.detach())
        scale = torch.linspace(-1, 1, got.numel()).view(got.shape)
        (got * scale).sum().backward()
        (want * scale).sum().backward()
        with torch.no_grad():
            _reference_step(ref, [r.grad for r in ref], states, optimizer)
        for r in ref:
            r.grad = None
    for r, w in zip(ref, tbe.split_embedding_weights(), strict=True):
        _close32(w, r.detach())
    if optimizer != "sgd":
        for m, (s,) in zip(states, tbe.split_optimizer_states(), strict=True):
            _close32(s, m)


def test_preallocated_buffers_are_the_storage() -> None:
    numel = sum(t.rows * t.dim for t in TABLES)
    weights, momentum = torch.zeros(numel), torch.zeros(numel)
    tbe = TorchTableBatchedEmbedding(
        tables=TABLES,
        feature_table_map=FEATURE_TABLES,
        optimizer="adagrad",
        learning_rate=LR,
        eps=EPS,
        pooling="sum",
        buffers={"weights": weights, "momentum1": momentum},
    )
    weights.normal_()
    _train(tbe, 1, weighted=False)
    assert tbe.split_embedding_weights()[0].data_ptr() == weights.data_ptr()
    assert momentum.abs().sum() > 0  # the update wrote Adagrad's state into the given buffer
    with pytest.raises(ValueError, match="preallocated buffer 'weights'"):
        TorchTableBatchedEmbedding(
            tables=TABLES,
            feature_table_map=FEATURE_TABLES,
            optimizer="sgd",
            learning_rate=LR,
            eps=EPS,
            pooling="sum",
            buffers={"weights": torch.zeros(numel - 1)},
        )


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_torch_codecs_give_fbgemm_bytes_and_values(precision: str) -> None:
    block = torch.randn(64, 20, generator=torch.Generator().manual_seed(0))
    block *= torch.logspace(-4, 2, 20)  # values spanning HFP8's subnormal and normal ranges
    mine, theirs = CODECS[precision], codecs_for("fbgemm")[precision]
    assert mine is not theirs
    payload = mine.encode(block)
    assert torch.equal(payload, theirs.encode(block))
    rows, cols = block.shape
    decoded = mine.decode(payload, rows=rows, cols=cols, dtype=torch.float32)
    assert torch.equal(decoded, theirs.decode(payload, rows=rows, cols=cols, dtype=torch.float32))


def test_permute_bags_matches_fbgemm() -> None:
    from raydlrm._versions import import_fbgemm

    import_fbgemm()
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (12,), generator=gen)
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen)
    order = torch.randperm(12, generator=gen)
    want = torch.ops.fbgemm.permute_1D_sparse_data(
        order.int(), lengths, values, weights, values.numel()
    )
    got = permute_bags(order, lengths, values, weights, num_values=values.numel())
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # Repeated features (2-D: features x batch), as the input distribution sends them.
    features = torch.tensor([2, 0, 2, 1], dtype=torch.int32)
    want = torch.ops.fbgemm.permute_2D_sparse_data(
        features, lengths.view(3, 4), values, weights, None
    )
    bags = (features.long().unsqueeze(1) * 4 + torch.arange(4)).reshape(-1)
    got = permute_bags(bags, lengths, values, None)
    assert torch.equal(got[0].view(4, 4), want[0]) and torch.equal(got[1], want[1])
    assert got[2] is None


def test_auto_falls_back_to_torch_with_one_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(kernel_module, "fbgemm_problem", lambda: "fbgemm-gpu is not installed")
    kernel_module._warn_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="raydlrm.sharding.kernel"):
        assert kernel_module.resolve_kernel("auto") == "torch"
        assert kernel_module.resolve_kernel("auto") == "torch"
    lines = [r.getMessage() for r in caplog.records if r.name == "raydlrm.sharding.kernel"]
    assert lines == ["sharding.kernel 'auto': using the torch kernel (fbgemm-gpu is not installed)"]
    assert kernel_module.resolve_kernel("torch") == "torch"
    monkeypatch.undo()
    assert kernel_module.resolve_kernel("auto") == "fbgemm"  # installed and matching here


def test_without_fbgemm_the_collection_trains_on_the_torch_kernel(no_fbgemm_path) -> None:
    """In a process where fbgemm cannot be imported: ``auto`` warns and trains with torch,
    ``fbgemm`` is an ImportError saying why."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        from raydlrm.sharding import ShardingConfig, plan_sharding, shard_model
        from raydlrm.sharding.kernel import resolve_kernel
        from tests.sharding._fixtures import TinyModel, make_tables

        tables = make_tables()
        config = ShardingConfig(default_type="row_wise", comm_precision="int8")
        plan = plan_sharding(tables, world_size=1, config=config)
        model = shard_model(TinyModel(tables), plan=plan, config=config, device="cpu")
        assert model.embedding_bags.kernel == "torch"
        assert "fbgemm_gpu" not in sys.modules or sys.modules["fbgemm_gpu"] is None
        try:
            resolve_kernel("fbgemm")
        except ImportError as e:
            print("fbgemm refused:", e)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([no_fbgemm_path, os.getcwd()])}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "using the torch kernel (fbgemm_gpu made unimportable)" in done.stderr
    assert "fbgemm refused: fbgemm_gpu made unimportable" in done.stdout


def _empty_rank_worker(rank: int, world_size: int) -> dict:
    """Rank 1 has no samples (a rank that ran dry steps with an empty batch)."""
    from raydlrm.sharding import ShardingConfig, plan_sharding, shard_model
    from tests.sharding._fixtures import TinyModel, make_tables
    from tests.sharding.test_embedding import _train

    out = {}
    mixed = {"t0": "data_parallel", "t1": "row_wise", "t2": "column_wise"}
    for name, pinned in (("table_wise", {}), ("mixed", mixed)):
        for kernel in ("fbgemm", "torch"):
            tables = make_tables()
            config = ShardingConfig(
                pinned_types=pinned, kernel=kernel, learning_rate=LR, eps=EPS, comm_precision="fp8"
            )
            plan = plan_sharding(tables, world_size=world_size, config=config)
            model = shard_model(TinyModel(tables), plan=plan, config=config, device="cpu")
            rows = slice(0, 13) if rank == 0 else slice(13, 13)
            record = _train(model, weighted=False, rows=rows, tables=tables)
            record["tables"] = gather_full_tables(model.embedding_bags, dst=0)
            out[name, kernel] = record
    return out


@pytest.mark.distributed
def test_a_rank_without_samples_on_both_kernels() -> None:
    from tests._multiprocess import run_distributed

    results = run_distributed(_empty_rank_worker, world_size=2)
    for name in ("table_wise", "mixed"):
        for rank, per_rank in enumerate(results):
            fb, th = per_rank[name, "fbgemm"], per_rank[name, "torch"]
            assert th["pooled"][0].shape[0] == (13 if rank == 0 else 0)
            got, want = th["pooled"] + th["pooled_grad"], fb["pooled"] + fb["pooled_grad"]
            for a, b in zip(want, got, strict=True):
                torch.testing.assert_close(b, a, **parity_tol())
        fb, th = results[0][name, "fbgemm"]["tables"], results[0][name, "torch"]["tables"]
        for table in fb:
            torch.testing.assert_close(th[table], fb[table], **parity_tol(), msg=f"{name} {table}")


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad", "sgd"])
def test_torch_kernel_on_cuda_matches_cpu(optimizer: str) -> None:
    """The torch kernel on a GPU: the CPU kernel's outputs, rows and state (float rounding)."""
    cpu, cuda = (
        _build("torch", optimizer=optimizer, pooling="mean", precision="fp32", device=device)
        for device in ("cpu", "cuda")
    )
    for a, b in zip(cpu.split_embedding_weights(), cuda.split_embedding_weights(), strict=True):
        a.normal_(generator=torch.Generator().manual_seed(0))
        b.copy_(a)
    gen_cpu, gen_cuda = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(3):
        outs = []
        for tbe, gen in ((cpu, gen_cpu), (cuda, gen_cuda)):
            ids, offsets, weights = _batch(gen, FEATURE_TABLES, TABLES)
            device = tbe.weights.device
            out = tbe(ids.to(device), offsets.to(device), weights.to(device))
            (
                out * torch.linspace(-1, 1, out.numel(), device=device).view(out.shape)
            ).sum().backward()
            outs.append(out.detach().cpu())
        _close32(outs[1], outs[0])
    for a, b in zip(cpu.split_embedding_weights(), cuda.split_embedding_weights(), strict=True):
        _close32(b.cpu(), a)
    for a, b in zip(cpu.split_optimizer_states(), cuda.split_optimizer_states(), strict=True):
        _close32(b[0].cpu(), a[0])
