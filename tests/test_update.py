"""Each algorithm key changes the update where it should and nowhere else (``rl.update.accumulate`` on a fixed
batch of real trajectories through the tiny Qwen3-VL); the reward functions by hand."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from conf.schema import AlgoConfig, RewardConfig
from maze import TrainSampler
from maze.env import EnvSettings
from maze.rewards import episode_reward
from models.engines.base import banned_token_ids
from models.tiny import build_tiny
from rl import grpo
from rl.experts import expert_trajectory
from rl.rollout import Conversation
from rl.update import Scoring, StepBatch, accumulate, frozen_logprobs


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model, processor = build_tiny(0)
    conv = Conversation(processor)
    env = EnvSettings(pixels_per_cell=8, pad_to=32, max_turns=5)
    trajs = [expert_trajectory(m, conv, env, "bfs", noise=0.3, seed=k)
             for k, m in enumerate(TrainSampler(sizes=(5,), seed=1).take(6))]
    tok = processor.tokenizer
    s = Scoring(tok.pad_token_id, model.config.image_token_id, banned_token_ids(tok), 1.0)
    rows = list(range(len(trajs)))
    lp = frozen_logprobs(model, trajs, rows, 8, s)  # the current policy's logprobs: ratio 1 against it
    width = lp.shape[1]
    mask = torch.zeros((len(trajs), width))
    for i, t in enumerate(trajs):
        mask[i, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
    noise = 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    return model, trajs, s, rows, lp, mask, noise


def grad(setup, algo=None, **batch):
    model, trajs, s, rows, lp, mask, _ = setup
    a = OmegaConf.merge(OmegaConf.structured(AlgoConfig(micro_batch=3)), algo or {})
    b = StepBatch(trajs, mask, batch.pop("rollout_lp", lp), torch.linspace(-1, 1, len(trajs)), **batch)
    model.zero_grad(set_to_none=True)
    accumulate(model, b, rows, a.micro_batch, s, grpo.loss(a))
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def differ(g1, g2) -> bool:
    return not torch.allclose(g1, g2, atol=1e-7, rtol=1e-5)


def test_gspo_sequence_ratio_changes_the_update_only_off_policy(setup):
    _, _, _, _, lp, _, noise = setup
    assert not differ(grad(setup), grad(setup, {"ratio_level": "sequence"}))  # ratio 1: the same gradient
    old = lp + noise
    assert differ(grad(setup, old_lp=old), grad(setup, {"ratio_level": "sequence"}, old_lp=old))


def test_clip_higher_acts_only_where_ratios_leave_one(setup):
    _, _, _, _, lp, _, noise = setup
    assert not differ(grad(setup), grad(setup, {"clip_high": 0.28}))  # one on-policy update: clipping is inert
    old = lp - noise.abs()  # ratios > 1: clip-higher lets positive advantages move further
    assert differ(grad(setup, old_lp=old), grad(setup, {"clip_high": 0.28}, old_lp=old))


def test_kl_in_the_loss_pulls_towards_the_reference_and_vanishes_on_it(setup):
    _, _, _, _, lp, _, noise = setup
    base = grad(setup)
    assert differ(base, grad(setup, {"kl_coef": 0.1}, ref_lp=lp + noise))
    # k3 has zero gradient where the policy equals the reference
    assert not differ(base, grad(setup, {"kl_coef": 0.1}, ref_lp=lp.clone()))


def test_truncated_importance_sampling_reweights_only_off_engine_tokens(setup):
    _, _, _, _, lp, _, _ = setup
    base = grad(setup)
    assert not differ(base, grad(setup, {"tis_cap": 2.0}))  # engine = trainer: weight 1
    assert differ(base, grad(setup, {"tis_cap": 2.0}, rollout_lp=lp - 0.5))  # exp(0.5) = 1.65 < cap
    assert not differ(grad(setup, rollout_lp=lp - 0.5), base)  # off by default (tis_cap = 0)


def test_rewards_by_hand():
    info = {"success": True, "optimal_steps": 10, "distance_to_goal": 0, "turns": 12, "bumps": 2,
            "invalid_actions": 1, "revisits": 3}
    traj = SimpleNamespace(final_info=info)
    sparse = OmegaConf.structured(RewardConfig(name="sparse"))
    shaped = OmegaConf.structured(RewardConfig(name="shaped", progress=0.5, step_cost=0.01, bump_penalty=0.05,
                                               invalid_penalty=0.1, revisit_penalty=0.02))  # every term on
    assert episode_reward(traj, sparse) == 1.0
    # 1 + 0.5 * (10 - 0) / 10 - 0.01 * 12 - 0.05 * 2 - 0.1 * 1 - 0.02 * 3 = 1.12
    assert episode_reward(traj, shaped) == pytest.approx(1.12)
    failed = SimpleNamespace(final_info={**info, "success": False, "distance_to_goal": 4})
    assert episode_reward(failed, sparse) == 0.0
    # 0 + 0.5 * 6 / 10 - 0.12 - 0.1 - 0.1 - 0.06 = -0.08
    assert episode_reward(failed, shaped) == pytest.approx(-0.08)
    stopped = SimpleNamespace(final_info={**failed.final_info, "stopped_wrong": True})
    assert episode_reward(stopped, shaped) == pytest.approx(-0.08)  # no penalty unless asked for
    strict = OmegaConf.structured(RewardConfig(name="shaped", progress=0.5, step_cost=0.01, bump_penalty=0.05,
                                               invalid_penalty=0.1, revisit_penalty=0.02, wrong_stop_penalty=0.5))
    assert episode_reward(stopped, strict) == pytest.approx(-0.58)
    assert episode_reward(failed, strict) == pytest.approx(-0.08)
