"""One vlmaze GRPO step (rollout -> rewards/advantages -> update) for the benchmarks.

The same library calls ``train.py`` makes, without its logging and checkpointing: on-policy with
one PPO epoch, so the old logprobs are the current ones detached (no extra forward), no KL (no
reference model), images encoded once per rollout by the hf engine, one packed (or padded)
forward and backward over the whole batch in which each distinct image is encoded once.
"""

from __future__ import annotations

import time

import torch

from models.engines.base import SamplingParams
from models.engines.hf import HFEngine
from rl.grpo import aggregate, group_advantages, policy_loss
from rl.packing import sequence_logprobs
from rl.rollout import rollout


class GRPOStep:
    def __init__(self, model, processor, env, group_size: int, max_new_tokens: int, lr: float, clip: float = 0.2,
                 packing: bool = True, reward=None, temperature: float = 1.0):
        self.model, self.processor, self.env = model, processor, env
        self.engine = HFEngine(model, processor)
        self.group_size, self.max_new_tokens, self.clip = group_size, max_new_tokens, clip
        self.packing, self.temperature = packing, temperature
        self.reward = reward or (lambda t: float(t.success))
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def __call__(self, mazes, seed: int = 0) -> dict:
        model = self.model
        t0 = time.perf_counter()
        model.eval()
        sampling = SamplingParams(temperature=self.temperature, max_new_tokens=self.max_new_tokens, seed=seed)
        trajs = rollout(self.engine, self.processor, mazes, self.group_size, self.env, sampling)
        t1 = time.perf_counter()
        res = self.update(trajs, self.packing)
        self.last_trajs = trajs
        return {"generate": t1 - t0, **res, "step": time.perf_counter() - t0}

    def update(self, trajs, packing: bool) -> dict:
        """Rewards, advantages, then one forward/backward/optimizer step over ``trajs``."""
        e, model = self.engine, self.model
        t1 = time.perf_counter()
        rewards = torch.tensor([self.reward(t) for t in trajs])
        adv = group_advantages(rewards, self.group_size)
        seqs, images = [t.token_ids for t in trajs], [t.images for t in trajs]
        width = max(len(s) for s in seqs)
        mask = torch.zeros((len(trajs), width))
        for r, t in enumerate(trajs):
            mask[r, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float)
        t2 = time.perf_counter()
        model.train()
        lp = sequence_logprobs(model, seqs, images, e.pad_id, e.image_token_id, e.banned_token_ids,
                               self.temperature, packing=packing)
        out = policy_loss(lp, lp.detach(), adv, mask, self.clip, self.clip)
        loss = aggregate(out.loss_per_token, mask, "token_mean", float(mask.sum()), float(len(trajs)), 1.0)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self.opt.step()
        t3 = time.perf_counter()
        return {"score": t2 - t1, "update": t3 - t2, "tokens": float(mask.sum()),
                "context_tokens": float(sum(len(s) for s in seqs)), "padded_tokens": float(len(seqs) * width)}
