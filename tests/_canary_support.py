"""Builds matching JAX and SGLang-oracle inputs for the write / verify tests and compares results.

A case is plain numpy data; each side gets its own copy (torch tensors for SGLang's reference,
JAX arrays for ours), so the two never share memory. torch is imported only where SGLang's side
is built, so the case builders and our side also serve runs without torch.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import consts
from kvcanary_jax.context import RealKvSource, VerifyOrWriteContext
from kvcanary_jax.contracts import TensorMeta
from kvcanary_jax.plans import VerifyPlan, WritePlan

import _impls


@dataclasses.dataclass
class State:
    canary: np.ndarray  # uint8 [num_slots, stride]
    ring: np.ndarray  # int64 [cap, 8]
    widx: int = 0
    sctr: int = 0
    kctr: int = 0

    @classmethod
    def zeros(cls, num_slots, ring_cap, stride=32):
        return cls(np.zeros((num_slots, stride), np.uint8), np.zeros((ring_cap, 8), np.int64))

    @property
    def canary_i64(self):
        return self.canary.view(np.int64)

    def copy(self):
        return State(self.canary.copy(), self.ring.copy(), self.widx, self.sctr, self.kctr)


@dataclasses.dataclass
class Src:
    """A real-KV source: ``u8`` are the bytes of the source's rows ([rows, row_bytes]); with
    ``pad`` > 0 the rows live at byte ``pad`` inside wider rows of a base buffer (a strided view)."""

    u8: np.ndarray
    page_size: int
    nbpt: int
    read_bytes: int
    dtype: str = "uint8"
    pad: int = 0

    def base(self):
        rows, rb = self.u8.shape
        if not self.pad:
            return self.u8
        base = np.full((rows, rb + 2 * self.pad), 0xA5, np.uint8)
        base[:, self.pad:self.pad + rb] = self.u8
        return base


def _jax_typed(u8: np.ndarray, dtype: str):
    k = jnp.dtype(dtype).itemsize
    x = jnp.asarray(u8)
    if k == 1:
        return x if dtype == "uint8" else jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))
    return jax.lax.bitcast_convert_type(x.reshape(u8.shape[0], -1, k), jnp.dtype(dtype))


def jax_source(s: Src) -> RealKvSource:
    if not s.pad:
        return RealKvSource(tensor=_jax_typed(s.u8, s.dtype), page_size=s.page_size,
                            num_bytes_per_token=s.nbpt, read_bytes=s.read_bytes)
    base = s.base()
    k = jnp.dtype(s.dtype).itemsize
    rows, rb = s.u8.shape
    view = TensorMeta(shape=(rows, rb // k), dtype=s.dtype, strides=(base.shape[1] // k, 1),
                      device=None, framework="jax")
    return RealKvSource(tensor=_jax_typed(base, s.dtype), page_size=s.page_size,
                        num_bytes_per_token=s.nbpt, read_bytes=s.read_bytes, view=view,
                        offset_bytes=s.pad)


def torch_source(sgl, s: Src):
    import torch

    base = torch.from_numpy(s.base().copy())
    t = base[:, s.pad:s.pad + s.u8.shape[1]] if s.pad else base
    return sgl.verify.RealKvSource(tensor=t, page_size=s.page_size,
                                   num_bytes_per_token=s.nbpt, read_bytes=s.read_bytes)


def jax_context(st: State, *, kind=2, sources=(), mode=0, cpa=1) -> VerifyOrWriteContext:
    with jax.enable_x64(True):
        return VerifyOrWriteContext(
            canary_buf=jnp.asarray(st.canary),
            kernel_kind=consts.CanaryLaunchTag(kind),
            violation_ring=jnp.asarray(st.ring),
            violation_write_index=jnp.asarray([st.widx], jnp.int32),
            slot_run_counter=jnp.asarray([st.sctr], jnp.int64),
            kernel_run_counter=jnp.asarray([st.kctr], jnp.int64),
            real_kv_sources=tuple(jax_source(s) for s in sources),
            real_kv_hash_mode=consts.RealKvHashMode(mode),
            enable_chain_position_assert=jnp.asarray([cpa], jnp.int32),
        )


def torch_context(sgl, st: State, *, kind=2, sources=(), mode=0, cpa=1):
    import torch

    return sgl.verify.VerifyOrWriteContext(
        canary_buf=torch.from_numpy(st.canary.copy()),
        kernel_kind=sgl.verify.CanaryLaunchTag(kind),
        violation_ring=torch.from_numpy(st.ring.copy()),
        violation_write_index=torch.tensor([st.widx], dtype=torch.int32),
        slot_run_counter=torch.tensor([st.sctr], dtype=torch.int64),
        kernel_run_counter=torch.tensor([st.kctr], dtype=torch.int64),
        real_kv_sources=tuple(torch_source(sgl, s) for s in sources),
        real_kv_hash_mode=sgl.consts.RealKvHashMode(mode),
        enable_chain_position_assert=torch.tensor([cpa], dtype=torch.int32),
    )


def state_of(ctx) -> State:
    if isinstance(ctx, VerifyOrWriteContext):
        return State(np.asarray(ctx.canary_buf).copy(), np.asarray(ctx.violation_ring).copy(),
                     int(ctx.violation_write_index[0]), int(ctx.slot_run_counter[0]),
                     int(ctx.kernel_run_counter[0]))
    return State(ctx.canary_buf.numpy().copy(), ctx.violation_ring.numpy().copy(),
                 int(ctx.violation_write_index[0]), int(ctx.slot_run_counter[0]),
                 int(ctx.kernel_run_counter[0]))


def _i64(x):
    return jnp.asarray(np.asarray(x, np.int64), jnp.int64)


def _t64(x):
    import torch

    return torch.tensor(np.asarray(x, np.int64), dtype=torch.int64)


def run_write(sgl, st: State, *, offsets, seeds, num_valid, ids, pos, ocl, assert_on=False,
              etok=None, epos=None, reference=True, jnp_reference=False, ours=True,
              implementation=None, config=None, **ctx_kw):
    """Runs SGLang's write reference and ours (``implementation``, launch ``config``; or our
    pure-jnp reference) on the same case; returns (ours, reference) (either None when not
    run)."""
    from kvcanary_jax.ops.write import canary_write, canary_write_reference

    if config is None:
        config = _impls.config("write", implementation)
    if jnp_reference:
        canary_write = canary_write_reference  # noqa: F811

    if reference:
        import torch

        tctx = torch_context(sgl, st, **ctx_kw)
        sgl.write_ref.launch_canary_write_kernel_torch_reference(
            context=tctx,
            plan=sgl.write.WritePlan(
                write_offsets=_t64(offsets), write_seed_slot_indices=_t64(seeds),
                write_num_valid_reqs=torch.tensor([num_valid], dtype=torch.int32)),
            input_ids=_t64(ids), positions=_t64(pos), out_cache_loc=_t64(ocl),
            enable_write_input_assert=assert_on,
            expected_input_tokens=None if etok is None else _t64(etok),
            expected_input_positions=None if epos is None else _t64(epos),
        )
    if not ours:
        return None, state_of(tctx)
    with jax.enable_x64(True):
        out = canary_write(
            **jax_write_args(st, offsets=offsets, seeds=seeds, num_valid=num_valid, ids=ids,
                             pos=pos, ocl=ocl, assert_on=assert_on, etok=etok, epos=epos,
                             **ctx_kw),
            **({} if jnp_reference else dict(implementation=implementation, config=config)),
        )
    return state_of(out), (state_of(tctx) if reference else None)


def jax_write_args(st: State, *, offsets, seeds, num_valid, ids, pos, ocl, assert_on=False,
                   etok=None, epos=None, **ctx_kw) -> dict:
    """``canary_write``'s keyword arguments for a case (call under ``jax.enable_x64(True)``)."""
    return dict(
        context=jax_context(st, **ctx_kw),
        plan=WritePlan(write_offsets=_i64(offsets), write_seed_slot_indices=_i64(seeds),
                       write_num_valid_reqs=jnp.asarray([num_valid], jnp.int32)),
        input_ids=_i64(ids), positions=_i64(pos), out_cache_loc=_i64(ocl),
        enable_write_input_assert=assert_on,
        expected_input_tokens=None if etok is None else _i64(etok),
        expected_input_positions=None if epos is None else _i64(epos))


