"""Cases of the write and verify ops, built for JAX (ours) and for torch (SGLang's references and
kernels, or our bridge), every keyword argument named as the op's own field.

The test suite and the benchmark build their cases here, so that a field added to a context or a
plan is added once. (Scatter and plan take plain arrays and no context: their suites and bench
modules draw their inputs themselves.)

A case is plain numpy data and Python ints, one name per field of the op it feeds:

* a **context**: :class:`~kvcanary_jax.context.VerifyOrWriteContext`'s fields, declared with
  their defaults by :class:`ContextCase`.
* a **write**: :class:`~kvcanary_jax.plans.WritePlan`'s fields (``write_num_valid_reqs`` an
  int) and ``canary_write``'s token arguments: :data:`WRITE_FIELDS`.
* a **verify**: :class:`~kvcanary_jax.plans.VerifyPlan`'s fields (``verify_num_valid`` and
  ``enable`` ints) and ``check_verify_expected_token``: :data:`VERIFY_FIELDS`.

Each side gets its own copy of every array (torch tensors for SGLang and the bridge, JAX arrays
for ours), so the two never share memory; a torch tensor handed to a torch builder is used as it
is. The JAX builders make int64 arrays: call them under ``jax.enable_x64(True)``
(:func:`jax_context` scopes it itself). torch is imported only by the torch builders
(:class:`TorchApi` names whose classes they build), so everything else serves runs without it.

The random case generators at the end (:func:`make_trip`, :func:`random_write_launch`, ...)
draw from the generator they are handed, in a fixed order: the suites' seeded cases and the
golden files (``tests/golden/``) are made of those draws, so a change of order changes them all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import consts
from kvcanary_jax.context import RealKvSource, VerifyOrWriteContext
from kvcanary_jax.contracts import TensorMeta
from kvcanary_jax.ops.plan import base as plan_base
from kvcanary_jax.plans import VerifyPlan, WritePlan

# A write case's fields: the plan's, then canary_write's token arguments.
WRITE_PLAN_FIELDS = ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")
WRITE_TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc", "enable_write_input_assert",
                      "expected_input_tokens", "expected_input_positions")
WRITE_FIELDS = WRITE_PLAN_FIELDS + WRITE_TOKEN_FIELDS
# A verify case's fields: the plan's entry arrays, its counts, and the token check.
VERIFY_ENTRY_FIELDS = plan_base.VERIFY_ARRAYS
VERIFY_FIELDS = VERIFY_ENTRY_FIELDS + ("verify_num_valid", "enable",
                                       "check_verify_expected_token")


def split_case(case: dict, fields) -> tuple[dict, dict]:
    """``(the entries of case named in fields, the others)``: a write or verify case apart from
    the context fields given with it."""
    return ({k: v for k, v in case.items() if k in fields},
            {k: v for k, v in case.items() if k not in fields})


def violation_ring(capacity: int, fill: int = 0) -> np.ndarray:
    """An int64 ``[capacity, 8]`` violation ring holding ``fill``."""
    return np.full((capacity, consts.VIOLATION_FIELDS), fill, np.int64)


@dataclasses.dataclass(frozen=True)
class ContextCase:
    """A context case: ``VerifyOrWriteContext``'s fields as numpy data and ints. ``canary_buf``
    (uint8 ``[num_slots, stride]``) and ``violation_ring`` (int64 ``[capacity, 8]``,
    :func:`violation_ring`) are arrays; the counters, the write index and the chain check are
    ints (the builders make their one-element arrays); ``kernel_kind`` and ``real_kv_hash_mode``
    are ints or enum members; ``real_kv_sources`` are :class:`KvSource` cases (a source already
    built for the framework passes through as it is). The defaults are what a case leaves out."""

    canary_buf: Any
    violation_ring: Any
    violation_write_index: int = 0
    slot_run_counter: int = 0
    kernel_run_counter: int = 0
    kernel_kind: int = consts.CanaryLaunchTag.TAIL_K_FULL
    real_kv_sources: tuple = ()
    real_kv_hash_mode: int = consts.RealKvHashMode.NONE
    enable_chain_position_assert: int = 1


@dataclasses.dataclass
class KvSource:
    """A real-KV source case: ``u8`` are the bytes of the source's rows ([rows, row_bytes]),
    read as ``dtype``; with ``offset_bytes`` > 0 the rows live that many bytes into rows
    ``2 * offset_bytes`` wider of a base buffer (a strided view, its padding 0xA5)."""

    u8: np.ndarray
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    dtype: str = "uint8"
    offset_bytes: int = 0

    def base(self) -> np.ndarray:
        """The buffer the source's rows live in (``u8`` itself without an offset)."""
        rows, rb = self.u8.shape
        if not self.offset_bytes:
            return self.u8
        base = np.full((rows, rb + 2 * self.offset_bytes), 0xA5, np.uint8)
        base[:, self.offset_bytes:self.offset_bytes + rb] = self.u8
        return base


