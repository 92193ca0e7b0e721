"""Effect of the all-to-all codec (compressed communication) on final AUC and wire bytes.

Trains the same job once per codec (``sharding.comm_precision``), on the same synthetic data with
the same seeds, one after the other, and prints a table of held-out AUC, log loss, the bytes the
embedding all-to-alls put on the wire (summed over ranks and the run) and the throughput. The only
difference between the runs is the codec of the pooled-embedding all-to-all and its gradient, so
the AUC differences are the codec's effect (plus the run-to-run noise of asynchronous data
loading, which fp32 against itself measures: ``--codecs fp32,fp32``).

``--seeds 0,1,2`` repeats the whole comparison once per ``training.seed`` (the model's
initialisation; the data stay the same), codecs in turn within each seed, and adds a summary: per
codec, the mean AUC and its spread over the seeds, and the AUC difference from the first codec
paired by seed (mean, min, max).

Usage::

    python benchmarks/codec_auc.py [--config configs/quickstart.toml]
        [--codecs fp32,fp16,bf16,fp8,int8,mx4] [--seeds 0,1,2] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import raydlrm

DIRECTIONS = ("forward", "backward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.toml")
    parser.add_argument("--codecs", default="fp32,fp16,bf16,fp8,int8,mx4")
    parser.add_argument(
        "--seeds", default=None, help="training.seed values, comma-separated (default: config's)"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    codecs = args.codecs.split(",")
    seeds: list[str | None] = args.seeds.split(",") if args.seeds else [None]

    rows = []
    for seed in seeds:
        for i, codec in enumerate(codecs):
            tag = f"{i}-{codec}" if seed is None else f"{i}-{codec}-seed{seed}"
            overrides = [
                # Every table sharded, so that every pooled vector crosses the codec.
                "sharding.default_type=table_wise",
                f"sharding.comm_precision={codec}",
                f"run.name=codec-auc-{tag}",
                "tracking.experiment_name=raydlrm-codec-auc",
                "tracking.registered_model_name=raydlrm-codec-auc",
                *([] if seed is None else [f"training.seed={seed}"]),
                *args.overrides,
            ]
            start = time.perf_counter()
            result = raydlrm.train(args.config, overrides=overrides)
            took = time.perf_counter() - start
            m = result.metrics
            wire = {
                d: sum(
                    v for k, v in m.items() if k.startswith(f"comm/{d}_") and k.endswith("_bytes")
                )
                for d in DIRECTIONS
            }
            rows.append((seed, codec, m["eval/auc"], m["eval/log_loss"], wire, m, took))
            print(f"[{tag}] eval/auc={m['eval/auc']:.4f} ({took:.0f}s)", flush=True)

    first: dict[str | None, float] = {}
    for seed, codec, auc, *_ in rows:
        if codec == codecs[0]:
            first.setdefault(seed, auc)  # a repeat of the first codec: its run-to-run noise
    print(f"\nconfig {args.config}, overrides {args.overrides or 'none'}")
    print(
        "| seed | codec | eval AUC | AUC - first | eval log loss | forward bytes "
        "| backward bytes | samples/s | run s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for seed, codec, auc, log_loss, wire, m, took in rows:
        print(
            f"| {seed if seed is not None else '-'} | {codec} | {auc:.4f} "
            f"| {auc - first[seed]:+.4f} | {log_loss:.4f} "
            f"| {wire['forward'] / 1e6:,.1f} MB | {wire['backward'] / 1e6:,.1f} MB "
            f"| {m['train/samples_per_second']:,.0f} | {took:.0f} |"
        )
    if len(seeds) > 1:
        print(f"\nover seeds {','.join(str(s) for s in seeds)} (AUC - {codecs[0]} paired by seed)")
        print(
            "| codec | mean AUC | AUC min..max | mean AUC - first | AUC - first min..max "
            "| wire bytes / first |"
        )
        print("|---|---|---|---|---|---|")
        total = {(seed, codec): sum(wire.values()) for seed, codec, _, _, wire, *_ in rows}
        for codec in dict.fromkeys(codecs):
            aucs = [auc for _, c, auc, *_ in rows if c == codec]
            deltas = [auc - first[seed] for seed, c, auc, *_ in rows if c == codec]
            ratio = statistics.mean(total[s, codec] / total[s, codecs[0]] for s in seeds)
            print(
                f"| {codec} | {statistics.mean(aucs):.4f} | {min(aucs):.4f}..{max(aucs):.4f} "
                f"| {statistics.mean(deltas):+.4f} | {min(deltas):+.4f}..{max(deltas):+.4f} "
                f"| {ratio:.3f} |"
            )


if __name__ == "__main__":
    main()
