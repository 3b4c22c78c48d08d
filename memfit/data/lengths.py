"""How long the run's sequences really are: tokens per sequence and per padded micro-batch.

A plan at cfg.data.seq_len is the worst case; real batches are padded only to their longest example.
`length_profile` tokenizes a sample of the configured data exactly as training does (same
tokenizer, format, truncation and packing) and batches it in the trainer's own order, so a plan
can also be made at the length the run will actually see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memfit.data.loader import BatchStream, load_examples
from memfit.data.packing import pack_examples
from memfit.errors import MemfitError
from memfit.models.loading import load_tokenizer


@dataclass(frozen=True)
class LengthProfile:
    source: str
    records: int       # usable records tokenized (skipped ones are not counted)
    seq_len: int       # the truncation limit
    packing: bool
    micro_batch: int
    p50: int           # tokens per sequence after truncation (a packed row with packing)
    p90: int
    max: int
    batch_p50: int     # tokens per sequence of a micro-batch, padded to its longest sequence
    batch_p90: int

    def to_text(self) -> str:
        kind = "packed row" if self.packing else "sequence"
        return (f"{self.source}: {self.records} records, tokens per {kind} (seq_len {self.seq_len}): "
                f"p50 {self.p50}, p90 {self.p90}, max {self.max} tokens; a micro-batch of {self.micro_batch} "
                f"pads to p50 {self.batch_p50}, p90 {self.batch_p90} tokens")


def percentile(values: list[int], q: float) -> int:
    """Nearest rank: the smallest value with at least q of the values at or below it (one that occurs)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)), 1) - 1]


def length_profile(cfg, tokenizer=None, limit: int = 2000, micro_batch: int | None = None) -> LengthProfile:
    """Lengths of the first `limit` records of cfg.data, tokenized as the run would tokenize them.

    `micro_batch` defaults to cfg.batch.micro_batch (needed when that is `auto`). Batches are drawn in the
    order of the trainer's first epoch (its seeded shuffle, or group_by_length's sorted windows) over
    the sample, so the padded lengths are those the run sees, up to the sample being smaller.
    """
    micro_batch = micro_batch or cfg.batch.micro_batch
    if micro_batch == "auto":
        raise MemfitError("length_profile: micro_batch is auto; pass the micro_batch to profile batches of")
    tokenizer = tokenizer or load_tokenizer(cfg.model)
    data = cfg.data.model_copy(update={"limit": min(limit, cfg.data.limit or limit)})
    examples = load_examples(data, tokenizer, cfg.data.seq_len)
    rows = list(pack_examples(examples, cfg.data.seq_len)) if cfg.data.packing else examples  # as load_examples packs
    lengths = [len(r["input_ids"]) for r in rows]
    stream = BatchStream(rows, micro_batch, tokenizer.pad_token_id, cfg.seed,
                         group_by_length=cfg.data.group_by_length)
    order = stream._order()
    padded = [max(lengths[i] for i in order[s:s + micro_batch]) for s in range(0, len(order), micro_batch)]
    return LengthProfile(cfg.data.path, len(examples), cfg.data.seq_len, cfg.data.packing, micro_batch,
                         percentile(lengths, 0.5), percentile(lengths, 0.9), max(lengths),
                         percentile(padded, 0.5), percentile(padded, 0.9))