# ---------------------------------------------------------------------------------------------
# JAX


def jax_i64(x) -> jax.Array:
    """An int64 JAX array of the integers ``x`` (under x64): a copy, never a view of ``x``'s
    memory, so that it can be donated and updated in place."""
    return jnp.array(np.asarray(x, np.int64), jnp.int64)


def _jax_typed(u8: np.ndarray, dtype: str) -> jax.Array:
    k = jnp.dtype(dtype).itemsize
    x = jnp.array(u8)
    if k == 1:
        return x if dtype == "uint8" else jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
    return jax.lax.bitcast_convert_type(x.reshape(u8.shape[0], -1, k), jnp.dtype(dtype))


def jax_source(s: KvSource) -> RealKvSource:
    """Our ``RealKvSource`` of a source case: its bytes as ``s.dtype``, a strided view of its
    base buffer where it has an offset."""
    if not s.offset_bytes:
        return RealKvSource(tensor=_jax_typed(s.u8, s.dtype), page_size=s.page_size,
                            num_bytes_per_token=s.num_bytes_per_token, read_bytes=s.read_bytes)
    base = s.base()
    k = jnp.dtype(s.dtype).itemsize
    rows, rb = s.u8.shape
    view = TensorMeta(shape=(rows, rb // k), dtype=s.dtype, strides=(base.shape[1] // k, 1),
                      device=None, framework="jax")
    return RealKvSource(tensor=_jax_typed(base, s.dtype), page_size=s.page_size,
                        num_bytes_per_token=s.num_bytes_per_token, read_bytes=s.read_bytes,
                        view=view, offset_bytes=s.offset_bytes)


def jax_context(**fields) -> VerifyOrWriteContext:
    """Our ``VerifyOrWriteContext`` of a context case (``fields``: :class:`ContextCase`'s)."""
    c = ContextCase(**fields)
    with jax.enable_x64(True):
        return VerifyOrWriteContext(
            canary_buf=jnp.array(c.canary_buf),
            kernel_kind=consts.CanaryLaunchTag(c.kernel_kind),
            violation_ring=jnp.array(c.violation_ring),
            violation_write_index=jnp.asarray([c.violation_write_index], jnp.int32),
            slot_run_counter=jnp.asarray([c.slot_run_counter], jnp.int64),
            kernel_run_counter=jnp.asarray([c.kernel_run_counter], jnp.int64),
            real_kv_sources=tuple(jax_source(s) if isinstance(s, KvSource) else s
                                  for s in c.real_kv_sources),
            real_kv_hash_mode=consts.RealKvHashMode(c.real_kv_hash_mode),
            enable_chain_position_assert=jnp.asarray([c.enable_chain_position_assert],
                                                     jnp.int32),
        )


def jax_write_plan(*, write_offsets, write_seed_slot_indices,
                   write_num_valid_reqs: int) -> WritePlan:
    """Our ``WritePlan``: int64 copies of the arrays, ``[write_num_valid_reqs]`` int32."""
    return WritePlan(write_offsets=jax_i64(write_offsets),
                     write_seed_slot_indices=jax_i64(write_seed_slot_indices),
                     write_num_valid_reqs=jnp.asarray([write_num_valid_reqs], jnp.int32))


def jax_verify_plan(*, verify_slot_indices, verify_expected_tokens, verify_expected_positions,
                    verify_prev_slot_indices, verify_num_valid: int,
                    enable: int = 1) -> VerifyPlan:
    """Our ``VerifyPlan``: int64 copies of the entry arrays, ``[verify_num_valid]`` and
    ``[enable]`` int32."""
    return VerifyPlan(verify_slot_indices=jax_i64(verify_slot_indices),
                      verify_expected_tokens=jax_i64(verify_expected_tokens),
                      verify_expected_positions=jax_i64(verify_expected_positions),
                      verify_prev_slot_indices=jax_i64(verify_prev_slot_indices),
                      verify_num_valid=jnp.asarray([verify_num_valid], jnp.int32),
                      enable=jnp.asarray([enable], jnp.int32))


def jax_write_args(*, context, write_offsets, write_seed_slot_indices, write_num_valid_reqs,
                   input_ids, positions, out_cache_loc, enable_write_input_assert=False,
                   expected_input_tokens=None, expected_input_positions=None) -> dict:
    """``canary_write``'s keyword arguments for a write case on ``context``."""
    return dict(
        context=context,
        plan=jax_write_plan(write_offsets=write_offsets,
                            write_seed_slot_indices=write_seed_slot_indices,
                            write_num_valid_reqs=write_num_valid_reqs),
        input_ids=jax_i64(input_ids), positions=jax_i64(positions),
        out_cache_loc=jax_i64(out_cache_loc),
        enable_write_input_assert=enable_write_input_assert,
        expected_input_tokens=None if expected_input_tokens is None
        else jax_i64(expected_input_tokens),
        expected_input_positions=None if expected_input_positions is None
        else jax_i64(expected_input_positions))


def jax_verify_args(*, context, check_verify_expected_token=True, **plan) -> dict:
    """``canary_verify``'s keyword arguments for a verify case on ``context`` (``plan``:
    :func:`jax_verify_plan`'s arguments)."""
    return dict(context=context, plan=jax_verify_plan(**plan),
                check_verify_expected_token=check_verify_expected_token)


# ---------------------------------------------------------------------------------------------
# torch


@dataclasses.dataclass(frozen=True)
class TorchApi:
    """The torch classes a case is built as: SGLang's (:meth:`sglang`, over the modules
    :func:`kvcanary_jax.oracle.load` returns) or our bridge's (:meth:`bridge`)."""

    context: type
    real_kv_source: type
    verify_plan: type
    write_plan: type
    launch_tag: type
    hash_mode: type

    @classmethod
    def sglang(cls, sgl) -> "TorchApi":
        return cls(context=sgl.verify.VerifyOrWriteContext,
                   real_kv_source=sgl.verify.RealKvSource, verify_plan=sgl.verify.VerifyPlan,
                   write_plan=sgl.write.WritePlan, launch_tag=sgl.verify.CanaryLaunchTag,
                   hash_mode=sgl.consts.RealKvHashMode)

    @classmethod
    def bridge(cls) -> "TorchApi":
        import kvcanary_jax.bridge as bridge

        return cls(context=bridge.VerifyOrWriteContext, real_kv_source=bridge.RealKvSource,
                   verify_plan=bridge.VerifyPlan, write_plan=bridge.WritePlan,
                   launch_tag=bridge.CanaryLaunchTag, hash_mode=bridge.RealKvHashMode)


def _torch_copy(x, device):
    """A torch tensor handed in as it is; anything else copied into one (on ``device``)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x
    t = torch.from_numpy(np.array(x, copy=True))
    return t if device is None else t.to(device)


def torch_i64(x, device=None):
    """An int64 torch tensor of the integers ``x`` (on ``device``, by default the CPU)."""
    import torch

    return torch.tensor(np.asarray(x, np.int64), dtype=torch.int64, device=device)


def _torch_count(n: int, device):
    import torch

    return torch.tensor([n], dtype=torch.int32, device=device)


def torch_source(api: TorchApi, s: KvSource) -> Any:
    """``api``'s ``RealKvSource`` of a source case: a uint8 view of its rows (strided where it
    has an offset), on the CPU."""
    import torch

    base = torch.from_numpy(s.base().copy())
    t = base[:, s.offset_bytes:s.offset_bytes + s.u8.shape[1]] if s.offset_bytes else base
    return api.real_kv_source(tensor=t, page_size=s.page_size,
                              num_bytes_per_token=s.num_bytes_per_token, read_bytes=s.read_bytes)


def torch_context(api: TorchApi, *, device=None, **fields) -> Any:
    """``api``'s ``VerifyOrWriteContext`` of a context case (``fields``: :class:`ContextCase`'s).
    Arrays copied go to ``device``, by default the canary's (a numpy canary's: the CPU); the
    counters too."""
    import torch

    c = ContextCase(**fields)
    canary = _torch_copy(c.canary_buf, device)
    dev = canary.device if device is None else device
    return api.context(
        canary_buf=canary,
        kernel_kind=api.launch_tag(c.kernel_kind),
        violation_ring=_torch_copy(c.violation_ring, dev),
        violation_write_index=torch.tensor([c.violation_write_index], dtype=torch.int32,
                                           device=dev),
        slot_run_counter=torch.tensor([c.slot_run_counter], dtype=torch.int64, device=dev),
        kernel_run_counter=torch.tensor([c.kernel_run_counter], dtype=torch.int64, device=dev),
        real_kv_sources=tuple(torch_source(api, s) if isinstance(s, KvSource) else s
                              for s in c.real_kv_sources),
        real_kv_hash_mode=api.hash_mode(c.real_kv_hash_mode),
        enable_chain_position_assert=torch.tensor([c.enable_chain_position_assert],
                                                  dtype=torch.int32, device=dev),
    )


def torch_write_plan(api: TorchApi, *, write_offsets, write_seed_slot_indices,
                     write_num_valid_reqs: int, device=None) -> Any:
    """``api``'s ``WritePlan``, as :func:`jax_write_plan`."""
    return api.write_plan(write_offsets=torch_i64(write_offsets, device),
                          write_seed_slot_indices=torch_i64(write_seed_slot_indices, device),
                          write_num_valid_reqs=_torch_count(write_num_valid_reqs, device))


