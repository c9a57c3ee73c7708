"""Under torchrun (gloo): the models ``rl.run.build_models`` builds for a GRPO run with a KL reference under FSDP2,
then one no-grad reference forward as ``build_batch`` runs it (``frozen_logprobs``). Rank 0 writes
``<out>/result.json``: which of the reference's and the policy's parameters are sharded (FSDP2 swaps each unit's
sharded DTensors for plain gathered tensors while the unit is unsharded) after that forward.

    torchrun --standalone --nproc-per-node 2 tests/scripts/reference_shards.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from conf.schema import register  # noqa: E402
from maze import TrainSampler  # noqa: E402
from maze.env import EnvSettings  # noqa: E402
from models.engines.base import banned_token_ids  # noqa: E402
from rl.experts import expert_trajectory  # noqa: E402
from rl.rollout import Conversation  # noqa: E402
from rl.run import build_models  # noqa: E402
from rl.update import Scoring, frozen_logprobs  # noqa: E402


def unsharded(model) -> list[str]:
    return [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["cluster=cpu2", "cluster.parallel=fsdp2", "algo.kl_coef=0.05"])
    policy, processor, _, reference, _ = build_models(cfg, None, "cpu", fsdp=True, with_reference=True)
    conv = Conversation(processor)
    env = EnvSettings(max_turns=4)
    trajs = [expert_trajectory(m, conv, env, "bfs", noise=0.3, seed=k)
             for k, m in enumerate(TrainSampler(sizes=(5,), seed=3).take(2))]
    scoring = Scoring(processor.tokenizer.pad_token_id, policy.config.image_token_id,
                      banned_token_ids(processor.tokenizer), 1.0, share_images=False)
    before = {"reference": unsharded(reference), "policy": unsharded(policy)}
    frozen_logprobs(reference, trajs, [0, 1], 2, scoring)
    frozen_logprobs(policy, trajs, [0, 1], 2, scoring)  # the old policy's no-grad forward (algo.ppo_epochs > 1)
    result = {"before": before, "reference": unsharded(reference), "policy": unsharded(policy),
              "parameters": len(list(reference.parameters()))}
    if dist.get_rank() == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
