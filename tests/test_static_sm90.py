"""benchmarks/static_sm90.py: the CPU-side sm_90 numbers the kernels' docstrings quote
(registers, spill bytes, shared memory, SASS opcode counts) come out of a real compile."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import compile_env

ROOT = Path(__file__).resolve().parents[1]


def _static(tmp_path, *args):
    # No timeout: under load a compile can take minutes; a hang shows as the job's limit.
    r = subprocess.run([sys.executable, "-m", "benchmarks.static_sm90", *args], cwd=ROOT,
                       env=compile_env(tmp_path), capture_output=True, text=True)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip(f"no CUDA compiler toolchain in this Triton install: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.sm90_compile
def test_reports_registers_shared_memory_and_a_sass_histogram(tmp_path):
    """A compile of the fp8 reshape_and_cache kernel prints plausible ptxas numbers
    (registers within the sm_90 limit, no spill), and the opcode histogram sums to no more
    than the SASS total it reports; the listing written with --sass has those opcodes."""
    sass = tmp_path / "k.sass"
    out = _static(tmp_path, "kernels.reshape_and_cache", "--pick", "0", "--const",
                  "num_warps=2", "--top", "5", "--sass", str(sass))
    m = re.search(r"registers (\d+), stack (\d+) B, shared (\d+) B, SASS instructions (\d+)",
                  out)
    assert m, out
    regs, stack, _, total = map(int, m.groups())
    assert 16 <= regs <= 255 and stack == 0 and total > 50
    counts = [(int(n), op) for n, op in re.findall(r"^\s+(\d+) ([A-Z][A-Z0-9_]*)$", out, re.M)]
    assert len(counts) == 5 and sum(n for n, _ in counts) <= total
    assert all(op in sass.read_text() for _, op in counts)


@pytest.mark.sm90_compile
def test_launch_options_change_the_compile(tmp_path):
    """--const num_warps is a launch option, not a constexpr: 4 warps instead of 2 compile
    a different kernel (the same block spread over twice the threads: fewer instructions
    per thread)."""
    def total(out):
        return int(re.search(r"SASS instructions (\d+)", out).group(1))

    two = _static(tmp_path, "kernels.reshape_and_cache", "--pick", "0", "--const", "num_warps=2")
    four = _static(tmp_path, "kernels.reshape_and_cache", "--pick", "0", "--const", "num_warps=4")
    assert total(four) < total(two)


@pytest.mark.sm90_compile
def test_three_stages_fit_the_wide_first_pass_not_its_repair_pass(tmp_path):
    """sm_90, model shape, bf16 cache (kernels.attention_prefill's compile_signatures pick
    5), 8 warps, 3 pipeline stages: the first pass fits the 232,448 B of shared memory per
    block and waits at the top of each block with the next block's two load groups still
    in flight (``DEPBAR.LE SB0, 0x2``: its loads a block ahead; at 2 stages ``0x0``: issued
    at the end of the previous block); the repair pass does not fit: why a given depth is
    the first pass's and the repair pass takes the deepest that fits (``_prefill_pass``)."""
    def shared(out):
        return int(re.search(r"shared (\d+) B", out).group(1))

    limit = 232_448
    base = ["kernels.attention_prefill", "--pick", "5", "--const", "num_warps=8",
            "--const", "num_stages=3"]
    sass = tmp_path / "first.sass"
    first = _static(tmp_path, *base, "--const", "REPAIR=False", "--const", "LISTED=False",
                    "--sass", str(sass))
    assert all(f"'{k}': {v}" in first for k, v in
               (("G_P", 16), ("D", 128), ("P", 128), ("BN", 128), ("FP8", False)))
    assert shared(first) <= limit and "DEPBAR.LE SB0, 0x2" in sass.read_text()
    repair = _static(tmp_path, *base, "--const", "REPAIR=True", "--const", "LISTED=True")
    assert shared(repair) > limit


