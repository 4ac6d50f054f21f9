"""Two-level's stages as a pipeline (``gift.node_pieces``): a bucket cut into pieces on row
boundaries, piece k+1's node stage and piece k-1's forwards under way while piece k crosses the
nodes. The cut sets the bits; the overlap never does. Real gloo ranks, one machine posing as 2
nodes of 2; a comm whose all-to-alls take a set time stands in for links of known speed."""

import time

import pytest
import torch

from deepspeed_gift.core import formats
from deepspeed_gift.exchange.comm import Pending
from deepspeed_gift.exchange.plan import GEO, MAIN, ParamSlice
from deepspeed_gift.exchange.reducer import GiftReducer
from deepspeed_gift.exchange.two_level import bucket_pieces, piece_slices
from launch.spawn import run_ranks
from tests.harness import train_many

# Six parameters over four owners: matrices cut mid-row by the partitions, a vector, and a Muon
# matrix every owner of a part of it receives whole (copy ranks 1 and 3).
SHAPES = {0: (40, 16), 1: (24, 32), 2: (300,), 3: (20, 48), 4: (16, 16), 5: (500,)}
CUTS = {0: [(0, 400), (1, 240)], 1: [(1, 768)], 2: [(1, 100), (2, 200)], 3: [(2, 500), (3, 460)],
        4: [(1, 100), (3, 156)], 5: [(3, 500)]}


def _bucket(whitened=True):
    slices, offset = [], 0
    for key, shape in SHAPES.items():
        at = 0
        for dst, n in CUTS[key]:
            geo = whitened and len(shape) == 2
            slices.append(ParamSlice(dst, offset + at, n, at, key, shape[-1] if geo else 0, GEO if geo else MAIN,
                                     (1, 3) if key == 4 else ()))
            at += n
        offset += at
    return slices, offset


def test_pieces_cover_the_bucket_once_cut_on_rows_and_never_inside_a_shared_parameter():
    slices, total = _bucket()
    for pieces, least in ((1, 1), (2, 1), (4, 1), (7, 1), (4, 1000), (4, total), (50, 1)):
        cut = bucket_pieces(slices, pieces, least)
        assert 1 <= len(cut) <= min(pieces, max(1, total // least)), (pieces, least, len(cut))
        covered = sorted((slices[i].bucket_offset + at, n) for runs in cut for i, at, n in runs)
        assert sum(n for _, n in covered) == total and covered[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))  # no gap, no overlap
        for runs in cut:  # in bucket order inside a piece
            starts = [slices[i].bucket_offset + at for i, at, _ in runs]
            assert starts == sorted(starts)
        for runs in cut:
            sub, _ = piece_slices(slices, runs, None)
            for (i, _, _), s in zip(runs, sub):
                o = slices[i]
                if s.mode == GEO:  # a cut of the piece falls on a row of the parameter, as the whitener reads them
                    for edge, own in ((s.param_offset, o.param_offset), (s.param_offset + s.numel,
                                                                         o.param_offset + o.numel)):
                        assert edge == own or edge % s.row_len == 0, (s, o)
                if s.copy_ranks:
                    assert s == o, s  # whole
    # every piece holds about a quarter of every owner's elements (a row or the Muon matrix allowing),
    # so each loads every owner, slot and node as the bucket does
    cut = bucket_pieces(slices, 4, 1)
    assert len(cut) == 4
    for owner in range(4):
        mine = sum(s.numel for s in slices if s.dst == owner)
        held = [sum(n for i, _, n in runs if slices[i].dst == owner) for runs in cut]
        shared = sum(s.numel for s in slices if s.dst == owner and s.copy_ranks)  # whole, in one piece
        slack = max(s.row_len or 1 for s in slices if s.dst == owner) + shared
        assert all(abs(h - mine / 4) <= slack for h in held), (owner, mine, held)
    assert len({k for k, runs in enumerate(cut) for i, _, _ in runs if slices[i].copy_ranks}) == 1


class PacedComm:
    """A real comm whose all-to-alls each take ``seconds`` of a link that carries one at a time:
    one starts when the link is free and its result is handed over no earlier than that plus
    ``seconds`` (the collectives' own time here is milliseconds)."""

    def __init__(self, comm, seconds: float) -> None:
        self._comm, self.seconds, self._free_at = comm, seconds, 0.0

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _paced(self, pending):
        start = max(time.perf_counter(), self._free_at)
        self._free_at = done_at = start + self.seconds

        def finish():
            out = pending.wait()
            time.sleep(max(0.0, done_at - time.perf_counter()))
            return out

        return Pending(finish)

    def all_to_all_bytes_start(self, *args, **kwargs):
        return self._paced(self._comm.all_to_all_bytes_start(*args, **kwargs))

    def all_to_all_parts_start(self, *args, **kwargs):  # the node stage's
        return self._paced(self._comm.all_to_all_parts_start(*args, **kwargs))

    def all_to_all_bytes(self, *args, **kwargs):
        return self.all_to_all_bytes_start(*args, **kwargs).wait()


def _whiteners():
    """Whiteners of rank 4 for the bucket's matrices, fitted on inputs of unequal scales."""
    from deepspeed_gift.core import geometry as geo

    whiteners = {}
    for key in (0, 1, 3, 4):
        dim = SHAPES[key][-1]
        x = torch.randn(200, dim, generator=torch.Generator().manual_seed(key)) * torch.linspace(0.1, 3.0, dim)
        whiteners[key] = geo.fit_whitener(x.T @ x / 200, rank=4, damping=1e-3)
    return whiteners


def _pieces_body(rank, world, per_node):
    import torch.distributed as dist

    from deepspeed_gift.core.rng import CounterRng
    from deepspeed_gift.exchange.comm import TorchComm, split_by_node
    from deepspeed_gift.exchange.two_level import TwoLevelReducer

    dist.init_process_group("gloo")
    slices, total = _bucket()
    whiteners = _whiteners()
    node_comm, slot_comm = split_by_node(TorchComm(), per_node)
    out = {}

    def run(fmt, route, pieces, overlap, whitened, steps=2):
        rounding = "stochastic" if fmt == "fp8_e4m3" else "nearest"
        inner = GiftReducer(slot_comm, formats.get_format(fmt, rounding=rounding), generator=CounterRng(7 + rank),
                            error_feedback=fmt == "fp8_e4m3", route=route)
        two = TwoLevelReducer(node_comm, inner, per_node, pieces=pieces, piece_min_elements=200, overlap=overlap)
        got, slices = [], _bucket(whitened)[0]
        for step in range(steps):
            grad = torch.randn(total, generator=torch.Generator().manual_seed(100 * step + rank))
            outputs = [torch.zeros(s.numel) if s.dst == rank else None for s in slices]
            stats = two.reduce(grad, slices, whiteners if whitened else {}, divisor=world, step=step, outputs=outputs)
            mine = [i for i, s in enumerate(slices) if s.dst == rank or rank in s.copy_ranks]
            got.append(([grad.narrow(0, slices[i].bucket_offset, slices[i].numel).clone() for i in mine],
                        [outputs[i] for i in mine if outputs[i] is not None], stats.pieces, stats.bytes_node))
        return got

    for route in ("direct", "relay", "by_layout"):
        for overlap in (False, True):
            out["fp8", route, overlap] = run("fp8_e4m3", route, 4, overlap, True)
        out["fp32", route, 4] = run("fp32", route, 4, True, False)
        out["fp32", route, 1] = run("fp32", route, 1, True, False)
    return out


def _parts_body(rank, world):
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from deepspeed_gift.exchange.comm import Comm, TorchComm

    dist.init_process_group("gloo")
    comm = TorchComm()
    sub = comm.split([[0, 2], [1, 3]])  # a group whose ranks are not the job's: global peers

    def sizes(src, dst):  # parts of every size, an empty one among them; a rank's own, copied in place
        return [5, 0, 9] if src == dst else [16, 0, 3 * (src + 1) + dst, 1000 + 7 * dst]

    def part(src, dst, k, n):
        return (torch.arange(n, dtype=torch.int64) * (src + 3) + 11 * dst + 5 * k).remainder(256).to(torch.uint8)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    from deepspeed_gift.exchange.comm import MAX_PEER_PARTS

    def many(src, dst):  # more parts to a peer than go one by one: joined into one send buffer
        return [7 + k for k in range(MAX_PEER_PARTS + 1)]

    out = {}
    for name, c, sizes in (("world", comm, sizes), ("sub", sub, sizes), ("many", comm, many)):
        me, n = c.rank, c.world_size
        parts = [[part(me, j, k, m) for k, m in enumerate(sizes(me, j))] for j in range(n)]
        recv_parts = [sizes(i, me) for i in range(n)]
        ops = Ops()
        with ops:
            pending = c.all_to_all_parts_start(parts, recv_parts)
        got = pending.wait()
        joined = Comm.all_to_all_parts_start(c, parts, recv_parts).wait()  # one send buffer, one collective
        want = torch.cat([part(i, me, k, m) for i in range(n) for k, m in enumerate(sizes(i, me))])
        out[name] = (torch.equal(got, want), torch.equal(joined, want),
                     [o for o in ops.names if o in ("cat", "copy_", "clone")][:1 if name == "many" else None])
    return out


def test_parts_are_sent_where_they_lie_and_arrive_as_one_all_to_all_lays_them_out():
    """The node stage's messages go as parts (``Comm.all_to_all_parts_start``): over torch's
    point-to-point sends (TorchComm) every part that leaves is sent from where it lies (no
    gather, no cat; a rank's parts to itself are copied into place), and what arrives equals
    the joined send buffer's all-to-all, byte for byte, in a
    group of the whole job and in one whose ranks are not the job's."""
    for per_rank in run_ranks(_parts_body, 4):
        for name, (p2p_equal, joined_equal, copies) in per_rank.items():
            assert p2p_equal and joined_equal, name
            # a rank's own parts only, into their places; too many parts: one send buffer
            assert copies == (["cat"] if name == "many" else ["copy_"] * 3), (name, copies)


def test_parts_go_point_to_point_only_where_the_backend_sends_that_device():
    """NCCL on CUDA and gloo on the host send parts where they lie; gloo's CUDA path (a
    ``cuda:gloo`` group) and MPI through torch join them into one all-to-all."""
    from deepspeed_gift.exchange.comm import sends_parts

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert sends_parts("nccl", cuda) and sends_parts("gloo", cpu)
    assert sends_parts("cpu:gloo,cuda:nccl", cuda) and sends_parts("cpu:gloo,cuda:nccl", cpu)
    assert not sends_parts("cuda:gloo", cuda) and not sends_parts("mpi", cpu)


def test_overlapped_pieces_give_the_serial_bits_and_lossless_ones_the_whole_buckets():
    for per_rank in run_ranks(_pieces_body, 4, 2):
        for route in ("direct", "relay", "by_layout"):
            serial, overlapped = per_rank["fp8", route, False], per_rank["fp8", route, True]
            for (s_res, s_out, s_pieces, s_node), (o_res, o_out, o_pieces, o_node) in zip(serial, overlapped):
                assert s_pieces == o_pieces == 4 and s_node == o_node > 0
                # stochastic rounding and error feedback across two steps: the same bits
                assert all(torch.equal(a, b) for a, b in zip(s_res, o_res)), route
                assert all(torch.equal(a, b) for a, b in zip(s_out, o_out)), route
            # fp32 on the wire, no transform: each element's sum is the same operations, cut or not
            cut, whole = per_rank["fp32", route, 4], per_rank["fp32", route, 1]
            assert cut[0][2] == 4 and whole[0][2] == 1
            for (c_res, c_out, _, _), (w_res, w_out, _, _) in zip(cut, whole):
                assert all(torch.equal(a, b) for a, b in zip(c_res, w_res)), route
                assert all(torch.equal(a, b) for a, b in zip(c_out, w_out)), route


def _paced_body(rank, world, per_node, seconds, pieces):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm, split_by_node
    from deepspeed_gift.exchange.two_level import TwoLevelReducer

    dist.init_process_group("gloo")
    slices, total = _bucket(whitened=False)
    node_comm, slot_comm = split_by_node(TorchComm(), per_node)
    node, slot = PacedComm(node_comm, seconds), PacedComm(slot_comm, seconds)
    grad = torch.randn(total, generator=torch.Generator().manual_seed(rank))
    walls = {}
    for overlap in (False, True):
        two = TwoLevelReducer(node, GiftReducer(slot, formats.get_format("fp8_e4m3"), route="direct"), per_node,
                              pieces=pieces, piece_min_elements=100, overlap=overlap)
        two.reduce(grad.clone(), slices, {}, divisor=world)  # plans made and agreed (unpaced collectives)
        dist.barrier()
        t0 = time.perf_counter()
        two.reduce(grad.clone(), slices, {}, divisor=world)
        walls[overlap] = time.perf_counter() - t0
        dist.barrier()
    return walls


def test_overlapped_stages_take_about_the_longest_stage_not_their_sum():
    # every all-to-all takes T on its link; direct route: per piece a node stage (node link) and an
    # exchange among the nodes (slot link). Serial: 2 P T. Pipelined: the first node stage, then
    # each exchange beside the next node stage: (P + 1) T. The compute is milliseconds.
    seconds, pieces = 0.25, 4
    for walls in run_ranks(_paced_body, 4, 2, seconds, pieces):
        assert walls[False] >= 2 * pieces * seconds, walls
        assert walls[True] < (pieces + 1 + 0.6) * seconds, walls  # 0.6 T: compute and scheduling slack
        assert walls[True] < 0.75 * walls[False], walls


def _carry_body(rank, world, per_node, routes=("direct", "relay", "by_layout")):
    import torch.distributed as dist

    from deepspeed_gift.core.rng import CounterRng
    from deepspeed_gift.exchange.comm import TorchComm, split_by_node
    from deepspeed_gift.exchange.two_level import TwoLevelReducer

    dist.init_process_group("gloo")
    slices, total = _bucket()
    whiteners = _whiteners()
    # a second layout: the first bucket's slices of parameters 3 to 5, from offset 0
    first = min(s.bucket_offset for s in slices if s.param_key >= 3)
    second = [ParamSlice(s.dst, s.bucket_offset - first, s.numel, s.param_offset, s.param_key, s.row_len, s.mode,
                         s.copy_ranks) for s in slices if s.param_key >= 3]
    layouts = [(slices, total), (second, total - first), (slices, total)]  # three buckets a step
    node_comm, slot_comm = split_by_node(TorchComm(), per_node)
    out = {}

    def run(route, carry, steps=2, log=None):
        inner = GiftReducer(slot_comm, formats.get_format("fp8_e4m3", rounding="stochastic"),
                            generator=CounterRng(7 + rank), error_feedback=True, route=route)
        two = TwoLevelReducer(node_comm, inner, per_node, pieces=4, piece_min_elements=200)
        reported, calling = [], [None]
        on_done = None
        if log is not None:  # buckets reported the moment they are done; each piece's waits logged
            from deepspeed_gift.exchange import two_level as two_level_module

            native_finish = two._finish

            def finish(bucket, k, *args):
                log.append(("wait", bucket.tag, k))
                native_finish(bucket, k, *args)

            def on_done(tag, stats):
                log.append(("done", tag))
                reported.append((tag, stats))
            two._finish = finish

            class Logged(two_level_module.Begun):  # an exchange's every step after it is posted (the
                def __init__(self, steps):        # relay's second hop waits for its first)
                    self.tag = None
                    super().__init__(steps)
                    self.tag = calling[0]

                def _advance(self):
                    if self.tag is not None:
                        log.append(("advance", self.tag))
                    super()._advance()
            two_level_module.Begun = Logged
        got, flags = [], []
        for step in range(steps):
            held = []
            for b, (layout, n) in enumerate(layouts):
                grad = torch.randn(n, generator=torch.Generator().manual_seed(100 * step + 10 * b + rank))
                outputs = [torch.zeros(s.numel) if s.dst == rank else None for s in layout]
                held.append((grad, outputs, layout))
                calling[0] = (step, b)
                if carry:
                    done = two.reduce_carried(grad, layout, whiteners, divisor=world, step=step, outputs=outputs,
                                              tag=(step, b), carry=b + 1 < len(layouts), on_done=on_done)
                    done, reported[:] = done + reported, []
                else:
                    done = [((step, b), two.reduce(grad, layout, whiteners, divisor=world, step=step,
                                                   outputs=outputs))]
                flags.append(([tag for tag, _ in done], [st.carried_buckets for _, st in done],
                              [(st.pieces, st.bytes_node, st.bytes_main, st.recv_max) for _, st in done]))
            for grad, outputs, layout in held:
                mine = [i for i, s in enumerate(layout) if s.dst == rank or rank in s.copy_ranks]
                got.append(([grad.narrow(0, layout[i].bucket_offset, layout[i].numel).clone() for i in mine],
                            [outputs[i] for i in mine if outputs[i] is not None]))
        if log is not None:
            two_level_module.Begun = Logged.__mro__[1]
        return got, flags, two.carrying

    for route in routes:
        for carry in (False, True):
            out[route, carry] = run(route, carry)
        log = []
        out[route, "on_done"] = run(route, True, log=log) + (log,)
    return out


def test_buckets_carried_into_the_next_give_the_same_bits_and_are_reported_when_done():
    """``TwoLevelReducer.reduce_carried``: a bucket's last pieces finish during the next bucket's
    call; stochastic rounding, error feedback, relay and forwards over three buckets of two
    layouts and two steps give the bits of reducing each bucket whole, and each bucket is
    reported once, when its last piece and forwards are done."""
    for per_rank in run_ranks(_carry_body, 4, 2):
        for route in ("direct", "relay", "by_layout"):
            (whole, whole_flags, _), (carried, carried_flags, left) = per_rank[route, False], per_rank[route, True]
            assert not left
            for (w_res, w_out), (c_res, c_out) in zip(whole, carried):
                assert all(torch.equal(a, b) for a, b in zip(w_res, c_res)), route
                assert all(torch.equal(a, b) for a, b in zip(w_out, c_out)), route
            for step in range(2):
                # bucket 0 returns nothing (carried); bucket 1 reports bucket 0 (and carries itself);
                # bucket 2, the step's last, finishes bucket 1 and itself
                tags = [t for t, _, _ in carried_flags[3 * step:3 * step + 3]]
                assert tags == [[], [(step, 0)], [(step, 1), (step, 2)]], (route, tags)
                assert [c for _, c, _ in carried_flags[3 * step:3 * step + 3]] == [[], [1], [1, 0]], route
                # what each bucket counted is what it counts reduced whole
                assert sum((f for _, _, f in carried_flags[3 * step:3 * step + 3]), []) == \
                    sum((f for _, _, f in whole_flags[3 * step:3 * step + 3]), []), route
            # on_done: the same bits and reports, each bucket reported the moment it is done, before
            # any exchange of the next bucket is waited for (on a GPU, what the backward waits for
            # before refilling the carried bucket's buffer holds none of the next bucket's exchanges)
            called, called_flags, left, log = per_rank[route, "on_done"]
            assert not left and called_flags == carried_flags, route
            for (w_res, w_out), (c_res, c_out) in zip(whole, called):
                assert all(torch.equal(a, b) for a, b in zip(w_res, c_res)), route
                assert all(torch.equal(a, b) for a, b in zip(w_out, c_out)), route
            for step in range(2):
                for b in (1, 2):
                    done_at = log.index(("done", (step, b - 1)))
                    first_wait = min(i for i, e in enumerate(log) if e[0] != "done" and e[1] == (step, b))
                    assert done_at < first_wait, (route, step, b, log)


def test_a_carried_bucket_is_done_before_the_next_ones_relay_waits_for_its_first_hop():
    """Three nodes of two (a relay among two nodes is the direct route): the relay's second hop
    waits for its first, so a carried bucket's last piece and forwards are finished before the
    next bucket's first relay goes on; the same bits as buckets reduced whole."""
    for per_rank in run_ranks(_carry_body, 6, 2, ("relay",)):
        (whole, _, _), (called, _, left, log) = per_rank["relay", False], per_rank["relay", "on_done"]
        assert not left
        for (w_res, w_out), (c_res, c_out) in zip(whole, called):
            assert all(torch.equal(a, b) for a, b in zip(w_res, c_res))
            assert all(torch.equal(a, b) for a, b in zip(w_out, c_out))
        for step in range(2):
            for b in (1, 2):
                done_at = log.index(("done", (step, b - 1)))
                after = [e for e in log[done_at:] if e[0] == "advance" and e[1] == (step, b)]
                assert after and all(e[1] != (step, b) for e in log[:done_at] if e[0] != "done"), (step, b, log)


def _paced_carry_body(rank, world, per_node, seconds, pieces):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm, split_by_node
    from deepspeed_gift.exchange.two_level import TwoLevelReducer

    dist.init_process_group("gloo")
    slices, total = _bucket(whitened=False)
    node_comm, slot_comm = split_by_node(TorchComm(), per_node)
    node, slot = PacedComm(node_comm, seconds), PacedComm(slot_comm, seconds)
    grads = [torch.randn(total, generator=torch.Generator().manual_seed(10 * rank + b)) for b in range(2)]
    two = TwoLevelReducer(node, GiftReducer(slot, formats.get_format("fp8_e4m3"), route="direct"), per_node,
                          pieces=pieces, piece_min_elements=100)
    two.reduce(grads[0].clone(), slices, {}, divisor=world)  # plans made and agreed (unpaced collectives)
    walls = {}
    for carry in (False, True, False, True):  # twice each, alternating: the better of two
        dist.barrier()
        t0 = time.perf_counter()
        two.reduce_carried(grads[0].clone(), slices, {}, divisor=world, carry=carry)
        two.reduce_carried(grads[1].clone(), slices, {}, divisor=world, carry=False)
        walls[carry] = min(walls.get(carry, float("inf")), time.perf_counter() - t0)
    dist.barrier()
    return walls


def test_a_bucket_carried_into_the_next_pays_the_pipelines_fill_once():
    # every all-to-all takes T on its link; two buckets of P pieces, direct route. Bucket by
    # bucket: (P + 1) T each; carried, the second bucket's first node stage runs beside the
    # first's last exchange: (2 P + 1) T (the layout model's "across buckets" column)
    seconds, pieces = 0.25, 4
    for walls in run_ranks(_paced_carry_body, 4, 2, seconds, pieces):
        assert walls[False] >= 2 * (pieces + 1) * seconds, walls
        assert walls[True] < (2 * pieces + 1 + 0.6) * seconds, walls  # 0.6 T: compute and scheduling slack
        assert walls[True] < walls[False] - 0.5 * seconds, walls


# The engine: DeepSpeed's buckets and ZeRO-1's rounds cut into pieces. At two ranks on one node the
# node stage is the whole reduction: fp32 sums of two ranks, divided once (exact: a division by 2),
# as DeepSpeed's; every route, overlapped pieces or whole buckets.
PIECED = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1},
          "hierarchy": "two_level", "ranks_per_node": 2, "node_pieces": 3, "node_piece_min_elements": 500}


@pytest.mark.parametrize("stage", [1, 2])
def test_pieced_two_level_lossless_equals_deepspeed_bit_for_bit_at_two_ranks(stage):
    base = dict(stage=stage, steps=4, ga=2, bucket=12000)
    specs = [base] + [dict(base, gift=dict(PIECED, route=route)) for route in ("direct", "by_layout")]
    specs.append(dict(base, gift=dict(PIECED, node_pieces=1)))
    for native, *gifts in run_ranks(train_many, 2, specs):
        for gift in gifts:
            assert gift["digests"] == native["digests"]
            for name, p in native["params"].items():
                assert torch.equal(gift["params"][name], p), name
        cut, whole = gifts[0]["records"], gifts[-1]["records"]
        assert all(c["pieces"] > w["pieces"] > 0 for c, w in zip(cut, whole)), [(c["pieces"], w["pieces"])
                                                                               for c, w in zip(cut, whole)]


def _kernel_modes_body(rank, world, per_node):
    import torch.distributed as dist

    from deepspeed_gift.core.rng import CounterRng
    from deepspeed_gift.exchange.comm import TorchComm, split_by_node
    from deepspeed_gift.exchange.two_level import TwoLevelReducer
    from tests.kernel_calls import compiled_calls

    dist.init_process_group("gloo")
    whiteners = _whiteners()
    node_comm, slot_comm = split_by_node(TorchComm(), per_node)
    out = {}
    for whitened in (False, True):
        slices, total = _bucket(whitened)
        for mode in ("eager", "compiled"):
            codec = formats.get_format("fp8_e4m3", rounding="stochastic", kernels=mode)
            two = TwoLevelReducer(node_comm, GiftReducer(slot_comm, codec, generator=CounterRng(7 + rank),
                                                         route="direct"),
                                  per_node, pieces=4, piece_min_elements=200, overlap=True)
            got = []
            with compiled_calls() as calls:
                for step in range(2):
                    grad = torch.randn(total, generator=torch.Generator().manual_seed(100 * step + rank))
                    two.reduce(grad, slices, whiteners if whitened else {}, divisor=world, step=step)
                    got.append(grad)
            out[whitened, mode] = (got, calls.count("spans_block_encode"),
                                   calls.count("ragged_block_encode") + calls.count("fp8_block_encode"))
    return out


