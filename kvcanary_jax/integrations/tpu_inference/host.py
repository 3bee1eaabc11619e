"""The canary's host side over tpu-inference's request lifecycle (numpy; no device work).

The runner learns every step's requests from vLLM's ``SchedulerOutput`` in
``persistent_batch_manager.update_states``, which keeps ``runner.requests[req_id]``
(``block_ids``, ``num_computed_tokens``) and the persistent batch ``runner.input_batch``
(``req_ids`` in batch order, ``token_ids_cpu`` with every row's token history,
``num_tokens_no_spec``). Its rows move every step (``swap_states``, ``condense``), so what
the canary keeps is keyed by request id:

* :class:`TokenBook`: a stable expected-token pool row per request, how many of its ids the
  device holds, and each step's :class:`~.device.TokenDelta` (only the ids the device lacks:
  one per request in decode). A row is freed when its request finishes; when every row is taken,
  the row of the request seen least recently outside this step is handed over (its request, if
  it comes back, is sent whole). The book commits what a step sent only after the step ran.
* :class:`CachedBlocks`: the runner-side source of the sweep over vLLM's prefix cache. The
  scheduler's ``BlockPool`` (another process under vLLM's multiprocess executors) is not
  visible here; what is: a block fully written by a request (below its ``num_computed_tokens``)
  holds that prefix until vLLM hands the block out again, which a later step shows as a block a
  request writes into. Each such block is kept with its chain of block ids from the start of the
  sequence; the sweep re-verifies the longest chains.
* :class:`Unwritten`: per block, the first slot a guarded step wrote since the canary started
  (the block size where none): slots below it hold KV written before (an install over a warm
  prefix cache, a restart after a failed step) with no canary, which the steps and the sweep
  leave unchecked until vLLM hands the block out again.

Batch rows per data-parallel rank are ordered as the runner orders them (``input_batch.req_ids``
filtered by ``scheduler_output.assigned_dp_rank``).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

__all__ = ["TokenBook", "CachedBlocks", "Unwritten", "batch_order", "block_owners",
           "applied_head_delta", "head_delta", "late_requests", "next_bucket"]

MIN_IDS = 16


def next_bucket(n: int) -> int:
    """The delta's id bucket: a power of two, at least :data:`MIN_IDS` (a few compilations)."""
    return max(MIN_IDS, 1 << max(int(n) - 1, 0).bit_length())


def batch_order(runner, scheduler_output, dp_size: int) -> list[list[str]]:
    """Request ids per data-parallel rank, in the order the step's device arrays hold them."""
    ranks: list[list[str]] = [[] for _ in range(dp_size)]
    assigned = getattr(scheduler_output, "assigned_dp_rank", None) or {}
    batch = runner.input_batch
    for req_id in batch.req_ids[:batch.num_reqs]:
        ranks[int(assigned.get(req_id, 0)) if dp_size > 1 else 0].append(req_id)
    return ranks


def block_owners(runner, order: list[list[str]]) -> list[dict[int, list[str]]]:
    """Per data-parallel rank, block id -> the requests of the step whose block-table rows (the
    ones the step's attention reads, ``input_batch.block_table[0]``) hold it, in batch order
    (several where a prefix block is shared)."""
    batch = runner.input_batch
    table = batch.block_table[0]
    owners: list[dict[int, list[str]]] = [{} for _ in order]
    for rank, req_ids in enumerate(order):
        for req_id in req_ids:
            idx = batch.req_id_to_index[req_id]
            for b in table.block_table_cpu[idx, :int(table.num_blocks_per_row[idx])]:
                holders = owners[rank].setdefault(int(b), [])
                if req_id not in holders:
                    holders.append(req_id)
    return owners


@dataclasses.dataclass
class PendingDelta:
    """A step's delta, not yet delivered: the arrays and what the book records once it ran."""

    rows: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    ids: np.ndarray
    held: dict


def head_delta(delta: PendingDelta, dp_size: int, tokens: int, context_len: int):
    """What HEAD takes of a step's delta, ``tokens`` ids a rank (the step's own token count
    per data-parallel rank, so that HEAD's compiles stay keyed by the step's token bucket):
    ``(rows, starts, counts, ids, fits)``. A delta of at most ``tokens`` ids a rank (a decode
    step's: one id a request) ``fits``: HEAD writes it with the step's own ids in one pass. A
    bigger one (a prompt, a request sent whole again) is applied first by the delta's own jit,
    keyed by its id bucket; HEAD then takes a delta of no ids, each row starting at what that
    one left it holding (``start + count``, which also keeps a new request's row from being
    reset twice). ``context_len``: the pool's width (a padding id's column)."""
    sent = delta.counts.reshape(dp_size, -1).sum(axis=1)
    if int(sent.max(initial=0)) > tokens:
        return (*applied_head_delta(delta, dp_size, tokens, context_len), False)
    ids = delta.ids.reshape(dp_size, -1, 3)
    out = _padding_ids(dp_size, tokens, context_len)
    k = min(tokens, ids.shape[1])
    out[:, :k] = ids[:, :k]
    return delta.rows, delta.starts, delta.counts, out.reshape(-1, 3), True


