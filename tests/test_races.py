"""The GPU comparators themselves (:mod:`_races`, :mod:`_write_races`), on the CPU: from correct
results, built here from the jnp reference run request by request (and block by block), the
outcomes some execution of the racing programs gives are each accepted, and outcomes no
execution gives are each rejected.

The write cases draw every race on purpose: a slot two requests write, a seed slot another
request writes twice (a torn read has three rows to mix), seeds two requests read from each
other's stores, a chain that continues from a slot a racing request writes, rows of several
requests claimed block by block, and a ring that overflows. An outcome is composed as an
execution of the kernel leaves it (:meth:`WriteCase.compose`): the requests' stores applied in
some order, each seed reading what that execution lets it read, chosen words ending with a
chosen writer's last store, the blocks' claims in some order under the ring guard. The verify
case is one plan in blocks of 8 entries on two programs, composed from each block's entries run
alone."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from kvcanary_jax import consts
from kvcanary_jax.testing import cases

import _canary_support as support
import _races
import _write_races

MAX = consts.VIOLATION_WRITE_INDEX_MAX
X, Y = 3, 4  # request 0 writes X twice, request 1 seeds on it; the crossed case's other slot


def _write_config(**kw):
    from kvcanary_jax.ops.write.pallas_triton import Config

    return Config(**kw)


def _verify_config(**kw):
    from kvcanary_jax.ops.verify.pallas_triton import Config

    return Config(**kw)


def _row(a) -> tuple:
    return tuple(int(v) for v in a)


@dataclasses.dataclass
class Composed:
    """A composed outcome: the state, each request's seed row read, and each request's claims
    (lists of rows) in its order."""

    state: support.State
    read: dict
    claims: dict


def lay(before: support.State, state: support.State, rows, *, widx=None) -> support.State:
    """``state`` with the launch's ring rows ``rows`` placed from ``before``'s write index under
    the ring guard, the index moved past them (or set to ``widx``)."""
    out = state.copy()
    out.ring = before.ring.copy()
    w0, cap = before.widx, len(before.ring)
    out.widx = w0
    if w0 >= 0:
        for j, row in enumerate(rows):
            if w0 + j < cap:
                out.ring[w0 + j] = row
        out.widx = min(w0 + len(rows), MAX)
    if widx is not None:
        out.widx = widx
    return out


class WriteCase:
    """A write launch from ``before`` (``pallas_triton`` blocks of ``block`` tokens), its
    comparator's verdicts, and outcomes composed from its requests run alone by the jnp
    reference."""

    def __init__(self, before, launch, *, sources=(), mode=0, block=2):
        self.before, self.launch, self.sources, self.mode = before, launch, sources, mode
        self.config = _write_config(block=block)
        self.block = block
        self.offsets = [int(v) for v in launch["write_offsets"]]
        self.requests = len(launch["write_seed_slot_indices"])

    def check(self, state) -> str | None:
        """The comparator's verdict: None (accepted) or why not."""
        found = _write_races.explain_write(state, self.before, self.launch, self.sources,
                                           self.mode, config=self.config)
        return None if isinstance(found, _write_races.Execution) else found

    def seed_slot(self, r):
        seed = int(self.launch["write_seed_slot_indices"][r])
        return seed if 0 <= seed < self.before.canary.shape[0] else None

    def writes(self, r, slot) -> list:
        """The token indices at which request ``r`` stores ``slot``, in order."""
        return [i for i in range(self.offsets[r], self.offsets[r + 1])
                if int(self.launch["out_cache_loc"][i]) == slot]

    def pre(self, slot) -> tuple:
        return _row(self.before.canary_i64[slot, :3])

    @functools.lru_cache(maxsize=None)
    def alone(self, r, seed_row, end=None) -> support.State:
        """Request ``r`` alone from ``before`` (through token ``end``), by the jnp reference."""
        return _write_races.run_alone(self.before, self.launch, self.sources, self.mode, r,
                                      seed_row, end=end)

    def store(self, r, seed_row, token) -> tuple:
        """The fields 0-2 request ``r`` (its seed reading ``seed_row``) stores at ``token``."""
        slot = int(self.launch["out_cache_loc"][token])
        return _row(self.alone(r, seed_row, token + 1).canary_i64[slot, :3])

    def claims(self, r, seed_row) -> list:
        """Request ``r``'s rows, per block of its tokens that records any."""
        a, b = self.offsets[r], self.offsets[r + 1]
        ends = list(range(a + self.block, b, self.block)) + [b]
        counts = [0] + [self.alone(r, seed_row, e).widx for e in ends]
        rows = support.new_rows(support.State.zeros(1, 1), self.alone(r, seed_row))
        return [rows[lo:hi] for lo, hi in zip(counts, counts[1:]) if hi > lo]

    def compose(self, order, *, seeds=None, claims=None, finals=None) -> Composed:
        """The outcome of an execution: the requests' stores applied in ``order``, request
        ``r``'s seed reading ``seeds[r]`` (fields 0-2; by default what its slot holds when its
        turn comes); each word ``(slot, field)`` of ``finals`` ending with the last store there
        of the request it maps to; the claims in ``claims`` order (the ``k``-th occurrence of
        ``r`` is its ``k``-th claim; by default ``order``'s, a request's claims together) under
        the ring guard."""
        seeds, finals = dict(seeds or {}), finals or {}
        st = self.before.copy()
        read = {}
        for r in order:
            slot = self.seed_slot(r)
            row = None if slot is None else seeds.get(r, _row(st.canary_i64[slot, :3]))
            read[r] = row
            cur = st.copy()
            if row is not None:
                cur.canary_i64[slot, :3] = row
            out = _write_races.run_alone(cur, self.launch, self.sources, self.mode, r)
            if row is not None and not self.writes(r, slot):
                out.canary[slot] = st.canary[slot]  # the seed read wrote nothing there
            st.canary, st.sctr = out.canary, out.sctr
        for (slot, f), r in finals.items():
            st.canary_i64[slot, f] = self.store(r, read[r], self.writes(r, slot)[-1])[f]
        per = {r: self.claims(r, read[r]) for r in order}
        if claims is None:
            claims = [r for r in order for _ in per[r]]
        taken = dict.fromkeys(per, 0)
        rows = []
        for r in claims:
            rows += per[r][taken[r]]
            taken[r] += 1
        assert taken == {r: len(c) for r, c in per.items()}, (claims, per)
        st.kctr = self.before.kctr + 1
        return Composed(lay(self.before, st, rows), read, per)


