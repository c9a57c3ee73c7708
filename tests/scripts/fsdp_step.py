"""One FSDP2 training setup as train.py builds it (fp32 masters, ``wrap_fsdp2`` with the compute dtype, the update
of ``rl.update.accumulate``) on a fixed batch, under torchrun with gloo. Rank 0 writes ``<out>/result.json``:
the dtypes the forward and the gradient reduction ran in, the fraction of fp32 master parameters changed
after ``--steps`` AdamW steps, and (``--grads``) the full first-step gradient to ``<out>/grads.pt``.

    torchrun --standalone --nproc-per-node 2 tests/scripts/fsdp_step.py --out DIR --dtype bfloat16 --lr 1e-6
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from conf.schema import AlgoConfig  # noqa: E402
from maze import TrainSampler  # noqa: E402
from maze.env import EnvSettings  # noqa: E402
from models.build import DTYPES  # noqa: E402
from models.distributed import wrap_fsdp2  # noqa: E402
from models.engines.base import banned_token_ids  # noqa: E402
from models.tiny import build_tiny  # noqa: E402
from rl import grpo  # noqa: E402
from rl.experts import expert_trajectory  # noqa: E402
from rl.rollout import Conversation  # noqa: E402
from rl.update import Scoring, StepBatch, accumulate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--grads", action="store_true")
    ap.add_argument("--pure-bf16", dest="pure_bf16", action="store_true",
                    help="the contrast: bf16 parameters and AdamW on them, no fp32 master (the old setup)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    compute = DTYPES[args.dtype]

    policy, processor = build_tiny(0)  # fp32: the master copy
    if args.pure_bf16:
        policy.to(torch.bfloat16)
    tok = processor.tokenizer
    conv = Conversation(processor)
    env = EnvSettings(pixels_per_cell=8, pad_to=32, max_turns=6)
    trajs = [expert_trajectory(m, conv, env, "bfs", noise=0.3, seed=k)
             for k, m in enumerate(TrainSampler(sizes=(5, 7), seed=3).take(8))]
    n = len(trajs)
    width = max(len(t.token_ids) for t in trajs)
    mask = torch.zeros((n, width))
    for i, t in enumerate(trajs):
        mask[i, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
    advantages = torch.linspace(-1.0, 1.0, n)  # a fixed batch: every rank builds the same one
    batch = StepBatch(trajs, mask, torch.zeros_like(mask), advantages)
    mine = list(range(n))[rank::world]  # this rank's rows, as train.py slices mazes
    algo = OmegaConf.structured(AlgoConfig(micro_batch=3, loss_agg="token_mean"))
    scoring = Scoring(tok.pad_token_id, policy.config.image_token_id, banned_token_ids(tok), 1.0,
                      share_images=False, compute_dtype=compute)

    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    wrap_fsdp2(policy, torch.bfloat16 if args.pure_bf16 else compute)
    seen = {"forward": set(), "reduce": set()}
    policy.model.language_model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, i, o: seen["forward"].add(str(o.dtype)))
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # the one FSDP2 calls differs by torch version
        if hasattr(dist, name):
            real = getattr(dist, name)

            def spy(*a, _real=real, **kw):
                t = kw.get("input", kw.get("input_tensor", a[1] if len(a) > 1 else None))
                seen["reduce"].add(str(t.dtype))
                return _real(*a, **kw)

            setattr(dist, name, spy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        policy.train()
        accumulate(policy, batch, mine, algo.micro_batch, scoring, grpo.loss(algo), sharded=True)
        if step == 0 and args.grads:
            grads = {k: p.grad.full_tensor() for k, p in policy.named_parameters()}
        optimizer.step()
    after = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in policy.state_dict().items()}
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    total = sum(v.numel() for v in before.values())
    param_dtypes = {str(p.dtype) for p in policy.parameters()}
    grad_dtypes = {str(p.grad.dtype) for p in policy.parameters() if p.grad is not None}
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if args.grads:
            torch.save(grads, out / "grads.pt")
        (out / "result.json").write_text(json.dumps({
            "world": world, "forward_dtypes": sorted(seen["forward"]), "reduce_dtypes": sorted(seen["reduce"]),
            "param_dtypes": sorted(param_dtypes), "grad_dtypes": sorted(grad_dtypes),
            "changed_fraction": changed / total}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