def torch_verify_plan(api: TorchApi, *, verify_slot_indices, verify_expected_tokens,
                      verify_expected_positions, verify_prev_slot_indices,
                      verify_num_valid: int, enable: int = 1, device=None) -> Any:
    """``api``'s ``VerifyPlan``, as :func:`jax_verify_plan`."""
    return api.verify_plan(
        verify_slot_indices=torch_i64(verify_slot_indices, device),
        verify_expected_tokens=torch_i64(verify_expected_tokens, device),
        verify_expected_positions=torch_i64(verify_expected_positions, device),
        verify_prev_slot_indices=torch_i64(verify_prev_slot_indices, device),
        verify_num_valid=_torch_count(verify_num_valid, device),
        enable=_torch_count(enable, device))


def torch_write_args(api: TorchApi, *, context, write_offsets, write_seed_slot_indices,
                     write_num_valid_reqs, input_ids, positions, out_cache_loc,
                     enable_write_input_assert=False, expected_input_tokens=None,
                     expected_input_positions=None, device=None) -> dict:
    """The keyword arguments of ``api``'s write launcher (or SGLang's reference) for a write
    case on ``context``."""
    return dict(
        context=context,
        plan=torch_write_plan(api, write_offsets=write_offsets,
                              write_seed_slot_indices=write_seed_slot_indices,
                              write_num_valid_reqs=write_num_valid_reqs, device=device),
        input_ids=torch_i64(input_ids, device), positions=torch_i64(positions, device),
        out_cache_loc=torch_i64(out_cache_loc, device),
        enable_write_input_assert=enable_write_input_assert,
        expected_input_tokens=None if expected_input_tokens is None
        else torch_i64(expected_input_tokens, device),
        expected_input_positions=None if expected_input_positions is None
        else torch_i64(expected_input_positions, device))