def racing_case(*, ring=32, widx=2, stride=32, sources=(), mode=0) -> WriteCase:
    """Four requests (tokens 0-9), blocks of 2 tokens:

    * request 0 (no seed) writes slot X twice (tokens 0 and 2) and slot 5;
    * request 1 seeds on X, writes 6, 7 and X last, and records rows in two blocks (its first
      chain-position check depends on its seed);
    * request 2 seeds on slot 6, which request 1 writes (its chain continues request 1's);
    * request 3 (no seed) writes slot 5 too, and 10, and records a row."""
    rng = np.random.default_rng(3)
    st = support.State.zeros(16, ring, stride)
    st.canary_i64[:, :3] = rng.integers(-(2**62), 2**62, (16, 3))
    st.canary_i64[:, 1] = 3
    st.canary_i64[6, 1] = 1
    if stride > 32:
        st.canary[:, 32:] = rng.integers(0, 256, (16, stride - 32), dtype=np.uint8)
    st.ring[:] = rng.integers(-9, 9, st.ring.shape)
    st.widx = widx
    st.sctr, st.kctr = 100, 7
    ids = [10, 11, 12, 20, 21, 22, 30, 31, 40, 41]
    pos = [0, 1, 2, 4, 5, 6, 5, 9, 0, 1]
    etok = list(ids)
    etok[4], etok[5], etok[8] = 99, 98, 97
    launch = dict(write_offsets=[0, 3, 6, 8, 10], write_seed_slot_indices=[-1, X, 6, -1],
                  write_num_valid_reqs=4, input_ids=ids, positions=pos,
                  out_cache_loc=[X, 5, X, 6, 7, X, 8, 9, 5, 10], enable_write_input_assert=True,
                  expected_input_tokens=etok, expected_input_positions=pos,
                  enable_chain_position_assert=1, kernel_kind=2)
    return WriteCase(st, launch, sources=sources, mode=mode)


