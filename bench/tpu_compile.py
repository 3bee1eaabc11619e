"""Compile every op and the whole step for TPU topologies with libtpu, on a machine without a TPU.

    JAX_PLATFORMS=cpu python -m bench.tpu_compile [--topology v5e:2x2,v6e:2x2] [--case NAME,...]
                                                 [--implementation xla] [--xla-step]
                                                 [--out FILE.json]

Needs ``jax[tpu]`` (libtpu) at the installed jax's version (Python >= 3.11 with jax 0.12:
``pip install "jax[tpu]==0.12.0.1"``). libtpu's compiler, Mosaic included, compiles ahead of time
for a TPU topology (``jax.experimental.topologies``): arguments are ``jax.ShapeDtypeStruct`` s
placed on one device of the topology, the jit is lowered for ``("tpu",)`` and compiled. Nothing
runs: this proves that Mosaic accepts the kernels (DMA granularity, tiling, loop carries), which
TPU interpret mode and lowering do not check, and reports what the compiler allocates.

Per case and topology: ``ok`` or the compiler's error (Mosaic's message, first lines), the compile
seconds (trace + lower + compile), ``memory_analysis()`` (argument, output, alias, temp and
generated-code bytes) next to the logical bytes of the arguments (their shapes times their item
sizes: what the data needs, without layout padding), and ``cost_analysis()``'s bytes accessed.
Every op runs with ``implementation="pallas_mosaic_tpu"``, fallbacks refused (a
:class:`kvcanary_jax.FallbackWarning` is an error); ``--xla-step`` adds the ``xla`` step.

Sizes (:data:`CASES`): the serving sizes (a 1M-slot canary; scatter 256 x 8,192 and 1 x 5; plan
at 4,096 requests and 1; write 1 x 8,192 and 64 x 1; verify 64k entries; real-KV sources of page
size 1 and 16), the step at a serving config (:func:`serving_config`), also with the coverage
window on (8 layers' K and V, bf16, digested every step), and the KV digest over every layer of a
32-layer model (:func:`digest_case`: 8 GiB of KV as 32 int32 or bf16 sources, a 64k-entry verify
at window 64 over 1M slots in 4 KiB pages, a 8,192-slot write of 4 KiB tokens; and 8 GiB of fused
bf16 layers, 8 of ``[1M, 4, 128]``, as the strided views of their heads' K and V strips).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import sys
import time
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

import kvcanary_jax as kc
from kvcanary_jax import runtime as rt

TOPOLOGIES = ("v5e:2x2", "v6e:2x2")  # --topology also takes e.g. v5p:2x2x1, v4:2x2x1
LIBTPU = "libtpu"  # the module jax[tpu] installs: libtpu's compiler
SLOTS = 1 << 20  # the serving canary: 1M slots
KV_BYTES_PER_TOKEN = 256  # one K strip per slot (a head of 128 bf16)
TPU = "pallas_mosaic_tpu"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    op: str  # scatter, plan, write, verify, step, digest
    build: Callable  # implementation -> (jitted fn, argument pytree of ShapeDtypeStructs)


def _shape(f, *a, **k):
    """Abstract result of an allocation (nothing is materialised: the serving sizes are GBs)."""
    return jax.eval_shape(lambda: f(*a, **k))


def _i64(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int64)


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _source(page_size: int, slots: int = SLOTS):
    """A real-KV source over ``slots`` slots: bf16 pages of ``page_size`` tokens of
    :data:`KV_BYTES_PER_TOKEN` bytes, the whole strip read (mode ALL)."""
    rows = -(-slots // page_size)
    kv = jax.ShapeDtypeStruct((rows, page_size * KV_BYTES_PER_TOKEN // 2), jnp.bfloat16)
    return kc.RealKvSource(tensor=kv, page_size=page_size, num_bytes_per_token=KV_BYTES_PER_TOKEN,
                           read_bytes=KV_BYTES_PER_TOKEN)


def _context(page_size: int | None, slots: int = SLOTS):
    ctx = _shape(kc.VerifyOrWriteContext.allocate, num_slots=slots, ring_capacity=1024)
    if page_size is None:
        return ctx
    return ctx.replace(real_kv_sources=(_source(page_size, slots),),
                       real_kv_hash_mode=kc.RealKvHashMode.ALL)


def scatter_case(bs: int, cols: int, rows: int):
    def build(impl):
        fn = jax.jit(lambda f, o, r, p: kc.scatter_req_token_ids(
            flat_in=f, offsets=o, req_pool_indices=r, pool_out=p, implementation=impl),
            donate_argnums=3)
        return fn, (_i64(bs * cols), _i64(bs + 1), _i64(bs), _i32(rows, cols))
    return build


def plan_case(bs: int, ctx: int):
    def build(impl):
        cap = bs * ctx

        def plan_fn(vp, wp, rpi, prefix, extend, rtt, pool, vl):
            return kc.canary_plan(
                verify_plan_out=vp, write_plan_out=wp, req_pool_indices=rpi, prefix_lens=prefix,
                extend_seq_lens=extend, req_to_token=rtt, swa_window_size=0,
                full_to_swa_index_mapping=None, verify_capacity=cap,
                req_to_verify_expected_tokens=pool, req_to_verify_expected_tokens_valid_lens=vl,
                kv_token_id_vs_position_offset=1, implementation=impl)

        vp = _shape(kc.VerifyPlan.allocate, verify_capacity=cap)
        wp = _shape(kc.WritePlan.allocate, write_req_capacity=bs)
        return (jax.jit(plan_fn, donate_argnums=(0, 1)),
                (vp, wp, _i64(bs), _i64(bs), _i64(bs), _i32(bs + 1, ctx), _i32(bs + 1, ctx),
                 _i64(bs)))
    return build


def write_case(reqs: int, tokens_per_req: int, page_size: int | None):
    def build(impl):
        n = reqs * tokens_per_req

        def write_fn(ctx, wp, ids, pos, loc, etok, epos):
            return kc.canary_write(context=ctx, plan=wp, input_ids=ids, positions=pos,
                                   out_cache_loc=loc, enable_write_input_assert=True,
                                   expected_input_tokens=etok, expected_input_positions=epos,
                                   implementation=impl)

        wp = _shape(kc.WritePlan.allocate, write_req_capacity=reqs)
        return (jax.jit(write_fn, donate_argnums=0),
                (_context(page_size), wp, *(_i64(n),) * 5))
    return build


def verify_case(entries: int, page_size: int | None):
    def build(impl):
        def verify_fn(ctx, vp):
            return kc.canary_verify(context=ctx, plan=vp, check_verify_expected_token=True,
                                    implementation=impl)

        vp = _shape(kc.VerifyPlan.allocate, verify_capacity=entries)
        return jax.jit(verify_fn, donate_argnums=0), (_context(page_size), vp)
    return build


def serving_config(impl: str | None, **kw) -> rt.CanaryConfig:
    """The step's serving config: a 1M-slot pool, 256 requests of up to 8,192 tokens, a 64k-entry
    verify, 8,192 tokens a step, one K strip of 256 B a slot folded (mode ALL)."""
    base = dict(max_reqs=257, context_len=8192, num_slots=SLOTS, max_bs=256, max_tokens=8192,
                verify_capacity=1 << 16, ring_capacity=1024, implementation=impl)
    base.update(kw)
    return rt.CanaryConfig(**base)


def step_case(**kw):
    def build(impl):
        from kvcanary_jax.sim import make_forward

        cfg = serving_config(impl, **kw)
        step = rt.make_canary_step(cfg, make_forward(cfg, KV_BYTES_PER_TOKEN // 2))
        state = _shape(rt.init_state, cfg)
        batch = _shape(lambda: rt.make_batch(
            cfg, req_pool_indices=[1], prefix_lens=[0], extend_seq_lens=[2], all_ids=[[5, 6]],
            input_ids=[5, 6], positions=[0, 1], out_cache_loc=[1, 2]))
        if cfg.coverage_window:
            # Every layer of each group, K and V (the coverage window's KV form).
            kv = {g: {"layers": {h: tuple(
                jax.ShapeDtypeStruct((cfg.group_slots(g), KV_BYTES_PER_TOKEN // 2), jnp.bfloat16)
                for _ in range(cfg.num_layers)) for h in ("K", "V")}} for g in cfg.groups}
        else:
            kv = {g: {h: (jax.ShapeDtypeStruct((cfg.group_slots(g), KV_BYTES_PER_TOKEN // 2),
                                               jnp.bfloat16),) for h in cfg.halves}
                  for g in cfg.groups}
        rtt = _i32(cfg.max_reqs, cfg.context_len)
        lut = _i64(1)
        return step.jitted, (state, kv, batch, rtt, lut)
    return build


DIGEST_LAYERS = 32


def digest_layers(slots: int, token_bytes: int, page_size: int,
                  layers: int = DIGEST_LAYERS, dtype=jnp.int32, fused_heads: int = 0) -> tuple:
    """``layers`` KV arrays of ``slots`` tokens of ``token_bytes``: rows ``[pages, page_size *
    token]`` (one per layer: a fused K/V row, or a layer's K or V), or with ``fused_heads``
    sglang-jax's fused layers ``[slots, 2 * heads, head_dim]`` (``token_bytes`` a head)."""
    item = jnp.dtype(dtype).itemsize
    if fused_heads:
        shape = (slots, 2 * fused_heads, token_bytes // item)
    else:
        shape = (-(-slots // page_size), page_size * token_bytes // item)
    return tuple(jax.ShapeDtypeStruct(shape, dtype) for _ in range(layers))


def digest_sources(kv, *, token_bytes: int, page_size: int, fused: bool) -> tuple:
    """The digest's sources over the arrays of :func:`digest_layers` (traced in the jitted
    function, so that the views of one layer share its array): each array whole, or each fused
    layer as the strided views of its heads' K and V strips (``fused_kv_sources``'
    construction, V included)."""
    from kvcanary_jax.contracts import TensorMeta

    if not fused:
        return tuple(kc.RealKvSource(tensor=a, page_size=page_size,
                                     num_bytes_per_token=token_bytes, read_bytes=token_bytes)
                     for a in kv)
    out = []
    for a in kv:
        slots, strips, head_dim = a.shape
        view = TensorMeta(shape=(slots, head_dim), dtype=jnp.dtype(a.dtype).name,
                          strides=(strips * head_dim, 1), device=None, framework="jax")
        out += [kc.RealKvSource(tensor=a, page_size=1, num_bytes_per_token=token_bytes,
                                read_bytes=token_bytes, view=view, offset_bytes=k * token_bytes)
                for k in range(strips)]
    return tuple(out)


def digest_case(entries: int, *, verify: bool, slots: int, token_bytes: int, page_size: int,
                layers: int = DIGEST_LAYERS, window: int = 64, dtype=jnp.int32,
                fused_heads: int = 0):
    """digest_write of ``entries`` slots, or digest_verify of ``entries`` entries at ``window``,
    over :func:`digest_sources` of :func:`digest_layers`."""
    def build(impl):
        kv = digest_layers(slots, token_bytes, page_size, layers, dtype, fused_heads)
        sources = functools.partial(digest_sources, token_bytes=token_bytes,
                                    page_size=page_size, fused=bool(fused_heads))
        if not verify:
            fn = jax.jit(lambda b, s, kv: kc.digest_write(b, s, sources(kv), implementation=impl),
                         donate_argnums=0)
            return fn, (_i64(slots), _i64(entries), kv)

        def verify_fn(ctx, s, pos, nv, phase, kv):
            return kc.digest_verify(ctx, s, pos, nv, phase, window=window, sources=sources(kv),
                                    implementation=impl)

        ctx = _shape(kc.DigestContext.allocate, num_slots=slots, ring_capacity=1024)
        return (jax.jit(verify_fn, donate_argnums=0),
                (ctx, _i64(entries), _i64(entries), _i32(1), _i32(1), kv))
    return build


CASES = (
    Case("scatter 256x8192", "scatter", scatter_case(256, 8192, 512)),
    Case("scatter 1x5", "scatter", scatter_case(1, 5, 4)),
    Case("scatter 3x200", "scatter", scatter_case(3, 200, 8)),  # a row's short last segment
    Case("plan 4096 reqs", "plan", plan_case(4096, 1024)),
    Case("plan 1 req", "plan", plan_case(1, 1024)),
    Case("write 1x8192", "write", write_case(1, 8192, None)),
    Case("write 64x1", "write", write_case(64, 1, None)),
    Case("write 64x1 rkv page 1", "write", write_case(64, 1, 1)),
    Case("write 1x8192 rkv page 16", "write", write_case(1, 8192, 16)),
    Case("verify 64k", "verify", verify_case(1 << 16, None)),
    Case("verify 64k rkv page 1", "verify", verify_case(1 << 16, 1)),
    Case("verify 64k rkv page 16", "verify", verify_case(1 << 16, 16)),
    Case("step serving", "step", step_case()),
    # The coverage window on: every one of 8 layers' K and V digested at TAIL, a window of 64.
    Case("step serving coverage w64 x8", "step", step_case(coverage_window=64, num_layers=8,
                                                           sweep_interval=64)),
    Case("digest verify 64k w64 x32 pages", "digest",
         digest_case(1 << 16, verify=True, slots=SLOTS, token_bytes=256, page_size=16)),
    Case("digest write 8192 x32 4KiB tokens", "digest",
         digest_case(8192, verify=False, slots=1 << 16, token_bytes=4096, page_size=1)),
    # The same over bf16 KV (every server's dtype), read in place in row groups (two bf16 rows
    # share a 32-bit word), and over 8 fused layers of 2 heads of 128 bf16 (K and V: 32 views).
    Case("digest verify 64k w64 x32 pages bf16", "digest",
         digest_case(1 << 16, verify=True, slots=SLOTS, token_bytes=256, page_size=16,
                     dtype=jnp.bfloat16)),
    Case("digest write 8192 x32 4KiB tokens bf16", "digest",
         digest_case(8192, verify=False, slots=1 << 16, token_bytes=4096, page_size=1,
                     dtype=jnp.bfloat16)),
    Case("digest verify 64k w64 x8 fused bf16", "digest",
         digest_case(1 << 16, verify=True, slots=SLOTS, token_bytes=256, page_size=1,
                     layers=8, dtype=jnp.bfloat16, fused_heads=2)),
)


def topology_device(topology: str):
    """The first device of a TPU topology (its ``device_kind`` names the generation)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]


def logical_bytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree)
               if hasattr(x, "dtype"))


def place(tree, device):
    """``tree``'s arrays as ShapeDtypeStructs on ``device`` (a TPU of a topology)."""
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
                        if hasattr(x, "dtype") else x, tree)


def compile_for(fn, args, device):
    """``fn`` (jitted) compiled for ``device``'s TPU; a FallbackWarning is an error."""
    from kvcanary_jax.ops import _tpu_lib

    with warnings.catch_warnings():
        warnings.simplefilter("error", kc.FallbackWarning)
        with jax.enable_x64(True), _tpu_lib.tpu_lowering(device.device_kind):
            lowered = fn.trace(*place(args, device)).lower(lowering_platforms=("tpu",))
        return lowered.compile()


def mosaic_error(e: BaseException, lines: int = 3) -> str:
    """The compiler's message, first lines (Mosaic's errors quote whole MLIR ops after them)."""
    text = str(e)
    at = text.find("Mosaic failed")
    text = text[at:] if at >= 0 else f"{type(e).__name__}: {text}"
    return "\n".join(text.splitlines()[:lines])


def measure(case: Case, topology: str, impl: str = TPU) -> dict:
    device = topology_device(topology)
    row = {"case": case.name, "op": case.op, "topology": topology, "implementation": impl,
           "device_kind": device.device_kind}
    t0 = time.perf_counter()
    with jax.enable_x64(True):
        fn, args = case.build(impl)
    row["logical_bytes"] = logical_bytes(args)
    try:
        compiled = compile_for(fn, args, device)
    except Exception as e:  # noqa: BLE001  (the report names every failure)
        row.update(ok=False, seconds=round(time.perf_counter() - t0, 2), error=mosaic_error(e))
        return row
    row.update(ok=True, seconds=round(time.perf_counter() - t0, 2))
    mem = compiled.memory_analysis()
    for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "generated_code_size_in_bytes"):
        row[k] = int(getattr(mem, k, 0) or 0)
    row["argument_vs_logical"] = round(row["argument_size_in_bytes"] /
                                       max(row["logical_bytes"], 1), 3)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    row["bytes_accessed"] = int((cost or {}).get("bytes accessed", 0))
    return row


def _fmt(row: dict) -> str:
    head = f"{row['topology']:9s} {row['implementation']:18s} {row['case']:26s}"
    if not row["ok"]:
        return f"{head} ERROR ({row['seconds']} s): {row['error'].splitlines()[0]}"
    mb = lambda k: row[k] / 2**20  # noqa: E731
    return (f"{head} ok {row['seconds']:7.1f} s  arg {mb('argument_size_in_bytes'):9.1f} MiB "
            f"({row['argument_vs_logical']:.2f}x logical {row['logical_bytes'] / 2**20:.1f}) "
            f"out {mb('output_size_in_bytes'):8.1f} temp {mb('temp_size_in_bytes'):8.1f} "
            f"code {row['generated_code_size_in_bytes'] / 1024:7.1f} KiB  "
            f"accessed {row['bytes_accessed'] / 2**20:9.1f} MiB")


def libtpu_missing() -> str | None:
    """None where libtpu is installed, else the one line saying what to install."""
    if importlib.util.find_spec(LIBTPU) is not None:
        return None
    return ("kv-canary tpu_compile: compiling for TPU topologies needs libtpu, which is not "
            f'installed: pip install "jax[tpu]=={jax.__version__}"')


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default=",".join(TOPOLOGIES))
    ap.add_argument("--case", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--implementation", default=TPU,
                    choices=kc.implementations_available(platform="tpu"),
                    help="what the cases compile (default pallas_mosaic_tpu; xla for comparison)")
    ap.add_argument("--xla-step", action="store_true",
                    help="also compile the step with implementation='xla' (minutes)")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    wanted = {c.strip() for c in args.case.split(",") if c.strip()}
    cases = [c for c in CASES if not wanted or c.name in wanted]
    unknown = wanted - {c.name for c in CASES}
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}; known: {[c.name for c in CASES]}")
    missing = libtpu_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if jax.default_backend() != "cpu":
        print("note: compiling ahead of time; JAX_PLATFORMS=cpu is the tested setup",
              file=sys.stderr)
    rows = []
    for topology in args.topology.split(","):
        plan = [(c, args.implementation) for c in cases]
        if args.xla_step:
            plan += [(c, "xla") for c in CASES if c.op == "step"]
        for case, impl in plan:
            row = measure(case, topology, impl)
            print(_fmt(row), flush=True)
            rows.append(row)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)
            f.write("\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
