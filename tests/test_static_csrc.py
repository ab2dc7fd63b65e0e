"""benchmarks/static_csrc.py: SASS attributed to source lines through inlining chains."""

from __future__ import annotations

from benchmarks import static_csrc as sc

LISTING = """\
//--------------------- .text._Z1kv --------------------------
\t//## File "/x/csrc/a.cuh", line 10 inlined at "/x/csrc/k.cuh", line 50
\t//## File "/x/csrc/k.cuh", line 50
        /*0000*/                   IMAD R1, R2, R3, RZ ;
        /*0010*/              @!P0 LDG.E R4, desc[UR4][R2.64] ;
\t//## File "/x/csrc/k.cuh", line 60
        /*0020*/                   STG.E desc[UR4][R2.64], R4 ;
\t//## File "/x/csrc/k.cuh", line 70
        /*0030*/                   EXIT ;
//--------------------- .text._Z1jv --------------------------
\t//## File "/x/csrc/a.cuh", line 10 inlined at "/x/csrc/k.cuh", line 52
\t//## File "/x/csrc/k.cuh", line 52
        /*0000*/                   SHFL.BFLY PT, R1, R2, 0x1, 0x1f ;
"""


def test_instructions_carry_their_whole_inlining_chain():
    """Each instruction is attributed to every frame of the annotation block above it
    (the helper's line and the caller's), and an annotation block replaces the last."""
    k = sc.parse(LISTING)
    assert set(k) == {"_Z1kv", "_Z1jv"}
    assert [(a, op) for a, op, _ in k["_Z1kv"]] == [(0, "IMAD"), (16, "LDG"), (32, "STG"),
                                                     (48, "EXIT")]
    assert k["_Z1kv"][1][2] == (("a.cuh", 10), ("k.cuh", 50))
    assert k["_Z1kv"][2][2] == (("k.cuh", 60),)


def test_a_range_counts_what_is_inlined_into_its_lines_per_code_region():
    """A range of the caller's lines counts the helper's instructions inlined there; code
    far apart (another instantiation of the same lines) is a region of its own."""
    insns = sc.parse(LISTING)["_Z1kv"]
    regs = sc.regions(insns, ("k.cuh", 50, 60))
    assert len(regs) == 1 and sc.summary(regs[0]) == "3 instructions (LDG=1 STG=1)"
    far = insns[:2] + [(0x40, "NOP", ())] * 3 + [(0x90, "STG", (("k.cuh", 60),))]
    assert [len(r) for r in sc.regions(far, ("k.cuh", 50, 60), gap=2)] == [2, 1]
    assert [len(r) for r in sc.regions(far, ("k.cuh", 50, 60), gap=4)] == [3]
    assert sc.regions(insns, ("a.cuh", 11, 20)) == []
    assert sc.top_lines(insns, ("k.cuh", 50, 70), 2) == ["    k.cuh:50 2", "    k.cuh:60 1"]
