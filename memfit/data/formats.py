"""Render a record as text segments, each marked trainable (carries loss) or not.

Formats:
- `text`: `{"text": ...}`; all of it is trainable.
- `alpaca`: `{"instruction", "input" (optional), "output"}`; the prompt (ALPACA_PROMPT) is masked,
  the output is trainable.
- `chat`: `{"messages": [{"role", "content"}, ...]}`, or ShareGPT `{"conversations": [{"from",
  "value"}, ...]}` (mapped: human->user, gpt->assistant). Rendered with the tokenizer's chat
  template, or memfit's built-in `CHAT_TEMPLATE` when the tokenizer has none; every assistant
  turn is trainable (multi-turn), everything else is masked.

Text fields must hold strings: a null, a number or a list where text belongs is a malformed record
(reported with its file and line, or skipped and counted with data.skip_bad_records), never trained on
as "None"; only alpaca's optional `input` may be absent or null.

Field names can be remapped (`data.fields: {instruction: question, output: answer}`): keys are
memfit's names, values the names in your data.
"""

from __future__ import annotations

from memfit.data.sources import DataError
from memfit.models.tokenizer import CHAT_TEMPLATE

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "system": "system", "tool": "tool"}
FORMATS = ("auto", "text", "alpaca", "chat")

Segment = tuple[str, bool]  # (text, trainable)


def remap_fields(record: dict, fields: dict[str, str]) -> dict:
    """Rename the user's columns to memfit's names (`fields` maps memfit name -> user's name)."""
    if not fields:
        return record
    record = dict(record)
    for ours, theirs in fields.items():
        if theirs in record:
            record[ours] = record.pop(theirs)
    return record


def text_field(record: dict, key: str, name: str | None = None, optional: bool = False) -> str:
    """`record[key]` if it is a string. A null or a number where text belongs is a record error, not
    the text "None" or "42" to train on; `optional`: absent or null reads as "" (alpaca's `input`).
    `name`: how the message calls the field (messages[2].content)."""
    value = record.get(key) if optional else record[key]  # KeyError: the caller reports the missing field
    if isinstance(value, str):
        return value
    if value is None and optional:
        return ""
    got = "null" if value is None else f"{_KIND.get(type(value), 'a ' + type(value).__name__)} ({_short(value)})"
    raise DataError(f"field '{name or key}' is {got}, expected text (a string)")


_KIND = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def detect_format(record: dict) -> str:
    if "messages" in record or "conversations" in record:
        return "chat"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "text" in record:
        return "text"
    raise DataError(f"cannot tell the format from fields {sorted(record)}: expected 'text', "
                    "'instruction'+'output', 'messages' or 'conversations'; set data.format, "
                    "or map your field names with data.fields")


def chat_messages(record: dict) -> list[dict]:
    """`messages` (role/content) or ShareGPT `conversations` (from/value) -> role/content dicts."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in messages):
            raise DataError("'messages' must be a list of objects with 'role' and 'content'")
        for i, message in enumerate(messages):
            text_field(message, "role", f"messages[{i}].role")
            text_field(message, "content", f"messages[{i}].content")
        return messages
    turns = record["conversations"]
    if not isinstance(turns, list) or not all(isinstance(t, dict) and "from" in t and "value" in t for t in turns):
        raise DataError("'conversations' must be a list of objects with 'from' and 'value' (ShareGPT)")
    messages = []
    for i, turn in enumerate(turns):
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise DataError(f"unknown ShareGPT speaker '{turn['from']}'; known: {', '.join(SHAREGPT_ROLES)}")
        messages.append({"role": role, "content": text_field(turn, "value", f"conversations[{i}].value")})
    return messages


def chat_template_for(tokenizer) -> str | None:
    """None = use the tokenizer's own; else memfit's documented built-in template."""
    return None if getattr(tokenizer, "chat_template", None) else CHAT_TEMPLATE


def render_chat(messages: list[dict], tokenizer) -> list[Segment]:
    """Render incrementally so each assistant turn's text is known exactly: the text the template
    adds for turn i is trainable when turn i is the assistant's, masked otherwise."""
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("the conversation has no assistant message to learn from")
    template = chat_template_for(tokenizer)

    def text(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, chat_template=template,
                                             add_generation_prompt=generation_prompt)

    segments: list[Segment] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, full = text(i, True), text(i + 1, False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise DataError("the chat template does not render the conversation turn by turn "
                            "(an earlier turn's text changes when a later one is added)")
        segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    rest = text(len(messages), False)[len(done):]  # turns after the last assistant reply
    if rest:
        segments.append((rest, False))
    return [s for s in segments if s[0]]


def render_segments(record: dict, fmt: str, tokenizer) -> tuple[list[Segment], bool]:
    """-> (segments, templated). `templated` = the text already holds the special tokens (chat
    templates add them), so the encoder must not add BOS/EOS itself."""
    if fmt == "auto":
        fmt = detect_format(record)
    try:
        if fmt == "text":
            return [(text_field(record, "text"), True)], False
        if fmt == "alpaca":
            instruction, output = text_field(record, "instruction"), text_field(record, "output")
            extra = text_field(record, "input", optional=True)
            template = ALPACA_PROMPT if extra else ALPACA_PROMPT_NO_INPUT
            return [(template.format(instruction=instruction, input=extra), False), (output, True)], False
        if fmt == "chat":
            if "messages" not in record and "conversations" not in record:
                raise KeyError("messages")
            return render_chat(chat_messages(record), tokenizer), True
    except KeyError as exc:
        raise DataError(f"missing field {exc} for format '{fmt}'") from None
    raise DataError(f"unknown format '{fmt}'; known: {', '.join(FORMATS)}")