def test_two_level_pieces_encode_their_plain_sections_in_one_call_with_eagers_bits():
    # 4 ranks in nodes of 2, overlapped pieces, stochastic rounding, two steps: compiled, a piece's
    # plain sections to the other nodes' slot are encoded in one call (on its own: only a shared
    # parameter's; with layers whitened, a section that holds whitened rows too), and every
    # rank's bucket equals the eager path's bit for bit
    for per_rank in run_ranks(_kernel_modes_body, 4, 2):
        (eager, _, _), (fused, spans, alone) = per_rank[False, "eager"], per_rank[False, "compiled"]
        (w_eager, _, _), (w_fused, _, w_alone) = per_rank[True, "eager"], per_rank[True, "compiled"]
        assert spans > 0
        assert w_alone > alone, (alone, w_alone)
        assert all(torch.equal(a, b) for a, b in zip(eager, fused))
        assert all(torch.equal(a, b) for a, b in zip(w_eager, w_fused))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_node_partial_is_the_ordered_fp32_sum_of_the_local_ranks_in_both_kernel_modes(dtype):
    # the node stage sums its local ranks' parts (the bucket's dtype; its own part, not sent, at its
    # place) by the passthrough codec's decode-and-sum: the same bits as adding them one by one in
    # fp32, in local rank order, eager or compiled
    from deepspeed_gift.core.formats import Payload

    n, senders = 5000, 3
    gen = torch.Generator().manual_seed(3)
    rows = (torch.randn(senders, n, generator=gen) * torch.logspace(-3, 3, n)).to(dtype)
    mine = (torch.randn(n, generator=gen) * 7).to(dtype)
    for me in range(senders + 1):
        terms = list(rows.unbind(0))
        terms.insert(me, mine)
        want = terms[0].to(torch.float32, copy=True)
        for t in terms[1:]:
            want.add_(t)
        for kernels in ("eager", "compiled"):
            codec = formats.get_format("bf16" if dtype == torch.bfloat16 else "fp32", kernels=kernels)
            got = torch.empty(n)
            codec.decode_sum(Payload(codec.name, torch.Size((n,)), rows), got, own=mine, own_at=me)
            assert torch.equal(got, want), (kernels, me)


