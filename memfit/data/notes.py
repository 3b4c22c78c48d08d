"""What the data path did to the user's data, for the run's summary: records read, examples kept,
examples truncated to `data.seq_len` (and the tokens cut), records dropped by kind, and a micro-batch
smaller than `batch.micro_batch` because the data holds fewer examples.

Every batch stream keeps one (`stream.notes`): the in-memory stream from its load, a prepared dataset
from the statistics `memfit data prepare` stored, a streamed one from what it has read so far.
Each fact is also logged as a warning when it is first known; this is the record the summary prints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from memfit.data.examples import BAD, EMPTY, NO_RESPONSE, OVERSIZE, ProblemLog

log = logging.getLogger(__name__)

# How the summary names each kind of dropped record (data/examples.py's kinds).
DROPPED_TEXT = {BAD: "malformed", OVERSIZE: "over data.max_record_bytes", EMPTY: "empty",
                NO_RESPONSE: "with no response token within data.seq_len"}


@dataclass
class DataNotes:
    seq_len: int
    records: int | None = None      # records read (None: not known, e.g. an older prepared folder)
    examples: int | None = None     # examples made, before packing
    held_out: int = 0               # of them, set aside for evaluation (eval.fraction)
    truncated: int | None = None    # examples cut to seq_len
    truncated_tokens: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # kind -> records
    micro_batch_note: str | None = None  # set when micro-batches hold fewer rows than batch.micro_batch
    scope: str = ""                 # qualifies the counts: "streamed, so far", "prepared"

    @classmethod
    def from_log(cls, problems: ProblemLog, seq_len: int, scope: str = "") -> "DataNotes":
        return cls(seq_len, problems.records, problems.examples, problems.held_out, problems.truncated,
                   problems.truncated_tokens, dict(problems.counts), scope=scope)

    @classmethod
    def from_prepared(cls, meta: dict) -> "DataNotes":
        """The counts a prepared folder's meta.json holds (folders prepared before truncation was
        counted leave it unknown)."""
        report = meta.get("report", {})
        return cls(meta.get("seq_len"), report.get("records"), report.get("examples"), 0, report.get("truncated"),
                   report.get("truncated_tokens", 0), dict(report.get("skipped", {})), scope="prepared")

    def shrink_micro_batch(self, asked: int, available: int, packed: bool, world: int) -> None:
        """Every micro-batch holds `available` rows instead of `asked` (the data, or this data-parallel
        process's share of it, is smaller than one micro-batch): say so now, and in the summary."""
        unit = ("packed row(s)" if packed else "example(s)") + (" per data-parallel process" if world > 1 else "")
        self.micro_batch_note = (f"micro-batches hold {available} row(s), not batch.micro_batch={asked}: the data "
                                 f"holds only {available} {unit}; lower batch.micro_batch (raise "
                                 "batch.grad_accum to keep the batch size) or add data")
        log.warning("%s", self.micro_batch_note)

    def lossy(self) -> bool:
        """Whether anything was truncated or dropped."""
        return bool(self.truncated or self.dropped)

    def lines(self) -> list[str]:
        """The summary: one line of counts, and one more when micro-batches were smaller than asked."""
        unknown = "?"  # a folder prepared before these were counted
        dropped = sum(self.dropped.values())
        kinds = ", ".join(f"{n} {DROPPED_TEXT.get(kind, kind)}" for kind, n in self.dropped.items())
        truncated = unknown if self.truncated is None else str(self.truncated)
        cut = f" ({self.truncated_tokens:,} tokens cut)" if self.truncated else ""
        scope = f" ({self.scope})" if self.scope else ""
        line = (f"data{scope}: {unknown if self.records is None else self.records} record(s) read, "
                f"{unknown if self.examples is None else self.examples} example(s)"
                f"{f' ({self.held_out} held out for eval)' if self.held_out else ''}; "
                f"{truncated} truncated to data.seq_len={self.seq_len} tokens{cut}; "
                f"{dropped} dropped{f' ({kinds})' if kinds else ''}")
        return [line] + ([self.micro_batch_note] if self.micro_batch_note else [])
