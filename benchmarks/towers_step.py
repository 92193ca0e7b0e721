"""Disaggregated Multi-Tower on an emulated two-level network (issue 31): training-step time and
bytes between hosts, a flat sharded collection against towers pinned to hosts.

4 gloo ranks as 2 emulated hosts x 2 ranks (``raydlrm._netem.EmulatedHosts``: a network
namespace per host; ranks of one host talk over its loopback, ranks of different hosts through a
veth link rate-limited by ``tc``). First, with no limit, the gloo bandwidth of a 32 MB
send/receive between the two ranks of host 0 (intra-host) is measured; then the link between the
hosts is set to ``1 / --ratio`` of it and measured the same way (ranks 0 and 2), and both
variants train side by side (interleaved repeats):

- ``flat``: :class:`~raydlrm.sharding.ShardedEmbeddingBagCollection` over all 4 ranks (tables
  table-wise, the planner's placement), the dense top MLP under DDP over all 4;
- ``dmt``: :class:`~raydlrm.sharding.towers.ShardedTowerCollection`, the features split in two
  towers (one per host), each tower's tables sharded table-wise over its host's 2 ranks, its
  module a linear projection to ``1 / --compression`` of the tower's pooled width (data-parallel
  inside the host), then the same kind of top MLP on the towers' outputs.

A step: the lookups, the top MLP, a BCE loss, the backward with the fused row-wise Adagrad
update, Adam on the dense part. Bytes between hosts are each host's link counters
(``/sys/class/net/eth0/statistics/tx_bytes`` inside its namespace, gloo's framing included)
over the timed steps. Needs root and iproute2 (``raydlrm._netem.available``).

    .venv/bin/python benchmarks/towers_step.py --out /tmp/bench/towers_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

HOSTS, RANKS_PER_HOST = 2, 2
WORLD = HOSTS * RANKS_PER_HOST
PORT = 29611


def _tables(args):
    from raydlrm.models.embedding import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim, feature_names=(f"f{i}",)
        )
        for i in range(args.tables)
    ]


def _batch(args, rank: int, step: int):
    from raydlrm.batch import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(rank * 1000 + step)
    lengths = torch.randint(1, 2 * args.pooling, (args.tables * args.batch_size,), generator=gen)
    values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=gen)
    keys = [f"f{i}" for i in range(args.tables)]
    labels = torch.randint(0, 2, (args.batch_size,), generator=gen).float()
    return KeyedJaggedTensor.from_lengths(keys, values, lengths), labels


def _top(width: int) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(width, 256), nn.ReLU(), nn.Linear(256, 1))


def _build(variant: str, args, groups):
    from raydlrm.models.embedding import EmbeddingBagCollection
    from raydlrm.sharding import ShardedEmbeddingBagCollection, ShardingConfig, plan_sharding
    from raydlrm.sharding.towers import ShardedTowerCollection, Tower, plan_towers

    tables = _tables(args)
    config = ShardingConfig(optimizer="rowwise_adagrad", learning_rate=0.05)
    ebc = EmbeddingBagCollection(tables, device="meta")
    if variant == "flat":
        plan = plan_sharding(tables, world_size=WORLD, config=config)
        sparse = ShardedEmbeddingBagCollection(ebc, plan=plan, config=config, device="cpu")
        width = args.tables * args.dim
    else:
        half = args.tables // HOSTS
        towers = [
            Tower(f"tower{h}", tuple(f"f{i}" for i in range(h * half, (h + 1) * half)), host=h)
            for h in range(HOSTS)
        ]
        out = half * args.dim // args.compression
        torch.manual_seed(4)
        modules = {t.name: nn.Linear(half * args.dim, out) for t in towers}
        plan = plan_towers(tables, towers, groups.topology, config=config)
        sparse = ShardedTowerCollection(
            ebc,
            towers=towers,
            modules=modules,
            output_widths={t.name: out for t in towers},
            plan=plan,
            config=config,
            device="cpu",
            groups=groups,
        )
        width = out * HOSTS
    top = DistributedDataParallel(_top(width))
    return (
        sparse,
        top,
        torch.optim.Adam(
            [*top.parameters(), *getattr(sparse, "tower_modules", nn.Module()).parameters()],
            lr=1e-3,
        ),
    )


def _link_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def _bandwidth(peer: int, rank: int, size: int = 32 << 20, repeats: int = 3) -> float | None:
    """Gbit/s of ``size`` bytes from rank 0 to ``peer`` (median of ``repeats``), on rank 0."""
    payload = torch.empty(size // 4)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(payload, dst=peer)
            dist.recv(payload[:1], src=peer)
        elif rank == peer:
            dist.recv(payload, src=0)
            dist.send(payload[:1], dst=0)
        times.append(time.perf_counter() - start)
    return size * 8 / statistics.median(times) / 1e9 if rank == 0 else None


def worker(args) -> None:
    from raydlrm.sharding.towers import Topology, topology_groups

    torch.set_num_threads(1)
    rank = args.rank
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.master}:{PORT}", rank=rank, world_size=WORLD
    )
    result: dict = {}
    if args.phase == "bandwidth":
        result["intra_gbit"] = _bandwidth(1, rank)
        result["cross_gbit"] = _bandwidth(2, rank)
    else:
        groups = topology_groups(Topology(HOSTS, RANKS_PER_HOST))
        variants = {v: _build(v, args, groups) for v in ("flat", "dmt")}
        batches = [_batch(args, rank, s) for s in range(4)]
        result = {v: {"step_s": [], "link_bytes": [], "module_bytes": []} for v in variants}
        loss_fn = nn.BCEWithLogitsLoss()

        def run(name: str, steps: int) -> None:
            sparse, top, opt = variants[name]
            for s in range(steps):
                kjt, labels = batches[s % len(batches)]
                loss = loss_fn(top(sparse(kjt).values).squeeze(1), labels)
                opt.zero_grad()
                loss.backward()
                opt.step()

        for name in variants:
            run(name, 2)  # warm-up
        for r in range(args.repeats):
            for name in list(variants)[r % 2 :] + list(variants)[: r % 2]:
                dist.barrier()
                sent, before = _link_bytes(), variants[name][0].comm_bytes()
                start = time.perf_counter()
                run(name, args.steps)
                dist.barrier()
                elapsed = time.perf_counter() - start
                stats = result[name]
                stats["step_s"].append(elapsed / args.steps)
                stats["link_bytes"].append((_link_bytes() - sent) / args.steps)
                after = variants[name][0].comm_bytes()
                stats["module_bytes"].append(
                    {
                        d: (sum(after[d].values()) - sum(before.get(d, {}).values())) / args.steps
                        for d in after
                    }
                )
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _launch(net, args, phase: str, extra: list[str]) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "TORCH_CPP_LOG_LEVEL": "ERROR"}
        procs = []
        for rank in range(WORLD):
            argv = [sys.executable, __file__, "--worker", f"--rank={rank}", f"--phase={phase}",
                    f"--master={net.address(0)}", f"--result={out.name}", *extra]  # fmt: skip
            procs.append(subprocess.Popen(net.command(rank // RANKS_PER_HOST, argv), env=env))
        codes = [p.wait(timeout=args.timeout) for p in procs]
        if any(codes):
            raise RuntimeError(f"{phase} ranks exited with {codes}")
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=16)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1024, help="per rank")
    parser.add_argument("--pooling", type=int, default=4)
    parser.add_argument("--compression", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=10.0, help="intra / cross bandwidth")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench/towers_step.json"))
    # Worker-side arguments (the benchmark starts its ranks with them).
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.tables % HOSTS:
        parser.error(f"--tables must be a multiple of {HOSTS} (a tower per host)")
    from raydlrm._netem import EmulatedHosts, available

    reason = available()
    if reason:
        sys.exit(f"cannot emulate hosts here: {reason}")
    shape = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in (
            "tables",
            "rows",
            "dim",
            "batch_size",
            "pooling",
            "compression",
            "steps",
            "repeats",
        )
    ]
    with EmulatedHosts(hosts=HOSTS) as net:
        intra = _launch(net, args, "bandwidth", [])[0]["intra_gbit"]
    rate = intra * 1000 / args.ratio
    print(
        f"intra-host gloo bandwidth {intra:.2f} Gbit/s; link between hosts set to {rate:.0f} Mbit/s"
    )
    with EmulatedHosts(hosts=HOSTS, rate_mbit=rate) as net:
        bandwidth = _launch(net, args, "bandwidth", [])[0]
        ranks = _launch(net, args, "train", shape)
    summary = {
        "args": shape,
        "intra_gbit_unlimited": intra,
        "link_mbit_set": rate,
        "measured": bandwidth,
        "ranks": ranks,
    }
    for name in ("flat", "dmt"):
        steps = statistics.median(ranks[0][name]["step_s"])
        link = sum(
            statistics.median(ranks[h * RANKS_PER_HOST][name]["link_bytes"]) for h in range(HOSTS)
        )
        summary[name] = {"step_ms": steps * 1000, "cross_host_bytes_per_step": link}
        print(f"{name}: step {steps * 1000:.1f} ms (median of {args.repeats}), "
              f"{link / 1e6:.2f} MB/step between hosts")  # fmt: skip
    summary["speedup"] = summary["flat"]["step_ms"] / summary["dmt"]["step_ms"]
    summary["byte_reduction"] = (
        summary["flat"]["cross_host_bytes_per_step"] / summary["dmt"]["cross_host_bytes_per_step"]
    )
    print(f"dmt: {summary['speedup']:.2f}x faster, {summary['byte_reduction']:.2f}x fewer bytes")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
