"""Canary-only step (bench.sglang_jax_step) per REAL_KV_PREFETCH value, one process."""
import json, os, sys
import jax
from kvcanary_jax.ops import _kernel_lib
from kvcanary_jax.bench import sglang_jax_step as b

out = os.environ.get("OUT", "/tmp/out")
what = sys.argv[1]
values = [int(v) for v in sys.argv[2].split(",")]
rest = sys.argv[3:]
for v in values:
    _kernel_lib.REAL_KV_PREFETCH = v
    jax.clear_caches()
    print(f"=== REAL_KV_PREFETCH={v}", flush=True)
    rc = b.main(["--what", what, "--out", f"{out}/prefetch{v}", *rest])
    d = json.load(open(f"{out}/prefetch{v}/sglang_jax_step.json"))
    for r in d["rows"]:
        k = r["canary_only"].get("kernel_us_per_call", {})
        top = {n: k[n] for n in sorted(k, key=lambda n: -k[n])[:6]}
        print(f"  prefetch={v} bs={r['bs']} ctx={r['ctx']} canary_only {r['canary_only']['median_us']:.1f} us "
              f"guarded {r['guarded']['median_us']:.1f} sglang_jax {r['sglang_jax']['median_us']:.1f} "
              f"share {r['share_pct']:.2f}% rc={rc} top={top}", flush=True)
