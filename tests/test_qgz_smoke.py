"""benchmarks/qgz_fidelity.py: the CPU reference of DeepSpeed's qgZ against hand-computed cases and a
rank-by-rank simulation of its two all-to-alls, and a tiny run of the comparison."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.qgz_fidelity import (group_count, int4_dequantize, int4_quantize, qgz_bytes_per_element,  # noqa: E402
                                     qgz_reduce)


def test_int4_one_group():
    # amax 4: quantization scale 16 / 8 = 2, stored 4 / 8 = 0.5; +4 -> 8 clamps to 7, -4 -> -8;
    # 0.25 * 2 = 0.5 and 1.25 * 2 = 2.5 round half to even (0 and 2), 0.75 * 2 = 1.5 -> 2
    x = torch.tensor([[4.0, -4.0, 0.25, 0.75, 1.25, -1.0, 0.5, 3.0]], dtype=torch.float16)
    codes, stored = int4_quantize(x)
    assert codes.tolist() == [[7, -8, 0, 2, 2, -2, 1, 6]]
    assert stored.dtype == torch.float32 and stored.tolist() == [0.5]
    deq = int4_dequantize(codes, stored)
    assert deq.dtype == torch.float16
    assert deq.float().tolist() == [[3.5, -4.0, 0.0, 1.0, 1.0, -1.0, 0.5, 3.0]]


def test_int4_zero_group():
    codes, stored = int4_quantize(torch.zeros(2, 8, dtype=torch.float16))
    assert codes.abs().sum() == 0 and stored.tolist() == [1.0, 1.0]  # scale 1 when amax is 0


def two_by_two(delta0: float, delta1: float):
    """W = 4, 2 nodes of 2; an 8 x 8 weight: 8 groups of one row (max(8, 8, 4)), 2 rows a partition.
    Every row holds -8 (group amax 8, stored 1, exact codes) and in column 1 the rank's own value."""
    base = torch.zeros(8, 8)
    base[:, 0] = -8.0
    grads = []
    for r in range(4):
        g = base.clone()
        g[:, 1] = delta0 if r % 2 == 0 else delta1
        g[:, 2] = torch.arange(8.0) - 4 + (r // 2)  # row-specific values (routing), node-specific
        grads.append(g)
    return grads


def test_two_nodes_by_hand():
    grads = two_by_two(1.0, 2.0)
    # node a, element (i, 1): hop 1 exact (every value is a code); the node's fp16 sum of its 2 ranks has
    # amax 16 in every row: stored 2, so 1 + 2 = 3 -> 3/2 = 1.5 -> code 2 (half to even) -> 4, and the
    # column-2 sum 2 (i - 4 + a) -> code (i - 4 + a) -> exact. Hop 2: the 2 nodes' copies summed and
    # halved in fp16: column 1 (4 + 4) / 2 = 4, column 2 ((2i - 8) + (2i - 6)) / 2 = 2i - 7, column 0
    # (-16 - 16) / 2 = -16: DeepSpeed's scale is L = 2 x the mean; the reference's mean halves it.
    ds = qgz_reduce(grads, 2, loss_scale=1.0, deepspeed_scale=True)
    i = torch.arange(8.0)
    want = torch.zeros(8, 8)
    want[:, 0], want[:, 1], want[:, 2] = -16.0, 4.0, 2 * i - 7
    assert torch.equal(ds, want)
    mean = qgz_reduce(grads, 2, loss_scale=1.0)
    assert torch.equal(mean, want / 2)
    exact = torch.stack(grads).mean(0)
    assert exact[0, 1] == 1.5 and mean[0, 1] == 2.0  # the re-quantization's rounding, by hand
    # codes that survive both hops exactly: no error at all
    assert torch.equal(qgz_reduce(two_by_two(2.0, 2.0), 2, loss_scale=1.0), torch.stack(two_by_two(2.0, 2.0)).mean(0))


def simulate_ranks(grads, L):
    """qgZ rank by rank from the module docstring's rules, with explicit message lists: a
    check on the reference's vectorized swizzle and routing."""
    W = len(grads)
    nodes = W // L
    shape = grads[0].shape
    numel = grads[0].numel()
    groups, _ = group_count(shape, W, L)
    size = numel // groups
    part = numel // W
    # hop 1: rank (a, j) sends local rank b the partitions a' L + b for a' = 0 .. nodes - 1, quantized
    inbox1 = {}
    for r, g in enumerate(grads):
        a, j = divmod(r, L)
        x = g.reshape(-1).half()
        for b in range(L):
            msg = []
            for a2 in range(nodes):
                p = a2 * L + b
                codes, stored = int4_quantize(x[p * part:(p + 1) * part].view(-1, size))
                msg.append((codes, stored))
            inbox1[(a, b, j)] = msg
    # reduction at (a, b): per destination node a', the fp16 sum over senders j, requantized
    inbox2 = {}
    for a in range(nodes):
        for b in range(L):
            for a2 in range(nodes):
                acc = torch.zeros(part // size, size, dtype=torch.float16)
                for j in range(L):
                    acc = acc + int4_dequantize(*inbox1[(a, b, j)][a2])
                inbox2[(a2, b, a)] = int4_quantize(acc)
    out = torch.empty(numel, dtype=torch.float16)
    for a2 in range(nodes):
        for b in range(L):
            total = 0
            for a in range(nodes):
                total = total + int4_dequantize(*inbox2[(a2, b, a)]).reshape(-1)
            p = a2 * L + b
            out[p * part:(p + 1) * part] = total / nodes
    return out.float().reshape(shape)


@pytest.mark.parametrize("W,L,shape", [(4, 2, (16, 8)), (8, 2, (24, 16)), (8, 4, (32, 16)), (4, 4, (8, 16))])
def test_reference_matches_rank_by_rank(W, L, shape):
    torch.manual_seed(W * 100 + L)
    grads = [torch.randn(shape) * (1 + r) for r in range(W)]
    ref = qgz_reduce(grads, L, loss_scale=1.0, deepspeed_scale=True)
    assert torch.equal(ref, simulate_ranks(grads, L))
    # the mean is close to the exact one (INT4: ~10% off), and far from any other partition order
    mean = qgz_reduce(grads, L, loss_scale=1.0)
    exact = torch.stack(grads).mean(0)
    err = float((mean - exact).norm() / exact.norm())
    assert 0 < err < 0.3, err


def test_fallbacks_and_layout():
    grads = [torch.full((6,), float(r)) for r in range(4)]  # 1-D: the exact reduce-scatter
    assert torch.allclose(qgz_reduce(grads, 2), torch.full((6,), 1.5))
    odd = [torch.ones(3, 3) * r for r in range(4)]  # 9 % (2 W) != 0
    assert torch.allclose(qgz_reduce(odd, 2), torch.full((3, 3), 1.5))
    assert group_count((8, 8), 4, 2) == (8, True)
    assert group_count((688, 256), 8, 8) == (688, True)
    with pytest.raises(ValueError):
        group_count((688, 256), 32, 8)  # 688 groups: not a multiple of 32
    assert group_count((688, 256), 32, 8, "aligned") == (1376, False)
    assert math.isclose(qgz_bytes_per_element((256, 256), 32, 8), 0.5 + 4 / 256)


def test_comparison_tiny(tmp_path):
    out = tmp_path / "qgz.json"
    cmd = [sys.executable, "benchmarks/qgz_fidelity.py", "--preset", "tiny", "--worlds", "4", "8", "--ranks-per-node",
           "2", "--micro", "1", "--seq", "32", "--train-steps", "2", "--refresh-interval", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| qgZ INT4 |" in proc.stdout and "GIFT kfac / GIFT Euclidean" in proc.stdout
    data = json.loads(out.read_text())
    for w in ("4", "8"):
        row = data["results"][w]
        assert set(row) == {"qgz_int4", *(f"gift_{f}_{g}" for f in ("nvfp4", "fp8_e4m3") for g in ("euclidean", "kfac"))}
        for key, r in row.items():
            for m in ("rel_l2", "whitened", "adam_upd"):
                assert math.isfinite(r[m]) and 0 < r[m] < 2, (w, key, m, r[m])
        # INT4 with a scale per row-sized group (tiny: 32-64 elements) is far coarser than fp8
        assert row["gift_fp8_e4m3_euclidean"]["rel_l2"] < row["qgz_int4"]["rel_l2"]
        assert 0.5 < row["qgz_int4"]["bytes_inter"] < 0.6


def test_gift_in_the_plugins_hadamard_coordinates(tmp_path):
    # --coordinates hadamard reduces in the rotation the plugin builds for geometry.kind hadamard:
    # its errors are GIFT's own (finite, of the codec's size) and not Euclidean's bits
    out = tmp_path / "qgz.json"
    cmd = [sys.executable, "benchmarks/qgz_fidelity.py", "--preset", "tiny", "--worlds", "4", "--ranks-per-node", "2",
           "--micro", "1", "--seq", "32", "--train-steps", "2", "--refresh-interval", "1", "--formats", "nvfp4",
           "--coordinates", "euclidean", "hadamard", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GIFT hadamard / GIFT Euclidean" in proc.stdout
    row = json.loads(out.read_text())["results"]["4"]
    assert set(row) == {"qgz_int4", "gift_nvfp4_euclidean", "gift_nvfp4_hadamard"}
    rot, plain = row["gift_nvfp4_hadamard"], row["gift_nvfp4_euclidean"]
    assert 0 < rot["rel_l2"] < 2 and math.isfinite(rot["adam_upd"])
    assert rot["rel_l2"] != plain["rel_l2"]
