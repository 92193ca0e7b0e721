"""What a user would pick instead of raydlrm on a table: a tuned gradient-boosted-tree model
(LightGBM) and a factorization machine, on the train/eval split a raydlrm config reads.

Both are tuned on a validation split of the training data (``fit`` / ``valid``: see
:func:`validation_split`, the split every method of ``benchmarks/quality.py`` tunes on), then
trained on the whole training data with the best settings and measured on the eval data
(AUC), with ``--seeds`` seeds.

- **GBDT** (LightGBM, a benchmark-only dependency: ``make bench-deps``): dense columns as they
  are, sparse columns as categorical features (an id list: one 0/1 column per value, for lists
  of at most 64 distinct values); ``--gbdt-trials`` random settings of leaves, learning rate,
  leaf size, feature fraction and L2, each stopped early on the validation AUC; the final model
  gets the best setting's rounds scaled by the data (train / fit rows).
- **FM** (a factorization machine in PyTorch, one process): one weight and one factor vector per
  distinct training value of each sparse column (unseen values share one per column; an id
  list's values weigh 1/length) and per dense column (its standardized value); the grid of
  ``--fm-dims`` x learning rates x L2, Adam, batches of 1,024, the epoch count chosen on the
  validation AUC.
- **Logistic regression** (scikit-learn, ``--methods logreg``, not in the default methods): one
  0/1 column per distinct training value of each sparse column (every value of an id list; unseen
  values: none) and the standardized dense columns, L2-regularized (L-BFGS); the inverse
  regularization ``C`` chosen from ``--logreg-cs`` on the validation AUC. Deterministic: one
  eval AUC (repeated for each seed).

    .venv/bin/python benchmarks/baselines.py --config configs/adult.toml --out /tmp/bench/b.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from sklearn.metrics import roc_auc_score

from raydlrm import load_config
from raydlrm.ingestion import DataConfig

MAX_LIST_VALUES = 64


def validation_split(data: DataConfig, *, seed: int = 0, fraction: float = 0.2) -> tuple[str, str]:
    """``fit/`` and ``valid/`` beside the training data: its rows shuffled with ``seed``, a
    ``fraction`` held out. Written once (kept when there: the data writers remove them when
    they write the data again), returned as paths."""
    root = Path(data.train_path).parent
    fit, valid = root / "fit", root / "valid"
    if not (fit / "part-00000.parquet").exists() or not (valid / "part-00000.parquet").exists():
        table = pq.read_table(data.train_path)
        order = np.random.default_rng(seed).permutation(table.num_rows)
        cut = round(table.num_rows * fraction)
        for path, rows in ((valid, order[:cut]), (fit, order[cut:])):
            path.mkdir(parents=True, exist_ok=True)
            pq.write_table(
                table.take(pa.array(np.sort(rows))),
                path / "part-00000.parquet",
                row_group_size=2048,
            )
    return str(fit), str(valid)


@dataclass
class Frame:
    """A split as the baselines read it: labels, dense values, sparse columns (lists)."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: dict[str, list]

    @classmethod
    def read(cls, path: str, data: DataConfig) -> Frame:
        table = pq.read_table(path)
        dense = np.stack(
            [
                table[c].cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
                for c in data.dense_columns
            ],
            axis=1,
        )
        return cls(
            labels=table[data.label_column].to_numpy().astype(np.float32),
            dense=dense,
            sparse={c: table[c].to_pylist() for c in data.sparse_columns},
        )


# --- GBDT ------------------------------------------------------------------------------------


def _gbdt_features(frames: list[Frame], data: DataConfig):
    """pandas frames for LightGBM: dense as is, categoricals with the first frame's levels."""
    import pandas as pd

    out = [pd.DataFrame(f.dense, columns=data.dense_columns) for f in frames]
    for c in data.sparse_columns:
        first = frames[0].sparse[c]
        if first and isinstance(first[0], list):
            values = sorted({v for row in first for v in row})
            if len(values) > MAX_LIST_VALUES:
                continue
            for frame, df in zip(frames, out, strict=True):
                for v in values:
                    df[f"{c}={v}"] = [int(v in row) for row in frame.sparse[c]]
        else:
            levels = sorted(set(first), key=str)
            known = set(levels)
            for frame, df in zip(frames, out, strict=True):
                values = [v if v in known else None for v in frame.sparse[c]]  # unseen: missing
                df[c] = pd.Categorical(values, categories=levels)
    return out


