"""Plain-text tables for the terminal (the plan's per-rank table, a sweep's trials)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["text_table"]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """``header`` and ``rows`` as left-aligned columns two spaces apart, a rule of dashes under
    the header; one string a line."""
    widths = [max(len(x) for x in column) for column in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines
