"""Telemetry's keys have one definition (``deepspeed_gift.telemetry.TELEMETRY_KEYS``): real
engines write only those, and docs/telemetry.md (generated from it) documents every one."""

import os

from deepspeed_gift.telemetry import TELEMETRY_KEYS
from launch.spawn import run_ranks
from tests.harness import train_many

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALWAYS = {"step", "bytes_payload", "bytes_scales", "bytes_header", "bytes_geometry", "elements_sent", "bytes_per_elem",
          "bytes_per_elem_run", "ratio_to_bf16", "hierarchy", "bytes_recv_max", "bytes_recv_max_internode",
          "relay_buckets", "bytes_internode", "geometry_version", "geometry_layers"}


def test_every_telemetry_key_is_documented():
    doc = open(os.path.join(ROOT, "docs", "telemetry.md")).read()
    assert [k for k in TELEMETRY_KEYS if f"| `{k}` |" not in doc] == []
    assert ALWAYS <= set(TELEMETRY_KEYS)


def test_engines_write_the_schema_keys_flat_and_two_level():
    # sampled every step, error feedback, selection by measurement, two-level with params: most
    # optional keys show up; every record has the keys every step writes
    gift = {"format": "fp8_e4m3", "layers": "measured", "error_feedback": True, "telemetry": {"every": 1},
            "geometry": {"rank": 8, "refresh_interval": 2, "collect_interval": 1}}
    base = dict(stage=2, steps=3, bucket=20000)
    two = dict(base, gift=dict(gift, hierarchy="two_level", ranks_per_node=2, params={"format": "fp8_e4m3"}))
    per_rank = run_ranks(train_many, 4, [dict(base, gift=gift), two])
    seen = set()
    for runs in per_rank:
        for run in runs:
            for record in run["records"]:
                assert ALWAYS <= set(record) <= set(TELEMETRY_KEYS), set(record) ^ ALWAYS
                seen |= set(record)
    for key in ("fidelity_rel_err", "error_feedback_bytes", "bytes_node", "balanced_buckets", "params_bytes",
                "profile_layers", "quantized"):
        assert key in seen, key
