"""The canary inside sglang-jax 0.0.2 (Python 3.12: ``pip install --no-deps -r
requirements-sglang-jax.txt``, sglang-jax and exactly what its imported modules need).

Each life runs in its own process (a mesh of 2 CPU devices needs XLA_FLAGS before JAX starts):
``tests/_sglang_jax_life.py`` drives sglang-jax's own ``ReqToTokenPool``, ``MHATokenToKVPool``
(sharded ``P(None, "tensor")`` over the 2 devices), token / paged allocators, ``RadixCache``,
``Req`` and ``ScheduleBatch`` through prefill, decode steps, a finished request whose slots are
evicted and handed out again, and a prefix-cache hit, with the canary around every model step;
then replays one decode step with faults injected into the real pool arrays and batch fields.
``tests/_sglang_jax_runner.py`` runs a tiny random-weight Qwen2 through sglang-jax's own
``ModelRunner`` (native attention, tensor parallel 2) with the canary installed in it (and once
with the coverage window, every layer digested).
``tests/_sglang_jax_feed.py`` hands the TokenFeed the ordinary events of a server (a delta never
run, a step that failed before it ran, two states, a recycled ``id()``, a delta for another
batch) in the same world.

What does not run as shipped with our JAX versions (jax 0.12; sglang-jax 0.0.2 pins 0.8), and
what the scripts do instead (details in their docstrings):

* ``MHATokenToKVPool.set_kv_buffer`` (its Pallas TPU kernel ``kv_cache_update``) fails at trace
  time: ``AttributeError: module 'jax.experimental.pallas.tpu' has no attribute
  'TPUMemorySpace'`` (now ``pl.ANY``). The life gives the module that name and runs the kernel
  unchanged in TPU interpret mode; a second life writes through ``set_kv_buffer_legacy``, the
  path sglang-jax's native attention takes off TPU.
* ``sgl_jax.srt.layers.attention.native_backend`` fails to import with flax >= 0.12.10 (the only
  flax that imports with jax 0.12): ``ValueError: Duplicate custom PyTreeDef type registration
  for <class '...NativeAttention'>``. The runner sets flax's ``FLAX_PYTREE_MODULE=false``.
* ``ModelRunner``'s dummy loader needs ``jax.set_mesh(mesh)`` around it with flax 0.12.12.
* sglang-jax 0.0.2's ``Sampler`` cannot be traced off TPU with any jax (``ValueError: too many
  values to unpack (expected 2)`` in ``_apply_min_p_filter``); next tokens are the argmax of the
  model's logits.
* ``ForwardBatch.init_new`` in the life gets a namespace with the mesh instead of a
  ``ModelRunner`` (it reads only ``.mesh`` and ``.attn_backend``); the life's model is a
  stand-in that writes KV through the pool's own write paths.
* sglang-jax HEAD (layout ``[pages, page_size, heads*2/packing, packing, head_dim]``) pins jax
  0.10.2 and is not on the registry: a third life keeps everything of 0.0.2 but the pool, a
  stand-in with HEAD's layout, sharding and write.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sglang_jax

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def _installed() -> str | None:
    """The installed sglang-jax's version, to pick the lives to run (the scripts and the
    integration read it from sglang-jax's objects; this process does not import sglang-jax)."""
    try:
        return importlib.metadata.version("sglang-jax")
    except importlib.metadata.PackageNotFoundError:
        return None


VERSION = _installed()
V01 = VERSION is not None and not VERSION.startswith("0.0.")
LIVES = {
    f"{VERSION}-page1-tpu-kernel-feed": ("--page-size", "1", "--kv-write", "kernel",
                                         "--tokens", "feed"),
    f"{VERSION}-page4-native-path": ("--page-size", "4", "--kv-write", "legacy", "--host-table"),
}
if not V01:  # 0.1.0rc0's own pool has the layout this stand-in gives 0.0.2's world
    LIVES["head-layout-page4-feed"] = ("--page-size", "4", "--layout", "head", "--kv-write",
                                       "head", "--tokens", "feed")
