"""One vlmaze GRPO step (rollout -> rewards/advantages -> update) for the benchmarks.

The same library calls ``train.py`` makes (``rl.rollout.rollout``, ``rl.grpo.build_batch``,
``rl.update.accumulate``), without its logging and checkpointing: on-policy with one PPO epoch, so the old
logprobs are the current ones detached (no extra forward), no KL (no reference model), token-mean loss, one
packed (or padded) forward and backward over the whole batch in which each distinct image is encoded once.
"""

from __future__ import annotations

import time

import torch
from omegaconf import OmegaConf

from conf.schema import AlgoConfig
from models.engines.base import SamplingParams
from models.engines.hf import HFEngine
from rl import grpo
from rl.rollout import rollout
from rl.update import Scoring, accumulate


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
        """The step's batch (``rl.grpo.build_batch``), then one forward/backward (``rl.update.accumulate``, the
        whole batch in one micro-batch) and one optimizer step over ``trajs``: train.py's own calls."""
        e, model = self.engine, self.model
        t1 = time.perf_counter()
        algo = OmegaConf.structured(AlgoConfig(group_size=self.group_size, clip_low=self.clip, clip_high=self.clip,
                                               loss_agg="token_mean", micro_batch=len(trajs),
                                               temperature=self.temperature))
        scoring = Scoring(e.pad_id, e.image_token_id, e.banned_token_ids, self.temperature, packing=packing)
        batch = grpo.build_batch(trajs, torch.tensor([self.reward(t) for t in trajs]), algo, scoring)
        t2 = time.perf_counter()
        model.train()
        self.opt.zero_grad(set_to_none=True)
        accumulate(model, batch, batch.kept, algo.micro_batch, scoring, grpo.loss(algo))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self.opt.step()
        t3 = time.perf_counter()
        seqs = [t.token_ids for t in trajs]
        return {"score": t2 - t1, "update": t3 - t2, "tokens": float(batch.mask.sum()),
                "context_tokens": float(sum(len(x) for x in seqs)),
                "padded_tokens": float(len(seqs) * max(len(x) for x in seqs))}
