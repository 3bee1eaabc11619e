"""The outcomes a write launch may give on the GPU, and a check that accepts exactly those.

Derived from the kernel as written (``kvcanary_jax/ops/write/pallas_triton.py``), under the PTX
memory model (plain loads and stores are weak: each word is coherent, words are not ordered
among themselves without a fence, and no value comes out of thin air):

1. Request ``r`` is one program. Its seed fields are three scalar loads of one word each (token,
   position, link: fields 0-2 of the seed slot; field 3 is never read), issued before its first
   store. Each load returns the pre-launch word or a word that ANOTHER request stores there
   (any of its stores to that slot, not only its last): a program never sees its own later
   store, and the three loads may see different stores (a torn read).
2. Stores: fields 0-2 are scalar stores in token order; field 3, a block's vector scatter,
   depends on the slot only (every writer of a slot stores the same value). The stored token
   and position (fields 0, 1) depend on nothing the program loaded from the seed; the stored
   link (field 2) is the hash chain, which depends on all three seed fields. Which tokens record
   rows, and the links they record, depend on the seed too (its position starts the
   chain-position check).
3. No value out of thin air: reads-from plus dependencies form no cycle. Here: request ``r``'s
   link read from request ``k``'s store makes ``k``'s seed come first, and such reads form no
   cycle. Token and position reads impose no order (load buffering: those stores depend on no
   seed load).
4. Each word ends with its coherence-last store: a slot's fields 0-3, each independently, hold
   one writer's LAST store there (a writer's stores to one word are ordered). Coherence also
   orders a read before the reader's own later store to that word: when ``r`` read field ``f``
   of slot ``x`` from ``k``'s last store there and ``r`` itself stores ``x``, that field does
   not end as ``k``'s.
5. Ring rows: each block of ``Config.block`` tokens of a request claims its rows at once, in
   entry order (an input-assert row before the same token's chain-position row); a request's
   claims follow its token order; the requests' claims interleave in any order; under the ring
   guard the first rows below the capacity land (:func:`_races.ring_mismatch`).
6. The store counter gains each request's stored tokens (atomic adds), the kernel counter 1.

An execution picks, for each request whose seed slot it reads and stores anything, the store
each of its three seed fields reads (the pre-launch word, or another request's store there),
with no cycle of link reads (3); then each written word's final writer (4) and an order of the
ring claims (5). :func:`assert_write_outcome` accepts a result exactly when some execution gives
it; everything a race cannot reach (untouched slots, bytes past the 32 canary bytes, counters)
is exact.

How it searches: a request's effect given its seed row is computed by :class:`Launch`'s
``walk`` (a few lines following the op's semantics, ``kvcanary_jax.ops.write.base``). The
search assigns seeds request by request; a request whose link reads another's store assigns
that one first (a request waiting on it cannot be read from: no cycle). Each assignment is
pruned at once by what its walk must show (a slot only it writes holds its last store; with
every row landed, each of its claims appears in the ring), and each slot once all its writers
are assigned; seed rows whose walks the rest of the search would read alike are tried once. The
execution found is then run again by the jnp reference, request by request: the walks must agree
with it (a check of this model, not of the result).
"""

from __future__ import annotations

import collections
import dataclasses
import numpy as np

from kvcanary_jax import consts, hashing
from kvcanary_jax.testing import cases

import _canary_support as support
import _races

# The fields a seed read loads and a token stores one word at a time, in this order (a walk's
# store keeps them at these indices).
SEED_FIELDS = (consts.CANARY_FIELD_TOKEN, consts.CANARY_FIELD_POSITION,
               consts.CANARY_FIELD_PREV_HASH)
assert SEED_FIELDS == (0, 1, 2)
REAL_KV = consts.CANARY_FIELD_REAL_KV_HASH
# Seed rows tried before the check gives up with an error (never a pass; a few seconds): the
# suite's launches need at most a few hundred; only launches whose requests all seed on, and
# write many times, the one slot, with no row landing in the ring, come near it.
MAX_STEPS = 200_000
_F = consts.FailReason


@dataclasses.dataclass(frozen=True)
class Store:
    token: int  # index into the token arrays
    slot: int
    fields: tuple  # (token, position, link): SEED_FIELDS


