"""Offline config.json presets of popular architectures, for planning without network access.

Each preset is `presets/<org>__<name>.json`: the model's config.json as published on the Hugging Face hub
(memfit's own presets use the org `memfit`). A preset is named by its hub id (`meta-llama/Llama-2-7b-hf`),
its file stem (`meta-llama__Llama-2-7b-hf`), or the part after the org (`Llama-2-7b-hf`, `gpt3-175b`)
when only one preset has that name.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

PRESETS_DIR = Path(__file__).with_name("presets")

# Keys that are not architecture: notes for humans, and pointers to hub code that a preset never runs
# (every preset uses a model_type built into transformers).
_IGNORED_KEYS = {"_comment", "auto_map"}


def _files() -> dict[str, Path]:
    """Hub id -> preset file."""
    return {p.stem.replace("__", "/", 1): p for p in sorted(PRESETS_DIR.glob("*__*.json"))}


def _aliases(files: dict[str, Path]) -> dict[str, Path]:
    """Short name (the part after the org) -> file, for the names only one preset has."""
    by_short: dict[str, list[Path]] = {}
    for hub_id, path in files.items():
        by_short.setdefault(hub_id.split("/", 1)[1], []).append(path)
    return {short: paths[0] for short, paths in by_short.items() if len(paths) == 1}


def list_presets() -> list[str]:
    """Sorted hub ids of all presets, plus the short names of memfit's own (e.g. `gpt3-175b`)."""
    files = _files()
    own = [hub_id.split("/", 1)[1] for hub_id in files if hub_id.startswith("memfit/")]
    return sorted([*files, *own], key=str.lower)


def preset_path(name: str) -> Path | None:
    """The preset file for a hub id, file stem or unambiguous short name; None if there is none."""
    files = _files()
    if name in files:
        return files[name]
    if name.replace("__", "/", 1) in files:  # the file stem
        return files[name.replace("__", "/", 1)]
    return _aliases(files).get(name)


def load_preset_config(name: str) -> PretrainedConfig:
    """The transformers config of a preset; KeyError naming close matches when `name` is unknown."""
    path = preset_path(name)
    if path is None:
        known = list_presets() + list(_aliases(_files()))
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
        hint = f"did you mean: {', '.join(close)}?" if close else "`memfit presets` lists them"
        raise KeyError(f"no preset named '{name}'; {hint}")
    cfg = {k: v for k, v in json.loads(path.read_text()).items() if k not in _IGNORED_KEYS}
    return AutoConfig.for_model(**cfg)


def preset_hub_id(name: str) -> str | None:
    """The hub id whose published weights a preset describes; None for memfit's own shapes
    (`memfit/...`), which have no weights anywhere, and for names that are not presets."""
    path = preset_path(name)
    if path is None:
        return None
    hub_id = path.stem.replace("__", "/", 1)
    return None if hub_id.startswith("memfit/") else hub_id
