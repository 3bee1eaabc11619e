"""The write's serial chain against its floor, instruction by instruction (any machine).

    python -m kvcanary_jax.bench.write_sass [--out DIR]

Compiles, with the installed triton for sm_90 (no GPU needed), the write kernel as the torch
bridge's direct path lowers it (``pallas_triton``, no real-KV source) and the chain floor's plain
Triton kernel (:func:`bench.op_write.chain_kernel`), disassembles both with the ``nvdisasm``
triton ships, finds each kernel's chain loops (innermost loops that run a token's splitmix64
rounds: the floor's unrolled trip; the write's fast chain, for a block whose tokens are all
written, and its general chain, :func:`write_chains`) and prints their SASS instructions per
token by opcode, side by side.
The floor's loop is unrolled by the compiler and the write's fast chain by ``CHAIN_UNROLL``; each
body is divided by the tokens it covers (its ``IMAD.WIDE.U32`` count over the six a token's three splitmix64
rounds take). ``--out`` keeps both SASS listings and the table as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys

ROUND_WIDE_MULS = 6  # mix3: three splitmix64 rounds, two 64-bit multiplies each, one IMAD.WIDE


def _sass(cubin: bytes, path: str) -> str:
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")
    with open(path, "wb") as f:
        f.write(cubin)
    return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                          check=True).stdout


def parse(sass: str) -> tuple[list[str], dict[str, int]]:
    """(instructions, label -> index of the instruction it precedes)."""
    ins, labels = [], {}
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if m:
            ins.append(m.group(1))
    return ins, labels


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def chain_loops(ins: list[str], labels: dict[str, int]) -> list[list[str]]:
    """The bodies of the innermost loops (no backward branch inside them) that run at least one
    token's splitmix64 rounds (``ROUND_WIDE_MULS`` ``IMAD.WIDE.U32``), in code order."""
    loops = []
    for end, i in enumerate(ins):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", i)
        if m and labels.get(m.group(1), end + 1) <= end:
            loops.append((labels[m.group(1)], end))
    inner = [(a, b) for a, b in loops
             if not any(a <= c and d < b and (c, d) != (a, b) for c, d in loops)]
    bodies = [ins[a:b + 1] for a, b in sorted(inner)]
    bodies = [x for x in bodies
              if sum(opcode(i) == "IMAD.WIDE.U32" for i in x) >= ROUND_WIDE_MULS]
    if not bodies:
        raise RuntimeError("no chain loop found in the kernel's SASS")
    return bodies


def write_chains(bodies: list[list[str]]) -> dict[str, list[str]]:
    """The write's chain loops by role. Each of its two parts (the first block, peeled out of
    the block loop, then the later blocks: a long request's all but one) has the fast chain's
    unrolled trip (the most tokens a trip), its remainder (one token, no select) and the
    general chain (one token, with the selects of its per-token checks); the loop that re-runs
    a block's chain to record a violation stores nothing and is left out."""
    chains = [b for b in bodies if (lambda t, c: c["STG.E.64"] == 3 * t and t)(
        *per_token_counts(b))]
    if len(chains) != 6:
        raise RuntimeError(f"the write's SASS has {len(chains)} chain loops, not 6 (the fast "
                           "chain's trip and remainder and the general chain, in the first "
                           "block and in the later ones)")
    out = {}
    for part, group in (("first", chains[:3]), ("later", chains[3:])):
        trip = max(group, key=lambda b: per_token_counts(b)[0])
        ones = [b for b in group if b is not trip]
        general = [b for b in ones if per_token_counts(b)[1]["SEL"]]
        if len(general) != 1:
            raise RuntimeError("the write's general chain was not told from its fast remainder")
        out[f"{part}_fast"], out[f"{part}_general"] = trip, general[0]
    return out


def per_token_counts(body: list[str]) -> tuple[float, collections.Counter]:
    counts = collections.Counter(opcode(x) for x in body)
    return counts["IMAD.WIDE.U32"] / ROUND_WIDE_MULS, counts


def per_token(body: list[str]) -> tuple[float, dict[str, float]]:
    counts = collections.Counter(opcode(x) for x in body)
    tokens = counts["IMAD.WIDE.U32"] / ROUND_WIDE_MULS
    return tokens, {k: v / tokens for k, v in counts.items()}


