"""Communication backends: byte exchange between data-parallel ranks. No math here.

Two backends with one interface (and ``LocalComm``, ranks as threads of one process, for
benchmarks that simulate ranks):

* ``TorchComm``: ``torch.distributed`` on the data-parallel process group (gloo on CPU,
  NCCL on GPU). Everything quantized travels as ``uint8`` (gloo rejects float8 dtypes).
  Its ``device`` is the one the group's backend takes (the host for gloo, the accelerator
  for NCCL, which rejects host tensors): every tensor handed to a collective is moved there
  once, and results come back on the device the caller's tensor was on.
* ``MpiComm``: mpi4py (imported only when chosen), over a communicator holding the
  same ranks as the data-parallel group. Host buffers; CUDA buffers are staged through
  host memory unless the MPI library reports CUDA awareness.

Every exchange records the bytes this rank sent to other ranks, by kind, so telemetry
can report exactly what crossed the network.
"""

from __future__ import annotations

import collections
import enum
import datetime
import sys
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .stats import ByteKind


class Backend(str, enum.Enum):
    """``gift.backend``: DeepSpeed's own process group (torch.distributed), or MPI."""

    TORCH = "torch"
    MPI = "mpi"


class Comm:
    """Interface of a backend. ``rank``/``world_size`` are within the data-parallel group."""

    name = "base"
    device = torch.device("cpu")  # where the collectives take their tensors

    def __init__(self) -> None:
        self.bytes_sent: Dict[ByteKind, int] = collections.defaultdict(int)

    rank: int
    world_size: int

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def all_to_all_bytes(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                         *, kind: ByteKind = ByteKind.PAYLOAD) -> torch.Tensor:
        """Send ``send[sum(send_splits[:j]) : ...]`` to rank j; return what every rank sent
        here, concatenated in rank order (``recv_splits[j]`` bytes from rank j)."""
        raise NotImplementedError(f"{type(self).__name__}.all_to_all_bytes")

    def all_to_all_bytes_start(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                               *, kind: ByteKind = ByteKind.PAYLOAD) -> "Pending":
        """:meth:`all_to_all_bytes` begun: its :class:`Pending` hands back what it returns. The
        caller may run other work (and collectives on *other* comms) meanwhile; every rank issues
        this comm's collectives in one order. A backend that cannot leave one running finishes
        it here (the result is the same, only not overlapped)."""
        return Pending(result=self.all_to_all_bytes(send, send_splits, recv_splits, kind=kind))

    def all_to_all_parts_start(self, parts: Sequence[Sequence[torch.Tensor]], recv_parts: Sequence[Sequence[int]],
                               *, kind: ByteKind = ByteKind.PAYLOAD) -> "Pending":
        """:meth:`all_to_all_bytes_start` of messages given in parts: ``parts[j]`` the contiguous
        uint8 tensors whose concatenation goes to rank j, ``recv_parts[j]`` the byte counts of
        the parts rank j sends here, in its order. What comes back is laid out as
        :meth:`all_to_all_bytes` lays it out. Every rank of the group passes as many parts to
        its busiest peer (the node stage's do: every rank cuts the same runs). Here the parts are
        joined into one send buffer (one copy of what leaves); a backend whose point-to-point
        sends read each part where it lies overrides this."""
        flat = [p for ps in parts for p in ps]
        send = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=self.device)
        return self.all_to_all_bytes_start(send, [sum(p.numel() for p in ps) for ps in parts],
                                           [sum(r) for r in recv_parts], kind=kind)

    def all_reduce_sum(self, tensor: torch.Tensor, *, kind: ByteKind = ByteKind.GEOMETRY) -> torch.Tensor:
        """In-place sum over the group (float32 statistics, counters)."""
        raise NotImplementedError(f"{type(self).__name__}.all_reduce_sum")

    def all_gather_bytes(self, blob: torch.Tensor, *, kind: ByteKind = ByteKind.GEOMETRY,
                         same_size: bool = False) -> List[torch.Tensor]:
        """Every rank contributes a 1-D uint8 tensor of any length; all get all, in rank order.
        ``same_size``: the caller guarantees every rank's blob has this one's length, which
        saves the exchange of sizes (one collective instead of two)."""
        raise NotImplementedError(f"{type(self).__name__}.all_gather_bytes")

    def split(self, groups: Sequence[Sequence[int]]) -> "Comm":
        """A comm of the group (ranks of this comm) that holds this rank. ``groups`` partitions
        ``range(world_size)`` and is the same on every rank: every rank must call this, with
        the same list, at the same point (backends build every group collectively)."""
        raise NotImplementedError(f"{type(self).__name__}.split")

    def split_many(self, partitions: Sequence[Sequence[Sequence[int]]]) -> List["Comm"]:
        """:meth:`split` by each partition, in order. Every rank of the *job* calls it once at the
        same point, also where this comm's group (one data-parallel group of several: pipeline or
        tensor parallelism) wants no split at all (``[]``): a backend that builds groups over the
        whole job does so for every group that any rank asks for (:class:`TorchComm`)."""
        return [self.split(groups) for groups in partitions]

    def _count(self, kind: "ByteKind", nbytes: int) -> None:
        self.bytes_sent[ByteKind(kind)] += int(nbytes)  # a kind outside the vocabulary fails here


class Pending:
    """A collective under way: :meth:`wait` finishes it (once) and returns its result."""

    def __init__(self, finish=None, *, result=None) -> None:
        self._finish, self._result = finish, result

    def wait(self):
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result

    def finished(self) -> "Pending":
        """This collective waited for now (a serial schedule's), as a Pending that holds its result."""
        self.wait()
        return self


def group_of(groups: Sequence[Sequence[int]], rank: int, world_size: int) -> int:
    """Index of the group holding ``rank``; checks that ``groups`` partitions the ranks."""
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world_size)):
        raise ValueError(f"comm groups {list(map(list, groups))} do not partition ranks 0..{world_size - 1}")
    return next(i for i, g in enumerate(groups) if rank in g)


def served_devices(backend: str) -> Dict[str, str]:
    """Device type -> backend of a process group's backend string: ``"gloo"`` serves the host
    (its CUDA support lacks all-to-all), ``"nccl"`` CUDA, ``"cpu:gloo,cuda:nccl"`` each type
    its own."""
    backend = str(backend).lower()
    if ":" in backend:
        return dict(part.split(":", 1) for part in backend.split(","))
    if backend in ("gloo", "mpi"):
        return {"cpu": backend}
    return {"cuda": backend}  # nccl; other device-only backends name their type with "type:backend"


def sends_parts(backend: str, device: torch.device) -> bool:
    """Whether a group's point-to-point sends take ``device``'s tensors where they lie: NCCL's on
    CUDA, gloo's on the host (not gloo's CUDA path, nor MPI through torch)."""
    by = served_devices(backend).get(torch.device(device).type)
    return by == "nccl" or (by == "gloo" and torch.device(device).type == "cpu")


def device_for_backend(backend: str) -> torch.device:
    """The device GIFT's collectives use on a group with this backend: the host where it has a
    host backend of its own (not only gloo's CUDA path), else the current accelerator."""
    served = served_devices(backend)
    accelerators = [kind for kind in served if kind != "cpu"]
    if "cpu" in served and all(served[kind] == "gloo" for kind in accelerators):
        return torch.device("cpu")
    kind = accelerators[0]
    module = getattr(torch, kind, None)
    if module is None or not module.is_available():
        if "cpu" in served:
            return torch.device("cpu")
        raise RuntimeError(f"deepspeed_gift: the data-parallel group's backend {backend!r} takes {kind} tensors only, "
                           f"and this process has no {kind} device")
    return torch.device(kind, module.current_device())


def agreed_groups(dist, mine: Sequence[Sequence[int]], **kwargs) -> Dict[Tuple[int, ...], object]:
    """Process groups of the global ranks in ``mine``, made on every rank of the job.

    ``torch.distributed.new_group`` is collective over the whole job: every rank must call it for
    every group, members or not, in the same order (torch names a group by a counter and meets
    its members under that name; NCCL with a bound device splits the world's communicator). With
    several data-parallel groups (pipeline or tensor parallelism) each rank knows only its own
    group's wishes, so every rank first gathers what every rank asks for, over the whole job,
    then all make the union in one sorted order. Returns the groups by their sorted members."""
    asked: List[Optional[list]] = [None] * dist.get_world_size()
    dist.all_gather_object(asked, sorted(tuple(sorted(int(r) for r in g)) for g in mine))
    union = sorted({tuple(g) for wishes in asked for g in wishes})
    return {members: dist.new_group(ranks=list(members), **kwargs) for members in union}