@dataclasses.dataclass(frozen=True)
class Walk:
    """One request's effect given its seed row: its stores in order, and its violation rows,
    each with the block (of the kernel's ``Config.block`` tokens) that claims it."""

    stores: tuple
    rows: tuple  # ((block, row), ...) in entry order

    @property
    def last(self) -> dict:
        """Per slot, the fields of the request's last store there."""
        return {s.slot: s.fields for s in self.stores}

    @property
    def claims(self) -> list:
        by_block = collections.defaultdict(list)
        for block, row in self.rows:
            by_block[block].append(row)
        return [by_block[b] for b in sorted(by_block)]


class Launch:
    """A write launch (``_canary_support.run_write``'s case arguments) from ``before`` as plain
    ints, and its requests' walks."""

    def __init__(self, before: support.State, launch: dict, block: int):
        as_ints = lambda a: [int(v) for v in np.asarray(a, np.int64).reshape(-1)]  # noqa: E731
        self.before, self.launch, self.block = before, launch, block
        self.num_slots = before.canary.shape[0]
        self.offsets = as_ints(launch["write_offsets"])
        self.seeds = as_ints(launch["write_seed_slot_indices"])
        self.ids, self.pos, self.ocl = (as_ints(launch[k]) for k in
                                        ("input_ids", "positions", "out_cache_loc"))
        self.check_input = bool(launch.get("enable_write_input_assert", False))
        self.etok = (self.ids if launch.get("expected_input_tokens") is None
                     else as_ints(launch["expected_input_tokens"]))
        self.epos = (self.pos if launch.get("expected_input_positions") is None
                     else as_ints(launch["expected_input_positions"]))
        self.kind = int(launch.get("kernel_kind", cases.ContextCase.kernel_kind))
        self.cpa = int(launch.get("enable_chain_position_assert",
                                  cases.ContextCase.enable_chain_position_assert))
        self.capacity = len(self.seeds)
        self.active = min(max(int(launch["write_num_valid_reqs"]), 0), self.capacity)
        self._walks: dict = {}

    def tokens(self, r) -> range:
        """Request ``r``'s token indices as the op walks them (its own range, clamped)."""
        if r >= self.active:
            return range(0)
        n = len(self.ocl)
        lo = min(max(self.offsets[r], 0), n)
        return range(lo, max(min(max(self.offsets[r + 1], 0), n), lo))

    def seed_slot(self, r) -> int | None:
        """The slot request ``r``'s seed reads (None: a seed below 0 reads nothing, one past the
        buffer reads zeros)."""
        seed = self.seeds[r]
        return seed if 0 <= seed < self.num_slots else None

    def pre_row(self, slot) -> tuple:
        return tuple(int(v) for v in self.before.canary_i64[slot, :3])

    def walk(self, r, seed_row=None) -> Walk:
        """Request ``r`` alone, its seed reading ``seed_row`` (token, position, link)."""
        key = (r, seed_row)
        if key not in self._walks:
            self._walks[key] = self._walk(r, seed_row)
        return self._walks[key]

    def _walk(self, r, seed_row) -> Walk:
        seed = self.seeds[r]
        if seed < 0:
            h, check, last = hashing.ANCHOR_HASH_I64, False, 0
        else:
            tok, p0, link = seed_row if self.seed_slot(r) is not None else (0, 0, 0)
            h, check = hashing.mix3_int(link, tok, p0), self.cpa != 0
            last = p0 if check else 0
        stores, rows = [], []
        for i in self.tokens(r):
            slot, t, p = self.ocl[i], self.ids[i], self.pos[i]
            if not 0 <= slot < self.num_slots:
                continue
            block = (i - self.offsets[r]) // self.block
            if self.check_input:
                et, ep = self.etok[i], self.epos[i]
                bits = ((int(_F.WRITE_TOKEN_MISMATCH) if t != et else 0)
                        | (int(_F.WRITE_POSITION_MISMATCH) if p != ep else 0))
                if bits:
                    rows.append((block, (self.kind, slot, p, t, et, h, ep, bits)))
            want = hashing.to_i64(last + 1)
            if check and p != want:
                rows.append((block, (self.kind, slot, p, t, t, h, want,
                                     int(_F.WRITE_POSITION_MISMATCH))))
            stores.append(Store(i, slot, (t, p, h)))
            h, last = hashing.mix3_int(h, t, p), p
        return Walk(tuple(stores), tuple(rows))


@dataclasses.dataclass(frozen=True)
class Execution:
    """What an accepted result was explained by: each request's seed row (None where it reads
    none) and walk."""

    seed_rows: dict
    walks: dict


