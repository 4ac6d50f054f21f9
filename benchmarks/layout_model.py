"""    .venv/bin/python benchmarks/layout_model.py [--bucket 5e8] [--nic-gbit 400] [--json out.json]

The gradient exchange of real model layouts, bucket by bucket, as DeepSpeed ZeRO-1/2 lays
them out: the busiest NIC's received bytes per step for DeepSpeed's bf16 all-reduce and for
GIFT FP8 by route and node split, at W = 8 / 64 / 512 GPUs with G = 1 and 8 per node (one NIC
each), and the gradient time when NVLink is counted too.

The layout is built from the models' definitions, not assumed balanced:
- parameters: HF ``LlamaForCausalLM`` on the meta device (~1B: TinyLlama-1.1B's shape, 7B and
  13B: Llama-2's), in ``model.parameters()`` order, one parameter group;
- partitions: DeepSpeed flattens the group padded to a multiple of 2 W elements and gives rank r
  the contiguous r-th W-th;
- buckets: gradients in the order a backward produces them (a forward and backward of the
  model on the meta device, with the hooks ZeRO uses), a bucket reduced when the next gradient
  would take it past ``reduce_bucket_size`` (default 5e8), a larger parameter reduced alone.
  ``tests/test_route.py`` checks this layout against what real engines hand GIFT.

Per bucket of N elements, N_d on owner d, N_m on the ranks of node m, N_s on the owners of
local rank s, n = W/G nodes, b FP8 e4m3 per-block bytes per element; bytes into the busiest
NIC (a rank's messages to ranks on its own node take NVLink):
- DeepSpeed bf16, ring all-reduce of the bucket (``use_multi_rank_bucket_allreduce``):
  2 (W-1)/W N 2 B, the G rings of a node sharing its G NICs (/G when the job spans nodes);
- GIFT flat direct: owner d receives its part from the W - G ranks off its node: (W-G) N_d b;
- GIFT flat relay: chunk j of every owner's part to rank j, then the sums to the owners:
  (W-G)/W N b + (W-G)/W max N_d b;  flat by_layout: the smaller, per bucket;
- GIFT ZeRO-1 rounds (``gift.stage1_rounds``): the step cut by the plugin's own
  ``exchange.rounds.plan_rounds`` into rounds of at most a bucket, each a slice of every owner's
  partition, each direct (flat) or by the lighter two-level split; the relay's second hop
  (``gift.relay_format`` int8, fp32 scale per 128) has FP8's bytes per element, so the relay
  columns hold for it;
- GIFT two-level (G > 1), after a node stage on NVLink, the exchange among the nodes in each
  slot group: ``owner_slot`` (the slot of a part's owner carries it): direct (n-1) max N_d b,
  relay (n-1)/n max N_s b + (n-1)/n max N_d b; ``balanced`` (every slot carries 1/G of each
  node's part): direct (n-1) max N_m / G b, relay (n-1)/n N/G b + (n-1)/n max N_m / G b; each
  split takes its lighter route (relay needs 3+ nodes), and by_layout the lighter split.
NVLink bytes into the busiest GPU (bucket dtype, 2 B): the node stage, (G-1) max N_s 2 B
(owner_slot) or (G-1) N/G 2 B (balanced), and the balanced split's forwards to the owners,
max (N_d - min(N_d, N_m/G)) 2 B (each slot carries its own owner's elements first). The time
columns count DeepSpeed's ring with its NVLink and NIC traffic at once (the slower link sets
it), and GIFT's two-level stages one after the other (``serial``) and as the pipeline of
``gift.node_pieces`` pieces the reducer runs (``scheme_seconds``); with ``--codec-traffic``
GIFT's work on the GPU too, with ``--host-us`` the host's time to issue each codec call, and
with ``--alpha-us``/``--a2a-us`` latencies. Memory the new
exchange holds per GPU while a bucket is reduced: flat, the relay's chunk sums (4 N/W B);
two-level, the fp32 node partial of its slot's share (4 N/G B) and the chunk sums; with error
feedback, the relayed residuals too (4/W B per parameter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.results import write_json  # noqa: E402
from deepspeed_gift.core.formats import get_format  # noqa: E402
from deepspeed_gift.config import NODE_PIECES_BY_BUCKET, NODE_PIECES_CARRIED  # noqa: E402
from deepspeed_gift.exchange.two_level import FINISH_LAG, OWN_TAIL_KEPT  # noqa: E402

NODE_PIECES = NODE_PIECES_BY_BUCKET  # gift.node_pieces' default bucket by bucket (and ZeRO-1's rounds)

MODELS = {
    "~1B": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000),
    "7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "13B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=40, vocab_size=32000),
}
WORLDS = (8, 64, 512)
PER_NODE = (1, 8)


def rows_with_nics(rows: List[dict]) -> List[dict]:
    return [r for r in rows if r["bf16_nic_gb"]]


def parameter_layout(config: dict) -> Tuple[List[int], List[int]]:
    """The model's parameter sizes in ``model.parameters()`` order (how ZeRO flattens them) and
    the order their gradients arrive in a backward (how ZeRO fills buckets): one forward and
    backward on the meta device, which computes nothing but runs the real autograd graph."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    params = list(model.parameters())
    arrival: List[int] = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: arrival.append(i))
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.numel() for p in params], arrival


def owners_of(runs: List[Tuple[int, int]]) -> Dict[int, int]:
    """Elements per owner of ``(owner, numel)`` runs."""
    out: Dict[int, int] = {}
    for d, n in runs:
        out[d] = out.get(d, 0) + n
    return out


def buckets_of(sizes: List[int], arrival: List[int], world: int, bucket_size: int) -> List[Dict[int, int]]:
    """Per bucket (in reduction order), elements per owning partition, by DeepSpeed's rules."""
    return [owners_of(runs) for runs in bucket_runs_of(sizes, arrival, world, bucket_size)]


