"""Runs SGLang's references and ours on the same write / verify cases, and compares the results.

The cases come from :mod:`kvcanary_jax.testing.cases` (the builders the benchmark shares),
named as the ops' fields. What lives here is the tests' own: :class:`State`, a numpy snapshot of
a context (canary, ring, write index, counters) that a launch starts from and the comparisons
read; running SGLang's reference next to ours on one case; and the comparisons themselves.
torch is imported only where SGLang's side runs, so our side also serves runs without torch.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import numpy as np

from kvcanary_jax.context import VerifyOrWriteContext
from kvcanary_jax.testing import cases

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

    def context_fields(self) -> dict:
        """The snapshot as a context case's fields (each builder copies them)."""
        return dict(canary_buf=self.canary, violation_ring=self.ring,
                    violation_write_index=self.widx, slot_run_counter=self.sctr,
                    kernel_run_counter=self.kctr)


def jax_context(st: State, **options) -> VerifyOrWriteContext:
    """Our context over a copy of ``st`` (``options``: the other context fields)."""
    return cases.jax_context(**st.context_fields(), **options)


def torch_context(sgl, st: State, **options):
    """SGLang's context over a copy of ``st`` (``options``: the other context fields)."""
    return cases.torch_context(cases.TorchApi.sglang(sgl), **st.context_fields(), **options)


def state_of(ctx) -> State:
    if isinstance(ctx, VerifyOrWriteContext):
        return State(np.asarray(ctx.canary_buf).copy(), np.asarray(ctx.violation_ring).copy(),
                     int(ctx.violation_write_index[0]), int(ctx.slot_run_counter[0]),
                     int(ctx.kernel_run_counter[0]))
    return State(ctx.canary_buf.numpy().copy(), ctx.violation_ring.numpy().copy(),
                 int(ctx.violation_write_index[0]), int(ctx.slot_run_counter[0]),
                 int(ctx.kernel_run_counter[0]))


def run_write(sgl, st: State, *, reference=True, jnp_reference=False, ours=True,
              implementation=None, config=None, **case):
    """Runs SGLang's write reference and ours (``implementation``, launch ``config``; or our
    pure-jnp reference) on the same case (``case``: a write case and the context fields it
    sets, :mod:`kvcanary_jax.testing.cases`) from ``st``; returns (ours, reference) (either None
    when not run)."""
    from kvcanary_jax.ops.write import canary_write, canary_write_reference

    if config is None:
        config = _impls.config("write", implementation)
    write, options = cases.split_case(case, cases.WRITE_FIELDS)
    if reference:
        tctx = torch_context(sgl, st, **options)
        sgl.write_ref.launch_canary_write_kernel_torch_reference(
            **cases.torch_write_args(cases.TorchApi.sglang(sgl), context=tctx, **write))
    if not ours:
        return None, state_of(tctx)
    launch = canary_write_reference if jnp_reference else functools.partial(
        canary_write, implementation=implementation, config=config)
    with jax.enable_x64(True):
        out = launch(**cases.jax_write_args(context=jax_context(st, **options), **write))
    return state_of(out), (state_of(tctx) if reference else None)


def run_verify(sgl, st: State, *, reference=True, jnp_reference=False, ours=True,
               implementation=None, config=None, **case):
    """SGLang's torch reference and ours (``implementation`` with launch ``config``, by default
    its heuristics'; or our pure-jnp reference) on the same verify case (``case``: with the
    context fields it sets) from ``st``; returns (ours, reference) (either None when not run)."""
    from kvcanary_jax.ops.verify import canary_verify, canary_verify_reference

    if config is None:
        config = _impls.config("verify", implementation)
    verify, options = cases.split_case(case, cases.VERIFY_FIELDS)
    if reference:
        tctx = torch_context(sgl, st, **options)
        sgl.verify_ref.launch_canary_verify_kernel_torch_reference(
            **cases.torch_verify_args(cases.TorchApi.sglang(sgl), context=tctx, **verify))
    if not ours:
        return None, state_of(tctx)
    launch = canary_verify_reference if jnp_reference else functools.partial(
        canary_verify, implementation=implementation, config=config)
    with jax.enable_x64(True):
        out = launch(**cases.jax_verify_args(context=jax_context(st, **options), **verify))
    return state_of(out), (state_of(tctx) if reference else None)


def triton_config(op: str, st: State, config=None, **case):
    """The ``pallas_triton`` launch config that ``op`` (``"write"`` or ``"verify"``) runs for a
    case (:func:`run_write` / :func:`run_verify`'s ``case``) from ``st`` given ``config``:
    ``config`` itself, else the tuned table's entry of this machine's device kind, else the
    heuristics, resolved by the op's own code."""
    api = importlib.import_module(f"kvcanary_jax.ops.{op}.api")
    base = importlib.import_module(f"kvcanary_jax.ops.{op}.base")
    with jax.enable_x64(True):
        if op == "write":
            write, options = cases.split_case(case, cases.WRITE_FIELDS)
            args = cases.jax_write_args(context=jax_context(st, **options), **write)
            tokens = base.WriteTokens(
                input_ids=args["input_ids"], positions=args["positions"],
                out_cache_loc=args["out_cache_loc"],
                expected_input_tokens=args["expected_input_tokens"],
                expected_input_positions=args["expected_input_positions"])
            shapes = base.shapes(args["context"], args["plan"], tokens)
        else:
            verify, options = cases.split_case(case, cases.VERIFY_FIELDS)
            args = cases.jax_verify_args(context=jax_context(st, **options), **verify)
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


def check_verify(sgl, st: State, *, implementation, config=None, **case):
    """:func:`run_verify` of ``case`` with SGLang's reference and ours, compared: exactly where the
    implementation keeps entry order; on the GPU (``pallas_triton``), whose blocks claim ring rows
    concurrently, as an outcome of the claims in some order
    (:func:`_races.assert_verify_outcome`), which SGLang's result must be too."""
    ours, ref = run_verify(sgl, st, implementation=implementation, config=config, **case)
    if _impls.in_reference_order(implementation):
        assert_same(ours, ref, st)
    else:
        import _races  # it builds on this module

        claims = _races.assert_verify_outcome(ours, st, config=config, **case)
        _races.assert_verify_outcome(ref, st, claims=claims, **case)
    return ours, ref


# ---------------------------------------------------------------------------------------------
# Round trips (kvcanary_jax.testing.cases.make_trip) run from a garbage canary


def garbage_state(rng, stride) -> State:
    """A state of the round trips' shapes whose canary is :func:`cases.garbage_canary`."""
    return State(cases.garbage_canary(rng, stride),
                 np.zeros((cases.RING_CAP, 8), np.int64))


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
        _, st = run_write(sgl, st, **launch, real_kv_sources=trip.real_kv_sources,
                          real_kv_hash_mode=trip.real_kv_hash_mode, ours=False)
    return st


def run_trip(sgl, rng, trip, implementation=None, jnp_reference=False, reference=True):
    """Both writes of a trip (``implementation``, or our pure-jnp reference), each compared with
    SGLang's reference (``reference``; else each write's result is taken as it is); returns the
    final state."""
    st = garbage_state(rng, trip.stride)
    kw = dict(real_kv_sources=trip.real_kv_sources, real_kv_hash_mode=trip.real_kv_hash_mode,
              jnp_reference=jnp_reference, implementation=implementation, reference=reference)
    for launch in trip.launches:
        ours, ref = run_write(sgl, st, **launch, **kw)
        if reference:
            assert_same(ours, ref, st)
        st = ref if reference else ours
    return st
