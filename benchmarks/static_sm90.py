"""Static sm_90 numbers of a Triton kernel, on the CPU (no GPU): compile it with the real
Triton compiler for sm_90 and report what ptxas made of it -- registers per thread, spill
(stack) bytes, shared memory, and the SASS instruction count with its most frequent
opcodes (cuobjdump from Triton's bundled CUDA tools). The numbers the kernels' docstrings
quote come from here; timing needs the GPU (benchmarks/).

    TRITON_INTERPRET=0 python -m benchmarks.static_sm90 kernels.attention_decode \\
        --pick 0 --const num_warps=4 --const num_stages=2 [--sass out.sass] [--top 25]

The kernel, signature and constexprs are the module's ``compile_signatures()`` entry
``--pick`` (its compile-check cases); ``--const K=V`` overrides a constexpr or sets a launch
option (num_warps, num_stages, maxnreg). Pointer and stride arguments are declared 16-byte
divisible, as the JIT specialises them at a real launch (without that hint Triton does not
vectorise or pipeline the loads, and the numbers would not be the GPU's).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kernels._triton import programs_per_sm

OPTIONS = ("num_warps", "num_stages", "maxnreg")
#: An sm_90 SM's registers and the shared memory per block the H100/H200 report
#: (``max_num_regs``, ``max_shared_mem``), as kernels._triton.resident_programs reads them.
SM90_LIMITS = (65536, 232448)


def _value(text: str):
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return text


def compile_one(module: str, pick: int, overrides: dict, divisible=()):
    """The compiled kernel (triton CompiledKernel) of compile_signatures()[pick];
    ``divisible``: integer arguments to declare 16-divisible too (as a launch does for a
    value that is, e.g. the insert's ``half`` = 32 at the model shape)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod = importlib.import_module(module)
    kernel, sig, const = mod.compile_signatures()[pick]
    opts = {k: overrides[k] for k in OPTIONS if k in overrides}
    const = {**const, **{k: v for k, v in overrides.items() if k not in OPTIONS}}
    # Pointers and strides (i64 arguments named *_s*, *stride*) get the divisibility hint
    # a launch would give them.
    names = kernel.arg_names
    hint = [i for i, n in enumerate(names)
            if sig.get(n, "").startswith("*") or re.search(r"(_s\d|stride)", n)
            or n in divisible]
    attrs = {(i,): [["tt.divisibility", 16]] for i in hint}
    src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts), const, opts


def cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump")


def report(compiled, top: int, sass_out: str | None, sequence: bool = False) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        res = subprocess.run([cuobjdump(), "-res-usage", cubin], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([cuobjdump(), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout
    if sass_out:
        Path(sass_out).write_text(sass)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    ops = collections.Counter(
        m.group(1).split(".")[0]
        for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass))
    lines = [f"registers {regs.group(1) if regs else '?'}, stack {stack.group(1) if stack else '?'}"
             f" B, shared {compiled.metadata.shared} B, SASS instructions {sum(ops.values())}"]
    if regs:
        per_sm = programs_per_sm(int(regs.group(1)), compiled.metadata.shared,
                                 compiled.metadata.num_warps, *SM90_LIMITS)
        lines.append(f"programs per SM {per_sm} (sm_90: {SM90_LIMITS[0]} registers, "
                     f"{SM90_LIMITS[1]} B shared)")
    lines += [f"  {n:6d} {op}" for op, n in ops.most_common(top)]
    if sequence:
        lines.append(loop_sequence(sass))
    return "\n".join(lines)


#: Opcode classes the loop sequence shows (memory, barriers, tensor, conversion, exp).
SEQUENCE_OPS = ("LDGSTS", "LDGDEPBAR", "DEPBAR", "LDG", "STG", "BAR.SYNC", "HGMMA", "HMMA",
                "LDSM", "STSM", "LDS", "STS", "F2FP", "MUFU.EX2", "SHFL")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS instruction of a cuobjdump listing."""
    return [(int(a, 16), t.strip()) for a, t in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def loop_sequence(sass: str) -> str:
    """The hot loop of the listing (the shortest backward-branch span holding the most
    tensor-core instructions: the block loop, not an outer loop around it) as a run-length
    sequence of SEQUENCE_OPS classes, e.g. ``LDG x33 | BAR.SYNC | LDSM x2``: where the
    loads stand against the barriers and the products (a global load after a ``BAR.SYNC``
    cannot be hoisted above it, so its latency does not overlap the loads before it)."""
    ins = instructions(sass)
    spans = [(int(m.group(1), 16), a) for a, t in ins
             if (m := re.search(r"\bBRA\s+(?:\S+,\s*)?0x([0-9a-f]+)", t))
             and int(m.group(1), 16) < a]
    if not spans:
        return "no loop"

    def mmas(span):
        return sum(span[0] <= a <= span[1] and "MMA" in t for a, t in ins)

    lo, hi = min(spans, key=lambda s: (-mmas(s), s[1] - s[0]))
    runs: list[list] = []
    for a, t in ins:
        op = t.split()[1] if t.startswith("@") else t.split()[0]
        cls = next((c for c in SEQUENCE_OPS if op.startswith(c)), None)
        if lo <= a <= hi and cls:
            if runs and runs[-1][0] == cls:
                runs[-1][1] += 1
            else:
                runs.append([cls, 1])
    body = " | ".join(c if n == 1 else f"{c} x{n}" for c, n in runs)
    return f"loop {lo:#x}..{hi:#x} ({(hi - lo) // 16 + 1} instructions): {body}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module", help="a kernel module with compile_signatures()")
    ap.add_argument("--pick", type=int, default=0, help="index into compile_signatures()")
    ap.add_argument("--const", action="append", default=[], metavar="K=V",
                    help="constexpr override or launch option (num_warps, num_stages, maxnreg)")
    ap.add_argument("--top", type=int, default=20, help="opcodes listed")
    ap.add_argument("--sass", help="also write the SASS listing here")
    ap.add_argument("--sequence", action="store_true",
                    help="also print the hot loop's memory/barrier/MMA sequence (loop_sequence)")
    ap.add_argument("--divisible", action="append", default=[], metavar="ARG",
                    help="an integer argument the launch would find 16-divisible")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("set TRITON_INTERPRET=0: the interpreter does not compile")
    overrides = dict(kv.split("=", 1) for kv in args.const)
    compiled, const, opts = compile_one(args.module, args.pick,
                                        {k: _value(v) for k, v in overrides.items()},
                                        args.divisible)
    print(args.module, args.pick, opts, {k: v for k, v in const.items()})
    print(report(compiled, args.top, args.sass, args.sequence))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
