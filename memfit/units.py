"""Byte sizes: read them from what users write, print them with the unit named.

Binary units (GiB = 2^30 bytes) are what memfit prints; GB/MB are read as decimal.
"""

from __future__ import annotations

import re

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_SIZE = re.compile(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*")


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n):,} B"


def parse_bytes(text: str) -> int:
    """'24GiB', '24 GB', '512MiB', '1e9' -> bytes. GB/MB are decimal, GiB/MiB binary."""
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise ValueError(f"cannot read '{text}' as a size; use e.g. 24GiB, 80GB or 512MiB")
    number, unit = float(match.group(1)), (match.group(2) or "B")
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    if unit == "B":
        return int(number)
    base = 1024 if unit.endswith("iB") else 1000
    return int(number * base ** powers[unit[0]])
