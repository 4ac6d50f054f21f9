"""Telemetry: one record per optimizer step, built from the step's counters (``StepStats``),
kept in ``engine.gift.records``, written to ``telemetry.jsonl`` (rank 0) and to DeepSpeed's
monitor. ``TELEMETRY_KEYS`` is the schema: every key a record may hold, with what it means;
tests check records against it, and docs/telemetry.md is generated from it."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from .config import Hierarchy
from .exchange.stats import StepStats

TELEMETRY_KEYS: Dict[str, str] = {
    "step": "the optimizer step (gift.start_step included)",
    "bytes_payload": "gradient payload this rank sent (scales included)",
    "bytes_scales": "the scales inside bytes_payload",
    "bytes_header": "control headers",
    "bytes_geometry": "statistics and factors shared for geometry",
    "elements_sent": "gradient elements sent, once per destination",
    "bytes_per_elem": "this step: everything sent per gradient element sent",
    "bytes_per_elem_run": "the same since the start",
    "ratio_to_bf16": "bytes_per_elem / 2",
    "hierarchy": "flat or two_level",
    "bytes_recv_max": "gradient bytes the busiest rank received (each collective's largest, summed)",
    "bytes_recv_max_internode": "the same, of what arrives from other nodes",
    "relay_buckets": "buckets that took the relay route (two-level: in any of their pieces)",
    "rounds": "ZeRO-1 (gift.stage1_rounds): balanced rounds the step's reduction ran in, in place of DeepSpeed's buckets",
    "bytes_internode": "payload + headers this rank sent to ranks of other nodes",
    "geometry_version": "refreshes so far",
    "geometry_layers": "layers whose transform is in use",
    "geometry_s": "seconds in the geometry's own work this step: input statistics, refits, judgement (CPU runs: on an accelerator the hooks return before their kernels run)",
    "transform_s": "seconds in transforms and their inverse (timed steps)",
    "codec_s": "seconds encoding, decoding and summing (timed steps)",
    "comm_s": "seconds in the exchange's collectives (timed steps)",
    "bytes_node": "two-level: bytes sent inside the node",
    "balanced_buckets": "two-level: buckets split evenly over the node's ranks (in any of their pieces)",
    "pieces": "two-level: pieces the buckets were cut into, their node stages overlapped with the exchange among nodes",
    "carried_buckets": "two-level: buckets whose last pieces finished during the next bucket's reduction (overlap_comm)",
    "node_s": "two-level: seconds in the stages inside the node (timed steps)",
    "geometry_kinds": "with several kinds: layers on each",
    "params_bytes": "gift.params: bytes of the parameter all-gather",
    "params_bytes_internode": "gift.params: of them to other nodes",
    "params_bytes_per_elem": "the parameter all-gather per element (DeepSpeed's own: the replicas' itemsize)",
    "params_gap_rel": "gift.params, sampled: the largest replica-target gap, relative to its block",
    "params_exact": "gift.params: this step's gather was exact (a resync)",
    "params_s": "gift.params: seconds in the gather (timed steps)",
    "bytes_per_elem_total": "gradients, geometry and parameters per element and step",
    "error_feedback_bytes": "memory held by error-feedback residuals",
    "fidelity_rel_err": "sampled: relative L2 error against an exact fp32 reduction",
    "fidelity_bytes": "sampled: fp32 bytes sent for that check",
    "saturated": "sampled: measured elements at the format's largest code",
    "underflow": "sampled: measured nonzero elements that decoded to zero",
    "nonfinite": "sampled: measured nan/inf elements in the codec's input (and in this rank's own sections, whole)",
    "quantized": "sampled: elements measured: of each quantized section an evenly strided sample of whole blocks, at most 2^20 (exchange.encode.QUANT_SAMPLE_ELEMENTS)",
    "underflow_rate": "sampled: underflow / quantized",
    "profile_layers": "judging refresh: layers selected",
    "profile_judged": "judging refresh: layers judged",
    "update_metric": "judging refresh: the optimizer's metric (muon, adam, adam+muon, l2)",
    "profile_l2": "judging refresh: mean relative error in plain L2, coordinates in use",
    "profile_whitened": "the same in whitened coordinates",
    "profile_update": "the same in the optimizer's update",
    "profile_l2_euclid": "profile_l2 with every layer Euclidean",
    "profile_whitened_euclid": "profile_whitened with every layer Euclidean",
    "profile_update_euclid": "profile_update with every layer Euclidean",
    "profile_per_layer": "judging refresh: each layer's errors, selection and kind",
    "profile_experts": "judging refresh, DeepSpeed-MoE: each expert group's profile (the fields above)",
}


def step_record(k: int, t: StepStats, *, start_step: int, hierarchy: str, geometry,
                run_totals: Dict[str, float], replica_itemsize: Optional[int], error_feedback_bytes: Optional[int],
                profile: Optional[dict], expert_profiles: Optional[Dict[str, dict]] = None,
                geometry_s: Optional[float] = None) -> dict:
    """The record of step ``k`` from its summed counters; ``run_totals`` (bytes and elements since
    the start) is updated here."""
    sent, elements, geometry_bytes = t.bytes_sent, t.elements_sent, t.bytes_geometry
    run_totals["bytes"] += sent + geometry_bytes
    run_totals["elements"] += elements
    in_use = geometry.whiteners  # a dict built per call: once per step here
    record = {
        "step": k + start_step,
        "bytes_payload": t.bytes_main + t.bytes_high,
        "bytes_scales": t.bytes_scales,
        "bytes_header": t.bytes_header,
        "bytes_geometry": int(geometry_bytes),
        "elements_sent": int(elements),
        "bytes_per_elem": (sent + geometry_bytes) / elements if elements else 0.0,
        "bytes_per_elem_run": run_totals["bytes"] / run_totals["elements"] if run_totals["elements"] else 0.0,
        "hierarchy": Hierarchy(hierarchy).value,
        "bytes_recv_max": t.recv_max,
        "bytes_recv_max_internode": t.recv_max_internode,
        "relay_buckets": t.relay_buckets,
        "rounds": t.rounds,
        "bytes_internode": t.bytes_internode,  # flat: by the detected topology
        "geometry_version": geometry.version,
        "geometry_layers": len(in_use),
    }
    if t.timed:  # seconds only where they time the work (see StepStats.timed)
        record.update(transform_s=t.transform_s, codec_s=t.codec_s, comm_s=t.comm_s)
    if geometry_s is not None:
        record["geometry_s"] = geometry_s
    if hierarchy == Hierarchy.TWO_LEVEL:
        record["bytes_node"] = t.bytes_node
        record["balanced_buckets"] = t.balanced_buckets
        record["pieces"] = t.pieces
        record["carried_buckets"] = t.carried_buckets
        if t.timed:
            record["node_s"] = t.node_s
    if len(geometry.kinds) > 1:
        kinds = [geometry.active[n] for n in in_use]
        record["geometry_kinds"] = {kind: kinds.count(kind) for kind in geometry.kinds}
    record["ratio_to_bf16"] = record["bytes_per_elem"] / 2.0
    if t.params_elements:
        record["params_bytes"] = t.params_bytes
        record["params_bytes_internode"] = t.params_bytes_internode
        record["params_bytes_per_elem"] = t.params_bytes / t.params_elements
        if t.params_gap_rel is not None:
            record["params_gap_rel"] = t.params_gap_rel
        record["params_exact"] = bool(t.params_exact_steps)
        if t.timed:
            record["params_s"] = t.params_codec_s + t.params_comm_s
    elif replica_itemsize is not None:  # DeepSpeed's own all-gather: the replica's dtype per element
        record["params_bytes_per_elem"] = float(replica_itemsize)
    if "params_bytes_per_elem" in record:
        # per element of the model and step: gradients (and geometry) out, parameters back
        record["bytes_per_elem_total"] = record["bytes_per_elem"] + record["params_bytes_per_elem"]
    if error_feedback_bytes is not None:
        record["error_feedback_bytes"] = error_feedback_bytes
    if t.fidelity_ref_sq:
        record["fidelity_rel_err"] = (t.fidelity_err_sq / t.fidelity_ref_sq) ** 0.5
    if t.bytes_fidelity:
        record["fidelity_bytes"] = t.bytes_fidelity
    if t.sampled:
        record.update(saturated=t.saturated, underflow=t.underflow, nonfinite=t.nonfinite, quantized=t.quantized)
    if t.quantized:
        record["underflow_rate"] = t.underflow / t.quantized
    if profile:
        record.update(profile)
    if expert_profiles:
        record["profile_experts"] = expert_profiles
    return record


class TelemetryLog:
    """Where records go: the last 1000 in memory, rank 0's JSONL file, DeepSpeed's monitor."""

    KEEP = 1000

    def __init__(self, jsonl: Optional[str], rank: int, monitor: bool, writer: Optional[int] = None) -> None:
        """``writer``: the global rank of this data-parallel group's rank 0 where the group is one of
        several (its file is then named by it, see ``TelemetryConfig.jsonl``); None: the whole job."""
        self.records: List[dict] = []
        self.rank = rank
        self.monitor = monitor
        if jsonl and writer is not None:
            stem, ext = os.path.splitext(jsonl)
            jsonl = f"{stem}.rank{writer}{ext}"
        self.path = jsonl if rank == 0 else None
        self._file = open(jsonl, "a", buffering=1) if jsonl and rank == 0 else None

    def write(self, record: dict, engine) -> None:
        unknown = record.keys() - TELEMETRY_KEYS.keys()
        if unknown:  # the schema is the one list of keys: a key written ad hoc is a bug here
            raise RuntimeError(f"deepspeed_gift: telemetry keys {sorted(unknown)} are not in TELEMETRY_KEYS")
        self.records.append(record)
        if len(self.records) > self.KEEP:
            del self.records[:-self.KEEP]
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        monitor = getattr(engine, "monitor", None)
        if self.monitor and monitor is not None and getattr(monitor, "enabled", False) and self.rank == 0:
            events = [(f"Gift/{key}", float(v), engine.global_samples) for key, v in record.items()
                      if key != "step" and isinstance(v, (int, float))]
            monitor.write_events(events)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