def bucket_runs_of(sizes: List[int], arrival: List[int], world: int, bucket_size: int) -> List[List[Tuple[int, int]]]:
    """Per bucket (in reduction order), its ``(owner, numel)`` runs in bucket order."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += n
    align = 2 * world
    partition = -(-pos // align) * align // world
    out: List[List[Tuple[int, int]]] = []
    current: List[Tuple[int, int]] = []
    filled = 0

    def add(start: int, n: int, into: List[Tuple[int, int]]) -> None:
        while n > 0:
            d = start // partition
            take = min(n, (d + 1) * partition - start)
            into.append((d, take))
            start, n = start + take, n - take

    # DeepSpeed's rule (stage_1_and_2's reduce_independent_p_g_buckets_and_remove_grads): a
    # gradient that would take the bucket past its size first reduces the bucket (an empty one
    # too), then joins it; so a parameter larger than a bucket is reduced alone when the next
    # gradient arrives, and the bucket left at the end of the backward is reduced then.
    for start, n in ((offsets[i], sizes[i]) for i in arrival):
        if filled + n > bucket_size:
            out.append(current)
            current, filled = [], 0
        add(start, n, current)
        filled += n
    if filled:
        out.append(current)
    return out


def parameter_units(config: dict) -> List[int]:
    """Each parameter's row length (a matrix's ``shape[-1]``, else 1), in ``parameter_layout``'s
    order: where ZeRO-1's balanced rounds may cut it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    return [p.shape[-1] if p.dim() >= 2 else 1 for p in model.parameters()]


