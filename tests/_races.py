"""What a launch may give where its requests race, and checks that accept exactly that.

Programs of one launch run in no promised order on a GPU (``pallas_triton``, and SGLang's own
kernels alike). Two requests that target one pool row (scatter), or one KV slot (write), race on
what they share; a request whose seed slot another request writes may read it before or after
that store; rows of several requests land in the violation ring in the order their atomics ran.
The sequential implementations (the references, ``xla``, ``pallas_interpret``,
``pallas_mosaic_tpu``) resolve every race in request order, which is one of the outcomes below.

The checks here are exact everywhere a race cannot reach, and accept, where one can, exactly
the values some order of stores gives:

* scatter (:func:`assert_scatter_outcome`): a cell that two or more requests write holds one of
  its writers' values; every other cell is exact (the request's value, or untouched).
* write (:func:`assert_write_outcome`): each request is run alone, in order, by the jnp
  reference (within a request everything is sequential). A request's seed reads as the
  pre-launch row or as any row another request stores at that slot; an outcome is a choice of
  one seed per request. For some outcome: a slot that two or more requests write holds, field by
  field, one writer's last store there; every other slot, the trailing bytes past the 32 canary
  bytes, the counters and the write index are exact; the ring rows are the outcome's rows as a
  multiset (in order where one request recorded them all), and where the ring overflows, the
  rows that land are drawn from them.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np

import _canary_support as support

# ---------------------------------------------------------------------------------------------
# scatter


def scatter_writes(flat, offsets, rpi, shape, max_cols=None):
    """Per request: ``(row, cols, values)`` it stores (``row`` None when it stores nothing), by
    the op's semantics (``kvcanary_jax.ops.scatter.base``): ``write_len = min(end - start,
    max_cols)`` columns from ``start``, flat indices outside ``flat_in`` and rows outside the
    pool skipped, values wrapped to int32."""
    rows, width = shape
    max_cols = width if max_cols is None else int(max_cols)
    n = len(flat)
    cols = np.arange(width, dtype=np.int64)
    out = []
    for r in range(len(rpi)):
        start, end, row = int(offsets[r]), int(offsets[r + 1]), int(rpi[r])
        src = start + cols
        take = (cols < min(end - start, max_cols)) & (src >= 0) & (src < n)
        if not (0 <= row < rows) or n == 0 or not take.any():
            out.append((None, cols[:0], np.zeros(0, np.int32)))
            continue
        c = cols[take]
        out.append((row, c, np.asarray(flat, np.int64)[start + c].astype(np.int32)))
    return out


def assert_scatter_outcome(got, before, writes):
    """``got`` (the pool after a launch from ``before``) holds, in every cell, one of its
    writers' values, and the cells no request writes are untouched."""
    got, before = np.asarray(got), np.asarray(before)
    assert got.shape == before.shape
    written = np.zeros(before.shape, bool)
    match = np.zeros(before.shape, bool)
    writers = np.zeros(before.shape, np.int64)
    for row, c, v in writes:
        if row is None:
            continue
        written[row, c] = True
        writers[row, c] += 1
        match[row, c] |= got[row, c] == v
    untouched = ~written
    bad = np.argwhere(untouched & (got != before))
    assert not len(bad), f"cells no request writes changed: {bad[:5].tolist()}"
    bad = np.argwhere(written & ~match)
    assert not len(bad), (
        f"cells holding none of their writers' values: "
        f"{[(tuple(x), int(got[tuple(x)]), int(writers[tuple(x)])) for x in bad[:5]]}")


def contested_cells(writes, shape) -> int:
    """How many cells two or more requests write (the races a case draws)."""
    writers = np.zeros(shape, np.int64)
    for row, c, _ in writes:
        if row is not None:
            writers[row, c] += 1
    return int((writers > 1).sum())


def apply_scatter(before, writes, order):
    """The pool after the requests' stores in ``order`` (each request's row at once): one
    outcome a GPU may give."""
    out = np.array(before, copy=True)
    for r in order:
        row, c, v = writes[r]
        if row is not None:
            out[row, c] = v
    return out


# ---------------------------------------------------------------------------------------------
# write


def _token_range(launch, r, num_tokens):
    """Request ``r``'s token indices as the op walks them (its own clamped range)."""
    capacity = len(launch["seeds"])
    active = min(max(int(launch["num_valid"]), 0), capacity)
    if r >= active:
        return range(0)
    start, end = int(launch["offsets"][r]), int(launch["offsets"][r + 1])
    lo = min(max(start, 0), num_tokens)
    return range(lo, max(min(max(end, 0), num_tokens), lo))