def crossed_case() -> WriteCase:
    """Two requests, each seeding on the slot the other writes (request 0 on Y, request 1 on X)
    and checking its chain's positions from its seed's."""
    st = support.State.zeros(16, 16)
    st.canary_i64[:, :3] = np.random.default_rng(4).integers(-(2**62), 2**62, (16, 3))
    st.canary_i64[:, 1] = 6
    launch = dict(write_offsets=[0, 2, 4], write_seed_slot_indices=[Y, X], write_num_valid_reqs=2,
                  input_ids=[50, 51, 60, 61], positions=[7, 8, 7, 8], out_cache_loc=[X, 11, Y, 12],
                  enable_chain_position_assert=1)
    return WriteCase(st, launch)


def interleavings(counts: dict):
    """Every sequence holding each key ``counts[key]`` times."""
    pool = [k for k, n in counts.items() for _ in range(n)]
    return sorted(set(itertools.permutations(pool)))


def torn_rows(rows) -> list:
    """Every seed row that takes each field from one of ``rows``."""
    return sorted({tuple(c[f][f] for f in range(3)) for c in itertools.product(rows, repeat=3)})


SEQ = (0, 1, 2, 3)


# ---------------------------------------------------------------------------------------------
# write: outcomes


def write_legal(case: WriteCase) -> list:
    """``(name, state)`` of outcomes executions of :func:`racing_case` give."""
    out = [(f"order {o}", case.compose(o).state) for o in itertools.permutations(SEQ)]
    r0_at_x = [case.store(0, None, t) for t in case.writes(0, X)]
    for row in torn_rows([case.pre(X), *r0_at_x]):
        out.append((f"request 1's seed torn {row}", case.compose(SEQ, seeds={1: row}).state))
    base = case.compose(SEQ)
    for claims in interleavings({r: len(c) for r, c in base.claims.items()}):
        out.append((f"claims in order {claims}", case.compose(SEQ, claims=claims).state))
    for owners in itertools.product((0, 3), repeat=3):
        out.append((f"slot 5's fields from requests {owners}",
                    case.compose(SEQ, finals={(5, f): r for f, r in enumerate(owners)}).state))
    # Request 1 read X before request 0's stores: X's fields may end as either's.
    for owners in itertools.product((0, 1), repeat=3):
        out.append((f"X's fields from requests {owners}, request 1 reading first",
                    case.compose((1, 0, 2, 3), finals={(X, f): r for f, r in enumerate(owners)}
                                 ).state))
    # Request 1 read request 0's FIRST store at X: X may still end as request 0's last.
    out.append(("X ends as request 0's after request 1 read its first store",
                case.compose(SEQ, seeds={1: r0_at_x[0]},
                             finals={(X, f): 0 for f in range(3)}).state))
    return out


