"""sglang-jax 0.0.2's own ``ModelRunner`` (tests/_sglang_jax_runner.py's tiny Qwen2, tensor
parallel 2 on CPU devices) with :class:`ManagedModelRunnerHook`: the runtime manager runs the host
side after every guarded step, and a flipped K byte reaches ``on_violation`` one step after the
step that found it, with the request that owns the slot (through the step's ``reqs``), which is
then aborted through sglang-jax's own ``to_abort``. Prints one JSON document
(tests/test_sglang_jax_remediation.py checks it)."""

from __future__ import annotations

import json
import os
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]

import _sglang_jax_runner  # noqa: E402  (sets the 2-device mesh before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvcanary_jax.integrations import sglang_jax as ksj  # noqa: E402


def main() -> None:
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(_sglang_jax_runner.CONFIG, f)
    mesh = _sglang_jax_runner.create_device_mesh(ici_parallelism=[-1, 2, 1],
                                                 dcn_parallelism=[1, 1, 1],
                                                 devices=jax.devices()[:2])
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
    slot = int(runner.req_to_token_pool.req_to_token[life.reqs[0].req_pool_idx, 2])
    buf = pool.kv_buffer[0]
    words = jax.lax.bitcast_convert_type(buf, jnp.uint16)
    words = words.at[slot, 0, 3].set(words[slot, 0, 3] ^ jnp.uint16(0x0100))
    pool.kv_buffer[0] = jax.device_put(jax.lax.bitcast_convert_type(words, buf.dtype),
                                       buf.sharding)
    out["slot"] = slot
    life.decode()  # its TAIL verify finds the flip
    out["reports_after_finding_step"] = list(reports)
    life.decode()  # ... and this step's host side reports it
    out["reports"] = reports
    out["to_abort"] = [bool(r.to_abort) for r in life.reqs]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
