"""Held-out error of the learned cost model against the analytic form (issue 30, first part).

Reads measured cost samples (Parquet, as ``raydlrm plan --collect N`` or
:func:`raydlrm.sharding.planner.learned_cost.collect_samples` write them) or collects
``--collect N`` first; holds out ``--held-out`` of the sets at random; trains the learned model
on the first ``k`` of the rest for each ``k`` of ``--train-sizes`` (a learning curve); and
reports on the same held-out sets the mean absolute percentage error (MAPE) of the learned model
and of the analytic form (``seconds = c + bytes / rate`` over the set's tables, fitted by least
squares to the same training sets), overall and by the number of tables in a set.

    .venv/bin/python benchmarks/learned_cost.py --samples /tmp/lc_*.parquet \
        --train-sizes 300 1000 3000 --out /tmp/bench/learned_cost.json

On a GPU (the tables in GPU memory, as GPU workers hold them), collecting for at most two
minutes and keeping the samples and the model trained on the most sets:

    python3 benchmarks/learned_cost.py --device cuda --collect 5000 --collect-seconds 120 \
        --batch-size 4096 --train-sizes 100000 --save-samples S.parquet --save-model M.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydlrm.sharding.planner import learned_cost as lc
from raydlrm.sharding.planner.measure import mape


def _by_size(sets: list, predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    sizes = np.array([len(s) for s in sets])
    out = {}
    for lo, hi in ((1, 1), (2, 5), (6, 10), (11, 15)):
        pick = (sizes >= lo) & (sizes <= hi)
        if pick.any():
            out[f"{lo}-{hi}"] = float(
                np.mean(np.abs(predicted[pick] - measured[pick]) / measured[pick])
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", nargs="*", default=[], help="Parquet files of samples")
    parser.add_argument("--collect", type=int, default=0, help="collect this many first")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--train-sizes", type=int, nargs="+", default=[300, 1000, 3000])
    parser.add_argument("--held-out", type=int, default=500, help="sets held out")
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--collect-seconds", type=float, default=0, help="stop collecting after this long"
    )
    parser.add_argument("--save-samples", type=Path, help="write the samples (Parquet) here")
    parser.add_argument("--save-model", type=Path, help="save the model of the most sets here")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench/learned_cost.json"))
    args = parser.parse_args()
    tables = [pq.read_table(p) for p in args.samples]
    if args.collect:
        tables += _collect(args)
    samples = pa.concat_tables(tables)
    if args.save_samples:
        pq.write_table(samples, args.save_samples)
    order = np.random.default_rng(args.seed).permutation(samples.num_rows)
    held_out = min(args.held_out, samples.num_rows // 5)  # a fifth at most: few collected
    test = samples.take(order[:held_out])
    rest = samples.take(order[held_out:])
    sets = lc.sample_sets(test)
    measured = np.asarray(test.column("seconds").to_pylist())
    print(
        f"{samples.num_rows} samples ({samples.column('kernel')[0]} kernel, "
        f"{samples.column('machine')[0]}); {held_out} held out"
    )
    rows, model = [], None
    for size in sorted({min(s, rest.num_rows) for s in args.train_sizes}):
        train = rest.slice(0, size)
        start = time.perf_counter()
        # The sets held out are ours (the same for every size): none inside.
        model = lc.train_cost_model(train, epochs=args.epochs, held_out=0, seed=args.seed)
        seconds = time.perf_counter() - start
        learned = np.array(model.predict_features(sets))
        train_sets = lc.sample_sets(train)
        analytic = lc.fit_analytic(train_sets, np.asarray(train.column("seconds").to_pylist()))(
            sets
        )
        row = {
            "train_sets": size,
            "train_s": seconds,
            "learned_mape": mape(learned, measured),
            "analytic_mape": mape(analytic, measured),
            "learned_by_tables": _by_size(sets, learned, measured),
            "analytic_by_tables": _by_size(sets, analytic, measured),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        "\n| train sets | learned MAPE | analytic MAPE | learned by tables "
        "(1 / 2-5 / 6-10 / 11-15) | analytic by tables | train s |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        fmt = lambda d: " / ".join(f"{v:.1%}" for v in d.values())  # noqa: E731
        print(
            f"| {r['train_sets']} | {r['learned_mape']:.1%} | {r['analytic_mape']:.1%} | "
            f"{fmt(r['learned_by_tables'])} | {fmt(r['analytic_by_tables'])} | "
            f"{r['train_s']:.0f} |"
        )
    if args.save_model and model is not None:
        model.save(args.save_model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"args": meta, "samples": samples.num_rows, "rows": rows}))


def _collect(args) -> list[pa.Table]:
    """``--collect`` sets on ``--device``, in chunks of 50, until ``--collect-seconds``."""
    out, start, done = [], time.perf_counter(), 0
    while done < args.collect:
        n = min(50, args.collect - done)
        out.append(
            lc.collect_samples(
                n, batch_size=args.batch_size, seed=args.seed + done, device=args.device
            )
        )
        done += n
        elapsed = time.perf_counter() - start
        print(f"collected {done} sets in {elapsed:.0f} s", flush=True)
        if args.collect_seconds and elapsed > args.collect_seconds:
            break
    return out


if __name__ == "__main__":
    main()