def run_verify(sgl, st: State, *, slots, etok, epos, prev, num_valid, enable=1, check_token=True,
               reference=True, jnp_reference=False, ours=True, implementation=None, config=None,
               **ctx_kw):
    """SGLang's torch reference and ours (``implementation`` with launch ``config``, by default
    its heuristics'; or our pure-jnp reference) on the same state; returns (ours, reference)
    (either None when not run)."""
    from kvcanary_jax.ops.verify import canary_verify, canary_verify_reference

    if config is None:
        config = _impls.config("verify", implementation)
    if jnp_reference:
        canary_verify = canary_verify_reference  # noqa: F811

    if reference:
        import torch

        tctx = torch_context(sgl, st, **ctx_kw)
        sgl.verify_ref.launch_canary_verify_kernel_torch_reference(
            context=tctx,
            plan=sgl.verify.VerifyPlan(
                verify_slot_indices=_t64(slots), verify_expected_tokens=_t64(etok),
                verify_expected_positions=_t64(epos), verify_prev_slot_indices=_t64(prev),
                verify_num_valid=torch.tensor([num_valid], dtype=torch.int32),
                enable=torch.tensor([enable], dtype=torch.int32)),
            check_verify_expected_token=check_token,
        )
    if not ours:
        return None, state_of(tctx)
    with jax.enable_x64(True):
        out = canary_verify(
            **jax_verify_args(st, slots=slots, etok=etok, epos=epos, prev=prev,
                              num_valid=num_valid, enable=enable, check_token=check_token,
                              **ctx_kw),
            **({} if jnp_reference else dict(implementation=implementation, config=config)),
        )
    return state_of(out), (state_of(tctx) if reference else None)