class _Search:
    """The search of the module docstring over one result ``ours``."""

    def __init__(self, ours: support.State, launch: Launch):
        self.ours, self.launch, self.before = ours, launch, launch.before
        self.got = ours.canary_i64
        base = {r: launch.walk(r, self._pre(r)) for r in range(launch.capacity)}
        # Which stores a request makes does not depend on its seed, only their links do.
        stored_at = collections.defaultdict(dict)  # slot -> request -> store indices
        for r, w in base.items():
            for n, s in enumerate(w.stores):
                stored_at[s.slot].setdefault(r, []).append(n)
        self.stored_at = dict(stored_at)
        self.readers = [r for r in range(launch.capacity)
                        if launch.seed_slot(r) is not None and base[r].stores]
        self.fixed = {r: base[r] for r in base if r not in self.readers}
        self.base = base
        w0, cap = self.before.widx, len(self.before.ring)
        # With every row landed (as a legal result whose index is at most the capacity has),
        # each claim of each request appears whole in the window.
        self.window = (_races.as_rows(ours.ring[w0:ours.widx])
                       if 0 <= w0 <= ours.widx <= cap else None)
        self.steps = 0

    def _pre(self, r):
        slot = self.launch.seed_slot(r)
        return None if slot is None else self.launch.pre_row(slot)

    # -- what does not depend on the seeds

    def fixed_mismatch(self, real_kv: dict) -> str | None:
        ours, before = self.ours, self.before
        if not np.array_equal(ours.canary[:, 32:], before.canary[:, 32:]):
            return "bytes past the 32 canary bytes changed"
        untouched = [s for s in range(self.launch.num_slots) if s not in self.stored_at]
        if not np.array_equal(self.got[untouched], before.canary_i64[untouched]):
            return "a slot no request writes changed"
        for slot, want in real_kv.items():
            if int(self.got[slot, REAL_KV]) != want:
                return f"slot {slot} real-KV field {int(self.got[slot, REAL_KV])} != {want}"
        stores = sum(len(w.stores) for w in self.base.values())
        want = (before.sctr + stores, before.kctr + 1)
        if (ours.sctr, ours.kctr) != want:
            return f"counters {(ours.sctr, ours.kctr)} != {want}"
        return None

    # -- the search

    def run(self) -> Execution | None:
        """An execution that gives ``ours``, or None."""
        walks = dict(self.fixed)
        for r, w in self.fixed.items():
            if not self._walk_ok(r, w):
                return None
        for slot, writers in self.stored_at.items():
            if all(k in walks for k in writers) and self._slot_mismatch(slot, walks, ()):
                return None

        def step(i, walks, seed_rows, excluded):
            """The first execution that assigns readers ``i``, ... (each unless assigned
            already) on top of ``walks``, or None."""
            if i == len(self.readers):
                if _races.ring_mismatch(self.ours, self.before,
                                        [walks[r].claims for r in sorted(walks)]) is None:
                    return Execution(seed_rows=seed_rows, walks=walks)
                return None
            r = self.readers[i]
            if r in walks:
                return step(i + 1, walks, seed_rows, excluded)
            return self._assign(r, walks, seed_rows, excluded, frozenset(),
                                lambda w, s, e: step(i + 1, w, s, e))

        return step(0, walks, {}, ())

    def _sources(self, r):
        """``(k, n)``: the stores of other requests at ``r``'s seed slot (``k``'s ``n``-th)."""
        slot = self.launch.seed_slot(r)
        return [(k, n) for k, ns in self.stored_at.get(slot, {}).items() if k != r for n in ns]

    def _excludes(self, r, k, n):
        """Whether ``r``'s read of ``k``'s store ``n`` keeps ``k`` from ending as that word's
        writer (``k``'s last store there, and ``r`` stores that slot later: coherence)."""
        writers = self.stored_at[self.launch.seed_slot(r)]
        return r in writers and n == writers[k][-1]

    def _assign(self, r, walks, seed_rows, excluded, waiting, then):
        """Each seed row of reader ``r`` given ``walks`` (assigning first, recursively, a
        reader whose link ``r`` reads; ``waiting``: the readers whose assignment waits on this
        one), followed by ``then(walks, seed_rows, excluded)``: its first result that is not
        None."""
        tried = set()  # the signatures tried on top of ``walks``
        for src in [None] + self._sources(r):
            if src is not None:
                k, _ = src
                if k in waiting:
                    continue  # a cycle of link reads
                if k not in walks:
                    found = self._assign(
                        k, walks, seed_rows, excluded, waiting | {r},
                        lambda w, s, e, src=src: self._finish(r, src, w, s, e, then, set()))
                    if found is not None:
                        return found
                    continue
            found = self._finish(r, src, walks, seed_rows, excluded, then, tried)
            if found is not None:
                return found
        return None

    def _finish(self, r, link_src, walks, seed_rows, excluded, then, tried):
        """``r``'s link read from ``link_src`` (None: the pre-launch word), its token and
        position read from any source, each followed by ``then``: its first result that is not
        None. A seed row whose walk has a signature in ``tried`` (:meth:`_signature`) is
        skipped: the rest of the search would go as for the one tried."""
        slot = self.launch.seed_slot(r)
        pre = self.launch.pre_row(slot)
        if link_src is None:
            link, link_ex = pre[2], ()
        else:
            k, n = link_src
            link = walks[k].stores[n].fields[2]
            link_ex = ((slot, 2, k),) if self._excludes(r, k, n) else ()
        options = []
        for f in (0, 1):
            opts = {(pre[f], ())}
            for k, n in self._sources(r):
                v = self.base[k].stores[n].fields[f]
                opts.add((v, ((slot, f, k),) if self._excludes(r, k, n) else ()))
            options.append(sorted(opts))
        for tok, tok_ex in options[0]:
            for pos, pos_ex in options[1]:
                self.steps += 1
                assert self.steps <= MAX_STEPS, (
                    f"the write check tried {MAX_STEPS} seed rows without deciding (a launch "
                    "with more racing requests than it can search)")
                row = (tok, pos, link)
                w = self.launch.walk(r, row)
                if not self._walk_ok(r, w):
                    continue
                new_walks = {**walks, r: w}
                new_ex = excluded + tok_ex + pos_ex + link_ex
                sig = (tok_ex + pos_ex + link_ex, self._signature(r, w, new_walks))
                if sig in tried:
                    continue
                tried.add(sig)
                # The slots r writes whose writers are now all assigned (r's exclusions are
                # on its seed slot, and matter only where r writes it).
                if any(self._slot_mismatch(s, new_walks, new_ex) for s in w.last
                       if all(k in new_walks for k in self.stored_at[s])):
                    continue
                found = then(new_walks, {**seed_rows, r: row}, new_ex)
                if found is not None:
                    return found
        return None

    def _signature(self, r, w: Walk, walks) -> tuple:
        """What the rest of the search reads of ``r``'s walk ``w`` (``walks``: the requests
        assigned with it): of its last links on slots another request writes too, only whether
        each is the result's (a slot's check asks no more); its rows (only how many, where none
        can land); the links of its stores that a reader not yet assigned may read."""
        links = tuple((slot, f[2] == int(self.got[slot, 2])) for slot, f in w.last.items()
                      if len(self.stored_at[slot]) > 1)
        w0, cap = self.before.widx, len(self.before.ring)
        rows = len(w.rows) if (w0 < 0 or w0 >= cap) else w.rows
        readable = tuple(
            (q, tuple(s.fields[2] for s in w.stores if s.slot == self.launch.seed_slot(q)))
            for q in self.readers if q not in walks)
        return links, rows, readable

    # -- pruning

    def _walk_ok(self, r, w: Walk) -> bool:
        """What ``r``'s walk alone must show: its last store in every slot only it writes, and,
        with every row landed, each of its claims whole in the ring's window."""
        for slot, fields in w.last.items():
            if set(self.stored_at[slot]) == {r} and \
                    tuple(int(v) for v in self.got[slot, :3]) != fields:
                return False
        if self.window is None:
            return True
        if len(w.rows) > len(self.window):
            return False
        return all(_contains(self.window, tuple(c)) for c in w.claims)

    def _slot_mismatch(self, slot, walks, excluded) -> str | None:
        """Why ``slot``'s fields 0-2 are not each the last store of a writer allowed to end
        there (None when they are)."""
        writers = self.stored_at.get(slot, {})
        for f in SEED_FIELDS:
            allowed = {walks[k].last[slot][f] for k in writers if (slot, f, k) not in excluded}
            if int(self.got[slot, f]) not in allowed:
                return (f"slot {slot} field {f} = {int(self.got[slot, f])} is no last store of "
                        f"its writers {sorted(writers)}")
        return None


