"""Markdown table and PNG plots from a results dict."""

from __future__ import annotations

import os

PEERS = ("sglang", "triton_2d")
LABEL = {"ours": "ours (Pallas)", "sglang": "SGLang 0.5.23", "triton_2d": "Triton 2-D",
         "floor": "byte floor", "gather_floor": "gather floor (random 32 B rows)",
         "chain_floor": "chain floor (the dependent splitmix64 chain alone)"}


def _med(row, key):
    v = row.get(key)
    return None if not isinstance(v, dict) else v.get("median_us")


def _fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def _first_impl_rows(result: dict) -> list[dict]:
    """The rows of the run's first implementation (all rows of a run before the axis existed):
    the ones compared with SGLang and the peers."""
    rows = result["rows"]
    impls = {r.get("implementation") for r in rows if r["op"] != "bridge"}
    if len(impls) <= 1:
        return rows
    first = next(r["implementation"] for r in rows if r["op"] != "bridge")
    return [r for r in rows if r["op"] == "bridge" or r.get("implementation") == first]


def implementations_table(result: dict) -> list[str]:
    """Device time per call of every implementation the run timed, case by case, and each
    one's ratio to the first (empty when the run timed one)."""
    rows = [r for r in result["rows"] if r["op"] != "bridge" and "implementation" in r]
    impls = list(dict.fromkeys(r["implementation"] for r in rows))
    if len(impls) < 2:
        return []
    by_case = {}
    for r in rows:
        by_case.setdefault((r["op"], r["case"]), {})[r["implementation"]] = r
    head = ["op", "case"] + impls + [f"{i}/{impls[0]}" for i in impls[1:]] + ["correct"]
    lines = ["", "Implementations (device time per call, us; correct: equal to SGLang):", "",
             "| " + " | ".join(head) + " |",
             "| --- | --- |" + " ---: |" * (2 * len(impls) - 1) + " --- |"]
    for (op, case), got in by_case.items():
        t = [_med(got[i], "ours") if i in got else None for i in impls]
        ratios = [None if a is None or not t[0] else a / t[0] for a in t[1:]]
        ok = [got[i].get("ours_correct") for i in impls if i in got]
        correct = "-" if any(v is None for v in ok) else ("yes" if all(ok) else "NO")
        lines.append(f"| {op} | {case} | " + " | ".join(_fmt(x) for x in t) + " | "
                     + " | ".join(_fmt(x, 2) for x in ratios) + f" | {correct} |")
    return lines


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        f"# kvcanary-jax bench ({result['mode']})",
        "",
        f"GPU: {env.get('gpu', env.get('jax_backend'))}; jax {env.get('jax')}, torch {env.get('torch')}, "
        f"triton {env.get('triton')}; copy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s "
        f"(read + write). Device time per call (us, median over {result['iters']} iterations, "
        "torch.profiler/CUPTI for both sides, every kernel the call launches); inputs rotate among "
        "enough sets to overflow the 60 MB L2. Byte floor: bytes the op must move / copy "
        "bandwidth; gather floor (verify): a plain Triton kernel that only reads the plan and "
        "gathers the same random 32-byte canary rows; chain floor (write): a plain Triton kernel "
        "that only computes each request's dependent splitmix64 chain over the same tokens.",
        "",
        "| op | case | ours | SGLang 0.5.23 | Triton 2-D | byte floor | gather / chain floor | ours/SGLang | ours/best Triton | ours/byte floor | ours/gather or chain floor | correct |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    first_rows = _first_impl_rows(result)
    for row in first_rows:
        if "ours" not in row:
            continue
        ours, sgl, t2d = _med(row, "ours"), _med(row, "sglang"), _med(row, "triton_2d")
        floor = row.get("floor_us")
        pattern = row.get("gather_floor_us", row.get("chain_floor_us"))
        best = min([x for x in (sgl, t2d) if x is not None], default=None)
        ratio = lambda a, b: None if a is None or b is None or b == 0 else a / b  # noqa: E731
        correct = all(v for k, v in row.items() if k.endswith("_correct")) if any(
            k.endswith("_correct") for k in row) else None
        lines.append(
            f"| {row['op']} | {row['case']} | {_fmt(ours)} | {_fmt(sgl)} | {_fmt(t2d)} | {_fmt(floor)} | "
            f"{_fmt(pattern)} | "
            f"{_fmt(ratio(ours, sgl), 2)} | {_fmt(ratio(ours, best), 2)} | {_fmt(ratio(ours, floor), 2)} | "
            f"{_fmt(ratio(ours, pattern), 2)} | "
            f"{'-' if correct is None else ('yes' if correct else 'NO')} |"
        )
    lines += implementations_table(result)
    calls = [r for r in first_rows if "ours_call" in r]
    if calls:
        lines += ["", "Call time from Python (us per call, async launches back to back; bridge rows: "
                  "torch tensors in and out through the bridge, the fused step against the sum of "
                  "SGLang's four launches):", "",
                  "| op | case | ours | SGLang launcher | ours/SGLang |", "| --- | --- | ---: | ---: | ---: |"]
        for r in calls:
            o, s = _med(r, "ours_call"), _med(r, "sglang_call")
            lines.append(f"| {r['op']} | {r['case']} | {_fmt(o)} | {_fmt(s)} | "
                         f"{_fmt(None if o is None or not s else o / s, 2)} |")
    if result.get("errors"):
        lines += ["", "Errors:", ""] + [f"- {op}: {err.strip().splitlines()[-1]}" for op, err in result["errors"].items()]
    return "\n".join(lines) + "\n"


