"""The ring ops' CUDA-graph path (runtime/graphs.py, Note [Ring graphs]): what runs on a CPU.
Its replays are checked against the ring without graphs in tests/test_ring_gpu.py."""

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import ringcc
from ringcc import _compat
from ringcc.runtime import graphs


def test_a_bad_setting_names_the_choices(monkeypatch):
    monkeypatch.setenv("RINGCC_RING_GRAPHS", "sometimes")
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"RINGCC_RING_GRAPHS must be one of auto, on, off; got 'sometimes'"):
        ringcc.ring_attention(q, q, q)


@pytest.mark.parametrize("choice", ["auto", "on"])
def test_cpu_rings_never_capture(monkeypatch, choice):
    monkeypatch.setenv("RINGCC_RING_GRAPHS", choice)
    assert not graphs.wanted(torch.randn(1, 2, 8, 4), None, None, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_destroy_process_group_releases_first(monkeypatch):
    """A live graph holding NCCL kernels makes destroy_process_group hang (pytorch#115388): once
    installed, both spellings of destroy_process_group call the release first."""
    monkeypatch.setattr(c10d, "destroy_process_group", c10d.destroy_process_group)
    monkeypatch.setattr(dist, "destroy_process_group", dist.destroy_process_group)
    calls = []
    _compat.release_before_destroy(lambda: calls.append(dist.is_initialized()))
    _compat.release_before_destroy(lambda: calls.append("second"))
    for destroy in (dist.destroy_process_group, c10d.destroy_process_group):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        destroy()
        assert not dist.is_initialized()
    assert calls == [True, "second", True, "second"]


@pytest.mark.parametrize("transport,device", [("nccl", "cuda"), ("auto", "cpu"), ("copy-engine", "cpu")])
def test_graphs_take_no_receive_area_of_their_own_off_the_copy_engine_ring(monkeypatch, transport, device):
    """A graph gets its own receive area only for the copy-engine ring (Note [Ring graphs]): with
    RINGCC_RING_TRANSPORT=nccl, or off CUDA, it keeps the process group's send/recv, decided
    without a collective or a CUDA call."""
    from ringcc.runtime import comm

    monkeypatch.setenv("RINGCC_RING_TRANSPORT", transport)
    monkeypatch.setattr(comm, "_copy_engine_usable", lambda *a: pytest.fail("asked the group"))
    assert comm.graph_area(object(), torch.device(device)) is None