def _contains(window: tuple, claim: tuple) -> bool:
    n = len(claim)
    return any(window[i:i + n] == claim for i in range(len(window) - n + 1))


def alone(launch: dict, r: int, end: int | None = None) -> dict:
    """``launch`` with only request ``r``'s tokens (through token index ``end``, exclusive,
    when given): the other requests' ranges are emptied."""
    offsets = np.asarray(launch["write_offsets"], np.int64)
    alone = np.empty_like(offsets)
    alone[:r + 1] = offsets[r]
    alone[r + 1:] = offsets[r + 1] if end is None else end
    return dict(launch, write_offsets=alone)


def run_alone(before: support.State, launch: dict, sources, mode, r: int, seed_row=None, *,
              end: int | None = None) -> support.State:
    """Request ``r`` alone (:func:`alone`) by the jnp reference from ``before``, its seed slot
    holding ``seed_row`` (fields 0-2) when given, from write index 0 on a ring with room for
    all its rows (the counters are ``before``'s plus the run's)."""
    st = support.widened(before.copy(), 4 * len(launch["out_cache_loc"]) + 8)
    st.widx, st.ring[:] = 0, 0
    if seed_row is not None:
        st.canary_i64[int(launch["write_seed_slot_indices"][r]), :3] = seed_row
    out, _ = support.run_write(None, st, **alone(launch, r, end), real_kv_sources=sources,
                               real_kv_hash_mode=mode, reference=False, jnp_reference=True)
    return out