R3_TOKENS = [11, 12, 13, 14, 15, 16, 17, 18, 31, 32, 33]  # the life's third request's prompt


def _run(script: str, *args: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True,
                          text=True, env=env, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout)


@pytest.fixture(scope="module", params=list(LIVES))
def life(request):
    return {**_run("_sglang_jax_life.py", *LIVES[request.param]), "name": request.param}


@pytest.fixture(scope="module")
def runner():
    return _run("_sglang_jax_runner.py")


@pytest.fixture(scope="module")
def runner_window():
    return _run("_sglang_jax_runner.py", "--coverage-window", "1")


@pytest.fixture(scope="module")
def feed_events():
    return _run("_sglang_jax_feed.py")


def _rows(found):
    return sorted((v["shard"], v["tag"], v["slot"], v["position"], tuple(v["reasons"]))
              for v in found)


def _fault(life, name):
    (entry,) = [f for f in life["faults"] if f["fault"] == name]
    return entry


REAL_KV = ("VERIFY_REAL_KV_HASH_MISMATCH",)


def test_the_life_is_sglang_jax_s(life):
    assert life["num_shards"] == 2
    assert life["kv_spec"] in ("P(None, 'tensor')", "P('data', None, 'tensor', None, None)")
    assert life["r3_prefix_len"] == 8  # the radix cache served R1's prompt to R3
    assert life["r4_reused_slots"]  # R4 got slots the allocator had handed out before
    rows = {step["step"]: step["rows"] for step in life["life"]}
    assert rows["prefill r1 r2"][0] == rows["prefill r4 (reused slots)"][0]  # and R1's row
    assert any(pre[:8] == life["r3_slots"][:8] for pre in life["sweep_prefixes"])
    if life["page_size"] > 1:  # paged allocation: page-contiguous slots, pages from 1
        for slots in (life["r3_slots"], life["r4_slots"]):
            for i in range(0, len(slots) - 1):
                if (i + 1) % life["page_size"]:
                    assert slots[i + 1] == slots[i] + 1
        assert min(life["r3_slots"] + life["r4_slots"]) >= life["page_size"]


def test_clean_life_has_no_violations(life):
    assert [step["new_violations"] for step in life["life"]] == [[]] * len(life["life"])
    assert life["sweep_clean"] == []
    assert life["total_violations_live"] == [0, 0]
    assert _fault(life, "clean replay")["step"] == []
    if "--host-table" in LIVES[life["name"]]:
        assert _fault(life, "clean replay, host req_to_token table")["step"] == []


def test_flipped_k_byte_is_found_by_the_shard_that_holds_it(life):
    s, p = life["flip"]["slot"], life["flip"]["position"]
    assert _rows(_fault(life, "flip K byte head 0")["step"]) == [(0, "TAIL_K_FULL", s, p, REAL_KV)]
    assert _rows(_fault(life, "flip K byte head 1")["step"]) == [(1, "TAIL_K_FULL", s, p, REAL_KV)]
    if "--host-table" in LIVES[life["name"]]:
        found = _fault(life, "flip K byte head 0, host req_to_token table")["step"]
        assert _rows(found) == [(0, "TAIL_K_FULL", s, p, REAL_KV)]


def test_stale_cache_loc_entry(life):
    stale = life["stale"]
    slot, pos = stale["slot"], stale["position"]
    stored_pos = life["r4_slots"].index(slot)  # the slot now holds R4's token at that position
    successor = life["r3_slots"][pos + 1]
    want = []
    for shard in (0, 1):
        for tag in ("HEAD_K_FULL", "TAIL_K_FULL"):
            want.append((shard, tag, slot, stored_pos, ("VERIFY_CHAIN_HASH_MISMATCH",
                         "VERIFY_POSITION_MISMATCH", "VERIFY_TOKEN_MISMATCH")))
            want.append((shard, tag, successor, pos + 1, ("VERIFY_CHAIN_HASH_MISMATCH",)))
    found = _fault(life, "stale cache_loc entry")["step"]
    assert _rows(found) == sorted(want)
    assert {v["expected_token"] for v in found if v["slot"] == slot} == {R3_TOKENS[pos]}


