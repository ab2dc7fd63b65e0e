"""One decode step of a sparse layer through the Triton kernels -- fused insert -> index
decode -> sparse attention decode -- as a server runs it: captured once in a
CUDA graph and replayed with changing inputs, bit-identical to eager launches; with
``validate=False`` the launch path makes no host synchronisation; run to run, the same
inputs give the same bits.

The step: B requests (one padding request, seq_len 0), one new token each at position
seq_len - 1, whose K/V and index_k go into paged caches already holding the prefix (random
content), its q and index_q into fixed buffers; the indexer's selections land in a
token-major buffer the attention reads through its transposed view. Caches are restored
between runs, so every run starts from the same state. Determinism is also checked in the
interpreter (``interp``); graph capture and the sync check need CUDA (``gpu``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from benchmarks import harness
from benchmarks.bench_insert import rope_table

# The interpreter converts 1-element loop bounds with int() (numpy < 2.4 allows it).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

HQ, HKV, D, R, P, K = 8, 2, 128, 64, 16, 4
SEQ = (70, 33, 0, 50)  # the third request is graph padding


@dataclass
class Step:
    rows: torch.Tensor  # [B, row width] bf16, copied in before each run
    positions: torch.Tensor
    slots: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor
    rope: torch.Tensor
    w: dict
    kv: torch.Tensor
    ic: torch.Tensor
    kv0: torch.Tensor  # the caches' starting content
    ic0: torch.Tensor
    q: torch.Tensor  # [B, Hq, D] fused output
    iq: torch.Tensor  # [B, Hi, D] index_q in the index format
    sel: torch.Tensor  # token-major [B, Hi, K]
    out: torch.Tensor  # [B, Hq, D]
    kv_fmt: str
    index_fmt: str
    scale: torch.Tensor | None


def make_step(kv_fmt: str, dev, seed: int = 0) -> Step:
    g = torch.Generator(device=dev).manual_seed(seed)
    b = len(SEQ)
    width = (HQ + 2 * HKV + HKV + 1) * D  # q | k | v | index_q (Hi = Hkv) | index_k
    blocks = -(-max(SEQ) // P)
    table, pool = harness.shuffled_block_table(b, blocks, g, dev)
    seq = torch.tensor(SEQ, dtype=torch.int32, device=dev)
    pos = (seq.long() - 1).clamp(min=0)
    page = table.long().gather(1, (pos // P)[:, None])[:, 0]
    slots = torch.where(seq > 0, page * P + pos % P, -1)
    index_fmt = "bfloat16" if kv_fmt == "bfloat16" else "e4m3fn"
    kv = harness.random_cache((pool, HKV, P, 2 * D), kv_fmt, g, dev)
    ic = harness.random_cache((pool, P, D), index_fmt, g, dev)
    w = {k: (0.3 * torch.randn(D, generator=g, device=dev)).to(torch.bfloat16)
         for k in ("q", "k", "index_q", "index_k")}
    iq_dtype = torch.bfloat16 if index_fmt == "bfloat16" else torch.uint8
    scale = torch.tensor(0.75, dtype=torch.float32, device=dev) if kv_fmt != "bfloat16" \
        else None
    return Step(torch.empty((b, width), dtype=torch.bfloat16, device=dev), pos, slots, table,
                seq, rope_table(max(SEQ), _Shape(), dev), w, kv, ic, kv.clone(), ic.clone(),
                torch.empty((b, HQ, D), dtype=torch.bfloat16, device=dev),
                torch.empty((b, HKV, D), dtype=iq_dtype, device=dev),
                torch.full((b, HKV, K), -1, dtype=torch.int32, device=dev),
                torch.empty((b, HQ, D), dtype=torch.bfloat16, device=dev), kv_fmt, index_fmt,
                scale)


@dataclass(frozen=True)
class _Shape:  # what bench_insert.rope_table reads
    rotary: int = R
    rope_base: float = 1e6


def run_step(s: Step, ws=None, pdl=False) -> None:
    """The three launches, validate=False, into the step's fixed buffers (the two decode
    launches sharing the ``Workspace`` ws, if given, as a server's step would, and launched
    with programmatic dependent launch when ``pdl``)."""
    from kernels.attention_decode import sparse_attention_decode
    from kernels.indexer_decode import indexer_decode
    from kernels.norm_rope_insert import norm_rope_insert

    ins = norm_rope_insert(
        s.rows, s.positions, s.rope, s.w["q"], s.w["k"], num_q_heads=HQ, num_kv_heads=HKV,
        head_dim=D, rotary_dim=R, eps=1e-6, kv_cache=s.kv, kv_fmt=s.kv_fmt,
        slot_mapping=s.slots, num_index_heads=HKV, has_index_k=True,
        w_index_q=s.w["index_q"], w_index_k=s.w["index_k"], k_scale=s.scale,
        v_scale=s.scale, index_cache=s.ic, index_fmt=s.index_fmt, q_out=s.q,
        index_q_out=s.iq if s.index_fmt != "bfloat16" else None)
    if s.index_fmt == "bfloat16":
        s.iq.copy_(ins["index_q"])
    indexer_decode(s.iq, s.ic, s.index_fmt, s.table, s.seq_lens, 1, topk=K,
                   out=s.sel.transpose(0, 1), workspace=ws, pdl=pdl)
    sparse_attention_decode(s.q, s.kv, s.kv_fmt, s.table, s.seq_lens, s.sel.transpose(0, 1),
                            1, s.scale, s.scale, out=s.out, workspace=ws, pdl=pdl)


def results(s: Step) -> dict:
    """Every output of a step, as raw bits."""
    return {name: t.clone().view(torch.uint8) if t.dtype == torch.uint8 else
            t.clone().view(torch.int16) if t.element_size() == 2 else t.clone()
            for name, t in (("q", s.q), ("iq", s.iq), ("sel", s.sel), ("out", s.out),
                            ("kv", s.kv), ("ic", s.ic))}


def eager(s: Step, rows: torch.Tensor, ws=None, pdl=False) -> dict:
    s.kv.copy_(s.kv0)
    s.ic.copy_(s.ic0)
    s.rows.copy_(rows)
    run_step(s, ws, pdl)
    return results(s)


def _equal(a: dict, b: dict):
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def _new_rows(s: Step, seed: int) -> torch.Tensor:
    g = torch.Generator(device=s.rows.device).manual_seed(seed)
    return torch.randn(s.rows.shape, generator=g, device=s.rows.device).to(torch.bfloat16)


@pytest.mark.interp
@pytest.mark.parametrize("kv_fmt", ["bfloat16", "e4m3fn"])
def test_step_is_deterministic_and_selects_real_blocks(kv_fmt):
    """The same inputs give the same bits run to run (caches restored in between); the
    selections are valid (in range of each live row's visible blocks, -1 for padding) and
    the outputs of live rows finite, zero for the padding request."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s = make_step(kv_fmt, dev)
    rows = _new_rows(s, 1)
    first = eager(s, rows)
    _equal(first, eager(s, rows))
    sel = first["sel"].cpu()
    for r, n in enumerate(SEQ):
        if n == 0:
            assert (sel[r] == -1).all() and not s.out[r].any()
        else:
            live = sel[r][sel[r] >= 0]
            assert live.numel() and int(live.max()) <= (n - 1) // P
            assert torch.isfinite(s.out[r].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("workspace,pdl", [(False, False), (True, False), (True, True)],
                         ids=["fresh", "workspace", "workspace-pdl"])
@pytest.mark.parametrize("kv_fmt", ["bfloat16", "e4m3fn"])
def test_graph_replay_is_bit_identical_to_eager_launches(kv_fmt, workspace, pdl):
    """The step captured once in a CUDA graph and replayed with new rows (and the caches
    restored) gives the bits eager launches give, for several inputs; with a
    ``Workspace`` shared by the two decode launches (warmed up eagerly, then captured:
    the counters the replays find must be the zeros the last launch left), and with them
    launched as programmatic dependent launches (each decode kernel may start while the
    one before it finishes, waiting before it touches memory), the bits of plain eager
    launches without a workspace."""
    from kernels._host import Workspace

    s = make_step(kv_fmt, "cuda")
    ws = Workspace() if workspace else None
    inputs = [_new_rows(s, seed) for seed in (1, 2, 3)]
    want = [eager(s, rows) for rows in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager(s, inputs[0], ws, pdl)  # warm-up on the capture stream (compiles, plans)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    s.kv.copy_(s.kv0)
    s.ic.copy_(s.ic0)
    with torch.cuda.graph(graph):
        run_step(s, ws, pdl)
    for rows, w in zip(inputs, want):
        s.kv.copy_(s.kv0)
        s.ic.copy_(s.ic0)
        s.rows.copy_(rows)
        graph.replay()
        torch.cuda.synchronize()
        _equal(w, results(s))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fmt", ["bfloat16", "e4m3fn"])
def test_launch_path_makes_no_host_sync(kv_fmt):
    """With validate=False (the default) the three launchers never synchronise with the
    device (torch's sync debug mode set to raise), after a first call has compiled."""
    s = make_step(kv_fmt, "cuda")
    eager(s, _new_rows(s, 1))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_step(s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