def _stores(launch, r, num_slots):
    """``[(token index, slot)]`` that request ``r`` stores, in order."""
    ocl = launch["ocl"]
    return [(i, int(ocl[i])) for i in _token_range(launch, r, len(ocl))
            if 0 <= int(ocl[i]) < num_slots]


def _alone(launch, r, end=None):
    """``launch`` with only request ``r``'s tokens (through token ``end`` when given): the other
    requests' ranges are emptied, so the op walks request ``r`` alone."""
    offsets = np.asarray(launch["offsets"], np.int64)
    start = int(offsets[r])
    stop = int(offsets[r + 1]) if end is None else end
    alone = np.empty_like(offsets)
    alone[:r + 1] = start
    alone[r + 1:] = stop
    out = dict(launch)
    out["offsets"] = alone
    return out


class WriteOutcomes:
    """Each request of a write launch run alone from ``before`` by the jnp reference, for each
    candidate row of its seed slot (cached)."""

    def __init__(self, before: support.State, launch: dict, sources, mode):
        self.before, self.launch, self.sources, self.mode = before, launch, sources, mode
        self.num_slots = before.canary.shape[0]
        self.capacity = len(launch["seeds"])
        self._runs = {}

    def _start(self, r, seed_row):
        st = self.before.copy()
        st.widx = 0
        st = support.widened(st, 4 * len(self.launch["ocl"]) + 8)
        st.ring[:] = 0
        seed = int(self.launch["seeds"][r])
        if seed_row is not None:
            st.canary_i64[seed, :4] = seed_row
        return st

    def run(self, r, seed_row, end=None) -> support.State:
        key = (r, None if seed_row is None else tuple(int(v) for v in seed_row), end)
        if key not in self._runs:
            ours, _ = support.run_write(None, self._start(r, seed_row),
                                        **_alone(self.launch, r, end),
                                        sources=self.sources, mode=self.mode, reference=False,
                                        jnp_reference=True)
            self._runs[key] = ours
        return self._runs[key]

    def seed_slot(self, r):
        s = int(self.launch["seeds"][r])
        return s if 0 <= s < self.num_slots else None

    def rows_stored_at(self, k, seed_row, slot):
        """Every row request ``k`` (seeded with ``seed_row``) stores at ``slot``, in order."""
        at = [i for i, s in _stores(self.launch, k, self.num_slots) if s == slot]
        return [tuple(int(v) for v in self.run(k, seed_row, end=i + 1).canary_i64[slot, :4])
                for i in at]

    def seed_candidates(self):
        """Per request: the rows its seed may read. The pre-launch row, and every row another
        request stores there, under any seed that request may itself have read first: a seed
        read comes before the request's own stores, so no chain of reads and stores leads back
        to the request (each request at most once along a chain)."""
        return {r: self._candidates(r, frozenset()) for r in range(self.capacity)}

    def _candidates(self, r, banned):
        key = ("candidates", r, banned)
        if key not in self._runs:
            self._runs[key] = self._candidates_uncached(r, banned)
        return self._runs[key]

    def _candidates_uncached(self, r, banned):
        slot = self.seed_slot(r)
        if slot is None:
            return [None]
        rows = [tuple(int(v) for v in self.before.canary_i64[slot, :4])]
        if not _token_range(self.launch, r, len(self.launch["ocl"])):
            return rows  # a seed that nothing uses
        for k in range(self.capacity):
            if k == r or k in banned:
                continue
            for c in self._candidates(k, banned | {r}):
                for row in self.rows_stored_at(k, c, slot):
                    if row not in rows:
                        rows.append(row)
        return rows


