"""The copies XLA puts into the canary's compiled step: device-to-device copies that no kernel of
ours launches, about a microsecond each on an H200, which the step pays every time.

    python -m bench.step_copies [--implementation NAME] [--window N] [--out DIR]

Compiles ``make_canary_step`` (a 2-layer model that writes every layer's K and V, the state and
the KV donated) with the coverage window off and at ``--window`` (default 64) for the platform's
implementation, and lists each ``copy`` instruction of the optimized program with what it copies.
Two causes were found this way (bench/NOTES.md, "copies out of the step"): a donated state leaf
paired with another leaf's output (every state-donating jit keeps its unused inputs), and a reader
of an array's old values left unordered with its in-place update (the old values are gathered
behind a barrier). On a CPU the numbers differ (XLA's CPU scatters copy their operand, its loops
copy their carry); on the H200 both steps compiled to 0 copies at 36f9222 (before: 0 and 9).

Results: ``DIR/step_copies.json`` and a line per step on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings

from kvcanary_jax.bench import common
from kvcanary_jax.testing.forward import layered_kv, write_every_layer

LAYERS, SLOTS, WIDTH = 2, 16, 8
SIZES = dict(max_reqs=4, context_len=16, num_slots=SLOTS, max_bs=2, max_tokens=8,
             ring_capacity=64)
SHOWN = 12  # copies listed per step on stdout (all of them in the JSON)
_COPY = re.compile(r"^\s*(?:ROOT )?%\S+ = (\S+) copy(?:-start)?\((%[^),]+)")


def copies(text: str) -> list[dict]:
    """Each copy instruction of an optimized HLO module's text: its shape and operand."""
    out = []
    for line in text.splitlines():
        m = _COPY.match(line)
        if m:
            out.append({"shape": m.group(1), "of": m.group(2).lstrip("%")})
    return out


def step_copies(window: int, implementation: str | None) -> dict:
    """The copies of ``make_canary_step``'s compiled program at ``window`` (0: off)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvcanary_jax import runtime as rt

    cfg = rt.CanaryConfig(**SIZES, coverage_window=window, num_layers=LAYERS,
                          implementation=implementation)
    step = rt.make_canary_step(cfg, write_every_layer)
    ids = [11, 12, 13]
    with jax.enable_x64(True):
        state = rt.init_state(cfg)
        kv = layered_kv(SLOTS, WIDTH, LAYERS)
        batch = rt.make_batch(cfg, req_pool_indices=[1], prefix_lens=[2], extend_seq_lens=[1],
                              all_ids=[ids], input_ids=ids[2:], positions=[2],
                              out_cache_loc=[3])
        table = np.zeros((cfg.max_reqs, cfg.context_len), np.int32)
        table[1, :3] = [1, 2, 3]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*donated buffers.*")
            text = step.jitted.lower(state, kv, batch, jnp.asarray(table),
                                     jnp.zeros((1,), jnp.int64)).compile().as_text()
    found = copies(text)
    return {"window": window, "copies": len(found), "list": found}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_copies",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--implementation", default=None,
                    help="the ops' implementation (default: the platform's)")
    ap.add_argument("--window", type=int, default=64, help="the coverage window (>= 1)")
    ap.add_argument("--out", default=None, help="a directory for step_copies.json")
    a = ap.parse_args(argv)
    if a.window < 1:
        ap.error(f"argument --window: must be >= 1, got {a.window}")
    if a.out:
        try:
            os.makedirs(a.out, exist_ok=True)
        except OSError as e:
            ap.error(f"argument --out: {a.out!r} is not a writable directory ({e.strerror})")
    impl = a.implementation or common.implementation()
    rows = [step_copies(w, impl) for w in (0, a.window)]
    for r in rows:
        shown = r["list"][:SHOWN]
        more = f"\n    ... {r['copies'] - len(shown)} more" if r["copies"] > len(shown) else ""
        print(f"make_canary_step window {r['window']:>4} ({impl or 'the platform default'}): "
              f"{r['copies']} copies" + "".join(f"\n    {c['shape']} of {c['of']}"
                                                for c in shown) + more)
    if a.out:
        with open(os.path.join(a.out, "step_copies.json"), "w") as f:
            json.dump({"implementation": impl, "environment": common.environment(),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
