"""The expected token ids on the host: laid out like ``cache_loc``, or fed as deltas.

**Token ids.** sglang-jax's device batch has no token history. With ``token_checks`` (default),
each step takes ``expected``, an int32 array parallel to ``cache_loc`` holding every request's
token ids (:func:`expected_tokens`, from the requests' ``origin_input_ids + output_ids``). It
feeds SGLang's verify token check and the write's input check (``input_ids`` / ``positions`` of
the batch against the request's history). A server gives each id once instead: with
``token_rows`` (``from_pools(..., incremental_tokens=True)``) the state keeps every request's ids
in an expected-token pool with a row per sglang-jax ``req_to_token`` row, and each step takes a
:class:`TokenDelta` from a :class:`TokenFeed`: only the ids the device lacks (a decode step: one
per request), scattered into the pool on the device. The feed records a delta only once its
step has been dispatched, for the state that step returned: a delta never run records nothing, a
delta sent to another state goes whole, and a delta made for another batch is refused before
anything is donated. Without token checks (``token_checks=False``) the chain hash and positions
still bind every slot to its request. sglang-jax's overlap scheduler builds a decode batch before
the previous step's token reaches the host (the device resolves it): run it with
``token_checks=False``.

Also here: :func:`host_table`, the slot table from sglang-jax's host ``req_to_token`` (a caller
who plans from it instead of ``cache_loc``), and :func:`host_ints`, the host arrays' check.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, NamedTuple

import jax
import numpy as np

from kvcanary_jax.integrations.sglang_jax.layout import (
    SglangJaxCanary,
    require_int,
    require_positive_int,
)

__all__ = [
    "request_token_ids",
    "expected_tokens",
    "host_table",
    "host_ints",
    "dp_segments",
    "per_dp",
    "RequestIds",
    "DeltaBatch",
    "TokenDelta",
    "TokenFeed",
]


def request_token_ids(reqs) -> list[list[int]]:
    """Each sglang-jax ``Req``'s token history, prompt then output (batch order)."""
    out = []
    for i, r in enumerate(reqs):
        try:
            out.append(list(r.origin_input_ids) + list(r.output_ids))
        except (AttributeError, TypeError) as e:
            raise TypeError(f"kv-canary sglang-jax: reqs[{i}] must be an sglang-jax Req (with "
                            f"origin_input_ids and output_ids), got {type(r).__name__}: {e}") from None
    return out


