"""Records -> training examples (`input_ids`, `labels` with masked positions at IGNORE_INDEX).

`encode_chunk` is the unit of work every path shares (in-memory, streaming workers, `memfit data
prepare` workers): a list of raw records in, examples and problems out. Problems are returned,
not raised, so a worker process never dies on bad input; `ProblemLog` in the parent decides:
a malformed record, or one over `data.max_record_bytes`, stops the run with its file and line,
unless `data.skip_bad_records`; empty examples and ones with no response tokens left after
truncation are always skipped, counted and reported (never silently trained on). Examples cut to
`data.seq_len` are counted too, with the tokens cut, so the run's summary can say what was lost.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from memfit.data.formats import remap_fields, render_segments
from memfit.data.sources import DataError, OversizeRecord, parse_item

log = logging.getLogger(__name__)
IGNORE_INDEX = -100  # label value that cross-entropy skips

BAD, OVERSIZE, EMPTY, NO_RESPONSE = "malformed", "oversize", "empty", "no-response"
_KIND_TEXT = {BAD: "malformed record(s) skipped (data.skip_bad_records)",
              OVERSIZE: "oversize record(s) skipped (data.skip_bad_records)",
              EMPTY: "empty example(s) skipped: nothing to learn from",
              NO_RESPONSE: "example(s) skipped: the prompt fills seq_len, no response token is left to learn"}


@dataclass(frozen=True)
class EncodeSpec:
    """Everything a worker needs to turn records into examples (picklable)."""

    tokenizer: object
    seq_len: int
    format: str = "auto"
    fields: dict = field(default_factory=dict)
    train_on_prompt: bool = False

    @classmethod
    def from_config(cls, data_cfg, tokenizer, seq_len: int) -> "EncodeSpec":
        return cls(tokenizer, seq_len, data_cfg.format, dict(data_cfg.fields), data_cfg.train_on_prompt)


@dataclass
class ChunkResult:
    examples: list[dict]
    problems: list[tuple[str, str]]  # (kind, message naming where)
    records: int = 0
    truncated: int = 0                 # examples cut to seq_len
    truncated_tokens: int = 0          # tokens cut off them
    first_truncated: str | None = None  # where the first of them came from


def encode_chunk(items: list[tuple[str, object]], spec: EncodeSpec) -> ChunkResult:
    """Parse, render and tokenize a chunk of records (one batched tokenizer call: much faster)."""
    rendered, problems = [], []
    for where, item in items:
        if isinstance(item, OversizeRecord):
            problems.append((OVERSIZE, f"{where}: {item.problem}"))
            continue
        try:
            record = remap_fields(parse_item(where, item), spec.fields)
            segments, templated = render_segments(record, spec.format, spec.tokenizer)
        except DataError as exc:
            message = str(exc)
            problems.append((BAD, message if message.startswith(where) else f"{where}: {message}"))
            continue
        if not any(text.strip() for text, trainable in segments if trainable):
            problems.append((EMPTY, f"{where}: the response/text is empty"))
            continue
        rendered.append((where, segments, templated))
    texts = [text for _, segments, _ in rendered for text, _ in segments]
    ids = spec.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    result = ChunkResult([], problems, len(items))
    cursor = 0
    for where, segments, templated in rendered:
        pieces = ids[cursor:cursor + len(segments)]
        cursor += len(segments)
        example, cut = _assemble(pieces, [t for _, t in segments], templated, spec)
        if example is None:
            problems.append((NO_RESPONSE, f"{where}: no response token left within data.seq_len={spec.seq_len}"))
            continue
        result.examples.append(example)
        if cut:
            result.truncated, result.truncated_tokens = result.truncated + 1, result.truncated_tokens + cut
            result.first_truncated = result.first_truncated or where
    return result


def _assemble(pieces: list[list[int]], trainable: list[bool], templated: bool,
              spec: EncodeSpec) -> tuple[dict | None, int]:
    """-> (example, tokens cut off at seq_len); example None when no response token fits."""
    tok = spec.tokenizer
    bos, eos = tok.bos_token_id, tok.eos_token_id
    input_ids, labels, response = [], [], []  # response[i]: token i belongs to a trainable segment
    if bos is not None and not (templated and pieces and pieces[0][:1] == [bos]):
        input_ids.append(bos)  # chat templates usually render BOS themselves
        labels.append(bos if spec.train_on_prompt else IGNORE_INDEX)
        response.append(False)
    if not templated and eos is not None:
        pieces, trainable = pieces + [[eos]], trainable + [True]  # learn to stop
    for piece, is_response in zip(pieces, trainable):
        input_ids += piece
        labels += piece if (is_response or spec.train_on_prompt) else [IGNORE_INDEX] * len(piece)
        response += [is_response] * len(piece)
    if not any(response[:spec.seq_len]):  # the prompt alone fills seq_len
        return None, 0
    cut = max(len(input_ids) - spec.seq_len, 0)
    return {"input_ids": input_ids[:spec.seq_len], "labels": labels[:spec.seq_len]}, cut


# The kinds that stop the run unless data.skip_bad_records, and what the error adds.
_STOP_HINT = {BAD: "\n(set data.skip_bad_records=true to skip and count such records)",
              OVERSIZE: " (raise it or set data.skip_bad_records=true)"}


class ProblemLog:
    """What one pass over the data read, dropped and cut: skipped examples by kind (a malformed or
    oversize record raises unless skipping is allowed), records read, examples kept, examples cut to
    seq_len. `live`: warn the first time each kind is seen (streaming: the totals come at the end of
    the pass, which a run may never reach)."""

    def __init__(self, skip_bad_records: bool, keep: int = 3, seq_len: int | None = None, live: bool = False):
        self.skip_bad_records, self.keep, self.seq_len, self.live = skip_bad_records, keep, seq_len, live
        self.counts: dict[str, int] = {}
        self.samples: dict[str, list[str]] = {}
        self.records = self.examples = self.truncated = self.truncated_tokens = 0
        self.held_out = 0  # examples the caller set aside (load_examples' `keep`: the eval share)
        self.truncated_samples: list[str] = []

    def add(self, kind: str, message: str) -> None:
        if kind in _STOP_HINT and not self.skip_bad_records:
            raise DataError(message + _STOP_HINT[kind])
        if self.live and kind not in self.counts:
            log.warning("%s: skipped (%s); the run's summary counts such records", message, kind)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if len(self.samples.setdefault(kind, [])) < self.keep:
            self.samples[kind].append(message)

    def add_all(self, problems: list[tuple[str, str]]) -> None:
        for kind, message in problems:
            self.add(kind, message)

    def add_chunk(self, result: ChunkResult) -> None:
        """A chunk's problems (may raise), and its counts."""
        self.add_all(result.problems)
        self.records += result.records
        self.examples += len(result.examples)
        if not result.truncated:
            return
        if self.live and not self.truncated:
            log.warning("%s: the example is longer than data.seq_len=%s tokens and is truncated; the run's summary "
                        "counts such examples", result.first_truncated, self.seq_len)
        self.truncated += result.truncated
        self.truncated_tokens += result.truncated_tokens
        if len(self.truncated_samples) < self.keep:
            self.truncated_samples.append(result.first_truncated)

    def summary(self) -> list[str]:
        return [f"{n} {_KIND_TEXT[kind]}; e.g. {'; '.join(self.samples[kind])}" for kind, n in self.counts.items()]

    def truncation_line(self) -> str | None:
        if not self.truncated:
            return None
        return (f"{self.truncated} of {self.examples} example(s) were longer than data.seq_len={self.seq_len} tokens "
                f"and truncated ({self.truncated_tokens:,} tokens cut; e.g. {'; '.join(self.truncated_samples)}); "
                "raise data.seq_len to keep them whole")

    def report(self) -> None:
        for line in self.summary() + [self.truncation_line()]:
            if line:
                log.warning("%s", line)
