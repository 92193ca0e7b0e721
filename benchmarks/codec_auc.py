"""Effect of the all-to-all codec (compressed communication) on final AUC and wire bytes.

Trains the same job once per codec (``sharding.comm_precision``), on the same synthetic data with
the same seeds, one after the other, and prints a table of held-out AUC, log loss, the bytes the
embedding all-to-alls put on the wire (summed over ranks and the run) and the throughput. The only
difference between the runs is the codec of the pooled-embedding all-to-all and its gradient, so
the AUC differences are the codec's effect (plus the run-to-run noise of asynchronous data
loading, which fp32 against itself measures: ``--codecs fp32,fp32``).

Usage::

    python benchmarks/codec_auc.py [--config configs/quickstart.toml]
        [--codecs fp32,fp16,bf16,fp8,int8] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import time

import raydlrm

DIRECTIONS = ("forward", "backward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.toml")
    parser.add_argument("--codecs", default="fp32,fp16,bf16,fp8,int8")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    rows = []
    for i, codec in enumerate(args.codecs.split(",")):
        overrides = [
            # Every table sharded, so that every pooled vector crosses the codec.
            "sharding.default_type=table_wise",
            f"sharding.comm_precision={codec}",
            f"run.name=codec-auc-{i}-{codec}",
            "tracking.experiment_name=raydlrm-codec-auc",
            "tracking.registered_model_name=raydlrm-codec-auc",
            *args.overrides,
        ]
        start = time.perf_counter()
        result = raydlrm.train(args.config, overrides=overrides)
        took = time.perf_counter() - start
        m = result.metrics
        wire = {
            d: sum(v for k, v in m.items() if k.startswith(f"comm/{d}_") and k.endswith("_bytes"))
            for d in DIRECTIONS
        }
        rows.append((codec, m["eval/auc"], m["eval/log_loss"], wire, m, took))
        print(f"[{codec}] eval/auc={m['eval/auc']:.4f} ({took:.0f}s)", flush=True)

    base = rows[0][1]
    print(f"\nconfig {args.config}, overrides {args.overrides or 'none'}")
    print(
        "| codec | eval AUC | AUC - first | eval log loss | forward bytes | backward bytes "
        "| samples/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for codec, auc, log_loss, wire, m, _ in rows:
        print(
            f"| {codec} | {auc:.4f} | {auc - base:+.4f} | {log_loss:.4f} "
            f"| {wire['forward'] / 1e6:,.1f} MB | {wire['backward'] / 1e6:,.1f} MB "
            f"| {m['train/samples_per_second']:,.0f} |"
        )


if __name__ == "__main__":
    main()
