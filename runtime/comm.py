"""Ring communication: one small object that sends to rank+1 and receives from rank-1.

Usage per step:  recv = comm.send_recv(tensors); comm.commit(); <compute>; comm.wait()
It fails loudly on misuse (commit with nothing queued, wait without commit, queueing while
a batch is in flight), so a schedule bug is an exception, not a silent deadlock.

Two transports (`ring_comm` picks one; RINGCC_RING_TRANSPORT=auto|nccl|copy-engine):
- RingComm: one batched isend/irecv per step through the process group (gloo on CPU, NCCL on
  GPU). A dead peer surfaces as the backend's error within the group timeout.
- CopyEngineRing (CUDA, whole-group rings): each rank pushes the batch into the next rank's
  receive area with peer copies (the GPU's copy engines over NVLink/PCIe: no SMs, so the
  transfer runs beside the attention kernels instead of waiting for SMs they hold) and
  signals it with stream memory operations (no kernel either). See Note [Copy-engine ring].
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
import weakref

import torch
import torch.distributed as dist

from ringcc import _compat
from . import merge


# Config(timeout=...) per group, for the ring's point-to-point waits: gloo's send/recv keep the
# timeout the group was created with when `_set_pg_timeout` changes it for collectives.
_WAIT_TIMEOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_timeout(group, timeout) -> None:
    """Make `timeout` (a timedelta) the bound of every later wait on `group` (None = WORLD):
    its collectives (the group's own timeout) and the rings' transfers (Config.timeout)."""
    group = dist.group.WORLD if group is None else group
    _compat.set_group_timeout(group, timeout)
    _WAIT_TIMEOUTS[group] = timeout


class RingComm:
    borrows_buffers = False  # received tensors are fresh allocations the caller owns

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
        self._reqs: list | None = None  # the batch in flight
        self._tag = 0
        self.bytes_sent = 0

    def send_recv(self, tensors, recv_buffers=None) -> list[torch.Tensor]:
        """Queue sending `tensors` to the next rank; returns buffers that will hold the
        previous rank's tensors of the same shapes once `wait()` returns."""
        if self._reqs is not None:
            raise RuntimeError("RingComm.send_recv called while a batch is in flight; call wait() first")
        out = []
        for i, t in enumerate(tensors):
            t = merge.contiguous(t)
            buf = torch.empty_like(t) if recv_buffers is None else recv_buffers[i]
            # Distinct tags keep gloo's matching unambiguous when several tensors go to one peer.
            self._ops.append(dist.P2POp(dist.isend, t, self.send_to, self.group, tag=self._tag))
            self._ops.append(dist.P2POp(dist.irecv, buf, self.recv_from, self.group, tag=self._tag))
            self._tag += 1
            if not _capturing():  # (a graph's capture sends nothing; its replays are not counted)
                self.bytes_sent += t.numel() * t.element_size()
            out.append(buf)
        return out

    def reserve(self, nbytes: list[int]) -> None:
        """Nothing to size: receive buffers are allocated per batch."""

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
        # A wait with a timeout polls from the host, which a CUDA graph capture cannot hold.
        timeout = None if _capturing() else _WAIT_TIMEOUTS.get(self.group)
        for req in self._reqs:
            req.wait() if timeout is None else req.wait(timeout)
        self._reqs = None
        self._tag = 0


# Note [Copy-engine ring]
# Each rank owns a symmetric receive area (torch symmetric memory: every rank maps every
# other rank's area) of a header and two slots; batch number j (counted per area, the same
# on every rank since all ranks run the same schedule) lands in slot j % 2. Two flag words
# in each header, written by neighbours with cuStreamWriteValue32 and waited on with
# cuStreamWaitValue32 (GPU-side, no kernel, no host round trip):
#   READY  set by rank-1 to j once batch j is in our slot (after its copies, fenced);
#   FREE   set by rank+1 to j once we may write batch j into its slot.
# commit(j) on the side stream: wait for the compute issued so far (it made the tensors sent
# and finished with our slot j % 2, which held batch j-2: read by the step before, forwarded
# by batch j-1); write FREE=j into rank-1; wait for our FREE >= j, then set it back to 0; copy
# into rank+1's slot; write READY=j into rank+1. wait(j) on the compute stream: READY >= j,
# then set it back to 0, then the side stream (our copies have read their sources, so the
# allocator may reuse them).
# A flag is consumed (set back to 0) by the one who waited on it, before anything that lets a
# neighbour write it again: rank+1 writes FREE=j+1 only after its wait for our READY=j, which
# we write after consuming FREE=j; rank-1 writes READY=j+1 only after our FREE=j+1, which our
# commit(j+1) writes after our wait(j). So a flag holds 0 between batches, and a wait compares
# with a batch number that the flag reaches only when that batch is signalled. That is what a
# CUDA graph needs: its replays wait for and write the batch numbers of its capture, again and
# again, in a receive area of its own (`OwnArea`, Note [Ring graphs] in graphs.py).
# Received tensors are views of the slot: valid until batch j+2 is committed, so a caller
# that keeps one longer copies it (`borrows_buffers`).
# The copy engines are shared: a same-dtype copy on the kernels' stream is a memcpy too, and
# may wait behind these peer copies; the ring makes its own copies with kernels
# (`merge.copy_by_kernel`, measured there).


class _Mailbox:
    """One rank's receive area for a whole-group ring on one device, and its neighbours'."""

    HEADER = 4096
    READY, FREE = 0, 16  # u32 word indices in the header

    def __init__(self, group, device: torch.device, slot_bytes: int):
        symm = _compat.symmetric_memory()
        ((lo, hi),) = group_extremes([slot_bytes], group, device)
        if lo != slot_bytes or hi != slot_bytes:
            raise RuntimeError(f"copy-engine ring: ranks asked for receive slots of {lo} to {hi} bytes "
                               f"(this rank {slot_bytes}); every rank must run the same schedule")
        self.group, self.device, self.slot_bytes = group, device, slot_bytes
        before = torch.cuda.memory_allocated(device)
        self.buf = symm.empty(self.HEADER + 2 * slot_bytes, dtype=torch.uint8, device=device)
        # Some torch versions serve symmetric memory from a pool of the caching allocator (then
        # memory_allocated counts it); others map it outside. Measured here, not assumed.
        self.outside_allocator = torch.cuda.memory_allocated(device) - before < self.buf.numel()
        self.buf.zero_()
        self.handle = _compat.symm_rendezvous(self.buf, group)
        rank, world = self.handle.rank, self.handle.world_size
        size = (self.buf.numel(),)
        self.next_buf = self.handle.get_buffer((rank + 1) % world, size, torch.uint8, 0)
        prev_buf = self.handle.get_buffer((rank - 1) % world, size, torch.uint8, 0)
        base = self.buf.data_ptr()
        self.ready_addr, self.free_addr = base + 4 * self.READY, base + 4 * self.FREE
        self.next_ready_addr = self.next_buf.data_ptr() + 4 * self.READY
        self.prev_free_addr = prev_buf.data_ptr() + 4 * self.FREE
        self._prev_buf = prev_buf
        self.next_ptr = self.next_buf.data_ptr()
        self.stream = torch.cuda.Stream(device=device)
        self.side = self.stream.cuda_stream  # raw handles for the driver calls
        self.driver = _compat.CudaDriver()
        with torch.cuda.device(device):
            self.to_side, self.to_compute = self.driver.event(), self.driver.event()
        self.seq = 0
        self.last_stream = None  # the compute stream of the last wait(): the next commit orders after it too
        self._layouts: dict = {}
        torch.cuda.synchronize(device)
        _barrier(group, device)  # every area is zeroed before any neighbour writes a flag

    def quiesce(self) -> None:
        """Returns once no copy into or out of this area is in flight on any rank (collective),
        so it may be freed."""
        torch.cuda.synchronize(self.device)  # our copies into the neighbours' areas are done
        _barrier(self.group, self.device)  # and theirs into ours

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def layout(self, slot: int, key: tuple) -> tuple[list[torch.Tensor], list[int]]:
        """(views of slot `slot` for a batch of tensors of `key` = ((dtype, shape), ...),
        their byte offsets in the slot), made once per slot and key."""
        got = self._layouts.get((slot, key))
        if got is None:
            if len(self._layouts) >= 64:  # shapes come and go (other models, lengths): keep a few
                self._layouts.clear()
            views, offsets, off = [], [], 0
            base = self.HEADER + slot * self.slot_bytes
            for dtype, shape in key:
                nbytes = math.prod(shape) * dtype.itemsize
                views.append(self.buf[base + off:base + off + nbytes].view(dtype).view(shape))
                offsets.append(off)
                off += _align(nbytes)
            got = self._layouts[(slot, key)] = (views, offsets)
        return got


# Keyed by the group object, not its name: names come back after destroy_process_group.
# _CE_USABLE and _WARNED hold their groups weakly (ops._SETUPS says why); a receive area
# holds its group until release_comm_buffers().
_MAILBOXES: dict[tuple[object, int], _Mailbox] = {}
_CE_USABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> True, or why not


def group_extremes(values: list, group, device) -> list[tuple[int, int]]:
    """(min, max) over the ranks of `group` of each of `values`, in one all_reduce: the ranks
    agree on a value exactly when both equal this rank's. A value is an int, or a 0-d int64
    tensor on `device` (a checksum computed there: read after the collective, in its one copy
    to the host)."""
    t = torch.tensor([v if isinstance(v, int) else 0 for v in values], dtype=torch.int64, device=device)
    computed = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if computed:
        t[computed] = torch.stack([values[i] for i in computed])
    t = torch.cat([t, -t])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    got = t.tolist()  # one device-to-host copy
    k = len(values)
    return [(-got[k + i], got[i]) for i in range(k)]


def _align(nbytes: int) -> int:
    return (nbytes + 255) // 256 * 256


def _barrier(group, device: torch.device) -> None:
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def _mailbox(group, device: torch.device, slot_bytes: int) -> _Mailbox:
    """The receive area of this rank for `group` with slots of at least `slot_bytes`; grown
    (collectively: every rank asks for the same size at the same batch) when too small."""
    key = (group, device.index)
    box = _MAILBOXES.get(key)
    if box is not None and box.slot_bytes >= slot_bytes:
        return box
    if box is not None:
        box.quiesce()
        del _MAILBOXES[key], box
    box = _MAILBOXES[key] = _Mailbox(group, device, slot_bytes)
    return box


def _cuda_index(device: torch.device) -> int:
    """The CUDA device index of `device`; "cuda" without one is the current device."""
    return torch.cuda.current_device() if device.index is None else device.index


def comm_buffer_bytes(device: torch.device | None = None) -> int:
    """Bytes of copy-engine receive areas on `device` (all devices: None) that torch's caching
    allocator does not count (memory measurements add them); 0 where the areas come from an
    allocator pool, which memory_allocated already sees."""
    idx = None if device is None or device.type != "cuda" else _cuda_index(device)
    if device is not None and idx is None:
        return 0  # no receive areas off CUDA
    shared = sum(b.nbytes for (_, i), b in _MAILBOXES.items() if b.outside_allocator and (idx is None or i == idx))
    own = sum(a.nbytes for a in list(_OWN_AREAS) if idx is None or _cuda_index(a.device) == idx)
    return shared + own


def transport_info(group, device: torch.device) -> dict:
    """What the rings over `group` on `device` have used so far, for measurements: the transport
    ("copy-engine" once it made a receive area, else "process group"), why copy engines were
    unusable where that was decided, and the area's bytes and whether the caching allocator
    counts them (then memory_allocated() before a step already includes the area)."""
    box = _MAILBOXES.get((group, _cuda_index(device))) if device.type == "cuda" else None
    usable = _CE_USABLE.get(group)
    return {"transport": "copy-engine" if box is not None else "process group",
            "copy_engine_unusable": usable if isinstance(usable, str) else None,
            "area_bytes": box.nbytes if box is not None else 0,
            "area_counted_by_allocator": box is not None and not box.outside_allocator}


def release_comm_buffers() -> None:
    """Free the copy-engine receive areas (collective over each area's group: call it on every
    rank, with no ring in flight). The next ring allocates them again."""
    for box in list(_MAILBOXES.values()):
        box.quiesce()
    _MAILBOXES.clear()


class CopyEngineRing:
    """RingComm's interface over peer copies and stream flags (Note [Copy-engine ring])."""

    borrows_buffers = True

    def __init__(self, group, device: torch.device, area: "OwnArea | None" = None):
        self.group, self.device = group, device
        self._area = area  # a captured ring op's own receive area (None: the group's, `_mailbox`)
        self.bytes_sent = 0
        self._queued = None
        self._inflight = None
        # Benchmark switches, never for real results: RINGCC_SKIP_COMM=payload: every flag and
        # stream order as usual, no copies (the receivers compute on stale slots), to time the
        # handshake apart from the copies beside the kernels; =half-grads: the first half of each
        # fp32 tensor only (the dK/dV accumulators; K/V whole, so the kernels read real data),
        # to time the ring with a third fewer backward bytes.
        mode = os.environ.get("RINGCC_SKIP_COMM", "0")
        self._payload, self._half_fp32 = mode != "payload", mode == "half-grads"

    def reserve(self, nbytes: list[int]) -> None:
        """Size the receive area for batches of tensors of these byte sizes now (collective),
        so that it does not grow in the middle of a ring."""
        self._box(sum(_align(n) for n in nbytes))

    def _box(self, slot_bytes: int) -> "_Mailbox":
        if self._area is not None:
            return self._area.get(slot_bytes)
        return _mailbox(self.group, self.device, slot_bytes)

    def send_recv(self, tensors, recv_buffers=None) -> list[torch.Tensor]:
        if recv_buffers is not None:
            raise ValueError("CopyEngineRing receives into its own areas; recv_buffers is not supported")
        if self._queued is not None or self._inflight is not None:
            raise RuntimeError("CopyEngineRing.send_recv called while a batch is queued or in flight; call wait() first")
        tensors = [merge.contiguous(t) for t in tensors]
        key = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        box = self._box(sum(_align(t.nbytes) for t in tensors))
        seq = box.seq + 1
        views, offsets = box.layout(seq % 2, key)
        if not _capturing():  # (as RingComm: a capture sends nothing; replays are not counted)
            self.bytes_sent += sum(t.nbytes for t in tensors)
        self._queued = (box, seq, tensors, offsets)
        return list(views)

    def commit(self) -> None:
        if self._queued is None or not self._queued[2]:
            raise RuntimeError("CopyEngineRing.commit called with nothing queued")
        box, seq, tensors, offsets = self._queued
        d, side = box.driver, box.side
        # The driver calls take raw stream handles: 0, the default stream, means the current
        # device's, so the device is made current for them.
        with _compat.on_device(self.device):
            compute = _compat.current_raw_stream(self.device)
            d.order(side, compute, box.to_side)
            if box.last_stream is not None and box.last_stream != compute:
                d.order(side, box.last_stream, box.to_side)  # a ring before this one ran on another stream
            d.write(side, box.prev_free_addr, seq)
            d.wait_geq(side, box.free_addr, seq)
            d.write(side, box.free_addr, 0)  # consumed (Note [Copy-engine ring])
            base = box.next_ptr + box.HEADER + (seq % 2) * box.slot_bytes
            for t, off in zip(tensors, offsets):
                nbytes = t.nbytes // 2 if self._half_fp32 and t.dtype == torch.float32 else t.nbytes
                if nbytes and self._payload:
                    d.copy(side, base + off, t.data_ptr(), nbytes)
            d.write(side, box.next_ready_addr, seq)
        box.seq = seq
        # The sources stay referenced until wait() orders the compute stream after the copies:
        # send_recv's contiguous copies have no other owner, and the allocator would hand their
        # memory to the next kernels while the copies still read it.
        self._queued, self._inflight = None, (box, seq, tensors)

    def wait(self) -> None:
        if self._inflight is None:
            raise RuntimeError("CopyEngineRing.wait called without a committed batch")
        box, seq, _sources = self._inflight
        with _compat.on_device(self.device):
            compute = _compat.current_raw_stream(self.device)
            box.driver.wait_geq(compute, box.ready_addr, seq)
            box.driver.write(compute, box.ready_addr, 0)  # consumed (Note [Copy-engine ring])
            box.driver.order(compute, box.side, box.to_compute)
        box.last_stream = compute
        self._inflight = None


TRANSPORTS = ("auto", "nccl", "copy-engine")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class OwnArea:
    """The receive area of one captured ring op (Note [Ring graphs] in graphs.py): a graph bakes
    in the area's addresses and batch numbers, so no other ring may use it or grow it. Sized by
    the op's eager run before the capture (collective, like `_mailbox`); under capture it must
    already fit."""

    def __init__(self, group, device: torch.device):
        self.group, self.device, self.box = group, device, None
        _OWN_AREAS.add(self)

    def get(self, slot_bytes: int) -> _Mailbox:
        if self.box is not None and self.box.slot_bytes >= slot_bytes:
            return self.box
        if _capturing():
            have = 0 if self.box is None else self.box.slot_bytes
            raise RuntimeError(f"ringcc: a captured ring op asked for receive slots of {slot_bytes} bytes; its eager run "
                               f"sized them at {have}. Set RINGCC_RING_GRAPHS=off on every rank to run it without graphs")
        self.release()
        self.box = _Mailbox(self.group, self.device, slot_bytes)
        return self.box

    def before_capture(self) -> None:
        """The eager run is done: the capture's first commit orders after nothing outside it."""
        torch.cuda.synchronize(self.device)
        if self.box is not None:
            self.box.last_stream = None

    def release(self) -> None:
        """Free the area (collective: every rank at the same call, as graphs are dropped)."""
        if self.box is not None:
            self.box.quiesce()
            self.box = None

    @property
    def nbytes(self) -> int:
        return 0 if self.box is None or not self.box.outside_allocator else self.box.nbytes


_OWN_AREAS: weakref.WeakSet = weakref.WeakSet()
_FORCE_PROCESS_GROUP = [False]
_GRAPH_AREA: list = [None]


@contextlib.contextmanager
def graph_transport(area: OwnArea | None):
    """Rings made inside run as a CUDA graph can hold them (Note [Ring graphs] in graphs.py):
    the copy-engine ring in `area`, or with no area the process group's send/recv."""
    before = _FORCE_PROCESS_GROUP[0], _GRAPH_AREA[0]
    _FORCE_PROCESS_GROUP[0], _GRAPH_AREA[0] = area is None, area
    try:
        yield
    finally:
        _FORCE_PROCESS_GROUP[0], _GRAPH_AREA[0] = before


def graph_area(group, device: torch.device) -> OwnArea | None:
    """A receive area for a captured ring op over `group` when the copy-engine ring may carry it
    (the setting allows it and every rank can run it: collective on first use), else None (as
    ring_comm decides: `_copy_engine`)."""
    setting = transport_setting()
    if device.type != "cuda" or setting == "nccl":
        return None
    return OwnArea(group, device) if _copy_engine(group, device, setting) else None


def transport_setting() -> str:
    raw = os.environ.get("RINGCC_RING_TRANSPORT", "auto").strip().lower() or "auto"
    if raw not in TRANSPORTS:
        raise ValueError(f"RINGCC_RING_TRANSPORT must be one of {', '.join(TRANSPORTS)}; got {raw!r}")
    return raw


def _copy_engine_usable(group, device: torch.device) -> bool | str:
    """True when every rank of `group` can run the copy-engine ring on `device`, else why not
    (decided once per group, the same on every rank)."""
    if group in _CE_USABLE:
        return _CE_USABLE[group]
    why = None
    if _compat.symmetric_memory() is None:
        why = "this torch build has no symmetric memory"
    else:
        try:  # the stream memory operations, on this rank alone, before any rank commits
            driver, word = _compat.CudaDriver(), torch.zeros(1, dtype=torch.int32, device=device)
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream(device)
                driver.write(stream.cuda_stream, word.data_ptr(), 1)
                driver.wait_geq(stream.cuda_stream, word.data_ptr(), 1)
            torch.cuda.synchronize(device)
            if int(word.item()) != 1:
                why = "a CUDA stream memory write did not land"
        except (OSError, AttributeError, RuntimeError) as e:
            why = f"CUDA driver stream memory operations unavailable ({e})"
    ok = torch.tensor([0 if why else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if why is None and int(ok.item()) == 1:
        try:
            _mailbox(group, device, 1 << 20)
        except Exception as e:  # noqa: BLE001 - any failure here means: use the process group
            why = f"symmetric memory setup failed ({type(e).__name__}: {e})"
        ok.fill_(0 if why else 1)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if why is None and int(ok.item()) == 0:
        why = "another rank cannot use it"
    _CE_USABLE[group] = True if why is None else why
    return _CE_USABLE[group]


def ring_comm(group, members, device: torch.device):
    """The transport for a ring over `group` (see the module docstring): copy engines for a
    whole-group ring of CUDA tensors where symmetric memory works (RINGCC_RING_TRANSPORT=auto,
    the default, falls back to the process group with a warning; =copy-engine raises instead),
    else RingComm."""
    setting = transport_setting()
    if device.type == "cuda" and members is None and _GRAPH_AREA[0] is not None:
        return CopyEngineRing(group, device, _GRAPH_AREA[0])  # a ring op being captured, in its own area
    if device.type == "cuda" and (torch.cuda.is_current_stream_capturing() or _FORCE_PROCESS_GROUP[0]):
        # A capture of the caller's: the group's area would be baked into the graph, which
        # other rings use and may grow. NCCL send/recv, which CUDA graphs capture, instead.
        if setting == "copy-engine":
            raise RuntimeError("RINGCC_RING_TRANSPORT=copy-engine cannot run under a CUDA graph capture of the "
                               "caller's; use auto or nccl")
        return RingComm(group, members=members)
    if setting == "nccl" or device.type != "cuda" or members is not None:
        if setting == "copy-engine" and (device.type != "cuda" or members is not None):
            raise ValueError("RINGCC_RING_TRANSPORT=copy-engine needs CUDA tensors and a whole-group ring; "
                             f"got device {device} and ring members {members}; use auto or nccl")
        return RingComm(group, members=members)
    return CopyEngineRing(group, device) if _copy_engine(group, device, setting) else RingComm(group, members=members)


def _copy_engine(group, device: torch.device, setting: str) -> bool:
    """Whether a whole-group CUDA ring may take the copy engines (setting auto or copy-engine):
    where they are unusable, copy-engine raises and auto falls back with a warning (once per
    group)."""
    usable = _copy_engine_usable(group, device)
    if usable is True:
        return True
    if setting == "copy-engine":
        raise RuntimeError(f"RINGCC_RING_TRANSPORT=copy-engine: {usable}; set it to nccl or auto")
    if group not in _WARNED:
        _WARNED.add(group)
        warnings.warn(f"ringcc: ring transfers go through the process group: copy-engine ring unusable: {usable}",
                      stacklevel=3)
    return False


_WARNED: weakref.WeakSet = weakref.WeakSet()
