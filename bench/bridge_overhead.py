"""Per-call host overhead of the torch bridge's launchers (the hot path), and SGLang's.

One decode-like step (``bs`` requests, ``prefix`` cached tokens each, one new token) on persistent
buffers, as a CUDA-graph-style serving loop holds them. For each launcher and the fused step: the
host wall time per call in bursts of back-to-back calls (``launch_us``: what the host pays per
call, the kernels overlapping), in ``rounds`` rounds whose sides alternate (our launchers on the
direct Triton path and on the DLPack path, SGLang 0.5.23's launchers on a twin set of buffers), so
a drift in the host's speed hits every side alike. Quoted: medians over the rounds, and ratios as medians of the
per-round ratios.

    python -m bench.bridge_overhead --device cuda --bs 64,256 [--sglang] [--out result.json]

``scatter_growing`` and ``step_growing`` are the scatter and the fused step as a server calls
them: SGLang scatters each request's whole token history every step, so ``flat_in`` is one
token a request longer at every call (each call here takes the next of ``GROW`` lengths; its
SGLang side is the same calls on its twin buffers, and ``step_growing``'s ratio is against the
sum of SGLang's four launches with the growing scatter).

On the GPU SGLang's side is its Triton / CUDA kernels; on CPU its torch references.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import kvcanary_jax.bridge as bridge
from kvcanary_jax.testing import cases


GROW = 1024  # the growing history's lengths: more than one side's calls of one op


def make_case(*, device, bs: int = 64, prefix: int = 100, width: int = 256, ring: int = 1024):
    """Persistent buffers and one step's inputs (every tensor reused call after call), and a
    growing history (``history``: ``GROW`` pairs of a ``flat_in`` one token a request longer
    than the last and its offsets, with a pool wide enough for the longest)."""
    device = torch.device(device)
    max_reqs = bs + 1
    g = torch.Generator().manual_seed(0)
    rtt = torch.randperm(max_reqs * width, generator=g).add_(1).to(torch.int32)
    rtt = rtt.reshape(max_reqs, width).to(device)
    num_slots = max_reqs * width + 1
    rpi = torch.arange(1, bs + 1, dtype=torch.int64, device=device)
    prefix_lens = torch.full((bs,), prefix, dtype=torch.int64, device=device)
    extend = torch.ones(bs, dtype=torch.int64, device=device)
    ocl = rtt[rpi, prefix_lens].to(torch.int64)
    hist = torch.randint(0, 50000, (bs * (prefix + 1),), generator=g).to(device)
    offs = torch.arange(0, bs * (prefix + 1) + 1, prefix + 1, dtype=torch.int64, device=device)
    case = dict(
        device=device,
        vp=bridge.VerifyPlan.allocate(verify_capacity=3 * bs * (prefix + 1), device=device),
        wp=bridge.WritePlan.allocate(write_req_capacity=max_reqs, device=device),
        ctx=cases.torch_context(
            cases.TorchApi.bridge(),
            canary_buf=torch.zeros(num_slots, 32, dtype=torch.uint8, device=device),
            violation_ring=cases.violation_ring(ring),
            kernel_kind=bridge.CanaryLaunchTag.HEAD_K_FULL,
            real_kv_hash_mode=bridge.RealKvHashMode.NONE),
        rtt=rtt, rpi=rpi, prefix_lens=prefix_lens, extend=extend,
        pool=torch.zeros(max_reqs, width, dtype=torch.int32, device=device),
        valid=prefix_lens + 1, flat=hist, offs=offs,
        input_ids=hist[offs[1:] - 1].contiguous(), positions=prefix_lens.clone(), ocl=ocl,
    )
    longest = prefix + 1 + GROW
    base = torch.randint(0, 50000, (bs * longest,), generator=g).to(device)
    case["history"] = [(base[: bs * per], torch.arange(0, bs * per + 1, per, dtype=torch.int64,
                                                      device=device))
                       for per in range(prefix + 1, longest)]
    case["history_pool"] = torch.zeros(max_reqs, longest, dtype=torch.int32, device=device)
    case["calls"] = [0]
    return case


def _bucket_starts(c) -> list[int]:
    """The first index of the growing history in each length bucket."""
    from kvcanary_jax import buckets

    seen, out = set(), []
    for i, (flat, _) in enumerate(c["history"]):
        b = buckets.bucket(int(flat.shape[0]))
        if b not in seen:
            seen.add(b)
            out.append(i)
    return out


def _next_history(c):
    """The next (flat_in, offsets) of the growing history (cycling after ``GROW`` calls)."""
    i = c["calls"][0]
    c["calls"][0] = i + 1
    return c["history"][i % GROW]


def _plan_kw(c):
    return dict(verify_plan_out=c["vp"], write_plan_out=c["wp"], req_pool_indices=c["rpi"],
                prefix_lens=c["prefix_lens"], extend_seq_lens=c["extend"], req_to_token=c["rtt"],
                swa_window_size=0, full_to_swa_index_mapping=None,
                verify_capacity=int(c["vp"].verify_slot_indices.shape[0]),
                req_to_verify_expected_tokens=c["pool"],
                req_to_verify_expected_tokens_valid_lens=c["valid"],
                kv_token_id_vs_position_offset=0)


def run_scatter(c, lib=bridge):
    lib.launch_scatter_req_token_ids_kernel(flat_in=c["flat"], offsets=c["offs"],
                                            req_pool_indices=c["rpi"], pool_out=c["pool"])


def run_scatter_growing(c, lib=bridge):
    flat, offs = _next_history(c)
    lib.launch_scatter_req_token_ids_kernel(flat_in=flat, offsets=offs, req_pool_indices=c["rpi"],
                                            pool_out=c["history_pool"])


def run_plan(c, lib=bridge):
    lib.launch_canary_plan_kernels(**_plan_kw(c))


def run_verify(c, lib=bridge):
    lib.launch_canary_verify_kernel(context=c["ctx"], plan=c["vp"],
                                    check_verify_expected_token=True)


def run_write(c, lib=bridge):
    lib.launch_canary_write_kernel(context=c["ctx"], plan=c["wp"], input_ids=c["input_ids"],
                                   positions=c["positions"], out_cache_loc=c["ocl"],
                                   enable_write_input_assert=False, expected_input_tokens=None,
                                   expected_input_positions=None)


def run_step(c):
    kw = _plan_kw(c)
    bridge.launch_canary_step(
        context=c["ctx"], input_ids=c["input_ids"], positions=c["positions"],
        out_cache_loc=c["ocl"], expected_token_ids=c["flat"], expected_token_offsets=c["offs"],
        check_verify_expected_token=True, **kw,
    )


def run_step_growing(c):
    flat, offs = _next_history(c)
    kw = dict(_plan_kw(c), req_to_verify_expected_tokens=c["history_pool"])
    bridge.launch_canary_step(
        context=c["ctx"], input_ids=c["input_ids"], positions=c["positions"],
        out_cache_loc=c["ocl"], expected_token_ids=flat, expected_token_offsets=offs,
        check_verify_expected_token=True, **kw,
    )


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _burst(fn, c, n: int) -> float:
    """Mean host time per call of ``n`` back-to-back calls (us), the device drained before."""
    _sync(c["device"])
    t = time.perf_counter()
    for _ in range(n):
        fn(c)
    return (time.perf_counter() - t) / n * 1e6


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _interleaved(sides: dict, ops, *, iters: int, rounds: int):
    """Every (side, op) timed in ``rounds`` bursts of ``iters // rounds`` calls, the sides
    alternating inside each round, so a drift in the host's speed hits all sides alike.
    ``sides``: name -> (op -> call or None where the side lacks the op, case). Returns per side
    and op the median burst and the spread, and the raw bursts (for per-round ratios)."""
    n = max(1, iters // rounds)
    plan = [(side, op, fn_of(op), c) for op in ops for side, (fn_of, c) in sides.items()]
    plan = [p for p in plan if p[2] is not None]
    raw = {side: {} for side in sides}
    for side, op, f, c in plan:  # warm-up: compile, record the replays
        raw[side][op] = []
        if op.endswith("_growing"):  # one call per bucket of the history: compiled before
            for i in _bucket_starts(c):
                c["calls"][0] = i
                f(c)
            c["calls"][0] = 0
        for _ in range(5):
            f(c)
    for _ in range(rounds):
        for side, op, f, c in plan:
            raw[side][op].append(_burst(f, c, n))
    for _, c in sides.values():
        _sync(c["device"])
    out = {side: {op: dict(launch_us=round(_median(v), 2), min_us=round(min(v), 2),
                           max_us=round(max(v), 2), bursts=[round(x, 2) for x in v])
                  for op, v in per_op.items()} for side, per_op in raw.items()}
    return out, raw


class _SglangLib:
    """SGLang 0.5.23's launchers under the bridge's names (its own dataclasses are duck-typed
    the same, so the bridge's plan / context objects are passed through)."""

    def __init__(self, cuda_jit: bool):
        from kvcanary_jax import oracle

        ns = oracle.load(cuda_jit=cuda_jit)
        # Its scatter launcher is Triton only; the torch reference stands in on CPU tensors.
        self.launch_scatter_req_token_ids_kernel = (
            ns.scatter.launch_scatter_req_token_ids_kernel if cuda_jit else
            ns.scatter_ref.scatter_req_token_ids_torch_reference)
        self.launch_canary_plan_kernels = ns.plan_api.launch_canary_plan_kernels
        self.launch_canary_verify_kernel = ns.verify.launch_canary_verify_kernel
        self.launch_canary_write_kernel = ns.write.launch_canary_write_kernel


def measure(*, device="cpu", bs: int = 64, iters: int = 200, sglang: bool = False,
            rounds: int = 9) -> dict:
    """Per-call host times (microseconds) of every bridge launcher and the fused step on each
    path (GPU: ``bridge`` = the direct Triton path, ``bridge_dlpack`` = XLA over DLPack with the
    event handshake; CPU: the DLPack path only), and with ``sglang`` SGLang's launchers on a twin
    set of buffers, all interleaved in ``rounds`` rounds (see :func:`_interleaved`); ratios are
    medians of the per-round ratios."""
    c = make_case(device=device, bs=bs)
    ops = dict(scatter=run_scatter, plan=run_plan, verify=run_verify, write=run_write)
    is_gpu = c["device"].type == "cuda"
    out = {"device": str(c["device"]), "bs": bs, "iters": iters, "rounds": rounds,
           "method": "median over rounds of the mean host time per call in a burst of "
                     "iters/rounds back-to-back calls; sides interleaved within each round"}
    default_direct = bridge.direct_enabled()

    grown = dict(scatter_growing=run_scatter_growing)
    fused = dict(step_fused=run_step, step_growing=run_step_growing)

    def ours(direct):
        def fn_of(op):
            f = {**ops, **grown, **fused}[op]

            def call(cc):
                bridge.set_direct(direct)
                f(cc)
            return call
        return fn_of

    sides = {"bridge": (ours(True), c)}
    if is_gpu:
        sides["bridge_dlpack"] = (ours(False), make_case(device=device, bs=bs))
    if sglang:
        lib = _SglangLib(cuda_jit=is_gpu)
        sides["sglang"] = (
            lambda op: ((lambda cc, f={**ops, **grown}[op]: f(cc, lib))
                        if op in ops or op in grown else None),
            make_case(device=device, bs=bs))
    try:
        timed, raw = _interleaved(sides, [*ops, *grown, *fused], iters=iters, rounds=rounds)
    finally:
        bridge.set_direct(default_direct)
    out.update(timed)
    out["paths"] = bridge.paths()
    out["stats"] = bridge.stats()
    if sglang:
        sg = raw["sglang"]
        total = [sum(sg[n][r] for n in ops) for r in range(rounds)]
        grown_total = [total[r] - sg["scatter"][r] + sg["scatter_growing"][r]
                       for r in range(rounds)]
        for side in [k for k in sides if k != "sglang"]:
            mine = raw[side]
            ratios = {n: round(_median([mine[n][r] / sg[n][r] for r in range(rounds)]), 2)
                      for n in [*ops, *grown]}
            ratios["step_fused_vs_sum"] = round(_median(
                [mine["step_fused"][r] / total[r] for r in range(rounds)]), 2)
            ratios["step_growing_vs_sum"] = round(_median(
                [mine["step_growing"][r] / grown_total[r] for r in range(rounds)]), 2)
            out["ratio_launch" if side == "bridge" else "ratio_launch_" + side[7:]] = ratios
        out["sglang"]["sum_of_four"] = {"launch_us": round(_median(total), 2)}
        out["sglang"]["sum_of_four_growing"] = {"launch_us": round(_median(grown_total), 2)}
    return out


def table(out) -> str:
    """Microseconds per call (median burst) per side, SGLang's, and the ratios (medians of the
    per-round ratios)."""
    names = ("scatter", "plan", "verify", "write", "step_fused", "scatter_growing",
             "step_growing")
    sums = {"step_fused": "sum_of_four", "step_growing": "sum_of_four_growing"}
    sides = [k for k in ("bridge", "bridge_dlpack") if k in out]
    label = {"bridge": "direct" if out["device"].startswith("cuda") else "dlpack",
             "bridge_dlpack": "dlpack"}
    ratio_key = {"bridge": "ratio_launch", "bridge_dlpack": "ratio_launch_dlpack"}
    sg = out.get("sglang", {})
    head = f"{'op':<16}" + "".join(f"{label[k]:>12}" for k in sides) + f"{'sglang':>10}"
    if sg:
        head += "".join(f"{'ratio ' + label[k]:>14}" for k in sides)
    lines = [f"device={out['device']} bs={out['bs']} iters={out['iters']} rounds="
             f"{out.get('rounds', 1)} (us per call)", head]
    for n in names:
        row = f"{n:<16}" + "".join(f"{out[k][n]['launch_us']:>12.1f}" for k in sides)
        ref = sg.get(sums.get(n, n), {}).get("launch_us")
        row += f"{ref:>10.1f}" if ref else f"{'-':>10}"
        if ref:
            rk = n + "_vs_sum" if n in sums else n
            row += "".join(f"{out[ratio_key[k]][rk]:>13.2f}x" for k in sides)
        lines.append(row)
    if sg:
        lines.append("(the steps' SGLang column is the sum of its four launches, the growing "
                     "scatter's for step_growing; targets on the direct path: ops <= 1.0x, "
                     "step <= 0.5x)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bs", default="64", help="batch sizes, comma-separated (e.g. 64,256)")
    p.add_argument("--iters", type=int, default=270)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--sglang", action="store_true")
    p.add_argument("--out", help="write the full JSON here (printed otherwise)")
    a = p.parse_args(argv)
    results = []
    for bs in (int(x) for x in a.bs.split(",")):
        out = measure(device=a.device, bs=bs, iters=a.iters, sglang=a.sglang, rounds=a.rounds)
        results.append(out)
        print(table(out), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
