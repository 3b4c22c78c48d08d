"""ConfigError, and how pydantic's validation errors become its problems: one line each, with its field path."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from memfit.errors import MemfitError

# The cross-field rules reach pydantic as one ValueError; their problems are joined by this, split again here.
PROBLEMS_SEPARATOR = "\n"

Model = TypeVar("Model", bound=BaseModel)


class ConfigError(MemfitError, ValueError):
    """Every problem in a config, one per line, each with its field path."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} has {len(problems)} problem(s):\n{lines}")


def _describe(error: dict) -> str:
    where = ".".join(str(p) for p in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    if error["type"] == "literal_error":
        return f"{where}: got {error['input']!r}; allowed: {error['ctx']['expected']}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message} (got {error['input']!r})"


def _unknown_field_hint(path: tuple, model: type[BaseModel], renamed: Mapping[str, str]) -> str:
    """Suggest the closest known field for a typo like `micro_bach`; at the top level the flat keys in
    `renamed` are known too, and suggested by the sectioned path they stand for."""
    top = model
    for part in path[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None) if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    aliases = renamed if model is top else {}
    known = list(model.model_fields) + list(aliases)
    close = difflib.get_close_matches(str(path[-1]), known, n=1)
    return f" (did you mean '{aliases.get(close[0], close[0])}'?)" if close else ""


def validated(model: type[Model], raw: dict, source: str = "config",
              renamed: Mapping[str, str] | None = None) -> Model:
    """`raw` validated as `model`, or a ConfigError listing every problem at once."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if not err["loc"] and err["type"] == "value_error":  # the cross-field rules, one per line
                problems += err["msg"].removeprefix("Value error, ").split(PROBLEMS_SEPARATOR)
                continue
            text = _describe(err)
            if err["type"] == "extra_forbidden":
                text += _unknown_field_hint(err["loc"], model, renamed or {})
            problems.append(text)
        raise ConfigError(problems, source) from None
