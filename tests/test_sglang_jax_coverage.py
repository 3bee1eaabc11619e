"""The coverage window in the sglang-jax integration without sglang-jax: every layer's whole slot
rows as the digest's sources in both layouts (against the digest computed by hand on the host),
the guarded step stamping each written slot's digest at TAIL and finding a flipped bit in any
layer, K or V, within the window, the sweep finding one in a cached slot, and every setting the
window cannot honour refused where it is given. (The real pools, TP and DP, and a flip campaign:
tests/test_sglang_jax_coverage_campaign.py.)"""

from __future__ import annotations

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import consts
from kvcanary_jax.hashing import digest_np
from kvcanary_jax.integrations import sglang_jax as ksj
from kvcanary_jax.runtime import coverage_stats
from kvcanary_jax.runtime.kv import digest_reads_rows

warnings.filterwarnings("ignore", message=".*donated buffers.*")

HEADS, HEAD_DIM, SLOTS, PAGE, LAYERS = 2, 8, 16, 4, 3
CONTEXT, BUCKET = 12, 16


def _pool(seed: int) -> list[np.ndarray]:
    """Every layer of a 0.0.2-layout pool [slots, heads * 2, head_dim], distinct bf16 values."""
    rng = np.random.default_rng(seed)
    return [np.asarray(jnp.asarray(rng.normal(size=(SLOTS, 2 * HEADS, HEAD_DIM)), jnp.bfloat16))
            for _ in range(LAYERS)]


def _row_bytes(layers: list[np.ndarray]) -> list[np.ndarray]:
    """Each layer's slot rows as the bytes the digest reads: ``[slots, 2 * heads * head_dim * 2]``
    (every head's K and V strip of the slot, in the buffer's order)."""
    return [np.ascontiguousarray(b).reshape(SLOTS, -1).view(np.uint8) for b in layers]


