"""The KV digest's torch launchers (``launch_kv_digest_write`` / ``launch_kv_digest_verify``, ours):
torch tensors in, the caller's tensors updated in place, byte-equal to the numpy oracle of
``_digest_support`` over sources of every kind (SGLang's ``RealKvSource`` and the bridge's, over
strided views, paged rows, an SGLang KV pool's bf16 layers); the contracts on the torch tensors,
each refusal leaving every tensor as it was; the direct Triton path's program (lowered, mapped and
compiled for sm_90 on any machine); on a GPU (marked ``gpu``) the direct path run, against the
DLPack path and the oracle."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

import kvcanary_jax.bridge as bridge  # noqa: E402
from kvcanary_jax import consts  # noqa: E402
from kvcanary_jax.bridge import declarations  # noqa: E402
from kvcanary_jax.bridge import triton_direct as td  # noqa: E402
from kvcanary_jax.bridge.launcher import Launcher, Prepared, bind, lowered_specs  # noqa: E402

import _digest_support as ds  # noqa: E402
import _tier  # noqa: E402

CPU = torch.device("cpu")
DEVICES = [pytest.param(CPU, id="cpu"),
           pytest.param(torch.device("cuda"), id="cuda", marks=pytest.mark.gpu)]


def _torch_source(src: ds.NpSource, device, cls=bridge.RealKvSource, cache=None):
    """``src`` as a torch source: its bytes as a uint8 row view (row stride and offset as the
    oracle addresses them) of one tensor per buffer (views of one buffer share it)."""
    cache = {} if cache is None else cache
    key = id(src.base)
    if key not in cache:
        cache[key] = torch.from_numpy(src.base.reshape(-1).view(np.uint8).copy()).to(device)
    flat = cache[key]
    width = (src.view[0][1] if src.view else int(np.prod(src.base.shape[1:]))) * src.itemsize
    rows = torch.as_strided(flat, (src.rows, width), (src.row_bytes, 1), src.offset)
    return cls(tensor=rows, page_size=src.page, num_bytes_per_token=src.nbpt,
               read_bytes=src.read)


def _torch_sources(sources, device, cls=bridge.RealKvSource):
    cache = {}
    return tuple(_torch_source(s, device, cls, cache) for s in sources)


def _ctx(st: ds.State, device):
    t = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt).to(device)  # noqa: E731
    return bridge.DigestContext(
        digest_buf=t(st.digest, torch.int64), kernel_kind=st.kind,
        violation_ring=t(st.ring, torch.int64),
        violation_write_index=t([st.widx], torch.int32),
        slot_run_counter=t([st.sctr], torch.int64), kernel_run_counter=t([st.kctr], torch.int64))


def _state_of(ctx) -> ds.State:
    return ds.State(ctx.digest_buf.cpu().numpy(), ctx.violation_ring.cpu().numpy(),
                    int(ctx.violation_write_index[0]), int(ctx.slot_run_counter[0]),
                    int(ctx.kernel_run_counter[0]), int(ctx.kernel_kind))


def _i64(x, device):
    return torch.as_tensor(np.asarray(x, np.int64)).to(device)


def _i32(x, device):
    return torch.tensor([int(x)], dtype=torch.int32, device=device)


def _sglang_cls(sgl):
    return sgl.verify.RealKvSource


# --------------------------------------------------------------------------------------------
# Against the oracle


@pytest.mark.parametrize("device", DEVICES)
def test_write_then_verify_match_the_oracle_over_every_kind_of_source(device, sgl):
    """Random sources (plain rows read in part, paged 16-bit rows, a fused layer's strided head
    strips, int64 pages, a source shorter than the slots, 2 KiB strips), as SGLang's
    RealKvSource or the bridge's; hostile slots; a verify of every window and phase after a few
    stored digests and KV bits were changed: the digests, ring rows and counters the oracle
    gives."""
    rng = np.random.default_rng(3)
    count = _tier.n(10, 60)
    for i in _tier.cases("bridge digest vs oracle", 3, count):
        with _tier.case("bridge digest vs oracle", 3, i):
            n = int(rng.integers(8, 40))
            sources = ds.random_sources(rng, n, small=i % 3 != 0)
            cls = _sglang_cls(sgl) if i % 2 else bridge.RealKvSource
            tsrc = _torch_sources(sources, device, cls)
            slots = rng.integers(-3, n + 3, int(rng.integers(1, 2 * n)))
            digest = torch.zeros(n, dtype=torch.int64, device=device)
            bridge.launch_kv_digest_write(digest_buf=digest, slots=_i64(slots, device),
                                          sources=tsrc)
            want = ds.np_write(np.zeros(n, np.int64), slots, sources)
            np.testing.assert_array_equal(digest.cpu().numpy(), want)

            # Some stored digests and some KV bits changed: each shows where it is checked.
            bad = rng.choice(np.arange(1, n), size=2, replace=False)
            stored = want.copy()
            stored[bad[0]] ^= np.int64(1) << np.int64(rng.integers(64))  # bit 63 too
            flipped = ds.flip(sources, [ds.random_flip(rng, sources, int(bad[1]))])
            tflipped = _torch_sources(flipped, device, cls)
            cap = int(rng.integers(1, 3 * n))
            vslots = rng.integers(-2, n + 2, cap)
            vslots[: min(cap, 2)] = bad[: min(cap, 2)]
            positions = rng.integers(0, 10**6, cap)
            window = int(rng.choice([1, 2, 3, 8]))
            phase = int(rng.integers(-20, 20))
            num_valid = int(rng.integers(-1, cap + 2))
            st = ds.State(stored, rng.integers(-2**62, 2**62, (int(rng.choice([0, 2, 64])), 8)),
                          int(rng.choice([0, 1, 5])), 3, 4, int(rng.integers(0, 20)))
            ctx = _ctx(st, device)
            bridge.launch_kv_digest_verify(
                context=ctx, slots=_i64(vslots, device), positions=_i64(positions, device),
                num_valid=_i32(num_valid, device), phase=_i32(phase, device), window=window,
                sources=tflipped)
            exp, rows = ds.np_verify(st, vslots, positions, num_valid, phase, window, flipped)
            ds.assert_verified(_state_of(ctx), exp, st, rows, ordered=device.type == "cpu")


def test_an_sglang_pool_of_bf16_layers_every_layer_and_half(sgl):
    """The coverage's sources: SGLang's MHA pool lays each layer's K and V out as the two halves
    of one bf16 allocation ``[2, slots, heads, head_dim]``; each half as rows of bytes is a
    source. One flipped bit of any layer and half of a slot changes its digest."""
    rng = np.random.default_rng(5)
    slots, layers, heads, dim = 24, 3, 2, 8
    fused = [torch.from_numpy(rng.integers(0, 2**16, (2, slots, heads, dim), dtype=np.uint16)
                              .astype(np.int16)).view(torch.bfloat16) for _ in range(layers)]
    halves = [f[h] for f in fused for h in (0, 1)]  # K_0, V_0, K_1, ...
    width = heads * dim * 2
    sources = tuple(_sglang_cls(sgl)(tensor=t.view(torch.uint8).view(slots, -1), page_size=1,
                                     num_bytes_per_token=width, read_bytes=width)
                    for t in halves)
    digest = torch.zeros(slots, dtype=torch.int64)
    every = torch.arange(slots, dtype=torch.int64)
    bridge.launch_kv_digest_write(digest_buf=digest, slots=every, sources=sources)
    strips = [t.view(torch.uint8).view(slots, -1).numpy() for t in halves]
    from kvcanary_jax import hashing
    np.testing.assert_array_equal(digest.numpy(), hashing.digest_np(strips))
    for i, t in enumerate(halves):
        ctx = bridge.DigestContext.allocate(num_slots=slots, device=CPU, kernel_kind=3)
        ctx = dataclasses.replace(ctx, digest_buf=digest)
        slot, byte = int(rng.integers(1, slots)), int(rng.integers(width))
        t.view(torch.uint8).view(slots, -1)[slot, byte] ^= 1 << int(rng.integers(8))
        bridge.launch_kv_digest_verify(context=ctx, slots=every, positions=every,
                                       num_valid=_i32(slots, CPU), phase=_i32(0, CPU),
                                       window=1, sources=sources)
        assert int(ctx.violation_write_index[0]) == 1, (i, slot)
        row = ctx.violation_ring[0].tolist()
        assert row[:5] == [3, slot, slot, 0, 0] and row[7] == consts.KV_DIGEST_MISMATCH
        # Stamped again: the next half's flip is the only change its check sees.
        bridge.launch_kv_digest_write(digest_buf=digest, slots=every, sources=sources)


def test_zero_sizes():
    src = (bridge.RealKvSource(tensor=torch.zeros(4, 16, dtype=torch.uint8), page_size=1,
                               num_bytes_per_token=16, read_bytes=16),)
    digest = torch.full((4,), 7, dtype=torch.int64)
    before = bridge.stats().get("dlpack", 0)
    bridge.launch_kv_digest_write(digest_buf=digest, slots=torch.zeros(0, dtype=torch.int64),
                                  sources=src)
    bridge.launch_kv_digest_write(digest_buf=torch.zeros(0, dtype=torch.int64),
                                  slots=torch.ones(3, dtype=torch.int64), sources=src)
    assert bridge.stats().get("dlpack", 0) == before and digest.tolist() == [7] * 4  # nothing launched
    # A verify with no entry only counts its launch.
    ctx = bridge.DigestContext.allocate(num_slots=4, device=CPU, ring_capacity=0)
    empty = torch.zeros(0, dtype=torch.int64)
    bridge.launch_kv_digest_verify(context=ctx, slots=empty, positions=empty,
                                   num_valid=_i32(5, CPU), phase=_i32(0, CPU), window=2,
                                   sources=src)
    assert (int(ctx.kernel_run_counter[0]), int(ctx.slot_run_counter[0])) == (1, 0)


def test_a_writes_slots_are_lowered_at_their_bucket_padded_with_a_skipped_slot():
    """A step's written tokens change in number every step: their slots are lowered at
    ``bucket(len)`` and handed over padded with -1 (a per-call copy), so lengths within a bucket
    share one program, and the padding writes nothing."""
    src = _model(2, 32)
    digest = torch.zeros(40, dtype=torch.int64)
    for n in (5, 7, 64, 65):
        kw = dict(digest_buf=digest, slots=torch.arange(n) % 40, sources=src)
        args, _, _ = declarations.DIGEST_WRITE.arguments(kw, declarations.DIGEST_WRITE.tensors(kw))
        (slots,) = [a for a in args if a.name == "slots"]
        assert slots.shape == ((64,) if n <= 64 else (128,))
        assert slots.pad == (None if n == 64 else -1)
    before = bridge.stats().get("bucket_copies", 0)  # a Counter's key, absent until counted
    bridge.launch_kv_digest_write(digest_buf=digest, slots=torch.tensor([3, 9]), sources=src)
    assert bridge.stats()["bucket_copies"] == before + 1
    assert torch.count_nonzero(digest).item() == 2  # slots 3 and 9 (all-zero KV): no other


# --------------------------------------------------------------------------------------------
# Contracts: each refused before anything runs, every tensor left as it was


def _good(device=CPU):
    src = tuple(bridge.RealKvSource(tensor=torch.arange(8 * 32, dtype=torch.int64)
                                    .to(torch.uint8).view(8, 32).to(device), page_size=1,
                                    num_bytes_per_token=32, read_bytes=32) for _ in range(2))
    ctx = bridge.DigestContext.allocate(num_slots=8, device=device, kernel_kind=5,
                                        ring_capacity=4)
    ctx.digest_buf.fill_(11)
    e = torch.arange(8, dtype=torch.int64, device=device)
    return dict(context=ctx, slots=e, positions=e.clone(), num_valid=_i32(8, device),
                phase=_i32(0, device), window=1, sources=src)


def _snapshot(kw):
    ctx = kw["context"]
    return [t.clone() for t in (ctx.digest_buf, ctx.violation_ring, ctx.violation_write_index,
                                ctx.slot_run_counter, ctx.kernel_run_counter)]


_P_W = "kv-canary: launch_kv_digest_write"
_P_V = "kv-canary: launch_kv_digest_verify"
_VERIFY_BAD = [
    ("slots", lambda kw: kw["slots"].to(torch.int32), TypeError,
     "kv-canary digest_verify: slots must be torch.int64, got torch.int32"),
    ("positions", lambda kw: kw["positions"][:5], ValueError,
     "kv-canary digest_verify: positions must have the shape of slots (8,), got (5,)"),
    ("num_valid", lambda kw: torch.tensor([8, 8], dtype=torch.int32), ValueError,
     "kv-canary digest_verify: num_valid must be of shape (1,), got shape (2,)"),
    ("phase", lambda kw: torch.tensor([0], dtype=torch.int64), TypeError,
     "kv-canary digest_verify: phase must be torch.int32, got torch.int64"),
    ("window", lambda kw: 0, ValueError, "kv-canary digest_verify: window must be >= 1, got 0"),
    ("window", lambda kw: True, TypeError,
     "kv-canary digest_verify: window must be a static int >= 1, got bool True"),
    ("slots", lambda kw: torch.arange(16, dtype=torch.int64)[::2], ValueError,
     f"{_P_V} slots must be contiguous, got strides (2,) for shape (8,)"),
    ("slots", lambda kw: None, TypeError, f"{_P_V} slots must be a torch.Tensor, got NoneType"),
    ("sources", lambda kw: list(kw["sources"]) * 300, ValueError,
     f"{_P_V} sources must hold 1 to 512 RealKvSource entries, got 600"),
    ("sources", lambda kw: (), ValueError,
     f"{_P_V} sources must hold 1 to 512 RealKvSource entries, got 0"),
    ("sources", lambda kw: kw["sources"][0], TypeError,
     f"{_P_V} sources must be a tuple of RealKvSource, got RealKvSource"),
    ("sources", lambda kw: (kw["sources"][0], torch.zeros(8, 32)), TypeError,
     f"{_P_V} sources[1] must be a RealKvSource (tensor, page_size, num_bytes_per_token, "
     "read_bytes), got Tensor without tensor, page_size, num_bytes_per_token, read_bytes"),
]


@pytest.mark.parametrize("field, bad, exc, message", _VERIFY_BAD,
                         ids=[f"{f}-{i}" for i, (f, *_) in enumerate(_VERIFY_BAD)])
def test_verify_refuses_bad_input_and_loses_nothing(field, bad, exc, message):
    kw = _good()
    kw[field] = bad(kw)
    before = _snapshot(kw)
    with pytest.raises(exc) as e:
        bridge.launch_kv_digest_verify(**kw)
    assert str(e.value) == message
    for a, b in zip(before, _snapshot(kw)):
        assert torch.equal(a, b)


def test_verify_refuses_a_bad_context_and_a_3d_source():
    kw = _good()
    with pytest.raises(TypeError, match=rf"^{_P_V} context must be a DigestContext .* got "
                                        r"SimpleNamespace without violation_ring"):
        bridge.launch_kv_digest_verify(**{**kw, "context": types.SimpleNamespace(
            digest_buf=kw["context"].digest_buf)})
    ctx = dataclasses.replace(kw["context"], kernel_kind=-1)
    with pytest.raises(TypeError, match=rf"^{_P_V} context.kernel_kind must be an int in "
                                        r"\[0, 2\*\*31\), got int -1"):
        bridge.launch_kv_digest_verify(**{**kw, "context": ctx})
    layer = torch.zeros(8, 2, 16, dtype=torch.uint8)

    class Source:  # duck-typed: SGLang's dataclass refuses a 3-D tensor at construction
        tensor, page_size, num_bytes_per_token, read_bytes = layer, 1, 32, 32
    with pytest.raises(ValueError, match=r"RealKvSource.tensor row is 2 bytes wide"):
        bridge.launch_kv_digest_verify(**{**kw, "sources": (Source,)})
    Source.tensor = torch.zeros(8, 64, dtype=torch.uint8)[:, ::2]
    with pytest.raises(ValueError, match=rf"^{_P_V} sources\[0\].tensor must be 2-D with packed "
                                         r"rows \(stride\(-1\) == 1\), got shape \(8, 32\) "
                                         r"strides \(64, 2\)"):
        bridge.launch_kv_digest_verify(**{**kw, "sources": (Source,)})


def test_write_refuses_bad_input_and_loses_nothing():
    kw = _good()
    digest = kw["context"].digest_buf
    cases = [
        (dict(digest_buf=digest.to(torch.int32)), TypeError,
         "kv-canary digest_write: digest_buf must be torch.int64, got torch.int32"),
        (dict(slots=kw["slots"].view(2, 4)), ValueError,
         "kv-canary digest_write: slots must be 1-D, got shape (2, 4)"),
        (dict(digest_buf=torch.zeros(16, dtype=torch.int64)[::2]), ValueError,
         f"{_P_W} digest_buf must be contiguous, got strides (2,) for shape (8,)"),
        (dict(sources=None), TypeError, f"{_P_W} sources must be a tuple of RealKvSource, got "
                                        "NoneType"),
        (dict(slots=kw["slots"].to("meta")), ValueError,
         "kv-canary: slots must be on digest_buf's device cpu, got meta"),
    ]
    for change, exc, message in cases:
        args = {**dict(digest_buf=digest, slots=kw["slots"], sources=kw["sources"]), **change}
        before = digest.clone()
        with pytest.raises(exc) as e:
            bridge.launch_kv_digest_write(**args)
        assert str(e.value) == message
        assert torch.equal(digest, before)
    # A digest buffer over a source's bytes: refused, naming both.
    src = kw["sources"][0]
    alias = src.tensor.view(-1)[:64].view(torch.int64)
    with pytest.raises(bridge.BridgeError, match="digest_buf shares memory with "
                                                 r"sources\[0\].tensor"):
        bridge.launch_kv_digest_write(digest_buf=alias, slots=kw["slots"][:2],
                                      sources=kw["sources"])


def test_verify_refuses_outputs_that_share_memory():
    kw = _good()
    ctx = kw["context"]
    shared = torch.zeros(2, dtype=torch.int64)
    ctx = dataclasses.replace(ctx, slot_run_counter=shared[:1], kernel_run_counter=shared[:1])
    with pytest.raises(bridge.BridgeError, match="share memory"):
        bridge.launch_kv_digest_verify(**{**kw, "context": ctx})


# --------------------------------------------------------------------------------------------
# The direct Triton path: its program, on any machine


def _program(decl, kw):
    ts = decl.tensors(kw)
    args, static, results = decl.arguments(kw, ts)
    names = [a.name for a in args]
    prog = td.extract_program(bind(decl.fn, names, results), lowered_specs(args),
                              results_to_args=[names.index(r) for r in results],
                              static=dict(static, platform="cuda"))
    return names, prog


def _model(layers, width, slots=40):
    """An SGLang pool's layers as sources: K and V of each, rows of ``width`` bytes."""
    return tuple(bridge.RealKvSource(tensor=torch.zeros(slots, width, dtype=torch.uint8),
                                     page_size=1, num_bytes_per_token=width, read_bytes=width)
                 for _ in range(2 * layers))