def test_the_layout_model_runs_the_reducers_order_and_finds_the_paced_runs_times():
    # benchmarks/layout_model.py's pipeline, on the paced test's shape (every all-to-all T, direct
    # route, nothing computed): serial 2 P T, pipelined (P + 1) T, what the real ranks took above;
    # a slower NIC sets the time (the node stages hide behind it), a slower node link likewise
    from benchmarks.layout_model import Rates, Stage, scheme_seconds

    T, P = 0.25, 4
    rates = Rates(nic_bps=1.0, nvlink_bps=1.0)
    stages = [Stage(node=T, node_steps=1, nic=((T, 1),)) for _ in range(P)]
    assert scheme_seconds(stages, rates, overlap=False) == pytest.approx(2 * P * T)
    assert scheme_seconds(stages, rates, overlap=True) == pytest.approx((P + 1) * T)
    slow_nic = [Stage(node=T, node_steps=1, nic=((3 * T, 1),)) for _ in range(P)]
    assert scheme_seconds(slow_nic, rates, overlap=True) == pytest.approx(T + 3 * T * P)
    slow_node = [Stage(node=3 * T, node_steps=1, nic=((T, 1),)) for _ in range(P)]
    assert scheme_seconds(slow_node, rates, overlap=True) == pytest.approx(3 * T * P + T)
    # a relay's second hop waits for its sums on the GPU: the GPU's stream is in the chain too
    relay = [Stage(node=T, node_steps=1, nic=((T, 1), (T, 1)), relay_s=T) for _ in range(P)]
    assert 2 * P * T <= scheme_seconds(relay, rates, overlap=True) < scheme_seconds(relay, rates, overlap=False)