def write_illegal(case: WriteCase) -> list:
    """``(name, state)`` of outcomes no execution of :func:`racing_case` gives, each made from a
    legal one."""
    base = case.compose(SEQ)
    w0 = case.before.widx
    out = []

    def changed(name, edit):
        st = base.state.copy()
        edit(st)
        out.append((name, st))

    rows = support.new_rows(case.before, base.state)
    c1 = base.claims[1]
    assert len(c1) == 2 and len(c1[0]) == 2 and base.claims[2], base.claims
    # The ring: entry order inside a claim, a request's claims in order, no claim split.
    swapped = [c1[0][1], c1[0][0], *c1[1]] + base.claims[2][0] + base.claims[3][0]
    out.append(("request 1's two rows of one block swapped", lay(case.before, base.state,
                                                                  swapped)))
    out.append(("request 1's second block before its first",
                lay(case.before, base.state, [*c1[1], *c1[0]] + base.claims[2][0]
                    + base.claims[3][0])))
    out.append(("request 2's claim inside request 1's first",
                lay(case.before, base.state, [c1[0][0], *base.claims[2][0], c1[0][1], *c1[1]]
                    + base.claims[3][0])))
    out.append(("a row duplicated over another", lay(case.before, base.state,
                                                     rows[:-1] + rows[:1])))
    out.append(("a row dropped", lay(case.before, base.state, rows[1:],
                                     widx=base.state.widx)))
    out.append(("a row recorded twice", lay(case.before, base.state, rows + rows[-1:])))
    changed("a row's link", lambda st: st.ring.__setitem__((w0, 5), st.ring[w0, 5] + 1))
    changed("a ring row before the launch's", lambda st: st.ring.__setitem__((0, 0), 77))
    changed("a ring row past the launch's", lambda st: st.ring.__setitem__((w0 + len(rows), 0),
                                                                           77))
    # Seeds: a row no store of this execution wrote.
    r1_pre = case.store(1, case.pre(X), 3)
    out.append(("request 2's seed: request 1's store as it would be under another seed",
                case.compose(SEQ, seeds={2: r1_pre}).state))
    out.append(("request 2's seed: a row nobody stores",
                case.compose(SEQ, seeds={2: (30, 4, 12345)}).state))
    out.append(("request 1's seed: a row nobody stores",
                case.compose(SEQ, seeds={1: (12, 2, 777)}).state))
    # Request 1 read request 0's last store at X, then stored X: X cannot end as request 0's.
    for f in range(3):
        out.append((f"X's field {f} ends as request 0's after request 1 read it",
                    case.compose(SEQ, finals={(X, f): 0}).state))
    # Words: only a writer's last store, nothing else changes.
    changed("X's token is request 0's first store (not its last)",
            lambda st: st.canary_i64.__setitem__((X, 0), 10))
    changed("slot 5's link from no writer", lambda st: st.canary_i64.__setitem__(
        (5, 2), st.canary_i64[5, 2] ^ (1 << 33)))
    changed("slot 7's real-KV field", lambda st: st.canary_i64.__setitem__(
        (7, 3), st.canary_i64[7, 3] + 1))
    changed("an untouched slot", lambda st: st.canary.__setitem__((12, 0), st.canary[12, 0] ^ 1))
    changed("an untouched seed slot", lambda st: st.canary_i64.__setitem__(
        (6 + 9, 1), st.canary_i64[15, 1] + 1))
    for name, field, d in (("store counter", "sctr", 1), ("store counter", "sctr", -1),
                           ("kernel counter", "kctr", 1), ("kernel counter", "kctr", -1),
                           ("write index", "widx", 1), ("write index", "widx", -1)):
        changed(f"{name} {d:+d}",
                lambda st, field=field, d=d: setattr(st, field, getattr(st, field) + d))
    return out


def overflow_outcomes() -> tuple[list, list]:
    """:func:`racing_case` on a ring with room for 3 of its rows: legal (the first rows of every
    order of the claims) and illegal windows."""
    case = racing_case(ring=5, widx=2)
    base = case.compose(SEQ)
    legal = [(f"overflow, claims in order {c}", case.compose(SEQ, claims=c).state)
             for c in interleavings({r: len(c) for r, c in base.claims.items()})]
    c = base.claims
    rows = [*c[1][0], *c[1][1], *c[2][0], *c[3][0]]
    illegal = [
        ("overflow: request 1's first row missing",
         lay(case.before, base.state, rows[1:], widx=base.state.widx)),
        ("overflow: request 1's second block before its first",
         lay(case.before, base.state, [*c[1][1], *c[1][0], *c[2][0], *c[3][0]])),
        ("overflow: request 2's claim inside request 1's",
         lay(case.before, base.state, [c[1][0][0], *c[2][0], c[1][0][1], *c[1][1], *c[3][0]])),
        ("overflow: request 1's first claim dropped, its second landed",
         lay(case.before, base.state, [*c[1][1], *c[3][0], *c[2][0], *c[1][0]])),
        ("overflow: request 3's row, then request 1's second row first",
         lay(case.before, base.state, [*c[3][0], c[1][0][1], c[1][0][0], *c[1][1], *c[2][0]])),
    ]
    return legal, illegal


