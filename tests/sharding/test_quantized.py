"""int8 / int4 tables: the row-wise quantization, its stochastic rounding, and training through
the fp32 cache (the sharded parity of every type is in ``test_sharding_types``; checkpoints in
``tests/trainers/test_checkpoint``)."""

from __future__ import annotations

import logging

import pytest
import torch

from raydlrm.batch import KeyedJaggedTensor
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.models.quantized import code_bytes_per_row, dequantize_rows, quantize_rows
from raydlrm.sharding import ShardedEmbeddingBagCollection, ShardingConfig, plan_sharding
from raydlrm.sharding.quantized import QuantizedRows, rounding_noise, table_key
from raydlrm.sharding.sizes import table_memory_bytes
from raydlrm.sharding.tiers import TierError

LEVELS = {"int8": 255, "int4": 15}


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_round_trip_errors_are_within_their_bounds(precision: str) -> None:
    """Nearest: at most half a step; stochastic: below one step; a constant row and a row of
    large values come back; codes and scales have their stated sizes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, 16, generator=gen) * torch.logspace(-3, 2, 500).unsqueeze(1)
    x[0] = 0.25  # constant
    codes, params = quantize_rows(x, precision=precision)
    assert codes.dtype == torch.uint8 and codes.shape == (500, code_bytes_per_row(16, precision))
    assert params.dtype == torch.float16 and params.shape == (500, 2)
    step = params[:, 0].float().unsqueeze(1)
    err = (dequantize_rows(codes, params, precision=precision) - x).abs()
    assert bool((err <= step * 0.5 * (1 + 1e-4)).all())
    assert torch.equal(dequantize_rows(codes[:1], params[:1], precision=precision), x[:1])
    # Every value of a row lies in [bias, bias + L * scale]: nothing clips.
    lo, hi = torch.aminmax(x, dim=1)
    assert bool((params[:, 1].float() <= lo).all())
    assert bool((params[:, 1].float() + LEVELS[precision] * step.squeeze(1) >= hi).all())
    noise = rounding_noise(x, key=table_key(0, "t"), rows=torch.arange(500), col_start=0)
    codes, params = quantize_rows(x, precision=precision, noise=noise)
    err = (dequantize_rows(codes, params, precision=precision) - x).abs()
    assert bool((err < params[:, 0].float().unsqueeze(1) * (1 + 1e-4)).all())
    with pytest.raises(ValueError, match="int4 rows pack two codes per byte; dim 5 is odd"):
        code_bytes_per_row(5, "int4")


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased(precision: str) -> None:
    """A value ``f`` of the way between two codes rounds up with probability ``f``: over 40000
    rows (each its own noise) the mean code is within 5 standard deviations of ``k + f``."""
    levels, n = LEVELS[precision], 40000
    scale = 2.0**-6
    for f in (0.1, 0.5, 0.83):
        x = torch.tensor([0.0, levels * scale, (3 + f) * scale, 0.0]).repeat(n, 1)
        noise = rounding_noise(x, key=table_key(1, "t"), rows=torch.arange(n), col_start=0)
        codes, params = quantize_rows(x, precision=precision, noise=noise)
        assert bool((params[:, 0] == scale).all()) and bool((params[:, 1] == 0).all())
        got = dequantize_rows(codes, params, precision=precision)[:, 2] / scale
        assert set(got.unique().tolist()) <= {3.0, 4.0}
        bound = 5 * (f * (1 - f) / n) ** 0.5
        assert abs(got.mean().item() - (3 + f)) < bound, (precision, f)


def test_rounding_depends_on_global_row_and_column_not_on_the_shard() -> None:
    """A shard starting at row 10, column 4 rounds its rows as the whole table does."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(30, 8, generator=gen)
    shard = QuantizedRows(
        torch.zeros(20, 4, dtype=torch.uint8),
        torch.zeros(20, 2, dtype=torch.float16),
        precision="int8",
        dim=4,
        key=table_key(5, "t"),
        row_start=10,
        col_start=4,
    )
    shard[torch.arange(20)] = values[10:, 4:]
    u_whole = rounding_noise(values, key=table_key(5, "t"), rows=torch.arange(30), col_start=0)
    u_shard = rounding_noise(
        values[10:, 4:], key=table_key(5, "t"), rows=torch.arange(10, 30), col_start=4
    )
    assert torch.equal(u_whole[10:, 4:], u_shard)
    codes, params = quantize_rows(values[10:, 4:], precision="int8", noise=u_whole[10:, 4:])
    assert torch.equal(shard.codes, codes) and torch.equal(shard.params, params)
    assert not torch.equal(u_whole[:, :4], u_whole[:, 4:])  # columns draw their own
    assert not torch.equal(
        u_whole, rounding_noise(values, key=table_key(6, "t"), rows=torch.arange(30), col_start=0)
    )


