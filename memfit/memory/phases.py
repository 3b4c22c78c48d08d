"""Peaks outside the training step: loading the model, evaluating, saving a checkpoint, merging adapters.

The step's peak is the analytic estimate itself; these phases run before or after it and can set
the run's peak on their own (a quantize-on-load that holds a 16-bit layer beside the 4-bit model, an
evaluation whose micro-batch materialises full logits, a checkpoint that copies the trainable weights and optimizer states to host RAM). Each phase is GPU
bytes (tensors on the device) and host RAM bytes, per process.
"""

from __future__ import annotations

from memfit.memory.model_shape import ModelShape, trainable_params, trainable_value_bytes


def _largest_linear(shape: ModelShape) -> int:
    return max([i * o for _, i, o in shape.linear] + [shape.embedding_params, shape.lm_head_params or 0])


def load_phase(shape: ModelShape, cfg, weights: int, host_load: int, host_base: int) -> dict[str, int]:
    """Building the model on the device: the final weights, plus the one tensor in flight.

    Quantized base (QLoRA, int8): transformers + bitsandbytes move each 16-bit linear to the GPU and
    quantize it there, so one 16-bit block linear and its fp32 block statistics exist beside the
    already quantized model. Otherwise each tensor is cast to the training dtype once: one fp32 copy
    of the largest tensor in flight. Host RAM: the load term (memfit/models/load_plan.py)."""
    if cfg.quant.scheme != "none":
        in_flight = max(i * o for _, i, o in shape.linear) * (2 + 4)
    else:
        in_flight = _largest_linear(shape) * 4
    return {"gpu": weights + in_flight, "cpu_ram": host_base + host_load}


def checkpoint_phase(shape: ModelShape, cfg, weights: int, states: int, host_base: int) -> dict[str, int]:
    """Saving a resumable checkpoint after an optimizer step: gradients are freed, the trainable
    weights and the optimizer states are copied to host RAM before they are written."""
    host_copy = trainable_params(shape, cfg) * trainable_value_bytes(cfg) + states
    return {"gpu": weights + states, "cpu_ram": host_base + host_copy}


def merge_phase(shape: ModelShape, cfg, host_base: int) -> dict[str, int] | None:
    """`merge: true` / `memfit merge`: the base is loaded in 16 bits on the host and the adapters are
    folded into it in place (peft merge_and_unload); nothing on the GPU."""
    if cfg.method == "full":
        return None
    return {"gpu": 0, "cpu_ram": host_base + shape.total_params * 2 + _largest_linear(shape) * 4}


def phase_peaks(shape: ModelShape, cfg, step_gpu: int, step_ram: int, weights: int, states: int,
                host_load: int, host_base: int, eval_gpu: int | None = None) -> dict[str, dict[str, int]]:
    """Every phase of a run with its GPU bytes (allocated tensors; the step's figure is its reserved
    peak) and its host RAM; the step as estimated, and the evaluation (`eval_gpu`, when the run
    evaluates: single_device.eval_bytes) with the step's host RAM."""
    phases = {"load": load_phase(shape, cfg, weights, host_load, host_base),
              "step": {"gpu": step_gpu, "cpu_ram": step_ram},
              "checkpoint_save": checkpoint_phase(shape, cfg, weights, states, host_base)}
    if eval_gpu is not None:
        phases["eval"] = {"gpu": eval_gpu, "cpu_ram": step_ram}
    merge = merge_phase(shape, cfg, host_base)
    if merge is not None and cfg.lora.merge:
        phases["merge"] = merge
    return phases
