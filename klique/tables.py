"""Plain-text tables for the terminal."""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, max_width: int = 60) -> str:
    cells = [[_cell(value, max_width) for value in row] for row in rows]
    widths = [max([len(header), *(len(row[index]) for row in cells)]) for index, header in enumerate(headers)]
    lines = ["  ".join(header.upper().ljust(width) for header, width in zip(headers, widths, strict=True))]
    lines += [
        "  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)) for row in cells
    ]
    return "\n".join(line.rstrip() for line in lines)


def _cell(value: object, max_width: int) -> str:
    text = "-" if value is None or value == "" else str(value)
    return text if len(text) <= max_width else text[: max_width - 1] + "…"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
