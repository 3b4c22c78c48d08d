"""Sample from a trained run: `memfit generate RUN_DIR "prompt"`.

The prompt is rendered the way the run's training data were, so the model sees what it learned
from: an alpaca run gets the instruction template, a chat run the tokenizer's chat template (or
memfit's built-in one) with a generation prompt, a text run the prompt as is. A full run loads its
model folder; a LoRA/QLoRA run loads its base exactly as training saw it, then the adapter.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer

from memfit.config import RunConfig, load_config
from memfit.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, chat_template_for, detect_format
from memfit.data.sources import iter_raw
from memfit.errors import MemfitError, require
from memfit.models.loading import load_saved_model
from memfit.models.merge import base_dtype, load_adapter, load_base, require_run_dir

log = logging.getLogger(__name__)


def load_run(run_dir: str | Path):
    """-> (model in eval mode, tokenizer, the run's config) from a finished run's folder."""
    run_dir = Path(run_dir)
    require_run_dir(run_dir, "memfit generate")
    cfg = load_config(run_dir / "run_config.yaml")
    if (run_dir / "adapter_config.json").is_file():
        peft = require("peft", "memfit generate on a LoRA/QLoRA run")
        model = load_adapter(peft, load_base(run_dir, cfg), run_dir)
    elif (run_dir / "config.json").is_file():
        model = load_saved_model(run_dir, base_dtype(cfg))
    else:
        raise MemfitError(f"{run_dir}: holds neither a model (config.json) nor an adapter (adapter_config.json); "
                          "has the run finished?")
    return model.eval(), AutoTokenizer.from_pretrained(run_dir), cfg


def data_format(cfg: RunConfig) -> str:
    """The run's data format; `auto` is decided by the first training record, as training did."""
    if cfg.data.format != "auto":
        return cfg.data.format
    try:
        _, record = next(iter(iter_raw(cfg.data.path, limit=1)))
        return detect_format(json.loads(record) if isinstance(record, str) else record)
    except (MemfitError, OSError, ValueError, StopIteration) as exc:  # the data may be gone since training
        log.warning("data.format: auto, and %s cannot be read (%s): the prompt is used as plain text; "
                    "set the format the run trained on to render it the same way", cfg.data.path, exc)
        return "text"


def render_prompt(prompt: str, fmt: str, tokenizer, context: str = "") -> tuple[str, bool]:
    """-> (text, templated): templated text already holds the special tokens it needs. `context`
    is an alpaca record's `input` (the prompt is its instruction); other formats append it."""
    if fmt == "alpaca":
        template = ALPACA_PROMPT if context else ALPACA_PROMPT_NO_INPUT
        return template.format(instruction=prompt, input=context), False
    prompt = f"{prompt}\n\n{context}" if context else prompt
    if fmt == "chat":
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             chat_template=chat_template_for(tokenizer), add_generation_prompt=True)
        return text, True
    return prompt, False


@torch.no_grad()
def generate(run_dir: str | Path, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0,
             seed: int = 0, context: str = "") -> str:
    """The completion of `prompt` (greedy at temperature 0, else sampled with `seed`)."""
    if max_new_tokens < 1:
        raise MemfitError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise MemfitError(f"--temperature must be 0 (greedy) or more, got {temperature}")
    model, tokenizer, cfg = load_run(run_dir)
    text, templated = render_prompt(prompt, data_format(cfg), tokenizer, context)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and not (templated and ids[:1] == [bos]):
        ids = [bos, *ids]  # the training encoder starts every example with BOS
    input_ids = torch.tensor([ids])
    torch.manual_seed(seed)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                         temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
