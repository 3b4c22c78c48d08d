"""The fine-tuning methods (`method`): what each trains and how it stores the frozen base, written once and
read by the config, the analytic estimate (memory/model_states.py) and the plan's table."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.strategies.entries import entry_lookup


@dataclass(frozen=True)
class MethodEntry:
    name: str            # the value of `method`
    adapters: bool       # trains LoRA adapters on a frozen base (else every weight)
    default_quant: str   # how the frozen base is stored when quant.scheme is none
    gives_up: str = ""   # against full fine-tuning, for the plan's table


METHOD_ENTRIES = (
    MethodEntry("full", False, "none"),
    MethodEntry("lora", True, "none", "trains LoRA adapters only"),
    MethodEntry("qlora", True, "nf4-dq", "trains LoRA adapters only"),
)
METHODS, method_entry = entry_lookup(METHOD_ENTRIES, "method")