def test_the_layout_models_bound_for_a_pipeline_across_buckets():
    # the carried column (gift.carry_buckets): two buckets of P paced pieces as one pipeline pay the fill
    # once, (2 P + 1) T, against 2 (P + 1) T bucket by bucket; each link's busy time, 2 P T, is
    # the floor either way (a relay's second hop and the GPU's work count where they run)
    from benchmarks.layout_model import Rates, Stage, busy_seconds, scheme_seconds

    T, P = 0.25, 4
    rates = Rates(nic_bps=1.0, nvlink_bps=1.0)
    bucket = [Stage(node=T, node_steps=1, nic=((T, 1),)) for _ in range(P)]
    per_bucket = 2 * scheme_seconds(bucket, rates, overlap=True)
    across = scheme_seconds(bucket + bucket, rates, overlap=True)
    assert per_bucket == pytest.approx(2 * (P + 1) * T) and across == pytest.approx((2 * P + 1) * T)
    assert busy_seconds(bucket + bucket, rates) == pytest.approx({"nv": 2 * P * T, "nic": 2 * P * T, "gpu": 0.0,
                                                                  "host": 0.0})
    relay = Stage(node=T, node_steps=1, nic=((T, 1), (2 * T, 1)), relay_s=T, encode_s=T, forward=T, forward_steps=1)
    assert busy_seconds([relay], rates) == pytest.approx({"nv": 2 * T, "nic": 3 * T, "gpu": 2 * T, "host": 0.0})
    assert scheme_seconds([relay] * P, rates, overlap=True) >= max(busy_seconds([relay] * P, rates).values())


