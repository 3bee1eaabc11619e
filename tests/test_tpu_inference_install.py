"""What ``kvcanary_jax.integrations.tpu_inference.install`` refuses, and that a refusal leaves
the runner as it was.

Every check runs before the guard touches the runner (and before it imports tpu-inference), so
these tests need neither tpu-inference nor vLLM: the runner is a stand-in with the attributes a
tpu-inference 0.32 ``TPUModelRunner`` has, its KV caches abstract arrays (shape, dtype and
placement: nothing allocated), and the installed version is the one the test says. They run in
every leg; the real runner's life is ``tests/test_tpu_inference.py``'s.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pickle
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvcanary_jax.integrations import tpu_inference as kti
from kvcanary_jax.integrations.tpu_inference import layout as L

BLOCK_SIZE = 16


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def _shape(head_dim=128, kv_heads=2, dtype=jnp.bfloat16, blocks=32):
    packing = 32 // (jnp.dtype(dtype).itemsize * 8)
    if head_dim == 64:
        return (blocks, BLOCK_SIZE, -(-kv_heads // packing), packing, 128)
    return (blocks, BLOCK_SIZE, -(-2 * kv_heads // packing), packing, -(-head_dim // 128) * 128)


def runner(*, head_dim=128, kv_heads=2, dtype=jnp.bfloat16, shape=None, spec=P(None, None, "model"),
           sharding=None, dp_size=1, async_scheduling=False, **extra):
    """A stand-in for a tpu-inference 0.32 ``TPUModelRunner`` (the attributes the guard reads)."""
    shape = shape or _shape(head_dim, kv_heads, dtype)
    if sharding is None:
        sharding = NamedSharding(_mesh(), spec)
    kv = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    hf = types.SimpleNamespace(head_dim=head_dim, hidden_size=4 * head_dim, num_attention_heads=4)
    model_config = types.SimpleNamespace(hf_text_config=hf,
                                         get_total_num_kv_heads=lambda: kv_heads)
    funcs = {name: (lambda *a, **k: None) for name in ("model_fn", "step", "update", "cont")}
    r = types.SimpleNamespace(
        model_fn=funcs["model_fn"],
        model=types.SimpleNamespace(step_fn_no_options=funcs["step"]),
        persistent_batch_manager=types.SimpleNamespace(update_states=funcs["update"]),
        _execute_continue_decode=funcs["cont"],
        kv_caches=[kv, kv], layer_name_to_kvcache_index={"layer.0": 0, "layer.1": 1},
        input_batch=types.SimpleNamespace(
            token_ids_cpu=np.zeros((4, 128), np.int32), num_tokens_no_spec=np.zeros(4, np.int32),
            block_table=[types.SimpleNamespace(max_num_blocks_per_req=8)]),
        requests={}, mesh=_mesh(), max_num_reqs=4, dp_size=dp_size,
        model_config=model_config,
        vllm_config=types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(async_scheduling=async_scheduling)),
        cache_config=types.SimpleNamespace(block_size=BLOCK_SIZE), state_leaves=[],
        speculative_config=None, is_first_rank=True, is_last_rank=True, pcp_preprocessor=None)
    for k, v in extra.items():
        setattr(r, k, v)
    return r


@pytest.fixture
def version(monkeypatch):
    """Sets the tpu-inference version ``install`` finds (None: not installed)."""
    real = importlib.metadata.version

    def set_to(v):
        def fake(name):
            if name != "tpu-inference":
                return real(name)
            if v is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return v
        monkeypatch.setattr(importlib.metadata, "version", fake)

    set_to("0.32.0")
    return set_to


def _wrapped(r):
    """What the guard would replace (None where the runner lacks it)."""
    return (getattr(r, "model_fn", None), r.model.step_fn_no_options,
            r.persistent_batch_manager.update_states,
            getattr(r, "_execute_continue_decode", None), list(r.kv_caches))


def _refused(r, exc, match, **kwargs):
    before = _wrapped(r)
    with pytest.raises(exc, match=match):
        kti.install(r, **kwargs)
    assert _wrapped(r) == before


@pytest.mark.parametrize("found", [None, "0.31.0", "0.33.1", "0.3.2"])
def test_another_tpu_inference_is_refused(version, found):
    version(found)
    _refused(runner(), ValueError,
             rf"kv-canary tpu-inference: found tpu-inference {found}; supported: 0\.32\.x$")


def test_a_runner_without_the_wrapped_attributes_is_refused(version):
    r = runner()
    del r.model_fn, r._execute_continue_decode
    _refused(r, ValueError, r"kv-canary tpu-inference: SimpleNamespace has no model_fn, "
             r"_execute_continue_decode: not a TPUModelRunner of tpu-inference 0\.32$")


@pytest.mark.parametrize("extra, what", [
    (dict(speculative_config=object()), "speculative decoding"),
    (dict(is_last_rank=False), "pipeline parallelism"),
    (dict(pcp_preprocessor=object()), "prefill context parallelism"),
])
def test_features_the_guard_does_not_cover_are_refused(version, extra, what):
    _refused(runner(**extra), NotImplementedError,
             rf"kv-canary tpu-inference: the runner uses {what}, which the guard does not cover")


def test_a_runner_that_forbids_compilation_with_a_loop_the_guard_cannot_warm_is_refused(version):
    """``VLLM_XLA_CHECK_RECOMPILATION=1`` gives the runner a ``ForbidCompile`` around each step,
    which raises at any compile inside it. The guard compiles its own programs in the runner's
    warm-up, and the on-device decode loop over its carry in the loop's warm-up, through
    ``compilation_manager._precompile_continue_decode`` (``tests/_tpu_inference_life.py
    --warm-up --forbid-compile`` serves a real runner so). A runner without that warm-up would
    compile the loop at its first use, inside the check: refused when installing."""
    ForbidCompile = type("ForbidCompile", (), {"__enter__": lambda self: self,
                                               "__exit__": lambda self, *exc: False})
    _refused(runner(maybe_forbid_compile=ForbidCompile(), enable_continue_decode=True),
             NotImplementedError,
             r"kv-canary tpu-inference: the runner forbids compilation while it steps "
             r"\(VLLM_XLA_CHECK_RECOMPILATION=1\) and runs the on-device decode loop "
             r"\(enable_continue_decode\), but has no compilation_manager\."
             r"_precompile_continue_decode: .* Install "
             r"with VLLM_XLA_CHECK_RECOMPILATION unset or 0, or without enable_continue_decode$")


def test_token_checks_under_async_scheduling_are_refused(version):
    _refused(runner(async_scheduling=True), NotImplementedError,
             r"token checks need async_scheduling=False .* pass token_checks=False")


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="none", real_data="none"), r"mode 'none' installs no guard"),
    (dict(mode="none"), r"mode 'none' installs no guard"),
    (dict(mode=" None "), r"mode 'none' installs no guard"),
    (dict(mode="warn"), r"mode \(--kv-canary\) must be one of none/log/raise, got 'warn'"),
    (dict(real_data="some"), r"real_data .* must be one of none/partial/all, got 'some'"),
    (dict(sweep_interval=-1), r"sweep_interval must be an int >= 0, got -1"),
    (dict(sweep_interval=True), r"sweep_interval must be an int >= 0, got True"),
    (dict(sweep_interval=2.0), r"sweep_interval must be an int >= 0, got 2\.0"),
    (dict(layer=-1), r"layer must be an int >= 0, got -1"),
    (dict(layer="0"), r"layer must be an int >= 0, got '0'"),
    (dict(k_heads=0), r"k_heads must be an int >= 1, got 0"),
    (dict(sweep_rows=0), r"sweep_rows must be an int >= 1, got 0"),
    (dict(layer=2), r"no KV cache for layer\.2 \(layers: layer\.0, layer\.1\)"),
    (dict(k_heads=3), r"k_heads must be in \[1, 2\] \(at most 4 sources, 2 KV heads per shard\), "
                      r"got 3"),
    (dict(implementation="cuda"), r"unknown implementation 'cuda'"),
    (dict(on_violation="abort"), r"on_violation must be callable"),
    (dict(coverage_window=-1), r"coverage_window must be an int >= 0, got -1"),
    (dict(coverage_window=4.0, sweep_interval=2), r"coverage_window must be an int >= 0, got 4\.0"),
    (dict(coverage_window=4), r"coverage_window 4 verifies the slots steps read within 4 steps "
                              r"and the cached blocks at each of the guard's sweeps: pass "
                              r"sweep_interval=K > 0"),
    (dict(coverage_window=2**30, sweep_interval=1),
     r"--kv-canary-coverage-window 1073741824: a window is at most 536870912 steps"),
    (dict(coverage_window=4, sweep_interval=2, mode="none", real_data="none"),
     r"mode 'none' installs no guard"),
    (dict(coverage_window=4, sweep_interval=2, padding_guard=True),
     r"padding_guard checks SGLang's padding slot in the manager's own sweep, which the guard "
     r"does not run"),
    # Without a window the guard's sweep is its own: the guard's word, not the manager's (which
    # asked for a sweep interval the call had given).
    (dict(sweep_interval=2, padding_guard=True), r"padding_guard checks SGLang's padding slot"),
])
def test_bad_arguments_are_refused(version, kwargs, match):
    _refused(runner(), ValueError, match, **kwargs)


def test_numpy_integers_are_taken_as_ints(version, monkeypatch):
    """A window and interval read from a config as numpy integers are ints: taken, as Python
    ints (numpy's bools and floats are not)."""
    from kvcanary_jax.integrations.tpu_inference import guard

    built = []  # the guard itself needs tpu-inference: stood in for, past every check
    monkeypatch.setattr(guard, "TpuInferenceGuard", lambda *args: built.append(args) or "guard")
    assert kti.install(runner(), coverage_window=np.int64(8), sweep_interval=np.int32(4)) == \
        "guard"
    (_, canary, manager, interval), = built
    assert (canary.coverage_window, interval) == (8, 4)
    assert type(canary.coverage_window) is int and type(interval) is int
    _refused(runner(), ValueError, r"coverage_window must be an int >= 0, got np\.True_|"
             r"coverage_window must be an int >= 0, got True", coverage_window=np.bool_(True),
             sweep_interval=4)
    _refused(runner(), ValueError, r"sweep_interval must be an int >= 0, got np\.float64\(2\.0\)|"
             r"sweep_interval must be an int >= 0, got 2\.0", sweep_interval=np.float64(2.0))


def test_a_coverage_window_over_layers_of_another_layout_is_refused(version):
    """A window digests every array of ``runner.kv_caches`` as the canary layer's layout: one
    of another shape (a hybrid model's) is refused, never left out of the digest."""
    r = runner()
    other = jax.ShapeDtypeStruct(_shape(blocks=16), jnp.bfloat16, sharding=r.kv_caches[0].sharding)
    r.kv_caches = [r.kv_caches[0], other]
    _refused(r, ValueError, r"coverage_window 8 digests every layer's KV as layer\.0's layout, but "
             r"runner\.kv_caches\[1\] is \(16, 16, 2, 2, 128\) bfloat16 .* \(caches of several "
             r"layouts, e\.g\. hybrid or MLA models, are not covered\)",
             coverage_window=8, sweep_interval=4)
    _refused(r, ValueError, r"coverage_window 8 digests every layer's KV", layer=1,
             coverage_window=8, sweep_interval=4)


def test_a_coverage_window_over_more_strips_than_a_digest_takes_is_refused(version, monkeypatch):
    """For the TPU kernel each layer gives the digest a source per 128-lane row of a slot (2 KV
    heads: 4 rows): 129 layers are 516 sources, past the 512 a digest takes. Elsewhere a layer
    is one source: 513 layers are refused, 129 are not."""
    from kvcanary_jax.integrations.tpu_inference import guard

    r = runner()
    r.kv_caches = [r.kv_caches[0]] * 513
    _refused(r, ValueError, r"coverage_window 8 cannot cover 513 layers: a slot's digest takes "
             r"at most 512 sources, and each layer gives 1", coverage_window=8, sweep_interval=4)
    r.kv_caches = r.kv_caches[:129]
    built = []  # the guard itself needs tpu-inference: stood in for, past every check
    monkeypatch.setattr(guard, "TpuInferenceGuard", lambda *args: built.append(args) or "guard")
    assert kti.install(r, coverage_window=8, sweep_interval=4) == "guard"
    (_, canary, manager, interval), = built
    assert (canary.num_layers, canary.coverage_window, interval) == (129, 8, 4)
    assert (manager.config.coverage_window, manager.config.sweep_interval) == (8, 4)
    monkeypatch.setattr(guard, "digest_reads_rows", lambda implementation, like: True)
    _refused(r, ValueError, r"coverage_window 8 cannot cover 129 layers: a slot's digest takes "
             r"at most 512 sources, and each layer gives 4", coverage_window=8, sweep_interval=4)


@pytest.mark.parametrize("text, match", [
    ("x", r'kv-canary: SGLANG_KV_CANARY_COVERAGE_WINDOW="x" is not a valid integer value'),
    ("-2", r'kv-canary: SGLANG_KV_CANARY_COVERAGE_WINDOW="-2" must be >= 0'),
    ("4", r"coverage_window 4 \(from SGLANG_KV_CANARY_COVERAGE_WINDOW\) verifies the slots "
          r"steps read .* pass sweep_interval=K > 0"),
])
def test_the_coverage_window_s_environment_variable_is_read_and_checked(version, monkeypatch,
                                                                         text, match):
    """``coverage_window`` left out: ``SGLANG_KV_CANARY_COVERAGE_WINDOW`` sets it (checked as
    SGLang checks its variables); an argument given wins over it."""
    monkeypatch.setenv("SGLANG_KV_CANARY_COVERAGE_WINDOW", text)
    _refused(runner(), ValueError, match)
    _refused(runner(), ValueError, r"k_heads must be an int >= 1", coverage_window=0, k_heads=0)


def test_the_canary_s_config_carries_the_window_and_every_layer():
    lay = L.kv_layout(_shape(), jnp.bfloat16, head_dim=128, kv_heads=2, head_shards=1,
                      block_size=BLOCK_SIZE)
    base = dict(layout=lay, layer_index=0, layers=("layer.0",), num_slots=32 * BLOCK_SIZE,
                max_reqs=4, max_blocks=8, pool_rows=8, mesh=_mesh(),
                kv_spec=P(None, None, "model", None, None))
    cfg = kti.TpuInferenceCanary(**base, coverage_window=4, num_layers=3).config
    assert (cfg.coverage_window, cfg.num_layers) == (4, 3)
    off = kti.TpuInferenceCanary(**base, num_layers=3).config
    assert (off.coverage_window, off.num_layers) == (0, None)
    srcs = lay.row_sources(jnp.zeros(_shape(), jnp.bfloat16))
    # A slot's whole row, every byte of it: 2 heads x (K, V), each a 128-lane strip of bf16.
    assert [(s.num_bytes_per_token, s.read_bytes, s.page_size, s.offset_bytes) for s in srcs] == [
        (256, 256, 1, 256 * r) for r in range(4)]


def test_a_cache_not_placed_by_a_named_sharding_is_refused(version):
    # An array's own one-device sharding (the class's name is deprecated in jax 0.12.1).
    single = jax.device_put(jnp.zeros(()), jax.devices()[0]).sharding
    _refused(runner(sharding=single), ValueError,
             r"layer\.0's KV cache is not placed with a NamedSharding \(found "
             r"SingleDeviceSharding\)")


def test_blocks_split_unlike_the_runner_s_data_parallelism_are_refused(version):
    _refused(runner(spec=P("data", None, "model"), dp_size=2), ValueError,
             r"layer\.0's blocks are split over 1 data shards but the runner has dp_size 2")


@pytest.mark.parametrize("kwargs, match", [
    (dict(shape=(32, BLOCK_SIZE, 2, 2, 128, 1)),
     r"layout not recognised \(layer\.0's KV cache: shape \(32, 16, 2, 2, 128, 1\), dtype "
     r"bfloat16, head_dim 128, kv_heads 2\); supported: tpu-inference 0\.32's RPA v3 layouts.* "
     r"\(MLA and other caches are not\)"),
    (dict(shape=(32, BLOCK_SIZE, 1, 4, 128)),
     r"packing 4 does not match dtype bfloat16 \(RPA packs 32 // 16 = 2 per row\)"),
    (dict(dtype=jnp.float64, shape=(32, BLOCK_SIZE, 4, 1, 128)),
     r"packing 1 does not match dtype float64 \(RPA packs 32 // 64 = 0 per row\)"),
    (dict(shape=(16, 2 * BLOCK_SIZE, 2, 2, 128)),
     r"block dimension 32 is not the cache's block_size 16 .*context parallelism"),
    (dict(shape=(32, BLOCK_SIZE, 2, 2, 64)),
     r"layout not recognised .*; expected \[32, 16, align\(2\*2, 2\)/2 per shard, 2, 128\]"),
    (dict(head_dim=64, shape=(32, BLOCK_SIZE, 2, 2, 128)),
     r"layout not recognised .*head_dim 64.*; expected \[32, 16, align\(2, 2\)/2 per shard, 2, "
     r"128\]"),
    (dict(head_dim=96, shape=(32, BLOCK_SIZE, 2, 2, 96)),
     r"layout not recognised .*head_dim 96.*; expected \[32, 16, align\(2\*2, 2\)/2 per shard, 2, "
     r"128\]"),
])
def test_layouts_not_recognised_are_refused(version, kwargs, match):
    _refused(runner(**kwargs), ValueError, "kv-canary tpu-inference: " + match)


@pytest.mark.parametrize("head_dim, kv_heads, dtype, kind, row, pitch, k_elems", [
    (128, 2, jnp.bfloat16, L.RPA_V3, 4 * 128, 256, 128),
    (96, 2, jnp.bfloat16, L.RPA_V3, 4 * 128, 256, 128),  # head_dim padded to 128 lanes
    (256, 1, jnp.bfloat16, L.RPA_V3, 2 * 256, 512, 256),
    (128, 3, jnp.float8_e4m3fn, L.RPA_V3, 8 * 128, 256, 128),  # 6 heads padded to 8
    (128, 2, jnp.float32, L.RPA_V3, 4 * 128, 256, 128),
    (64, 2, jnp.bfloat16, L.RPA_V3_HD64, 2 * 128, 128, 64),
    (64, 3, jnp.float8_e4m3fn, L.RPA_V3_HD64, 4 * 128, 128, 64),
])
def test_layouts_recognised(head_dim, kv_heads, dtype, kind, row, pitch, k_elems):
    lay = L.kv_layout(_shape(head_dim, kv_heads, dtype), dtype, head_dim=head_dim,
                      kv_heads=kv_heads, head_shards=1, block_size=BLOCK_SIZE)
    assert (lay.kind, lay.row_elems, lay.k_pitch, lay.k_elems, lay.local_heads) == (
        kind, row, pitch, k_elems, kv_heads)


def test_heads_that_do_not_split_over_the_head_shards_are_refused():
    with pytest.raises(ValueError, match=r"kv-canary tpu-inference: 3 head rows do not split "
                                         r"over 2 head shards"):
        L.kv_layout((32, BLOCK_SIZE, 3, 2, 128), jnp.bfloat16, head_dim=128, kv_heads=3,
                    head_shards=2, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match=r"layout not recognised .*2 head shard\(s\)"):
        L.kv_layout((32, BLOCK_SIZE, 4, 2, 128), jnp.bfloat16, head_dim=128, kv_heads=3,
                    head_shards=2, block_size=BLOCK_SIZE)


class DPScheduler:
    """tpu-inference's data-parallel scheduler as the remediation sees it: no block pool here
    (each rank's lives in a process of its own)."""

    def finish_requests(self, request_ids, status):
        pass


def test_a_remediator_without_a_block_pool_is_given_evict():
    with pytest.raises(ValueError, match=r"kv-canary tpu-inference: DPScheduler has no "
                       r"kv_cache_manager\.block_pool .* pass evict=\(rank, block\) -> None$"):
        kti.Remediator(DPScheduler())
    with pytest.raises(ValueError, match=r"evict must be callable \(rank, block\)"):
        kti.Remediator(DPScheduler(), evict="drop")
    evicted = []
    rem = kti.Remediator(DPScheduler(), evict=lambda rank, block: evicted.append((rank, block)))
    assert rem.evict is not None and rem.evicted == [] and evicted == []


def test_a_remediator_evicts_through_the_scheduler_s_block_pool_by_default():
    pool = types.SimpleNamespace(evicted=[])
    pool.evict_blocks = lambda blocks: pool.evicted.append(set(blocks))
    rem = kti.Remediator(types.SimpleNamespace(kv_cache_manager=types.SimpleNamespace(
        block_pool=pool)))
    rem.evict(0, 7)
    assert pool.evicted == [{7}]


def test_a_shared_block_resolves_to_each_request_holding_it():
    """vLLM's prefix cache hands two requests the same block (block 3): the step's rows for one
    of its slots go to each holder in turn; a block of one request, to it; a block of no
    request, to none; one held on two data-parallel ranks, to each rank's holder."""
    from kvcanary_jax.integrations.tpu_inference import guard as G, host

    rows = np.zeros((3, 4), np.int32)
    rows[0, :2], rows[1, :3], rows[2, :1] = [3, 4], [3, 5, 6], [3]
    batch = types.SimpleNamespace(
        req_id_to_index={"a": 0, "b": 1, "c": 2},
        block_table=[types.SimpleNamespace(block_table_cpu=rows,
                                           num_blocks_per_row=np.array([2, 3, 1]))])
    owners = host.block_owners(types.SimpleNamespace(input_batch=batch), [["a", "b"]])
    assert owners == [{3: ["a", "b"], 4: ["a"], 5: ["b"], 6: ["b"]}]
    guard = types.SimpleNamespace(canary=types.SimpleNamespace(
        layout=types.SimpleNamespace(block_size=BLOCK_SIZE)))
    resolve = G.TpuInferenceGuard._resolve(guard, owners)
    slot = 3 * BLOCK_SIZE + 5
    assert [resolve(slot) for _ in range(3)] == ["a", "b", "a"]
    assert resolve(4 * BLOCK_SIZE) == "a" and resolve(9 * BLOCK_SIZE) is None
    two = host.block_owners(types.SimpleNamespace(input_batch=batch), [["a"], ["c"]])
    assert G.TpuInferenceGuard._resolve(guard, two)(slot) == ((0, "a"), (1, "c"))


def test_a_remediator_acts_on_every_report_not_only_a_block_s_or_an_id_s_first(monkeypatch):
    """vLLM hands an evicted block out again and caches it under a new prefix, and a request id
    may come back: a later corruption of the same block, reported for a request of the same id,
    is remediated again (before, the first eviction and abort were the last ones: the block
    stayed cached and the next request was served the corrupted prefix). Within one report step,
    each request is aborted once and each block evicted once. A late report of a request whose
    id was sent again since aborts nothing (before, it aborted the new request)."""
    from kvcanary_jax.runtime.host import Violation
    from kvcanary_jax.runtime.reporting import ViolationReport

    if importlib.util.find_spec("vllm") is None:  # the request status the callback passes
        status = types.SimpleNamespace(FINISHED_ABORTED="FINISHED_ABORTED")
        for name, module in (("vllm", types.ModuleType("vllm")),
                             ("vllm.v1", types.ModuleType("vllm.v1")),
                             ("vllm.v1.request", types.SimpleNamespace(RequestStatus=status))):
            monkeypatch.setitem(sys.modules, name, module)

    class Scheduler:  # vLLM's finish_requests: what it finished, [] for a finished id
        def __init__(self):
            self.live, self.calls = set(), []
            block = types.SimpleNamespace
            self.pool = types.SimpleNamespace(blocks=[block(block_hash=None) for _ in range(4)])
            self.pool.evict_blocks = self._evict
            self.kv_cache_manager = types.SimpleNamespace(block_pool=self.pool)

        def finish_requests(self, request_id, status):
            self.calls.append(request_id)
            if request_id in self.live:
                self.live.discard(request_id)
                return [request_id]
            return []

        def _evict(self, blocks):
            for b in blocks:
                self.pool.blocks[b].block_hash = None

    s = Scheduler()
    dropped = []
    guard = types.SimpleNamespace(
        canary=types.SimpleNamespace(layout=types.SimpleNamespace(block_size=BLOCK_SIZE),
                                     num_shards=1, data_shards=1),
        cached=types.SimpleNamespace(drop=lambda rank, block: dropped.append((rank, block))))
    rem = kti.Remediator(s, guard)

    def report(step, slot, request):
        v = Violation(index=0, tag="TAIL_K_FULL", phase="TAIL", half="K", group="FULL",
                      op="verify", slot=slot, position=3, stored_token=1, expected_token=1,
                      stored_chain_hash=0, expected_aux=0, reason_bits=0, reasons=("x",))
        rem(ViolationReport(violation=v, step=step, rank=0, shard=0, request=request))

    slot = 2 * BLOCK_SIZE + 3
    s.live.add("s")
    s.pool.blocks[2].block_hash = "prefix-1"
    report(5, slot, "s")
    report(5, slot, "s")  # the same step's second row: nothing more to do
    assert (rem.aborted, rem.evicted, s.calls, dropped) == (["s"], [(0, 2)], ["s"], [(0, 2)])
    assert s.pool.blocks[2].block_hash is None
    report(6, slot, "s")  # a late row of the same incident: "s" is gone, block 2 uncached
    assert (rem.aborted, rem.evicted) == (["s"], [(0, 2)])
    # Block 2 handed out at once to a new request's clean prefill and cached; late rows of the
    # incident (up to two steps after the eviction) do not evict the clean block.
    s.pool.blocks[2].block_hash = "clean"
    report(7, slot, None)
    assert rem.evicted == [(0, 2)] and s.pool.blocks[2].block_hash == "clean"
    # Block 2 handed out again and cached under another prefix; "s" comes back and reads it,
    # corrupted again.
    s.live.add("s")
    s.pool.blocks[2].block_hash = "prefix-2"
    report(9, slot, "s")
    assert (rem.aborted, rem.evicted) == (["s", "s"], [(0, 2), (0, 2)])
    assert s.pool.blocks[2].block_hash is None and dropped == [(0, 2), (0, 2)]
    # A client sends "s" again once it finished: rows of the old "s" arriving late (the
    # readback a step or two behind) name that request, not the new one, which is not aborted;
    # a row of the new one is. A plain str id (a forwarded report) is aborted as before.
    u1 = kti.RequestId("u", 1)
    assert u1 == "u" and str(u1) == "u" and repr(u1) == "RequestId('u', incarnation=1)"
    assert pickle.loads(pickle.dumps(u1)).incarnation == 1
    incarnations = {"u": 2}
    guard.incarnation = incarnations.get
    rem = kti.Remediator(s, guard)
    s.live, s.calls = {"u"}, []
    report(20, slot, kti.RequestId("u", 1))
    assert (rem.aborted, s.calls, s.live) == ([], [], {"u"})
    report(21, slot, kti.RequestId("u", 2))
    assert (rem.aborted, s.calls, s.live) == (["u"], ["u"], set())
    s.live.add("v")
    report(22, slot, "v")
    assert rem.aborted == ["u", "v"]
    # The old "w" finished and a new "w" waits for its first step (the batch full): vLLM's
    # finish_requests would abort the waiting one; a late row of the old one aborts nothing.
    s.live.add("w")
    report(23, slot, kti.RequestId("w", 3))
    assert rem.aborted == ["u", "v"] and "w" in s.live
    # With an evict of its own (a data-parallel engine's), every step that reports the block.
    own = []
    rem = kti.Remediator(DPScheduler(), guard, evict=lambda rank, block: own.append(block))
    for step in (1, 1, 2, 3, 4):
        report(step, slot, "t")
    assert own == [2, 2] and rem.aborted == ["t"]  # at steps 1 and 4


@pytest.mark.parametrize("env, match", [
    ({"SGLANG_KV_CANARY_RING_CAPACITY": "abc"},
     r'kv-canary: SGLANG_KV_CANARY_RING_CAPACITY="abc" is not a valid integer value'),
    ({"SGLANG_KV_CANARY_RING_CAPACITY": "0"}, r'SGLANG_KV_CANARY_RING_CAPACITY="0" must be >= 1'),
    ({"SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT": "maybe"},
     r'SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT="maybe" is not a valid boolean value'),
])
def test_the_manager_s_environment_variables_are_read_and_checked(version, monkeypatch, env,
                                                                  match):
    """SGLang's ``SGLANG_KV_CANARY_*`` variables set the manager's fields, as for SGLang's own
    canary: before, every one but the window's was ignored, a bad value included."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _refused(runner(), ValueError, match)


def test_the_ring_capacity_comes_from_the_environment_unless_given(version, monkeypatch):
    from kvcanary_jax.integrations.tpu_inference import guard

    built = []  # the guard itself needs tpu-inference: stood in for, past every check
    monkeypatch.setattr(guard, "TpuInferenceGuard", lambda *args: built.append(args) or "guard")
    monkeypatch.setenv("SGLANG_KV_CANARY_RING_CAPACITY", "7")
    kti.install(runner())
    kti.install(runner(), ring_capacity=64)
    (_, canary, manager, _), (_, canary64, manager64, _) = built
    assert (manager.config.ring_capacity, canary.config.ring_capacity) == (7, 7)
    assert (manager64.config.ring_capacity, canary64.config.ring_capacity) == (64, 64)
    # No token variable set: the guard checks tokens (both asserts).
    assert manager.config.enable_verify_token_assert and manager.config.enable_write_input_assert
    assert canary.token_checks


@pytest.mark.parametrize("env, passed, checks", [
    ({"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "false"}, None, False),
    ({"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "0",
      "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT": "no"}, None, False),
    ({"SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT": "true"}, None, True),
    ({"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "false"}, True, True),  # the argument wins
    ({}, False, False),
])
def test_the_token_variables_set_token_checks_unless_it_is_passed(version, monkeypatch, env,
                                                                  passed, checks):
    """SGLang's two token-assert variables turn the guard's token checks off or on where
    ``token_checks`` is not passed (before, the argument's default True won over them)."""
    from kvcanary_jax.integrations.tpu_inference import guard

    built = []
    monkeypatch.setattr(guard, "TpuInferenceGuard", lambda *args: built.append(args) or "guard")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kti.install(runner(), **({} if passed is None else {"token_checks": passed}))
    (_, canary, manager, _), = built
    assert canary.token_checks is checks
    assert manager.config.enable_verify_token_assert is manager.config.enable_write_input_assert \
        is checks


def test_token_variables_that_disagree_and_odd_keywords_are_refused(version, monkeypatch):
    """The guard checks the written and the read tokens together: variables that differ are
    refused, naming both, and so are the assert names as keywords (pointing to token_checks),
    a token_checks that is not a bool, and a keyword no config has (named as install's)."""
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT", "0")
    _refused(runner(), ValueError, "ENABLE_VERIFY_TOKEN_ASSERT and SGLANG_KV_CANARY_ENABLE_"
             "WRITE_INPUT_ASSERT differ.* set both the same, or pass token_checks")
    monkeypatch.delenv("SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT")
    _refused(runner(), TypeError, r"install\(\) sets enable_verify_token_assert from "
             "token_checks.* pass token_checks=True or False", enable_verify_token_assert=False)
    _refused(runner(), ValueError, "token_checks must be True or False, got 'no'",
             token_checks="no")
    _refused(runner(), TypeError, r"install\(\) got an unexpected keyword argument 'foo'.* "
             "ManagerConfig's fields", foo=1)
    # SGLang's draft-worker offset would contradict the guard's canary (the target runner's).
    _refused(runner(), ValueError, "draft_worker is SGLang's draft model's manager.* leave it "
             "off", draft_worker=True)


def test_a_remediator_is_bound_to_the_guard_it_is_installed_with(version, monkeypatch):
    """``on_violation=Remediator(scheduler)`` gets the guard at install (before, without
    ``remediate.guard = guard`` it knew no block size and never evicted a corrupted block);
    one bound to another guard that is still installed is refused, one whose guard was
    uninstalled is bound to the new one."""
    from kvcanary_jax.integrations.tpu_inference import guard

    class Guard:
        def __init__(self, *args):
            self.installed = True

    monkeypatch.setattr(guard, "TpuInferenceGuard", Guard)
    scheduler = types.SimpleNamespace(kv_cache_manager=types.SimpleNamespace(
        block_pool=types.SimpleNamespace(evict_blocks=lambda blocks: None)))
    rem = kti.Remediator(scheduler)
    g1 = kti.install(runner(), on_violation=rem)
    assert rem.guard is g1
    _refused(runner(), ValueError, "on_violation is a Remediator serving another installed "
             "guard", on_violation=rem)
    assert rem.guard is g1
    g1.installed = False
    g2 = kti.install(runner(), on_violation=rem)
    assert rem.guard is g2


def test_install_refuses_from_env_s_own_arguments(version):
    """``environ=`` or ``kv_canary=`` are not install's: refused, not taken by the manager's
    config as another environment or another mode."""
    for kwargs in (dict(environ={}), dict(kv_canary="log"), dict(kv_canary_sweep_interval=4)):
        with pytest.raises(TypeError, match=r"install\(\) got an unexpected keyword argument"):
            kti.install(runner(), **kwargs)