# The most parts TorchComm sends a peer one by one in an all-to-all of parts (see there).
MAX_PEER_PARTS = 16


class TorchComm(Comm):
    name = "torch"

    def __init__(self, group=None, timeout: Optional[float] = None) -> None:
        super().__init__()
        import torch.distributed as dist

        self._dist = dist
        if timeout is not None:
            # A group of our own, so the deadline applies to GIFT's exchanges whatever
            # timeout the data-parallel group was created with (DeepSpeed's new_group: 30 min);
            # every data-parallel group's, made on every rank of the job.
            ranks = tuple(sorted(dist.get_process_group_ranks(group) if group is not None
                                 else range(dist.get_world_size())))
            group = agreed_groups(dist, [ranks], timeout=datetime.timedelta(seconds=timeout))[ranks]
        self.group = group
        self.timeout = timeout
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        self.device = device_for_backend(dist.get_backend(group))
        self.sends_parts = sends_parts(dist.get_backend(group), self.device)

    def split(self, groups):
        return self.split_many([groups])[0]

    def split_many(self, partitions):
        dist = self._dist
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(dist.get_world_size()))
        kwargs = {} if self.timeout is None else {"timeout": datetime.timedelta(seconds=self.timeout)}
        mine = [tuple(sorted(ranks[r] for r in groups[group_of(groups, self.rank, self.world_size)]))
                for groups in partitions]
        made = agreed_groups(dist, mine, **kwargs)
        subs = []
        for members in mine:
            sub = TorchComm.__new__(TorchComm)
            Comm.__init__(sub)
            sub._dist, sub.group, sub.timeout, sub.device = dist, made[members], self.timeout, self.device
            sub.sends_parts = self.sends_parts
            sub.rank, sub.world_size = dist.get_rank(group=sub.group), dist.get_world_size(group=sub.group)
            subs.append(sub)
        return subs

    def all_to_all_bytes(self, send, send_splits, recv_splits, *, kind=ByteKind.PAYLOAD):
        send_splits = [int(s) for s in send_splits]
        recv_splits = [int(s) for s in recv_splits]
        if self.world_size == 1:
            return send.clone()
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        self._dist.all_to_all_single(recv, self._on_device(send), recv_splits, send_splits, group=self.group)
        self._count(kind, sum(send_splits) - send_splits[self.rank])
        return recv.to(send.device)

    def all_to_all_bytes_start(self, send, send_splits, recv_splits, *, kind=ByteKind.PAYLOAD):
        send_splits = [int(s) for s in send_splits]
        recv_splits = [int(s) for s in recv_splits]
        if self.world_size == 1:
            return Pending(result=send.clone())
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        staged = self._on_device(send)  # held by the closure until the work is done
        work = self._dist.all_to_all_single(recv, staged, recv_splits, send_splits, group=self.group, async_op=True)
        self._count(kind, sum(send_splits) - send_splits[self.rank])

        def finish():
            nonlocal staged
            work.wait()  # on an accelerator: the current stream waits for the collective's
            staged = None
            return recv.to(send.device)

        return Pending(finish)

    def all_to_all_parts_start(self, parts, recv_parts, *, kind=ByteKind.PAYLOAD):
        """Each part sent where it lies (``batch_isend_irecv``: one send a part, one receive a
        part into its place), so what leaves is never gathered into a send buffer: on a GPU that
        is a pass over the bucket's share the node stage sends (7/8 of it in nodes of 8). Parts
        off the comm's device are staged there first (a gloo group's host tensors are not).
        The parts are joined instead where the group's point-to-point sends do not serve the
        device (:func:`sends_parts`: gloo's CUDA path), and beyond :data:`MAX_PEER_PARTS` parts
        to a peer (a send each would cost more in latency than the copy: ZeRO-1's rounds at
        W = 512 bring a slot 60-140 runs of a piece; DeepSpeed's buckets at 7B and 13B, W = 64
        and 512, at most 15 in 6 pieces and 14 in 4, a part each beside the header's: within)."""
        if (not self.sends_parts or self.world_size == 1
                or max((len(ps) for ps in parts), default=0) > MAX_PEER_PARTS):
            return super().all_to_all_parts_start(parts, recv_parts, kind=kind)
        dist, group = self._dist, self.group
        if getattr(self, "_peers", None) is None:  # the group's ranks as the job numbers them, once
            self._peers = (dist.get_process_group_ranks(group) if group is not None
                           else list(range(self.world_size)))
        peer = self._peers.__getitem__

        recv = torch.empty(sum(sum(r) for r in recv_parts), dtype=torch.uint8, device=self.device)
        staged = [[self._on_device(p) for p in ps] for ps in parts]  # held until the sends are done
        if [p.numel() for p in staged[self.rank]] != list(recv_parts[self.rank]):
            raise RuntimeError(f"deepspeed_gift: rank {self.rank} sends itself parts of "
                               f"{[p.numel() for p in staged[self.rank]]} bytes and expects {list(recv_parts[self.rank])}")
        ops, at = [], 0
        for j, sizes in enumerate(recv_parts):
            for k, n in enumerate(sizes):
                if j == self.rank:  # what a rank sends itself is copied, as an all-to-all does
                    recv.narrow(0, at, n).copy_(staged[j][k])
                elif n:
                    ops.append(dist.P2POp(dist.irecv, recv.narrow(0, at, n), peer(j), group))
                at += n
        sent = 0
        for j, ps in enumerate(staged):
            for p in ps:
                if j != self.rank and p.numel():
                    ops.append(dist.P2POp(dist.isend, p, peer(j), group))
                    sent += p.numel()
        works = dist.batch_isend_irecv(ops) if ops else []
        self._count(kind, sent)
        device = next((p.device for ps in parts for p in ps), self.device)

        def finish():
            nonlocal staged
            for work in works:
                work.wait()
            staged = None
            return recv.to(device)

        return Pending(finish)

    def all_reduce_sum(self, tensor, *, kind=ByteKind.GEOMETRY):
        if self.world_size > 1:
            work = self._on_device(tensor)
            self._dist.all_reduce(work, op=self._dist.ReduceOp.SUM, group=self.group)
            if work is not tensor:
                tensor.copy_(work)
            self._count(kind, _ring_allreduce_bytes(tensor, self.world_size))
        return tensor

    def _gather_into(self, out, tensor):
        # torch 2.13 names it all_gather_single (all_gather_into_tensor warns); older ones lack it
        gather = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        gather(out, tensor, group=self.group)

    def all_gather_bytes(self, blob, *, kind=ByteKind.GEOMETRY, same_size=False):
        if self.world_size == 1:
            return [blob.clone()]
        if same_size:
            sizes_list = [blob.numel()] * self.world_size
        else:  # a host read: attach and refresh steps only (blobs of one size skip it)
            sizes = torch.tensor([blob.numel()], dtype=torch.int64, device=self.device)
            all_sizes = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
            self._gather_into(all_sizes, sizes)
            sizes_list = all_sizes.tolist()
        longest = max(sizes_list)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:blob.numel()].copy_(blob)
        out = torch.empty(longest * self.world_size, dtype=torch.uint8, device=self.device)
        self._gather_into(out, padded)
        self._count(kind, longest * (self.world_size - 1))
        out = out.to(blob.device)
        return [out[j * longest:j * longest + n] for j, n in enumerate(sizes_list)]


