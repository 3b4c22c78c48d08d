"""Does a checkpoint fill the model it is loaded into? transformers' own answer, made an error.

`from_pretrained(..., output_loading_info=True)` lists the tensors a checkpoint lacks (`missing`: they
would train from random values), holds beyond the model (`unexpected`: dropped) and holds with another
shape (`mismatched`: replaced by random values). That report already knows tied weights, non-persistent
buffers, the keys a model ignores on purpose (GPT-2's causal-mask buffers, old rotary `inv_freq`) and
transformers 5's key conversions (per-expert MoE tensors fused into one), so memfit reads it rather
than comparing keys itself. transformers logs it only as a warning, which memfit's CLI silences.

Loading real weights straight into 4/8-bit layers skips transformers' shape check for the quantized
tensors, so `quantized_shape_mismatches` compares what each quantized layer holds with what it declares.

Every surprise stops the run with one message, grouped (`model.layers.3.* (9 tensors) missing`), unless
model.new_weights / model.dropped_weights name it on purpose; those are logged one group per line.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections import defaultdict

from memfit.errors import MemfitError

log = logging.getLogger(__name__)

MAX_GROUPS = 12  # in one message; the rest are counted
_INDEX = re.compile(r"^\d+$")


class WeightsMismatchError(MemfitError):
    """The checkpoint's tensors do not match the model its config.json describes."""


TRAINING_FIX = ("Missing or misshapen tensors would train from random values: fix the weights or config.json, or "
                "list the tensors meant to start from random values in model.new_weights (e.g. [\"lm_head.*\"]) and "
                "checkpoint tensors to leave out in model.dropped_weights")


def check_loading_info(model, info: dict, where: str, new_weights=(), dropped_weights=(),
                       fix: str | None = None) -> None:
    """Raise one WeightsMismatchError for every missing, unexpected or misshapen tensor that
    `new_weights` / `dropped_weights` (glob patterns) do not allow; log the allowed ones.
    `where` starts the message (e.g. "model.name: /path/to/model"), `fix` ends it (default: the settings)."""
    # Names, not state_dict(): that would serialize every 4-bit layer's quantization state.
    model_keys = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    model_keys |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    missing = set(info.get("missing_keys", ()))
    mismatched = {(key, _shape(ckpt), _shape(own)) for key, ckpt, own in info.get("mismatched_keys", ())}
    unexpected = set(info.get("unexpected_keys", ()))
    new, dropped = list(new_weights), list(dropped_weights)

    allowed_missing = {k for k in missing if _matches(k, new)}
    allowed_mismatched = {m for m in mismatched if _matches(m[0], new)}
    allowed_unexpected = {k for k in unexpected if _matches(k, dropped)}
    # A 4/8-bit layer filled from a tensor of another shape holds garbage, not random values: never allowed.
    quantized = quantized_shape_mismatches(model)
    _log_allowed(allowed_missing, allowed_mismatched, allowed_unexpected, model_keys)
    _warn_unused("model.new_weights", new, missing | {m[0] for m in mismatched | quantized})
    _warn_unused("model.dropped_weights", dropped, unexpected)

    problems = describe(missing - allowed_missing, unexpected - allowed_unexpected,
                        mismatched - allowed_mismatched, model_keys, quantized)
    if problems:
        raise WeightsMismatchError(f"{where}: the checkpoint does not match the model its config.json describes: "
                                   f"{problems}. {fix or TRAINING_FIX}")


def quantized_shape_mismatches(model) -> set[tuple[str, tuple, tuple]]:
    """(name, shape loaded, shape declared) of the 4/8-bit linear layers that were filled from a tensor
    of another shape: bitsandbytes quantizes whatever it is given."""
    found = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or not hasattr(module, "in_features") or not hasattr(module, "out_features"):
            continue
        state = getattr(weight, "quant_state", None)  # 4-bit: the unpacked shape it was quantized from
        if state is not None and getattr(state, "shape", None) is not None:
            loaded = _shape(state.shape)
        elif type(weight).__name__ == "Int8Params":  # 8-bit: stored as given
            loaded = _shape(weight.shape)
        else:
            continue
        declared = (module.out_features, module.in_features)
        if loaded != declared:
            found.add((f"{name}.weight", loaded, declared))
    return found


