"""Peak RSS of the training data path vs corpus size, and tokenization throughput with 1 vs 2 workers.

    .venv/bin/python bench/data_ram.py                 # 0.5 GB and 2 GB corpora (several minutes)
    .venv/bin/python bench/data_ram.py --sizes-gb 0.05 0.2   # quick check

For each generated corpus (JSON Lines, `text` format, in bench/out/, deleted afterwards), each
measurement runs in a fresh child process and reports that process's peak RSS (ru_maxrss):
- streaming: memfit's streaming path (StreamingBatches: read, tokenize, shuffle buffer, packing,
  collate) for one full epoch over the corpus, as `memfit train` with `data.streaming: true` does;
- naive: the load-everything baseline: every record parsed into one Python list (what a simple
  script, or memfit's own in-memory path before tokenizing, does).
The memory test uses a whitespace word tokenizer written in Python (WordTokenizer below) so a
2 GB epoch takes minutes on 2 cores: the HF byte-level tokenizer runs at ~1-3 MB/s here, which
would take hours, and the tokenizer does not change what the data path holds. Throughput is
measured with the real byte-level tokenizer (memfit.models.tokenizer.byte_tokenizer) through
`memfit data prepare`'s code with 1 and then 2 worker processes on the same slice.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORDS = ("memory gradient tensor optimizer batch token layer weight activation model data stream "
         "arrow column record worker process buffer packing sequence length attention").split()


class WordTokenizer:
    """Minimal stand-in with the tokenizer interface the data path uses: word ids, BOS/EOS/pad."""

    bos_token_id, eos_token_id, pad_token_id, chat_template = 0, 1, 2, None

    def __init__(self):
        self.vocab = {w: i + 3 for i, w in enumerate(WORDS)}

    def __call__(self, texts, add_special_tokens=False):
        vocab = self.vocab
        return {"input_ids": [[vocab.get(w, 3) for w in t.split()] for t in texts]}


def generate(path: Path, size_bytes: int, seed: int = 0) -> int:
    """JSON Lines of ~2 KB `text` records; returns the record count."""
    rng = random.Random(seed)
    pool = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(150, 350))) for _ in range(512)]
    written = records = 0
    with path.open("w") as handle:
        while written < size_bytes:
            line = json.dumps({"text": f"record {records} " + pool[records % len(pool)]}) + "\n"
            handle.write(line)
            written += len(line)
            records += 1
    return records


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child_streaming(path: str, workers: int) -> dict:
    from memfit.config import load_config
    from memfit.data.streaming import StreamingBatches

    cfg = load_config(None, [f"data.path={path}", "data.format=text", "data.streaming=true", "data.seq_len=1024",
                             "data.packing=true", "batch.micro_batch=8", "data.shuffle_buffer=1000", f"data.num_workers={workers}"])
    stream = StreamingBatches(cfg, WordTokenizer())
    started, batches, tokens, worker_uss = time.perf_counter(), 0, 0, 0
    while stream.epoch == 0:
        batch = stream.next_batch()
        batches, tokens = batches + 1, tokens + batch["input_ids"].numel()
        if workers and batches == 200:  # unique memory of the worker processes (for memfit.data.ram)
            import psutil

            worker_uss = max(c.memory_full_info().uss for c in psutil.Process().children())
    return {"peak_rss_bytes": peak_rss_bytes(), "batches": batches, "tokens": tokens,
            "seconds": time.perf_counter() - started, "worker_uss_bytes": worker_uss}


def child_naive(path: str) -> dict:
    started = time.perf_counter()
    with open(path) as handle:
        records = [json.loads(line) for line in handle]
    return {"peak_rss_bytes": peak_rss_bytes(), "records": len(records), "seconds": time.perf_counter() - started}


def child_throughput(path: str, workers: int, limit: int, out: str) -> dict:
    from memfit.config import load_config
    from memfit.data.prepare import prepare_dataset
    from memfit.models.tokenizer import byte_tokenizer

    cfg = load_config(None, [f"data.path={path}", "data.format=text", "data.seq_len=4096", f"data.limit={limit}",
                             f"data.num_workers={workers}"])
    report = prepare_dataset(cfg, byte_tokenizer(), out, overwrite=True, progress=False)
    shutil.rmtree(out)
    return {"records": report.records, "tokens": report.tokens, "seconds": report.seconds}


def run_child(*args: str) -> dict:
    result = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, cwd=ROOT)
    if result.returncode:
        raise SystemExit(f"child {args} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-gb", type=float, nargs=2, default=[0.5, 2.0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "data_ram"))
    parser.add_argument("--throughput-records", type=int, default=3000)
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        result = {"streaming": lambda: child_streaming(rest[0], int(rest[1])), "naive": lambda: child_naive(rest[0]),
                  "throughput": lambda: child_throughput(rest[0], int(rest[1]), int(rest[2]), rest[3])}[kind]()
        print(json.dumps(result))
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"disk free before: {shutil.disk_usage(out).free / 1e9:.1f} GB (decimal GB, 10^9 bytes)")
    rows = {}
    try:
        for size_gb in args.sizes_gb:
            path = out / f"corpus_{size_gb}gb.jsonl"
            records = generate(path, int(size_gb * 1e9))
            size = path.stat().st_size
            streaming = run_child("streaming", str(path), "0")
            naive = run_child("naive", str(path))
            rows[size_gb] = (size, records, streaming, naive)
            print(f"corpus {mb(size)} ({records:,} records): streaming peak RSS {mb(streaming['peak_rss_bytes'])} "
                  f"({streaming['batches']:,} batches, {streaming['tokens']:,} tokens in {streaming['seconds']:.0f} "
                  "s); "
                  f"naive peak RSS {mb(naive['peak_rss_bytes'])} ({naive['seconds']:.0f} s)", flush=True)
        small, large = (rows[s] for s in args.sizes_gb)
        print(f"\ngrowth from {mb(small[0])} to {mb(large[0])} of corpus (x{large[0] / small[0]:.1f}):")
        print(f"  streaming: {mb(large[2]['peak_rss_bytes'] - small[2]['peak_rss_bytes'])} "
              f"(x{large[2]['peak_rss_bytes'] / small[2]['peak_rss_bytes']:.2f})")
        print(f"  naive:     {mb(large[3]['peak_rss_bytes'] - small[3]['peak_rss_bytes'])} "
              f"(x{large[3]['peak_rss_bytes'] / small[3]['peak_rss_bytes']:.2f})")

        first = out / f"corpus_{args.sizes_gb[0]}gb.jsonl"
        with_workers = run_child("streaming", str(first), "2") if args.sizes_gb[0] <= 0.5 else None
        if with_workers:
            print(f"\nstreaming with 2 DataLoader workers on {mb(small[0])}: main peak RSS "
                  f"{mb(with_workers['peak_rss_bytes'])}, unique memory (USS) of one worker "
                  f"{mb(with_workers['worker_uss_bytes'])}, {with_workers['seconds']:.0f} s "
                  f"(0 workers: {small[2]['seconds']:.0f} s)")
        print(f"\ntokenization throughput (byte-level HF tokenizer, prepare, first "
              f"{args.throughput_records:,} records of {first.name}):")
        base = None
        for workers in (1, 2):
            t = run_child("throughput", str(first), str(workers), str(args.throughput_records), str(out / "prepared"))
            rate = t["tokens"] / t["seconds"]
            base = base or rate
            print(f"  {workers} worker(s): {t['records'] / t['seconds']:,.0f} records/s, {rate:,.0f} tokens/s "
                  f"(x{rate / base:.2f} vs 1 worker; {t['seconds']:.1f} s)", flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        print(f"\ndeleted {out}")


if __name__ == "__main__":
    main()