def _ring_allreduce_bytes(tensor: torch.Tensor, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce (reduce-scatter + all-gather)."""
    return 2 * (world_size - 1) * tensor.numel() * tensor.element_size() // world_size


class MpiComm(Comm):
    name = "mpi"

    DEFAULT_TIMEOUT_S = 1800.0

    def __init__(self, group_ranks: Optional[Sequence[int]] = None, timeout: Optional[float] = None) -> None:
        super().__init__()
        self.timeout = float(timeout) if timeout is not None else self.DEFAULT_TIMEOUT_S
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ValueError("gift.backend: got 'mpi' but mpi4py cannot be imported "
                             f"({exc}); install the extra: pip install 'deepspeed-gift[mpi]', "
                             "or use backend 'torch'") from None
        self._MPI = MPI
        world = MPI.COMM_WORLD
        if group_ranks is None or len(group_ranks) == world.Get_size():
            self.comm = world.Dup()
        else:
            ranks = sorted(int(r) for r in group_ranks)
            # Every world rank must call Split; ranks outside this group get their own color.
            color = ranks[0] if world.Get_rank() in ranks else MPI.UNDEFINED
            self.comm = world.Split(color, world.Get_rank())
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self._cuda_aware = _mpi_is_cuda_aware(MPI)

    def split(self, groups):
        mine = group_of(groups, self.rank, self.world_size)
        sub = MpiComm.__new__(MpiComm)
        Comm.__init__(sub)
        sub.timeout, sub._MPI, sub._cuda_aware = self.timeout, self._MPI, self._cuda_aware
        sub.comm = self.comm.Split(mine, self.rank)
        sub.rank, sub.world_size = sub.comm.Get_rank(), sub.comm.Get_size()
        return sub

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer mpi4py may read now: host memory, or (CUDA-aware MPI) the device buffer once
        the stream that writes it has finished (MPI does not wait on CUDA streams)."""
        if t.device.type == "cpu":
            return t.contiguous()
        if self._cuda_aware:
            t = t.contiguous()
            torch.cuda.current_stream(t.device).synchronize()
            return t
        return t.detach().to("cpu").contiguous()

    def _deadline(self, op: str):
        """MPI collectives cannot time out: a watchdog aborts the job if one waits too long."""
        comm = self

        class _Watchdog:
            def __enter__(self):
                self.timer = threading.Timer(comm.timeout, self._fire)
                self.timer.daemon = True
                self.timer.start()

            def _fire(self):
                sys.stderr.write(f"deepspeed_gift: MPI {op} on rank {comm.rank} waited more than {comm.timeout:.0f} s "
                                 "(gift.comm_timeout_s) for the other ranks; aborting the job\n")
                sys.stderr.flush()
                comm._MPI.COMM_WORLD.Abort(124)

            def __exit__(self, *exc):
                self.timer.cancel()
                return False

        return _Watchdog()

    @staticmethod
    def _buffer(t: torch.Tensor):
        # mpi4py reads CUDA tensors through __cuda_array_interface__ (CUDA-aware MPI only)
        return t.numpy() if t.device.type == "cpu" else t

    def all_to_all_bytes(self, send, send_splits, recv_splits, *, kind=ByteKind.PAYLOAD):
        send_splits = [int(s) for s in send_splits]
        recv_splits = [int(s) for s in recv_splits]
        host_send = self._host(send)
        host_recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=host_send.device)  # MPI writes it
        # before returning, and kernels queued later read it: no wait needed on that side
        sdispl = _displacements(send_splits)
        rdispl = _displacements(recv_splits)
        with self._deadline("all-to-all"):
            self.comm.Alltoallv([self._buffer(host_send), (send_splits, sdispl), self._MPI.BYTE],
                                [self._buffer(host_recv), (recv_splits, rdispl), self._MPI.BYTE])
        self._count(kind, sum(send_splits) - send_splits[self.rank])
        return host_recv.to(send.device)

    def all_to_all_bytes_start(self, send, send_splits, recv_splits, *, kind=ByteKind.PAYLOAD):
        send_splits = [int(s) for s in send_splits]
        recv_splits = [int(s) for s in recv_splits]
        host_send = self._host(send)
        host_recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=host_send.device)
        request = self.comm.Ialltoallv(
            [self._buffer(host_send), (send_splits, _displacements(send_splits)), self._MPI.BYTE],
            [self._buffer(host_recv), (recv_splits, _displacements(recv_splits)), self._MPI.BYTE])
        self._count(kind, sum(send_splits) - send_splits[self.rank])

        def finish():
            nonlocal host_send  # MPI reads it until the request completes
            with self._deadline("all-to-all"):
                request.Wait()
            host_send = None
            return host_recv.to(send.device)

        return Pending(finish)

    def _allreduce(self, tensor, op):
        if self.world_size == 1:
            return tensor
        host = self._host(tensor)
        buf = self._buffer(host)
        with self._deadline("all-reduce"):
            self.comm.Allreduce(self._MPI.IN_PLACE, buf, op=op)
        if host.data_ptr() != tensor.data_ptr():
            tensor.copy_(host)
        return tensor

    def all_reduce_sum(self, tensor, *, kind=ByteKind.GEOMETRY):
        if tensor.dtype in (torch.bfloat16, torch.float16):  # MPI has no 16-bit float sum
            wide = tensor.float()
            self.all_reduce_sum(wide, kind=kind)
            return tensor.copy_(wide)
        if tensor.dtype not in (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8):
            raise TypeError(f"MpiComm.all_reduce_sum supports float/int tensors, got {tensor.dtype}")
        self._allreduce(tensor, self._MPI.SUM)
        if self.world_size > 1:
            self._count(kind, _ring_allreduce_bytes(tensor, self.world_size))
        return tensor

    def all_gather_bytes(self, blob, *, kind=ByteKind.GEOMETRY, same_size=False):
        host = self._host(blob)
        with self._deadline("all-gather"):
            sizes = [int(host.numel())] * self.world_size if same_size else self.comm.allgather(int(host.numel()))
            out = torch.empty(sum(sizes), dtype=torch.uint8, device=host.device)
            self.comm.Allgatherv(self._buffer(host), [self._buffer(out), (sizes, _displacements(sizes)),
                                                      self._MPI.BYTE])
        self._count(kind, host.numel() * (self.world_size - 1))
        offsets = _displacements(sizes)
        return [out[o:o + n].to(blob.device) for o, n in zip(offsets, sizes)]