def jax_verify_args(st: State, *, slots, etok, epos, prev, num_valid, enable=1, check_token=True,
                    **ctx_kw) -> dict:
    """``canary_verify``'s keyword arguments for a case (call under ``jax.enable_x64(True)``)."""
    return dict(
        context=jax_context(st, **ctx_kw),
        plan=VerifyPlan(
            verify_slot_indices=_i64(slots), verify_expected_tokens=_i64(etok),
            verify_expected_positions=_i64(epos), verify_prev_slot_indices=_i64(prev),
            verify_num_valid=jnp.asarray([num_valid], jnp.int32),
            enable=jnp.asarray([enable], jnp.int32)),
        check_verify_expected_token=check_token)


def triton_config(op: str, st: State, config=None, **kw):
    """The ``pallas_triton`` launch config that ``op`` (``"write"`` or ``"verify"``) runs for a
    case (``kw``: :func:`run_write` / :func:`run_verify`'s case arguments) given ``config``:
    ``config`` itself, else the tuned table's entry of this machine's device kind, else the
    heuristics, resolved by the op's own code."""
    api = importlib.import_module(f"kvcanary_jax.ops.{op}.api")
    base = importlib.import_module(f"kvcanary_jax.ops.{op}.base")
    with jax.enable_x64(True):
        if op == "write":
            args = jax_write_args(st, **kw)
            tokens = base.WriteTokens(
                input_ids=args["input_ids"], positions=args["positions"],
                out_cache_loc=args["out_cache_loc"],
                expected_input_tokens=args["expected_input_tokens"],
                expected_input_positions=args["expected_input_positions"])
            shapes = base.shapes(args["context"], args["plan"], tokens)
        else:
            args = jax_verify_args(st, **kw)
            shapes = base.shapes(args["context"], args["plan"])
    return api.OP.config("pallas_triton", shapes, config)