def _confirm(execution: Execution, launch: Launch, sources, mode, real_kv) -> None:
    """The walks of an accepted execution are what the jnp reference gives."""
    for r, w in execution.walks.items():
        if not (w.stores or w.rows):
            continue
        ref = run_alone(launch.before, launch.launch, sources, mode, r,
                        execution.seed_rows.get(r))
        want_rows = support.new_rows(support.State.zeros(1, 1), ref)
        got = {s: tuple(int(v) for v in ref.canary_i64[s, :4]) for s in w.last}
        mine = {s: (*f, real_kv[s]) for s, f in w.last.items()}
        assert [row for _, row in w.rows] == want_rows and got == mine, (
            f"the race model's walk of request {r} differs from the jnp reference "
            f"(rows {list(w.rows)} vs {want_rows}; slots {mine} vs {got})")


def explain_write(ours: support.State, before: support.State, launch: dict, sources, mode, *,
                  config=None) -> Execution | str:
    """The execution that gives ``ours`` (a write launch from ``before`` on ``pallas_triton``
    with ``config``; module docstring), or why none does."""
    block = support.triton_config("write", before, config, **launch, real_kv_sources=sources,
                                  real_kv_hash_mode=mode).block
    model = Launch(before, launch, block)
    search = _Search(ours, model)
    seq, _ = support.run_write(None, before, **launch, real_kv_sources=sources,
                               real_kv_hash_mode=mode, reference=False, jnp_reference=True)
    real_kv = {s: int(seq.canary_i64[s, REAL_KV]) for s in search.stored_at}
    why = search.fixed_mismatch(real_kv)
    if why is not None:
        return why
    found = search.run()
    if found is None:
        return (f"no execution gives this result ({search.steps} seed choices tried past the "
                f"checks no seed reaches)")
    _confirm(found, model, sources, mode, real_kv)
    return found


def assert_write_outcome(ours: support.State, before: support.State, launch: dict, sources,
                         mode, *, config=None) -> Execution:
    """``ours`` is a result some execution of the write launch gives (module docstring);
    raises AssertionError saying what differs. Returns the execution."""
    found = explain_write(ours, before, launch, sources, mode, config=config)
    assert isinstance(found, Execution), f"not an outcome of the write launch: {found}"
    return found


def write_races(before: support.State, launch: dict) -> int:
    """How many races a write launch draws: slots stored by two or more requests, plus seeds
    another request stores."""
    model = Launch(before, launch, block=1)
    writers = collections.defaultdict(set)
    for r in range(model.capacity):
        for i in model.tokens(r):
            if 0 <= model.ocl[i] < model.num_slots:
                writers[model.ocl[i]].add(r)
    races = sum(len(w) > 1 for w in writers.values())
    for r in range(model.capacity):
        races += bool(model.tokens(r)) and bool(writers.get(model.seeds[r], set()) - {r})
    return races


def apply_write_in_order(before: support.State, launch: dict, sources, mode,
                         order) -> support.State:
    """The state after the requests of ``launch`` run one after another in ``order`` (each
    alone, by the jnp reference), rows appended under the ring guard: one outcome a GPU may
    give."""
    st = before.copy()
    for r in order:
        st, _ = support.run_write(None, st, **alone(launch, r), real_kv_sources=sources,
                                  real_kv_hash_mode=mode, reference=False, jnp_reference=True)
        st.kctr -= 1  # one launch bumps the kernel counter once
    st.kctr += 1
    return st
