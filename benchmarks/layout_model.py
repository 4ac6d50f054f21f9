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
(G-1)/G max N_d 2 B. The time columns count DeepSpeed's ring with its NVLink and NIC traffic at
once (the slower link sets it) and GIFT's stages one after the other, as they run. Memory the
new exchange holds per GPU while a bucket is reduced: flat, the relay's chunk sums (4 N/W B);
two-level, the fp32 node partial of its slot's share (4 N/G B) and the chunk sums; with error
feedback, the relayed residuals too (4/W B per parameter).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.results import write_json  # noqa: E402
from deepspeed_gift.core.formats import get_format  # noqa: E402

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


def buckets_of(sizes: List[int], arrival: List[int], world: int, bucket_size: int) -> List[Dict[int, int]]:
    """Per bucket (in reduction order), elements per owning partition, by DeepSpeed's rules."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += n
    align = 2 * world
    partition = -(-pos // align) * align // world
    out: List[Dict[int, int]] = []
    current: Dict[int, int] = {}
    filled = 0

    def add(start: int, n: int, into: Dict[int, int]) -> None:
        while n > 0:
            d = start // partition
            take = min(n, (d + 1) * partition - start)
            into[d] = into.get(d, 0) + take
            start, n = start + take, n - take

    # DeepSpeed's rule (stage_1_and_2's reduce_independent_p_g_buckets_and_remove_grads): a
    # gradient that would take the bucket past its size first reduces the bucket (an empty one
    # too), then joins it; so a parameter larger than a bucket is reduced alone when the next
    # gradient arrives, and the bucket left at the end of the backward is reduced then.
    for start, n in ((offsets[i], sizes[i]) for i in arrival):
        if filled + n > bucket_size:
            out.append(current)
            current, filled = {}, 0
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


def rounds_of(sizes: List[int], units: List[int], world: int, bucket_size: int) -> List[Dict[int, int]]:
    """ZeRO-1's balanced rounds (``gift.stage1_rounds``), as the plugin plans them
    (``deepspeed_gift.exchange.rounds.plan_rounds`` on DeepSpeed's partitions): per round,
    elements per owning partition."""
    from deepspeed_gift.exchange.rounds import OwnedParam, contiguous_runs, plan_rounds

    align = 2 * world
    partition = -(-sum(sizes) // align) * align // world
    params = [OwnedParam(key, numel, runs, unit)
              for key, (numel, unit, runs) in enumerate(zip(sizes, units, contiguous_runs(sizes, partition)))]
    out = []
    for rnd in plan_rounds(params, world, bucket_size):
        owners: Dict[int, int] = {}
        for piece in rnd.pieces:
            owners[piece.owner] = owners.get(piece.owner, 0) + piece.numel
        out.append(owners)
    return out


def bucket_link_bytes(owners: Dict[int, int], world: int, per_node: int, b: float) -> Dict[str, Tuple[float, float]]:
    """Per scheme, (bytes into the busiest NIC, bytes into the busiest GPU over NVLink in stages
    that run before or after the NIC's) of one bucket (see the module docstring)."""
    n, biggest = sum(owners.values()), max(owners.values(), default=0)
    g = min(per_node, world)
    nodes = world // g
    off_node = world - g
    ring = 2 * (world - 1) / world * n * 2 / (g if nodes > 1 else 1) if nodes > 1 else 0.0
    direct = off_node * biggest * b
    relay = off_node / world * n * b + off_node / world * biggest * b
    out = {"bf16": (ring, 0.0), "direct": (direct, 0.0), "relay": (relay, 0.0), "by_layout": (min(direct, relay), 0.0)}
    if g > 1 and nodes > 1:
        slots: Dict[int, int] = {}
        per_owner_node: Dict[int, int] = {}
        for d, m in owners.items():
            slots[d % g] = slots.get(d % g, 0) + m
            per_owner_node[d // g] = per_owner_node.get(d // g, 0) + m
        busiest_slot, busiest_node = max(slots.values(), default=0), max(per_owner_node.values(), default=0)
        k = (nodes - 1) / nodes
        # owner_slot: each slot carries what its owners hold; the node stage sums it into that slot
        stage = (g - 1) * busiest_slot * 2
        two_direct = (nodes - 1) * biggest * b
        two_relay = k * busiest_slot * b + k * biggest * b
        # balanced: every slot carries 1/g of each node's part; results handed to their owners after
        even_stage, forward = (g - 1) * n / g * 2, (g - 1) / g * biggest * 2
        even_direct = (nodes - 1) * busiest_node / g * b
        even_relay = k * n / g * b + k * busiest_node / g * b
        relay_ok = nodes > 2  # a relay among two nodes is the direct route
        owner_slot = min(two_direct, two_relay) if relay_ok else two_direct
        balanced = min(even_direct, even_relay) if relay_ok else even_direct
        out.update(two_level_direct=(two_direct, stage),
                   two_level_owner_slot=(owner_slot, stage),
                   two_level_balanced=(balanced, even_stage + forward))
        # by_layout: the split whose busiest NIC receives less (owner_slot on a tie)
        out["two_level_by_layout"] = out["two_level_balanced"] if balanced < owner_slot else out["two_level_owner_slot"]
    return out


def bucket_seconds(scheme: str, nic: float, nvlink: float, n: int, world: int, per_node: int, nic_bps: float,
                   nvlink_bps: float) -> float:
    """Bandwidth time of one bucket: DeepSpeed's ring moves its NVLink and NIC bytes at once (the
    slower sets the time: its NVLink share is (G-1)/G of what a GPU sends around the ring); GIFT's
    two-level stages run one after the other (node stage, exchange among nodes, forwards)."""
    if scheme == "bf16":
        g = min(per_node, world)
        ring_nvlink = 2 * (world - 1) / world * n * 2 * (g - 1) / g
        return max(nic / nic_bps, ring_nvlink / nvlink_bps)
    return nic / nic_bps + nvlink / nvlink_bps


def model_rows(name: str, layout_of_model, bucket_size: int, b: float, nic_gbit: float = 400.0,
               nvlink_gbyte: float = 450.0, units: List[int] = None) -> List[dict]:
    sizes, arrival = layout_of_model
    rows = []
    params = sum(sizes)
    nic_bps, nvlink_bps = nic_gbit * 1e9 / 8, nvlink_gbyte * 1e9
    for world in WORLDS:
        layout = buckets_of(sizes, arrival, world, bucket_size)
        layout = [o for o in layout if o]  # empty reductions move nothing
        owners_per_bucket = [len(o) for o in layout]
        rounds = rounds_of(sizes, units, world, bucket_size) if units is not None else []
        for per_node in PER_NODE:
            if per_node > world:
                continue
            nic_totals: Dict[str, float] = {}
            seconds: Dict[str, float] = {}
            for owners in layout:
                for scheme, (nic, nvlink) in bucket_link_bytes(owners, world, per_node, b).items():
                    nic_totals[scheme] = nic_totals.get(scheme, 0.0) + nic
                    seconds[scheme] = seconds.get(scheme, 0.0) + bucket_seconds(
                        scheme, nic, nvlink, sum(owners.values()), world, per_node, nic_bps, nvlink_bps)
            for owners in rounds:  # ZeRO-1's balanced rounds: each direct (flat) or by_layout (two-level)
                schemes = bucket_link_bytes(owners, world, per_node, b)
                for scheme, key in (("rounds", "direct"), ("two_level_rounds", "two_level_by_layout")):
                    if key in schemes:
                        nic, nvlink = schemes[key]
                        nic_totals[scheme] = nic_totals.get(scheme, 0.0) + nic
                        seconds[scheme] = seconds.get(scheme, 0.0) + bucket_seconds(
                            scheme, nic, nvlink, sum(owners.values()), world, per_node, nic_bps, nvlink_bps)
            base, base_s = nic_totals["bf16"], seconds["bf16"]
            biggest = max(sum(o.values()) for o in layout)
            row = {"model": name, "params": params, "world": world, "per_node": per_node,
                   "buckets": len(layout), "rounds": len(rounds), "owners_min": min(owners_per_bucket), "owners_max": max(owners_per_bucket),
                   "bf16_nic_gb": base / 1e9, "bf16_s": base_s,
                   **{f"{k}_vs_bf16": (v / base if base else float("nan")) for k, v in nic_totals.items() if k != "bf16"},
                   **{f"{k}_time_vs_bf16": (v / base_s if base_s else float("nan")) for k, v in seconds.items()
                      if k != "bf16"},
                   # what the new exchange holds while a bucket is reduced: flat relay, its chunk sums;
                   # two-level, the node partial of its slot's share (fp32) and the relay's chunk sums
                   "relay_hold_gb": 4 * biggest / world / 1e9,
                   "two_level_hold_gb": 4 * biggest / per_node / 1e9 + 4 * biggest / world / 1e9,
                   "relay_ef_gb": 4 * params / world / 1e9}
            rows.append(row)
    return rows


def main(argv=None) -> List[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", type=float, default=5e8, help="reduce_bucket_size (DeepSpeed's default 5e8)")
    parser.add_argument("--nic-gbit", type=float, default=400.0, help="NIC rate per GPU for the time columns")
    parser.add_argument("--nvlink-gbyte", type=float, default=450.0, help="NVLink GB/s each way per GPU")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    b = get_format("fp8_e4m3").nbytes(1 << 24) / (1 << 24)
    rows = []
    for name, config in MODELS.items():
        rows += model_rows(name, parameter_layout(config), int(args.bucket), b, args.nic_gbit, args.nvlink_gbyte,
                           units=parameter_units(config))

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
    print(f"\nGradient time against DeepSpeed's (bandwidth only; {args.nic_gbit:g} Gbit/s NIC, "
          f"{args.nvlink_gbyte:g} GB/s NVLink per GPU; two-level's NVLink stages not overlapped with its NICs),"
          " and what the new exchange holds per GPU:")
    print("| model | W | G | bf16 ms | flat by_layout | two-level direct | two-level by_layout | ZeRO-1 rounds |"
          " ZeRO-1 rounds two-level | holds GB (+EF residuals) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows_with_nics(rows):
        cells = [ratio(r, k + "_time_vs_bf16") for k in ("by_layout", "two_level_direct", "two_level_by_layout",
                                                         "rounds", "two_level_rounds")]
        hold = r["two_level_hold_gb"] if r["per_node"] > 1 else r["relay_hold_gb"]
        print(f"| {r['model']} | {r['world']} | {r['per_node']} | {1e3 * r['bf16_s']:.1f} | {' | '.join(cells)} | "
              f"{hold:.2f} (+{r['relay_ef_gb']:.2f}) |")
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