def _displacements(sizes: Sequence[int]) -> List[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


class LocalComm(Comm):
    """Ranks as threads of one process, for code that simulates ranks (benchmarks): every
    exchange goes through a mailbox shared by the group, between two barriers. Made by
    :func:`run_local`, which runs one function per rank."""

    name = "local"

    def __init__(self, rank: int, world_size: int, mailbox: list, barrier: threading.Barrier) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self._mailbox, self._barrier = mailbox, barrier

    def _exchange(self, outgoing) -> list:
        """Post ``outgoing`` (anything, one per rank or one for all); return what every rank posted."""
        self._mailbox[self.rank] = outgoing
        self._barrier.wait()
        posted = list(self._mailbox)
        self._barrier.wait()  # every rank has read before the next exchange overwrites the box
        return posted

    def all_to_all_bytes(self, send, send_splits, recv_splits, *, kind=ByteKind.PAYLOAD):
        chunks = list(torch.split(send, [int(n) for n in send_splits]))
        posted = self._exchange(chunks)
        got = [posted[src][self.rank] for src in range(self.world_size)]
        if [g.numel() for g in got] != [int(n) for n in recv_splits]:
            raise RuntimeError(f"deepspeed_gift: rank {self.rank} expected {list(recv_splits)} bytes, ranks sent "
                               f"{[g.numel() for g in got]}")
        self._count(kind, sum(int(n) for n in send_splits) - int(send_splits[self.rank]))
        return torch.cat(got) if got else send.new_empty(0)

    def all_reduce_sum(self, tensor, *, kind=ByteKind.GEOMETRY):
        posted = self._exchange(tensor.clone())
        total = posted[0].clone()
        for part in posted[1:]:  # rank order, as every rank sees it: the same bits everywhere
            total.add_(part)
        tensor.copy_(total)
        if self.world_size > 1:
            self._count(kind, _ring_allreduce_bytes(tensor, self.world_size))
        return tensor

    def all_gather_bytes(self, blob, *, kind=ByteKind.GEOMETRY, same_size=False):
        posted = self._exchange(blob.clone())
        self._count(kind, blob.numel() * (self.world_size - 1))
        return [b.clone() for b in posted]


def run_local(world_size: int, fn, *args) -> list:
    """``fn(comm, *args)`` on ``world_size`` threads, each with the :class:`LocalComm` of its
    rank; their results in rank order. A rank that raises breaks the barrier, so the others
    stop instead of waiting, and its exception is raised here."""
    mailbox: list = [None] * world_size
    barrier = threading.Barrier(world_size)
    results: list = [None] * world_size
    errors: list = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(LocalComm(rank, world_size, mailbox, barrier), *args)
        except threading.BrokenBarrierError:
            pass  # another rank failed; its error is the one to report
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _mpi_is_cuda_aware(MPI) -> bool:
    try:
        query = getattr(MPI, "Query_cuda_support", None)
        return bool(query()) if query is not None else False
    except Exception:  # an MPI without the extension query: assume host buffers only
        return False


def split_by_node(comm: Comm, per_node: int):
    """(the node's comm, the slot group's comm: the same local rank on every node) for ranks
    numbered node by node. Every rank calls it at the same point."""
    nodes = comm.world_size // per_node
    node_comm, slot_comm = comm.split_many([[[n * per_node + j for j in range(per_node)] for n in range(nodes)],
                                            [[n * per_node + j for n in range(nodes)] for j in range(per_node)]])
    return node_comm, slot_comm


def ranks_per_node_from(hosts: Sequence[str], local_sizes: Sequence[str], whole_job: bool):
    """Ranks per node from what every rank reported: ``LOCAL_WORLD_SIZE`` when the group is the
    whole job and every rank reports the same, else the host names in rank order. Returns
    (ranks per node, "") or (None, why) when nodes are uneven or a node's ranks not contiguous."""
    world = len(hosts)
    if whole_job and len(set(local_sizes)) == 1 and local_sizes[0].isdigit():
        per_node = int(local_sizes[0])
        if per_node >= 1 and world % per_node == 0:
            return per_node, ""
        return None, f"LOCAL_WORLD_SIZE {per_node} does not divide the {world} data-parallel ranks"
    runs: List[list] = []  # [host, count] in rank order
    for host in hosts:
        if runs and runs[-1][0] == host:
            runs[-1][1] += 1
        else:
            runs.append([host, 1])
    if len({host for host, _ in runs}) != len(runs):
        return None, f"the ranks of a node are not contiguous (hosts in rank order: {list(hosts)})"
    if len({n for _, n in runs}) != 1:
        return None, f"nodes hold different numbers of data-parallel ranks ({[tuple(r) for r in runs]})"
    return runs[0][1], ""


def detect_ranks_per_node(comm: Comm):
    """Every rank's host name and ``LOCAL_WORLD_SIZE``, exchanged once, read by
    :func:`ranks_per_node_from`."""
    import json
    import os
    import socket

    import torch.distributed as dist

    mine = json.dumps([socket.gethostname(), os.environ.get("LOCAL_WORLD_SIZE", "")])
    blob = torch.frombuffer(bytearray(mine.encode()), dtype=torch.uint8)
    everyone = [json.loads(b.cpu().numpy().tobytes().decode())
                for b in comm.all_gather_bytes(blob, kind=ByteKind.CONTROL)]
    whole_job = not dist.is_initialized() or dist.get_world_size() == comm.world_size
    return ranks_per_node_from([h for h, _ in everyone], [n for _, n in everyone], whole_job)


def make_comm(backend: str, *, group=None, timeout: Optional[float] = None) -> Comm:
    """The backend named by ``gift.backend`` over DeepSpeed's data-parallel group."""
    if backend == Backend.TORCH:
        return TorchComm(group, timeout)
    if backend == Backend.MPI:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group) if group is not None else None
        return MpiComm(ranks, timeout)
    raise ValueError(f"gift.backend: got {backend!r}; allowed: {', '.join(repr(b.value) for b in Backend)}")


__all__ = ["Comm", "Pending", "TorchComm", "MpiComm", "LocalComm", "run_local", "make_comm", "split_by_node", "detect_ranks_per_node",
           "ranks_per_node_from", "device_for_backend", "served_devices"]