TABLES = [
    EmbeddingBagConfig(name="big", num_embeddings=400, embedding_dim=16, feature_names=("a", "b")),
    EmbeddingBagConfig(name="small", num_embeddings=60, embedding_dim=8, feature_names=("c",)),
]


def _batches(steps: int, *, batch: int = 32, seed: int = 0) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 3, (3 * batch,), generator=gen)
        per_key = lengths.view(3, batch).sum(1).tolist()
        # skewed ids: most lookups hit a few hot rows, as real ids do
        values = torch.cat(
            [
                (torch.rand(n, generator=gen) ** 3 * rows).long()
                for n, rows in zip(per_key, (400, 400, 60), strict=True)
            ]
        )
        out.append(KeyedJaggedTensor.from_lengths(["a", "b", "c"], values, lengths))
    return out


def _collection(
    precision: str,
    *,
    factor: float = 0.25,
    kernel: str = "torch",
    device: str = "cpu",
    planned: dict | None = None,
    **kw,
):
    config = ShardingConfig(
        weights_precision=precision,
        cache_load_factor=factor,
        cache_load_factor_per_table={"small": 1.0},
        kernel=kernel,
        learning_rate=0.05,
        **kw,
    )
    plan = plan_sharding(TABLES, world_size=1, config=config, **(planned or {}))
    return ShardedEmbeddingBagCollection(
        EmbeddingBagCollection(TABLES, device="meta", seed=11),
        plan=plan,
        config=config,
        device=device,
    )


def _train(collection, batches) -> list[torch.Tensor]:
    outs = []
    device = next(iter(collection.tbes[0].split_embedding_weights())).device
    for kjt in batches:
        values = collection(kjt.to(device)).values
        (values**2).sum().backward()
        outs.append(values.detach())
    return outs


@pytest.mark.parametrize("kernel", ["torch", "fbgemm"])
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_a_cache_of_every_row_trains_bit_identically_to_fp32(precision: str, kernel: str) -> None:
    """With every row in the cache nothing is quantized while training: each step's output
    equals an fp32 table's started from the same (dequantized) rows, bit for bit; flushing
    then quantizes the trained rows."""
    quantized = _collection(precision, factor=1.0, kernel=kernel)
    fp32 = _collection("fp32", kernel=kernel)
    start = {n: w.dequantize() for n, w in quantized.local_tables().items()}
    with torch.no_grad():
        for name, weight in fp32.local_tables().items():
            weight.copy_(start[name])
    batches = _batches(6)
    for got, want in zip(_train(quantized, batches), _train(fp32, batches), strict=True):
        assert torch.equal(got, want)
    hits, lookups = quantized.cache_hit_rates()["big"]
    assert 0 < hits < lookups
    trained = fp32.local_tables()["big"]
    flushed = quantized.local_tables()["big"]
    assert isinstance(flushed, QuantizedRows)
    step = flushed.params[:, 0].float().unsqueeze(1)
    assert bool(((flushed.dequantize() - trained).abs() < step * 1.0001).all())


def test_a_small_cache_evicts_quantizes_and_still_trains() -> None:
    """A cache of a quarter of the rows evicts (the rows written back quantized, read back
    dequantized): the outputs stay near fp32's (a few quantization steps), training lowers the
    loss as fp32's does, and evaluating (no autograd) re-rounds nothing."""
    batches = _batches(40)
    quantized, fp32 = _collection("int8", factor=0.25), _collection("fp32")
    with torch.no_grad():
        start = {n: w.dequantize() for n, w in quantized.local_tables().items()}
        for name, weight in fp32.local_tables().items():
            weight.copy_(start[name])
    got, want = _train(quantized, batches), _train(fp32, batches)
    hits, lookups = quantized.cache_hit_rates()["big"]
    assert hits < lookups  # rows were evicted and read back
    first, last = (float((o**2).sum()) for o in (got[0], got[-1]))
    assert last < 0.5 * first
    torch.testing.assert_close(got[-1], want[-1], atol=5e-3, rtol=0.05)
    assert not torch.equal(got[-1], want[-1])  # quantized on the way
    rows = quantized.local_tables()["big"]
    before = (rows.codes.clone(), rows.params.clone())
    quantized.eval()  # an evaluation: the module's mode says so, not autograd's
    with torch.no_grad():
        for kjt in _batches(20, seed=1):  # evaluation batches: other rows, evictions
            quantized(kjt)
    after = quantized.local_tables()["big"]
    assert torch.equal(after.codes, before[0]) and torch.equal(after.params, before[1])


