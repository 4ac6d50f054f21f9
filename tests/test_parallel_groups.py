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
