"""The bridge's environment switches: SGLang's boolean spellings in any case, and a misspelt
value refused at import naming the variable, never read as the default."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kvcanary_jax.bridge as bridge
from kvcanary_jax.bridge import checks, switches

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("word", ["1", "true", "True", "YES", "y", "on", " On "])
def test_true_words(word):
    assert switches.switch("X", word) is True


@pytest.mark.parametrize("word", ["0", "false", "False", "NO", "n", "off", "OFF "])
def test_false_words(word):
    assert switches.switch("X", word) is False


@pytest.mark.parametrize("word", ["bogus", "2", "enable", "", None, 2, -1, 1.0])
def test_anything_else_is_refused_naming_the_variable(word):
    with pytest.raises(ValueError, match=r"KVCANARY_BRIDGE_DIRECT=.* is not a valid switch"):
        switches.switch("KVCANARY_BRIDGE_DIRECT", word)


def test_unset_or_empty_is_the_default(monkeypatch):
    monkeypatch.delenv("KVCANARY_TEST_SWITCH", raising=False)
    assert switches.env_switch("KVCANARY_TEST_SWITCH", "auto", others=("auto",)) == "auto"
    monkeypatch.setenv("KVCANARY_TEST_SWITCH", "  ")
    assert switches.env_switch("KVCANARY_TEST_SWITCH", True) is True
    monkeypatch.setenv("KVCANARY_TEST_SWITCH", "Auto")
    assert switches.env_switch("KVCANARY_TEST_SWITCH", True, others=("auto",)) == "auto"
    monkeypatch.setenv("KVCANARY_TEST_SWITCH", "Fence")
    assert switches.env_choice("KVCANARY_TEST_SWITCH", "event", ("event", "fence")) == "fence"
    monkeypatch.setenv("KVCANARY_TEST_SWITCH", "fenced")
    with pytest.raises(ValueError, match="KVCANARY_TEST_SWITCH='fenced' must be one of event, fence"):
        switches.env_choice("KVCANARY_TEST_SWITCH", "event", ("event", "fence"))


def test_set_value_checks_reads_the_same_words_and_refuses_others():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    try:
        for mode, on_cpu, on_gpu in ((True, True, True), ("on", True, True), ("No", False, False),
                                     (False, False, False), ("auto", True, False)):
            bridge.set_value_checks(mode)
            assert (checks.value_checks_enabled(cpu), checks.value_checks_enabled(cuda)) == (
                on_cpu, on_gpu), mode
        bridge.set_value_checks("on")
        with pytest.raises(ValueError, match="set_value_checks='always'"):
            bridge.set_value_checks("always")
        # The refused value left the thread's mode as it was.
        assert checks.value_checks_enabled(cuda)
    finally:
        bridge.set_value_checks(checks._DEFAULT)


def test_numpy_bools_and_integers_are_switches_too():
    import numpy as np

    assert switches.switch("X", np.bool_(False)) is False
    assert switches.switch("X", np.True_) is True
    assert switches.switch("X", np.int64(1)) is True and switches.switch("X", np.int32(0)) is False
    with pytest.raises(ValueError, match="X=.* is not a valid switch"):
        switches.switch("X", np.int64(2))
    with pytest.raises(ValueError, match="X=.* is not a valid switch"):
        switches.switch("X", np.array([True]))


def test_set_direct_and_set_stream_sync_read_the_words_and_refuse_the_rest():
    """Before, ``set_direct("off")`` turned the direct path on (``bool("off")``) and
    ``set_stream_sync("Fence")`` was refused."""
    direct, mode = bridge.direct_enabled(), bridge.stream_sync()
    try:
        for word, on in (("off", False), ("ON", True), ("0", False), (True, True),
                         ("no", False), (1, True)):
            bridge.set_direct(word)
            assert bridge.direct_enabled() is on, word
        for word in ("maybe", "", None, 2):
            with pytest.raises(ValueError, match=r"set_direct=.* is not a valid switch"):
                bridge.set_direct(word)
            assert bridge.direct_enabled() is True, word  # the refused value changed nothing
        bridge.set_stream_sync("Fence")
        assert bridge.stream_sync() == "fence"
        bridge.set_stream_sync(" event ")
        assert bridge.stream_sync() == "event"
        for word in ("fenced", "", None, 1):
            with pytest.raises(ValueError, match=r"set_stream_sync=.* must be one of event, fence"):
                bridge.set_stream_sync(word)
            assert bridge.stream_sync() == "event", word
    finally:
        bridge.set_direct(direct)
        bridge.set_stream_sync(mode)


def _import_bridge(env: dict, code: str) -> subprocess.Popen:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_BRIDGE_")}
    full.update(env, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-c", "import kvcanary_jax.bridge as b\n" + code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)


def test_the_switches_at_import():
    """Each spelling a user may write turns its switch off (or on), as SGLang's EnvBool reads it:
    before, ``KVCANARY_BRIDGE_DIRECT=no`` (``=OFF``, ``=False``) left the direct path on and
    ``KVCANARY_BRIDGE_VALUE_CHECKS=yes`` read as auto; a bogus value is refused at import, where
    it was read as the default."""
    code = ("import torch\nfrom kvcanary_jax.bridge import checks\n"
            "print(b.direct_enabled(), checks.value_checks_enabled(torch.device('cuda')),"
            " b.stream_sync())")
    good = [((direct, value_checks, sync, want),
             _import_bridge({"KVCANARY_BRIDGE_DIRECT": direct,
                             "KVCANARY_BRIDGE_VALUE_CHECKS": value_checks,
                             "KVCANARY_BRIDGE_STREAM_SYNC": sync}, code))
            for direct, value_checks, sync, want in (
                ("no", "yes", "Fence", "False True fence"),
                ("Y", "OFF", "", "True False event"))]
    bad = [((name, value), _import_bridge({name: value}, ""))
           for name, value in (("KVCANARY_BRIDGE_DIRECT", "disable"),
                               ("KVCANARY_BRIDGE_VALUE_CHECKS", "bogus"),
                               ("KVCANARY_BRIDGE_STREAM_SYNC", "bogus"))]
    for case, proc in good:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        assert out.split("\n")[-2] == case[-1], (case, out)
    for (name, value), proc in bad:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode != 0
        assert f"ValueError: kv-canary bridge: {name}='{value}'" in err, err