def new_rows(before: State, after: State) -> list[tuple]:
    lo, hi = min(before.widx, len(after.ring)), min(after.widx, len(after.ring))
    return [tuple(int(v) for v in r) for r in after.ring[lo:hi]]


def rows_dropped(before: State, ref: State) -> bool:
    """Whether the launch recorded more rows than the ring had room for."""
    return ref.widx > len(ref.ring) and ref.widx > before.widx


def widened(st: State, extra: int) -> State:
    """A copy of ``st`` whose ring has ``extra`` more (zero) rows: run the reference on it to get
    every row a launch records, none dropped."""
    w = st.copy()
    w.ring = np.concatenate([st.ring, np.zeros((extra, st.ring.shape[1]), st.ring.dtype)])
    return w


def assert_same(ours: State, ref: State, before: State):
    """Equal canary, counters, write index and ring, rows in the same order: the comparison of
    an implementation that keeps request and entry order. (``before`` names the launch's rows in
    the message.) A GPU's results, whose programs race, go through :mod:`_races` and
    :mod:`_write_races` instead."""
    np.testing.assert_array_equal(ours.canary, ref.canary)
    assert (ours.widx, ours.sctr, ours.kctr) == (ref.widx, ref.sctr, ref.kctr)
    if not np.array_equal(ours.ring, ref.ring):
        row = int(np.argwhere((ours.ring != ref.ring).any(axis=1))[0][0])
        raise AssertionError(f"ring row {row} (the launch's rows start at {before.widx}): "
                             f"{ours.ring[row].tolist()} != {ref.ring[row].tolist()}")


def check_verify(sgl, st: State, *, implementation, config=None, **kw):
    """:func:`run_verify` with SGLang's reference and ours, compared: exactly where the
    implementation keeps entry order; on the GPU (``pallas_triton``), whose blocks claim ring rows
    concurrently, as an outcome of the claims in some order
    (:func:`_races.assert_verify_outcome`), which SGLang's result must be too."""
    ours, ref = run_verify(sgl, st, implementation=implementation, config=config, **kw)
    if _impls.in_reference_order(implementation):
        assert_same(ours, ref, st)
    else:
        import _races  # it builds on this module

        claims = _races.assert_verify_outcome(ours, st, config=config, **kw)
        _races.assert_verify_outcome(ref, st, claims=claims, **kw)
    return ours, ref


# ---------------------------------------------------------------------------------------------
# Random write-then-verify round trips in fixed shape buckets, so that thousands of cases reuse a
# few interpret-mode compilations (every static choice is a function of the bucket).

NUM_SLOTS = 64
NUM_TOKENS = 24
REQ_CAP = 4
VERIFY_CAP = 64
RING_CAP = 16

# (canary stride, write input assert, verify token check, sources as
#  (page_size, num_bytes_per_token, read_bytes, trailing row bytes, dtype, strided-view pad))
BUCKETS = (
    (32, True, True, ((1, 32, 32, 0, "uint8", 0),)),
    (48, False, False, ((2, 16, 16, 16, "bfloat16", 16), (1, 48, 32, 0, "float32", 0))),
    (32, False, True, ((4, 16, 16, 0, "int64", 0), (1, 32, 16, 16, "uint8", 16),
                       (2, 32, 32, 0, "bfloat16", 0), (1, 16, 16, 0, "float32", 0))),
)


@dataclasses.dataclass
class Trip:
    sources: list
    mode: int
    stride: int
    check_token: bool
    chains: list  # per request: the (slot, token, position) written, in chain order
    launches: list  # run_write keyword arguments, one dict per launch