def torch_verify_args(api: TorchApi, *, context, check_verify_expected_token=True, device=None,
                      **plan) -> dict:
    """The keyword arguments of ``api``'s verify launcher (or SGLang's reference) for a verify
    case on ``context``."""
    return dict(context=context, plan=torch_verify_plan(api, **plan, device=device),
                check_verify_expected_token=check_verify_expected_token)


# ---------------------------------------------------------------------------------------------
# Random cases: write-then-verify round trips in fixed shape buckets, so that thousands of cases
# reuse a few interpret-mode compilations (every static choice is a function of the bucket).

NUM_SLOTS = 64
NUM_TOKENS = 24
REQ_CAP = 4
VERIFY_CAP = 64
RING_CAP = 16
# What a padding entry of a verify plan holds, per entry field.
VERIFY_PADDING = dict(verify_slot_indices=0, verify_expected_tokens=-1,
                      verify_expected_positions=0, verify_prev_slot_indices=0)


class SourceLayout(NamedTuple):
    """A bucket's real-KV source: its addressing, ``trailing_bytes`` more bytes per row than
    its pages fill, read as ``dtype``, a strided view ``offset_bytes`` into its base (0: none)."""

    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    trailing_bytes: int
    dtype: str
    offset_bytes: int


class Bucket(NamedTuple):
    """The static choices of a round trip: canary stride, the write's input assert, the
    verify's token check, and the real-KV sources."""

    stride: int
    enable_write_input_assert: bool
    check_verify_expected_token: bool
    sources: tuple