def host_ints(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"kv-canary sglang-jax: {name} must be a 1-D sequence of ints, got "
                         f"shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


def dp_segments(name: str, values: np.ndarray, dp_size: int) -> list[np.ndarray]:
    """``values`` split in ``dp_size`` equal segments, one per DP rank (sglang-jax pads every
    rank's part of a batch array to the same size)."""
    if values.shape[0] % dp_size:
        raise ValueError(f"kv-canary sglang-jax: {name} has {values.shape[0]} entries, not "
                         f"{dp_size} equal segments (one per data-parallel rank)")
    return np.split(values, dp_size)


def per_dp(name: str, lists, dp_size: int) -> list:
    """Per-DP lists (``lists[d]``: rank ``d``'s), checked to be one per rank."""
    lists = list(lists)
    if len(lists) != dp_size or not all(isinstance(x, (list, tuple)) for x in lists):
        raise ValueError(f"kv-canary sglang-jax: with {dp_size} data-parallel ranks, {name} is "
                         f"one list per rank ([info.reqs for info in batch.reqs_info]), got "
                         f"{len(lists)} entries")
    return lists


def expected_tokens(token_ids, seq_lens, cache_loc_len: int, page_size: int, *,
                    dp_size: int = 1) -> np.ndarray:
    """Token ids laid out like ``cache_loc``: request ``r``'s first ``seq_lens[r]`` ids at its
    page-aligned segment, zeros elsewhere (int32 ``[cache_loc_len]``). Rows of ``seq_lens``
    past ``len(token_ids)`` (batch padding) must be 0. With ``dp_size > 1`` (sglang-jax
    0.1.0rc0's data parallelism) ``token_ids[d]`` are DP rank ``d``'s requests and ``seq_lens``
    and ``cache_loc`` split in ``dp_size`` equal segments, rank ``d``'s laid out in its own.

    Raises (our rules, checked before anything is laid out) TypeError / ValueError for a
    ``page_size`` that is not a positive int, a negative ``cache_loc_len`` or ``seq_lens``
    entry, a padding row with a length, a request with fewer ids than its ``seq_len``, and
    segments that do not fit ``cache_loc_len``."""
    require_positive_int("page_size", page_size)
    require_int("cache_loc_len", cache_loc_len)
    require_positive_int("dp_size", dp_size)
    if cache_loc_len < 0:
        raise ValueError(f"kv-canary sglang-jax: cache_loc_len must be >= 0, got {cache_loc_len}")
    seq = host_ints("seq_lens", seq_lens)
    if dp_size > 1:
        seqs = dp_segments("seq_lens", seq, dp_size)
        if cache_loc_len % dp_size:
            raise ValueError(f"kv-canary sglang-jax: cache_loc_len {cache_loc_len} is not "
                             f"{dp_size} equal segments (one per data-parallel rank)")
        ranks = per_dp("token_ids", token_ids, dp_size)
        if not all(isinstance(ids, (list, tuple, np.ndarray)) for rank in ranks for ids in rank):
            raise ValueError("kv-canary sglang-jax: with data parallelism, token_ids[d] is DP "
                             "rank d's list of requests' token id lists")
        return np.concatenate([expected_tokens(ranks[d], seqs[d], cache_loc_len // dp_size,
                                               page_size) for d in range(dp_size)])
    if (seq < 0).any():
        r = int(np.nonzero(seq < 0)[0][0])
        raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] must be >= 0, got {seq[r]}")
    need = sum(-(-n // page_size) * page_size for n in seq.tolist() if n > 0)
    if need > cache_loc_len:
        raise ValueError(f"kv-canary sglang-jax: {need} cache_loc entries for a bucket of {cache_loc_len}")
    out = np.zeros((cache_loc_len,), np.int32)
    at = 0
    for r, n in enumerate(seq.tolist()):
        if n <= 0:
            continue
        if r >= len(token_ids):
            raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] is {n} but token_ids has "
                             f"{len(token_ids)} requests (padding rows must have seq_len 0)")
        ids = np.asarray(token_ids[r][:n], np.int64)
        if ids.shape[0] != n:
            raise ValueError(f"kv-canary sglang-jax: request {r} has {ids.shape[0]} token ids "
                             f"for seq_len {n}")
        out[at : at + n] = ids
        at += -(-n // page_size) * page_size
    return out


def host_table(req_to_token: np.ndarray, req_pool_indices, seq_lens, context_len: int | None = None,
               *, dp_size: int = 1) -> np.ndarray:
    """The slot table from sglang-jax's host ``req_to_token`` (the batch's rows only): int32
    ``[bs + 1, context_len]``, row ``r + 1`` = request ``r``'s first ``seq_len`` slots. With
    ``dp_size > 1`` the batch splits in ``dp_size`` equal segments and each DP rank gets its own
    table of its segment, stacked rank after rank (``[dp_size * (bs / dp_size + 1),
    context_len]``).

    Raises ValueError (our rules) for a ``req_to_token`` that is not 2-D, lists of different
    lengths, a negative ``seq_len``, an active request (``seq_len > 0``) whose row is outside
    ``[0, req_to_token rows)`` (numpy would read row -1 as the last row: a wrong table, checked
    silently) or whose ``seq_len`` exceeds ``context_len`` (its tail would go unchecked)."""
    table = np.asarray(req_to_token)
    if table.ndim != 2:
        raise ValueError(f"kv-canary sglang-jax: req_to_token must be 2-D [rows, context_len], "
                         f"got shape {table.shape}")
    ctx = table.shape[1] if context_len is None else context_len
    require_int("context_len", ctx)
    if not 0 < ctx <= table.shape[1]:
        raise ValueError(f"kv-canary sglang-jax: context_len must be in [1, {table.shape[1]}] "
                         f"(req_to_token's columns), got {ctx}")
    rp = host_ints("req_pool_indices", req_pool_indices)
    seq = host_ints("seq_lens", seq_lens)
    if rp.shape != seq.shape:
        raise ValueError(f"kv-canary sglang-jax: req_pool_indices ({rp.shape[0]}) and seq_lens "
                         f"({seq.shape[0]}) must have one entry per request")
    require_positive_int("dp_size", dp_size)
    if dp_size > 1:
        rps, seqs = (dp_segments(name, x, dp_size)
                     for name, x in (("req_pool_indices", rp), ("seq_lens", seq)))
        return np.concatenate([host_table(table, a, b, ctx) for a, b in zip(rps, seqs)])
    for r in range(seq.shape[0]):
        if seq[r] < 0 or seq[r] > ctx:
            raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] must be in [0, {ctx}] "
                             f"(context_len), got {seq[r]}")
        if seq[r] > 0 and not 0 <= rp[r] < table.shape[0]:
            raise ValueError(f"kv-canary sglang-jax: req_pool_indices[{r}] must be a row of "
                             f"req_to_token, in [0, {table.shape[0]}), got {rp[r]}")
    out = np.zeros((rp.shape[0] + 1, ctx), np.int32)
    for r in np.nonzero(seq > 0)[0].tolist():
        n = int(seq[r])
        out[r + 1, :n] = table[rp[r], :n]
    return out


