"""Sizes: one rule (a number and a unit) for every size a user writes, in flags and in the config."""

from __future__ import annotations

import re

import pytest

from memfit.config import ConfigError, load_config
from memfit.errors import MemfitError
from memfit.memory.planner import parse_budget
from memfit.units import SizeError, format_bytes, parse_bytes

ADD_A_UNIT = "add a unit, e.g. 24GiB (2^30 bytes) or 24GB (10^9 bytes)"


@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * 2**30), ("24gib", 24 * 2**30), ("24 GiB", 24 * 2**30), (" 24 GIB ", 24 * 2**30),
    ("80GB", 80 * 10**9), ("80gb", 80 * 10**9), ("512MiB", 512 * 2**20), ("1kb", 1000), ("2 KiB", 2048),
    ("1.5TiB", int(1.5 * 2**40)), ("2TB", 2 * 10**12), ("1PiB", 2**50), ("100B", 100), ("100 b", 100),
    ("1e3MB", 10**9), ("0", 0), ("-1GiB", -(2**30)),
])
def test_a_number_and_a_unit_in_any_case_with_an_optional_space(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bare", ["24", 24, 24.5, "1e9", 1e9, " 7 "])
def test_a_bare_number_is_refused_with_how_to_add_a_unit(bare):
    with pytest.raises(SizeError, match="has no unit") as info:
        parse_bytes(bare)
    assert ADD_A_UNIT in str(info.value)


@pytest.mark.parametrize("text", ["24G", "24 gigs", "24 GiBs", "abc", "", "GiB", "1.2.3GiB", True, [24]])
def test_anything_else_is_refused_naming_the_units(text):
    with pytest.raises(SizeError, match="cannot read") as info:
        parse_bytes(text)
    assert "e.g. 24GiB" in str(info.value)


def test_size_errors_are_memfit_errors_and_value_errors():
    # ValueError: a config validator reports it under its field; MemfitError: the CLI prints one line
    assert issubclass(SizeError, MemfitError) and issubclass(SizeError, ValueError)


def test_printed_sizes_read_back():
    assert format_bytes(parse_bytes("1.5GiB")) == "1.50 GiB"
    assert parse_bytes(format_bytes(3 * 2**20).replace(",", "")) == 3 * 2**20


def test_flags_name_themselves_and_keep_their_ranges():
    assert parse_budget("24gib") == 24 * 2**30
    assert parse_budget(None) is None
    assert parse_budget("0", "--margin", allow_zero=True) == 0
    with pytest.raises(MemfitError, match="^" + re.escape(f"--host-ram: '64' has no unit: {ADD_A_UNIT}") + "$"):
        parse_budget("64", "--host-ram")
    with pytest.raises(MemfitError, match="--budget: must be a positive size"):
        parse_budget("0GiB")


@pytest.mark.parametrize("override, field", [("budget=24", "budget"), ("memory.limit=1000000", "memory.limit"),
                                             ("budget=24.5", "budget")])
def test_config_sizes_follow_the_same_rule(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert f"{field}: " in str(info.value) and ADD_A_UNIT in str(info.value)


def test_config_sizes_accept_what_the_flags_accept():
    cfg = load_config(None, ["budget=24gib", "memory.limit=512 MiB"])
    assert cfg.budget == "24gib" and cfg.memory.limit_bytes == 512 * 2**20
    assert load_config(None, ["budget=auto"]).budget == "auto"
    with pytest.raises(ConfigError, match="memory.limit: must be a positive size"):
        load_config(None, ["memory.limit=0"])
