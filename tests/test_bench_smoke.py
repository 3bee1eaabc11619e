"""The benchmark itself, run as the README types it (``kvcanary-jax bench --quick``) through the
installed entry point on the CPU, where it falls back to its smoke mode (interpret kernels,
wall-clock timing), so it cannot rot between H200 runs: every op runs, and every result is
checked against SGLang first. The canary inside sglang-jax's step (bench/sglang_jax_step.py) has
its own smoke run with the coverage window (sglang-jax 0.0.2, the Python 3.12 leg)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

import _cli
from kvcanary_jax.bench import cpu

COMMAND = "kvcanary-jax bench --quick"


def test_readme_types_this_command():
    assert f"`{COMMAND}`" in _cli.README.read_text()


@pytest.mark.e2e
@pytest.mark.torch  # SGLang's references and the torch bridge
def test_bench_smoke(tmp_path):
    proc = _cli.run(COMMAND, cwd=tmp_path)
    assert "no GPU: running the smoke mode" in proc.stderr, proc.stderr[-3000:]
    out = tmp_path / "bench" / "results"  # the default --out, under the current directory
    result = json.loads((out / "results.json").read_text())
    assert proc.returncode == 0, (result["errors"], proc.stderr[-3000:])
    assert result["mode"] == "smoke"
    assert {r["op"] for r in result["rows"]} == {"scatter", "plan", "write", "verify", "bridge"}
    for row in result["rows"]:
        if row["op"] == "bridge":  # end-to-end call times through the torch bridge
            assert row["ours_call"]["median_us"] > 0
            continue
        assert row["ours_correct"] is True, row
        assert row["ours"]["median_us"] > 0
    table = (out / "results.md").read_text()
    assert "| scatter | bs=2 seq=16 |" in table
    assert table in proc.stdout


@pytest.mark.e2e
def test_cpu_bench_smoke(tmp_path):
    """bench/cpu.py (xla against pallas_interpret, every op and the demo): the two agree byte for
    byte on every case and every row has its timings."""
    assert cpu.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert {r["op"] for r in result["rows"]} == {"scatter", "plan", "write", "verify", "demo"}
    for row in result["rows"]:
        assert row["equal"] is True, row
        assert all(row[i]["median_ms"] > 0 for i in cpu.IMPLEMENTATIONS)
    assert "| demo |" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["--iters", "-5"], "argument --iters: must be >= 1, got -5"),
    # 0 silently meant the default.
    (["--iters", "0"], "argument --iters: must be >= 1, got 0"),
    (["--ops", ","], "argument --ops: no op given (','); choose from ('scatter', 'plan', "
                     "'write', 'verify', 'bridge')"),
])
def test_bench_refuses_values_that_make_no_sense(argv, message, capsys):
    from kvcanary_jax.bench import run

    with pytest.raises(SystemExit) as e:
        run.main(argv, prog="kvcanary-jax bench")
    assert e.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(f"kvcanary-jax bench: error: {message}")


@pytest.mark.parametrize("main", ["run", "cpu"])
def test_bench_refuses_an_unwritable_out_before_running(main, tmp_path, capsys):
    """An unwritable --out ran the whole bench, then ended in a traceback."""
    import importlib

    blocker = tmp_path / "file"
    blocker.write_text("")
    out = str(blocker / "results")
    mod = importlib.import_module(f"kvcanary_jax.bench.{main}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--smoke", "--out", out])
    assert e.value.code == 2
    err = capsys.readouterr().err.rstrip()
    assert err.endswith(f"error: argument --out: {out!r} is not a writable directory "
                        "(NotADirectoryError: Not a directory)"), err
    assert err.startswith("usage: "), err  # the usage and the error only: no case ran before


@pytest.mark.e2e
def test_the_lowered_programs_are_the_same_from_one_run_to_the_next(tmp_path, capsys):
    """``bench/lowered_programs.py`` compares commits by digest: it only can if lowering the same
    code twice gives the same text (no addresses, counters or times in it)."""
    from kvcanary_jax.bench import lowered_programs

    assert lowered_programs.main(["--implementation", "xla", "--dump", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in first] == [
        f"{name}/xla" for name in ("step", "fused", "tail", "sweep", "observe", "counts")]
    assert lowered_programs.main(["--implementation", "xla"]) == 0
    assert capsys.readouterr().out.splitlines() == first
    assert "stablehlo" in (tmp_path / "tail_xla.txt").read_text()


@pytest.mark.e2e
def test_the_step_copies_bench_lists_each_copy(tmp_path, capsys):
    """``bench/step_copies.py`` on the CPU: both steps compiled, every copy of each listed with
    its operand (the JSON holds them all); the parser reads a hand-written module's copies and
    nothing else; a window below 1 is refused."""
    from kvcanary_jax.bench import step_copies

    text = ("  %copy.1 = s32[1]{0} copy(%state_step.1), metadata={op_name=\"x\"}\n"
            "  ROOT %copy.2 = s64[4]{0} copy-start(%p0)\n"
            "  %add.3 = s32[1]{0} add(%copy.1, %b)\n")
    assert step_copies.copies(text) == [{"shape": "s32[1]{0}", "of": "state_step.1"},
                                        {"shape": "s64[4]{0}", "of": "p0"}]
    assert step_copies.main(["--window", "4", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "step_copies.json").read_text())
    assert [r["window"] for r in got["rows"]] == [0, 4]
    assert all(r["copies"] == len(r["list"]) for r in got["rows"])
    assert "make_canary_step window    4" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        step_copies.main(["--window", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith("error: argument --window: must be >= 1, "
                                                     "got 0")


@pytest.mark.parametrize("argv,message", [
    (["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    (["--demo-steps", "-1"], "argument --demo-steps: must be >= 1, got -1"),
    (["--budget-s", "0"], "argument --budget-s: must be > 0, got 0.0"),
])
def test_cpu_bench_refuses_values_that_make_no_sense(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cpu.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(f"error: {message}")


@pytest.mark.e2e
@pytest.mark.torch  # SGLang's launchers (its torch references on CPU) and the torch bridge
def test_bridge_coverage_bench_smoke(tmp_path, capsys):
    """bench/bridge_coverage.py in its smoke mode (tiny pool, any machine): SGLang's kernels with
    every layer as sources in chunks of 4 against our digest launchers, each side clean after
    timing and finding a flipped bit of the last layer's V, every figure timed."""
    from kvcanary_jax.bench import bridge_coverage as bc

    assert bc.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bridge_coverage.json").read_text())
    assert result["mode"] == "smoke"
    (row,) = result["rows"]
    assert (row["sources"], row["sglang_launches_per_half"]) == (6, 2)  # 3 layers: 4 + 2
    assert row["ours_correct"] == {"clean": True, "flip_found": True}
    windows = bc.SMOKE_WINDOWS
    want = {"sglang_verify", "sglang_write", "sglang_step", "ours_write",
            *(f"ours_{k}_w{w}" for k in ("verify", "step") for w in windows)}
    assert set(row["times"]) == want
    assert all(t["median_us"] > 0 for t in row["times"].values())
    assert {result["paths"][k]["path"] for k in ("launch_kv_digest_write",
                                                  "launch_kv_digest_verify")} == {"dlpack"}
    assert "| 3 layers (6 sources) | bs=2 ctx=16 |" in capsys.readouterr().out


