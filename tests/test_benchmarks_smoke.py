"""Tiny versions of the benchmarks: they run, print their table and write JSON."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_codec_speed_smoke(tmp_path):
    out = tmp_path / "codec.json"
    proc = subprocess.run([sys.executable, "benchmarks/codec_speed.py", "--numel", "100000", "--repeats", "2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fp8_e4m3" in proc.stdout and "nvfp4" in proc.stdout
    data = json.loads(out.read_text())
    text = json.dumps(data)
    for name in ("fp8_e4m3", "fp8_e5m2", "nvfp4", "int8", "int4", "bf16", "fp32"):
        assert name in text
