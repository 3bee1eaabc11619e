"""sglang-jax's own ``ModelRunner`` (0.0.2 or 0.1.0rc0) (tests/_sglang_jax_runner.py's tiny Qwen2, tensor
parallel 2 on CPU devices) with :class:`ManagedModelRunnerHook`: the runtime manager runs the host
side after every guarded step, and a flipped K byte reaches ``on_violation`` one step after the
step that found it, with the request that owns the slot (through the step's ``reqs``), which is
then aborted through sglang-jax's own ``to_abort``. Prints one JSON document
(tests/test_sglang_jax_remediation.py checks it).

``--mode raise``: the same life in raise mode, next to the same life without the canary (the same
flip at the same step). Before the flip, one step is handed a delta made for another batch (the
batch padded to 3 rows, not the bucket's 4): refused before anything runs, the runner's pool
alive. The step that reports the flip raises; the runner's pool then holds that step's KV (what
sglang-jax alone holds after the same steps), the error carries it, and one more step from it
matches sglang-jax alone."""

from __future__ import annotations

import json
import os
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]

import _sglang_jax_runner  # noqa: E402  (sets the 2-device mesh before JAX starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from sgl_jax.srt.layers.logits_processor import LogitsMetadata  # noqa: E402
from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch  # noqa: E402

from kvcanary_jax.runtime import CanaryViolationError  # noqa: E402

from kvcanary_jax.integrations import sglang_jax as ksj  # noqa: E402


def _mesh_and_model():
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(_sglang_jax_runner.CONFIG, f)
    mesh = _sglang_jax_runner.make_mesh()
    return mesh, model_dir


def _flip(runner, req):
    """Flip one K byte of the canary layer at ``req``'s position 2; returns the slot."""
    pool = runner.token_to_kv_pool
    slot = int(runner.req_to_token_pool.req_to_token[req.req_pool_idx, 2])
    pool.kv_buffer[0] = _sglang_jax_runner.flip_k_byte(pool.kv_buffer[0], slot)
    return slot


def main() -> None:
    mesh, model_dir = _mesh_and_model()
    runner = _sglang_jax_runner.make_runner(model_dir, mesh)
    pool = runner.token_to_kv_pool
    canary = ksj.SglangJaxCanary.from_pools(runner.req_to_token_pool, pool,
                                            max_bs=_sglang_jax_runner.MAX_BS,
                                            incremental_tokens=True)
    reports = []

    def on_violation(r):
        reports.append({"step": r.step, "shard": r.shard, "tag": r.violation.tag,
                        "slot": r.violation.slot,
                        "request": None if r.request is None else r.request.rid})
        if r.request is not None:
            ksj.abort_request(r.request, "kv-canary: corrupted KV")

    mgr = ksj.canary_manager(canary, "log", on_violation=on_violation)
    hook = ksj.ManagedModelRunnerHook(canary, runner, mgr)
    life = _sglang_jax_runner.Life(runner, mesh, hook)
    expect = hook.expect
    # Life gives the expected ids; the step's requests come from its batch.
    hook.expect = lambda expected=None, table=None: expect(expected, table,
                                                           reqs=life.batch.reqs)
    life.forward()
    for _ in range(3):
        life.decode()
    out = {"clean_reports": list(reports), "steps_before_flip": mgr.step_count}
    out["slot"] = _flip(runner, life.reqs[0])
    life.decode()  # its TAIL verify finds the flip
    out["reports_after_finding_step"] = list(reports)
    life.decode()  # ... and this step's host side reports it
    out["reports"] = reports
    out["to_abort"] = [ksj.abort_pending(r) for r in life.reqs]
    json.dump(out, sys.stdout)


def _deleted(arrays) -> bool:
    return any(x.is_deleted() for x in arrays)


