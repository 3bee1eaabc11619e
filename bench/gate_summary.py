"""Summarises a GPU gate run (``bash bench/gpu_session.sh gate``) into one dated markdown file.

Reads the gate's logs (one pytest run per part, the memory checker's run) and writes
``<out>/<date>.md``: the commit, the machine and package versions, and per part its command, its
pytest tally (or the checker's error count) and its wall time; exit status 1 when a part failed.

    python -m bench.gate_summary --logs DIR --out DIR --commit SHA
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

_TALLY = re.compile(r"^=*\s*(?P<tally>(\d+ (passed|failed|error|errors|skipped|deselected|xfailed|"
                    r"xpassed|warnings?)(, )?)+).* in (?P<secs>[\d.]+)s", re.M)


def part_result(log: str) -> dict:
    """``{"ok", "tally", "seconds"}`` of one part's log (pytest's closing line, or the memory
    checker's ERROR SUMMARY)."""
    if "ERROR SUMMARY:" in log:
        n = int(re.search(r"ERROR SUMMARY: (\d+) error", log).group(1))
        done = len(re.findall(r"launches.* done$", log, re.M))
        return {"ok": n == 0 and done > 0, "tally": f"{n} errors, {done} op runs done",
                "seconds": None}
    m = None
    for m in _TALLY.finditer(log):
        pass
    if m is None:
        return {"ok": False, "tally": "no pytest summary (crashed or timed out)", "seconds": None}
    tally = m.group("tally").strip().rstrip(",")
    ok = "failed" not in tally and "error" not in tally and "passed" in tally
    return {"ok": ok, "tally": tally, "seconds": float(m.group("secs"))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", required=True, help="folder of the gate's <part>.log files")
    p.add_argument("--out", required=True, help="folder the dated summary goes to")
    p.add_argument("--commit", default="unknown", help="the commit the gate ran on")
    p.add_argument("--wall", type=float, default=None, help="the gate's wall time, seconds")
    args = p.parse_args(argv)
    with open(os.path.join(args.logs, "parts.json")) as f:
        parts = json.load(f)  # [{"name", "command", "wall"}] in run order
    rows, ok_all = [], True
    for part in parts:
        path = os.path.join(args.logs, part["name"] + ".log")
        log = open(path, errors="replace").read() if os.path.exists(path) else ""
        r = part_result(log)
        ok_all &= r["ok"]
        failed = re.findall(r"^FAILED (\S+)", log, re.M)[:10]
        rows.append((part, r, failed))
    env = open(os.path.join(args.logs, "env.txt")).read().strip() \
        if os.path.exists(os.path.join(args.logs, "env.txt")) else ""
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# GPU gate, {now:%Y-%m-%d %H:%M} UTC: {'PASSED' if ok_all else 'FAILED'}", "",
             f"- commit: `{args.commit}`",
             *(f"- {line}" for line in env.splitlines()),
             f"- wall time: {args.wall:.0f} s" if args.wall else "- wall time: ?", "",
             "| part | result | pytest time (s) | wall (s) | command |",
             "| --- | --- | ---: | ---: | --- |"]
    for part, r, failed in rows:
        secs = "" if r["seconds"] is None else f"{r['seconds']:.0f}"
        lines.append(f"| {part['name']} | {'ok' if r['ok'] else 'FAILED'}: {r['tally']} | "
                     f"{secs} | {part.get('wall', '')} | `{part['command']}` |")
    for part, r, failed in rows:
        if failed:
            lines += ["", f"Failed in {part['name']}:", *(f"- `{t}`" for t in failed)]
    os.makedirs(args.out, exist_ok=True)
    name = os.path.join(args.out, f"{now:%Y-%m-%dT%H%MZ}.md")
    with open(name, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"summary: {name}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