def plots(result: dict, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first_rows = _first_impl_rows(result)
    ops = sorted({r["op"] for r in first_rows})
    for op in ops:
        rows = [r for r in first_rows if r["op"] == op]
        xkey = "bytes" if all("bytes" in r for r in rows) else None
        if xkey is None:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        series = {"ours": [], "sglang": [], "triton_2d": [], "floor": [], "gather_floor": [],
                  "chain_floor": []}
        for r in sorted(rows, key=lambda r: r[xkey]):
            x = r[xkey] / 1e6
            for key in ("ours", "sglang", "triton_2d"):
                v = _med(r, key)
                if v is not None:
                    series[key].append((x, v))
            if r.get("floor_us"):
                series["floor"].append((x, r["floor_us"]))
            if r.get("gather_floor_us"):
                series["gather_floor"].append((x, r["gather_floor_us"]))
            if r.get("chain_floor_us"):
                series["chain_floor"].append((x, r["chain_floor_us"]))
        styles = {"ours": "o-", "sglang": "s--", "triton_2d": "^--", "floor": "k:", "gather_floor": "k-.",
                  "chain_floor": "kx"}
        # Write cases differ in chain length, not only in size: points, labelled, not a curve.
        points_only = op == "write"
        for key, pts in series.items():
            if pts:
                xs, ys = zip(*pts)
                style = (styles[key][0] if points_only and key not in ("floor", "chain_floor")
                         else styles[key])
                ax.plot(xs, ys, style, label=LABEL[key], markersize=5 if points_only else 4)
        if points_only:
            xs_all = [r[xkey] / 1e6 for r in rows if _med(r, "ours") is not None]
            for r in rows:
                v = _med(r, "ours")
                if v is not None:
                    # Labels of the right-most points go to their left, inside the axes.
                    right = xs_all and r[xkey] / 1e6 >= max(xs_all) / 3
                    ax.annotate(r["case"], (r[xkey] / 1e6, v), textcoords="offset points",
                                xytext=(-6, 8) if right else (4, -10), fontsize=7,
                                ha="right" if right else "left")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bytes the op must move (MB)")
        ax.set_ylabel("device time per call (us)")
        ax.set_title(f"{op}: {result['environment'].get('gpu', '')}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{op}.png"), dpi=120)
        plt.close(fig)


def main(argv=None) -> int:
    """``python -m bench.report results.json [bridge_overhead.json]``: rewrite the table and plots
    next to ``results.json`` (merging a separate bridge_overhead run's rows when given)."""
    import json
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    path = args[0]
    with open(path) as f:
        result = json.load(f)
    if len(args) > 1:
        from kvcanary_jax.bench.op_bridge import rows_from

        with open(args[1]) as f:
            runs = json.load(f)
        runs = runs if isinstance(runs, list) else [runs]  # one result per batch size
        result["rows"] = [r for r in result["rows"] if r["op"] != "bridge"] + [
            row for run in runs for row in rows_from(run)]
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    out_dir = os.path.dirname(os.path.abspath(path))
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(result))
    plots(result, out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