def bucket_sources(rng, layout, num_slots=NUM_SLOTS):
    out = []
    for page, nbpt, read, extra, dtype, pad in layout:
        rows = -(-num_slots // page)
        u8 = rng.integers(0, 256, (rows, page * nbpt + extra), dtype=np.uint8)
        out.append(Src(u8, page, nbpt, read, dtype, pad))
    return out


def make_trip(rng, mode, bucket, contiguous=False):
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
            offsets=offsets, seeds=seeds, num_valid=nreq if rng.random() < 0.8 else REQ_CAP,
            ids=ids, pos=pos, ocl=ocl, assert_on=assert_on,
            etok=ids.copy() if assert_on else None, epos=pos.copy() if assert_on else None))
    return Trip(sources, mode, stride, check_token, chains, launches)


def verify_entries(rng, chains):
    slots, etok, epos, prev = [], [], [], []
    for chain in chains:
        for j, (s, t, p) in enumerate(chain):
            slots.append(s)
            etok.append(t if rng.random() < 0.9 else -1)
            epos.append(p)
            prev.append(chain[j - 1][0] if j else -1)
        if rng.random() < 0.3:  # a padding entry
            slots.append(0), etok.append(-1), epos.append(0), prev.append(0)
    return slots, etok, epos, prev


def verify_plan(slots, etok, epos, prev, cap=VERIFY_CAP):
    n = len(slots)
    pad = cap - n
    arr = lambda v, fill: np.array(list(v) + [fill] * pad, np.int64)  # noqa: E731
    return dict(slots=arr(slots, 0), etok=arr(etok, -1), epos=arr(epos, 0), prev=arr(prev, 0),
                num_valid=n)


def garbage_state(rng, stride):
    """Zero canary except a few garbage rows on slots no chain uses here (they must survive)."""
    st = State.zeros(NUM_SLOTS, RING_CAP, stride)
    st.canary[0] = rng.integers(0, 256, stride, dtype=np.uint8)
    st.canary[:, 32:] = rng.integers(0, 256, (NUM_SLOTS, stride - 32), dtype=np.uint8)
    return st


def guarded(before: State, full: State, w0: int) -> State:
    """The ring guard (docs/spec.md §14.1) applied to a launch: ``full`` is a reference run of the
    launch from ``before`` with write index 0 on a ring with room for every row; the result is
    what the launch gives from write index ``w0``: ``w0 < 0``: no row written, index unchanged; else row j
    at ``w0 + j`` below the capacity, index ``min(w0 + n, 2**31 - 1)``."""
    out = full.copy()
    cap = len(before.ring)
    out.ring = before.ring.copy()
    n = full.widx
    if w0 < 0:
        out.widx = w0
        return out
    for j in range(n):
        if w0 + j < cap:
            out.ring[w0 + j] = full.ring[j]
    out.widx = min(w0 + n, 2**31 - 1)
    return out


def assert_guarded(ours: State, before: State, full: State, w0: int) -> None:
    """``ours`` (a launch from ``before``, whose write index is ``w0``) equals :func:`guarded`
    (an implementation that keeps request and entry order)."""
    assert full.widx <= len(full.ring)  # a reference run that dropped no row
    assert_same(ours, guarded(before, full, w0), before)


def reference_trip_state(sgl, rng, trip) -> State:
    """The state after a trip's writes, by SGLang's reference alone."""
    st = garbage_state(rng, trip.stride)
    for launch in trip.launches:
        _, st = run_write(sgl, st, **launch, sources=trip.sources, mode=trip.mode, ours=False)
    return st


def run_trip(sgl, rng, trip, implementation=None, jnp_reference=False, reference=True):
    """Both writes of a trip (``implementation``, or our pure-jnp reference), each compared with
    SGLang's reference (``reference``; else each write's result is taken as it is); returns the
    final state."""
    st = garbage_state(rng, trip.stride)
    kw = dict(sources=trip.sources, mode=trip.mode, jnp_reference=jnp_reference,
              implementation=implementation, reference=reference)
    for launch in trip.launches:
        ours, ref = run_write(sgl, st, **launch, **kw)
        if reference:
            assert_same(ours, ref, st)
        st = ref if reference else ours
    return st
