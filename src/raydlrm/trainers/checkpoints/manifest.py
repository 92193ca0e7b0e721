"""Manifests and verification: what every rank wrote into a checkpoint, and whether it is intact.

Every rank writes ``manifest.rank<r>.json`` last (:func:`write_manifest`): the size and CRC-32
of each file it wrote. :func:`verify_checkpoint` checks a checkpoint against its manifests
(every rank's present, every file there with its size, and with ``checksums`` its CRC-32): a
truncated shard or state file is found before a load fails on it. A delta's chain is checked
with it (each checkpoint of the chain intact, of the same chain and plan), so a delta whose
chain is damaged, missing or foreign is damaged itself. :func:`check_intact` raises on the
first problems, before anything reads the shards.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from raydlrm.trainers.checkpoints.chains import sibling_path
from raydlrm.trainers.checkpoints.format import (
    MANIFEST_PREFIX,
    STATE_FILE,
    CheckpointDamagedError,
    read_json,
)

__all__ = ["check_intact", "verify_checkpoint", "write_manifest"]


def _crc32(filesystem: pafs.FileSystem, path: str) -> int:
    crc = 0
    with filesystem.open_input_stream(path) as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: str | Path, *, rank: int, world_size: int) -> Path:
    """Writes ``manifest.rank<rank>.json`` into ``directory``: the size and CRC-32 of every
    file this rank wrote there (call it last, once the rank's files are complete)."""
    path = Path(directory)
    files = {
        p.name: {"bytes": p.stat().st_size, "crc32": _crc32(pafs.LocalFileSystem(), str(p))}
        for p in sorted(path.iterdir())
        if p.is_file() and not p.name.startswith(MANIFEST_PREFIX)
    }
    manifest = path / f"{MANIFEST_PREFIX}{rank:05d}.json"
    manifest.write_text(json.dumps({"rank": rank, "world_size": world_size, "files": files}))
    return manifest


def verify_checkpoint(
    directory: str | Path,
    *,
    checksums: bool = True,
    filesystem: pafs.FileSystem | None = None,
    chain: bool = True,
) -> list[str]:
    """What is wrong with a checkpoint, one line per problem (empty when it is intact): a
    missing or unreadable ``trainer_state.json``, a missing rank manifest, a file missing,
    of another size or (with ``checksums``) another CRC-32 than its manifest says. A
    checkpoint written before manifests existed (format version 1) is checked for its state
    file only.

    Args:
        directory: the checkpoint (a local directory, or a path on ``filesystem``).
        checksums: also read every file for its CRC-32 (else sizes only).
        filesystem: where ``directory`` is (default: the local disk), e.g. an object store.
        chain: for a delta (differential checkpoints), also check the checkpoints its chain
            needs, its siblings: each intact and of the same chain and plan.
    """
    filesystem = filesystem or pafs.LocalFileSystem()
    root = str(directory).rstrip("/")
    infos = {
        i.base_name: i
        for i in filesystem.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        if i.type == pafs.FileType.File
    }
    try:
        state = read_json(filesystem, root, STATE_FILE, present=STATE_FILE in infos)
    except (FileNotFoundError, CheckpointDamagedError) as exc:
        return [str(exc)]
    if state.get("format_version", 1) < 2:
        return []  # written before manifests: nothing more to check against
    problems, seen = [], set()
    for name in sorted(n for n in infos if n.startswith(MANIFEST_PREFIX)):
        try:
            record = read_json(filesystem, root, name, present=True)
        except CheckpointDamagedError as exc:
            problems.append(f"{name} is damaged: {exc.__cause__}")
            continue
        seen.add(int(record["rank"]))
        for file, expected in record["files"].items():
            info = infos.get(file)
            if info is None:
                problems.append(f"{file} is missing")
            elif info.size != expected["bytes"]:
                problems.append(
                    f"{file} has {info.size} bytes, its manifest says {expected['bytes']}"
                )
            elif checksums and _crc32(filesystem, f"{root}/{file}") != expected["crc32"]:
                problems.append(f"{file} does not match its checksum")
    missing = sorted(set(range(int(state["world_size"]))) - seen)
    if missing:
        problems.append(f"no manifest of ranks {missing} (their part was not completed)")
    if chain:
        problems += _chain_problems(root, state, checksums=checksums, filesystem=filesystem)
    return problems


def _chain_problems(
    root: str, state: dict[str, Any], *, checksums: bool, filesystem: pafs.FileSystem
) -> list[str]:
    """What is wrong with the checkpoints a delta needs (its siblings named in its chain):
    each must be intact, of the same chain (its baseline's id), in the same order and with
    the same plan."""
    link = state.get("differential") or {}
    problems = []
    for i, name in enumerate(link.get("chain", [])):
        path = sibling_path(root, name)
        theirs = verify_checkpoint(path, checksums=checksums, filesystem=filesystem, chain=False)
        if theirs:
            problems.append(f"the chain's {name} is damaged or missing: {theirs[0]}")
            continue
        other = read_json(filesystem, path, STATE_FILE, present=True)
        link_of = other.get("differential") or {}
        if link_of.get("chain_id") != link["chain_id"] or link_of.get("chain") != link["chain"][:i]:
            problems.append(
                f"the chain's {name} belongs to another chain (another run or restart): "
                f"it is not this delta's {'baseline' if i == 0 else 'delta ' + str(i)}"
            )
        elif other["plan"] != state["plan"]:
            problems.append(f"the chain's {name} was written with another sharding plan")
    return problems


def check_intact(
    directory: str | Path,
    *,
    filesystem: pafs.FileSystem | None = None,
    checksums: bool = False,
    chain: bool = True,
) -> None:
    """Raises :class:`CheckpointDamagedError` naming the checkpoint and its first problems
    (:func:`verify_checkpoint`, with its ``chain`` when a delta) unless it is intact: before
    anything reads its shards."""
    problems = verify_checkpoint(directory, checksums=checksums, filesystem=filesystem, chain=chain)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointDamagedError(
            f"checkpoint {directory} is damaged: {'; '.join(problems[:3])}{more} "
            "(raydlrm checkpoint verify names every problem)"
        )
