"""What a task lets a critic explain, from a value-pretraining rollouts file: the policy's success rate, how
its episodes end (the environment's reason and steps done), and the oracle's held-out EV ceiling on the
same split `sao value-pretrain` makes (trainer/oracle_value.py). No model runs; a minute on a CPU.

    PYTHONPATH=. .venv/bin/python benchmarks/rollout_ceiling.py examples/smollm2_chain.yaml \\
        runs/smollm2/chain/value_pretrain_rollouts.safetensors actor.init=runs/smollm2/chain/sft_model
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("rollouts", type=Path, help="a value_pretrain_rollouts.safetensors")
    ap.add_argument("overrides", nargs="*", help="k=v overrides (actor.init: the policy that made the rollouts)")
    args = ap.parse_args(argv)
    from megatron_sao.config import load_config
    from megatron_sao.trainer.value_data import split_heldout
    from megatron_sao.trainer.value_pretrain import task_ceiling
    from megatron_sao.trajectory import load_trajectories

    cfg = load_config(args.config, args.overrides)
    trajs = load_trajectories(args.rollouts)
    usable = [t for t in trajs if t.trainable]
    train, held = split_heldout(usable, cfg.value_pretrain.heldout_fraction, cfg.run.seed)
    env_infos = [t.info.get("env_info", {}) for t in trajs]
    ends = collections.Counter(f"{e.get('reason')} after {e.get('steps_done')}" for e in env_infos)
    ceiling = task_ceiling(cfg, Path(cfg.actor.init), train, held)
    out = {"rollouts": len(trajs), "usable": len(usable), "heldout": len(held),
           "success_rate": sum(t.reward for t in usable) / max(len(usable), 1),
           "ends": dict(ends.most_common()),
           "ceiling": None if ceiling is None else {k: v for k, v in ceiling.items() if k != "keys"}}
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
