"""CSV that spreadsheets open as data: every file Klique writes as CSV goes through `csv_bytes`.

A cell whose text begins with `=`, `+`, `-`, `@`, a tab or a line break is a formula to Excel, LibreOffice
and Google Sheets (`=HYPERLINK(...)`, `=cmd|...`); names people choose (projects, cost centres, models)
reach these files. As OWASP's CSV injection guidance says, such a cell is written with a leading `'`,
which spreadsheets show as text, and every field is quoted. Full-width forms of those characters are
treated alike, since some spreadsheets fold them. Numbers (int, Decimal) are written as numbers.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n", "\uff1d", "\uff0b", "\uff0d", "\uff20")


def cell(value: Any) -> Any:
    """The value as a CSV cell: text that a spreadsheet would evaluate is neutralised."""
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, bool) or not isinstance(value, str):
        return value
    return f"'{value}" if value.startswith(FORMULA_STARTS) else value


def csv_bytes(columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)
    writer.writeheader()
    writer.writerows({key: cell(value) for key, value in row.items()} for row in rows)
    return out.getvalue().encode()