def test_swapped_slots(life):
    (sa, sb), (pa, pb) = life["swap"]["slots"], life["swap"]["positions"]
    want = [(sh, "TAIL_K_FULL", s, p, REAL_KV) for sh in (0, 1) for s, p in ((sa, pa), (sb, pb))]
    assert _rows(_fault(life, "swap two slots")["step"]) == sorted(want)


def test_write_into_a_slot_another_request_reads(life):
    s, p = life["overwrite"]["slot"], life["overwrite"]["position"]
    found = _fault(life, "write into a slot another request reads")["step"]
    assert _rows(found) == [(sh, "TAIL_K_FULL", s, p, REAL_KV) for sh in (0, 1)]


def test_write_to_slot_0_is_reported_as_sglang_reports_it(life):
    info = life["slot0"]
    entry = _fault(life, "write to slot 0")
    assert entry["step"] == []  # slot 0 itself is never verified
    # Next step: R4's slot for that position was never stamped (it holds a stale record), and
    # the chain continued from it fails the position check at R4's next slot.
    rows = _rows(entry["next_step"])
    stale = [r for r in rows if r[2] == info["r4_slot"]]
    seeded = [r for r in rows if r[2] == info["r4_next_slot"]]
    assert len(stale) + len(seeded) == len(rows) == 8
    assert {(r[0], r[1]) for r in stale} == {(sh, t) for sh in (0, 1)
                                              for t in ("HEAD_K_FULL", "TAIL_K_FULL")}
    assert all("VERIFY_POSITION_MISMATCH" in r[4] and r[3] != info["r4_position"] for r in stale)
    assert seeded == sorted((sh, t, info["r4_next_slot"], info["r4_position"] + 1,
                             ("WRITE_POSITION_MISMATCH",))
                            for sh in (0, 1) for t in ("HEAD_K_FULL", "TAIL_K_FULL"))
    assert 0 not in {r[2] for r in rows}


def test_input_id_not_the_request_s(life):
    """The write's input check against the request's history: sent whole every step, or kept on
    the device and sent as deltas (``--tokens feed``)."""
    info = life["wrong_input"]
    found = _fault(life, "input id not the request's")["step"]
    assert _rows(found) == sorted((sh, t, info["r4_slot"], info["r4_position"],
                                   ("WRITE_TOKEN_MISMATCH",))
                                  for sh in (0, 1) for t in ("HEAD_K_FULL", "TAIL_K_FULL"))
    assert {(v["token"], v["expected_token"]) for v in found} == {(info["token"],
                                                                   info["right_token"])}


def test_sweep_finds_a_flipped_byte_in_a_radix_cached_slot(life):
    sf = life["sweep_fault"]
    assert _rows(sf["found"]) == [(0, "SWEEP_K_FULL", sf["slot"], sf["position"], REAL_KV)]


def test_model_runner_with_the_canary_installed(runner):
    assert runner["num_shards"] == 2 and runner["version"] == VERSION  # read from the runner
    assert runner["kv_spec"] == ("P('data', None, 'tensor', None, None)" if V01
                                 else "P(None, 'tensor')")
    plain, guarded = runner["plain_steps"], runner["guarded_steps"]
    assert [s["mode"] for s in guarded] == ["EXTEND"] + ["DECODE"] * 4
    # The canary changes nothing the model computes: same tokens, byte-identical KV.
    assert [s["next_ids"] for s in guarded[:4]] == [s["next_ids"] for s in plain]
    assert runner["guarded_kv"] == runner["plain_kv"]
    assert [s["violations"] for s in guarded[:4]] == [[]] * 4
    flip = runner["flip"]
    assert _rows(guarded[4]["violations"]) == [
        (0, "TAIL_K_FULL", flip["slot"], flip["position"], REAL_KV)]