def crossed_outcomes() -> tuple[list, list]:
    """:func:`crossed_case`: seeds read from each other's stores."""
    case = crossed_case()
    x_by_0 = case.store(0, case.pre(Y), 0)  # request 0's store at X, its seed pre-launch
    y_by_1 = case.store(1, case.pre(X), 2)
    pre_x, pre_y = case.pre(X), case.pre(Y)
    legal = [
        ("both read before the other's store", case.compose((0, 1),
                                                            seeds={0: pre_y, 1: pre_x}).state),
        ("request 1 first", case.compose((1, 0)).state),
        ("request 0 first", case.compose((0, 1)).state),
        # Load buffering: each reads the other's token (a token depends on no seed load).
        ("each reads the other's token", case.compose(
            (0, 1), seeds={0: (y_by_1[0], *pre_y[1:]), 1: (x_by_0[0], *pre_x[1:])}).state),
        ("each reads the other's token and position", case.compose(
            (0, 1), seeds={0: (*y_by_1[:2], pre_y[2]), 1: (*x_by_0[:2], pre_x[2])}).state),
        # A link read one way, a token the other: no cycle of link reads.
        ("request 1 reads request 0's row, request 0 request 1's token", case.compose(
            (0, 1), seeds={0: (y_by_1[0], *pre_y[1:])}).state),
    ]
    # Each reads the other's link as the other stores it under a pre-launch seed: neither
    # request's seed was the pre-launch row, so neither link was stored by this execution.
    illegal = [("each reads the other's link (a cycle)", case.compose(
        (0, 1), seeds={0: (*pre_y[:2], y_by_1[2]), 1: (*pre_x[:2], x_by_0[2])}).state)]
    return legal, illegal


# ---------------------------------------------------------------------------------------------
# verify: outcomes


