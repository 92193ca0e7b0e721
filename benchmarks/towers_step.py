"""Disaggregated Multi-Tower on an emulated two-level network (issue 31): training-step time and
bytes between hosts of the model the trainer ships, flat against towers pinned to hosts.

4 gloo ranks as 2 emulated hosts x 2 ranks (``raydlrm._netem.EmulatedHosts``: a network
namespace per host; ranks of one host talk over its loopback, ranks of different hosts through a
veth link rate-limited by ``tc``). First, with no limit, the gloo bandwidth of a 32 MB
send/receive between the two ranks of host 0 (intra-host) is measured; then the link between the
hosts is set to ``1 / --ratio`` of it and measured the same way (ranks 0 and 2), and both
variants train side by side (interleaved repeats). Both are built and sharded as the trainer
does (``Trainer._sharded_model``): :func:`raydlrm.models.build_model` (DLRM, tables on the meta
device) and :func:`raydlrm.sharding.shard_model`:

- ``flat``: no towers; ``shard_model(..., topology=None)``: a
  :class:`~raydlrm.sharding.ShardedEmbeddingBagCollection` over all 4 ranks (the planner's
  placement, :func:`~raydlrm.sharding.plan_sharding`), the dense DLRM (bottom MLP, dot
  interaction, top MLP) under DDP over all 4;
- ``dmt``: ``model.towers`` = two towers of half the features each (tower ``i`` on host ``i``),
  ``model.tower_dim`` = a tower's pooled width / ``--compression``, rounded to a multiple of
  ``--dim`` (at least ``--dim``); ``shard_model(..., topology=Topology(2, 2))``, the tower path
  (:func:`raydlrm.sharding.towers.shard_tower_model`, plan from
  :func:`raydlrm.sharding.planner.tower_plan.plan_towers`): each tower's tables sharded over its
  host's 2 ranks, its :class:`~raydlrm.models.towers.TowerModule` (the tower's pooled embeddings and
  their pairwise dot products projected to ``tower_dim``) run on its host but *replicated on
  every rank*, its gradients all-reduced over all 4 ranks (so across hosts) by a hook after
  each backward pass, and the dense DLRM on the towers' outputs
  (:class:`~raydlrm.sharding.towers.TowerOutputsDense`) under DDP over all 4.

A step, as ``Trainer.train_step``: ``model.forward_pooled`` on a :class:`raydlrm.batch.Batch`
(13 dense features, the sparse KJT, labels), a BCE loss, the backward with the fused row-wise
Adagrad update, Adam on the dense parameters (``model.dense``'s and
``unwrap_dense(model)``'s: with towers, the tower modules). Bytes between hosts are each host's
link counters (``/sys/class/net/eth0/statistics/tx_bytes`` inside its namespace, gloo's
framing and every all-reduce included) over the timed steps; for ``dmt`` the tower
collection's own counters (``cross_input``, ``cross_forward``, ``cross_backward``) say how
much of it is ids and tower outputs, the rest being the all-reduces (dense DDP and tower
modules) and framing. Needs root and iproute2 (``raydlrm._netem.available``).

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

HOSTS, RANKS_PER_HOST = 2, 2
WORLD = HOSTS * RANKS_PER_HOST
PORT = 29611
NUM_DENSE = 13
SEED = 3


def _tables(args):
    from raydlrm.models.embedding import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim, feature_names=(f"f{i}",)
        )
        for i in range(args.tables)
    ]


def _batch(args, rank: int, step: int):
    from raydlrm.batch import Batch, KeyedJaggedTensor

    gen = torch.Generator().manual_seed(rank * 1000 + step)
    lengths = torch.randint(1, 2 * args.pooling, (args.tables * args.batch_size,), generator=gen)
    values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=gen)
    keys = [f"f{i}" for i in range(args.tables)]
    return Batch(
        dense=torch.randn(args.batch_size, NUM_DENSE, generator=gen),
        sparse=KeyedJaggedTensor.from_lengths(keys, values, lengths),
        labels=torch.randint(0, 2, (args.batch_size,), generator=gen).float(),
    )


def tower_dim(args) -> int:
    """A tower's pooled width / ``--compression``, rounded to a multiple of ``--dim`` (at least
    one: ``model.tower_dim`` must be a positive multiple of ``embedding_dim``)."""
    pooled = args.tables // HOSTS * args.dim
    return max(1, round(pooled / args.compression / args.dim)) * args.dim


def _model_config(variant: str, args):
    from raydlrm.models.config import ModelConfig

    sizes = {"embedding_dim": args.dim, "bottom_mlp": [64, args.dim], "top_mlp": [256]}
    if variant == "flat":
        return ModelConfig(arch="dlrm", **sizes)
    half = args.tables // HOSTS
    towers = [[f"f{i}" for i in range(h * half, (h + 1) * half)] for h in range(HOSTS)]
    return ModelConfig(arch="dlrm", **sizes, towers=towers, tower_dim=tower_dim(args))


def _build(variant: str, args):
    """The model and its dense optimizer, built and sharded as ``Trainer`` does."""
    from raydlrm.models import build_model
    from raydlrm.sharding import ShardingConfig, Topology, plan_sharding, shard_model
    from raydlrm.sharding.parallelize import unwrap_dense
    from raydlrm.sharding.planner.tower_plan import plan_towers
    from raydlrm.sharding.tower_spec import model_towers
    from raydlrm.sharding.towers import ShardedTowerCollection

    tables = _tables(args)
    config = ShardingConfig(optimizer="rowwise_adagrad", learning_rate=0.05)
    model_config = _model_config(variant, args)
    torch.manual_seed(SEED)  # the same dense (and tower) weights on every rank
    model = build_model(
        model_config,
        tables=tables,
        num_dense=NUM_DENSE,
        embedding_device="meta",
        seed=SEED,
    )
    if variant == "flat":
        topology = None
        plan = plan_sharding(tables, world_size=WORLD, config=config)
    else:
        topology = Topology(HOSTS, RANKS_PER_HOST)
        towers = model_towers(model_config.towers, topology.num_hosts)
        plan = plan_towers(tables, towers, topology, config=config)
    model = shard_model(model, plan=plan, config=config, device="cpu", topology=topology)
    if variant == "dmt" and not isinstance(model.embedding_bags, ShardedTowerCollection):
        raise RuntimeError(f"shard_model gave {type(model.embedding_bags).__name__}, not towers")
    # The trainer's dense parameters: model.dense's, and with towers the tower modules, which
    # unwrap_dense(model) (the unsharded TowerDense) holds.
    params = {id(p): p for p in [*model.dense.parameters(), *unwrap_dense(model).parameters()]}
    ddp = sum(p.numel() for p in model.dense.parameters())
    blocks = getattr(unwrap_dense(model), "blocks", None)
    shapes = {
        "ddp_params": ddp,
        "tower_module_params": 0 if blocks is None else sum(p.numel() for p in blocks.parameters()),
        "tower_dim": model_config.tower_dim,
    }
    return model, torch.optim.Adam(list(params.values()), lr=1e-3), shapes


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
        variants = {v: _build(v, args) for v in ("flat", "dmt")}
        batches = [_batch(args, rank, s) for s in range(4)]
        result = {
            v: {"step_s": [], "link_bytes": [], "module_bytes": [], "shapes": shapes}
            for v, (_, _, shapes) in variants.items()
        }

        def run(name: str, steps: int) -> None:
            model, opt, _ = variants[name]
            model.train()
            for s in range(steps):  # Trainer.train_step
                batch = batches[s % len(batches)]
                logits, _ = model.forward_pooled(batch)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()  # also the fused embedding update, and the towers' all-reduce
                opt.step()

        for name in variants:
            run(name, 2)  # warm-up
        for r in range(args.repeats):
            for name in list(variants)[r % 2 :] + list(variants)[: r % 2]:
                collection = variants[name][0].embedding_bags
                dist.barrier()
                sent, before = _link_bytes(), collection.comm_bytes()
                start = time.perf_counter()
                run(name, args.steps)
                dist.barrier()
                elapsed = time.perf_counter() - start
                stats = result[name]
                stats["step_s"].append(elapsed / args.steps)
                stats["link_bytes"].append((_link_bytes() - sent) / args.steps)
                after = collection.comm_bytes()
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
        summary[name] = {
            "step_ms": steps * 1000,
            "step_ms_repeats": [s * 1000 for s in ranks[0][name]["step_s"]],
            "cross_host_bytes_per_step": link,
            **ranks[0][name]["shapes"],
        }
        if name == "dmt":
            # The tower collection's own bytes to the other host (ids, tower outputs, their
            # gradients), all ranks: the link's rest is the all-reduces and gloo's framing.
            directions = {
                d: sum(
                    statistics.median(m.get(d, 0.0) for m in r[name]["module_bytes"]) for r in ranks
                )
                for d in ("cross_input", "cross_forward", "cross_backward")
            }
            summary[name]["tower_collection_cross_bytes_per_step"] = directions
            summary[name]["link_rest_bytes_per_step"] = link - sum(directions.values())
        print(f"{name}: step {steps * 1000:.1f} ms (median of {args.repeats}), "
              f"{link / 1e6:.2f} MB/step between hosts, {summary[name]}")  # fmt: skip
    summary["speedup"] = summary["flat"]["step_ms"] / summary["dmt"]["step_ms"]
    summary["speedup_paired"] = statistics.median(
        f / d for f, d in zip(ranks[0]["flat"]["step_s"], ranks[0]["dmt"]["step_s"], strict=True)
    )
    summary["byte_reduction"] = (
        summary["flat"]["cross_host_bytes_per_step"] / summary["dmt"]["cross_host_bytes_per_step"]
    )
    print(f"dmt: {summary['speedup']:.2f}x faster (ratio of medians; median of the repeats' "
          f"ratios {summary['speedup_paired']:.2f}x), "
          f"{summary['byte_reduction']:.2f}x fewer bytes")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