def test_the_layout_models_quantized_node_stage():
    # --node-format (gift.node_format): the node stage's NVLink bytes scale from the bucket's 2 B
    # to the codec's, and its encode and the slot's decode-and-sum take the GPU's stream before
    # and after it, at the node codec's own counts where given; a paced piece of T each: the node
    # link waits for the encode
    from benchmarks.layout_model import Rates, Stage, bucket_stages, scheme_seconds

    owners = {0: 4 << 20, 1: 4 << 20}  # one node of 2 of 4 nodes owns the bucket
    plain = Rates(nic_bps=5e10, nvlink_bps=4.5e11, hbm_bps=2.7e12, encode_bpe=5.3, decode_a=4.0, decode_b=1.1)
    quantized = Rates(**{**plain.__dict__, "node_bpe": 1.03})
    a = bucket_stages(owners, 8, 2, 1.03, plain)["two_level_balanced"]
    b = bucket_stages(owners, 8, 2, 1.03, quantized)["two_level_balanced"]
    assert b.node == pytest.approx(a.node * 1.03 / 2) and a.node_encode_s == 0
    sent = (8 << 20) / 2  # a rank of 2 encodes the half of the bucket it sends
    assert b.node_encode_s == pytest.approx(plain.encode(sent, whiten=False))
    assert b.sum_s == pytest.approx(plain.decode(sent, 1, inverse=False))
    own = Rates(**{**quantized.__dict__, "node_codec": Rates(nic_bps=1.0, nvlink_bps=1.0, hbm_bps=2.7e12,
                                                              encode_bpe=7.0, decode_a=4.0, decode_b=2.0)})
    c = bucket_stages(owners, 8, 2, 1.03, own)["two_level_balanced"]
    assert c.node_encode_s == pytest.approx(own.node_codec.encode(sent, whiten=False))
    assert c.sum_s == pytest.approx(own.node_codec.decode(sent, 1, inverse=False))
    assert c.node_encode_s > b.node_encode_s and c.sum_s > b.sum_s
    assert c.encode_s == b.encode_s  # the exchange among the nodes keeps the main codec
    T = 0.25
    paced = Stage(node=T, node_steps=1, node_encode_s=T, nic=((T, 1),))
    assert scheme_seconds([paced], Rates(nic_bps=1.0, nvlink_bps=1.0), overlap=True) == pytest.approx(3 * T)


def test_the_layout_models_host_issues_every_codec_call():
    # --host-us: each codec call costs the host its time before the GPU can run it; the host issues
    # in order and never waits for the device. A bucket's owners give the calls: flat, an encode
    # per owner's section; two-level owner_slot, one per node holding an owner of the busiest slot
    from benchmarks.layout_model import Rates, Stage, bucket_stages, busy_seconds, scheme_seconds

    owners = {0: 1 << 20, 2: 1 << 20, 4: 1 << 20, 5: 1 << 20}  # W = 8 in nodes of 2: slot 0 on nodes 0-2
    rates = Rates(nic_bps=5e10, nvlink_bps=4.5e11, hbm_bps=2.7e12, encode_bpe=5.3, decode_a=4.0, decode_b=1.1,
                  host_call_s=1e-4)
    stages = bucket_stages(owners, 8, 2, 1.03, rates)
    assert (stages["direct"].encode_calls, stages["direct"].decode_calls) == (4, 1)
    assert stages["relay"].relay_calls == 2 * 4  # a decode-and-sum and an encode per owner's chunk
    slot = stages["two_level_owner_slot"]
    assert (slot.encode_calls, slot.sum_calls, slot.decode_calls) == (3, 1, 1)
    # paced: P pieces of T on each link, k calls of H each; the host's k H a piece sets the pace
    # once it exceeds T, and adds nothing where it is 0
    T, P, k = 0.25, 4, 5
    paced = [Stage(node=T, node_steps=1, nic=((T, 1),), encode_calls=k) for _ in range(P)]
    free = scheme_seconds(paced, Rates(nic_bps=1.0, nvlink_bps=1.0), overlap=True)
    assert free == pytest.approx((P + 1) * T)
    slow = Rates(nic_bps=1.0, nvlink_bps=1.0, host_call_s=T / 2)
    assert busy_seconds(paced, slow)["host"] == pytest.approx(P * k * T / 2)
    assert scheme_seconds(paced, slow, overlap=True) == pytest.approx(P * k * T / 2 + T)
    assert scheme_seconds(paced, slow, overlap=False) == pytest.approx(P * (2 * T + k * T / 2))