class VerifyCase:
    """A 40-entry plan, many entries violating, on ``pallas_triton`` blocks of 8 entries and 2
    programs (program 0 claims blocks 0, 2, 4 in that order, program 1 blocks 1, 3)."""

    BLOCK = 8

    def __init__(self, ring=64, widx=3, max_programs=2):
        rng = np.random.default_rng(6)
        n, cap = 40, 48
        st = support.State.zeros(64, ring)
        st.canary_i64[:, :4] = rng.integers(-3, 3, (64, 4))
        st.ring[:] = rng.integers(-9, 9, st.ring.shape)
        st.widx, st.sctr, st.kctr = widx, 5, 9
        self.before = st
        entries = dict(verify_slot_indices=rng.integers(1, 64, n),
                       verify_expected_tokens=rng.integers(-3, 3, n),
                       verify_expected_positions=rng.integers(-3, 3, n),
                       verify_prev_slot_indices=rng.integers(-1, 64, n))
        self.kw = dict(cases.padded_verify_plan(entries, capacity=cap),
                       check_verify_expected_token=True)
        self.config = _verify_config(block=self.BLOCK, max_programs=max_programs, group=1, vec=1)
        self.blocks = [self._rows(b) for b in range(-(-n // self.BLOCK))]

    def _rows(self, b) -> list:
        """Block ``b``'s rows: its entries alone, as a plan of their own."""
        lo, hi = b * self.BLOCK, min((b + 1) * self.BLOCK, self.kw["verify_num_valid"])
        part = {k: self.kw[k][lo:hi] for k in cases.VERIFY_ENTRY_FIELDS}
        start = support.State(self.before.canary.copy(), np.zeros((self.BLOCK, 8), np.int64))
        out, _ = support.run_verify(
            None, start, **part, verify_num_valid=hi - lo,
            check_verify_expected_token=self.kw["check_verify_expected_token"], reference=False,
            jnp_reference=True)
        return support.new_rows(start, out)

    def state(self, block_order=None, rows=None, *, widx=None) -> support.State:
        """The outcome whose blocks claim in ``block_order`` (or whose rows are ``rows``; the
        write index past them, or ``widx``)."""
        if rows is None:
            rows = [row for b in block_order for row in self.blocks[b]]
        st = self.before.copy()
        st.sctr = self.before.sctr + self.kw["verify_num_valid"]
        st.kctr = self.before.kctr + 1
        return lay(self.before, st, rows, widx=widx)

    def check(self, state) -> str | None:
        claims = _races.verify_claims(self.before, config=self.config, **self.kw)
        return _races.verify_mismatch(state, self.before, claims)


def _program_orders(programs):
    """Every order of the blocks that keeps each program's blocks in its order."""
    for seq in interleavings({p: len(bs) for p, bs in enumerate(programs)}):
        taken = [0] * len(programs)
        order = []
        for p in seq:
            order.append(programs[p][taken[p]])
            taken[p] += 1
        yield order


def verify_outcomes() -> list:
    """``(name, state, legal)`` of verify outcomes."""
    out = []
    for ring, widx in ((64, 3), (12, 3)):
        case = VerifyCase(ring, widx)
        tag = "overflow, " if ring < 40 else ""
        sizes = [len(b) for b in case.blocks]
        assert min(sizes) >= 2 and len(sizes) == 5, sizes
        for order in _program_orders([[0, 2, 4], [1, 3]]):
            out.append((f"{tag}blocks claimed in order {order}", case.state(order), True, case))
        b = case.blocks
        bad = {
            "two rows of block 0 swapped": [b[0][1], b[0][0], *b[0][2:], *b[1], *b[2], *b[3],
                                            *b[4]],
            "program 0's block 2 before its block 0": [*b[2], *b[1], *b[0], *b[3], *b[4]],
            "block 1 inside block 0": [b[0][0], *b[1], *b[0][1:], *b[2], *b[3], *b[4]],
            "block 0's first row missing": [*b[0][1:], *b[1], *b[2], *b[3], *b[4]],
            "a row duplicated over another": [b[0][0], b[0][0], *b[0][2:], *b[1], *b[2],
                                              *b[3], *b[4]],
            "a row recorded twice": [*b[0], *b[0][:1], *b[1], *b[2], *b[3], *b[4]],
        }
        for name, rows in bad.items():
            out.append((tag + name, case.state(rows=rows), False, case))
        # The first row dropped, the index right.
        out.append((tag + "block 0's first row missing, the index right",
                    case.state(rows=[*b[0][1:], *b[1], *b[2], *b[3], *b[4]],
                               widx=case.before.widx + sum(sizes)), False,
                    case))
        base = case.state([0, 1, 2, 3, 4])
        for name, edit in (
                ("a row's field", lambda st: st.ring.__setitem__((3, 2), st.ring[3, 2] + 1)),
                ("a ring row before the launch's", lambda st: st.ring.__setitem__((0, 0), 77)),
                ("the canary", lambda st: st.canary.__setitem__((5, 0), st.canary[5, 0] ^ 1)),
                ("store counter +1", lambda st: setattr(st, "sctr", st.sctr + 1)),
                ("kernel counter -1", lambda st: setattr(st, "kctr", st.kctr - 1)),
                ("write index +1", lambda st: setattr(st, "widx", st.widx + 1))):
            st = base.copy()
            edit(st)
            out.append((tag + name, st, False, case))
    # One block a program (no grid-stride loop): the blocks claim in any order.
    case = VerifyCase(max_programs=8)
    for order in itertools.islice(itertools.permutations(range(5)), 0, 120, 7):
        out.append((f"one block a program, blocks in order {order}", case.state(order), True,
                    case))
    return out


# ---------------------------------------------------------------------------------------------
# the tests


def test_write_comparator_accepts_every_legal_outcome():
    """Every order of the requests, every torn seed read, every order of the blocks' claims,
    each word of a shared slot from either writer, seeds read from each other's tokens."""
    case = racing_case()
    legal = write_legal(case)
    wrong = [(name, case.check(st)) for name, st in legal if case.check(st) is not None]
    assert not wrong, wrong
    over, _ = overflow_outcomes()
    over_case = racing_case(ring=5, widx=2)
    wrong = [(name, over_case.check(st)) for name, st in over if over_case.check(st) is not None]
    assert not wrong, wrong
    crossed = crossed_case()
    good, _ = crossed_outcomes()
    wrong = [(name, crossed.check(st)) for name, st in good if crossed.check(st) is not None]
    assert not wrong, wrong
    assert len(legal) >= 24 + 27 + 12 + 16


def test_write_comparator_rejects_every_impossible_outcome():
    """Rows out of entry or claim order, a claim split, rows dropped or added, an overflow that
    keeps other than the first rows, a seed read from a row no store of the execution wrote, a
    word ending as a store coherence puts before the reader's, a value from no writer's last
    store, anything changed that no race reaches."""
    case = racing_case()
    bad = write_illegal(case)
    accepted = [name for name, st in bad if case.check(st) is None]
    assert not accepted, accepted
    over_case = racing_case(ring=5, widx=2)
    _, over = overflow_outcomes()
    assert not [name for name, st in over if over_case.check(st) is None]
    crossed = crossed_case()
    _, cyc = crossed_outcomes()
    assert not [name for name, st in cyc if crossed.check(st) is None]


def test_write_comparator_past_the_canary_bytes_and_real_kv():
    """With real-KV sources and a wider canary slot: the sequential outcome passes, a changed
    byte past the 32 canary bytes or a changed real-KV field of a shared slot fails."""
    rng = np.random.default_rng(8)
    sources = cases.bucket_sources(rng, cases.BUCKETS[1].sources, num_slots=16)
    case = racing_case(stride=48, sources=sources, mode=2)
    good = case.compose(SEQ).state
    assert case.check(good) is None
    for slot, byte in ((5, 40), (12, 33), (5, 24)):
        bad = good.copy()
        bad.canary[slot, byte] ^= 0x10
        assert case.check(bad) is not None, (slot, byte)


def test_write_comparator_accepts_the_implementations_results():
    """The sequential implementations' results (``xla``'s, the jnp reference's) are outcomes."""
    for case in (racing_case(), racing_case(ring=5, widx=2), crossed_case()):
        for impl in ("xla", None):
            got, _ = support.run_write(None, case.before, **case.launch,
                                       real_kv_sources=case.sources, real_kv_hash_mode=case.mode,
                                       reference=False, implementation=impl,
                                       jnp_reference=impl is None)
            assert case.check(got) is None, impl


def test_write_model_walks_match_the_reference():
    """The comparator's walk of a request (its own account of the op) is the jnp reference's,
    for many seed rows: rows, and the last store in every slot."""
    case = racing_case()
    model = _write_races.Launch(case.before, case.launch, block=case.block)
    rng = np.random.default_rng(9)
    for r in range(case.requests):
        slot = case.seed_slot(r)
        rows = [None] if slot is None else [case.pre(slot)] + [
            (int(rng.integers(0, 50)), int(rng.integers(-2, 9)), int(rng.integers(-2**62, 2**62)))
            for _ in range(6)]
        for seed_row in rows:
            w = model.walk(r, seed_row)
            ref = case.alone(r, seed_row)
            assert [row for _, row in w.rows] == support.new_rows(support.State.zeros(1, 1), ref)
            assert {s: f for s, f in w.last.items()} == {
                s: _row(ref.canary_i64[s, :3]) for s in w.last}


def test_verify_comparator_accepts_exactly_the_claim_orders():
    """Blocks of one program in its order, programs interleaved, each block's rows whole and in
    entry order, the first rows landing where the ring overflows: accepted. Anything else (rows
    swapped, a program's blocks out of order, a block split, rows dropped or doubled, a changed
    row, canary or counter): rejected."""
    outcomes = verify_outcomes()
    wrong = [(name, legal, case.check(st)) for name, st, legal, case in outcomes
             if (case.check(st) is None) != legal]
    assert not wrong, wrong
    assert sum(not legal for *_, legal, _ in outcomes) >= 20
