"""Managed ids (issue 48): speed of the id -> row map, and of the training step with managed
tables against hashed tables at the same table sizes. Side by side in one run: the variants of
each part are interleaved (rotated order per repeat) and the figures are medians over repeats.

**Part 1, the map on one CPU core** (``torch.set_num_threads(1)``, in this process):
:class:`raydlrm.models.managed_ids.IdMap` over a whole table of ``--map-rows`` rows (default
policy: LRU, probe window 128, 240 buckets), first filled to load 0.5 with distinct random ids
(in batches of ``--map-batch``; the fill's rate is reported once). Its state (and the
reference's keys) is then snapshotted and restored before every timed call, so every call
sees load 0.5 exactly. One call = one ``IdMap.assign`` of ``--map-batch`` ids:

- ``lookup``: all ids known, drawn uniformly (with repeats) from the held ids, ``training=True``
  (the training path: records each row's last step and count);
- ``lookup_eval``: the same batch, ``training=False`` (evaluation and scoring);
- ``mixed``: 90% known (as ``lookup``) and 10% new distinct ids, shuffled; the new ones are
  admitted and placed (``admit_after = 1``); at load 0.5 a 128-slot window is never full, so
  nothing is evicted;
- ``insert_empty``: ``--map-batch`` new distinct ids into the empty map.

The reference (``probe_*``) is a plain vectorized linear probe (:class:`LinearProbe`, ~20 lines:
a power-of-two array of ids, the same splitmix64 hash, every unresolved id advances one slot per
round, empty slots claimed by ``index_put_`` and re-read to find the race's winner) with the
same ids, the same load and the same restore: ``probe_lookup``, ``probe_mixed`` and
``probe_insert_empty``. It has no buckets, no recency or counts, no admission, no eviction.

**Part 2, the training step on 2 CPU gloo workers** (spawned with ``torch.multiprocessing``,
one intra-op thread each, 2 cores): the Criteo-shaped synthetic data
(:func:`raydlrm.ingestion.generate_synthetic`, 26 sparse columns of which 4 are id lists,
written once under ``--data``), the tests' Trainer setup (``tests/trainers/test_checkpoint.py``:
``Trainer(spec, plan=plan_sharding(...), rank, device="cpu")`` and ``train_step`` on
preprocessed batches) scaled up: DLRM, ``--dim`` embedding dim, rowwise Adagrad, the default
table-wise plan, global batch ``--global-batch``, every table of ``--table-rows`` rows; each
size its own variants (default 32,768 rows: the 3 columns with most ids, C15, C25, C22, have
1.24x, 1.34x and 1.50x more distinct ids than rows over the default run's 378,880 rows, so
their managed tables fill and evict (LRU); 131,072 rows: no table passes load 0.38). Variants,
each its own Trainer in the same processes, trained on the same batches in the same order:

- ``hashed``: every column hashed into its table (the default);
- ``managed4``: the 4 columns with the most distinct ids (C10, C15, C22, C25: 18k-49k ids over
  the default run) managed (``data.managed_ids.<column>`` = the default policy), the rest hashed;
- ``managed_all``: all 26 columns managed.

After ``--warmup`` steps of each, ``--repeats`` rounds; each round runs a block of ``--steps``
fresh batches (never seen before by any variant) on every variant in rotated order; a block's
time (barrier to barrier, rank 0's clock) / steps is one sample (after each, outside the time,
the managed tables' load and evictions are recorded). Then one more block per
variant with timers wrapped around the managed path's functions (:func:`_instrument`: the
share of the step in ``ManagedShards.rows``, in ``IdMap.assign`` and its parts, in resetting
rows, and in the input all-to-all's routing ``route_rows``). ``--profile`` adds a
``torch.profiler`` table of ``managed4``'s step (the first table size) on rank 0.

    .venv/bin/python benchmarks/managed_ids.py --out /tmp/bench/managed_ids.json
    .venv/bin/python benchmarks/managed_ids.py --quick   # a ~15 s smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

WORLD = 2
MANAGED4 = ["C10", "C15", "C22", "C25"]
KINDS = ["hashed", "managed4", "managed_all"]
ALL_COLUMNS = [f"C{i}" for i in range(1, 27)]
PROFILE_STEPS = 10


# ---------------------------------------------------------------- part 1: the map on one core


class LinearProbe:
    """The reference: a plain vectorized linear-probing map of int64 ids to slots of a
    power-of-two array (lookup, and insert of the ids not found)."""

    def __init__(self, slots: int):
        self.keys = torch.full((slots,), -1, dtype=torch.int64)
        self.mask = slots - 1

    def assign(self, ids: torch.Tensor) -> torch.Tensor:
        from raydlrm.models.managed_ids import mix_ids

        slot = mix_ids(ids) & self.mask
        out = torch.empty_like(ids)
        index = torch.arange(ids.numel())
        while index.numel():
            held = self.keys.index_select(0, slot)
            empty = held == -1
            if bool(empty.any()):  # claim: one of the ids racing for a slot wins it
                self.keys.index_put_((slot[empty],), ids[empty])
                held = torch.where(empty, self.keys.index_select(0, slot), held)
            hit = held == ids
            out[index[hit]] = slot[hit]
            keep = (~hit).nonzero().squeeze(1)
            index, ids, slot = index[keep], ids[keep], (slot[keep] + 1) & self.mask
        return out


def _new_ids(gen: torch.Generator, n: int) -> torch.Tensor:
    """``n`` random ids in [0, 2^62) (distinct but for a negligible chance)."""
    return torch.randint(0, 1 << 62, (n,), generator=gen)


def bench_map(args) -> dict:
    from raydlrm.ids import ManagedIds
    from raydlrm.models.managed_ids import IdMap

    torch.set_num_threads(1)
    rows, batch = args.map_rows, args.map_batch
    gen = torch.Generator().manual_seed(11)
    id_map = IdMap(ManagedIds(), table="bench", num_embeddings=rows, row_start=0, row_end=rows)
    probe = LinearProbe(rows)
    empty_state, empty_keys = id_map.state.clone(), probe.keys.clone()
    held = _new_ids(gen, rows // 2)
    fill = {"map": 0.0, "probe": 0.0}
    for step, start in enumerate(range(0, held.numel(), batch)):
        chunk = held[start : start + batch]
        t = time.perf_counter()
        id_map.assign(chunk, now=step + 1, training=True)
        fill["map"] += time.perf_counter() - t
        t = time.perf_counter()
        probe.assign(chunk)
        fill["probe"] += time.perf_counter() - t
    stats = id_map.stats()
    half_state, half_keys = id_map.state.clone(), probe.keys.clone()
    now = 1000

    def run_map(state, ids, training=True):
        id_map.state.copy_(state)
        id_map.counters.zero_()
        t = time.perf_counter()
        out = id_map.assign(ids, now=now, training=training)
        elapsed = time.perf_counter() - t
        return elapsed, out

    def run_probe(keys, ids):
        probe.keys.copy_(keys)
        t = time.perf_counter()
        probe.assign(ids)
        return time.perf_counter() - t, None

    names = ["lookup", "lookup_eval", "mixed", "insert_empty"]
    names += ["probe_lookup", "probe_mixed", "probe_insert_empty"]
    rates: dict[str, list[float]] = {n: [] for n in names}
    placed = []
    for r in range(args.map_repeats):
        known = held[torch.randint(0, held.numel(), (batch,), generator=gen)]
        mixed = known.clone()
        new = batch // 10
        mixed[:new] = _new_ids(gen, new)
        mixed = mixed[torch.randperm(batch, generator=gen)]
        fresh = _new_ids(gen, batch)
        calls = {
            "lookup": partial(run_map, half_state, known),
            "lookup_eval": partial(run_map, half_state, known, training=False),
            "mixed": partial(run_map, half_state, mixed),
            "insert_empty": partial(run_map, empty_state, fresh),
            "probe_lookup": partial(run_probe, half_keys, known),
            "probe_mixed": partial(run_probe, half_keys, mixed),
            "probe_insert_empty": partial(run_probe, empty_keys, fresh),
        }
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            elapsed, out = calls[name]()
            rates[name].append(batch / elapsed / 1e6)
            if name == "mixed":
                placed.append(int(out.reset.numel()))
    # Where a call's time goes: 3 more calls of each with timers around the map's parts.
    timers = _instrument()
    breakdown = {}
    for name in ("lookup", "mixed", "insert_empty"):
        per_call = []
        for _ in range(3):
            timers.clear()
            elapsed, _out = calls[name]()
            per_call.append(
                {"call": elapsed * 1000, **{k: v * 1000 for k, v in timers.seconds.items()}}
            )
        keys = dict.fromkeys(k for c in per_call for k in c)
        breakdown[name] = {k: statistics.median(c.get(k, 0.0) for c in per_call) for k in keys}
    timers.restore()
    result = {
        "rows": rows,
        "batch": batch,
        "repeats": args.map_repeats,
        "load": stats["occupied"] / stats["capacity"],
        "max_probe_at_fill": stats["max_probe"],
        "fill_0_to_half_mids": {k: held.numel() / v / 1e6 for k, v in fill.items()},
        "mixed_new_rows_placed_median": statistics.median(placed),
        "mids": {n: statistics.median(v) for n, v in rates.items()},
        "mids_all": rates,
        "breakdown_ms_per_call": breakdown,
    }
    m = result["mids"]
    result["ratios"] = {
        "lookup_map_over_probe": m["lookup"] / m["probe_lookup"],
        "mixed_map_over_probe": m["mixed"] / m["probe_mixed"],
        "insert_empty_map_over_probe": m["insert_empty"] / m["probe_insert_empty"],
    }
    return result


# ----------------------------------------------------------- part 2: the step on 2 gloo workers


def _variants(args) -> list[str]:
    """``<kind>@<table rows>`` for every kind and table size."""
    return [f"{kind}@{rows}" for rows in args.table_rows for kind in KINDS]


def _spec(variant: str, args):
    from raydlrm.ids import ManagedIds
    from raydlrm.trainers.spec import WorkerSpec

    kind, _, rows = variant.partition("@")
    managed = {"hashed": [], "managed4": MANAGED4, "managed_all": ALL_COLUMNS}[kind]
    data = Path(args.data)
    spec = WorkerSpec(
        sharding={"optimizer": "rowwise_adagrad", "learning_rate": 0.05},
        data={
            "train_path": str(data / "train"),
            "eval_path": str(data / "eval"),
            "table_size": int(rows),
            "batch_size": args.global_batch // WORLD,
        },
        model={"embedding_dim": args.dim, "bottom_mlp": [64, args.dim], "top_mlp": [128, 64]},
        training={"seed": 7, "torch_threads": 1, "learning_rate": 0.001},
    )
    spec.data.managed_ids = {c: ManagedIds() for c in managed}
    return spec


class _Timers:
    """Seconds spent in wrapped functions (outermost calls of each name only)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.depth: dict[str, int] = defaultdict(int)
        self.originals: list[tuple[object, str, object]] = []

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def restore(self) -> None:
        while self.originals:
            owner, attr, original = self.originals.pop()
            setattr(owner, attr, original)

    def wrap(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        self.originals.append((owner, attr, original))
        timers = self

        def timed(*a, **k):
            timers.depth[name] += 1
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                timers.depth[name] -= 1
                if timers.depth[name] == 0:
                    timers.seconds[name] += time.perf_counter() - t
                    timers.calls[name] += 1

        setattr(owner, attr, timed)


def _instrument() -> _Timers:
    """Timers around the managed path: the collection's map step (``ManagedShards.rows``: the
    ids' copy, ``unit_offsets.tolist()``, each managed table's ``IdMap.assign`` and row resets),
    the map's parts, and the input distribution's bucket routing (only row-split shards route:
    a table-wise plan does not call it). The parts overlap: ``_place`` includes its re-probes
    (counted in ``_probe`` too) and ``_victims``."""
    from raydlrm.models import managed_ids
    from raydlrm.sharding import _input_dist, _managed

    timers = _Timers()
    timers.wrap(_managed.ManagedShards, "rows", "rows (all of the map step)")
    timers.wrap(_managed.ManagedShards, "_reset", "rows: reset new rows")
    timers.wrap(managed_ids.IdMap, "assign", "rows: IdMap.assign")
    timers.wrap(managed_ids.IdMap, "_home", "assign: _home (hash, bucket, check)")
    timers.wrap(managed_ids.IdMap, "_probe", "assign: _probe (lookup rounds)")
    timers.wrap(managed_ids.IdMap, "_place", "assign: _place (insert, evict)")
    timers.wrap(managed_ids.IdMap, "_victims", "assign: _place: _victims")
    timers.wrap(managed_ids.IdMap, "_check", "assign: _check (collision check)")
    timers.wrap(_input_dist, "route_rows", "input dist: route_rows")
    return timers


def _total_steps(args) -> int:
    """Batches each variant trains on: warm-up, timed blocks, the timed-parts block, profile."""
    return args.warmup + (args.repeats + 1) * args.steps + (PROFILE_STEPS if args.profile else 0)


def _step_worker(rank: int, args, port: int, result_path: str) -> None:
    import pyarrow.parquet as pq

    from raydlrm.ingestion import Preprocessor
    from raydlrm.ingestion.loader import arrow_to_batch
    from raydlrm.sharding import plan_sharding
    from raydlrm.trainers.loop import Trainer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    variants = _variants(args)
    raw = pq.read_table(Path(args.data) / "train")
    b = args.global_batch // WORLD
    trainers, batches, plans = {}, {}, {}
    for variant in variants:
        spec = _spec(variant, args)
        plan = plan_sharding(spec.tables(), world_size=WORLD, config=spec.sharding)
        plans[variant] = {t.name: [t.sharding_type, t.ranks] for t in plan.tables}
        trainers[variant] = Trainer(spec, plan=plan, rank=rank, device=torch.device("cpu"))
        table = Preprocessor(spec.data)(raw)
        batches[variant] = [
            arrow_to_batch(table.slice(s * args.global_batch + rank * b, b), config=spec.data)
            for s in range(_total_steps(args))
        ]
    del raw

    def block(variant: str, start: int, steps: int) -> float:
        """Seconds per step of ``steps`` steps from batch ``start`` (barrier to barrier)."""
        trainer = trainers[variant]
        dist.barrier()
        t = time.perf_counter()
        for s in range(start, start + steps):
            trainer.train_step(batches[variant][s])
        dist.barrier()
        return (time.perf_counter() - t) / steps

    for variant in variants:
        block(variant, 0, args.warmup)
    position = args.warmup

    def occupancy(variant: str) -> dict[str, list[float]]:
        """This rank's managed tables: [load, evictions so far]."""
        maps = trainers[variant].model.embedding_bags.id_maps()
        stats = {n: m.stats() for n, m in maps.items()}
        return {n: [st["occupied"] / st["capacity"], st["evictions"]] for n, st in stats.items()}

    step_s: dict[str, list[float]] = {v: [] for v in variants}
    loads: dict[str, list[dict]] = {v: [] for v in variants}
    machine_load: list[float] = []  # the 1-minute load average after each round
    for r in range(args.repeats):
        for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
            step_s[variant].append(block(variant, position, args.steps))
            loads[variant].append(occupancy(variant))
        position += args.steps
        machine_load.append(float(Path("/proc/loadavg").read_text().split()[0]))
    # One more block each with timers around the managed path.
    timers = _instrument()
    breakdown = {}
    for variant in variants:
        timers.clear()
        per_step = block(variant, position, args.steps)
        breakdown[variant] = {
            "step_s": per_step,
            "seconds_per_step": {k: v / args.steps for k, v in timers.seconds.items()},
            "calls_per_step": {k: v / args.steps for k, v in timers.calls.items()},
        }
    timers.restore()
    position += args.steps
    profile = None
    if args.profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        variant = f"managed4@{args.table_rows[0]}"
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            block(variant, position, PROFILE_STEPS)
        if rank == 0:
            profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    maps = {
        v: {n: m.stats() for n, m in trainers[v].model.embedding_bags.id_maps().items()}
        for v in variants
    }
    out = {
        "step_s": step_s,
        "loads_after_blocks": loads,
        "loadavg_after_rounds": machine_load,
        "breakdown": breakdown,
        "maps": maps,
        "profile": profile,
        "plans": plans,
    }
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, out)
    if rank == 0:
        Path(result_path).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_step(args) -> dict:
    import torch.multiprocessing as mp

    from raydlrm.ingestion import generate_synthetic
    from raydlrm.ingestion.synthetic_config import SyntheticConfig

    rows = _total_steps(args) * args.global_batch
    args.data = str(Path(args.data) / f"rows{rows}")  # written once per size, then reused
    generate_synthetic(
        SyntheticConfig(num_train_rows=rows, num_eval_rows=1000, seed=5), out_dir=args.data
    )
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        mp.spawn(_step_worker, args=(args, _free_port(), result.name), nprocs=WORLD, join=True)
        ranks = json.loads(Path(result.name).read_text())
    variants = _variants(args)
    step_ms = {v: [s * 1000 for s in ranks[0]["step_s"][v]] for v in variants}
    med = {v: statistics.median(step_ms[v]) for v in variants}

    def hashed(v: str) -> str:
        return "hashed@" + v.partition("@")[2]

    managed = [v for v in variants if not v.startswith("hashed")]
    plans = ranks[0]["plans"]
    out = {
        "train_rows": rows,
        "step_ms": med,
        "step_ms_repeats": step_ms,
        "ratio": {v: med[v] / med[hashed(v)] for v in managed},
        "ratio_paired": {
            v: statistics.median(m / h for m, h in zip(step_ms[v], step_ms[hashed(v)], strict=True))
            for v in managed
        },
        "breakdown_ms_per_step": {
            f"rank{r}": {
                v: {
                    "step": ranks[r]["breakdown"][v]["step_s"] * 1000,
                    **{
                        k: x * 1000 for k, x in ranks[r]["breakdown"][v]["seconds_per_step"].items()
                    },
                }
                for v in variants
            }
            for r in range(WORLD)
        },
        "calls_per_step_rank0": {v: ranks[0]["breakdown"][v]["calls_per_step"] for v in variants},
        "maps": {f"rank{r}": ranks[r]["maps"] for r in range(WORLD)},
        "loads_after_blocks": {f"rank{r}": ranks[r]["loads_after_blocks"] for r in range(WORLD)},
        "loadavg_after_rounds": ranks[0]["loadavg_after_rounds"],
        "plans": plans,
        "same_placement_as_hashed": {v: plans[v] == plans[hashed(v)] for v in managed},
    }
    if ranks[0]["profile"]:
        out["profile_rank0"] = ranks[0]["profile"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a ~15 s smoke run (smaller map, 2 blocks of 5 steps)"
    )
    parser.add_argument("--parts", default="map,step", help="map, step or both")
    parser.add_argument("--map-rows", type=int, default=1 << 22)
    parser.add_argument("--map-batch", type=int, default=1 << 18)
    parser.add_argument("--map-repeats", type=int, default=15)
    parser.add_argument(
        "--table-rows",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[32_768, 131_072],
        help="rows of every table, comma-separated sizes (each its variants)",
    )
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="steps of a timed block")
    parser.add_argument("--repeats", type=int, default=5, help="blocks of each variant")
    parser.add_argument("--profile", action="store_true", help="torch.profiler on rank 0")
    parser.add_argument("--data", default="/tmp/bench/managed_ids_data")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench/managed_ids.json"))
    args = parser.parse_args()
    if args.quick:
        args.map_rows, args.map_batch, args.map_repeats = 1 << 20, 1 << 16, 5
        args.warmup, args.steps, args.repeats = 2, 5, 2
    parts = set(args.parts.split(","))
    summary: dict = {"args": vars(args) | {"out": str(args.out)}}
    if "map" in parts:
        summary["map"] = m = bench_map(args)
        print(f"map, {m['rows']} rows at load {m['load']:.3f}, {m['batch']} ids a call, one "
              f"core; M ids/s (median of {m['repeats']}):")  # fmt: skip
        for name, rate in m["mids"].items():
            print(f"  {name:20s} {rate:7.2f}")
        print(f"  fill 0 -> 0.5: {m['fill_0_to_half_mids']}; ratios {m['ratios']}")
        for name, parts_ms in m["breakdown_ms_per_call"].items():
            print(
                f"  ms per call, {name}: " + ", ".join(f"{k} {x:.1f}" for k, x in parts_ms.items())
            )
    if "step" in parts:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        summary["step"] = s = bench_step(args)
        print(f"step, 2 gloo workers, global batch {args.global_batch}, dim {args.dim}; ms "
              f"(median of {args.repeats} blocks of {args.steps}):")  # fmt: skip
        for v, ms in s["step_ms"].items():
            extra = ""
            if v in s["ratio"]:
                extra = f"  ratio {s['ratio'][v]:.3f} (paired {s['ratio_paired'][v]:.3f})"
            print(f"  {v:20s} {ms:7.1f}{extra}")
        print(f"  same placement as hashed: {s['same_placement_as_hashed']}")
        print(f"  machine load average after each round: {s['loadavg_after_rounds']}")
        for rank, per in s["breakdown_ms_per_step"].items():
            for v, parts_ms in per.items():
                line = ", ".join(f"{k} {x:.2f}" for k, x in parts_ms.items())
                print(f"  ms per step {rank} {v}: {line}")
        if "profile_rank0" in s:
            print(s["profile_rank0"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
