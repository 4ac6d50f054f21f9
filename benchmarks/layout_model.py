"""    .venv/bin/python benchmarks/layout_model.py [--bucket 5e8] [--json out.json]

The gradient exchange of real model layouts, bucket by bucket, as DeepSpeed ZeRO-1/2 lays
them out: the busiest NIC's received bytes per step for DeepSpeed's bf16 all-reduce and for
GIFT FP8 by route, at W = 8 / 64 / 512 GPUs with G = 1 and 8 per node (one NIC each).

The layout is built from the models' definitions, not assumed balanced:
- parameters: HF ``LlamaForCausalLM`` on the meta device (~1B: TinyLlama-1.1B's shape, 7B and
  13B: Llama-2's), in ``model.parameters()`` order, one parameter group;
- partitions: DeepSpeed flattens the group padded to a multiple of 2 W elements and gives rank r
  the contiguous r-th W-th;
- buckets: gradients in the order a backward produces them (a forward and backward of the
  model on the meta device, with the hooks ZeRO uses), a bucket reduced when the next gradient
  would take it past ``reduce_bucket_size`` (default 5e8), a larger parameter reduced alone.
  ``tests/test_route.py`` checks this layout against what real engines hand GIFT.

Per bucket of N elements with N_d on owner d, bytes received through the busiest NIC (b: FP8
e4m3 per-block bytes per element; a rank's messages to ranks on its own node take NVLink):
- DeepSpeed bf16, ring all-reduce of the bucket (``use_multi_rank_bucket_allreduce``):
  2 (W-1)/W N 2 B, the G rings of a node sharing its G NICs (/G when the job spans nodes);
- GIFT direct: owner d receives its part from the W - G ranks off its node: (W-G) N_d b;
- GIFT relay: chunk j of every owner's part to rank j, then the sums to the owners:
  (W-G)/W N b + (W-G)/W max N_d b;
- GIFT by_layout: the smaller of the two, per bucket;
- GIFT two-level (G > 1): the node stage on NVLink, then the exchange among the W/G nodes in
  each slot group; the slot of a part's owner carries it: direct (n-1) N_d b, relay
  (n-1)/n N_slot b + (n-1)/n N_d b for n nodes (N_slot: what the busiest slot carries).
Bandwidth only (no latency, no overlap): the ratio to bf16 is the ratio of gradient time when
the NICs are the limit. Memory the relay holds per GPU: its chunk sums while a bucket is
reduced (4 N/W B) and, with error feedback, the relayed residuals (4/W B per parameter).
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
from deepspeed_gift.formats import get_format  # noqa: E402

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


def bucket_nic_bytes(owners: Dict[int, int], world: int, per_node: int, b: float) -> Dict[str, float]:
    """Busiest-NIC received bytes of one bucket for every scheme (see the module docstring)."""
    n, biggest = sum(owners.values()), max(owners.values(), default=0)
    g = min(per_node, world)
    nodes = world // g
    off_node = world - g
    ring = 2 * (world - 1) / world * n * 2 / (g if nodes > 1 else 1) if nodes > 1 else 0.0
    direct = off_node * biggest * b
    relay = off_node / world * n * b + off_node / world * biggest * b
    out = {"bf16": ring, "direct": direct, "relay": relay, "by_layout": min(direct, relay)}
    if g > 1 and nodes > 1:
        slots: Dict[int, int] = {}
        for d, m in owners.items():
            slots[d % g] = slots.get(d % g, 0) + m
        busiest_slot = max(slots.values(), default=0)
        two_direct = (nodes - 1) * biggest * b
        two_relay = (nodes - 1) / nodes * busiest_slot * b + (nodes - 1) / nodes * biggest * b
        out.update(two_level_direct=two_direct,
                   two_level_by_layout=min(two_direct, two_relay) if nodes > 2 else two_direct)
    return out


def model_rows(name: str, layout_of_model, bucket_size: int, b: float) -> List[dict]:
    sizes, arrival = layout_of_model
    rows = []
    params = sum(sizes)
    for world in WORLDS:
        layout = buckets_of(sizes, arrival, world, bucket_size)
        layout = [o for o in layout if o]  # empty reductions move nothing
        owners_per_bucket = [len(o) for o in layout]
        for per_node in PER_NODE:
            if per_node > world:
                continue
            totals: Dict[str, float] = {}
            for owners in layout:
                for scheme, v in bucket_nic_bytes(owners, world, per_node, b).items():
                    totals[scheme] = totals.get(scheme, 0.0) + v
            base = totals["bf16"]
            row = {"model": name, "params": params, "world": world, "per_node": per_node,
                   "buckets": len(layout), "owners_min": min(owners_per_bucket), "owners_max": max(owners_per_bucket),
                   "bf16_nic_gb": base / 1e9,
                   **{f"{k}_vs_bf16": (v / base if base else float("nan")) for k, v in totals.items() if k != "bf16"},
                   "relay_hold_gb": 4 * max(sum(o.values()) for o in layout) / world / 1e9,
                   "relay_ef_gb": 4 * params / world / 1e9}
            rows.append(row)
    return rows


def main(argv=None) -> List[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", type=float, default=5e8, help="reduce_bucket_size (DeepSpeed's default 5e8)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    b = get_format("fp8_e4m3").nbytes(1 << 24) / (1 << 24)
    rows = []
    for name, config in MODELS.items():
        rows += model_rows(name, parameter_layout(config), int(args.bucket), b)
    print(f"reduce_bucket_size {args.bucket:.0e}; FP8 e4m3 block 128 at {b:.4f} B/element; busiest NIC, per step")
    print("| model | W | G | buckets | owners per bucket | bf16 GB/NIC | direct | relay | by_layout | two-level direct |"
          " two-level by_layout | relay holds GB (+EF) |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if not r["bf16_nic_gb"]:  # one node: nothing crosses a NIC
            continue
        ratio = [f"{r[k]:.2f}x" if k in r else "-" for k in ("direct_vs_bf16", "relay_vs_bf16", "by_layout_vs_bf16",
                                                            "two_level_direct_vs_bf16", "two_level_by_layout_vs_bf16")]
        print(f"| {r['model']} | {r['world']} | {r['per_node']} | {r['buckets']} | {r['owners_min']}-{r['owners_max']} | "
              f"{r['bf16_nic_gb']:.2f} | {' | '.join(ratio)} | {r['relay_hold_gb']:.2f} (+{r['relay_ef_gb']:.2f}) |")
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