def rounds_of(sizes: List[int], units: List[int], world: int, bucket_size: int) -> List[List[Tuple[int, int]]]:
    """ZeRO-1's balanced rounds (``gift.stage1_rounds``), as the plugin plans them
    (``deepspeed_gift.exchange.rounds.plan_rounds`` on DeepSpeed's partitions): per round, its
    ``(owner, numel)`` runs in the round's order."""
    from deepspeed_gift.exchange.rounds import OwnedParam, contiguous_runs, plan_rounds

    align = 2 * world
    partition = -(-sum(sizes) // align) * align // world
    params = [OwnedParam(key, numel, runs, unit)
              for key, (numel, unit, runs) in enumerate(zip(sizes, units, contiguous_runs(sizes, partition)))]
    return [[(piece.owner, piece.numel) for piece in rnd.pieces] for rnd in plan_rounds(params, world, bucket_size)]


@dataclass
class Stage:
    """One piece's work in a scheme, in the order it runs: the node stage (NVLink, bytes into
    the busiest GPU, latency steps), the node partial's sum, the encode, the exchanges among
    nodes (NIC bytes into the busiest NIC and steps of each: one direct, two relayed, the relay's
    sums and second encode between them), the owner's decode and sum (and the inverse), the
    forwards (NVLink). Compute is in seconds (``Rates``)."""

    node: float = 0.0
    node_steps: int = 0
    node_encode_s: float = 0.0  # a quantized node stage (``Rates.node_bpe``): its encode, before it is sent
    sum_s: float = 0.0
    encode_s: float = 0.0
    nic: Tuple[Tuple[float, int], ...] = ()
    relay_s: float = 0.0
    decode_s: float = 0.0
    forward: float = 0.0
    forward_steps: int = 0
    # codec calls the host makes to issue each GPU operation above (``Rates.host_call_s`` each):
    # an encode per section it sends (and per tile past one), one batched decode-and-sum per
    # section received, a relay's decode-and-sum and encode per owner's chunk, the node stage's
    # sum (and, quantized, an encode per part it sends)
    node_encode_calls: int = 0
    sum_calls: int = 0
    encode_calls: float = 0  # in calls' worth of host time (a batched piece: its calls and joins)
    relay_calls: float = 0
    decode_calls: int = 0


@dataclass
class Rates:
    """The links, and the GPU's rates for what GIFT computes (``hbm_bps`` 0: compute not counted,
    bandwidth only). Codec traffic: bytes per element of the encode and ``decode_a + S decode_b``
    per element of the owner's decode-and-sum of S senders, each kernel a launch per tile."""

    nic_bps: float
    nvlink_bps: float
    alpha_s: float = 0.0  # DeepSpeed's ring: per step (2 (W - 1) steps an all-reduce)
    a2a_s: float = 0.0  # GIFT: per all-to-all (its messages to every peer posted at once)
    # and per step of an all-to-all (a peer it reaches: G - 1 inside a node, one a node less among
    # them): the scale model's alpha-per-step rule, which its other collectives follow
    a2a_step_s: float = 0.0
    hbm_bps: float = 0.0
    launch_s: float = 0.0
    encode_bpe: float = 0.0
    encode_kernels: int = 0
    decode_a: float = 0.0
    decode_b: float = 0.0
    whiten_rank: int = 0
    fp32_flops: float = 1.0
    tile: int = 1 << 24
    # the node stage's bytes per element: 2, the bucket's dtype (gift.node_format null); less, the
    # node stage quantized (gift.node_format), each rank encoding what it sends and the slot
    # decoding and summing the G - 1 parts, at ``node_codec``'s counted work (None: this codec's)
    node_bpe: float = 2.0
    node_codec: Optional["Rates"] = None
    encode_op: str = "encode"  # the codec_traffic row the encode counts come from ("encode bf16": a bf16 input)
    # the host's time per codec call (its Python, the compiled function's dispatch and guards, the
    # payload's views and header): a GPU runs none of a call's kernels before the host has issued
    # them, so where calls are many and short the host sets the pace (0: not counted)
    host_call_s: float = 0.0
    # the host's time per section where a rank's sections to its owners are plain spans of the
    # bucket (no layer whitened: ``whiten_rank`` 0) encoded by one call for all of a piece
    # (``Codec.encode_spans``) and each joined into its place (a cat): 0, a call per section
    section_join_s: float = 0.0

    def encode(self, n: float, whiten: bool = True) -> float:
        """An encode of ``n`` elements, whitened first (``whiten_rank``: a rank-r factor each way;
        not the relay's sums, which are whitened already)."""
        if not self.hbm_bps or n <= 0:
            return 0.0
        return (n * self.encode_bpe / self.hbm_bps + self._launches(n, self.encode_kernels)
                + (4 * self.whiten_rank * n / self.fp32_flops if whiten else 0.0))

    def decode(self, n: float, senders: int, inverse: bool = True) -> float:
        """The owner's decode and fp32 sum of ``senders`` payloads of ``n`` elements (and the
        inverse transform of the sum)."""
        if not self.hbm_bps or n <= 0:
            return 0.0
        return ((self.decode_a + senders * self.decode_b) * n / self.hbm_bps + self._launches(n, 1)
                + (4 * self.whiten_rank * n / self.fp32_flops if inverse else 0.0))

    def node_sum(self, n: float, g: int, sent: float, gathered: bool = False) -> float:
        """The node stage's own work: ``g`` parts of ``n`` elements summed into fp32 in order by
        the passthrough codec's decode-and-sum (one kernel: each part read once). Its messages
        (``sent`` elements) go from where they lie in the bucket (``TorchComm``'s point-to-point
        parts), or ``gathered`` into a send buffer first, a copy (a slot's runs of a piece past
        ``comm.MAX_PEER_PARTS``: ZeRO-1's rounds; an MPI comm always)."""
        if not self.hbm_bps:
            return 0.0
        return ((4 * sent if gathered else 0.0) + n * (2 * g + 4)) / self.hbm_bps + self._launches(n, 1) + (
            g - 1) * self.launch_s

    def cast(self, n: float) -> float:
        """fp32 results cast to the bucket's dtype for the forwards."""
        return 6 * n / self.hbm_bps + self._launches(n, 1) if self.hbm_bps and n > 0 else 0.0

    def _launches(self, n: float, kernels: int) -> float:
        return kernels * max(1, -(-int(n) // self.tile)) * self.launch_s

    def calls(self, n: float, sections: int, spans: bool = False) -> float:
        """Codec calls of ``sections`` sections of ``n`` elements in all: one a section, and one
        a tile past the first (none where nothing moves). ``spans``: sections that are plain spans
        of one buffer (``Codec.encode_spans``), one call a tile for them all and (where
        ``section_join_s`` is given) a join each, counted in calls' worth of host time."""
        if n <= 0:
            return 0
        tiles = -(-int(n) // self.tile)
        if spans and self.section_join_s and self.host_call_s:
            return tiles + sections * self.section_join_s / self.host_call_s
        return max(sections, tiles)

    def host(self, calls: int) -> float:
        return calls * self.host_call_s


def exchange_stage(group: int, sent: float, owned: float, b: float, relay: bool, rates: Rates,
                   reached: int = 1) -> Stage:
    """The exchange among ``group`` ranks (all of them, or one slot of every node): the busiest
    rank encodes ``sent`` elements, a section for each of the ``reached`` owners it sends to, and
    owns ``owned``; direct, the owners' parts go straight to them ((group - 1) owned b into the
    owner's NIC); relayed, chunk j of every part goes to rank j, which sums and re-encodes it for
    the owner (a decode-and-sum and an encode per owner's chunk)."""
    k = (group - 1) / group
    # a rank's sections plain where no layer is whitened; a relay's first hop a section at a time
    encode_calls = rates.calls(sent, reached, spans=not relay and not rates.whiten_rank)
    decode_calls = rates.calls(owned, 1)
    if not relay:
        return Stage(encode_s=rates.encode(sent), nic=(((group - 1) * owned * b, group - 1),),
                     decode_s=rates.decode(owned, group - 1), encode_calls=encode_calls, decode_calls=decode_calls)
    chunk = sent / group
    return Stage(encode_s=rates.encode(sent), nic=((k * sent * b, group - 1), (k * owned * b, group - 1)),
                 relay_s=rates.decode(chunk, group - 1, inverse=False) + rates.encode(chunk, whiten=False),
                 decode_s=rates.decode(owned, 1), encode_calls=encode_calls,
                 # per owner's chunk a decode-and-sum, then the sums (one buffer) encoded together
                 relay_calls=rates.calls(chunk, reached) + rates.calls(chunk, reached, spans=True),
                 decode_calls=decode_calls)


def bucket_stages(owners: Dict[int, int], world: int, per_node: int, b: float, rates: Rates,
                  gathered: bool = False) -> Dict[str, Stage]:
    """Per scheme, one bucket's (or piece's) work (see the module docstring's bytes); ``bf16``:
    DeepSpeed's ring, whose NVLink and NIC bytes move at once (in ``node`` and ``nic``);
    ``gathered``: the node stage's messages copied into a send buffer (``Rates.node_sum``)."""
    n, biggest = sum(owners.values()), max(owners.values(), default=0)
    g = min(per_node, world)
    nodes = world // g
    off_node = world - g
    ring = 2 * (world - 1) / world * n * 2 / (g if nodes > 1 else 1) if nodes > 1 else 0.0
    ring_nvlink = 2 * (world - 1) / world * n * 2 * (g - 1) / g
    direct = exchange_stage(world, n, biggest, b, False, rates, len(owners))
    direct.nic = ((off_node * biggest * b, world - 1),)
    relay = exchange_stage(world, n, biggest, b, True, rates, len(owners))
    relay.nic = ((off_node / world * n * b, world - 1), (off_node / world * biggest * b, world - 1))
    out = {"bf16": Stage(node=ring_nvlink, nic=((ring, 2 * (world - 1)),)), "direct": direct, "relay": relay,
           "by_layout": min(direct, relay, key=nic_bytes)}
    if g > 1 and nodes > 1:
        slots: Dict[int, int] = {}
        for d, m in owners.items():
            slots[d % g] = slots.get(d % g, 0) + m
        per_owner_node = node_totals(owners, g)
        busiest_slot, busiest_node = max(slots.values(), default=0), max(per_owner_node.values(), default=0)
        relay_ok = nodes > 2  # a relay among two nodes is the direct route
        # the owners' nodes a slot sends sections to: those holding an owner of that slot (owner_slot)
        slot_nodes: Dict[int, set] = {}
        for d in owners:
            slot_nodes.setdefault(d % g, set()).add(d // g)
        slot_reach = max((len(v) for v in slot_nodes.values()), default=0)

        def two_level(carried: float, owned: float, stage: float, forward: float, forwarded: float,
                      reached: int) -> Stage:
            """The lighter route among the nodes after a node stage (``carried``: what the busiest
            slot sums and sends, in sections to ``reached`` owners' nodes; ``owned``: what the
            busiest owner's slot receives for it)."""
            routes = [exchange_stage(nodes, carried, owned, b, False, rates, reached)]
            if relay_ok:
                routes.append(exchange_stage(nodes, carried, owned, b, True, rates, reached))
            best = min(routes, key=nic_bytes)
            best.node, best.node_steps = stage * rates.node_bpe / 2, g - 1
            best.sum_calls = rates.calls(carried, 1)
            if rates.node_bpe == 2:
                best.sum_s = rates.node_sum(carried, g, n * (g - 1) / g, gathered)
            else:
                codec = rates.node_codec or rates
                best.node_encode_s = codec.encode(n * (g - 1) / g, whiten=False)
                best.node_encode_calls = rates.calls(n * (g - 1) / g, g - 1)
                best.sum_s = codec.decode(carried, g - 1, inverse=False)
            best.forward, best.forward_steps = forward, (g - 1) if forward else 0
            best.decode_s += rates.cast(forwarded)
            best.decode_calls += rates.calls(forwarded, 1)
            return best

        # owner_slot: each slot carries what its owners hold; the node stage sums it into that slot
        owner_slot = two_level(busiest_slot, biggest, (g - 1) * busiest_slot * 2, 0.0, 0.0, slot_reach)
        direct_slot = exchange_stage(nodes, busiest_slot, biggest, b, False, rates, slot_reach)
        direct_slot.node, direct_slot.node_steps = owner_slot.node, owner_slot.node_steps
        direct_slot.sum_s, direct_slot.node_encode_s = owner_slot.sum_s, owner_slot.node_encode_s
        direct_slot.sum_calls, direct_slot.node_encode_calls = owner_slot.sum_calls, owner_slot.node_encode_calls
        # balanced: every slot carries 1/g of each node's part, its own owner's elements first
        # (``two_level.carried_balanced``); the rest is handed to the owners after
        handed_in, handed_out = balanced_forwards(owners, g)
        balanced = two_level(n / g, busiest_node / g, (g - 1) * n / g * 2, handed_in * 2, handed_out,
                             len(per_owner_node))
        out.update(two_level_direct=direct_slot, two_level_owner_slot=owner_slot, two_level_balanced=balanced)
        # by_layout: the split whose busiest NIC receives less (owner_slot on a tie)
        out["two_level_by_layout"] = balanced if nic_bytes(balanced) < nic_bytes(owner_slot) else owner_slot
    return out


def node_totals(owners: Dict[int, int], per_node: int) -> Dict[int, int]:
    """Elements per node of ``owners``' elements per owner."""
    out: Dict[int, int] = {}
    for d, m in owners.items():
        out[d // per_node] = out.get(d // per_node, 0) + m
    return out


def balanced_forwards(owners: Dict[int, int], per_node: int) -> Tuple[float, float]:
    """The balanced split's forwards inside a node (``two_level.carried_balanced``, rows not
    counted): slot j of node m carries a share N_m / G, first of its own owner's elements, so
    owner d receives N_d - min(N_d, N_m / G) from the other slots (nothing where the excess is
    at most 1/``OWN_TAIL_KEPT`` of the share: its slot keeps it) and a slot hands on its share
    less its own owner's part. The busiest owner's receive and the busiest slot's hand-on."""
    handed_in = handed_out = 0.0
    for node, total in node_totals(owners, per_node).items():
        share = total / per_node
        for j in range(per_node):
            own = owners.get(node * per_node + j, 0)
            kept = own if own - share <= share / OWN_TAIL_KEPT else min(own, share)  # a small excess stays
            handed_in = max(handed_in, own - kept)
            handed_out = max(handed_out, share - min(own, share))
    return handed_in, handed_out


def nic_bytes(stage: Stage) -> float:
    return sum(nbytes for nbytes, _ in stage.nic)


def bucket_link_bytes(owners: Dict[int, int], world: int, per_node: int, b: float) -> Dict[str, Tuple[float, float]]:
    """Per scheme, (bytes into the busiest NIC, bytes into the busiest GPU over NVLink in stages
    that run before or after the NIC's) of one bucket (see the module docstring)."""
    stages = bucket_stages(owners, world, per_node, b, Rates(1.0, 1.0))
    return {k: (nic_bytes(st), 0.0 if k in ("bf16", "direct", "relay", "by_layout") else st.node + st.forward)
            for k, st in stages.items()}


def cut_pieces(runs: List[Tuple[int, int]], pieces: int, min_elements: int) -> List[Dict[int, int]]:
    """Elements per owner of each piece ``gift.node_pieces`` cuts a bucket (or round) of these
    ``(owner, numel)`` runs into (``two_level.bucket_pieces``: piece k holds the k-th of the
    near-equal parts of every owner's elements; the rows' snapping, a row, is not counted)."""
    total = sum(n for _, n in runs)
    count = max(1, min(pieces, total // max(min_elements, 1)))
    owners = owners_of(runs)
    return [{d: m * (k + 1) // count - m * k // count for d, m in owners.items()} for k in range(count)]


def link_seconds(nbytes: float, steps: int, bps: float, rates: Rates) -> float:
    """One collective on a link: its latency (per collective and per step) and its bytes (none
    when it moves nothing)."""
    return rates.a2a_s + rates.a2a_step_s * steps + nbytes / bps if nbytes or steps else 0.0


def scheme_seconds(stages: List[Stage], rates: Rates, overlap: bool, finish_lag: int = FINISH_LAG) -> float:
    """Time of one bucket's pieces, in the order ``TwoLevelReducer.reduce`` issues their work.
    Three resources, each in issue order (and the host, whose codec calls each GPU operation
    waits for, ``Rates.host_call_s``): the node's links (node stages and forwards), the NICs
    (the exchanges), the GPU's stream (sum, encode, relay, decode); an operation starts when its
    resource is free and its input is ready. Issued per piece k: piece k+1's node stage, piece
    k's sum (after its node stage), piece k-1's last exchange (a relay's sums and second
    exchange), piece k's encode and first exchange, then piece k - ``finish_lag``'s rest (the
    owner's decode, the forwards: ``two_level.FINISH_LAG``). ``overlap`` off: every operation
    after the last."""
    def link(nbytes: float, steps: int, bps: float) -> float:
        return link_seconds(nbytes, steps, bps, rates)

    if not overlap:  # each operation waited for before the next is issued: host and device in turn
        return sum(st.node_encode_s + link(st.node, st.node_steps, rates.nvlink_bps) + st.sum_s + st.encode_s
                   + st.relay_s
                   + sum(link(nb, steps, rates.nic_bps) for nb, steps in st.nic) + st.decode_s
                   + link(st.forward, st.forward_steps, rates.nvlink_bps) + rates.host(host_calls(st))
                   for st in stages)
    t = {"nv": 0.0, "nic": 0.0, "gpu": 0.0, "host": 0.0}

    def run(resource: str, ready: float, seconds: float) -> float:
        t[resource] = max(t[resource], ready) + seconds
        return t[resource]

    def gpu(ready: float, seconds: float, calls: int) -> float:
        """A GPU operation of ``calls`` codec calls: the host issues it (in order, never waiting
        for the device), then the GPU's stream runs it once its input is ready."""
        issued = run("host", 0.0, rates.host(calls)) if calls else 0.0
        return run("gpu", max(ready, issued), seconds)

    def last_exchange(st: Stage, first_done: float) -> float:
        if len(st.nic) < 2:
            return first_done
        return run("nic", gpu(first_done, st.relay_s, st.relay_calls), link(*st.nic[1], rates.nic_bps))

    def rest(st: Stage, last_done: float) -> None:
        run("nv", gpu(last_done, st.decode_s, st.decode_calls), link(st.forward, st.forward_steps, rates.nvlink_bps))

    def node_stage(st: Stage) -> float:  # a quantized node stage is encoded on the GPU's stream first
        ready = gpu(0.0, st.node_encode_s, st.node_encode_calls) if st.node_encode_s else 0.0
        return run("nv", ready, link(st.node, st.node_steps, rates.nvlink_bps))

    node_done = [node_stage(stages[0])]
    waiting = []  # (piece, when its exchange so far is done): begun, not finished, oldest first
    for k, st in enumerate(stages):
        if k + 1 < len(stages):
            node_done.append(node_stage(stages[k + 1]))
        gpu(node_done[k], st.sum_s, st.sum_calls)
        if waiting:
            waiting[-1] = (waiting[-1][0], last_exchange(*waiting[-1]))
        first = (run("nic", gpu(0.0, st.encode_s, st.encode_calls), link(*st.nic[0], rates.nic_bps)) if st.nic
                 else t["gpu"])
        if len(waiting) == finish_lag:
            rest(*waiting.pop(0))
        waiting.append((st, first))
    waiting[-1] = (waiting[-1][0], last_exchange(*waiting[-1]))
    for st, done in waiting:
        rest(st, done)
    return max(t.values())


def busy_seconds(stages: List[Stage], rates: Rates) -> Dict[str, float]:
    """Each resource's own time over ``stages`` (``scheme_seconds``' three: the node's links, the
    NICs, the GPU's stream): no pipeline of them, however long, takes less than the largest."""
    def link(nbytes: float, steps: int, bps: float) -> float:
        return link_seconds(nbytes, steps, bps, rates)

    return {"nv": sum(link(st.node, st.node_steps, rates.nvlink_bps)
                      + link(st.forward, st.forward_steps, rates.nvlink_bps) for st in stages),
            "nic": sum(link(nb, steps, rates.nic_bps) for st in stages for nb, steps in st.nic),
            "gpu": sum(st.node_encode_s + st.sum_s + st.encode_s + st.relay_s + st.decode_s for st in stages),
            "host": sum(rates.host(host_calls(st)) for st in stages)}


def host_calls(st: Stage) -> float:
    """Every codec call the host makes for a piece's GPU work."""
    return st.node_encode_calls + st.sum_calls + st.encode_calls + st.relay_calls + st.decode_calls


def ring_seconds(stage: Stage, rates: Rates) -> float:
    """DeepSpeed's ring all-reduce: its NVLink and NIC bytes at once (the slower sets it)."""
    (nbytes, steps), = stage.nic
    return rates.alpha_s * steps + max(nbytes / rates.nic_bps, stage.node / rates.nvlink_bps)


def model_rows(name: str, layout_of_model, bucket_size: int, b: float, nic_gbit: float = 400.0,
               nvlink_gbyte: float = 450.0, units: List[int] = None, rates: Optional[Rates] = None,
               pieces: int = NODE_PIECES, piece_min_elements: int = 1 << 22,
               carried_pieces: int = NODE_PIECES_CARRIED) -> List[dict]:
    """Per W and G: the busiest NIC's bytes of every scheme against DeepSpeed's, and the gradient
    time (``rates``; default: bandwidth only), two-level's as whole buckets with its stages one
    after another (``_serial``) and as the pipeline of ``pieces`` it runs; ZeRO-2's two-level
    also as one pipeline carried from bucket to bucket, of ``carried_pieces`` a bucket."""
    sizes, arrival = layout_of_model
    rows = []
    params = sum(sizes)
    rates = rates or Rates(nic_gbit * 1e9 / 8, nvlink_gbyte * 1e9)
    for world in WORLDS:
        runs = [r for r in bucket_runs_of(sizes, arrival, world, bucket_size) if r]  # empty reductions move nothing
        layout = [owners_of(r) for r in runs]
        owners_per_bucket = [len(o) for o in layout]
        rounds = rounds_of(sizes, units, world, bucket_size) if units is not None else []
        for per_node in PER_NODE:
            if per_node > world:
                continue
            nic_totals: Dict[str, float] = {}
            seconds: Dict[str, float] = {}

            def add(scheme: str, nbytes: float, secs: float) -> None:
                nic_totals[scheme] = nic_totals.get(scheme, 0.0) + nbytes
                seconds[scheme] = seconds.get(scheme, 0.0) + secs

            carried: List[Stage] = []  # every bucket's pieces in backward order: one pipeline over the step
            for kind, reductions in (("bucket", runs), ("round", rounds)):
                # a round brings a slot more runs of a piece than TorchComm sends one by one
                # (8-20 at W = 64, 60-140 at 512): its node stage gathers them; a bucket's do not
                gathered = kind == "round"
                for these in reductions:
                    whole = bucket_stages(owners_of(these), world, per_node, b, rates, gathered)
                    cut = [bucket_stages(o, world, per_node, b, rates, gathered)
                           for o in cut_pieces(these, pieces, piece_min_elements)]
                    if kind == "bucket":
                        for scheme, st in whole.items():
                            if scheme == "bf16":
                                add(scheme, nic_bytes(st), ring_seconds(st, rates))
                            elif scheme.startswith("two_level"):
                                add(scheme, nic_bytes(st), scheme_seconds([c[scheme] for c in cut], rates, True))
                                if scheme == "two_level_by_layout":
                                    carried += [bucket_stages(o, world, per_node, b, rates, gathered)[scheme]
                                                for o in cut_pieces(these, carried_pieces, piece_min_elements)]
                                add(scheme + "_serial", 0.0, scheme_seconds([st], rates, False))
                            else:
                                add(scheme, nic_bytes(st), scheme_seconds([st], rates, False))
                    else:  # ZeRO-1's balanced rounds: each direct (flat) or by_layout (two-level)
                        add("rounds", nic_bytes(whole["direct"]), scheme_seconds([whole["direct"]], rates, False))
                        if "two_level_by_layout" in whole:
                            add("two_level_rounds", nic_bytes(whole["two_level_by_layout"]),
                                scheme_seconds([c["two_level_by_layout"] for c in cut], rates, True))
                            add("two_level_rounds_serial", 0.0,
                                scheme_seconds([whole["two_level_by_layout"]], rates, False))
            if carried:  # gift.carry_buckets: one pipeline carried from bucket to bucket
                seconds["two_level_across"] = scheme_seconds(carried, rates, True)
                seconds.update({f"two_level_busy_{k}": v for k, v in busy_seconds(carried, rates).items()})
            base, base_s = nic_totals["bf16"], seconds["bf16"]
            biggest = max(sum(o.values()) for o in layout)
            row = {"model": name, "params": params, "world": world, "per_node": per_node,
                   "buckets": len(layout), "rounds": len(rounds), "owners_min": min(owners_per_bucket), "owners_max": max(owners_per_bucket),
                   "bf16_nic_gb": base / 1e9, "bf16_s": base_s,
                   **{f"{k}_vs_bf16": (v / base if base else float("nan")) for k, v in nic_totals.items()
                      if k != "bf16" and not k.endswith("_serial")},
                   **{f"{k}_time_vs_bf16": (v / base_s if base_s else float("nan")) for k, v in seconds.items()
                      if k != "bf16"},
                   # what the new exchange holds while a bucket is reduced: flat relay, its chunk sums;
                   # two-level, the node partial of its slot's share (fp32) and the relay's chunk sums
                   "relay_hold_gb": 4 * biggest / world / 1e9,
                   "two_level_hold_gb": 4 * biggest / per_node / 1e9 + 4 * biggest / world / 1e9,
                   "relay_ef_gb": 4 * params / world / 1e9}
            rows.append(row)
    return rows


def traffic_rates(path: str, args, case: str = "fp8_e4m3/128", encode_op: str = "encode") -> Rates:
    """``Rates`` with the codec's counted traffic (``benchmarks/codec_traffic.py --json``, the
    ``case`` rows in ``--kernels`` mode): encode bytes and kernels per element (``encode_op``'s
    row where the file has one, else ``encode``'s: an fp32 input), and the decode-and-sum's bytes
    per element as a line in the senders S (fitted through its rows)."""
    rows = [r for r in json.loads(open(path).read())["rows"]
            if r["case"] in (case, f"relay {case}") and r["mode"] == args.kernels]
    if not rows:
        raise SystemExit(f"{path}: no {case} rows in {args.kernels} mode (codec_traffic.py --cases)")
    encode = next((r for r in rows if r["op"] == encode_op), None) or next(r for r in rows if r["op"] == "encode")
    decodes = sorted((int(r["op"].split("=")[1]), r["bytes_per_element"]) for r in rows
                     if r["op"].startswith("decode_sum"))
    if len(decodes) < 2:
        raise SystemExit(f"{path}: needs decode_sum rows of two sender counts at least")
    (s0, y0), (s1, y1) = decodes[0], decodes[-1]
    slope = (y1 - y0) / (s1 - s0)
    return Rates(args.nic_gbit * 1e9 / 8, args.nvlink_gbyte * 1e9, alpha_s=args.alpha_us * 1e-6,
                 a2a_s=args.a2a_us * 1e-6, hbm_bps=args.hbm_tbs * 1e12 * args.hbm_eff, launch_s=args.launch_us * 1e-6,
                 encode_bpe=encode["bytes_per_element"], encode_kernels=encode["kernels"], decode_a=y0 - slope * s0,
                 decode_b=slope, whiten_rank=args.whiten_rank, fp32_flops=args.fp32_tflops * 1e12 * args.fp32_eff,
                 encode_op=encode["op"])


def measured_rates(path: str, args) -> Rates:
    """``Rates`` with the codec's time measured on a GPU (``benchmarks/gpu_check.py --json``'s
    traffic rows, fp8_e4m3/128 in ``--kernels`` mode, one 2^24-element tile a call): each time
    taken as the bytes that would move in it at this model's copy rate (so the measurement holds
    whatever ``--hbm-tbs``), launches included (no kernel count added). The decode-and-sum was
    timed at one sender count S0 (7): its time is taken as proportional to S (S0 = 7 is W = 64
    in nodes of 8; other W extrapolate)."""
    data = json.loads(open(path).read())
    rows = {r["op"]: r for r in data.get("traffic", [])
            if r["case"] == "fp8_e4m3/128" and r["mode"] == args.kernels and "error" not in r}
    decode_op = next((op for op in rows if op.startswith("decode_sum")), None)
    if "encode" not in rows or decode_op is None:
        raise SystemExit(f"{path}: no fp8_e4m3/128 {args.kernels} encode and decode_sum rows in its traffic section")
    hbm = args.hbm_tbs * 1e12 * args.hbm_eff
    enc, dec = rows["encode"], rows[decode_op]
    senders = int(decode_op.split("=")[1])
    as_bytes = lambda r: r["us"] * 1e-6 / r["numel"] * hbm  # noqa: E731 (bytes per element at the model's rate)
    return Rates(args.nic_gbit * 1e9 / 8, args.nvlink_gbyte * 1e9, alpha_s=args.alpha_us * 1e-6,
                 a2a_s=args.a2a_us * 1e-6, hbm_bps=hbm, launch_s=0.0, encode_bpe=as_bytes(enc), encode_kernels=0,
                 decode_a=0.0, decode_b=as_bytes(dec) / senders, whiten_rank=args.whiten_rank,
                 fp32_flops=args.fp32_tflops * 1e12 * args.fp32_eff)


def main(argv=None) -> List[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", type=float, default=5e8, help="reduce_bucket_size (DeepSpeed's default 5e8)")
    parser.add_argument("--nic-gbit", type=float, default=400.0, help="NIC rate per GPU for the time columns")
    parser.add_argument("--nvlink-gbyte", type=float, default=450.0, help="NVLink GB/s each way per GPU")
    parser.add_argument("--node-pieces", type=int, default=NODE_PIECES,
                        help="gift.node_pieces bucket by bucket and in ZeRO-1's rounds (its default there)")
    parser.add_argument("--carried-pieces", type=int, default=NODE_PIECES_CARRIED,
                        help="gift.node_pieces for the pipeline carried from bucket to bucket (its default there)")
    parser.add_argument("--node-piece-min-elements", type=int, default=1 << 22, help="gift.node_piece_min_elements")
    parser.add_argument("--alpha-us", type=float, default=0.0,
                        help="latency per step of DeepSpeed's ring all-reduce, microseconds (0: bandwidth only)")
    parser.add_argument("--a2a-us", type=float, default=0.0,
                        help="latency per all-to-all of GIFT's, microseconds (0: bandwidth only)")
    c = parser.add_argument_group("GIFT's compute on the GPU (counted only with --codec-traffic or --codec-gpu)")
    c.add_argument("--codec-traffic", help="benchmarks/codec_traffic.py --json output: the codec's bytes and kernels")
    c.add_argument("--codec-gpu", help="benchmarks/gpu_check.py --json output from a GPU: the codec's time measured "
                                       "there instead of counted")
    c.add_argument("--kernels", choices=("compiled", "eager"), default="compiled", help="which mode's counts")
    c.add_argument("--hbm-tbs", type=float, default=3.35, help="GPU memory bandwidth, TB/s (H100 SXM; H200 4.8)")
    c.add_argument("--hbm-eff", type=float, default=0.8, help="of --hbm-tbs reached by a copy")
    c.add_argument("--launch-us", type=float, default=5.0, help="launch latency per kernel, microseconds")
    c.add_argument("--whiten-rank", type=int, default=32,
                   help="every element whitened by a rank-r factor on its way out and back (README's kfac rank)")
    c.add_argument("--fp32-tflops", type=float, default=67.0, help="fp32 matmul peak (the whitening)")
    c.add_argument("--fp32-eff", type=float, default=0.7, help="of --fp32-tflops reached")
    c.add_argument("--host-us", type=float, default=0.0,
                   help="host time per codec call, microseconds: an encode per section sent (and per tile past "
                        "one), a decode-and-sum per section received, a relay's two per owner's chunk, the node "
                        "stage's sum; the GPU runs a call's kernels only once the host has issued them "
                        "(benchmarks/codec_speed.py at a small --numel times a call; 0: not counted)")
    c.add_argument("--join-us", type=float, default=0.0,
                   help="with --host-us: the sections that are spans of one buffer encoded by one call a tile for "
                        "all of them and joined into their places, this many microseconds each: a rank's sections "
                        "to its owners where no layer is whitened (--whiten-rank 0; not a relay's first hop), a "
                        "relay's sums for their owners (codec_speed.py --sections times it; 0: a call per "
                        "section, as before the batched encode)")
    c.add_argument("--node-format", default=None, metavar="FORMAT/BLOCK",
                   help="gift.node_format (and node_block_size): two-level's node stage in this codec, e.g. int8/32 "
                        "(its bytes, and with --codec-traffic its counted work, from that file's rows of this codec, "
                        "which it must have; with --codec-gpu the main codec's measured work), not in the bucket's "
                        "dtype")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    b = get_format("fp8_e4m3").nbytes(1 << 24) / (1 << 24)
    if args.codec_gpu:
        rates = measured_rates(args.codec_gpu, args)
    elif args.codec_traffic:
        rates = traffic_rates(args.codec_traffic, args)
    else:
        rates = Rates(args.nic_gbit * 1e9 / 8, args.nvlink_gbyte * 1e9, alpha_s=args.alpha_us * 1e-6,
                      a2a_s=args.a2a_us * 1e-6)
    rates.host_call_s = args.host_us * 1e-6
    rates.section_join_s = args.join_us * 1e-6
    node_work = ""
    if args.node_format:
        if not rates.hbm_bps:
            raise SystemExit("--node-format needs the codec's work counted: --codec-traffic or --codec-gpu")
        name, _, block = args.node_format.partition("/")
        node = get_format(name, block_size=int(block) if block else None)
        rates.node_bpe = node.nbytes(1 << 24) / (1 << 24)
        label = f"{name}/{node.block_size}" if node.block_size else name
        if args.codec_traffic and not args.codec_gpu:
            # the node stage encodes the bucket's parts as they lie: a bf16 model's bf16 (the
            # file's "encode bf16" row, where it has one)
            rates.node_codec = traffic_rates(args.codec_traffic, args, label, encode_op="encode bf16")
            node_work = (f"its own counted work, its encode the {rates.node_codec.encode_op!r} row"
                         + ("" if rates.node_codec.encode_op == "encode bf16" else " (an fp32 input)"))
        else:
            node_work = "fp8_e4m3/128's measured work"
        node_work = f"the node stage in {label}, {rates.node_bpe:.4g} B an element ({node_work})"
    rows = []
    for name, config in MODELS.items():
        rows += model_rows(name, parameter_layout(config), int(args.bucket), b, args.nic_gbit, args.nvlink_gbyte,
                           units=parameter_units(config), rates=rates, pieces=args.node_pieces,
                           carried_pieces=args.carried_pieces,
                           piece_min_elements=args.node_piece_min_elements)

    def ratio(r, key):
        return f"{r[key]:.2f}x" if key in r else "-"

    print(f"reduce_bucket_size {args.bucket:.0e}; FP8 e4m3 block 128 at {b:.4f} B/element; per step")
    print("\nBusiest NIC's received bytes against DeepSpeed's bf16 all-reduce (NVLink not counted):")
    print("| model | W | G | buckets | owners per bucket | bf16 GB/NIC | flat direct | flat relay | flat by_layout |"
          " two-level direct | two-level owner_slot | two-level balanced | two-level by_layout |"
          " ZeRO-1 rounds | ZeRO-1 rounds two-level |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows_with_nics(rows):
        cells = [ratio(r, k + "_vs_bf16") for k in ("direct", "relay", "by_layout", "two_level_direct",
                                                    "two_level_owner_slot", "two_level_balanced",
                                                    "two_level_by_layout", "rounds", "two_level_rounds")]
        print(f"| {r['model']} | {r['world']} | {r['per_node']} | {r['buckets']} | {r['owners_min']}-{r['owners_max']} | "
              f"{r['bf16_nic_gb']:.2f} | {' | '.join(cells)} |")
    counted = "GIFT's compute not counted"
    if args.codec_gpu:
        counted = (f"GIFT's compute counted: fp8_e4m3/128 {args.kernels} codec times measured on a GPU "
                   f"({args.codec_gpu}), whitening rank {args.whiten_rank} at {args.fp32_tflops:g} TFLOPS x "
                   f"{args.fp32_eff:g}")
    elif args.codec_traffic:
        counted = (f"GIFT's compute counted: fp8_e4m3/128 {args.kernels} traffic at {args.hbm_tbs:g} TB/s x "
                   f"{args.hbm_eff:g}, {args.launch_us:g} us a kernel, whitening rank {args.whiten_rank} at "
                   f"{args.fp32_tflops:g} TFLOPS x {args.fp32_eff:g}")
    if node_work:
        counted += "; " + node_work
    if args.host_us:
        counted += f"; {args.host_us:g} us of host time a codec call"
        if args.join_us:
            counted += f", spans one call a piece and {args.join_us:g} us each to join"
    print(f"\nGradient time against DeepSpeed's ({args.nic_gbit:g} Gbit/s NIC, {args.nvlink_gbyte:g} GB/s NVLink per "
          f"GPU, {args.alpha_us:g} us a ring step, {args.a2a_us:g} us an all-to-all; {counted}); two-level as whole "
          f"buckets with its stages one after another (serial) and as the pipeline of gift.node_pieces "
          f"{args.node_pieces} (pieces of at least {args.node_piece_min_elements} elements), and what the new exchange "
          "holds per GPU:")
    print("| model | W | G | bf16 ms | flat by_layout | two-level by_layout serial | two-level by_layout |"
          " ZeRO-1 rounds | ZeRO-1 rounds two-level serial | ZeRO-1 rounds two-level | holds GB (+EF residuals) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    tables = rows_with_nics(rows)
    for r in tables:
        cells = [ratio(r, k + "_time_vs_bf16") for k in ("by_layout", "two_level_by_layout_serial",
                                                         "two_level_by_layout", "rounds", "two_level_rounds_serial",
                                                         "two_level_rounds")]
        hold = r["two_level_hold_gb"] if r["per_node"] > 1 else r["relay_hold_gb"]
        print(f"| {r['model']} | {r['world']} | {r['per_node']} | {1e3 * r['bf16_s']:.1f} | {' | '.join(cells)} | "
              f"{hold:.2f} (+{r['relay_ef_gb']:.2f}) |")
    print("\nZeRO-2's two-level by_layout as one pipeline carried from bucket to bucket (gift.carry_buckets under "
          "overlap_comm: a bucket's last pieces still crossing the NICs while the next bucket's first are in their "
          "node stage), against each bucket's own pipeline (carry_buckets false, or overlap_comm false), and the "
          f"busy time of each resource over the step, carried (no pipeline beats the largest); pieces a bucket: "
          f"{args.node_pieces} bucket by bucket, {args.carried_pieces} carried:")
    print("| model | W | G | bucket by bucket | carried (default) | node links busy | NICs busy | GPU busy |"
          " host busy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in tables:
        if "two_level_across_time_vs_bf16" in r:
            cells = [ratio(r, k + "_time_vs_bf16") for k in ("two_level_by_layout", "two_level_across",
                                                             "two_level_busy_nv", "two_level_busy_nic",
                                                             "two_level_busy_gpu", "two_level_busy_host")]
            print(f"| {r['model']} | {r['world']} | {r['per_node']} | {' | '.join(cells)} |")
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