def gbdt(train: Frame, fit: Frame, valid: Frame, evaluation: Frame, data, *, trials, seeds):
    import lightgbm as lgb

    x_fit, x_valid, x_train, x_eval = _gbdt_features([fit, valid, train, evaluation], data)
    rng = np.random.default_rng(0)
    grid = {
        "num_leaves": [15, 31, 63, 127],
        "learning_rate": [0.02, 0.05, 0.1],
        "min_child_samples": [10, 20, 50, 100],
        "colsample_bytree": [0.6, 0.8, 1.0],
        "reg_lambda": [0.0, 1.0, 10.0],
    }
    best = (-1.0, None, 0)
    for _ in range(trials):
        params = {k: v[rng.integers(len(v))] for k, v in grid.items()}
        model = lgb.LGBMClassifier(n_estimators=3000, verbose=-1, random_state=0, **params)
        model.fit(
            x_fit,
            fit.labels,
            eval_set=[(x_valid, valid.labels)],
            eval_metric="auc",
            callbacks=[lgb.early_stopping(100, verbose=False)],
        )
        auc = model.best_score_["valid_0"]["auc"]
        if auc > best[0]:
            best = (auc, params, model.best_iteration_)
    valid_auc, params, rounds = best
    rounds = max(1, round(rounds * len(train.labels) / len(fit.labels)))
    aucs = []
    for seed in range(seeds):
        model = lgb.LGBMClassifier(n_estimators=rounds, verbose=-1, random_state=seed, **params)
        model.fit(x_train, train.labels)
        aucs.append(float(roc_auc_score(evaluation.labels, model.predict_proba(x_eval)[:, 1])))
    return {"valid_auc": valid_auc, "params": params, "rounds": rounds, "eval_aucs": aucs}


# --- FM --------------------------------------------------------------------------------------


class _Encoder:
    """Feature indices and values of the FM: one index per training value of each sparse column
    (and one for its unseen values), one per dense column (the standardized value)."""

    def __init__(self, frame: Frame, data: DataConfig):
        self.data = data
        self.vocab: dict[str, dict] = {}
        self.unseen: dict[str, int] = {}
        self.widths: dict[str, int] = {}
        offset = len(data.dense_columns)
        for c in data.sparse_columns:
            rows = [r if isinstance(r, list) else [r] for r in frame.sparse[c]]
            values = sorted({v for row in rows for v in row}, key=str)
            self.unseen[c] = offset
            self.vocab[c] = {v: offset + 1 + i for i, v in enumerate(values)}
            self.widths[c] = max(len(r) for r in rows)
            offset += len(values) + 1
        self.size = offset
        self.mean, self.std = frame.dense.mean(axis=0), frame.dense.std(axis=0) + 1e-9

    def encode(self, frame: Frame) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index, value)``, ``(N, width)`` each; padding has value 0 (an id list's values
        weigh 1/length; a list longer than the training data's longest is cut)."""
        n, d = len(frame.labels), len(self.data.dense_columns)
        width = d + sum(self.widths.values())
        index = np.zeros((n, width), dtype=np.int64)
        value = np.zeros((n, width), dtype=np.float32)
        index[:, :d] = np.arange(d)
        value[:, :d] = (frame.dense - self.mean) / self.std
        col = d
        for c in self.data.sparse_columns:
            vocab, unseen, w = self.vocab[c], self.unseen[c], self.widths[c]
            for i, row in enumerate(frame.sparse[c]):
                items = row if isinstance(row, list) else [row]
                for j, v in enumerate(items[:w]):
                    index[i, col + j] = vocab.get(v, unseen)
                    value[i, col + j] = 1.0 / len(items)
            col += w
        return torch.from_numpy(index), torch.from_numpy(value)


class FactorizationMachine(torch.nn.Module):
    """``bias + sum w_i x_i + sum_{i<j} <v_i, v_j> x_i x_j`` (Rendle 2010)."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(()))
        self.linear = torch.nn.Embedding(size, 1)
        self.factors = torch.nn.Embedding(size, dim)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.normal_(self.factors.weight, std=0.01)

    def forward(
        self, index: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits, and the squared norm of the factors looked up (for L2)."""
        factors = self.factors(index)
        v = factors * value.unsqueeze(2)
        pairs = 0.5 * (v.sum(1).square() - v.square().sum(1)).sum(1)
        logits = self.bias + (self.linear(index).squeeze(2) * value).sum(1) + pairs
        return logits, factors.square().sum()


def _fm_epochs(encoded, labels, tests, *, dim, lr, l2, epochs, seed, size, patience=2):
    """Trains an FM; yields after each epoch the AUC of each ``(encoded, labels)`` of ``tests``;
    stops ``patience`` epochs after the first test's best."""
    torch.manual_seed(seed)
    model = FactorizationMachine(size, dim)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    index, value = encoded
    target = torch.from_numpy(labels)
    history, best = [], (-1.0, 0)
    for epoch in range(epochs):
        for batch in torch.randperm(len(target)).split(1024):
            logits, norm = model(index[batch], value[batch])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target[batch])
            opt.zero_grad()
            (loss + l2 * norm / len(batch)).backward()
            opt.step()
        with torch.no_grad():
            aucs = [float(roc_auc_score(y, torch.sigmoid(model(*x)[0]).numpy())) for x, y in tests]
        history.append(aucs)
        if aucs[0] > best[0]:
            best = (aucs[0], epoch)
        elif epoch - best[1] >= patience:
            break
    return history


