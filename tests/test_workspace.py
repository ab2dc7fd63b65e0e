"""kernels._host.Workspace: the decode kernels' scratch kept across calls (the kernels'
own use of it is tested in test_kernel_indexer.py and test_kernel_attention_decode.py)."""

from __future__ import annotations

import pytest
import torch

from kernels._host import Workspace, check_workspace, take_counters, take_scratch


def test_counters_start_zero_and_a_larger_request_replaces_them_with_zeros():
    """Counters are zero when made; a request within the buffer returns a view of the same
    memory (what a kernel left there stays: the kernels keep it zero); a larger request
    makes a new zeroed buffer; ``held`` shows the buffer without growing it."""
    ws = Workspace()
    assert ws.held("counters", "cpu") is None
    c = ws.counters(4, "cpu")
    assert c.dtype == torch.int32 and c.shape == (4,) and not c.any()
    c[1] = 7
    again = ws.counters(3, "cpu")
    assert again.data_ptr() == c.data_ptr() and again[1] == 7
    grown = ws.counters(9, "cpu")
    assert grown.shape == (9,) and not grown.any() and grown.data_ptr() != c.data_ptr()
    assert ws.held("counters", "cpu").numel() == 9
    assert ws.held("counters", "cpu").data_ptr() == grown.data_ptr()


def test_scratch_buffers_are_views_by_name():
    """Scratch of one name is one buffer viewed in the shape asked for (reused when it
    fits); two names never share memory."""
    ws = Workspace()
    a = ws.scratch("part", (2, 3, 4), torch.float32, "cpu")
    b = ws.scratch("lse", (2, 3), torch.float32, "cpu")
    assert a.shape == (2, 3, 4) and b.shape == (2, 3)
    assert a.data_ptr() != b.data_ptr()
    assert ws.scratch("part", (3, 4), torch.float32, "cpu").data_ptr() == a.data_ptr()
    assert ws.scratch("part", (5, 5), torch.float32, "cpu").numel() == 25


def test_without_a_workspace_every_call_gets_fresh_buffers():
    """``take_counters`` / ``take_scratch`` with None: new zeroed counters and new scratch
    each time (the launchers' default)."""
    a, b = take_counters(None, 3, "cpu"), take_counters(None, 3, "cpu")
    assert not a.any() and a.data_ptr() != b.data_ptr()
    assert take_scratch(None, "x", (2, 2), torch.int64, "cpu").shape == (2, 2)


def test_a_workspace_of_the_wrong_type_is_refused_by_name():
    with pytest.raises(ValueError, match="^workspace must be None or a kernels._host.Workspace"):
        check_workspace({"counters": None})
    assert check_workspace(None) is None


def test_check_counters_names_the_workspace_when_a_counter_is_left_set():
    """A counter left non-zero (a launch that died, or two launches at once on one
    workspace) is reported by ``check_counters`` (the launchers' ``validate=True``) as a
    ValueError naming ``workspace`` and the counter; zero counters pass."""
    ws = Workspace()
    ws.counters(6, "cpu")
    ws.check_counters()
    ws.counters(6, "cpu")[4] = 2
    with pytest.raises(ValueError, match="^workspace must hold zero ticket counters.* 2 at "
                                         "counter 4"):
        ws.check_counters()


def test_held_finds_a_cuda_buffer_by_the_bare_device_name(monkeypatch):
    """A launcher keys its buffers by its tensors' device ("cuda:0"); a caller asking
    ``held`` for "cuda" (what ``torch.device("cuda")`` names: the current device) gets that
    buffer, and a buffer taken for "cuda" is the one a launch on "cuda:0" reuses (compiled on
    a GPU, ``held`` with "cuda" once returned None). Checked without a GPU: the buffer is
    placed by hand."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    ws = Workspace()
    buf = torch.zeros(4, dtype=torch.int32)
    ws._bufs[("counters", torch.int32, torch.device("cuda", 0))] = buf
    assert ws.held("counters", "cuda") is buf
    assert ws.held("counters", torch.device("cuda", 0)) is buf
    assert ws.held("counters", "cuda:1") is None
    assert Workspace.device_key("cuda") == Workspace.device_key("cuda:0")
    assert Workspace.device_key("cpu") == torch.device("cpu")