@pytest.mark.parametrize("layers, width, kernels", [
    (3, 64, {"write": ["kvcanary_digest_write"], "verify": ["kvcanary_digest_verify"]}),
    # 32 layers of 8 heads of 128 bf16: few slots spread each slot over programs, whose
    # partial sums (a scratch buffer) a finishing kernel adds.
    (32, 2048, {"write": ["kvcanary_digest_write_partials", "kvcanary_digest_write_finish"],
                "verify": ["kvcanary_digest_verify_partials", "kvcanary_digest_verify_finish"]}),
])
def test_direct_path_programs_map_every_source_and_compile_for_sm90(layers, width, kernels):
    from triton.backends.compiler import GPUTarget

    srcs = _model(layers, width)
    ctx = bridge.DigestContext.allocate(num_slots=40, device=CPU, kernel_kind=7, ring_capacity=16)
    calls = {
        "write": (declarations.DIGEST_WRITE, dict(digest_buf=ctx.digest_buf,
                                                  slots=torch.arange(8), sources=srcs)),
        "verify": (declarations.DIGEST_VERIFY, dict(
            context=ctx, slots=torch.arange(64), positions=torch.arange(64),
            num_valid=_i32(6, CPU), phase=_i32(0, CPU), window=4, sources=srcs)),
    }
    for fn, (decl, kw) in calls.items():
        names, prog = _program(decl, kw)
        assert [k.name for k in prog.kernels] == kernels[fn]
        assert prog.copies == ()
        hashing = prog.kernels[0]
        used = [names[b.index] for b in hashing.bufs if b.kind == "arg"]
        # Every source is a pointer of the hashing kernel, in order.
        assert [u for u in used if u.startswith("sources[")] == \
            [f"sources[{i}].tensor" for i in range(2 * layers)]
        last = prog.kernels[-1]
        results = [names[b.index] for b in last.bufs[-len(decl.outputs):]]
        assert results == list(decl.outputs)  # updated in place: the caller's tensors
        for k in prog.kernels:
            compiled = td.compile_kernel(k.ttir, num_warps=k.num_warps,
                                         num_stages=k.num_stages,
                                         target=GPUTarget("cuda", 90, 32))
            assert compiled.metadata.name == k.name
            assert compiled.metadata.global_scratch_size == 0


