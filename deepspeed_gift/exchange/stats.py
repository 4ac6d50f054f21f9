"""Byte accounting: what bytes are for (:class:`ByteKind`), and what one step's gradient
reduction, geometry and parameter all-gather did on this rank: one typed record that every
bucket adds into and telemetry reads (pure: no torch.distributed)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, fields
from typing import Optional


class ByteKind(str, enum.Enum):
    """What bytes on the wire are for. A comm meters every collective it runs by kind
    (``Comm.bytes_sent``); the step's record (:class:`StepStats`) takes its figures from the
    encoders, and the geometry's from the meter (tests check the two against each other)."""

    PAYLOAD = "payload"  # gradient payloads of the exchange among ranks (or nodes)
    NODE = "node"  # two-level: inside the node (node stage, forwards)
    GEOMETRY = "geometry"  # statistics, sketches and factors
    CONTROL = "control"  # fingerprints, topology, profile tables
    TELEMETRY = "telemetry"  # the fidelity check's exact reduction of a sample
    PARAMS = "params"  # the compressed parameter all-gather
    PARAMS_NODE = "params_node"  # the same inside the node


@dataclass
class StepStats:
    """Counters of one rank over one step (or one bucket; :meth:`add` sums them).

    Bytes are what this rank sent, counted once per destination; seconds are wall time on
    this rank. Fields marked "sampled" are only counted on telemetry's fidelity steps."""

    # the gradient reduction
    elements: int = 0  # gradient elements of every section this rank reduced
    elements_sent: int = 0  # elements this rank put on the wire, once per destination
    bytes_main: int = 0  # payload of quantized sections (scales included)
    bytes_high: int = 0  # payload of sections in the high-precision format
    bytes_scales: int = 0  # the scales inside bytes_main
    bytes_header: int = 0  # control headers
    bytes_internode: int = 0  # payload + headers to ranks of other nodes
    bytes_node: int = 0  # two-level: the node stage (bucket dtype, inside the node)
    recv_max: int = 0  # gradient bytes the busiest rank received (each collective's largest receive, summed)
    relay_buckets: int = 0  # buckets reduced by the relay route (two balanced all-to-alls)
    rounds: int = 0  # ZeRO-1 balanced rounds (gift.stage1_rounds), in place of DeepSpeed's buckets
    recv_max_internode: int = 0  # the same, of the messages that cross between nodes
    balanced_buckets: int = 0  # two-level: buckets split over the node's ranks in equal runs (any piece)
    pieces: int = 0  # two-level: pieces the buckets were cut into for the pipeline of stages
    carried_buckets: int = 0  # two-level: buckets whose last pieces finished during the next bucket's reduction
    bytes_geometry: int = 0  # statistics, sketches and factors (the comm's GEOMETRY meter, once per step)
    transform_s: float = 0.0
    codec_s: float = 0.0
    comm_s: float = 0.0
    node_s: float = 0.0
    sampled: bool = False  # the counters below were taken on this step
    timed: bool = True  # the seconds are the work's (the host, or a device synchronized: sampled steps);
    # False: an accelerator's ordinary step, where they would time the queueing of kernels only
    quantized: int = 0  # sampled: elements through a quantizing codec
    underflow: int = 0  # sampled: nonzero elements that decoded to zero
    saturated: int = 0  # sampled: elements at the format's largest code
    nonfinite: int = 0  # sampled: nan/inf elements in the codec's input
    fidelity_err_sq: float = 0.0  # sampled: |GIFT's reduction - an exact fp32 one|^2
    fidelity_ref_sq: float = 0.0  # sampled: |exact fp32 reduction|^2
    bytes_fidelity: int = 0  # sampled: fp32 bytes this rank sent for the exact reduction of the sample
    # the parameter all-gather (gift.params)
    params_elements: int = 0  # parameter elements received (world - 1 partitions)
    params_bytes: int = 0
    params_bytes_internode: int = 0
    params_codec_s: float = 0.0
    params_comm_s: float = 0.0
    params_exact_steps: int = 0  # gathers done exactly (DeepSpeed's own: resync or passthrough)
    params_gap_rel: Optional[float] = None  # the largest replica-target gap measured; None: not measured

    def add(self, other: "StepStats") -> "StepStats":
        """Add ``other`` into this record (the gap takes the max, ``sampled`` the or); returns self."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "params_gap_rel":
                value = theirs if mine is None else mine if theirs is None else max(mine, theirs)
            elif f.name == "sampled":
                value = mine or theirs
            elif f.name == "timed":
                value = mine and theirs
            else:
                value = mine + theirs
            setattr(self, f.name, value)
        return self

    @property
    def bytes_sent(self) -> int:
        """Gradient bytes this rank sent across data-parallel ranks (payload and headers)."""
        return self.bytes_main + self.bytes_high + self.bytes_header


def clock(device, synchronize: bool) -> float:
    """``time.perf_counter()``, first waiting for the work queued on ``device`` when it has a
    queue (an accelerator) and ``synchronize``: seconds that time the work, not its queueing."""
    if synchronize and device.type != "cpu":
        import torch

        getattr(torch, device.type).synchronize(device)
    return time.perf_counter()