def applied_head_delta(delta: PendingDelta, dp_size: int, tokens: int, context_len: int):
    """HEAD's delta after ``delta`` was applied by its own jit: ``(rows, starts, counts,
    ids)``, no ids, each row starting at what ``delta`` left it holding."""
    return (delta.rows, delta.starts + delta.counts, np.zeros_like(delta.counts),
            _padding_ids(dp_size, tokens, context_len).reshape(-1, 3))


def _padding_ids(dp_size: int, n: int, context_len: int) -> np.ndarray:
    """``[dp_size, n, 3]`` padding ids: id 0 of batch row 0 at column ``context_len`` (written
    nowhere)."""
    out = np.zeros((dp_size, n, 3), np.int32)
    out[:, :, 2] = context_len
    return out


class TokenBook:
    """Pool rows and held counts per request (see the module docstring)."""

    def __init__(self, *, pool_rows: int, max_reqs: int, dp_size: int, context_len: int):
        self.pool_rows, self.max_reqs = pool_rows, max_reqs
        self.dp_size, self.context_len = dp_size, context_len
        self._row: dict[str, int] = {}
        self._held: dict[int, tuple[str, int]] = {}  # row -> (req_id, ids on the device)
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()

    def reset(self) -> None:
        """Forget what the device holds: every request is sent whole once (after a failed step
        or a state that did not see the earlier deltas)."""
        self._held.clear()

    def finish(self, req_ids) -> None:
        for req_id in req_ids:
            row = self._row.pop(req_id, None)
            self._recent.pop(req_id, None)
            if row is not None:
                self._held.pop(row, None)

    def _row_for(self, req_id: str, busy: set[str]) -> int:
        row = self._row.get(req_id)
        if row is None:
            taken = set(self._row.values())
            free = [r for r in range(1, self.pool_rows + 1) if r not in taken]
            if free:
                row = free[0]
            else:
                victim = next((r for r in self._recent if r not in busy), None)
                if victim is None:
                    raise RuntimeError(f"kv-canary tpu-inference: {self.pool_rows} pool rows for "
                                       f"more requests in one step")
                row = self._row.pop(victim)
                self._recent.pop(victim)
                self._held.pop(row, None)
            self._row[req_id] = row
        self._recent.pop(req_id, None)
        self._recent[req_id] = None
        return row

    def plan(self, runner, order: list[list[str]]) -> PendingDelta:
        """The delta for the step whose batch is ``order`` (:func:`batch_order`)."""
        batch = runner.input_batch
        busy = {r for rank in order for r in rank}
        m = self.max_reqs
        rows = np.zeros((self.dp_size, m), np.int32)
        starts = np.zeros((self.dp_size, m), np.int32)
        counts = np.zeros((self.dp_size, m), np.int32)
        # Per rank, each id sent with its batch row and its column in the pool row.
        parts: list[list[np.ndarray]] = [[] for _ in range(self.dp_size)]
        held = {}
        for rank, req_ids in enumerate(order):
            for i, req_id in enumerate(req_ids):
                idx = batch.req_id_to_index[req_id]
                known = min(int(batch.num_tokens_no_spec[idx]), self.context_len)
                row = self._row_for(req_id, busy)
                mine = self._held.get(row)
                start = min(mine[1], known) if mine is not None and mine[0] == req_id else 0
                rows[rank, i], starts[rank, i], counts[rank, i] = row, start, known - start
                part = np.empty((known - start, 3), np.int32)
                part[:, 0] = batch.token_ids_cpu[idx, start:known]
                part[:, 1] = i
                part[:, 2] = np.arange(start, known)
                parts[rank].append(part)
                held[row] = (req_id, known)
        n = next_bucket(max(sum(p.shape[0] for p in ps) for ps in parts))
        ids = _padding_ids(self.dp_size, n, self.context_len)
        for rank, ps in enumerate(parts):
            if ps:
                flat = np.concatenate(ps)
                ids[rank, :flat.shape[0]] = flat
        return PendingDelta(rows=rows.reshape(-1), starts=starts.reshape(-1),
                            counts=counts.reshape(-1), ids=ids.reshape(-1, 3), held=held)

    def commit(self, delta: PendingDelta) -> None:
        for row, entry in delta.held.items():
            if self._row.get(entry[0]) == row:
                self._held[row] = entry


