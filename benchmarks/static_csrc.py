"""Static sm_90 numbers of a csrc/ CUDA translation unit, on the CPU (no GPU): nvcc compiles
it for sm_90 with line info, ptxas reports registers and spills per kernel, and the SASS
(nvdisasm from Triton's bundled CUDA tools, with its inlining chains) is attributed to
source lines. A ``--range FILE:A-B`` counts the instructions whose inlining chain passes
through those lines (e.g. a loop's body: every helper inlined into it counts), split into
the contiguous code regions they occupy, since each template instantiation of the same
lines (variant 5's aligned and general loops) is a region of its own. Timing needs the GPU
(benchmarks/); this is what the static counts in csrc/README and the A/B notes come from.

    python -m benchmarks.static_csrc csrc/nri_split_bf16_d128.cu \\
        --kernel 'Lb1EE' --range nri_persist.cuh:240-275 [--lines 15]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kernels import cuda_build

FLAGS = (*cuda_build.NVCC_FLAGS, "-lineinfo")  # the library's build, plus line info
_FRAME = re.compile(r'(?:File|inlined at) "([^"]+)", line (\d+)')
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_SECTION = re.compile(r"^//-+ \.text\.(\S+) -+")
MEMORY_OPS = ("LDG", "STG", "LDL", "STL", "LDS", "STS", "SHFL")


def nvdisasm() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm")


def compile_unit(source: Path, out: Path) -> str:
    """nvcc -cubin of ``source`` into ``out``; ptxas' -v report (registers, spills)."""
    nvcc = cuda_build.find_nvcc()
    if nvcc is None:
        raise SystemExit("nvcc not found (PATH, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda/bin)")
    res = subprocess.run([nvcc, *FLAGS, "-cubin", "-Xptxas", "-v", f"-I{cuda_build.CSRC}",
                          str(source), "-o", str(out)], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"nvcc failed:\n{res.stderr[-3000:]}")
    return res.stderr


def parse(listing: str) -> dict[str, list[tuple[int, str, tuple]]]:
    """Kernel (mangled name) -> its instructions as (address, opcode, frames): frames the
    (file name, line) of each level of the inlining chain annotated above it."""
    kernels: dict[str, list] = {}
    cur, frames, fresh = None, [], False
    for line in listing.splitlines():
        m = _SECTION.match(line)
        if m:
            cur = kernels.setdefault(m.group(1), [])
            frames, fresh = [], False
            continue
        if line.lstrip().startswith("//##"):
            if not fresh:  # a new annotation block replaces the previous chain
                frames, fresh = [], True
            frames += [fr for fr in ((Path(f).name, int(n)) for f, n in _FRAME.findall(line))
                       if fr not in frames]
            continue
        m = _INSN.search(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2).split(".")[0], tuple(frames)))
            fresh = False
    return kernels


def spec_range(text: str) -> tuple[str, int, int]:
    m = re.fullmatch(r"([\w.]+):(\d+)-(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--range must be FILE:A-B, got {text!r}")
    return m.group(1), int(m.group(2)), int(m.group(3))


def regions(insns, rng, gap: int = 64) -> list[list[tuple[int, str, tuple]]]:
    """The instructions whose chain passes through ``rng`` (file, first, last line), in
    contiguous regions (runs that other code interrupts for fewer than ``gap``
    instructions are joined)."""
    name, a, b = rng
    hit = [i for i, (_, _, fr) in enumerate(insns)
           if any(f == name and a <= n <= b for f, n in fr)]
    out, last = [], None
    for i in hit:
        if last is None or i - last > gap:
            out.append([])
        out[-1].append(insns[i])
        last = i
    return out


def summary(insns) -> str:
    ops = collections.Counter(op for _, op, _ in insns)
    mem = " ".join(f"{k}={ops[k]}" for k in MEMORY_OPS if ops[k])
    return f"{len(insns)} instructions ({mem})"


def top_lines(insns, rng, n: int) -> list[str]:
    """The lines of ``rng``'s file inside the range that most instructions come from (the
    innermost frame of the chain inside the range)."""
    name, a, b = rng
    c = collections.Counter()
    for _, _, fr in insns:
        inside = [ln for f, ln in fr if f == name and a <= ln <= b]
        if inside:
            c[inside[0]] += 1
    return [f"    {name}:{ln} {k}" for ln, k in c.most_common(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="a csrc/ .cu translation unit")
    ap.add_argument("--kernel", default="", help="regex over the kernels' mangled names")
    ap.add_argument("--range", type=spec_range, action="append", default=[],
                    metavar="FILE:A-B", help="source lines to count (repeatable)")
    ap.add_argument("--lines", type=int, default=0, help="top source lines per region")
    ap.add_argument("--sass", type=Path, help="also write the annotated listing here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "unit.cubin"
        ptxas = compile_unit(args.source, cubin)
        listing = subprocess.run([nvdisasm(), "-gi", "-c", str(cubin)], capture_output=True,
                                 text=True, check=True).stdout
    if args.sass:
        args.sass.write_text(listing)
    usage = dict(re.findall(r"Compiling entry function '(\S+)'.*?\n(.*?Used \d+ registers)",
                            ptxas, re.S))
    for name, insns in parse(listing).items():
        if not re.search(args.kernel, name):
            continue
        regs = re.search(r"Used (\d+) registers", usage.get(name, ""))
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                          usage.get(name, ""))
        print(f"{name}: {regs.group(1) if regs else '?'} registers, spill "
              f"{spill.group(1) + ' / ' + spill.group(2) if spill else '?'} B, "
              f"{summary(insns)}")
        for rng in args.range:
            for k, reg in enumerate(regions(insns, rng)):
                print(f"  {rng[0]}:{rng[1]}-{rng[2]} region {k} at 0x{reg[0][0]:x}: "
                      f"{summary(reg)}")
                if args.lines:
                    print("\n".join(top_lines(reg, rng, args.lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