def fm(train, fit, valid, evaluation, data, *, dims, seeds, max_epochs):
    torch.set_num_threads(2)
    enc = _Encoder(fit, data)
    grid = list(itertools.product(dims, [1e-3, 3e-3, 1e-2], [0.0, 1e-6, 1e-5]))
    best = (-1.0, None, 0)
    fit_x, valid_x = enc.encode(fit), enc.encode(valid)
    for dim, lr, l2 in grid:
        history = _fm_epochs(
            fit_x, fit.labels, [(valid_x, valid.labels)], dim=dim, lr=lr, l2=l2,
            epochs=max_epochs, seed=0, size=enc.size,
        )  # fmt: skip
        epoch, (auc,) = max(enumerate(history), key=lambda e: e[1][0])
        if auc > best[0]:
            best = (auc, {"dim": dim, "lr": lr, "l2": l2}, epoch + 1)
    valid_auc, params, epochs = best
    enc = _Encoder(train, data)
    train_x, eval_x = enc.encode(train), enc.encode(evaluation)
    aucs = []
    for seed in range(seeds):
        history = _fm_epochs(
            train_x, train.labels, [(eval_x, evaluation.labels)], epochs=epochs, seed=seed,
            size=enc.size, patience=epochs, **params,
        )  # fmt: skip
        aucs.append(history[-1][0])
    return {"valid_auc": valid_auc, "params": params, "epochs": epochs, "eval_aucs": aucs}


# --- logistic regression ----------------------------------------------------------------


def _onehot(frames: list[Frame], data: DataConfig):
    """Sparse design matrices: the first frame's values of each sparse column as 0/1 columns
    (every value of an id list; a value the first frame lacks sets none), then the dense
    columns standardized with the first frame's mean and deviation."""
    from scipy import sparse

    first = frames[0]
    vocab: dict[str, dict] = {}
    offset = 0
    for c in data.sparse_columns:
        values = {v for r in first.sparse[c] for v in (r if isinstance(r, list) else [r])}
        vocab[c] = {v: offset + i for i, v in enumerate(sorted(values, key=str))}
        offset += len(values)
    mean, std = first.dense.mean(axis=0), first.dense.std(axis=0) + 1e-9
    out = []
    for frame in frames:
        n = len(frame.labels)
        rows, cols = [], []
        for c in data.sparse_columns:
            known = vocab[c]
            for i, r in enumerate(frame.sparse[c]):
                for v in r if isinstance(r, list) else [r]:
                    j = known.get(v)
                    if j is not None:
                        rows.append(i)
                        cols.append(j)
        ones = sparse.csr_matrix(
            (np.ones(len(rows), dtype=np.float64), (rows, cols)), shape=(n, offset)
        )
        ones.data[:] = 1.0  # a value repeated in a list is still one 0/1 column
        dense = sparse.csr_matrix((frame.dense - mean) / std)
        out.append(sparse.hstack([ones, dense], format="csr"))
    return out