def test_model_runner_hook_with_the_coverage_window_digests_every_layer(runner_window):
    """The hook with a coverage window (1: every read slot checked every step) hands the canary
    every layer the runner's step returns: the model's tokens and KV are unchanged, clean steps
    are silent, and a bit flipped in the last layer's V strip of head 1 (bytes SGLang's
    fingerprint of layer 0's K never reads) is reported by the next step's digest check, on the
    shard holding head 1."""
    run = runner_window
    assert run["num_layers"] == 2 and run["flip"]["layer"] == 1
    plain, guarded = run["plain_steps"], run["guarded_steps"]
    assert [s["next_ids"] for s in guarded[:4]] == [s["next_ids"] for s in plain]
    assert run["guarded_kv"] == run["plain_kv"]
    assert [s["violations"] for s in guarded[:4]] == [[]] * 4
    flip = run["flip"]
    assert _rows(guarded[4]["violations"]) == [
        (1, "TAIL_K_FULL", flip["slot"], flip["position"], ("KV_DIGEST_MISMATCH",))]


def test_the_guarded_step_lowered_for_cuda_has_no_loop_around_its_kernels():
    """The canary-only step over sglang-jax's real pools and batches, lowered for CUDA
    (``pallas_triton``, any machine), the token ids kept on the device (a ``TokenFeed``): its six
    kernels (the plan's two, verify and write at HEAD and TAIL; no scatter, the delta is an XLA
    scatter into the kept pool) and glue with no ``while`` loop, whose every trip would be
    launches on the GPU (``python -m bench.sglang_jax_step --glue``)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "kvcanary_jax.bench.sglang_jax_step", "--glue",
                           "--smoke"], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["tokens"] == "feed" and counts["kernels"] == 6, counts
    assert counts["while_loops"] == 0, counts


def test_a_delta_never_run_records_nothing(feed_events):
    """R3's prefill (a radix hit of 8 on R1's prompt): a delta made and never run, or run by a
    step that failed before it ran, leaves the feed as it was; the next delta of that batch sends
    R3 whole, and no step reports anything."""
    never = feed_events["never run"]
    assert never["r3_prefix_len"] == 8 and never["violations"] == []
    failed = feed_events["failed before dispatch"]
    assert failed["error"] == "ValueError"
    assert not failed["state_deleted"] and not failed["kv_deleted"]
    assert failed["violations"] == []


def test_one_feed_two_states(feed_events):
    """A fork of the state runs R3's prefill after the live state did, with a delta from the same
    feed: sent whole to the fork, and whole again to the live state after it."""
    two = feed_events["two states"]
    assert two["live_prefill"] == [] and two["fork_prefill"] == [] and two["violations"] == []


def test_a_new_request_in_a_finished_one_s_row_with_its_rid(feed_events):
    """R1 finished; a new Req with R1's rid takes R1's row (a radix hit of 5 on R2's prompt):
    not taken for R1, whatever its ``id()``."""
    again = feed_events["recycled id"]
    assert again["row"] == again["r1_row"] and again["prefix_len"] == 5
    # The scenario can bite: CPython handed the new Req R1's address, or something (the feed)
    # kept R1 alive so that it could not.
    assert again["id_recycled"] or again["r1_alive"]
    assert again["violations"] == []


def test_a_delta_for_another_batch_is_refused(feed_events):
    """R3's prefill delta made from the batch padded to one row, stepped with the batch padded to
    the bucket's four: refused before anything is donated; the right delta then runs clean."""
    other = feed_events["unpadded delta"]
    assert (other["own_bs"], other["padded_bs"]) == (1, 4)
    assert other["error"] == (
        "kv-canary sglang-jax: the TokenDelta was made for another batch (rows (bs) 1, this "
        "batch's is 4); make each step's delta from the ModelWorkerBatch its ForwardBatch comes "
        "from, padded to the same buckets")
    assert not other["state_deleted"] and not other["kv_deleted"]
    assert other["violations_when_run"] == [] and other["violations"] == []
