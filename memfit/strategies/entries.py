"""The one lookup every table of entries (optimizers, precisions, ...) offers: names in table order, and
the entry for a name with an error that names the config field and the choices."""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

from memfit.errors import MemfitError

Entry = TypeVar("Entry")


def entry_lookup(entries: Sequence[Entry], field: str) -> tuple[tuple[str, ...], Callable[[str], Entry]]:
    """(the entries' names in table order, name -> entry) for the config field `field`."""
    by_name = {entry.name: entry for entry in entries}
    names = tuple(by_name)

    def lookup(name: str) -> Entry:
        if name not in by_name:
            raise MemfitError(f"{field}: unknown '{name}'; allowed: {', '.join(names)}")
        return by_name[name]

    return names, lookup
