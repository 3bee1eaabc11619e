"""The canary inside vLLM's TPU backend, tpu-inference 0.32 (Python 3.12, jax 0.11.2: ``pip
install --no-deps -r requirements-tpu-inference.txt``, the packages the imported modules need).

Each life runs in a process of its own (``tests/_tpu_inference_life.py``): tpu-inference
prepends ``--xla_cpu_max_isa=AVX2`` to ``XLA_FLAGS`` and sets TPU and vLLM variables when it is
imported, so this process never imports it (checked below). The life drives a real
``TPUModelRunner`` (a tiny dummy-weight Qwen3, the jnp stand-in of its attention kernel, the
CPU patches of ``tests/_tpu_inference_runner.py``) with vLLM's own scheduler: prefill, a
same-step prefix hit, the on-device decode loop, a later prefix hit, preemption and the sweep
of cached blocks, all clean; then a flipped K byte, a wrong block-table entry, a stale block
handed out as a prefix hit and the decode loop's EOS lead, each detected where it is; then the
real-KV modes. A third life runs data parallelism 2 on two CPU devices; two more the coverage
window's campaigns (every layer's K and V). Last, the step bench's CPU smoke run and the guarded
step compiled by libtpu for v5e and v6e (``tpu_compile``). Every such process is a job of
:data:`JOBS`, started by the first test that needs one, as many at once as there are cores.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.tpu_inference

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
REAL_KV = ["VERIFY_REAL_KV_HASH_MISMATCH"]


def _command(script: list[str], devices: int = 1) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if devices > 1:  # the life's own process only
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                            + f" --xla_force_host_platform_device_count={devices}").strip()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(HERE),
                                                    env.get("PYTHONPATH")) if p)
    return [sys.executable, *script], env


def _run(*args: str, devices: int = 1) -> dict:
    """A life of ``tests/_tpu_inference_life.py``, in a process of its own: its JSON."""
    cmd, env = _command([str(HERE / "_tpu_inference_life.py"), *args], devices)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=HERE)
    assert proc.returncode == 0, _tail(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _bench(*args: str, timeout: int) -> dict:
    cmd, env = _command(["-m", "kvcanary_jax.bench.tpu_inference_step", *args])
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)
    assert proc.returncode == 0, _tail(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tail(stderr: str) -> str:
    # vLLM's scheduler logs this line at every step of a request with nothing left to compute
    # (the decode loop's last steps): it would drown the traceback.
    return "\n".join(line for line in stderr.splitlines()
                     if "Should not schedule a request that does nothing" not in line)[-6000:]


# The coverage window's campaigns: flips per layout (each life a process of its own).
COVERAGE_FLIPS = {128: 200, 64: 50}
COMPILES = (("v5e:2x2", 0), ("v6e:2x2", 64))  # (topology, coverage window)

# Every process the module runs, longest first (seconds on two cores, two at a time): each runs
# once, whichever tests read it.
JOBS = {
    **{("compile", t, w): functools.partial(
        _bench, "--compile", t, "--head-dim", "128,64", "--coverage-window", str(w),
        timeout=1800) for t, w in COMPILES},
    **{("coverage", h): functools.partial(_run, "--coverage-flips", str(COVERAGE_FLIPS[h]),
                                          "--head-dim", str(h)) for h in (128, 64)},
    **{("life", h): functools.partial(_run, "--head-dim", str(h)) for h in (128, 64)},
    ("dp",): functools.partial(_run, "--dp", "2", devices=2),
    ("bench",): functools.partial(_bench, "--smoke", timeout=900),
    ("raise",): functools.partial(_run, "--raise-mode"),
    ("trust",): functools.partial(_run, "--trust"),
    ("warm",): functools.partial(_run, "--warm-up"),
    ("forbid",): functools.partial(_run, "--warm-up", "--forbid-compile"),
    ("forbid_uninstall",): functools.partial(_run, "--forbid-uninstall"),
}
_POOL: dict = {}


def _job(request, key) -> dict:
    """``JOBS[key]``'s result. The first call starts every job the session's selected tests
    need, as many at a time as there are cores (2 to 4), longest first (the processes are the
    module's time: run one after the other, they left a core idle)."""
    if not _POOL:
        needed = set()
        for item in request.session.items:
            if item.path.name == pathlib.Path(__file__).name:
                needed.update(_jobs_of(item))
        workers = min(max(2, os.cpu_count() or 2), 4)  # each process is 1-2 GB
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
        _POOL.update({k: pool.submit(JOBS[k]) for k in JOBS if k in needed})
        pool.shutdown(wait=False)
    if key not in _POOL:  # not foreseen (a test calling a job by hand): run it now
        future = concurrent.futures.Future()
        try:
            future.set_result(JOBS[key]())
        except BaseException as e:
            future.set_exception(e)
        _POOL[key] = future
    return _POOL[key].result()


@pytest.fixture(scope="module", autouse=True)
def _jobs_cancelled_at_the_end():
    """Jobs still queued when the module ends (``-x`` stopped it, a test failed first) are
    not started: the interpreter would wait for them at exit."""
    yield
    for future in _POOL.values():
        future.cancel()


def _jobs_of(item) -> set:
    params = getattr(getattr(item, "callspec", None), "params", {})
    jobs = {("life", params["life"])} if "life" in item.fixturenames else set()
    if "coverage" in item.fixturenames:
        jobs.add(("coverage", params["coverage"]))
    if "full" in item.fixturenames:
        jobs.add(("life", 128))
    if "dp" in item.fixturenames:
        jobs.add(("dp",))
    for key in getattr(item.function, "jobs", ()):
        jobs.add(key(params) if callable(key) else key)
    return jobs


def uses(*keys):
    """The jobs a test reads by hand (a key, or a function of its parameters giving one)."""
    def mark(fn):
        fn.jobs = keys
        return fn
    return mark


@pytest.fixture(scope="module", params=[128, 64], ids=["head_dim128", "head_dim64"])
def life(request):
    return _job(request, ("life", request.param))


@pytest.fixture(scope="module")
def full(request):
    """The head_dim 128 life, the one that also runs the table, stale-block and EOS faults."""
    return _job(request, ("life", 128))


@pytest.fixture(scope="module")
def dp(request):
    """Data parallelism 2 on two CPU devices, with tpu-inference's DPScheduler."""
    return _job(request, ("dp",))


def _rows(found):
    return sorted({(v["tag"], v["slot"], v["position"], tuple(v["reasons"])) for v in found})


def test_this_process_never_imports_tpu_inference_and_keeps_its_xla_flags(life):
    assert "tpu_inference" not in sys.modules and "vllm" not in sys.modules
    assert "xla_cpu_max_isa" not in os.environ.get("XLA_FLAGS", "")
    # The life's own process shows what importing tpu-inference does to the variable.
    assert "--xla_cpu_max_isa=AVX2" in life["xla_flags"]["after"]
    assert "xla_cpu_max_isa" not in life["xla_flags"]["before"]


def test_the_life_is_vllm_s(life):
    assert life["layout"] == ("rpa_v3" if life["head_dim"] == 128 else "rpa_v3_hd64")
    assert life["layers"] == ["layer.0"] and life["num_shards"] == 1
    assert life["prefix_hits"]["b"] == 16  # in the step that fills the block
    assert life["prefix_hits"]["c"] == 16  # after it
    assert life["loops"] >= 3  # decode ran in the on-device loop, 4 steps a call
    assert life["cached_chains"]  # the sweep had cached blocks to re-verify
    if life["head_dim"] == 128:
        assert life["preempted"] == ["r"]
        assert life["prefix_hits"]["i"] == 16


def test_the_real_runner_s_bad_installs_are_refused_and_change_nothing(life):
    refused = life["refused"]
    assert {k: v["untouched"] for k, v in refused.items()} == dict.fromkeys(refused, True)
    assert refused["layer"]["error"] == ("kv-canary tpu-inference: no KV cache for layer.2 "
                                         "(layers: layer.0, layer.1)")
    assert refused["k_heads"]["error"] == (
        "kv-canary tpu-inference: k_heads must be in [1, 2] (at most 4 sources, 2 KV heads per "
        "shard), got 3")
    assert refused["real_data"]["error"].startswith("kv-canary: real_data")
    assert refused["coverage_no_sweep"]["error"].startswith(
        "kv-canary tpu-inference: coverage_window 4 verifies the slots steps read within 4 "
        "steps and the cached blocks at each of the guard's sweeps: pass sweep_interval=K > 0")
    assert refused["coverage_negative"]["error"] == (
        "kv-canary tpu-inference: coverage_window must be an int >= 0, got -1")
    assert refused["coverage_layers"]["error"].startswith(
        "kv-canary tpu-inference: coverage_window 4 digests every layer's KV as layer.0's "
        "layout, but runner.kv_caches[1] is ")
    # This life's runner runs the on-device decode loop; the refusal's runner has no
    # compilation manager whose loop warm-up the guard could reach.
    assert refused["forbid_compile"]["error"].startswith(
        "kv-canary tpu-inference: the runner forbids compilation while it steps "
        "(VLLM_XLA_CHECK_RECOMPILATION=1) and runs the on-device decode loop "
        "(enable_continue_decode), but has no compilation_manager._precompile_continue_decode")


def test_clean_life_has_no_violations(life):
    assert [s["new_violations"] for s in life["life"] if "," not in s["step"]
            and not s["step"].startswith(("f decode", "g decode", "i prefill", "w0 decode"))
            ] == [[] for s in life["life"] if "," not in s["step"]
                  and not s["step"].startswith(("f decode", "g decode", "i prefill",
                                                "w0 decode"))]
    assert life["clean_total"] == [0]


def test_flipped_k_byte_is_found_by_tail_in_every_loop_step(life):
    flip = life["faults"]["flip"]
    assert _rows(flip["found"]) == [("TAIL_K_FULL", flip["slot"], flip["position"],
                                     tuple(REAL_KV))]
    assert len(flip["found"]) == 4  # once per on-device decode step of the loop


def _table_fault_rows(table, first_token: int, bs: int = 16):
    """Every row a wrong entry for block 1 of a request (token ``first_token + p`` at position
    ``p``) gives in one loop call: its positions 16..31 read from the wrong block, whose stamps
    (``held``) are not the request's, and the chain broken twice, where the request's sequence
    enters the wrong block (its first slot) and where it leaves it (position 32, whose
    predecessor is read from the wrong block's last slot). Inside the wrong block every slot
    links to the one before it: it holds one chain of consecutive positions, or nothing (an
    unwritten block: zero stamps, and a zero link hashes to zero)."""
    held = [tuple(h) for h in table["held"]]
    assert held == [(0, 0)] * bs or [p for _, p in held] == list(
        range(held[0][1], held[0][1] + bs))
    expected = []
    for k, (token, position) in enumerate(held):
        reasons = {"VERIFY_CHAIN_HASH_MISMATCH"} if k == 0 else set()
        if position != bs + k:
            reasons.add("VERIFY_POSITION_MISMATCH")
        if token != first_token + bs + k:
            reasons.add("VERIFY_TOKEN_MISMATCH")
        expected.append((table["wrong"] * bs + k, position, token, first_token + bs + k, reasons))
    expected.append((table["after"], 2 * bs, first_token + 2 * bs, first_token + 2 * bs,
                     {"VERIFY_CHAIN_HASH_MISMATCH"}))
    return sorted((tag, slot, pos, tok, exp, tuple(sorted(r)))
                  for tag in ("HEAD_K_FULL", "TAIL_K_FULL")
                  for slot, pos, tok, exp, r in expected) * table["loop_steps"]


def _found_rows(found):
    return sorted((v["tag"], v["slot"], v["position"], v["token"], v["expected_token"],
                   tuple(sorted(v["reasons"]))) for v in found)


def test_a_call_update_states_did_not_describe_runs_unguarded(life):
    """``runner.model_fn`` called again for a step that already ran (a warm-up or a replay:
    ``update_states`` did not describe it) runs the runner's own step: no guarded step
    counted, nothing reported (the flip test after it still finds exactly its one slot)."""
    replay = life["faults"]["replay"]
    assert replay["after"] == replay["before"]


def test_wrong_block_table_entry_is_verified_and_remediated(full):
    """g's second block-table entry points at another block for one decode-loop call: every
    loop step reads g's positions 16..31 from the wrong block (their stamps are another
    request's, g's tokens 416..431 were expected there) and the chain breaks where g enters
    and leaves it; nothing else is reported."""
    table = full["faults"]["table"]
    assert table["loop_steps"] == 4
    assert _found_rows(table["found"]) == sorted(_table_fault_rows(table, 400))
    # Every row is g's (the block table the step read says so, the wrong block included); g
    # is aborted and both blocks are evicted from the prefix cache.
    assert table["requests"] == ["g"]
    assert table["aborted"]
    assert sorted(table["evicted"]) == [[0, b] for b in sorted({table["wrong"],
                                                                 table["after"] // 16})]


def test_stale_block_handed_out_as_a_prefix_hit(full):
    stale = full["faults"]["stale"]
    assert stale["computed"] == 16
    slots = list(range(stale["stale_block"] * 16, stale["stale_block"] * 16 + 16))
    rows = _rows(stale["found"])
    assert rows == sorted((t, s, p, ("VERIFY_TOKEN_MISMATCH",))
                          for t in ("HEAD_K_FULL", "TAIL_K_FULL") for p, s in enumerate(slots))
    assert {(v["token"], v["expected_token"]) for v in stale["found"]} == {
        (450 + p, 60 + p) for p in range(16)}
    assert stale["aborted"] and [0, stale["stale_block"]] in stale["evicted"]


def test_the_decode_loop_eos_lead(full):
    """With the loop's EOS check interval 0, the lane that sampled EOS keeps writing the padding
    token's KV over its last real token's slot: the write's input check sees the padding token
    where the request's token was; with the default interval 1 the loop stops and nothing is
    reported."""
    eos = full["faults"]["eos"]
    t, pad = eos["tokens"], eos["pad"]
    assert pad not in t[:3]
    assert eos["w1"]["found"] == []
    w0 = eos["w0"]
    assert _rows(w0["found"]) == [(tag, w0["slot"], w0["position"], ("WRITE_TOKEN_MISMATCH",))
                                  for tag in ("HEAD_K_FULL", "TAIL_K_FULL")]
    assert {(v["token"], v["expected_token"]) for v in w0["found"]} == {(pad, t[1])}
    assert len(w0["found"]) == 4  # the loop's third and fourth steps, HEAD and TAIL each


def test_the_guards_own_sweep_runs_after_every_kind_of_step(full):
    """``sweep_interval=1``: the sweep after a plain step reads the KV that step returned (not
    the donated arrays the runner still holds until ``model_fn`` returns), after a decode loop
    the KV the loop stored; every step sweeps, a prefix hit included, and nothing is reported."""
    s = full["sweep_every_step"]
    assert s["steps"] == s["sweeps"] == len(s["scheduled"]) > 0
    assert s["total"] == [0] and s["prefix_hit"] == 16
    assert any(n > 1 for step in s["scheduled"] for n in step.values())  # prefills
    assert any(step and all(n == 4 for n in step.values()) for step in s["scheduled"])  # loops


@uses(("raise",))
def test_a_raise_after_a_plain_step_leaves_the_runner_a_live_cache(request):
    """Mode "raise": the error raised from ``runner.model_fn`` after a plain step carries that
    step's KV, and the runner holds it too (it held the donated, deleted arrays before)."""
    r = _job(request, ("raise",))
    assert r["raised"] == "CanaryViolationError", r
    assert r["kv_attached"] and r["runner_kv_live"], r
    assert r["reasons"] == REAL_KV, r


@uses(("warm",))
def test_a_guard_installed_before_the_runners_warm_up_compiles_nothing_while_serving(request):
    """tpu-inference's own warm-up (``capture_model()``, a ``model_fn`` call per token bucket)
    compiles the guard's jits too (with a ``sweep_interval``, the sweep's): then serving
    (prefills and decodes of every bucket, a
    same-step prefix hit that splits HEAD and TAIL in two passes, a chunked prompt) misses no
    lowering in them (what ``VLLM_XLA_CHECK_RECOMPILATION`` counts), and a flipped K byte is
    still found. A thread calling ``guard.sweep()`` all through the warm-up gets no error."""
    w = _job(request, ("warm",))
    assert w["skip_precompile"], w  # the variable the life set for the warm-up is restored
    # A thread sweeping all through the warm-up never read the KV a warm-up call donated
    # (before the first guarded step a sweep has nothing to check, and returns).
    assert w["sweeps_during_warm_up"] > 10 and w["sweep_errors"] == [], w
    assert w["warmed"] == len(w["paddings"]) == 3, w
    assert w["compiles"] == {"delta": 0, "head": 0, "tail": 0, "sweep": 0}, w
    # The runner's own step gets the keywords the runner passed (what its warm-up compiled with).
    assert w["runner_keywords"] == ["shared_attention_metadata"], w
    assert min(w["calls"].values()) >= 1 and w["calls"]["head"] >= 4, w
    assert w["splits"] == [False, True], w
    used = {min(p for p in w["paddings"] if p >= t) for t in w["tokens"] if t}
    assert used == set(w["paddings"]), w
    assert w["found"] and {(f["slot"], f["position"], tuple(f["reasons"]))
                           for f in w["found"]} == {(w["flipped"], 3, tuple(REAL_KV))}, w
    assert w["violations"] == [len(w["found"])], w


@uses(("forbid",))
def test_a_runner_that_forbids_compiling_while_it_steps_serves_guarded(request):
    """``VLLM_XLA_CHECK_RECOMPILATION=1``: the runner steps inside its own ``ForbidCompile``,
    which raises at any compilation inside a step. A guard installed before the runner's
    warm-up has compiled everything a step runs there (HEAD, TAIL, the delta, the sweep, the
    readback each step stages, the on-device decode loop over the guard's carry): the same
    serving as above, a sweep every 3 steps and a thread
    sweeping through the warm-up, with a coverage window and its count in the stats line every
    step, raises nothing and finds the flipped K byte; ``coverage()`` inside the check compiles
    nothing. A step of shapes the warm-up did not compile (an install after it) is refused
    before anything runs."""
    w = _job(request, ("forbid",))
    # With a coverage window and the stats line every step; coverage() from another thread
    # while a step runs compiles nothing either.
    assert isinstance(w["coverage_during_a_step"], float), w
    assert w["unwarmed_error"].startswith(
        "kv-canary tpu-inference: the runner forbids compiling while it steps "
        "(VLLM_XLA_CHECK_RECOMPILATION=1), and the guard's programs for this step's shapes "), w
    assert "install the guard before capture_model()" in w["unwarmed_error"], w
    assert w["unwarmed_state_kept"], w
    assert w["unwarmed_loop_error"].startswith(
        "kv-canary tpu-inference: the runner forbids compiling while it steps "
        "(VLLM_XLA_CHECK_RECOMPILATION=1), and its on-device decode loop was not compiled "
        "over the guard's state in the runner's warm-up"), w
    assert w["unwarmed_loop_state_kept"], w
    # The on-device decode loop too: compiled in the warm-up over the guard's carry.
    assert (w["forbid"], w["loops"], w["warmed_loop"]) == ("ForbidCompile", True, True), w
    assert w["compiles"] == {"delta": 0, "head": 0, "tail": 0, "sweep": 0}, w
    # The delta's own jit runs before each decode loop, and for a step only for a delta bigger
    # than the step (the chunked prompt's first chunk sends the whole prompt); the others ride
    # in HEAD's one pass.
    assert w["calls"]["head"] >= 5 and w["calls"]["loop"] >= 3, w
    assert 1 <= w["calls"]["delta"] - w["calls"]["loop"] < w["calls"]["head"], w
    assert w["calls"]["sweep"] >= 3, w
    assert w["splits"] == [False, True], w
    assert w["sweep_errors"] == [], w
    # Found by the fingerprint, and by the digest of the window's every-layer check where a
    # decode loop's step read the slot: nothing else, nowhere else.
    assert w["found"] and {(f["slot"], f["position"], tuple(f["reasons"]))
                           for f in w["found"]} - {(w["flipped"], 3, ("KV_DIGEST_MISMATCH",))} \
        == {(w["flipped"], 3, tuple(REAL_KV))}, w
    assert w["violations"] == [len(w["found"])], w


@uses(("forbid_uninstall",))
def test_a_runner_that_forbids_compiling_serves_its_own_loop_after_uninstall(request):
    """Under ``VLLM_XLA_CHECK_RECOMPILATION=1`` the runner's warm-up compiles its loop with the
    guard's step: the guard warms the runner's own loop too, so after ``uninstall()`` the
    runner serves on, its own decode loop included, and nothing compiles inside its check."""
    w = _job(request, ("forbid_uninstall",))
    assert w["violations"] == [0], w
    assert w["loops"]["guarded"] >= 2 and w["loops"]["own"] >= 1, w
    assert w["outputs"] == {"u1": 9, "u2": 9}, w


@uses(("trust",))
def test_what_an_operator_does_around_a_guard_with_a_window(request):
    """A second install over a guarded runner is refused and changes nothing; the guard's
    readers and sweeps called from another thread while the runner serves (prefix hits, the
    decode loop) raise nothing and report nothing on clean KV; a flip in a cached block of layer
    1 found by a sweep called by hand is reported by ``flush()``; ``uninstall()`` twice gives
    the runner its own functions back, and the uninstalled guard refuses a sweep; an install again over the warm prefix cache reports
    nothing on the KV the first one's life wrote, and guards what is written after it; a
    decode loop, then a plain step, failing on the device
    after taking the canary's state raise their own errors, and the guard, its canary restarted,
    serves on clean; a late report of a request whose id a client has sent again does not abort
    the new request."""
    t = _job(request, ("trust",))
    assert "guarded already" in t["second_install"]["error"], t
    assert t["second_install"]["untouched"], t
    th = t["threads"]
    assert th["n_errors"] == 0, th["errors"]
    assert th["total"] == [0] and th["share"] == 1.0 and th["loops"] > 0, th
    assert min(th["calls"].values()) > 0, th
    assert t["manual_sweep"]["reported"] == [t["manual_sweep"]["slot"]], t
    assert t["manual_sweep"]["manager_coverage"], t
    assert t["uninstall_twice"] == {"restored": True, "marker": False}, t
    assert "sweep() of an uninstalled guard" in t["sweep_after_uninstall"], t
    w = t["warm_reinstall"]  # vLLM's prefix cache not reset: its blocks have no canary
    assert w["hits"] == {"w0": 16, "w1": 16}, w
    assert w["counts"] == [0] and w["reported"] == [] and w["share"] == 1.0, w
    assert w["warned"] == 1, w  # said once: those slots go unchecked
    assert w["found"] == [w["own"]], w  # a block written after the install is guarded
    lf = t["loop_failure"]
    assert lf["raised"] == "injected: the decode loop failed on the device", lf
    assert lf["counts"] == [0] and not lf["carried_left"] and lf["kv_arrays"] == 2, lf
    assert lf["manager_coverage"], lf  # the manager holds the fresh state, not the taken one
    sf = t["step_failure"]  # a plain step failing on the device after it took the state
    assert sf["raised"] == "injected: the step failed on the device", sf
    assert sf["counts"] == [0] and sf["manager_coverage"], sf
    # Serving on, the failed requests aborted: clean, covered, and each restart said so (the
    # blocks cached before it are not swept: they have no canary).
    on = t["served_on"]
    assert on["counts"] == [0] and on["share"] == 1.0 and len(on["restarts"]) == 2, on
    assert on["replaced"] == [], on  # the fresh state is announced, not warned of as swapped
    # An id sent again: the old request's late rows are reported (one incarnation), and the
    # new request of that id is not aborted for them (before, it was, after its prefill).
    rq = t["recycled_id"]
    assert rq["new"] == ["q"] and rq["aborted"] == [] and rq["outputs"] == 6, rq
    assert [s for s, _, _ in rq["reported"]] == [rq["slot"]], rq
    assert len({(q, n) for _, q, n in rq["reported"]}) == 1 and rq["reported"][0][1] == "q", rq


@pytest.mark.parametrize("mode, covered", [("all", {2, 4}), ("partial", {2}), ("none", set())])
def test_real_kv_modes_cover_what_they_say(life, mode, covered):
    """Three bits flipped after the prefill: K_0 in the strip's first 16 bytes (position 2),
    K_0 past them (position 4), V_0 (position 6). ``all`` fingerprints the whole K strip,
    ``partial`` its first 16 bytes, ``none`` nothing; V is not covered (SGLang's coverage: K of
    layer 0). Each covered flip is found by TAIL in every step of the loop, nothing else."""
    got = life["faults"]["real_data"][mode]
    first = 10 + 20 * ("all", "partial", "none").index(mode)  # the request's token at 0
    assert got["real_kv_hash_mode"] == mode and got["loop_steps"] == 4
    assert _found_rows(got["found"]) == sorted(
        ("TAIL_K_FULL", got["slots"][str(p)], p, first + p, first + p, tuple(REAL_KV))
        for p in covered for _ in range(4))


def test_data_parallel_clean_life(dp):
    """Two ranks, one canary each: the guarded run samples what the bare run sampled, both
    ranks served requests and ran their canary, nothing is reported."""
    assert dp["dp_size"] == 2 and dp["num_shards"] == 2
    assert dp["reset"]  # the bare run's blocks left vLLM's prefix cache before the guarded one
    assert dp["guarded"] == dp["bare"]
    assert set(dp["ranks"].values()) == {0, 1}
    assert dp["clean_total"] == [0, 0]
    assert all(n > 0 for n in dp["slot_runs"])


def test_data_parallel_flip_on_rank_1(dp):
    flip = dp["faults"]["flip"]
    assert [(v["shard"], v["tag"], v["slot"], v["position"], tuple(v["reasons"]))
            for v in flip["found"]] == [(1, "TAIL_K_FULL", flip["slot"], 3, tuple(REAL_KV))] * 4
    assert flip["requests"] == [flip["request"]] and flip["aborted"] == [flip["request"]]
    assert flip["evicted"] == [[1, flip["slot"] // 16]]


def test_data_parallel_wrong_entry_names_a_block_id_of_the_other_rank(dp):
    """Rank 0's request reads its positions 16..31 from block id ``wrong``, which rank 1's
    request holds; on rank 0 that id is a block nobody wrote. Rank 0's canary reports it (its
    own numbering), the block id alone names a request on each rank, and the remediation takes
    the report's rank: rank 0's request is aborted, rank 1's goes on."""
    table = dp["faults"]["table"]
    assert {v["shard"] for v in table["found"]} == {0}
    assert _found_rows(table["found"]) == sorted(_table_fault_rows(table, 380))
    assert table["aborted"] == [table["tampered"]]
    ambiguous = [[0, table["tampered"]], [1, table["holder"]]]
    assert {json.dumps(r) for r in table["requests"]} == {json.dumps(ambiguous),
                                                          json.dumps(table["tampered"])}
    assert sorted(table["evicted"]) == sorted([[0, table["wrong"]], [0, table["after"] // 16]])


WINDOW, SWEEP_EVERY = 4, 2  # the life's settings
DIGEST, FINGERPRINT = "KV_DIGEST_MISMATCH", "VERIFY_REAL_KV_HASH_MISMATCH"


@pytest.fixture(scope="module", params=[128, 64], ids=["head_dim128", "head_dim64"])
def coverage(request):
    return _job(request, ("coverage", request.param))


def test_coverage_window_clean_life_verifies_every_layer_s_bytes(coverage):
    """Window 4, a sweep every 2 calls: prefill, a same-step and a later prefix hit, the
    decode loop, the sweep; no violation, and the report says every live byte (each slot's
    whole row in every layer: K and V of every head) was verified within the window."""
    assert coverage["clean_total"] == [0]
    assert coverage["prefix_hits"] == {"a": 0, "b": 16, "c": 16}
    r = coverage["clean_report"]
    assert (r["window"], r["sweep_interval"], r["violations"]) == (WINDOW, SWEEP_EVERY, 0)
    assert coverage["layers"] == 2
    # head_dim 128: 2 KV heads x (K, V) x 128 lanes x 2 B; head_dim 64: 2 heads x 128 lanes x 2 B.
    assert coverage["row_bytes"] == (1024 if coverage["head_dim"] == 128 else 512)
    assert r["bytes_per_slot"] == coverage["layers"] * coverage["row_bytes"]
    assert r["live_bytes"] > 0 and r["verified_bytes"] == r["live_bytes"] and r["share"] == 1.0


def _half(head_dim: int, byte: int) -> str:
    element = byte // 2  # bf16
    if head_dim == 64:  # K_h | V_h in one 128-lane row
        return "K" if element % 128 < 64 else "V"
    return "K" if (element // 128) % 2 == 0 else "V"  # combined head 2h is K_h, 2h + 1 V_h


def test_coverage_window_finds_every_flip_in_any_layer_k_or_v(coverage):
    """A single-bit flip in a random byte of a random layer's row of a random slot, alternately
    one that running requests read at every step and one of a cached block nobody reads: each
    is found at its slot within the bound the report states (a read slot by a TAIL within the
    window, a cached one by the next sweep), nothing is reported anywhere else, and with every
    bit flipped back the rest of the life is clean."""
    head_dim = coverage["head_dim"]
    flips = coverage["campaign"]
    assert len(flips) == COVERAGE_FLIPS[head_dim]
    assert {f["layer"] for f in flips} == {0, 1}
    assert {_half(head_dim, f["byte"]) for f in flips} == {"K", "V"}
    kinds = [f["kind"] for f in flips]
    assert kinds.count("cached") >= len(flips) // 2 - 1 and kinds.count("used") >= len(flips) // 2
    assert not any(f["overwritten"] for f in flips)  # no block handed out again under a flip
    for f in flips:
        assert f["found"], f
        digest = [r for r in f["rows"] if DIGEST in r["reasons"]]
        assert {r["slot"] for r in f["rows"]} == {f["slot"]}, f  # nothing anywhere else
        assert all(set(r["reasons"]) <= {DIGEST, FINGERPRINT} for r in f["rows"]), f
        if f["kind"] == "used":
            # The call that found it began within the window of TAILs after the flip.
            assert f["calls"][-1]["tails_before"] < WINDOW, f
            assert "TAIL_K_FULL" in {r["tag"] for r in digest}, f
        else:
            assert len(f["calls"]) <= SWEEP_EVERY, f
            assert {r["tag"] for r in digest} == {"SWEEP_K_FULL"}, f
    after = coverage["after_campaign"]
    assert after["end"] == after["before"]  # every bit flipped back: clean again
    end = coverage["end_report"]
    assert end["share"] == 1.0 and end["violations"] == after["end"][0]


@uses(("bench",))
def test_the_step_bench_runs(request):
    """``bench/tpu_inference_step.py`` on the CPU (its smoke size, wall clock): a real decode
    step of the runner replayed bare, guarded and canary-only, every guarded replay clean."""
    result = _job(request, ("bench",))
    assert result["errors"] == []
    (row,) = result["rows"]
    assert (row["bs"], row["ctx"], row["violations"]) == (2, 16, 0)
    assert row["cached_tokens"] == {"min": 17, "max": 17}
    assert all(row[k]["median_us"] > 0 for k in ("bare", "guarded", "canary_only"))


@pytest.mark.tpu_compile
@pytest.mark.parametrize("topology, window", COMPILES)
@uses(lambda params: ("compile", params["topology"], params["window"]))
def test_the_guarded_step_compiles_for_v5e_and_v6e(request, topology, window):
    """The guard's jits at a serving size (256 requests of up to 8,192 tokens, 8,192 tokens a
    step, a 1M-slot cache), both KV layouts, compiled by libtpu (nothing runs): the expected-id
    delta, HEAD (one pass, and split in two), and TAIL with SGLang's layer-0 fingerprint for
    v5e, with the coverage window (every layer digested) for v6e. The canary state is donated
    and aliased in each, and TAIL only reads the KV: nothing it outputs is a copy. Compile time
    and memory of every combination: docs/tpu-inference.md."""
    result = _job(request, ("compile", topology, window))
    assert result["errors"] == []
    rows = result["rows"]
    steps = ("delta", "head", "head split", "tail")
    assert [(r["head_dim"], r["topology"], r["step"], r["coverage_window"], r["ok"])
            for r in rows] == [(h, topology, s, window, True) for h in (128, 64) for s in steps]
    for r in rows:
        assert r["kv_shape"][:2] == [1 << 16, 16] and r["reqs"] == 256 and r["tokens"] == 8192
        assert r["generated_code_size_in_bytes"] > 0 and r["seconds"] > 0
        if r["step"] in ("delta", "tail"):  # all they give back is the donated state (the
            # output's few bytes more: its tuple's index tables)
            assert 0 <= r["output_size_in_bytes"] - r["alias_size_in_bytes"] < 4096, r
            assert r["alias_size_in_bytes"] > 2**20, r
        else:  # the state, and the passes TAIL takes
            assert 0 < r["alias_size_in_bytes"] < r["output_size_in_bytes"], r
        if r["step"] == "tail" and window:
            # The digest reads every layer in place (a strip per 128-lane row): TAIL's
            # temporaries are the fingerprint's int32 strips (2.3 layers' bytes at head_dim
            # 128, 2.6 at 64 measured); a layer laid out as 32-bit rows for the digest, as a
            # whole-row source was, adds a whole one.
            layer = 2 * int(np.prod(r["kv_shape"]))  # one layer of bf16
            assert r["temp_size_in_bytes"] < (2.6 if r["head_dim"] == 128 else 3.1) * layer, r
