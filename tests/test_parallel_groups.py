"""GIFT where the data-parallel group is not the world (issue 33): a Megatron-style ``mpu`` with
tensor-parallel pairs, so ranks {0, 2} and {1, 3} reduce together. Every process group GIFT makes
(two-level's node and slot groups, ``comm_timeout_s``'s own) is made on every rank of the job in
one agreed order; before that, two-level hung (torch names groups by a global counter, so {0, 2}
and {1, 3} met under one name) and ``comm_timeout_s`` refused."""

import pytest

from launch.spawn import run_ranks
from tests.harness import train_many
from tests.spread import max_param_diff

LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1}}


@pytest.mark.parametrize("stage", [1, 2])
def test_two_level_and_a_timeout_of_its_own_over_one_data_parallel_group_of_two(stage):
    # DP = 2 x TP = 2; two-level with one rank per node (two "nodes" of one rank in each DP group),
    # and the flat exchange with comm_timeout_s; lossless: DP = 2 sums x/2 + y/2, the native bits
    base = dict(stage=stage, steps=3, ga=2, bucket=12000, tp=2)
    two_level = dict(base, gift=dict(LOSSLESS, hierarchy="two_level", ranks_per_node=1))
    timed = dict(base, gift=dict(LOSSLESS, comm_timeout_s=60))
    for native, split, own_timeout in run_ranks(train_many, 4, [base, two_level, timed], timeout=300):
        for gift in (split, own_timeout):
            assert gift["losses"] == native["losses"] and max_param_diff(native, gift) == 0.0
            assert len(gift["records"]) == 3
        assert all(r["hierarchy"] == "two_level" for r in split["records"])


def test_checkpoints_and_telemetry_of_each_data_parallel_group_are_their_own(tmp_path):
    # DP = 2 x TP = 2, fp8 + kfac + error feedback + stochastic rounding: every process saves its own
    # file (named by its global rank; by the data-parallel rank, 2 files were overwritten by the
    # other group's), the resumed run continues bit for bit, and each group writes its own telemetry
    import json
    import os

    jsonl = str(tmp_path / "gift.jsonl")
    gift = {"format": "fp8_e4m3", "rounding": "stochastic", "error_feedback": True, "layers": "all",
            "geometry": {"rank": 8, "refresh_interval": 2, "collect_interval": 1},
            "telemetry": {"every": 1, "jsonl": jsonl}}
    save_dir = str(tmp_path / "ckpt")
    base = dict(stage=2, steps=5, bucket=20000, gift=gift, tp=2)
    full, first = zip(*run_ranks(train_many, 4, [base, dict(base, steps=3, save_at=3, save_dir=save_dir)],
                                 timeout=300))
    resumed = [r[0] for r in run_ranks(train_many, 4, [dict(base, resume=save_dir)], timeout=300)]
    files = sorted(f for f in os.listdir(os.path.join(save_dir, "global_step3")) if f.startswith("gift_rank"))
    assert [f for f in files if f.endswith(".pt")] == [f"gift_rank{r}.pt" for r in range(4)]
    for rank in range(4):
        assert first[rank]["losses"] == full[rank]["losses"][:3]
        assert resumed[rank]["losses"] == full[rank]["losses"][3:]
    written = sorted(os.listdir(tmp_path))
    assert "gift.rank0.jsonl" in written and "gift.rank1.jsonl" in written and "gift.jsonl" not in written
    for name in ("gift.rank0.jsonl", "gift.rank1.jsonl"):
        with open(tmp_path / name) as f:
            steps = [json.loads(line)["step"] for line in f]
        assert steps == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]  # the full run, its first part, the resumed part
