"""The demo dataset memfit ships: short string-manipulation instructions (Alpaca format).

Tasks simple enough that a 1M-parameter byte-level model visibly learns them within a minute
on two CPU cores: reverse, upper-case, sort the letters of, and add two numbers.
`python -m memfit.data.demo` regenerates `demo.jsonl` (deterministic; a test checks it).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DEMO_PATH = Path(__file__).with_name("demo.jsonl")
WORDS = ("apple banana cherry delta echo falcon garden harbor island jungle kernel lemon memory "
         "needle orange planet quartz river silver tensor union violet window yellow zebra "
         "adam batch cache dense epoch float gradient layer model token vector weight").split()


def _example(rng: random.Random) -> dict:
    task = rng.choice(("reverse", "upper", "sort", "add"))
    if task == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return {"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)}
    word = rng.choice(WORDS)
    if task == "reverse":
        return {"instruction": "Reverse the word.", "input": word, "output": word[::-1]}
    if task == "upper":
        return {"instruction": "Write the word in capital letters.", "input": word, "output": word.upper()}
    return {"instruction": "Sort the letters of the word.", "input": word, "output": "".join(sorted(word))}


def demo_records(n: int = 2000, seed: int = 1234) -> list[dict]:
    rng = random.Random(seed)
    return [_example(rng) for _ in range(n)]


def write_demo(path: Path = DEMO_PATH) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in demo_records()))


if __name__ == "__main__":
    write_demo()
    print(f"wrote {DEMO_PATH}")
