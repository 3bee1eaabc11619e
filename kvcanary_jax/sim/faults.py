"""Fault injectors for the simulated server: SGLang's perturbers (``sglang.srt.kv_canary.perturb``),
two canary-level faults and two of ours that flip one bit of a random layer's K or V (caught by
the coverage digest, ``coverage_window``; SGLang's check reads layer 0 only), as a registry.

Each fault is a :class:`Fault`: the server hook it arms for one step and a placement function
``place(server, pick, rng, *hook_args)`` that corrupts something and returns the fields that
describe it (``None``: the step offered no target; :data:`WAIT`: try again at the next step).
``pick(seq)`` draws one element with the trial's generator. Register a new fault with
:func:`fault`; :func:`inject` arms one on a server.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.sim.server import Server

__all__ = ["Fault", "FAULTS", "FAULT_KINDS", "SWEEP_PLACED", "WAIT", "fault", "inject",
           "hooks_armed", "disarm", "flip_kv_bit"]

_HOOKS = ("pre_step_hook", "post_sample_hook", "post_step_hook", "admit_hook")

# A placement's answer when its step is not the right one yet (it is armed again for the next).
WAIT = object()


@dataclasses.dataclass(frozen=True)
class Fault:
    """``kind``: its name; ``description``: what it models and which launch should catch it;
    ``hook``: the :class:`~kvcanary_jax.sim.server.Server` hook it arms; ``place``: see the
    module docstring."""

    kind: str
    description: str
    hook: str
    place: Callable


FAULTS: dict[str, Fault] = {}


def fault(kind: str, description: str, hook: str):
    """Decorator registering a placement function as fault ``kind``."""
    if hook not in _HOOKS:
        raise ValueError(f"unknown server hook {hook!r}; known: {', '.join(_HOOKS)}")

    def register(place):
        FAULTS[kind] = Fault(kind, description, hook, place)
        return place

    return register


def inject(server: Server, kind: str, rng: np.random.Generator) -> dict:
    """Arm the hook of fault ``kind`` on ``server``; returns a record filled when the fault is
    actually placed (``record["placed"]``, the step, and the fault's own fields)."""
    f = FAULTS.get(kind)
    if f is None:
        raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULTS)}")
    rec = {"kind": kind, "placed": False}

    def pick(seq):
        return seq[int(rng.integers(len(seq)))] if seq else None

    def hook(srv, *args):
        fields = f.place(srv, pick, rng, *args)
        if fields is WAIT:
            setattr(srv, f.hook, hook)
        elif fields is not None:
            rec.update(placed=True, step=srv.step_idx, **fields)

    setattr(server, f.hook, hook)
    return rec


def hooks_armed(server: Server) -> bool:
    return any(getattr(server, h) is not None for h in _HOOKS)


def disarm(server: Server) -> None:
    for h in _HOOKS:
        setattr(server, h, None)


# ------------------------------------------------------------------------------------------
# Helpers


def _xor_kv(server: Server, group: str, slot: int, layer: int, half: str, element: int,
            mask: int):
    layers = server.kv[group]["layers"]
    arr = layers[half][layer]
    u16 = jax.lax.bitcast_convert_type(arr, jnp.uint16)
    u16 = u16.at[slot, element].set(u16[slot, element] ^ jnp.uint16(mask))
    arrays = list(layers[half])
    arrays[layer] = jax.lax.bitcast_convert_type(u16, arr.dtype)
    server.kv = {**server.kv, group: {**server.kv[group],
                                      "layers": {**layers, half: tuple(arrays)}}}


def _flip_kv_byte(server: Server, group: str, slot: int):
    """Flip the bits of the first byte of ``slot``'s layer-0 K (the bytes SGLang's check reads)."""
    _xor_kv(server, group, slot, 0, "K", 0, 0x00FF)  # the first byte (little-endian)