# overlap_comm: DeepSpeed's double ipg buffer keeps a bucket's buffer through the next bucket, so
# GIFT carries two-level's pipeline from bucket to bucket (gift.carry_buckets), holding the bucket's
# copies into the partition until it is done. FP8, stochastic rounding, error feedback and
# whitening at 4 ranks in nodes of 2, over gradient accumulation: the bits of the same buckets
# finished one by one, and (stage 2, whose buckets DeepSpeed fills alike either way) of
# overlap_comm false; ZeRO-1 on DeepSpeed's buckets (stage1_rounds false).
CARRIED = {"format": "fp8_e4m3", "layers": "all", "rounding": "stochastic", "error_feedback": True,
           "geometry": {"rank": 4, "refresh_interval": 2, "collect_interval": 1}, "telemetry": {"every": 1},
           "hierarchy": "two_level", "ranks_per_node": 2, "node_pieces": 3, "node_piece_min_elements": 500,
           "stage1_rounds": False}


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeeds_buckets_carried_under_overlap_comm_give_the_bits_of_whole_buckets(stage):
    base = dict(stage=stage, steps=4, ga=2, bucket=12000, overlap=True)
    specs = [dict(base, gift=CARRIED), dict(base, gift=dict(CARRIED, carry_buckets=False))]
    if stage == 2:
        specs.append(dict(base, gift=CARRIED, overlap=False))
    for carried, *whole in run_ranks(train_many, 4, specs):
        for other in whole:
            assert carried["digests"] == other["digests"]
            for name, p in other["params"].items():
                assert torch.equal(carried["params"][name], p), name
            assert carried["losses"] == other["losses"]
            assert all(r["carried_buckets"] == 0 for r in other["records"])
            for key in ("elements_sent", "bytes_payload", "bytes_node", "pieces", "bytes_recv_max"):
                assert [r[key] for r in carried["records"]] == [r[key] for r in other["records"]], key
        # every bucket but each backward's last is carried into the next
        assert all(r["carried_buckets"] > 0 for r in carried["records"]), [r["carried_buckets"]
                                                                           for r in carried["records"]]


# Lossless and carried: under overlap_comm at two ranks on one node, the pieces of every bucket but
# each backward's last finish during DeepSpeed's next bucket, and the parameters are still
# DeepSpeed's own with overlap_comm, bit for bit (fp32 sums of two ranks, divided once).
@pytest.mark.parametrize("stage", [1, 2])
def test_carried_two_level_lossless_equals_deepspeed_under_overlap_comm_bit_for_bit(stage):
    base = dict(stage=stage, steps=4, ga=2, bucket=12000, overlap=True)
    specs = [base, dict(base, gift=dict(PIECED, route="by_layout", stage1_rounds=False))]
    for native, gift in run_ranks(train_many, 2, specs):
        assert gift["digests"] == native["digests"]
        for name, p in native["params"].items():
            assert torch.equal(gift["params"][name], p), name
        assert all(r["carried_buckets"] > 0 for r in gift["records"]), [r["carried_buckets"]
                                                                        for r in gift["records"]]


def _abandoned_carry_body(rank, world, spec):
    from tests.harness import batches, build_engine

    engine = build_engine(spec)
    calls = {"n": 0}
    native_finish = engine.gift.reducer._finish

    def finish(*args):  # every rank fails at the same piece of the first backward's second bucket
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure")
        return native_finish(*args)
    engine.gift.reducer._finish = finish
    errors = []
    for tokens in batches(rank, 2, 2, 32, 0):
        try:
            out = engine(input_ids=tokens, labels=tokens)
            engine.backward(out.loss)
            engine.step()
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors, engine.gift.reducer.carrying


def test_a_reduction_that_raises_with_a_bucket_carried_makes_the_next_backward_refuse():
    """A backward that raises while a bucket is carried (an out-of-memory error a training loop
    might catch) leaves nothing under way behind it: the next backward refuses, naming the key
    and the first error, instead of finishing the old bucket's pieces into a new step."""
    spec = dict(stage=2, bucket=12000, overlap=True, gift=dict(PIECED, route="by_layout"))
    for errors, carrying in run_ranks(_abandoned_carry_body, 2, spec):
        assert not carrying
        assert len(errors) == 2 and "injected failure" in errors[0], errors
        assert "gift.carry_buckets" in errors[1] and "injected failure" in errors[1], errors


def _default_pieces_body(rank, world, specs):
    from tests.harness import build_engine

    return [build_engine(spec).gift.reducer.pieces for spec in specs]


def test_node_pieces_unset_is_four_where_buckets_are_carried_and_six_where_not():
    """``gift.node_pieces`` unset: a pipeline carried over the step pays its fill once, so fewer,
    larger pieces (config.NODE_PIECES_CARRIED); a bucket's own pipeline (overlap_comm off, or
    carry_buckets false) and ZeRO-1's rounds keep more (NODE_PIECES_BY_BUCKET); a set value is kept."""
    from deepspeed_gift.config import NODE_PIECES_BY_BUCKET, NODE_PIECES_CARRIED

    gift = {k: v for k, v in CARRIED.items() if k != "node_pieces"}
    specs = [dict(stage=2, bucket=12000, overlap=True, gift=gift),
             dict(stage=2, bucket=12000, overlap=False, gift=gift),
             dict(stage=2, bucket=12000, overlap=True, gift=dict(gift, carry_buckets=False)),
             dict(stage=1, bucket=12000, overlap=False, gift=dict(gift, stage1_rounds=True)),
             dict(stage=2, bucket=12000, overlap=True, gift=dict(gift, node_pieces=5))]
    for got in run_ranks(_default_pieces_body, 4, specs):
        assert got == [NODE_PIECES_CARRIED, NODE_PIECES_BY_BUCKET, NODE_PIECES_BY_BUCKET, NODE_PIECES_BY_BUCKET, 5]