def test_a_step_beyond_the_cache_names_the_table_and_the_setting() -> None:
    collection = _collection("int8", factor=0.01)  # 4 slots of 'big'
    kjt = KeyedJaggedTensor.from_lengths(
        ["a", "b", "c"], torch.arange(12), torch.tensor([6, 5, 1] + [0] * 0)
    )
    with pytest.raises(
        TierError,
        match=r"table 'big': a step looks up 11 distinct rows .* holds 4 .*"
        r"data\.sparse_specs\.<column>\.max_length, or raise sharding\.cache_load_factor",
    ):
        collection(kjt)


def test_a_cache_planned_for_the_steps_ids_holds_every_step() -> None:
    """The planner sizes a quantized table's cache for the most rows a step can look up (the
    global batch times the most ids a sample looks up in it: ``step_rows``), however small
    ``cache_load_factor`` is: the quickstart's int8 tables once stopped mid-run with a step of
    2,593 distinct rows against 2,500 slots. Steps of up to that many ids train."""
    planned = {"batch_size": 32, "max_bag_sizes": {"big": 4, "small": 2}}
    collection = _collection("int8", factor=0.01, planned=planned)  # 4 slots by the factor
    assert collection.plan.table("big").step_rows == 32 * 4
    batches = _batches(10)  # each feature's list: up to 2 ids; 'a' and 'b' share 'big'
    outputs = _train(collection, batches)
    assert all(bool(torch.isfinite(o).all()) for o in outputs)
    _, lookups = collection.cache_hit_rates()["big"]
    assert lookups > 4 * 10  # more distinct rows a step than the factor's 4 slots


def test_planner_counts_quantized_rows_and_warns_of_a_small_cache(caplog) -> None:
    """Memory: codes, scales, row-wise state and the cache; the planner warns when uniform ids
    would need more slots than the cache has, naming the table and the key."""
    table = EmbeddingBagConfig(
        name="t", num_embeddings=10**6, embedding_dim=64, feature_names=("a",)
    )
    fp32 = table_memory_bytes(table, optimizer="rowwise_adagrad")
    int8 = table_memory_bytes(
        table, optimizer="rowwise_adagrad", weights_precision="int8", cache_rows=50_000
    )
    int4 = table_memory_bytes(
        table, optimizer="rowwise_adagrad", weights_precision="int4", cache_rows=10_000
    )
    assert fp32 == 10**6 * (64 * 4 + 4)
    assert int8 == 10**6 * (64 + 4 + 4) + 50_000 * (64 * 4 + 4 + 33)
    assert fp32 / int8 > 3 and fp32 / int4 > 6
    with caplog.at_level(logging.WARNING, logger="raydlrm.sharding.planner"):
        plan_sharding(
            [table],
            world_size=1,
            config=ShardingConfig(weights_precision="int4", cache_load_factor=0.001),
            batch_size=4096,
        )
    assert "quantized or host tables ['t']: a step may look up more distinct rows" in caplog.text
    assert "(table t: about 4087 of a 1000000-row shard, 1000 slots)" in caplog.text
    with pytest.raises(ValueError, match="cache_load_factor_per_table names unknown tables"):
        plan_sharding(
            [table], world_size=1, config=ShardingConfig(cache_load_factor_per_table={"x": 0.1})
        )
    with pytest.raises(ValueError, match=r"sharding\.cache_load_factor must be in"):
        ShardingConfig(cache_load_factor=-0.1)


