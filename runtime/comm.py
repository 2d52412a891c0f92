"""Ring communication: one small object that sends to rank+1 and receives from rank-1.

Usage per step:  recv = comm.send_recv(tensors); comm.commit(); <compute>; comm.wait()
It fails loudly on misuse (commit with nothing queued, wait without commit, queueing while
a batch is in flight), so a schedule bug is an exception, not a silent deadlock.
The same code runs on gloo (CPU) and NCCL (GPU): one batched isend/irecv per step.
A dead peer surfaces as the backend's error within the group timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RingComm:
    def __init__(self, group, *, offset: int = 1, members: tuple[int, ...] | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        # `members` (group ranks in ring order, default: the whole group) lets disjoint
        # sub-rings of one group run at once without creating process groups (dilated attention).
        ring = tuple(range(dist.get_world_size(group))) if members is None else tuple(members)
        pos = ring.index(self.rank)
        self.world = len(ring)
        # Global ranks of the ring neighbours (P2POp takes global ranks).
        self.send_to = dist.get_global_rank(group, ring[(pos + offset) % self.world])
        self.recv_from = dist.get_global_rank(group, ring[(pos - offset) % self.world])
        self._ops: list[dist.P2POp] = []
        self._reqs: list | None = None
        self._tag = 0
        self.bytes_sent = 0

    def send_recv(self, tensors, recv_buffers=None) -> list[torch.Tensor]:
        """Queue sending `tensors` to the next rank; returns buffers that will hold the
        previous rank's tensors of the same shapes once `wait()` returns."""
        if self._reqs is not None:
            raise RuntimeError("RingComm.send_recv called while a batch is in flight; call wait() first")
        out = []
        for i, t in enumerate(tensors):
            t = t.contiguous()
            buf = torch.empty_like(t) if recv_buffers is None else recv_buffers[i]
            # Distinct tags keep gloo's matching unambiguous when several tensors go to one peer.
            self._ops.append(dist.P2POp(dist.isend, t, self.send_to, self.group, tag=self._tag))
            self._ops.append(dist.P2POp(dist.irecv, buf, self.recv_from, self.group, tag=self._tag))
            self._tag += 1
            self.bytes_sent += t.numel() * t.element_size()
            out.append(buf)
        return out

    def commit(self) -> None:
        if not self._ops:
            raise RuntimeError("RingComm.commit called with nothing queued")
        if self._reqs is not None:
            raise RuntimeError("RingComm.commit called twice without wait()")
        self._reqs = dist.batch_isend_irecv(self._ops)
        self._ops = []

    def wait(self) -> None:
        if self._reqs is None:
            raise RuntimeError("RingComm.wait called without a committed batch")
        for req in self._reqs:
            req.wait()
        self._reqs = None
        self._tag = 0