def flip_kv_bit(server: Server, group: str, slot: int, layer: int, half: str, byte: int,
                bit: int) -> None:
    """Flip bit ``bit`` of byte ``byte`` of ``slot``'s KV in ``layer``'s ``half`` (``"K"`` or
    ``"V"``) of ``group`` (bf16 elements, little-endian: byte ``b`` is in element ``b // 2``).
    Flipping it again restores it."""
    _xor_kv(server, group, slot, layer, half, byte // 2, 1 << (8 * (byte % 2) + bit))


def _random_bit(server: Server, rng) -> dict:
    """A random layer, half, byte and bit of a slot's KV."""
    return dict(layer=int(rng.integers(server.sim.num_layers)),
                half=("K", "V")[int(rng.integers(2))],
                byte=int(rng.integers(2 * server.sim.kv_width)), bit=int(rng.integers(8)))


def _group_slot(server: Server, group: str, slot: int) -> int:
    """``slot``'s canary slot in ``group`` (the SWA group's through the LUT; 0: none)."""
    return slot if group == "FULL" else int(server.lut[slot])


def _in_window(server: Server, group: str, j: int, length: int, ahead: int = 0) -> bool:
    """Whether position ``j`` of a prefix of ``length`` tokens is verified in ``group`` now and
    while the prefix grows by ``ahead`` tokens (the SWA group's plans verify the last
    ``swa_window_size`` positions only: a position that leaves the window is read no more)."""
    return group == "FULL" or j >= length + ahead - server.sim.swa_window_size


def _prefix_targets(server: Server, sched):
    """(request, position) pairs of prefix slots the coming HEAD/TAIL verify will read."""
    out = []
    for req, _ in sched:
        for j in range(len(req.slots)):
            if req.slots[j] != 0:
                out.append((req, j))
    return out


# ------------------------------------------------------------------------------------------
# The faults


@fault("canary_token_flip", "flip a stored token in a HEAD canary slot of a running request "
       "(HEAD verify)", "pre_step_hook")
def _canary_token_flip(srv, pick, rng, sched):
    t = pick(_prefix_targets(srv, sched))
    if t is None:
        return None
    req, j = t
    slot = req.slots[j]
    key = "HEAD_K_FULL"
    buf = srv.state.bufs[key]
    bufs = dict(srv.state.bufs)
    bufs[key] = buf.at[slot, 0].set(buf[slot, 0] ^ jnp.uint8(1))
    srv.state = dataclasses.replace(srv.state, bufs=bufs)
    return dict(slot=slot, position=j)


@fault("next_token_swap", "swap two requests' sampled next tokens (write input assert, token "
       "oracle)", "post_sample_hook")
def _next_token_swap(srv, pick, rng, sampled):
    alive = [r for r in sampled if len(r.output) < r.max_new
             and len(r.all_ids) < srv.sim.context_len]
    pairs = [(a, b) for a in alive for b in alive
             if a.rid < b.rid and a.output[-1] != b.output[-1]]
    pr = pick(pairs)
    if pr is None:
        return None
    a, b = pr
    a.output[-1], b.output[-1] = b.output[-1], a.output[-1]
    return dict(rids=(a.rid, b.rid), position=len(a.all_ids) - 1)


@fault("real_kv_used", "flip a KV byte of a slot in a running request's prefix (TAIL verify)",
       "pre_step_hook")
def _real_kv_used(srv, pick, rng, sched):
    t = pick(_prefix_targets(srv, sched))
    if t is None:
        return None
    req, j = t
    _flip_kv_byte(srv, "FULL", req.slots[j])
    return dict(slot=req.slots[j], position=j)


@fault("real_kv_post_forward", "flip a KV byte of a slot just written, after TAIL (next TAIL "
       "verify)", "post_step_hook")
def _real_kv_post_forward(srv, pick, rng, sched):
    t = pick([(r, s) for r, slots in sched if r in srv.live for s in slots])
    if t is None:
        return None
    _flip_kv_byte(srv, "FULL", t[1])
    return dict(slot=t[1])


@fault("real_kv_unused_cache", "flip a KV byte of a cached slot no running request uses (SWEEP)",
       "post_step_hook")
def _real_kv_unused_cache(srv, pick, rng, sched):
    # SGLang's perturber fires only on sweep steps (a cached slot can be evicted and legitimately
    # rewritten before a later sweep would look at it).
    if srv.sim.sweep_interval <= 0 or (srv.step_idx + 1) % srv.sim.sweep_interval:
        return WAIT
    # The most recently used entry: a slot evicted and rewritten before the next sweep would no
    # longer be corrupt.
    recent = max(srv.cache, key=lambda e: e.last_used) if srv.cache else None
    unused = set(srv.cached_unused_slots())
    slot = pick([s for s in recent.slots if s in unused]) if recent else None
    if slot is None:
        return None
    _flip_kv_byte(srv, "FULL", slot)
    return dict(slot=slot)


@fault("layer_flip_used", "flip one bit of a random byte of a random layer, K or V, of a slot in "
       "a running request's prefix (TAIL digest, within the coverage window)", "pre_step_hook")
def _layer_flip_used(srv, pick, rng, sched):
    group = pick(list(srv.cfg.groups))
    # Read by this step and the window's worth after it (the prefix grows by this step's new
    # tokens, then by one a step): an SWA position must stay in the window that long.
    new = {req.rid: len(slots) for req, slots in sched}
    ahead = max(srv.sim.coverage_window, 1) - 1
    targets = [(req, j) for req, j in _prefix_targets(srv, sched)
               if _in_window(srv, group, j, len(req.slots), new[req.rid] + ahead - 1)
               and _group_slot(srv, group, req.slots[j]) > 0]
    t = pick(targets)
    if t is None:
        return None
    req, j = t
    slot = _group_slot(srv, group, req.slots[j])
    where = _random_bit(srv, rng)
    flip_kv_bit(srv, group, slot, **where)
    return dict(group=group, slot=slot, position=j, **where)


@fault("layer_flip_cached", "flip one bit of a random byte of a random layer, K or V, of a cached "
       "slot no running request uses (SWEEP digest)", "post_step_hook")
def _layer_flip_cached(srv, pick, rng, sched):
    # As real_kv_unused_cache: on a sweep step, in the most recently used entry (a slot evicted
    # and rewritten before the sweep looks at it would no longer be corrupt).
    if srv.sim.sweep_interval <= 0 or (srv.step_idx + 1) % srv.sim.sweep_interval:
        return WAIT
    recent = max(srv.cache, key=lambda e: e.last_used) if srv.cache else None
    if recent is None:
        return None
    group = pick(list(srv.cfg.groups))
    unused = set(srv.cached_unused_slots())
    n = len(recent.slots)
    j = pick([j for j, s in enumerate(recent.slots) if s in unused
              and _in_window(srv, group, j, n) and _group_slot(srv, group, s) > 0])
    if j is None:
        return None
    slot = _group_slot(srv, group, recent.slots[j])
    where = _random_bit(srv, rng)
    flip_kv_bit(srv, group, slot, **where)
    return dict(group=group, slot=slot, position=j, **where)


@fault("req_to_token", "point a running request's req_to_token entry at another live slot "
       "(HEAD verify)", "pre_step_hook")
def _req_to_token(srv, pick, rng, sched):
    targets = _prefix_targets(srv, sched)
    live_slots = sorted({s for r in srv.live for s in r.slots if s > 0})
    t = pick(targets)
    if t is None:
        return None
    req, j = t
    new = pick([s for s in live_slots if s != req.slots[j]])
    if new is None:
        return None
    srv.req_to_token[req.row, j] = new
    return dict(row=req.row, position=j, slot=req.slots[j], new_slot=new)


@fault("stale_row_reuse", "admit a request into a recycled row and skip one prefix entry of the "
       "row write, leaving the previous owner's stale slot (HEAD verify)", "admit_hook")
def _stale_row_reuse(srv, pick, rng):
    choices = []
    for row in srv.free_rows:
        for e in srv.cache:
            for j in range(min(len(e.slots), srv.sim.context_len) - 1):
                stale = int(srv.req_to_token[row, j])
                if stale in (0, e.slots[j]):
                    continue
                if srv.slot_content.get(stale) == (e.tokens[j], j):
                    continue  # identical content: not a corruption
                choices.append((row, e, j, stale))
    c = pick(choices)
    if c is None:
        return None
    row, e, j, stale = c
    suffix = [int(t) for t in rng.integers(1, srv.sim.vocab, size=3)]
    prompt = list(e.tokens) + suffix
    if len(prompt) >= srv.sim.context_len - 2:
        return None
    req = srv.admit(prompt, row=row, entry=e, skip_row_write_at=j)
    if req is None or len(req.slots) <= j:
        return None
    return dict(row=row, position=j, slot=e.slots[j], stale_slot=stale)


# What each fault models, and which launch is expected to catch it.
FAULT_KINDS = {kind: f.description for kind, f in FAULTS.items()}
# The kinds placed only on a sweep step (in a cached slot no request reads): a run without a
# sweep never places them.
SWEEP_PLACED = ("real_kv_unused_cache", "layer_flip_cached")