def test_direct_path_hands_the_kernels_a_padded_copy_of_the_slots():
    """The kernels read every lowered slot: the direct path's pointer for ``slots`` is a per-call
    copy of the caller's 5 slots then -1 up to the bucket, never the caller's shorter tensor."""
    src = _model(1, 32)
    kw = dict(digest_buf=torch.zeros(40, dtype=torch.int64),
              slots=torch.tensor([3, 1, 4, 1, 5]), sources=src)
    ts = declarations.DIGEST_WRITE.tensors(kw)
    args, _, _ = declarations.DIGEST_WRITE.arguments(kw, ts)
    names = tuple(a.name for a in args)
    prep = Prepared(skip=False, args=tuple(args), arg_names=names,
                    padded=tuple(i for i, a in enumerate(args) if a.pad is not None))
    ptrs, keep = Launcher.pointers(prep, ts)
    (copy,) = keep
    assert copy.tolist() == [3, 1, 4, 1, 5] + [-1] * 59
    assert ptrs[names.index("slots")] == copy.data_ptr() != kw["slots"].data_ptr()
    assert ptrs[names.index("digest_buf")] == kw["digest_buf"].data_ptr()


@pytest.mark.gpu
def test_direct_path_runs_and_agrees_with_the_dlpack_path():
    """On a CUDA GPU: the launchers take the direct path by default, and give the DLPack path's
    digests and counters (rows as multisets)."""
    cuda = torch.device("cuda")
    rng = np.random.default_rng(9)
    sources = ds.random_sources(rng, 300)
    results = {}
    for direct in (True, False):
        bridge.set_direct(direct)
        try:
            tsrc = _torch_sources(sources, cuda)
            digest = torch.zeros(300, dtype=torch.int64, device=cuda)
            every = torch.arange(300, dtype=torch.int64, device=cuda)
            bridge.launch_kv_digest_write(digest_buf=digest, slots=every, sources=tsrc)
            digest[7] ^= 1
            ctx = bridge.DigestContext(
                digest_buf=digest, kernel_kind=2,
                violation_ring=torch.zeros(8, 8, dtype=torch.int64, device=cuda),
                violation_write_index=torch.zeros(1, dtype=torch.int32, device=cuda),
                slot_run_counter=torch.zeros(1, dtype=torch.int64, device=cuda),
                kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=cuda))
            bridge.launch_kv_digest_verify(context=ctx, slots=every, positions=every,
                                           num_valid=_i32(300, cuda), phase=_i32(1, cuda),
                                           window=3, sources=tsrc)
            torch.cuda.synchronize()
            results[direct] = (digest.cpu(), sorted(map(tuple, ctx.violation_ring.tolist())),
                               int(ctx.slot_run_counter[0]), int(ctx.kernel_run_counter[0]))
            paths = bridge.paths()
            want = "triton_direct" if direct else "dlpack"
            assert paths["launch_kv_digest_write"]["path"] == want
            assert paths["launch_kv_digest_verify"]["path"] == want
        finally:
            bridge.set_direct(True)
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1:] == results[False][1:]
    assert results[True][2] == 100  # slots 1, 4, ..., 298 of the window-3 phase 1