class RequestIds(NamedTuple):
    """One request of a :class:`TokenDelta`: batch row ``index``, sglang-jax row ``row``, its
    ``Req``, its ``seq_len`` and the tokens this step writes (``new``). Once the step has run,
    the row holds the request's first ``seq_len`` ids: a :class:`TokenFeed` records it as is.
    The ``Req`` itself is kept (one per row, released when another request takes the row or the
    feed is reset) and compared with ``is``: a request is never taken for another, not even one
    with the same ``rid`` that CPython placed at a finished request's address (its ``id()``).
    ``dp_rank``: the data-parallel rank whose canary holds the row's ids."""

    index: int
    row: int
    req: Any
    seq_len: int
    new: int
    dp_rank: int = 0

    @property
    def key(self) -> tuple[int, int]:
        """Where the ids live: the rank's expected-token pool, the row."""
        return self.dp_rank, self.row


@dataclasses.dataclass(frozen=True, eq=False)
class DeltaBatch:
    """The batch a :class:`TokenDelta` was made for, as sglang-jax padded it: ``bs`` rows, the
    token bucket (``tokens``, ``input_ids``'s length), the ``cache_loc`` bucket, the forward
    mode, the rows and lengths (numpy, padding rows included), sglang-jax's batch id
    (``bid``, which ``ForwardBatch.init_new`` copies from the ``ModelWorkerBatch``; None when
    the batch has none) and the data-parallel ranks it splits over (``dp_size``)."""

    bs: int
    tokens: int
    cache_loc: int
    decode: bool
    req_pool_indices: np.ndarray
    seq_lens: np.ndarray
    extend_seq_lens: np.ndarray | None
    bid: int | None
    dp_size: int = 1

    def check(self, forward_batch) -> None:
        """Raise ValueError unless ``forward_batch`` is the batch this delta was made for (its
        shapes and mode; its rows and lengths through the batch id when both carry one, else
        read from the batch, a host transfer when they are device arrays)."""
        fb = forward_batch
        shapes = {"rows (bs)": (self.bs, int(fb.seq_lens.shape[0])),
                  "token bucket": (self.tokens, int(fb.input_ids.shape[0])),
                  "cache_loc bucket": (self.cache_loc, int(fb.cache_loc.shape[0])),
                  "decode mode": (self.decode, bool(fb.forward_mode.is_decode()))}
        for what, (made, got) in shapes.items():
            if made != got:
                raise ValueError(_other_batch(f"{what} {made}, this batch's is {got}"))
        bid = getattr(fb, "bid", None)
        if self.bid is not None and isinstance(bid, (int, np.integer)) and bid == self.bid:
            return
        fields = {"req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens}
        if not self.decode:
            fields["extend_seq_lens"] = self.extend_seq_lens
        got = jax.device_get({name: getattr(fb, name) for name in fields})
        for name, made in fields.items():
            have = np.asarray(got[name]).astype(np.int64)
            if not np.array_equal(made, have):
                raise ValueError(_other_batch(f"{name} {made.tolist()}, this batch's are "
                                              f"{have.tolist()}"))


def _other_batch(what: str) -> str:
    return (f"kv-canary sglang-jax: the TokenDelta was made for another batch ({what}); make "
            "each step's delta from the ModelWorkerBatch its ForwardBatch comes from, padded "
            "to the same buckets")


@dataclasses.dataclass(frozen=True, eq=False)
class TokenDelta:
    """One step's expected token ids from a :class:`TokenFeed`: ``array``, int32 ``[bs + n]``,
    is each batch row's first column sent (``bs`` entries, 0 for padding rows), then, request
    after request, its ids from that column to its ``seq_len`` (zeros after). ``n`` is the
    batch's token bucket when the ids fit it, else its ``cache_loc`` bucket (two shapes per
    bucket at most; a decode step sends one id per request). With ``dp_size > 1`` it is one such
    array per DP rank, of its batch segment and buckets (``bs``, ``n`` divided by ``dp_size``),
    rank after rank. ``batch`` is the batch it was made
    for, ``requests`` what it sends for each request (the guarded step checks the one and
    recomputes ``array`` from the other when the state does not hold what it was made on)."""

    array: np.ndarray
    feed: "TokenFeed"
    batch: DeltaBatch
    requests: tuple[RequestIds, ...]


class TokenFeed:
    """The host side of a canary with ``token_rows``: which ids each sglang-jax row holds on the
    device, and each step's :class:`TokenDelta`.

    The device keeps every request's ids in its row of the state's expected-token pool (row =
    ``req_pool_idx + 1``), so a step sends only the ids the device lacks: a decode step one per
    request instead of every request's whole history. A row is the request's while the same
    ``Req`` object holds it (compared with ``is``); a row another request held before, a
    request seen first, and a request back after a retraction in a row someone else used in
    between are sent whole; this step's new tokens are always sent.

    What the device holds is recorded in two phases: :meth:`delta` records nothing the device
    holds, the guarded step records the delta once it has dispatched the step (a delta never
    run, or whose step failed before it ran, changes nothing), for the state that step
    returned. The feed knows that one state (its expected-token pool, by identity; a
    :func:`sweep` keeps it): a delta sent to any other state (a fork, a copy, a fresh
    ``init_state()``) is sent whole, and a delta made before an earlier one ran, or made on
    what a delta never run would have left, is recomputed from what the state holds, before
    the step is dispatched. Deltas can be made ahead, in step order (each is made on what the
    ones before it leave), and sent in any order. :meth:`reset` forgets everything (every row
    sent whole once)."""

    def __init__(self, canary: SglangJaxCanary):
        if not isinstance(canary, SglangJaxCanary) or canary.token_rows is None:
            raise ValueError("kv-canary sglang-jax: a TokenFeed needs a canary built with "
                             "token_rows (SglangJaxCanary.from_pools(..., incremental_tokens=True))")
        self.canary = canary
        # What the state the last guarded step returned holds, per row, and that state's pool
        # (a weak reference: the feed keeps no device memory alive).
        self._held: dict[tuple[int, int], RequestIds] = {}
        self._fed: weakref.ref | None = None
        # What the rows will hold once every delta made so far has run: deltas made ahead are
        # made on it (the steps check them against _held).
        self._ahead: dict[tuple[int, int], RequestIds] = {}

    def reset(self) -> None:
        """Forget what the device holds: the next delta sends each of its requests whole."""
        self._held, self._fed = {}, None
        self._ahead.clear()

    def delta(self, reqs, model_worker_batch) -> TokenDelta:
        """The ids the device lacks for sglang-jax's ``ModelWorkerBatch`` (its
        ``req_pool_indices``, ``seq_lens``, ``forward_mode``, ``extend_seq_lens``, ``input_ids``
        and ``cache_loc``, padded as sglang-jax pads them, and its ``bid``) of ``reqs``
        (``batch.reqs``, batch order: prompt then output ids each; with data parallelism, one
        list per DP rank, ``[info.reqs for info in batch.reqs_info]``, each rank's requests in
        the first rows of its batch segment). Give it to the step of that very batch.

        Raises (our rules, before anything is recorded) TypeError / ValueError for a request
        that is not a ``Req``, lists of different lengths, a padding row with a length, a row
        outside ``[0, token_rows)`` or held by two requests of the batch, a ``seq_len`` past
        ``context_len`` or with fewer ids, and ids that do not fit ``cache_loc``."""
        mwb = model_worker_batch
        rp = host_ints("req_pool_indices", mwb.req_pool_indices)
        seq = host_ints("seq_lens", mwb.seq_lens)
        if rp.shape != seq.shape:
            raise ValueError(f"kv-canary sglang-jax: req_pool_indices ({rp.shape[0]}) and seq_lens "
                             f"({seq.shape[0]}) must have one entry per request")
        decode = bool(mwb.forward_mode.is_decode())
        extend = None
        if decode:
            new = np.minimum(seq, 1)
        else:
            new = extend = host_ints("extend_seq_lens", mwb.extend_seq_lens)
            if new.shape != seq.shape:
                raise ValueError(f"kv-canary sglang-jax: extend_seq_lens ({new.shape[0]}) and "
                                 f"seq_lens ({seq.shape[0]}) must have one entry per request")
        bid = getattr(mwb, "bid", None)
        dp = self.canary.dp_size
        tokens = int(np.asarray(mwb.input_ids).shape[0])
        cache_loc = int(np.asarray(mwb.cache_loc).shape[0])
        if dp > 1:
            for name, n in (("req_pool_indices", seq.shape[0]), ("input_ids", tokens),
                            ("cache_loc", cache_loc)):
                dp_segments(name, np.zeros((n,)), dp)
            ranks = per_dp("reqs", reqs, dp)
        elif reqs and all(isinstance(x, (list, tuple)) for x in reqs):
            ranks = per_dp("reqs", reqs, dp)  # the one rank's list, as 0.1.0rc0's reqs_info
        else:
            ranks = [list(reqs)]
        batch = DeltaBatch(bs=int(seq.shape[0]), tokens=tokens, cache_loc=cache_loc,
                           decode=decode, req_pool_indices=rp, seq_lens=seq,
                           extend_seq_lens=extend,
                           bid=int(bid) if isinstance(bid, (int, np.integer)) else None,
                           dp_size=dp)
        rows, ctx = self.canary.token_rows, self.canary.context_len
        per_rank = batch.bs // dp
        requests, seen = [], {}
        for r, (row, n, k) in enumerate(zip(rp.tolist(), seq.tolist(), new.tolist())):
            if n < 0:
                raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] must be >= 0, got {n}")
            if n == 0:
                continue
            d, j = divmod(r, per_rank)
            if j >= len(ranks[d]):
                where = "reqs" if dp == 1 else f"reqs[{d}] (DP rank {d}'s segment)"
                raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] is {n} but {where} has "
                                 f"{len(ranks[d])} requests (padding rows must have seq_len 0)")
            if not 0 <= row < rows:
                raise ValueError(f"kv-canary sglang-jax: req_pool_indices[{r}] must be a row in "
                                 f"[0, {rows}) (token_rows), got {row}")
            if row in seen:
                raise ValueError(f"kv-canary sglang-jax: requests {seen[row]} and {r} of the batch "
                                 f"are both in row {row}")
            seen[row] = r
            if n > ctx:
                raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] must be in [0, {ctx}] "
                                 f"(context_len), got {n}")
            if not 0 <= k <= n:
                raise ValueError(f"kv-canary sglang-jax: request {r} extends {k} tokens with "
                                 f"seq_len {n}")
            _history(ranks[d][j], r, n)
            requests.append(RequestIds(index=r, row=row, req=ranks[d][j], seq_len=n, new=k,
                                       dp_rank=d))
        delta = TokenDelta(array=_lay_out(batch, requests, self._ahead), feed=self, batch=batch,
                           requests=tuple(requests))
        self._ahead.update((req.key, req) for req in requests)
        return delta

    def prepare(self, delta: TokenDelta, state, forward_batch) -> TokenDelta:
        """The delta as the guarded step sends it to ``state`` for ``forward_batch``: ``delta``
        itself when ``state`` holds what it was made on, else recomputed from what ``state``
        holds (whole, for a state this feed did not feed last). Records nothing.

        Raises ValueError (before anything runs or is donated) for a delta made for another
        batch (:meth:`DeltaBatch.check`) or whose requests no longer hold its ids."""
        delta.batch.check(forward_batch)
        held = self._held_by(state)
        for req in delta.requests:
            start = _start_of(delta, req)
            mine = held.get(req.key)
            if start and (mine is None or mine.req is not req.req or mine.seq_len < start):
                return dataclasses.replace(delta, array=_lay_out(delta.batch, delta.requests, held))
        return delta

    def commit(self, sent: TokenDelta, state, new_state) -> None:
        """Record what ``sent`` (:meth:`prepare`'s) put in ``state``'s pool: ``new_state``, the
        state the guarded step returned, holds it. The guarded step calls this once it has
        dispatched the step."""
        held = self._held_by(state)
        held.update((req.key, req) for req in sent.requests)
        self._held, self._fed = held, weakref.ref(new_state.expected_tokens)

    def _held_by(self, state) -> dict[tuple[int, int], RequestIds]:
        fed = None if self._fed is None else self._fed()
        return self._held if fed is not None and fed is state.expected_tokens else {}


