"""``bench.tpu_compile``'s command line where it cannot compile, on any machine: an unknown
implementation is refused naming the known ones, and without libtpu a run stops with one line
saying what to install and a non-zero status (the compiles themselves: tests/test_tpu_compile.py,
where libtpu is installed)."""

from __future__ import annotations

import importlib.util

import pytest

import jax

from kvcanary_jax.bench import tpu_compile as tc


def test_unknown_implementation_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as e:
        tc.main(["--implementation", "nosuch", "--case", "scatter 1x5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --implementation: invalid choice: 'nosuch'" in err
    for known in ("pallas_mosaic_tpu", "xla"):
        assert f"'{known}'" in err


def test_without_libtpu_one_line_says_what_to_install(capsys, monkeypatch):
    if importlib.util.find_spec(tc.LIBTPU) is not None:
        # Where jax[tpu] is installed (the Python 3.12 leg), as where it is not.
        monkeypatch.setattr(tc, "LIBTPU", "libtpu_not_installed_here")
    status = tc.main(["--case", "scatter 1x5", "--topology", "v5e:2x2"])
    captured = capsys.readouterr()
    assert status != 0 and captured.out == ""
    assert captured.err.splitlines() == [
        "kv-canary tpu_compile: compiling for TPU topologies needs libtpu, which is not "
        f'installed: pip install "jax[tpu]=={jax.__version__}"']