def late_requests(runner, order: list[list[str]], scheduler_output, max_reqs: int,
                  block_size: int) -> np.ndarray:
    """Per batch row (per rank, stacked), 1 where the request's computed prefix holds a block
    another request of the step writes into (vLLM caches a block when it hands it out, so a
    second request can hit it in the step that fills it)."""
    late = np.zeros((len(order), max_reqs), np.int32)
    for rank, req_ids in enumerate(order):
        writes: dict[int, str] = {}
        spans = []
        for req_id in req_ids:
            state = runner.requests[req_id]
            blocks = [int(b) for b in state.block_ids[0]]
            done = int(state.num_computed_tokens)
            end = done + int(scheduler_output.num_scheduled_tokens[req_id])
            for b in blocks[done // block_size:-(-end // block_size)]:
                writes.setdefault(b, req_id)
            spans.append(blocks[:-(-done // block_size)])
        for i, (req_id, prefix) in enumerate(zip(req_ids, spans)):
            late[rank, i] = any(writes.get(b, req_id) != req_id for b in prefix)
    return late.reshape(-1)


class CachedBlocks:
    """Fully written blocks and their chains, per data-parallel rank (see the module
    docstring)."""

    def __init__(self, *, dp_size: int, block_size: int):
        self.block_size = block_size
        self._chains: list[dict[int, tuple[int, ...]]] = [{} for _ in range(dp_size)]

    def observe(self, runner, order: list[list[str]]) -> None:
        """After ``update_states``: blocks the step writes are no longer what they held; blocks
        below each request's computed tokens are (its prefix)."""
        bs = self.block_size
        for rank, req_ids in enumerate(order):
            chains = self._chains[rank]
            fresh, full = set(), []
            for req_id in req_ids:
                state = runner.requests[req_id]
                blocks = [int(b) for b in state.block_ids[0]]
                done = int(state.num_computed_tokens) // bs
                fresh.update(blocks[done:])
                full.append(blocks[:done])
            self._drop(rank, fresh)
            for blocks in full:
                for k in range(len(blocks)):
                    chains[blocks[k]] = tuple(blocks[:k + 1])

    def _drop(self, rank: int, blocks: set[int]) -> None:
        chains = self._chains[rank]
        for b in [b for b, chain in chains.items() if blocks.intersection(chain)]:
            del chains[b]

    def drop(self, rank: int, block: int) -> None:
        """Forget every chain through ``block`` (evicted: remediation)."""
        self._drop(rank, {int(block)})

    def prefixes(self, rank: int) -> list[tuple[int, ...]]:
        """The longest chains (none a prefix of another), block ids from position 0."""
        chains = set(self._chains[rank].values())
        inner = {c[:k] for c in chains for k in range(1, len(c))}
        return sorted(chains - inner)


class Unwritten:
    """Per data-parallel rank and block, the first offset a guarded step wrote since the canary
    started (``block_size``: none; see the module docstring)."""

    def __init__(self, *, dp_size: int, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.first = np.full((dp_size, num_blocks), block_size, np.int32)

    def observe(self, runner, order: list[list[str]]) -> bool:
        """After ``update_states``: the blocks the step writes, from the slot it starts at (a
        block past a request's computed tokens from its first slot); returns whether any request
        of the step reads a slot written before (the step then masks them)."""
        bs, n = self.block_size, self.first.shape[1]
        reads_old = False
        for rank, req_ids in enumerate(order):
            first = self.first[rank]
            for req_id in req_ids:
                state = runner.requests[req_id]
                # A block id out of range (a broken table, which the checks report) is skipped.
                blocks = np.asarray([int(b) for b in state.block_ids[0]], np.int64)
                ok = (blocks >= 0) & (blocks < n)
                done = int(state.num_computed_tokens)
                read = -(-done // bs)
                reads_old = reads_old or bool((first[blocks[:read][ok[:read]]] > 0).any())
                k = done // bs
                if done % bs and k < blocks.shape[0] and ok[k]:
                    first[blocks[k]] = min(int(first[blocks[k]]), done % bs)
                first[blocks[read:][ok[read:]]] = 0
        return reads_old

    def tables(self, blocks: np.ndarray, rank: int) -> np.ndarray:
        """Slots of ``blocks`` (one row of block ids) with those written before set to 0 (the
        padding slot, which no check reads)."""
        bs = self.block_size
        blocks = np.asarray(blocks, np.int64)
        off = np.arange(bs)
        ok = off[None, :] >= self.first[rank][np.clip(blocks, 0, self.first.shape[1] - 1)][:, None]
        return np.where(ok, blocks[:, None] * bs + off, 0).reshape(-1)