BUCKETS = (
    Bucket(32, True, True, (SourceLayout(1, 32, 32, 0, "uint8", 0),)),
    Bucket(48, False, False, (SourceLayout(2, 16, 16, 16, "bfloat16", 16),
                              SourceLayout(1, 48, 32, 0, "float32", 0))),
    Bucket(32, False, True, (SourceLayout(4, 16, 16, 0, "int64", 0),
                             SourceLayout(1, 32, 16, 16, "uint8", 16),
                             SourceLayout(2, 32, 32, 0, "bfloat16", 0),
                             SourceLayout(1, 16, 16, 0, "float32", 0))),
)


@dataclasses.dataclass
class Trip:
    """A drawn round trip (:func:`make_trip`)."""

    real_kv_sources: list
    real_kv_hash_mode: int
    stride: int
    check_verify_expected_token: bool
    chains: list  # per request: the (slot, token, position) written, in chain order
    launches: list  # write cases, one dict per launch (their kernel_kind and chain check: defaults)


def bucket_sources(rng, layout, num_slots=NUM_SLOTS) -> list:
    """Random bytes for each source of ``layout`` (``Bucket.sources``), rows for ``num_slots``."""
    out = []
    for page, nbpt, read, extra, dtype, offset in layout:
        rows = -(-num_slots // page)
        u8 = rng.integers(0, 256, (rows, page * nbpt + extra), dtype=np.uint8)
        out.append(KvSource(u8, page, nbpt, read, dtype, offset))
    return out


def make_trip(rng, real_kv_hash_mode, bucket, contiguous=False) -> Trip:
    """Two write launches (new chains, then continuations seeded from their last slots) over
    distinct slots, with skipped tokens (slot -1), empty requests and padding request rows.
    ``contiguous``: slots are handed out in increasing order (runs of consecutive slots, as a
    paged allocator gives), else in random order."""
    stride, assert_on, check_token, layout = BUCKETS[bucket]
    sources = bucket_sources(rng, layout)
    nreq = int(rng.integers(1, REQ_CAP + 1))
    free = list(np.arange(NUM_SLOTS - 1, 0, -1) if contiguous
                else rng.permutation(np.arange(1, NUM_SLOTS)))  # handed out from the end
    chains = [[] for _ in range(nreq)]
    launches = []
    for phase in range(2):
        lens = rng.integers(0, NUM_TOKENS // nreq + 1, nreq)
        offsets = np.zeros(REQ_CAP + 1, np.int64)
        offsets[1:nreq + 1] = np.cumsum(lens)
        offsets[nreq + 1:] = offsets[nreq]
        seeds = np.full(REQ_CAP, -1, np.int64)
        ids = rng.integers(0, 50000, NUM_TOKENS).astype(np.int64)
        pos = rng.integers(0, 1000, NUM_TOKENS).astype(np.int64)
        ocl = np.full(NUM_TOKENS, -1, np.int64)
        for r in range(nreq):
            if phase == 1 and chains[r]:
                seeds[r] = chains[r][-1][0]
            nextpos = chains[r][-1][2] + 1 if chains[r] else 0
            for i in range(int(offsets[r]), int(offsets[r + 1])):
                if rng.random() < 0.15 or not free:
                    continue  # a skipped token: its position is noise
                ocl[i] = free.pop()
                pos[i] = nextpos
                nextpos += 1
                chains[r].append((int(ocl[i]), int(ids[i]), int(pos[i])))
        launches.append(dict(
            write_offsets=offsets, write_seed_slot_indices=seeds,
            write_num_valid_reqs=nreq if rng.random() < 0.8 else REQ_CAP,
            input_ids=ids, positions=pos, out_cache_loc=ocl, enable_write_input_assert=assert_on,
            expected_input_tokens=ids.copy() if assert_on else None,
            expected_input_positions=pos.copy() if assert_on else None))
    return Trip(sources, real_kv_hash_mode, stride, check_token, chains, launches)


def verify_entries(rng, chains) -> dict:
    """A verify plan's entries (lists per :data:`VERIFY_ENTRY_FIELDS`) over ``chains``: each
    chain's slots in order, a tenth of the expected tokens the sentinel -1, padding entries
    (:data:`VERIFY_PADDING`) after some chains."""
    slots, etok, epos, prev = [], [], [], []
    for chain in chains:
        for j, (s, t, p) in enumerate(chain):
            slots.append(s)
            etok.append(t if rng.random() < 0.9 else -1)
            epos.append(p)
            prev.append(chain[j - 1][0] if j else -1)
        if rng.random() < 0.3:  # a padding entry
            slots.append(0), etok.append(-1), epos.append(0), prev.append(0)
    return dict(verify_slot_indices=slots, verify_expected_tokens=etok,
                verify_expected_positions=epos, verify_prev_slot_indices=prev)


def padded_verify_plan(entries: dict, capacity: int = VERIFY_CAP) -> dict:
    """A verify plan's arrays and count: ``entries`` (lists or arrays per
    :data:`VERIFY_ENTRY_FIELDS`) padded to ``capacity`` with :data:`VERIFY_PADDING`,
    ``verify_num_valid`` their number."""
    n = len(entries["verify_slot_indices"])
    pad = capacity - n
    plan = {f: np.array(list(entries[f]) + [fill] * pad, np.int64)
            for f, fill in VERIFY_PADDING.items()}
    plan["verify_num_valid"] = n
    return plan


def garbage_canary(rng, stride, num_slots=NUM_SLOTS) -> np.ndarray:
    """A zero canary but for garbage in slot 0 and past the 32 canary bytes of every slot (what
    no chain writes: it must survive)."""
    canary = np.zeros((num_slots, stride), np.uint8)
    canary[0] = rng.integers(0, 256, stride, dtype=np.uint8)
    canary[:, 32:] = rng.integers(0, 256, (num_slots, stride - 32), dtype=np.uint8)
    return canary


def random_write_launch(rng, enable_write_input_assert, kernel_kind=ContextCase.kernel_kind,
                        hazards=False) -> dict:
    """A write case (with its ``kernel_kind`` and chain check) in the buckets' shapes: requests
    over their own slot pools, slots repeating inside a request, seeds of every kind, noisy
    positions and expectations. With ``hazards`` some tokens write, and some seeds read, slots
    of other requests' pools (only a sequential run makes that deterministic)."""
    nreq = int(rng.integers(1, REQ_CAP + 1))
    pool = NUM_SLOTS // REQ_CAP
    lens = rng.integers(0, NUM_TOKENS // nreq + 1, nreq)
    offsets = np.zeros(REQ_CAP + 1, np.int64)
    offsets[1:nreq + 1] = np.cumsum(lens)
    offsets[nreq + 1:] = offsets[nreq]
    n = NUM_TOKENS
    ids = rng.integers(-3, 50, n)
    pos = np.zeros(n, np.int64)
    ocl = np.full(n, -1, np.int64)
    seeds = np.full(REQ_CAP, -1, np.int64)
    for r in range(REQ_CAP):
        lo = r * pool
        choices = [-1, -5, lo, lo + int(rng.integers(pool))]
        if hazards:
            choices.append(int(rng.integers(NUM_SLOTS)))
        seeds[r] = int(rng.choice(choices))
        a, b = int(offsets[r]), int(offsets[r + 1])
        p0 = int(rng.integers(-2, 30))
        pos[a:b] = p0 + np.cumsum(rng.choice([0, 1, 1, 1, 2], b - a))
        ocl[a:b] = lo + rng.integers(0, pool, b - a)
        if hazards:
            shared = rng.random(b - a) < 0.2
            ocl[a:b][shared] = rng.integers(0, NUM_SLOTS, int(shared.sum()))
        ocl[a:b][rng.random(b - a) < 0.15] = -1
    etok = np.where(rng.random(n) < 0.2, ids + 1, ids)
    epos = np.where(rng.random(n) < 0.2, pos - 1, pos)
    assert_on = enable_write_input_assert
    return dict(write_offsets=offsets, write_seed_slot_indices=seeds,
                write_num_valid_reqs=int(rng.choice([nreq, nreq, REQ_CAP, 0, -1])),
                input_ids=ids, positions=pos, out_cache_loc=ocl,
                enable_write_input_assert=assert_on,
                expected_input_tokens=etok if assert_on else None,
                expected_input_positions=epos if assert_on else None,
                enable_chain_position_assert=int(rng.integers(0, 2)), kernel_kind=kernel_kind)