def test_loop_sequence_finds_the_hot_loop_and_run_lengths():
    """loop_sequence picks the shortest backward-branch span holding the most MMAs (the
    inner loop, not the outer loop around it) and condenses its opcode classes into runs,
    in address order; a listing without a backward branch has no loop."""
    from benchmarks.static_sm90 import loop_sequence

    def line(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;"

    sass = "\n".join([
        line(0x00, "MOV R1, c[0x0][0x28]"),
        line(0x10, "LDG.E R2, desc[UR4][R4.64]"),      # outer loop head
        line(0x20, "LDG.E.128 R8, desc[UR4][R6.64]"),  # inner loop head
        line(0x30, "@P0 LDG.E.128 R12, desc[UR4][R6.64+0x80]"),
        line(0x40, "BAR.SYNC.DEFER_BLOCKING 0x0"),
        line(0x50, "HMMA.16816.F32 R16, R8, R12, R16"),
        line(0x60, "HMMA.16816.F32 R20, R8, R12, R20"),
        line(0x70, "@P1 BRA 0x20"),
        line(0x80, "STG.E desc[UR4][R4.64], R16"),
        line(0x90, "@P2 BRA 0x10"),
        line(0xa0, "EXIT"),
    ])
    assert loop_sequence(sass) == ("loop 0x20..0x70 (6 instructions): LDG x2 | BAR.SYNC | "
                                   "HMMA x2")
    assert loop_sequence(sass.replace("BRA 0x20", "BRA 0xa0").replace("BRA 0x10", "BRA 0xa0")) \
        == "no loop"


@pytest.mark.sm90_compile
def test_the_unpipelined_narrow_tier_heads_its_block_loop_with_k_and_v_loads(tmp_path):
    """sm_90, model shape, e4m3fn cache, the fp8 narrow prefill tier as launched (one
    token, 1 warp, 64-key tiles, 1 stage): the block loop starts with all of K's and V's
    loads (32 vector loads, before the first barrier), nothing ahead of them: the next
    union block and its block-table entry are found one block ahead, after them (otherwise
    each block's chain begins with the entries' min-reduction and the page load that K/V's
    addresses wait for), and with K loaded first Triton converted K's codes
    through shared memory between the two loads, V's loads waiting behind K's data
    (kernels._attention.kv_tiles)."""
    from benchmarks.static_sm90 import loop_sequence

    sass = tmp_path / "narrow.sass"
    out = _static(tmp_path, "kernels.attention_prefill", "--pick", "0", "--const", "TIER=2",
                  "--const", "BLOCK_T=1", "--const", "WIDE_T=8", "--const", "LISTED=True",
                  "--const", "REPAIR=False", "--const", "BN=64", "--const", "num_warps=1",
                  "--const", "num_stages=1", "--sass", str(sass))
    assert all(f"'{k}': {v}" in out for k, v in
               (("G_P", 16), ("D", 128), ("P", 128), ("BN", 64), ("FP8", True)))
    runs = loop_sequence(sass.read_text()).split(": ", 1)[1].split(" | ")

    def count(r):
        return int(r.split(" x")[1]) if " x" in r else 1

    assert runs[0].startswith("LDG") and count(runs[0]) >= 32, runs[:4]
    assert runs.index("BAR.SYNC") > 0
    later = [r for r in runs[1:] if r.startswith("LDG")]
    assert sum(map(count, later)) >= 1, runs  # the next block's page entry


@pytest.mark.sm90_compile
def test_three_stages_double_buffer_k_and_v_with_the_masks_branch(tmp_path):
    """sm_90, model shape, e4m3fn, the narrow prefill tier (one token, G 16), 4 warps,
    64-key tiles, 3 pipeline stages: with the next block's page entry loaded a block ahead
    (a loop-carried value), Triton's pipeliner runs K/V's loads a tile ahead in a second
    buffer (``DEPBAR.LE SB0, 0x2``, shared memory above 2 stages') with the one-token mask
    in a branch inside the block loop (the fully seen tiles skip it). With the page loaded
    in the block's own iteration the branch would keep one K/V buffer, shared memory as at
    2 stages, only the page entry a stage deeper (``DEPBAR.LE SB0, 0x1``)."""
    def shared(out):
        return int(re.search(r"shared (\d+) B", out).group(1))

    base = ["kernels.attention_prefill", "--pick", "0", "--const", "TIER=2", "--const",
            "BLOCK_T=1", "--const", "WIDE_T=8", "--const", "LISTED=True", "--const",
            "REPAIR=False", "--const", "BN=64", "--const", "num_warps=4"]
    two = _static(tmp_path, *base, "--const", "num_stages=2")
    sass = tmp_path / "three.sass"
    three = _static(tmp_path, *base, "--const", "num_stages=3", "--sass", str(sass))
    assert shared(three) - shared(two) > 1024
    assert "DEPBAR.LE SB0, 0x2" in sass.read_text()


@pytest.mark.parametrize("regs, smem, warps, want", [
    (250, 40960, 2, 4),     # the fp8 narrow tier: 256 x 64 registers a program -> 4
    (200, 22528, 2, 5),     # 64-key tiles: registers allow 5
    (140, 55296, 4, 3),     # 4 warps: 144 x 128 registers -> 3 (shared would allow 4)
    (128, 139264, 4, 1),    # shared memory: one 136 KiB program
    (32, 0, 1, 32),         # no shared memory: the 32-block limit
    (32, 1024, 32, 2),      # 64 warps an SM
])
def test_programs_per_sm_takes_the_tightest_limit(regs, smem, warps, want):
    """An SM holds the fewest programs its registers (allocated 8 per thread at a time),
    shared memory, warps and blocks allow (sm_90's limits)."""
    from benchmarks.static_sm90 import SM90_LIMITS
    from kernels._triton import programs_per_sm

    assert programs_per_sm(regs, smem, warps, *SM90_LIMITS) == want