@pytest.mark.torch
@pytest.mark.parametrize("argv,message", [
    (["--iters", "0"], "argument --iters: must be >= 1, got 0"),
    (["--windows", "1,0"], "argument --windows: must be >= 1, got 0"),
    (["--windows", "64,x"], "argument --windows: must be an int >= 1, got 'x'"),
])
def test_bridge_coverage_bench_refuses_values_that_make_no_sense(argv, message, capsys):
    from kvcanary_jax.bench import bridge_coverage as bc

    with pytest.raises(SystemExit) as e:
        bc.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(f"error: {message}")


@pytest.mark.e2e
@pytest.mark.sglang_jax
@pytest.mark.sglang_jax_002  # the timed modes run on 0.0.2 (the bench's docstring says why)
def test_sglang_jax_step_bench_smoke_with_the_coverage_window(tmp_path):
    """bench/sglang_jax_step.py --coverage-window on the CPU (wall clock): the guarded,
    canary-only and sweep timings of both modes (the kv stack, sglang-jax's ModelRunner), with
    the manager, each ending with no violation."""
    assert importlib.metadata.version("sglang-jax").startswith("0.0.")
    what = "kv,runner"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "kvcanary_jax.bench.sglang_jax_step", "--smoke",
                           "--what", what, "--coverage-window", "2", "--sweep-interval", "8",
                           "--manager", "--out", str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=1200, cwd=root)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads((tmp_path / "sglang_jax_step.json").read_text())
    assert result["errors"] == []
    assert [r["what"] for r in result["rows"]] == what.split(",")
    for row in result["rows"]:
        assert row["coverage_window"] == 2 and row["manager"] is True
        assert row["violations"] == 0 and row["sweep_violations"] == 0
        assert row["sweep_interval"] == 8
        assert row["sweep_per_step_us"] == row["sweep"]["median_us"] / 8 > 0
        assert all(row[k]["median_us"] > 0 for k in ("sglang_jax", "guarded", "canary_only"))
    assert "window 2: sweep" in proc.stdout