def _refused_step(runner, mesh, hook, life) -> dict:
    """A decode step handed the delta of the batch padded to 3 rows, while the runner steps the
    batch padded to the bucket (4 rows)."""
    batch = life.batch
    batch.prepare_for_decode()
    mwb = batch.get_model_worker_batch([_sglang_jax_runner.TOKENS], [_sglang_jax_runner.MAX_BS],
                                       [_sglang_jax_runner.CACHE_LOC], 1)
    other = batch.get_model_worker_batch([3], [3], [_sglang_jax_runner.CACHE_LOC], 1)
    runner.attn_backend.forward_metadata = runner.attn_backend.get_forward_metadata(mwb)
    fb = ForwardBatch.init_new(mwb, runner)
    hook.expect(hook.feed.delta(batch.reqs, other), reqs=batch.reqs)
    out = {"error": None}
    try:
        with jax.set_mesh(mesh):
            runner.forward(fb, logits_metadata=LogitsMetadata.from_model_worker_batch(mwb, mesh))
    except ValueError as e:
        out["error"] = str(e)
    out["pool_deleted"] = _deleted(runner.token_to_kv_pool.kv_buffer)
    out["state_deleted"] = _deleted(jax.tree.leaves(hook.state))
    return out


def raise_mode() -> None:
    mesh, model_dir = _mesh_and_model()
    # sglang-jax alone, the same life and flip: the KV and tokens the guarded runner must keep.
    plain_runner = _sglang_jax_runner.make_runner(model_dir, mesh)
    plain = _sglang_jax_runner.Life(plain_runner, mesh)
    plain.forward()
    for _ in range(3):
        plain.decode()
    _flip(plain_runner, plain.reqs[0])
    plain.decode()
    plain.decode()
    after_raise = plain.kv_digest()
    plain.decode()

    runner = _sglang_jax_runner.make_runner(model_dir, mesh)
    canary = ksj.SglangJaxCanary.from_pools(runner.req_to_token_pool, runner.token_to_kv_pool,
                                            max_bs=_sglang_jax_runner.MAX_BS,
                                            incremental_tokens=True)
    mgr = ksj.canary_manager(canary, "raise")
    hook = ksj.ManagedModelRunnerHook(canary, runner, mgr)
    life = _sglang_jax_runner.Life(runner, mesh, hook)
    life.forward()
    life.decode()
    out = {"refused": _refused_step(runner, mesh, hook, life)}
    life.forward()  # the same decode step, with the right delta
    life.decode()
    _flip(runner, life.reqs[0])
    life.decode()  # its TAIL verify finds the flip
    life.batch.prepare_for_decode()
    try:
        life.forward()  # ... and this step's host side raises
        out["raised"] = None
    except CanaryViolationError as e:
        pool = runner.token_to_kv_pool.kv_buffer
        first_slots = sorted({r.violation.slot for r in e.reports})
        out["raised"] = {"step": e.step, "reports": len(e.reports),
                         "pool_deleted": _deleted(pool),
                         "error_kv_is_the_pool": e.kv is not None and len(e.kv) == len(pool)
                         and all(a is b for a, b in zip(e.kv, pool))}
    out["plain_kv_after_raise"] = after_raise
    out["plain_next_ids"] = plain.steps[-1]["next_ids"]
    out["plain_kv_after_next"] = plain.kv_digest()
    if _deleted(runner.token_to_kv_pool.kv_buffer):
        out["kv_after_raise"] = None  # nothing left to serve from
        json.dump(out, sys.stdout)
        return
    out["kv_after_raise"] = life.kv_digest()
    # Serving on from the kept KV: the raising step's tokens are sglang-jax's own (the step ran),
    # then one more step.
    for req, tok in zip(life.batch.reqs, plain.steps[-2]["next_ids"]):
        req.output_ids.append(int(tok))
    life.batch.output_ids = np.asarray(plain.steps[-2]["next_ids"], np.int32)
    # The flipped slot is still corrupted and the next step reads it again: its verify records a
    # new ring row, which raise mode raises (a raise silences nothing after it), after the step
    # ran and with its KV kept.
    try:
        life.decode()
        out["raised_again"] = None
    except CanaryViolationError as e:
        out["raised_again"] = {"step": e.step,
                               "same_slot": sorted({r.violation.slot for r in e.reports})
                               == first_slots,
                               "pool_deleted": _deleted(runner.token_to_kv_pool.kv_buffer)}
    out["kv_after_next"] = life.kv_digest()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    raise_mode() if sys.argv[1:] == ["--mode", "raise"] else main()
