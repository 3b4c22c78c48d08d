"""Read records from files and render them as (prompt, response) text.

Every record carries its location ("file:line") so a bad one can be reported precisely.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from memfit.errors import MemfitError

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


class DataError(MemfitError):
    """A record or file that cannot be used; the message names file and line."""


def resolve_path(path: str) -> Path:
    if path == "builtin:demo":
        from memfit.data.demo import DEMO_PATH

        return DEMO_PATH
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise DataError(f"data.path: {path} does not exist")
    return resolved


def read_jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record


def detect_format(record: dict) -> str:
    if "messages" in record:
        return "chat"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "text" in record:
        return "text"
    raise DataError(f"cannot tell the format from fields {sorted(record)}: expected 'text', "
                    "'instruction'+'output', or 'messages'; or set data.format")


def render(record: dict, fmt: str, tokenizer, where: str) -> tuple[str, str]:
    """(prompt, response). Loss goes on the response; plain text is all response."""
    try:
        if fmt == "auto":
            fmt = detect_format(record)
        if fmt == "text":
            return "", str(record["text"])
        if fmt == "alpaca":
            template = ALPACA_PROMPT if record.get("input") else ALPACA_PROMPT_NO_INPUT
            return template.format(instruction=record["instruction"], input=record.get("input", "")), str(record["output"])
        if fmt == "chat":
            messages = record["messages"]
            if not messages or messages[-1].get("role") != "assistant":
                raise DataError("the last message must be the assistant's")
            prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(messages, tokenize=False)
            if not full.startswith(prompt):
                raise DataError("chat template does not render the conversation as prompt + reply")
            return prompt, full[len(prompt):]
    except KeyError as exc:
        raise DataError(f"{where}: missing field {exc} for format '{fmt}'") from None
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None
    raise DataError(f"{where}: unknown format '{fmt}'")