@pytest.mark.torch  # torch tensors and triton, which the Python 3.11 leg installs
def test_the_write_benchs_chain_floor_kernel_computes_the_chains():
    """The chain floor's Triton kernel (bench/op_write.py, timed on the GPU beside the write) folds
    each request's splitmix64 chain as the host does, from each seed's hash handed over or read
    through its seed slot: run in Triton's interpreter on CPU
    tensors (in a process of its own: the interpreter is chosen when the kernel is decorated),
    on the write bench's own inputs, one request and several, an empty one among them."""
    code = """
import numpy as np, torch
from kvcanary_jax.bench import op_write
kern = op_write.chain_kernel()
for reqs, tokens, seed in ((1, 40, 0), (5, 7, 1), (3, 0, 2)):
    c = op_write.chain_inputs(reqs, tokens, seed)
    args = [torch.from_numpy(np.array(c[f]))
            for f in ("ids", "positions", "offsets", "h0", "seeds", "canary")]
    want = op_write.chain_reference(c)
    for seeded in (False, True):
        out = torch.zeros(reqs, dtype=torch.int64)
        kern[(reqs,)](*args, out, SEEDED=seeded)
        assert np.array_equal(out.numpy(), want), (reqs, tokens, seeded, out, want)
    assert tokens == 0 or not np.array_equal(want, c["h0"])
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["ok"], proc.stderr[-3000:]


def test_the_device_wheels_keep_what_the_benchmarks_import_and_skip_what_the_image_holds(tmp_path):
    """``bench.device_wheels``: a pruned wheel keeps every member but the dropped ones, bytes
    intact; SGLang's keeps its Python and drops the multimodal tree and the cp311 Rust builds;
    xprof's keeps the modules tokamax imports; the tpu-inference list asks for none of the
    image's packages and for every pin it lacks."""
    import zipfile

    from kvcanary_jax.bench import device_wheels as dw

    src, dst = tmp_path / "a.whl", tmp_path / "b.whl"
    members = {"sglang/srt/kv_canary/endpoint.py": b"x = 1\n",
               "sglang/srt/rust_extensions/loader.py": b"",
               "sglang/srt/rust_extensions/_server.cpython-311-x86_64-linux-gnu.so": b"\0" * 64,
               "sglang/multimodal_gen/runtime/a.py": b"",
               "sglang-0.5.23.dist-info/RECORD": b"r"}
    with zipfile.ZipFile(src, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    assert dw.prune(str(src), str(dst), dw._sglang_drop) == (3, 2)
    with zipfile.ZipFile(dst) as z:
        assert {n: z.read(n) for n in z.namelist()} == {
            n: d for n, d in members.items() if "multimodal_gen" not in n and not n.endswith(".so")}
    assert not dw._xprof_drop("xprof/cli/tools/__init__.py")
    assert not dw._xprof_drop("xprof/__init__.py")
    # xprof.cli's xplane tools load the profiler plugin's C library at import (the H200 run of
    # 2026-12-04 failed on its absence); its events database is never loaded.
    assert not dw._xprof_drop("xprof/convert/profiler_plugin_c_api.so")
    assert not dw._xprof_drop("xprof/profile_data.py")
    assert dw._xprof_drop("xprof/convert/events_db/python/libpywrap_events_db_c_api.so")
    assert dw._xprof_drop("xprof/static/index.html")
    assert not dw._xprof_drop("xprof-2.24.2.dist-info/METADATA")
    pins = {p.split("==")[0].lower().replace("_", "-") for p in dw._pins()}
    assert not pins & dw.IMAGE_HOLDS and not any(p.startswith("nvidia-") for p in pins)
    assert {"tpu-inference", "vllm-tpu", "tokamax", "xprof", "qwix", "torchax"} <= pins
    assert len(pins) == 33


@pytest.mark.e2e
@pytest.mark.torch
def test_the_write_sass_bench_reads_the_chain_loops_of_both_kernels(tmp_path):
    """``bench.write_sass`` (triton's compile for sm_90 and its nvdisasm, any machine): per token
    each of the write's chain loops (the fast and general chains, of the first block and of the
    later ones) loads a token's slot, id and position and stores three canary fields; the floor
    loads the id and position and stores nothing; all run the same three splitmix64 rounds
    (their shifts: three per round's 64-bit halves). The fast chain drops the general one's
    per-token checks and selects."""
    from kvcanary_jax.bench import write_sass

    assert write_sass.main(["--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "write_sass.json").read_text())
    f = rows["chain_floor"]["per_token"]
    assert (f["LDG.E.64"], f.get("STG.E.64", 0)) == (2, 0) and f["SHF.R.U64"] == 9
    for k in ("write_fast", "write_general", "write_first_fast", "write_first_general"):
        w = rows[k]["per_token"]
        assert w.get("LDG.E.64", 0) + w.get("LDG.E", 0) == 3 and w["STG.E.64"] == 3, k
        assert w["SHF.R.U64"] >= 9, k
        assert rows[k]["total_per_token"] > rows["chain_floor"]["total_per_token"], k
    assert "SEL" not in rows["write_fast"]["per_token"] and \
        rows["write_general"]["per_token"]["SEL"] >= 1
    assert rows["write_fast"]["total_per_token"] + 20 < rows["write_general"]["total_per_token"]
    assert (tmp_path / "write.sass").read_text().count("STG.E.64") > 0


def test_the_plan_tuner_checks_every_variant_against_the_defaults(tmp_path, monkeypatch):
    """bench/tune_plan.py off the GPU (the kernels in interpret mode, wall-clock timing), its
    lists cut to a small batch that still takes every path: the one-program and the multi-block
    offsets, another entries block, a capped grid. Every variant plans the defaults' bytes, and
    the JSON names a measured best."""
    from kvcanary_jax.bench import tune_plan

    monkeypatch.setattr(tune_plan, "MAX_PREFIX", 8)
    monkeypatch.setattr(tune_plan, "ITERS", 2)
    monkeypatch.setattr(tune_plan, "SINGLE_WARPS", [2])
    monkeypatch.setattr(tune_plan, "MULTI", [(16, 4)])
    monkeypatch.setattr(tune_plan, "ENTRY_SHAPES", [(16, 4)])
    monkeypatch.setattr(tune_plan, "PROGRAMS", [2])
    out = tmp_path / "tune_plan.json"
    monkeypatch.setattr(sys, "argv", ["tune_plan", str(out), "40"])
    assert tune_plan.main() == 0
    (res,) = json.loads(out.read_text())
    assert res["errors"] == {}
    # The defaults, 2 warps, blocks of 16, SGLang's one program, entries of 16, 2 programs.
    measured = set(res["total"])
    assert len(measured) == 6, sorted(measured)
    assert res["best"] in measured
    assert res["default_total"] is not None
