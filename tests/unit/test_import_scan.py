"""The layering holds: no import cycles, no upward imports, no function-local memfit imports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "import_scan.py"


def _scan_module():
    spec = importlib.util.spec_from_file_location("import_scan", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_memfit_has_no_cycles_upward_or_local_imports():
    found = _scan_module().scan()
    assert found == {"cycles": [], "upward imports": [], "function-local memfit imports": []}


def test_the_scan_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    scan = _scan_module()
    package = tmp_path / "memfit"
    (package / "strategies").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "strategies" / "__init__.py").write_text("")
    (package / "strategies" / "a.py").write_text("from memfit.strategies import b\nfrom memfit.train import loop\n")
    (package / "strategies" / "b.py").write_text("def f():\n    from memfit.strategies import a\n")
    (package / "train").mkdir()
    (package / "train" / "__init__.py").write_text("")
    (package / "train" / "loop.py").write_text("")
    monkeypatch.setattr(scan, "ROOT", tmp_path)
    monkeypatch.setattr(scan, "PACKAGE", package)
    found = scan.scan()
    assert found["cycles"] == ["memfit.strategies.a <-> memfit.strategies.b"]
    assert [line.split(" (")[0] for line in found["upward imports"]] == ["memfit.strategies.a -> memfit.train.loop"]
    assert [line.split(" (")[0] for line in found["function-local memfit imports"]] == [
        "memfit.strategies.b -> memfit.strategies.a"]


def test_a_config_import_in_strategies_is_upward_even_for_type_checking_only(tmp_path, monkeypatch):
    """Naming RunConfig in an annotation is still knowing the config: reported, though it makes no cycle."""
    scan = _scan_module()
    package = tmp_path / "memfit"
    for folder in ("strategies", "config"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "strategies" / "lora.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from memfit.config import RunConfig\n")
    (package / "config" / "__init__.py").write_text("from memfit.strategies import lora\n")
    monkeypatch.setattr(scan, "ROOT", tmp_path)
    monkeypatch.setattr(scan, "PACKAGE", package)
    found = scan.scan()
    assert found["upward imports"] == [
        "memfit.strategies.lora -> memfit.config (memfit/strategies/lora.py:4, under TYPE_CHECKING)"]
    assert found["cycles"] == []  # a TYPE_CHECKING import runs nothing
