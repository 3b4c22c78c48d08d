"""Byte sizes: read them from what users write, print them with the unit named.

One rule for every size a user gives (`--budget`, `--margin`, `--host-ram`, `budget`, `memory.limit`):
a number and a unit, case-insensitive, with an optional space: `24GiB`, `24 gib`, `80GB`, `512MiB`.
Binary units (GiB = 2^30 bytes) are what memfit prints; GB/MB are read as decimal (10^9, 10^6).
A bare number is refused: `24` could mean bytes or GiB, and guessing wrong plans a run 2^30 times off.
"""

from __future__ import annotations

import re

from memfit.errors import MemfitError

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE = re.compile(r"\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)
UNIT_NAMES = "B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB"
EXAMPLE = "e.g. 24GiB (2^30 bytes) or 24GB (10^9 bytes)"


class SizeError(MemfitError, ValueError):
    """A size written without a unit or in a form memfit does not read. A ValueError too, so that a
    config field's validator reports it under the field's path."""


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n):,} B"


def unit_bytes(unit: str) -> int | None:
    """Bytes in one `unit` (case-insensitive: b, kb, kib, ..., pib), or None for anything else."""
    unit = unit.lower()
    if unit == "b":
        return 1
    if len(unit) == 2 and unit[1] == "b" and unit[0] in _POWERS:
        return 1000 ** _POWERS[unit[0]]
    if len(unit) == 3 and unit[1:] == "ib" and unit[0] in _POWERS:
        return 1024 ** _POWERS[unit[0]]
    return None


def parse_bytes(text: str | int | float) -> int:
    """'24GiB', '24 gib', '80GB', '512MiB', '1.5TB' -> bytes. Raises SizeError for a bare number
    (0 aside: zero bytes in every unit) or an unknown unit. Negative sizes parse; callers say
    what range they accept."""
    if isinstance(text, bool):  # YAML `true` is no size; str(True) would be read as a unit-less word
        raise SizeError(f"cannot read {text!r} as a size; write a number and a unit, {EXAMPLE}")
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise SizeError(f"cannot read {str(text)!r} as a size; write a number and a unit, {EXAMPLE}")
    number, unit = float(match.group(1)), match.group(2)
    if not unit:
        if number == 0:
            return 0
        raise SizeError(f"{str(text).strip()!r} has no unit: add a unit, {EXAMPLE}")
    size = unit_bytes(unit)
    if size is None:
        raise SizeError(f"cannot read {str(text)!r} as a size: unknown unit {unit!r}; use one of {UNIT_NAMES} "
                        f"(case-insensitive), {EXAMPLE}")
    return int(number * size)