def _history(req, r: int, n: int):
    """``req``'s prompt and output ids, holding at least ``n`` ids (batch row ``r``)."""
    try:
        prompt, output = req.origin_input_ids, req.output_ids
        have = len(prompt) + len(output)
    except (AttributeError, TypeError) as e:
        raise TypeError(f"kv-canary sglang-jax: reqs[{r}] must be an sglang-jax Req (with "
                        f"origin_input_ids and output_ids), got {type(req).__name__}: "
                        f"{e}") from None
    if have < n:
        raise ValueError(f"kv-canary sglang-jax: request {r} has {have} token ids for seq_len {n}")
    return prompt, output


def _start_of(delta: TokenDelta, req: RequestIds) -> int:
    """The first column ``delta`` sends for ``req`` (its rank's array, its row there)."""
    batch = delta.batch
    per_rank = batch.bs // batch.dp_size
    d, j = divmod(req.index, per_rank)
    return int(delta.array.reshape(batch.dp_size, -1)[d, j])


def _lay_out(batch: DeltaBatch, requests, held: dict) -> np.ndarray:
    """A delta's array for ``requests`` sent to rows holding ``held`` (one array per DP rank,
    each of its batch segment, rank after rank)."""
    dp = batch.dp_size
    per_rank = batch.bs // dp
    starts = np.zeros((dp, per_rank), np.int64)
    ids: list[list[int]] = [[] for _ in range(dp)]
    for req in requests:
        mine = held.get(req.key)
        known = mine.seq_len if mine is not None and mine.req is req.req else 0
        n = req.seq_len
        start = min(known, n - req.new)
        d, j = divmod(req.index, per_rank)
        starts[d, j] = start
        # Only the ids sent, sliced from the prompt and the output (no whole-history copy).
        prompt, output = _history(req.req, req.index, n)
        p = len(prompt)
        ids[d].extend(prompt[start:min(n, p)])
        ids[d].extend(output[max(start - p, 0):max(n - p, 0)])
    total = max(len(rank_ids) for rank_ids in ids)
    tokens, cache_loc = batch.tokens // dp, batch.cache_loc // dp
    size = tokens if total <= tokens else cache_loc
    if total > size:
        raise ValueError(f"kv-canary sglang-jax: {total} token ids to send do not fit the "
                         f"cache_loc bucket of {cache_loc}"
                         + ("" if dp == 1 else f" (per data-parallel rank, of {dp})"))
    out = np.zeros((dp, per_rank + size), np.int32)
    out[:, :per_rank] = starts
    for d, rank_ids in enumerate(ids):
        out[d, per_rank : per_rank + len(rank_ids)] = rank_ids
    return out.reshape(-1)
