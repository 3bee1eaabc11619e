"""One interpret mechanism, the launch config's ``interpret`` field: ``implementation=
"pallas_triton", config=Config(interpret=True)`` runs anywhere (here on the CPU, with no fallback to
xla) and gives ``implementation="pallas_interpret"``'s results byte for byte, for each op (one small
hand case each: a step's plan, write and verify, and a scatter)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import kvcanary_jax as kc
from kvcanary_jax.ops import _registry

pytestmark = pytest.mark.skipif(
    _registry.op("verify").unusable("pallas_interpret") is not None,
    reason="the Pallas Triton module does not import here")


def _i64(*v):
    return jnp.asarray(np.asarray(v, np.int64))


# Two requests: rows 1 and 2 of req_to_token, 3 and 1 cached tokens, 2 and 3 new ones.
RPI, PREFIX, EXTEND = (1, 2), (3, 1), (2, 3)
REQ_TO_TOKEN = np.array([[0] * 8, [5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]],
                        np.int32)


def _tokens():
    """The step's new tokens: ids, positions and the slots they are written to."""
    ids, pos, loc = [], [], []
    for r, p, e in zip(RPI, PREFIX, EXTEND):
        for j in range(p, p + e):
            ids.append(100 * r + j)
            pos.append(j)
            loc.append(int(REQ_TO_TOKEN[r, j]))
    return _i64(*ids), _i64(*pos), _i64(*loc)


def _context():
    """32 slots, one real-KV source of 48 bytes a slot (hashed whole), a ring of 8 rows."""
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=8)
    kv = jnp.asarray(np.arange(32 * 48, dtype=np.uint8).reshape(32, 48))
    return ctx.replace(real_kv_sources=(kc.RealKvSource(tensor=kv, page_size=1,
                                                        num_bytes_per_token=48, read_bytes=48),),
                       real_kv_hash_mode=kc.RealKvHashMode.ALL)


def _plans(implementation, config):
    return kc.canary_plan(
        verify_plan_out=kc.VerifyPlan.allocate(verify_capacity=8),
        write_plan_out=kc.WritePlan.allocate(write_req_capacity=2),
        req_pool_indices=_i64(*RPI), prefix_lens=_i64(*PREFIX), extend_seq_lens=_i64(*EXTEND),
        req_to_token=jnp.asarray(REQ_TO_TOKEN), swa_window_size=0,
        full_to_swa_index_mapping=None, verify_capacity=8, req_to_verify_expected_tokens=None,
        req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0,
        implementation=implementation, config=config)


def _write(implementation, config, context=None):
    ids, pos, loc = _tokens()
    _, wp = _plans("xla", None)
    return kc.canary_write(context=_context() if context is None else context, plan=wp,
                           input_ids=ids, positions=pos, out_cache_loc=loc,
                           enable_write_input_assert=True, expected_input_tokens=ids,
                           expected_input_positions=pos, implementation=implementation,
                           config=config)


def _verify(implementation, config):
    # The canary the step's write left (xla), then the next step's verify of the cached tokens:
    # the written slots verify clean, the never-written prefixes go to the ring.
    ctx = _write("xla", None)
    vp, _ = _plans("xla", None)
    return kc.canary_verify(context=ctx, plan=vp, check_verify_expected_token=True,
                            implementation=implementation, config=config)


def _scatter(implementation, config):
    return kc.scatter_req_token_ids(
        flat_in=_i64(*range(10, 19)), offsets=_i64(0, 3, 5, 9), req_pool_indices=_i64(1, 3, 2),
        pool_out=jnp.full((4, 6), -9999, jnp.int32), implementation=implementation,
        config=config)


CASES = {"scatter": _scatter, "plan": _plans, "write": _write, "verify": _verify}


def _bytes(tree):
    return [(np.asarray(x).dtype, np.asarray(x).shape, np.asarray(x).tobytes())
            for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_pallas_triton_in_interpret_mode_is_pallas_interpret_byte_for_byte(name, monkeypatch):
    op = _registry.op(name)
    mod = op.module("pallas_triton")
    assert op.select("pallas_triton", platform="cpu", config=mod.Config(interpret=True)) == \
        "pallas_triton"
    # Both calls trace the pallas_triton module's run, each with a config in interpret mode.
    seen, run = [], mod.run

    def spy(*args, config, **kw):
        seen.append(config)
        return run(*args, config=config, **kw)

    monkeypatch.setattr(mod, "run", spy)
    api = __import__(f"kvcanary_jax.ops.{name}.api", fromlist=["_run"])
    api._run.clear_cache()  # trace again, whatever ran before in this process
    with jax.enable_x64(True):
        want = CASES[name]("pallas_interpret", None)
        got = CASES[name]("pallas_triton", mod.Config(interpret=True))
    assert len(seen) == 2 and all(isinstance(c, mod.Config) and c.interpret for c in seen), seen
    assert _bytes(got) == _bytes(want)
    if name == "verify":  # the case exercises the ring: violations were found and recorded
        assert int(np.asarray(got.violation_write_index)[0]) > 0