def _mismatch_write(ours: support.State, before: support.State, outcomes: WriteOutcomes, choice):
    """Why ``ours`` is not the outcome of seed choice ``choice`` (None when it is)."""
    launch, n_slots = outcomes.launch, outcomes.num_slots
    runs = [outcomes.run(r, choice[r]) for r in range(outcomes.capacity)]
    # Canary: per slot, the last store of each writer; fields 0..3 each one writer's.
    last = collections.defaultdict(dict)
    for r in range(outcomes.capacity):
        for _, slot in _stores(launch, r, n_slots):
            last[slot][r] = runs[r].canary_i64[slot, :4]
    got = ours.canary_i64[:, :4]
    ok = np.ones(got.shape, bool)
    for slot, by in last.items():
        ok[slot] = (np.stack(list(by.values())) == got[slot]).any(axis=0)
    untouched = [s for s in range(n_slots) if s not in last]
    if not np.array_equal(got[untouched], before.canary_i64[untouched, :4]):
        return "a slot no request writes changed"
    if not ok.all():
        slot, field = (int(x) for x in np.argwhere(~ok)[0])
        return (f"slot {slot} field {field} = {int(got[slot, field])} is none of its writers' "
                f"({sorted(last[slot])}) last stores")
    if not np.array_equal(ours.canary[:, 32:], before.canary[:, 32:]):
        return "bytes past the 32 canary bytes changed"
    # Counters are the same in every order.
    stores = sum(len(_stores(launch, r, n_slots)) for r in range(outcomes.capacity))
    if (ours.sctr, ours.kctr) != (before.sctr + stores, before.kctr + 1):
        return f"counters {(ours.sctr, ours.kctr)} != {(before.sctr + stores, before.kctr + 1)}"
    # Ring: every request's rows, under the ring guard.
    per_request = [support.new_rows(support.State.zeros(1, 1), run) for run in runs]
    rows = [row for rs in per_request for row in rs]
    w0, cap = before.widx, len(before.ring)
    if w0 < 0:
        want_widx, lo, hi = w0, cap, cap
    else:
        want_widx = min(w0 + len(rows), 2**31 - 1)
        lo, hi = min(w0, cap), min(w0 + len(rows), cap)
    if ours.widx != want_widx:
        return f"write index {ours.widx} != {want_widx}"
    if not (np.array_equal(ours.ring[:lo], before.ring[:lo])
            and np.array_equal(ours.ring[hi:], before.ring[hi:])):
        return "ring rows outside the launch's window changed"
    window = [tuple(int(v) for v in row) for row in ours.ring[lo:hi]]
    if w0 >= 0 and w0 + len(rows) <= cap:
        if collections.Counter(window) != collections.Counter(rows):
            return f"ring rows {window} != the outcome's {rows}"
    else:
        if collections.Counter(window) - collections.Counter(rows):
            return f"ring rows {window} not drawn from the outcome's {rows}"
    owners = [rs for rs in per_request if rs]
    if len(owners) == 1 and window != owners[0][:len(window)]:
        return "one request's rows out of order"
    return None


def assert_write_outcome(ours: support.State, before: support.State, launch: dict, sources, mode):
    """``ours`` (a write launch from ``before``) is an outcome some order of the launch's
    requests gives (module docstring); raises AssertionError naming what differs."""
    outcomes = WriteOutcomes(before, launch, sources, mode)
    cands = outcomes.seed_candidates()
    choices = list(itertools.product(*(cands[r] for r in range(outcomes.capacity))))
    assert len(choices) <= 4096, f"{len(choices)} seed choices"
    first = None
    for choice in choices:
        why = _mismatch_write(ours, before, outcomes, choice)
        if why is None:
            return len(choices)
        first = first or why
    raise AssertionError(f"no order of the requests gives this result ({len(choices)} seed "
                         f"choices tried); first: {first}")


def write_races(before: support.State, launch: dict) -> int:
    """How many races a write launch draws: slots stored by two or more requests, plus seeds
    another request stores."""
    n_slots = before.canary.shape[0]
    cap = len(launch["seeds"])
    writers = collections.defaultdict(set)
    for r in range(cap):
        for _, s in _stores(launch, r, n_slots):
            writers[s].add(r)
    races = sum(len(w) > 1 for w in writers.values())
    for r in range(cap):
        s = int(launch["seeds"][r])
        used = bool(_token_range(launch, r, len(launch["ocl"])))
        races += used and bool(writers.get(s, set()) - {r})
    return races


def apply_write_in_order(before: support.State, launch: dict, sources, mode,
                         order) -> support.State:
    """The state after the requests of ``launch`` run one after another in ``order`` (each
    alone, by the jnp reference), rows appended under the ring guard: one outcome a GPU may
    give."""
    st = before.copy()
    for r in order:
        st, _ = support.run_write(None, st, **_alone(launch, r), sources=sources, mode=mode,
                                  reference=False, jnp_reference=True)
        st.kctr -= 1  # one launch bumps the kernel counter once
    st.kctr += 1
    return st
