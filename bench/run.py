"""``python -m bench``: one run that times every op on this GPU, ours against SGLang 0.5.23.

Outputs (``--out``, default ``bench/results`` under the current directory): ``results.json`` (every raw figure plus the
environment), ``results.md`` (the table) and ``<op>.png`` plots (time vs size, log scales: ours,
SGLang, the best Triton baseline and the byte floor). ``--quick`` runs a subset in under two
minutes; ``--smoke`` runs tiny cases on the CPU in interpret mode (CI keeps the bench alive).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvcanary_jax.bench import common, report, timing

OPS = ("scatter", "plan", "write", "verify", "bridge")


def _op_module(name):
    import importlib

    return importlib.import_module(f"kvcanary_jax.bench.op_{name}")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (``--iters 0`` used to mean the default, ``-5`` failed
    inside numpy after the run)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def unwritable(directory: str) -> str:
    """"" when ``directory`` can be created and written, else why not."""
    import tempfile

    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return ""


def main(argv: list[str] | None = None, *, prog: str = "python -m bench") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a subset of cases (< 2 min on the H200)")
    mode.add_argument("--smoke", action="store_true", help="tiny cases, CPU interpret mode")
    ap.add_argument("--ops", default=",".join(OPS), help="comma list of ops to run")
    ap.add_argument("--iters", type=positive_int, default=None,
                    help="timed iterations per case (>= 1; default: 3 smoke, 30 quick, 50 full)")
    ap.add_argument("--implementations", default="",
                    help="comma list of implementations to time as 'ours' (default: the "
                    "platform's); SGLang and the other peers are timed with the first")
    # Relative to the current directory (in a checkout's root: the checkout's bench/results),
    # never inside an installed package.
    ap.add_argument("--out", default=os.path.join("bench", "results"),
                    help="output directory (default: bench/results under the current directory)")
    args = ap.parse_args(argv)

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = set(ops) - set(OPS)
    if unknown:
        ap.error(f"unknown ops {sorted(unknown)}; choose from {OPS}")
    if not ops:
        ap.error(f"argument --ops: no op given ({args.ops!r}); choose from {OPS}")
    # Before any case runs: an unwritable --out used to fail with a traceback after the whole
    # run, its figures lost.
    why = unwritable(args.out)
    if why:
        ap.error(f"argument --out: {args.out!r} is not a writable directory ({why})")

    from tqdm import tqdm

    kind = "smoke" if args.smoke else "quick" if args.quick else "full"
    iters = args.iters if args.iters is not None else (3 if args.smoke else 30 if args.quick else 50)
    if not args.smoke and not common.on_gpu():
        print("no GPU: running the smoke mode (use --smoke to silence this)", file=sys.stderr)
        kind, iters = "smoke", min(iters, 3)

    import kvcanary_jax as kc

    impls = [i for i in args.implementations.split(",") if i] or [None]
    unknown = [i for i in impls if i is not None and i not in kc.IMPLEMENTATIONS]
    if unknown:
        ap.error(f"unknown implementations {unknown}; choose from {kc.IMPLEMENTATIONS}")

    bw = timing.copy_bandwidth_gbs()
    plan = []
    for n, impl in enumerate(impls):
        for op in ops:
            if n and op == "bridge":  # the bridge picks its implementation from the device
                continue
            mod = _op_module(op)
            cases = {"smoke": mod.SMOKE_CASES, "quick": mod.QUICK_CASES,
                     "full": mod.FULL_CASES}[kind]
            plan.append((impl, n == 0, op, mod, cases))
    total = sum(len(c) for *_, c in plan)
    rows, errors = [], {}
    t0 = time.time()
    with tqdm(total=total, desc="bench", file=sys.stderr, dynamic_ncols=True) as progress:
        for impl, first, op, mod, cases in plan:
            common.RUN.update(implementation=impl, peers=first)
            name = impl or (kc.default_implementation(op) if op != "bridge" else "bridge")
            try:
                got = mod.measure(cases, iters=iters, bw_gbs=bw, progress=progress)
                rows += [dict(r, implementation=name) for r in got]
            except Exception as exc:  # noqa: BLE001 - keep the other ops' figures
                import traceback

                errors[f"{op}[{name}]" if len(impls) > 1 else op] = traceback.format_exc()
                print(f"bench: {op} ({name}) failed: {exc!r}", file=sys.stderr)
    common.RUN.update(implementation=None, peers=True)
    result = {
        "implementations": [i or "default" for i in impls],
        "mode": kind,
        "iters": iters,
        "environment": common.environment(),
        "copy_bandwidth_gbs": bw,
        "sglang_cuda_jit": common._SGL.get("cuda_jit"),
        "sglang_load_error": common._SGL.get("error"),
        "seconds": time.time() - t0,
        "rows": rows,
        "errors": errors,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = report.markdown(result)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    if kind != "smoke":
        report.plots(result, args.out)
    print(table)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
