"""The suite's own settings (tests/conftest.py): quick XLA CPU compiles and where TPU interpret
mode's race detector runs."""

from __future__ import annotations

import importlib.util
import os

import pytest

import _impls
import _tier
import conftest

LEVEL = "--xla_backend_optimization_level"
# Where a GPU plugin or libtpu is installed the suite leaves XLA_FLAGS alone.
ON_AN_ACCELERATOR = any(importlib.util.find_spec(m) for m in conftest.ACCELERATOR_PLUGINS)


def test_quick_compiles_join_the_users_flags():
    out = conftest._quick_cpu_compile_flags({"XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    if ON_AN_ACCELERATOR:
        assert out is None
    else:
        assert out.split()[0] == "--xla_dump_to=/tmp/x"
        assert f"{LEVEL}=0" in out.split()


def test_a_flag_the_user_set_is_kept():
    out = conftest._quick_cpu_compile_flags({"XLA_FLAGS": f"{LEVEL}=2"})
    assert out is None or (f"{LEVEL}=2" in out.split() and f"{LEVEL}=0" not in out)


def test_left_out_on_request():
    assert conftest._quick_cpu_compile_flags({"KVCANARY_TEST_XLA_DEFAULTS": "1"}) is None


def test_this_process_compiles_quickly():
    wanted = not ON_AN_ACCELERATOR and not os.environ.get("KVCANARY_TEST_XLA_DEFAULTS")
    assert LEVEL in os.environ.get("XLA_FLAGS", "") or not wanted  # ours, or the user's level


def test_race_detector_off_in_a_hand_written_test_of_the_fast_tier():
    assert _impls.DETECT_RACES is _tier.LONG


@pytest.mark.tpu_races
def test_race_detector_on_where_marked():
    assert _impls.DETECT_RACES is True