def kernels():
    """(ours, floor): triton's compiled kernels for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvcanary_jax.bench import bridge_overhead as bo
    from kvcanary_jax.bench import op_write
    from kvcanary_jax.bridge import declarations
    from kvcanary_jax.bridge import triton_direct as td
    from kvcanary_jax.bridge.launcher import bind, lowered_specs

    target = GPUTarget("cuda", 90, 32)
    c = bo.make_case(device="cpu", bs=4, prefix=12, width=32, ring=64)
    kw = dict(context=c["ctx"], plan=c["wp"], input_ids=c["input_ids"], positions=c["positions"],
              out_cache_loc=c["ocl"], enable_write_input_assert=False,
              expected_input_tokens=None, expected_input_positions=None)
    decl = declarations.WRITE
    args, static, results = decl.arguments(kw, decl.tensors(kw))
    names = [a.name for a in args]
    prog = td.extract_program(bind(decl.fn, names, results), lowered_specs(args),
                              results_to_args=[names.index(r) for r in results],
                              static=dict(static, platform="cuda"))
    [k] = prog.kernels
    ours = td.compile_kernel(k.ttir, num_warps=k.num_warps, num_stages=k.num_stages,
                             target=target)
    sig = {n: "*i64" for n in ("ids", "positions", "offsets", "h0", "seeds", "canary", "out")}
    sig["SEEDED"] = "constexpr"
    floor = triton.compile(ASTSource(fn=op_write.chain_kernel(), signature=sig,
                                     constexprs={"SEEDED": False}),
                           target=target, options=dict(num_warps=1, enable_fp_fusion=True))
    return ours, floor


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="a directory for the SASS listings and JSON")
    a = ap.parse_args(argv)
    import tempfile

    import triton

    out = a.out or tempfile.mkdtemp(prefix="kvcanary-sass-")
    os.makedirs(out, exist_ok=True)
    rows = {}
    for name, compiled in zip(("write", "chain_floor"), kernels()):
        sass = _sass(compiled.asm["cubin"], os.path.join(out, f"{name}.cubin"))
        with open(os.path.join(out, f"{name}.sass"), "w") as f:
            f.write(sass)
        bodies = chain_loops(*parse(sass))
        if name == "chain_floor":
            roles = {"chain_floor": max(bodies, key=lambda b: per_token_counts(b)[0])}
        else:  # the later blocks' chains are the table's; the first block's go to the JSON
            roles = {("write_" + k).replace("_later", ""): v
                     for k, v in write_chains(bodies).items()}
        for key, body in roles.items():
            tokens, mix = per_token(body)
            rows[key] = {"tokens_per_trip": tokens, "per_token": mix,
                         "total_per_token": sum(mix.values())}
    cols = ("chain_floor", "write_fast", "write_general")
    print(f"triton {triton.__version__}, sm_90; SASS instructions per token in the chain loops, "
          "in the blocks after a request's first (fast: a block whose tokens are all written, "
          f"{rows['write_fast']['tokens_per_trip']:g} a trip; general: any other, one a trip; "
          f"floor: {rows['chain_floor']['tokens_per_trip']:g} a trip)")
    print(f"{'opcode':24s} {'floor':>7s} {'fast':>7s} {'general':>7s}")
    f = rows["chain_floor"]["per_token"]
    ops = set().union(*(rows[c]["per_token"] for c in cols))
    for op in sorted(ops, key=lambda k: (-(rows["write_fast"]["per_token"].get(k, 0)
                                           - f.get(k, 0)), k)):
        print(f"{op:24s} " + " ".join(f"{rows[c]['per_token'].get(op, 0):7.2f}" for c in cols))
    print(f"{'total':24s} " + " ".join(f"{rows[c]['total_per_token']:7.2f}" for c in cols))
    print("the first block: fast " + f"{rows['write_first_fast']['total_per_token']:.2f}, "
          f"general {rows['write_first_general']['total_per_token']:.2f}")
    rows["triton"] = triton.__version__
    with open(os.path.join(out, "write_sass.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