def test_int8_rows_on_ssd_train_as_in_dram(tmp_path) -> None:
    """int8 rows in a mapped file behind the fp32 cache train bit for bit as in DRAM (the same
    evictions, the same rounding), and the file holds the codes."""
    batches = _batches(12)
    dram = _collection("int8", factor=0.25)
    ssd = _collection("int8", factor=0.25, placement={"big": "ssd"}, ssd_path=str(tmp_path))
    for got, want in zip(_train(ssd, batches), _train(dram, batches), strict=True):
        assert torch.equal(got, want)
    a, b = ssd.local_tables()["big"], dram.local_tables()["big"]
    assert torch.equal(a.codes, b.codes) and torch.equal(a.params, b.params)
    maps = open("/proc/self/maps").read()  # noqa: SIM115
    assert "raydlrm-ssd-" in maps
    assert ssd.memory_bytes() < dram.memory_bytes()  # the codes are in the file


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_tables_on_cuda_train_as_on_cpu(precision: str) -> None:
    """On a GPU (torch kernel) the quantized rows, the cache and its bookkeeping live on the
    device and round as on the CPU: the same values get the same noise, codes and scales, bit
    for bit. Trained, the GPU's sums round otherwise (another order), and the stochastic
    rounding hashes a value's bits, so a row written back after such a difference draws other
    roundings: the table then differs from the CPU's no more than a CPU run whose draws all
    differ (another rounding key) does, and the cache hits the same rows."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 16, generator=gen) * torch.logspace(-3, 2, 300).unsqueeze(1)
    ids, key = torch.arange(300) + 7, table_key(2, "t")
    noise = rounding_noise(x, key=key, rows=ids, col_start=4)
    on_gpu = rounding_noise(x.cuda(), key=key, rows=ids.cuda(), col_start=4)
    assert torch.equal(on_gpu.cpu(), noise)
    cpu_rows = quantize_rows(x, precision=precision, noise=noise)
    gpu_rows = quantize_rows(x.cuda(), precision=precision, noise=on_gpu)
    for got, want in zip(gpu_rows, cpu_rows, strict=True):
        assert torch.equal(got.cpu(), want)

    batches = _batches(12)
    cpu, cuda, redrawn = (_collection(precision, device=d) for d in ("cpu", "cuda", "cpu"))
    for rows in redrawn.local_tables().values():
        if isinstance(rows, QuantizedRows):
            rows.key ^= 0x5A5A5A5A
    want = _train(cpu, batches)
    _train(redrawn, batches)
    for got, expected in zip(_train(cuda, batches), want, strict=True):
        torch.testing.assert_close(got.cpu(), expected, atol=0.05, rtol=0.05)
    assert cuda.local_tables()["big"].codes.device.type == "cuda"

    def steps_apart(other) -> tuple[float, float]:
        """Mean and 99th percentile of the differences of table ``big`` from the CPU run's, in
        its steps (not the largest: a few values, whose rows' row-wise Adagrad steps part ways,
        go 5 to 15 steps apart with other draws on the CPU, differently for each key)."""
        a, b = other.local_tables()["big"], cpu.local_tables()["big"]
        d = (a.dequantize().cpu() - b.dequantize()).abs() / b.params[:, 0].float().unsqueeze(1)
        return d.mean().item(), d.flatten().quantile(0.99).item()

    (mean, q99), (ref_mean, ref_q99) = steps_apart(cuda), steps_apart(redrawn)
    assert ref_mean > 0 and mean <= 1.5 * ref_mean and q99 <= 1.5 * ref_q99 + 0.5, (
        f"GPU: mean {mean:.3f}, 99th percentile {q99:.2f} steps from the CPU run; "
        f"other draws on the CPU: mean {ref_mean:.3f}, 99th percentile {ref_q99:.2f}"
    )
    assert cuda.cache_hit_rates()["big"] == cpu.cache_hit_rates()["big"]


def test_the_config_names_the_quantized_precisions_the_format_has() -> None:
    """``sharding.config`` (torch-free) lists the precisions the row format defines."""
    import typing

    from raydlrm.models.quantized import QUANTIZED_BITS
    from raydlrm.sharding.config import QUANTIZED, WeightsPrecision

    assert set(QUANTIZED) == set(QUANTIZED_BITS)
    assert set(QUANTIZED) <= set(typing.get_args(WeightsPrecision))


def test_the_modules_mode_not_autograd_says_what_a_lookup_trains() -> None:
    """An evaluation with autograd on (eval mode, gradients not disabled) writes nothing back
    and flags no row for a differential checkpoint; a training lookup under ``no_grad`` (a
    step that updates rows itself) does. Both were once inferred from autograd."""
    quantized = _collection("int8", factor=0.25)
    quantized.track_modified_rows()
    rows = quantized.local_tables()["big"]
    before = (rows.codes.clone(), rows.params.clone())
    quantized.eval()
    for kjt in _batches(20, seed=1):  # evictions: a dirty slot would be written back
        quantized(kjt)
    after = quantized.local_tables()["big"]
    assert torch.equal(after.codes, before[0]) and torch.equal(after.params, before[1])
    assert all(not len(ids) for ids in quantized.modified_rows().values())
    quantized.train()
    with torch.no_grad():
        quantized(_batches(1, seed=2)[0])
    assert any(len(ids) for ids in quantized.modified_rows().values())
