"""The torch bridge end to end (torch tensors in, torch tensors out): per-call time of each
SGLang-named launcher and of the fused step, against SGLang's own launchers on the same buffers
(see bench/bridge_overhead.py; host wall time per call in back-to-back bursts, the sides
interleaved)."""

from __future__ import annotations

from kvcanary_jax.bench import common

FULL_CASES = [64]
QUICK_CASES = [64]
SMOKE_CASES = [4]
OPS = ("scatter", "plan", "verify", "write", "step_fused")
_LAUNCHER = {"scatter": "launch_scatter_req_token_ids_kernel", "plan": "launch_canary_plan_kernels",
             "verify": "launch_canary_verify_kernel", "write": "launch_canary_write_kernel"}


def measure(cases, *, iters: int, bw_gbs: float, progress) -> list[dict]:
    from kvcanary_jax.bench import bridge_overhead

    rows = []
    for bs in cases:
        progress.set_postfix_str(f"bridge bs={bs}")
        gpu = common.on_gpu()
        out = bridge_overhead.measure(device=common.torch_device(), bs=bs,
                                      iters=max(iters, 27) * 5 if gpu else 2, sglang=True,
                                      rounds=9 if gpu else 2)
        rows += rows_from(out)
        progress.update(1)
    return rows


def rows_from(out: dict) -> list[dict]:
    """Table rows from one ``bench.bridge_overhead.measure`` result."""
    rows, bs = [], out["bs"]
    sg = out.get("sglang", {})
    total = sg.get("sum_of_four", {}).get("launch_us")
    for name in OPS:
        row = {"op": "bridge", "case": f"{name} bs={bs}", "bs": bs,
               "ours_call": {"median_us": out["bridge"][name]["launch_us"]},
               "path": out.get("paths", {}).get(
                   "launch_canary_step" if name == "step_fused" else _LAUNCHER[name], {})}
        ref = total if name == "step_fused" else sg.get(name, {}).get("launch_us")
        if ref is not None:
            row["sglang_call"] = {"median_us": ref}
        if "bridge_dlpack" in out:
            row["ours_call_dlpack"] = {"median_us": out["bridge_dlpack"][name]["launch_us"]}
        rows.append(row)
    rows[-1]["raw"] = out
    return rows