def logreg(train, fit, valid, evaluation, data, *, cs=(0.01, 0.1, 1.0, 10.0), seeds=1):
    """L2 logistic regression on one-hot sparse and standardized dense columns: ``C`` chosen on
    the validation AUC, then trained on the whole training data (deterministic: the one eval
    AUC is repeated ``seeds`` times, so that its entry reads like the others)."""
    from sklearn.linear_model import LogisticRegression

    def fitted(x, y, c):
        return LogisticRegression(C=c, max_iter=2000, solver="lbfgs").fit(x, y)

    x_fit, x_valid = _onehot([fit, valid], data)
    scores = {}
    for c in cs:
        model = fitted(x_fit, fit.labels, c)
        scores[c] = float(roc_auc_score(valid.labels, model.predict_proba(x_valid)[:, 1]))
    best = max(scores, key=scores.get)
    x_train, x_eval = _onehot([train, evaluation], data)
    model = fitted(x_train, train.labels, best)
    auc = float(roc_auc_score(evaluation.labels, model.predict_proba(x_eval)[:, 1]))
    return {
        "valid_auc": scores[best],
        "params": {"C": best},
        "valid_aucs": {str(c): a for c, a in scores.items()},
        "features": x_train.shape[1],
        "eval_aucs": [auc] * seeds,
    }


def run(
    config: str,
    *,
    seeds: int,
    gbdt_trials: int,
    fm_dims,
    fm_epochs,
    methods,
    logreg_cs=(0.01, 0.1, 1.0, 10.0),
) -> dict:
    data = load_config(config).data
    fit_path, valid_path = validation_split(data)
    frames = {
        name: Frame.read(path, data)
        for name, path in (
            ("train", data.train_path),
            ("fit", fit_path),
            ("valid", valid_path),
            ("eval", data.eval_path),
        )
    }
    args = (frames["train"], frames["fit"], frames["valid"], frames["eval"], data)
    out = {}
    if "gbdt" in methods:
        start = time.perf_counter()
        out["gbdt"] = gbdt(*args, trials=gbdt_trials, seeds=seeds)
        out["gbdt"]["seconds"] = time.perf_counter() - start
        print("gbdt", json.dumps(out["gbdt"]), flush=True)
    if "fm" in methods:
        start = time.perf_counter()
        out["fm"] = fm(*args, dims=fm_dims, seeds=seeds, max_epochs=fm_epochs)
        out["fm"]["seconds"] = time.perf_counter() - start
        print("fm", json.dumps(out["fm"]), flush=True)
    if "logreg" in methods:
        start = time.perf_counter()
        out["logreg"] = logreg(*args, cs=logreg_cs, seeds=seeds)
        out["logreg"]["seconds"] = time.perf_counter() - start
        print("logreg", json.dumps(out["logreg"]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a raydlrm config (its data)")
    parser.add_argument("--methods", default="gbdt,fm", help="of gbdt, fm, logreg")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--gbdt-trials", type=int, default=20)
    parser.add_argument("--fm-dims", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--fm-epochs", type=int, default=20)
    parser.add_argument("--logreg-cs", type=float, nargs="+", default=[0.01, 0.1, 1.0, 10.0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench/baselines.json"))
    args = parser.parse_args()
    result = run(
        args.config,
        seeds=args.seeds,
        gbdt_trials=args.gbdt_trials,
        fm_dims=args.fm_dims,
        fm_epochs=args.fm_epochs,
        methods=args.methods.split(","),
        logreg_cs=args.logreg_cs,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": args.config, **result}, indent=1))


if __name__ == "__main__":
    main()