@pytest.mark.parametrize("layout", ["0.0.2", "paged"])
def test_layer_source_digests_every_byte_of_every_layer(layout):
    """One source a layer, over the slot's whole row: the form the step hands a digest that is
    not the TPU kernel (this machine's)."""
    layers = _pool(0)
    shaped = layers if layout == "0.0.2" else [
        b.reshape(SLOTS // PAGE, PAGE, HEADS, 2, HEAD_DIM) for b in layers]
    bufs = [jnp.asarray(b) for b in shaped]
    assert not digest_reads_rows(None, bufs[0])
    sources = [ksj.layer_source(b) for b in bufs]
    assert [s.tensor is b for s, b in zip(sources, bufs)] == [True] * LAYERS  # views, no copy
    with jax.enable_x64(True):
        got = kc.digest_write(jnp.zeros((SLOTS,), jnp.int64), jnp.arange(SLOTS, dtype=jnp.int64),
                              sources, implementation="xla")
    assert np.asarray(got).tolist() == digest_np(_row_bytes(layers)).tolist()


def _strip_bytes(layers: list[np.ndarray]) -> list[np.ndarray]:
    """Each layer's slot rows as the strips the digest reads, in order: per layer, each head
    row's ``[slots, head_dim * 2]`` bytes (head ``h``'s K strip, then its V strip, ...)."""
    out = []
    for b in layers:
        rows = np.ascontiguousarray(b).reshape(SLOTS, -1, HEAD_DIM)
        out += [np.ascontiguousarray(rows[:, r]).view(np.uint8) for r in range(rows.shape[1])]
    return out


@pytest.mark.parametrize("layout", ["0.0.2", "paged"])
def test_layer_sources_digest_every_byte_of_every_layer(layout):
    """One strip per head row: the form the step hands the TPU kernel, which reads it in
    place (tests/test_tpu_compile.py)."""
    layers = _pool(0)
    shaped = layers if layout == "0.0.2" else [
        b.reshape(SLOTS // PAGE, PAGE, HEADS, 2, HEAD_DIM) for b in layers]
    bufs = [jnp.asarray(b) for b in shaped]
    sources = [ksj.layer_sources(b) for b in bufs]
    # Views, no copy: a strip per head row (K and V of each head), one row each.
    assert all(s.tensor is b for srcs, b in zip(sources, bufs) for s in srcs)
    assert [len(srcs) for srcs in sources] == [2 * HEADS] * LAYERS
    assert all(s.num_bytes_per_token == s.read_bytes == 2 * HEAD_DIM for srcs in sources
               for s in srcs)
    flat = [s for srcs in sources for s in srcs]
    with jax.enable_x64(True):
        got = kc.digest_write(jnp.zeros((SLOTS,), jnp.int64), jnp.arange(SLOTS, dtype=jnp.int64),
                              flat, implementation="xla")
    assert np.asarray(got).tolist() == digest_np(_strip_bytes(layers)).tolist()
    # Together the strips are every byte of every slot's row.
    assert sum(b.shape[1] for b in _strip_bytes(layers)) == sum(
        np.ascontiguousarray(b).reshape(SLOTS, -1).view(np.uint8).shape[1] for b in layers)
    # One flipped bit of the last layer's V strip of head 1 changes that slot's digest only.
    flipped = [b.copy() for b in layers]
    words = flipped[-1].view(np.uint16)
    words[5, 3, 2] ^= np.uint16(1 << 9)
    want = digest_np(_strip_bytes(layers))
    changed = digest_np(_strip_bytes(flipped)) != want
    assert np.nonzero(changed)[0].tolist() == [5]


# ------------------------------------------------------------------ a guarded step, one device

class _Mode:
    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_extend(self):
        return not self.decode

    def __eq__(self, other):
        return isinstance(other, _Mode) and other.decode == self.decode

    def __hash__(self):
        return hash(self.decode)


_FIELDS = ("seq_lens", "req_pool_indices", "cache_loc", "extend_prefix_lens", "extend_seq_lens",
           "input_ids", "positions", "out_cache_loc")


@jax.tree_util.register_pytree_node_class
class _Batch:
    """sglang-jax's ForwardBatch fields the canary reads (a pytree, as sglang-jax's is)."""

    def __init__(self, forward_mode, **fields):
        self.forward_mode = forward_mode
        self.__dict__.update(fields)

    def tree_flatten(self):
        return tuple(getattr(self, f) for f in _FIELDS), self.forward_mode

    @classmethod
    def tree_unflatten(cls, mode, children):
        return cls(mode, **dict(zip(_FIELDS, children)))


def _batch(seq: int, new: int):
    """One request (row 1) in slots 1 .. seq, its last ``new`` tokens written now (id 10 + p at
    position p)."""
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    pos = list(range(seq - new, seq))
    pad = [0] * (BUCKET - new)
    decode = new == 1
    cache_loc = np.zeros((BUCKET,), np.int32)
    cache_loc[:seq] = np.arange(1, seq + 1)
    return _Batch(_Mode(decode), seq_lens=i32([seq, 0]), req_pool_indices=i32([1, -1]),
                  cache_loc=i32(cache_loc),
                  extend_prefix_lens=None if decode else i32([seq - new, 0]),
                  extend_seq_lens=None if decode else i32([new, 0]),
                  input_ids=i32([10 + p for p in pos] + pad), positions=i32(pos + pad),
                  out_cache_loc=i32([p + 1 for p in pos] + [-1] * (BUCKET - new)))


def _model(fb, pool):
    """Writes every layer's K and V of the new tokens (a function of token, layer, head row)."""
    out = []
    rows = jnp.where(fb.out_cache_loc < 0, SLOTS, fb.out_cache_loc)
    for layer, buf in enumerate(pool):
        vals = (fb.input_ids[:, None, None] * 0.5 + layer + jnp.arange(2 * HEADS)[None, :, None]
                + jnp.arange(HEAD_DIM)[None, None, :] * 0.125).astype(jnp.bfloat16)
        out.append(buf.at[rows].set(vals, mode="drop"))
    return None, out, None


def _canary(**kw):
    settings = dict(num_slots=SLOTS, page_size=1, context_len=CONTEXT, max_bs=2,
                    token_checks=False, implementation="xla")
    return ksj.SglangJaxCanary(**{**settings, **kw})


def _step(canary, **kw):
    return ksj.guard_model_step(canary, _model, batch_argnum=0, pool_argnum=1,
                                fused_kv=lambda out, pool: out[1][0], **kw)


def _flip(pool, slot, layer, row, word, bit):
    words = np.asarray(pool[layer]).view(np.uint16).copy()
    words[slot, row, word] ^= np.uint16(1 << bit)
    return pool[:layer] + [jnp.asarray(words.view(jnp.bfloat16))] + pool[layer + 1:]


def test_the_step_stamps_every_written_slot_and_checks_every_layer_within_the_window():
    """TAIL stamps each written slot's digest (every layer's K and V as the model wrote them);
    a bit flipped in layer 2's V strip of head 1 (bytes SGLang's layer-0 K fingerprint never
    reads) is reported by the first step whose phase is its slot's, as KV_DIGEST_MISMATCH; a
    flip in a cached slot no step reads is reported by the sweep."""
    window = 3
    canary = _canary(coverage_window=window, num_layers=LAYERS)
    step = _step(canary, kv_layers=lambda out, pool: out[1])
    pool = [jnp.zeros((SLOTS, 2 * HEADS, HEAD_DIM), jnp.bfloat16) for _ in range(LAYERS)]
    state = canary.init_state()
    state, out = step(state, _batch(4, 4), pool)  # step 1: prefill slots 1 .. 4
    pool = out[1]
    sc = state.coverage.groups["FULL"]
    want = digest_np(_row_bytes([np.asarray(b) for b in pool]))
    stamped = np.asarray(sc.written_at)[0]
    assert stamped.tolist() == [-1, 1, 1, 1, 1] + [-1] * (SLOTS - 5)
    assert np.asarray(sc.digest)[0, 1:5].tolist() == want[1:5].tolist()

    pool = _flip(pool, 2, LAYERS - 1, 3, 1, 5)  # slot 2, layer 2, V of head 1
    found = {}
    for t in range(2, 2 + window):  # decode steps 2 .. 4 read slots 1 .. t + 2
        before = ksj.violation_counts(state)
        state, out = step(state, _batch(t + 3, 1), pool)
        pool = out[1]
        for sv in ksj.read_violations(state, start=before):
            found[t] = (sv.violation.tag, sv.violation.slot, sv.violation.reasons)
    # Steps 2 .. 4 all read slot 2; the one of its phase (2 % 3) checks it, the others do not.
    assert found == {2: ("TAIL_K_FULL", 2, ("KV_DIGEST_MISMATCH",))}

    # The sweep checks every slot of the cached prefixes it walks, whatever the phase: slot 2
    # again, and slot 1, flipped in layer 0's K of head 0 (SGLang's fingerprinted bytes too).
    pool = _flip(pool, 1, 0, 0, 0, 0)
    before = ksj.violation_counts(state)
    state = ksj.sweep(canary, state, pool[0], [[1, 2, 3]], layers=pool)
    rows = sorted((v.violation.tag, v.violation.slot, v.violation.reasons)
                  for v in ksj.read_violations(state, start=before))
    assert rows == [("SWEEP_K_FULL", 1, ("KV_DIGEST_MISMATCH",)),
                    ("SWEEP_K_FULL", 1, ("VERIFY_REAL_KV_HASH_MISMATCH",)),
                    ("SWEEP_K_FULL", 2, ("KV_DIGEST_MISMATCH",))]
    stats = coverage_stats(canary.config, state)
    assert stats.window == window and stats.live_bytes == stats.verified_bytes > 0
    assert stats.groups["FULL"].bytes_per_slot == LAYERS * 2 * HEADS * HEAD_DIM * 2


def test_without_a_window_nothing_changes():
    """coverage_window 0: no coverage state, the step takes no layers, SGLang's fingerprint of
    the canary layer's K strips as before."""
    canary = _canary()
    assert canary.config.coverage_window == 0 and canary.init_state().coverage is None
    pool = [jnp.zeros((SLOTS, 2 * HEADS, HEAD_DIM), jnp.bfloat16) for _ in range(LAYERS)]
    state, out = _step(canary)(canary.init_state(), _batch(4, 4), pool)
    pool = _flip(out[1], 2, 0, 0, 1, 1)
    state, _ = _step(canary)(state, _batch(5, 1), pool)
    assert [(v.violation.slot, v.violation.reasons) for v in ksj.read_violations(state)] == [
        (2, ("VERIFY_REAL_KV_HASH_MISMATCH",))]


# --------------------------------------------------------------------------------- bad input

class _KvPool:
    """What from_pools reads of an MHATokenToKVPool."""

    def __init__(self, shapes, page_size=1, start_layer=0):
        self.kv_buffer = [jnp.zeros(s, jnp.bfloat16) for s in shapes]
        self.page_size, self.start_layer = page_size, start_layer


_REQ_POOL = types.SimpleNamespace(size=4, max_context_len=CONTEXT)
_SHAPE = (SLOTS, 2 * HEADS, HEAD_DIM)


def test_settings_the_window_cannot_honour_are_refused_when_the_canary_is_built():
    with pytest.raises(ValueError, match="coverage_window 2 digests every layer of the pool: set "
                                         "num_layers"):
        _canary(coverage_window=2)
    with pytest.raises(ValueError, match="coverage_window 2 cannot cover num_layers=513: a "
                                         "slot's digest takes at most 512 sources"):
        _canary(coverage_window=2, num_layers=513)
    with pytest.raises(ValueError, match="coverage_window must be >= 0"):
        _canary(coverage_window=-1, num_layers=2)
    with pytest.raises(TypeError, match="coverage_window must be an int, got bool True"):
        _canary(coverage_window=True, num_layers=2)
    with pytest.raises(ValueError, match="num_layers must be positive, got 0"):
        _canary(num_layers=0)
    # From the pool: its layer count, a canary layer it holds, layers of one shape.
    canary = ksj.SglangJaxCanary.from_pools(_REQ_POOL, _KvPool([_SHAPE] * 3), max_bs=2,
                                            coverage_window=4)
    assert (canary.num_layers, canary.config.num_layers, canary.config.coverage_window) == (
        3, 3, 4)
    with pytest.raises(ValueError, match="token_to_kv_pool.kv_buffer\\[1\\] is \\(12, 4, 8\\) "
                                         "and layer 0 is \\(16, 4, 8\\) \\(layers of different "
                                         "slot counts"):
        ksj.SglangJaxCanary.from_pools(_REQ_POOL, _KvPool([_SHAPE, (12, 4, 8), _SHAPE]),
                                       max_bs=2, coverage_window=4)
    # Without a window the shapes of other layers are nobody's business.
    ksj.SglangJaxCanary.from_pools(_REQ_POOL, _KvPool([_SHAPE, (12, 4, 8)]), max_bs=2)
    with pytest.raises(ValueError, match=r"layer=3 names a layer the pool lacks \(it holds "
                                         r"layers 0 .. 2\)"):
        ksj.SglangJaxCanary.from_pools(_REQ_POOL, _KvPool([_SHAPE] * 3), max_bs=2, layer=3)
    with pytest.raises(ValueError, match=r"layer=1 names a layer the pool lacks \(it holds "
                                         r"layers 4 .. 5\)"):
        ksj.SglangJaxCanary.from_pools(_REQ_POOL, _KvPool([_SHAPE] * 2, start_layer=4),
                                       max_bs=2, layer=1)
    with pytest.raises(ValueError, match="num_layers=2, but the pool holds 3 layers"):
        ksj.SglangJaxCanary.from_pools(_REQ_POOL, _KvPool([_SHAPE] * 3), max_bs=2, num_layers=2,
                                       coverage_window=1)


def test_steps_and_sweeps_handing_fewer_layers_are_refused_before_anything_runs():
    canary = _canary(coverage_window=2, num_layers=LAYERS)
    with pytest.raises(ValueError, match="coverage_window 2 digests every layer of the pool: "
                                         "pass kv_layers="):
        _step(canary)
    with pytest.raises(ValueError, match="kv_layers is read by the coverage window only"):
        _step(_canary(), kv_layers=lambda out, pool: out[1])
    state = canary.init_state()
    pool = [jnp.zeros((SLOTS, 2 * HEADS, HEAD_DIM), jnp.bfloat16) for _ in range(LAYERS)]
    short = _step(canary, kv_layers=lambda out, pool: out[1][:2])  # a layer left out
    with pytest.raises(ValueError, match="2 layer buffer\\(s\\) handed over, the canary's "
                                         "num_layers is 3"):
        short(state, _batch(4, 4), pool)
    # Refused while tracing: nothing was donated.
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    assert not any(b.is_deleted() for b in pool)
    with pytest.raises(ValueError, match="checks the digest of every layer of the cached slots: "
                                         "pass layers="):
        ksj.sweep(canary, state, pool[0], [[1, 2]])
    with pytest.raises(ValueError, match="num_layers is 3"):
        ksj.sweep(canary, state, pool[0], [[1, 2]], layers=pool[1:])
    with pytest.raises(ValueError, match="layers= is read by the coverage window only"):
        ksj.sweep(_canary(), _canary().init_state(), pool[0], [[1, 2]], layers=pool)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_the_manager_takes_the_canary_s_window_and_needs_the_sweep_interval():
    canary = _canary(coverage_window=2, num_layers=LAYERS)
    with pytest.raises(ValueError, match="coverage_window 2 verifies cached slots at each "
                                         "sglang_jax.sweep\\(\\): pass sweep_interval=K"):
        ksj.canary_manager(canary, "log")
    with pytest.raises(ValueError, match="coverage_window=4 here, but the canary's is 2"):
        ksj.canary_manager(canary, "log", sweep_interval=8, coverage_window=4)
    with pytest.raises(ValueError, match="the observe-mode manager takes no sweep_interval"):
        ksj.canary_manager(_canary(), "log", sweep_interval=8)
    manager = ksj.canary_manager(canary, "log", sweep_interval=8)
    assert (manager.config.coverage_window, manager.config.sweep_interval) == (2, 8)
    assert manager.cfg.num_layers == LAYERS
    assert consts.KV_DIGEST_MISMATCH == 1 << 17
    # The sweep's schedule stated on the canary (its steps leave read slots to the sweep by it):
    # the manager takes it from there, and refuses another.
    stated = _canary(coverage_window=4, num_layers=LAYERS, sweep_interval=4)
    assert stated.config.sweep_interval == 4 and stated.config.sweep_covers_reads
    manager = ksj.canary_manager(stated, "log")
    assert (manager.config.sweep_interval, manager.cfg.sweep_interval) == (4, 4)
    with pytest.raises(ValueError, match="sweep_interval=8 here, but the canary's is 4: set it "
                                         "in one place"):
        ksj.canary_manager(stated, "log", sweep_interval=8)
    with pytest.raises(ValueError, match="sweep_interval must be >= 0"):
        _canary(sweep_interval=-1)
    # A NumPy integer is an int to the canary and to the manager alike.
    numpy_stated = _canary(coverage_window=4, num_layers=LAYERS, sweep_interval=np.int64(4))
    assert ksj.canary_manager(numpy_stated, "log").config.sweep_interval == 4
    # An interval stated on a canary without a window is refused where it is set.
    with pytest.raises(ValueError, match=r"sweep_interval=4 with coverage_window 0: .* set "
                                         r"coverage_window, or leave sweep_interval at 0"):
        _canary(sweep_interval=4)


def test_the_guarded_step_keeps_its_step_counters_from_wrapping():
    """The guarded step rebases a state whose step reached 2**30 (runtime.rebase; it reads the
    step every 2**20 calls, here every call): a state moved up to 2 steps short of 2**31 checks
    the same slots at the same phases as the one it was moved from, and finds the same flip."""
    import dataclasses

    window = 3
    canary = _canary(coverage_window=window, num_layers=LAYERS)

    def run(moved):
        step = _step(canary, kv_layers=lambda out, pool: out[1])
        step.rebaser.every = 1
        pool = [jnp.zeros((SLOTS, 2 * HEADS, HEAD_DIM), jnp.bfloat16) for _ in range(LAYERS)]
        state, out = step(canary.init_state(), _batch(4, 4), pool)
        pool = out[1]
        if moved:
            cov = state.coverage
            by = (2**31 - 2 - 1) // window * window
            up = lambda x: jnp.where(x >= 0, x + by, x).astype(x.dtype)  # noqa: E731
            groups = {g: dataclasses.replace(sc, steps=up(sc.steps))
                      for g, sc in cov.groups.items()}
            state = dataclasses.replace(state, coverage=dataclasses.replace(
                cov, groups=groups, step=up(cov.step), last_sweep=up(cov.last_sweep)))
        pool = _flip(pool, 2, LAYERS - 1, 3, 1, 5)
        found, steps = [], []
        for t in range(2, 2 + 2 * window):
            before = ksj.violation_counts(state)
            state, out = step(state, _batch(t + 3, 1), pool)
            pool = out[1]
            steps.append(int(np.asarray(state.coverage.step).max()))
            found += [(t, v.violation.slot, v.violation.reasons)
                      for v in ksj.read_violations(state, start=before)]
        return found, steps

    found, steps = run(moved=False)
    assert found == [(2, 2, ("KV_DIGEST_MISMATCH",)), (5, 2, ("KV_DIGEST_MISMATCH",))]
    moved, moved_steps = run(moved=True)
    assert moved == found
    assert all(0 < s < 2**30 for s in moved_steps)
    assert [s % window for s in moved_steps] == [s % window for s in steps]