def describe(missing: set[str], unexpected: set[str], mismatched: set[tuple[str, tuple, tuple]],
             model_keys: set[str], quantized: set[tuple[str, tuple, tuple]] = frozenset()) -> str:
    """The problems in one line: each kind grouped, '' when there are none. `quantized`: misshapen
    tensors that were quantized while loading, which no setting can turn into random values."""
    parts = [f"{group} missing" for group in group_keys(missing, model_keys - missing)]
    parts += [f"{group} unexpected" for group in group_keys(unexpected, model_keys)]
    parts += [f"{group} is {_dims(ckpt)} in the checkpoint but {_dims(own)} in the model"
              for group, ckpt, own in _group_mismatched(mismatched)]
    parts += [f"{group} is {_dims(ckpt)} in the checkpoint but {_dims(own)} in the model (quantized while "
              "loading, so it cannot start from random values)" for group, ckpt, own in _group_mismatched(quantized)]
    shown = parts[:MAX_GROUPS]
    if len(parts) > len(shown):
        shown.append(f"and {len(parts) - len(shown)} more groups")
    return "; ".join(shown)


def group_keys(keys: set[str], present: set[str]) -> list[str]:
    """`keys` said briefly: a module none of whose tensors is in `present` becomes `module.*`, and
    groups that differ only in layer (or expert) numbers become one, e.g. `model.layers.{4-7}.*`."""
    taken = {".".join(k.split(".")[:i]) for k in present for i in range(1, k.count(".") + 1)}
    by_module: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        parts = key.split(".")
        module = next((".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) not in taken), None)
        by_module[f"{module}.*" if module else key].append(key)
    counted = {name if len(members) > 1 else members[0]: len(members) for name, members in by_module.items()}
    return [_with_count(name, count) for name, count in _merge_indices(counted)]


def _group_mismatched(mismatched: set[tuple[str, tuple, tuple]]) -> list[tuple[str, tuple, tuple]]:
    by_shapes: dict[tuple, dict[str, int]] = defaultdict(dict)
    for key, ckpt, own in mismatched:
        by_shapes[(ckpt, own)][key] = 1
    return sorted((_with_count(name, count), ckpt, own)
                  for (ckpt, own), keys in by_shapes.items() for name, count in _merge_indices(keys))


def _merge_indices(counts: dict[str, int]) -> list[tuple[str, int]]:
    """Names that differ only in their numeric parts, merged when together they are every combination
    of those numbers (layers 4-7 of one module; never a pattern that claims more than is there)."""
    families: dict[tuple, dict[tuple, str]] = defaultdict(dict)
    for name in counts:
        parts = name.split(".")
        template = tuple("{}" if _INDEX.match(p) else p for p in parts)
        families[template][tuple(int(p) for p in parts if _INDEX.match(p))] = name
    merged = []
    for template, members in families.items():
        values = [sorted(set(column)) for column in zip(*members)]
        combinations = 1
        for column in values:
            combinations *= len(column)
        if len(members) > 1 and combinations == len(members):
            spans = iter(_span(column) for column in values)
            merged.append((".".join(next(spans) if p == "{}" else p for p in template),
                           sum(counts[name] for name in members.values())))
        else:
            merged += [(name, counts[name]) for name in members.values()]
    return sorted(merged, key=lambda item: _natural(item[0]))


def _span(numbers: list[int]) -> str:
    """[0, 1, 2, 3, 7] -> '{0-3,7}'."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return "{" + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + "}"


def _with_count(name: str, count: int) -> str:
    return f"{name} ({count} tensors)" if count > 1 else name


def _natural(name: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name)]


def _matches(key: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)


def _log_allowed(missing: set[str], mismatched: set, unexpected: set[str], model_keys: set[str]) -> None:
    for group in group_keys(missing, model_keys - missing):
        log.warning("model.new_weights: %s not in the checkpoint: starts from random values", group)
    for group, ckpt, own in _group_mismatched(mismatched):
        log.warning("model.new_weights: %s is %s in the checkpoint but %s in the model: starts from random values",
                    group, _dims(ckpt), _dims(own))
    for group in group_keys(unexpected, model_keys):
        log.warning("model.dropped_weights: %s in the checkpoint left out (the model has no place for it)", group)


def _warn_unused(field: str, patterns: list[str], keys: set[str]) -> None:
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(key, pattern) for key in keys):
            log.warning("%s: '%s' matches no tensor that needed it: the checkpoint and the model agree there",
                        field, pattern)


def _shape(shape) -> tuple:
    return tuple(int(d) for d in shape)


def _dims(shape: tuple) -> str:
    return "x".join(map(str, shape)) if shape else "a scalar"
