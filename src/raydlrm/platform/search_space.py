"""A sweep's search space: a dotted config key and a distribution per dimension
(``[tune.search]``, ``--search``), parsed and checked against the config before any trial
starts, and how many trials it asks for."""

from __future__ import annotations

import json
import logging
import math
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tomllib

from raydlrm.platform.config import ConfigError, JobConfig, load_config, parse_value

__all__ = ["DEFAULT_TRIALS", "Dimension", "check_space", "num_samples", "override", "parse_search"]

logger = logging.getLogger(__name__)

_DISTRIBUTION = re.compile(r"^\s*(choice|grid|uniform|loguniform|randint)\s*\((.*)\)\s*$", re.S)
_NUMERIC = ("uniform", "loguniform", "randint")


@dataclass(frozen=True)
class Dimension:
    """One key of a search space and its distribution."""

    key: str
    kind: str
    """``choice``, ``grid``, ``uniform``, ``loguniform`` or ``randint``."""
    values: tuple[Any, ...]
    """The choices, or ``(low, high)``."""

    def domain(self) -> Any:
        """The Ray Tune domain."""
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.values))
        if self.kind == "grid":
            return tune.grid_search(list(self.values))
        sampler = {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}
        return sampler[self.kind](*self.values)

    def corners(self) -> list[Any]:
        """The values a config must accept: every choice, or both ends of the range."""
        if self.kind in ("choice", "grid"):
            return list(self.values)
        low, high = self.values
        return [low, high - 1 if self.kind == "randint" else high]


def _values(text: str) -> list[Any]:
    """A distribution's arguments: TOML values (``1e-3``, ``"dlrm"``, ``[64, 32]``), a bare
    word taken as a string, a bare ``null`` as None (as ``--set`` reads them)."""
    try:
        return tomllib.loads(f"v = [{text}]")["v"]
    except tomllib.TOMLDecodeError:
        return [parse_value(token.strip()) for token in text.split(",")]


def parse_search(expressions: Mapping[str, str] | Sequence[str]) -> dict[str, Dimension]:
    """A search space from ``key = distribution`` expressions (``[tune.search]``) or
    ``key=distribution`` strings (``--search``): ``choice(a, b, ...)``, ``grid(a, b, ...)``,
    ``uniform(lo, hi)``, ``loguniform(lo, hi)``, ``randint(lo, hi)`` (``hi`` excluded).

    Raises:
        ConfigError: an expression that is not one of these, naming its key.
    """
    if isinstance(expressions, Mapping):
        items = list(expressions.items())
    else:
        items = []
        for expression in expressions:
            key, sep, text = expression.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--search {expression!r} is not of the form key=distribution")
            items.append((key.strip(), text))
    space = {}
    for key, text in items:
        space[key] = _dimension(key, text)
    return space


def _dimension(key: str, text: str) -> Dimension:
    match = _DISTRIBUTION.match(text)
    if match is None:
        raise ConfigError(
            f"tune.search.{key}: {text.strip()!r} is not a distribution: choice(a, b, ...), "
            "grid(a, b, ...), uniform(lo, hi), loguniform(lo, hi) or randint(lo, hi)"
        )
    kind, values = match.group(1), _values(match.group(2))
    if kind in ("choice", "grid"):
        if not values:
            raise ConfigError(f"tune.search.{key}: {kind}() needs at least one value")
        return Dimension(key, kind, tuple(values))
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if len(values) != 2 or not numbers:
        raise ConfigError(f"tune.search.{key}: {kind}(lo, hi) needs two numbers, got {values}")
    low, high = values
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ConfigError(f"tune.search.{key}: {kind}({low}, {high}) needs finite ends")
    if not low < high:
        raise ConfigError(f"tune.search.{key}: {kind}({low}, {high}) is empty (lo >= hi)")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"tune.search.{key}: loguniform needs lo > 0, got {low}")
    if kind == "randint" and not all(isinstance(v, int) for v in values):
        raise ConfigError(f"tune.search.{key}: randint(lo, hi) needs integers, got {values}")
    return Dimension(key, kind, (low, high))


def override(key: str, value: Any) -> str:
    """``key=value`` as ``--set`` takes it (JSON is TOML for numbers, strings and arrays)."""
    return f"{key}={json.dumps(value)}"


def _current(job: JobConfig, key: str) -> Any:
    node: Any = job.to_dict()
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"tune.search.{key}: unknown config key")
        node = node[part]
    return node


def _number_type(job: JobConfig, key: str, current: Any) -> type | None:
    """``int`` or ``float`` when ``key`` holds a number: its value's type, or for an unset
    (None) key, the number type its field admits (``sharding.cache_load_factor`` is unset by
    default: a default per kind); None otherwise."""
    if current is not None:
        numeric = isinstance(current, int | float) and not isinstance(current, bool)
        return type(current) if numeric else None
    node: Any = type(job)
    for part in key.split("."):
        field = getattr(node, "__pydantic_fields__", {}).get(part)
        if field is None:
            return None
        node = field.annotation
    admitted = typing.get_args(node)
    return float if float in admitted else int if int in admitted else None


def check_space(job: JobConfig, space: Mapping[str, Dimension]) -> None:
    """Checks a search space against ``job`` before any trial: every key is a config key, a
    numeric distribution is on a numeric key, every choice and both ends of every range are
    values the config accepts, and the point of every key's first value is a valid config.

    Raises:
        ConfigError: naming the key (and value) that fails.
    """
    for dim in space.values():
        current = _current(job, dim.key)
        number = _number_type(job, dim.key, current)
        if dim.kind in _NUMERIC and number is None:
            raise ConfigError(
                f"tune.search.{dim.key}: {dim.kind}() needs a numeric key; {dim.key} is "
                f"{current!r}: use choice(...)"
            )
        if dim.kind in ("uniform", "loguniform") and number is int:
            raise ConfigError(
                f"tune.search.{dim.key}: an integer key; use randint(lo, hi) or choice(...)"
            )
        for value in dim.corners():
            try:
                load_config(job, overrides=[override(dim.key, value)])
            except ConfigError as e:
                raise ConfigError(f"tune.search.{dim.key} = {value!r}: {e}") from None
    first = [override(d.key, d.corners()[0]) for d in space.values()]
    try:
        load_config(job, overrides=first)
    except ConfigError as e:
        raise ConfigError(f"the search space's first point ({', '.join(first)}): {e}") from None


DEFAULT_TRIALS = 8
"""Trials sampled when ``tune.num_trials`` is unset and a key is not a grid."""


def num_samples(num_trials: int | None, space: Mapping[str, Dimension]) -> int:
    """Tune's samples of ``space``: ``num_trials``, else :data:`DEFAULT_TRIALS`, or one when
    every key is a ``grid`` (its points are the trials: more samples repeat them, with a
    warning when asked for)."""
    all_grid = all(d.kind == "grid" for d in space.values())
    if num_trials is None:
        return 1 if all_grid else DEFAULT_TRIALS
    if all_grid and num_trials > 1:
        points = math.prod(len(d.values) for d in space.values())
        logger.warning(
            "every searched key is a grid (%d points): tune.num_trials = %d runs each point "
            "%d times with the same settings (%d trials); leave it unset to run each once",
            points,
            num_trials,
            num_trials,
            points * num_trials,
        )
    return num_trials
