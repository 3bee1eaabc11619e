"""The torch bridge end to end (torch tensors in, torch tensors out): per-call time of each
SGLang-named launcher and of the fused step, against SGLang's own launchers on the same buffers
(see bench/bridge_overhead.py; host wall time per call, async back to back)."""

from __future__ import annotations

from bench import common

FULL_CASES = [64]
QUICK_CASES = [64]
SMOKE_CASES = [4]
OPS = ("scatter", "plan", "verify", "write", "step_fused")


def measure(cases, *, iters: int, bw_gbs: float, progress) -> list[dict]:
    from bench import bridge_overhead

    rows = []
    for bs in cases:
        progress.set_postfix_str(f"bridge bs={bs}")
        out = bridge_overhead.measure(device=common.torch_device(), bs=bs,
                                      iters=max(iters, 20) if common.on_gpu() else 3, sglang=True)
        rows += rows_from(out)
        progress.update(1)
    return rows


def rows_from(out: dict) -> list[dict]:
    """Table rows from one ``bench.bridge_overhead.measure`` result."""
    rows, bs = [], out["bs"]
    if True:
        sg = out.get("sglang", {})
        total = sum(sg[n]["launch_us"] for n in OPS[:4]) if all(
            "launch_us" in sg.get(n, {}) for n in OPS[:4]) else None
        for name in OPS:
            row = {"op": "bridge", "case": f"{name} bs={bs}", "bs": bs,
                   "ours_call": {"median_us": out["bridge"][name]["launch_us"]},
                   "stream_sync": out.get("stream_sync")}
            ref = total if name == "step_fused" else sg.get(name, {}).get("launch_us")
            if ref is not None:
                row["sglang_call"] = {"median_us": ref}
            for mode in ("event", "fence"):
                if "bridge_" + mode in out:
                    row[f"ours_call_{mode}"] = {"median_us": out["bridge_" + mode][name]["launch_us"]}
            rows.append(row)
        rows[-1]["raw"] = out
    return rows
