"""Peak memory (memfit's tracker) and step time: full fine-tune vs LoRA vs QLoRA (and int8 + LoRA),
same model, batch and sequence length, measured side by side in one run on this machine.

    .venv/bin/python bench/lora.py [--layers 12 --hidden 768 --seq-len 256 --micro-batch 2 --steps 3]

The model is a Llama-style config (random init, built locally, no download) of >= 100M parameters.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
import warnings

import torch

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.config import load_config
    from memfit.units import format_bytes
    from memfit.memory.tracker import MemoryTracker
    from memfit.build import apply_configured_method
    from memfit.strategies.optimizers import build_optimizer
    from memfit.strategies.precision import make_precision
    from memfit.step import training_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--variants", nargs="+", default=["full", "lora", "qlora", "qlora-torchao", "int8-lora"])
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, tie_word_embeddings=False)
    variants = {
        "full": ["method=full"],
        "lora": ["method=lora", "lora.targets=all-linear"],
        "qlora": ["method=qlora", "lora.targets=all-linear"],                       # bitsandbytes nf4-dq
        "qlora-torchao": ["method=qlora", "lora.targets=all-linear", "quant.backend=torchao"],
        "int8-lora": ["method=lora", "quant.scheme=int8", "lora.targets=all-linear"],
    }
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    precision = make_precision("fp32", torch.device("cpu"))
    rows = []
    for name in args.variants:
        cfg = load_config(None, [*variants[name], "output_dir=/tmp/memfit-bench-lora", "device=cpu"])
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        total_params = sum(p.numel() for p in model.parameters())
        model = apply_configured_method(model, cfg, "cpu").train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(cfg.optim.name, params, 1e-4)
        tracker = MemoryTracker()
        times = []
        with tracker:
            tracker.tag_module(model)
            for step in range(args.steps + 1):
                tracker.tag(batch.values(), "activations")
                started = time.perf_counter()
                training_step(model, optimizer, [batch], precision, tracker, params, 1.0)
                if step:  # step 0 warms up (first-call allocations, kernel selection)
                    times.append(time.perf_counter() - started)
        rows.append((name, total_params, sum(p.numel() for p in params), tracker.peak_bytes,
                     tracker.peak_by_category(), sorted(times)[len(times) // 2]))
        del model, optimizer, params, tracker
        gc.collect()
        print(f"measured {name}", flush=True)

    base_peak, base_time = rows[0][3], rows[0][5]
    print(f"\nLlama-style model: {rows[0][1] / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden}, "
          f"vocab {args.vocab}), micro_batch {args.micro_batch} x seq_len {args.seq_len}, fp32, AdamW, "
          f"{torch.get_num_threads()} threads; step time = median of {args.steps} steps after 1 warm-up")
    print(f"{'variant':<15}{'trainable':>12}{'peak (tracker)':>18}{'x full':>8}{'weights':>14}{'grads':>14}"
          f"{'optim':>14}{'activ.':>14}{'temp.':>14}{'step s':>9}{'x full':>8}")
    for name, _, trainable, peak, cat, step_s in rows:
        print(f"{name:<15}{trainable / 1e6:>11.2f}M{format_bytes(peak):>18}{peak / base_peak:>8.2f}"
              f"{format_bytes(cat['weights']):>14}{format_bytes(cat['gradients']):>14}"
              f"{format_bytes(cat['optimizer_states']):>14}{format_bytes(cat['activations']):>14}"
              f"{format_bytes(cat['temporaries']):>14}{step_s:>9.2f}{step_s / base_time:>8.2f}")
    print("(bytes in GiB/MiB = 2^30/2^20; 'x full' = ratio to the full fine-tune in this run)")


if __name__ == "__main__":
    main()
