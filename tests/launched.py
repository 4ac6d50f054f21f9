"""A rank body for launcher tests: run by ``deepspeed`` or ``mpirun``, not by pytest.

    mpirun --allow-run-as-root -np 2 python tests/launched.py --spec '{"stage": 2, "gift": {...}}' --out DIR
    deepspeed --hostfile H --no_ssh --node_rank 0 --master_addr 127.0.0.1 tests/launched.py --spec ... --out DIR

Trains the tiny Llama of ``tests/harness.py`` and writes ``DIR/rank{N}.json`` (losses, GIFT
telemetry, backend) so the test can check every rank.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.harness import train  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = parser.parse_args()
    result = train(-1, -1, json.loads(args.spec))
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    gift = result.get("records") is not None
    out = {"rank": rank, "world_size": world, "losses": result["losses"], "gift": gift,
           "records": result.get("records", []), "backend": result.get("backend"), "version": result.get("version"),
           "whitener_digest": result.get("whitener_digest"),
           "param_sum": float(sum(p.double().sum() for p in result["params"].values())),
           "digests": result["digests"]}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
