"""rl/grpo.py against hand-computed numbers, and gradient-accumulation equivalence."""

import math

import pytest
import torch

from rl.grpo import aggregate, group_advantages, kl_estimate, nonzero_std_groups, policy_loss


def test_grpo_advantage_hand_computed():
    # group 1: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3)
    # group 2: all 0 -> zero advantages (0 / (0 + eps))
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    adv = group_advantages(r, 4, "grpo", norm_by_std=True, eps=0.0 + 1e-12)
    s = math.sqrt(1 / 3)
    assert torch.allclose(adv[:4], torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))


def test_dr_grpo_and_rloo_advantages():
    r = torch.tensor([3.0, 1.0, 2.0])
    assert torch.allclose(group_advantages(r, 3, "grpo", norm_by_std=False), torch.tensor([1.0, -1.0, 0.0]))
    # rloo: r_i - mean of the others: 3 - 1.5, 1 - 2.5, 2 - 2
    assert torch.allclose(group_advantages(r, 3, "rloo"), torch.tensor([1.5, -1.5, 0.0]))
    with pytest.raises(ValueError):
        group_advantages(r, 3, "ppo")


def test_zero_std_filter():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert nonzero_std_groups(r, 2).tolist() == [False, False, True, True, False, False]


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # log r = 1
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-1) - 1 + 1)
    assert kl_estimate(ref, ref, "k3").item() == 0.0


def test_aggregations_hand_computed():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(v, m, "token_mean", 4, 2, 10).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(v, m, "seq_mean_token_mean", 4, 2, 10).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(v, m, "seq_mean_token_sum_norm", 4, 2, 10).item() == pytest.approx(10 / (2 * 10))


def test_token_ratio_and_clip_hand_computed():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.1, 1.5, 0.5]]))  # ratios 1.1, 1.5, 0.5
    mask = torch.ones(1, 3)
    out = policy_loss(logp, old, torch.tensor([1.0]), mask, 0.2, 0.28)
    # A > 0: min(r, clip(r, 0.8, 1.28)) -> 1.1, 1.28, 0.5
    assert torch.allclose(-out.loss_per_token, torch.tensor([[1.1, 1.28, 0.5]]), atol=1e-6)
    assert out.clipped.tolist() == [[False, True, False]]
    out = policy_loss(logp, old, torch.tensor([-1.0]), mask, 0.2, 0.28)
    # A < 0: min(-r, -clip(r)) -> -1.1, -1.5, -0.8
    assert torch.allclose(-out.loss_per_token, torch.tensor([[-1.1, -1.5, -0.8]]), atol=1e-6)
    assert out.clipped.tolist() == [[False, False, True]]


def test_sequence_ratio_gspo_hand_computed():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.2, 0.0]], requires_grad=True)
    out = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), 0.5, 0.5, ratio_level="sequence")
    s = math.exp(0.1)  # exp(mean log ratio)
    assert torch.allclose(out.ratio, torch.full((1, 2), s), atol=1e-6)
    out.loss_per_token.sum().backward()
    assert torch.allclose(logp.grad, torch.full((1, 2), -s), atol=1e-6)  # d/dlogp_t of -s*A per token


def test_truncated_importance_sampling_weight():
    old = torch.tensor([[-1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -0.5]])  # exp(0.5)=1.65 capped at 1.2, exp(-0.5)=0.61
    out = policy_loss(old.clone(), old, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2,
                      rollout_logp=rollout, tis_cap=1.2)
    assert torch.allclose(out.tis_weight, torch.tensor([[1.2, math.exp(-0.5)]]), atol=1e-6)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_gradient_accumulation_equals_full_batch(agg):
    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    feats = torch.randn(4, 6, 5)  # (N, T, D)
    old = torch.randn(4, 6) * 0.01
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1, 0, 0, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 0.3, -1.0])
    g_tokens, g_seqs = float(mask.sum()), 4.0

    def loss_of(rows):
        logp = (feats[rows] @ w) * 0.1  # (n, T) a stand-in for per-token logprobs
        out = policy_loss(logp, old[rows], adv[rows], mask[rows], 0.2, 0.28)
        return aggregate(out.loss_per_token, mask[rows], agg, g_tokens, g_seqs, 8)

    loss_of([0, 1, 2, 3]).backward()
    full = w.grad.clone()
    w.grad = None
    loss_of([0, 1]).backward()
    loss_of([2, 3]).backward()
    assert torch.allclose(w.grad, full, atol=1e-6)


def test_turn_index_and_the_logprob_gap_per_turn_by_hand():
    from models.forward import gap_by_turn, turn_index

    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1], [0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    assert turn_index(mask).tolist() == [[-1, -1, 0, 0, 0, 0, 1, 1, 2, 2, 2], [-1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]]
    engine = torch.arange(11.0).repeat(2, 1) * 0.1  # |gap| at position j is 0.1 j
    sums, counts = gap_by_turn(torch.zeros_like(mask), engine, mask, turns=3)
    assert sums.tolist() == pytest.approx([0.2 + 0.3 + 0.1, 0.6 + 0.3 + 0.4, 0.8 + 0.9 + 1.0])
    assert counts.tolist() == [3, 3, 3]
    sums, counts = gap_by_turn(torch.zeros_like(mask), engine, mask, turns=2)  # later turns pooled into the last
    assert counts.tolist() == [3, 6] and sums[1] == pytest.approx(1.3 + 2.7)


def test_turn_level_advantages_gigpo_by_hand():
    from rl.grpo import discounted_returns, turn_advantages

    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_returns([0.1, -0.2], 1.0) == pytest.approx([-0.1, -0.2])
    # one group of two episodes; both start in cell s0, then go separate ways (anchors seen once: no step term)
    episode = torch.tensor([0.7071, -0.7071])
    returns = [[0.5, 0.6, 1.0], [0.2, 0.1]]
    anchors = [["s0", "s1", "s2"], ["s0", "s3"]]
    adv = turn_advantages(episode, returns, anchors, group_size=2, weight=1.0)
    # at s0: returns 0.5 and 0.2, mean 0.35, unbiased std 0.2121: (0.5 - 0.35) / 0.2121 = +0.7071, and -0.7071
    assert adv[0] == pytest.approx([0.7071 + 0.7071, 0.7071, 0.7071], abs=1e-3)
    assert adv[1] == pytest.approx([-0.7071 - 0.7071, -0.7071], abs=1e-3)
    half = turn_advantages(episode, returns, anchors, group_size=2, weight=0.5, norm_by_std=False)
    assert half[0][0] == pytest.approx(0.7071 + 0.5 * 0.15, abs=1e-6) and half[1][0] == pytest.approx(-0.7071 - 0.075)
    # two groups never mix: the same anchor name in another group is another state
    two = turn_advantages(torch.zeros(4), [[1.0], [0.0], [5.0], [5.0]], [["s"], ["s"], ["s"], ["s"]], group_size=2)
    assert two[0][0] > 0 > two[1][0] and two[2][0] == two[3][0] == 0.0


def test_turn_rewards_sum_to_the_episode_reward_and_tokens_get_their_turns_advantage():
    from omegaconf import OmegaConf

    from conf.schema import AlgoConfig, RewardConfig
    from maze import TrainSampler
    from maze.env import EnvSettings
    from maze.rewards import episode_reward, turn_rewards
    from models.engines.base import SamplingParams
    from models.engines.hf import HFEngine
    from models.tiny import build_tiny
    from rl.grpo import turn_token_advantages
    from rl.rollout import rollout

    model, processor = build_tiny(0)
    trajs = rollout(HFEngine(model, processor), processor, TrainSampler(seed=2).take(2), 2, EnvSettings(max_turns=4),
                    SamplingParams(temperature=1.0, max_new_tokens=10, seed=3))
    shaped = OmegaConf.structured(RewardConfig(name="shaped", progress=0.5, step_cost=0.01, bump_penalty=0.05,
                                               invalid_penalty=0.1, revisit_penalty=0.02, wrong_stop_penalty=0.5,
                                               success=1.0))
    for t in trajs:
        for cfg in (shaped, OmegaConf.structured(RewardConfig(name="sparse"))):
            assert sum(turn_rewards(t, cfg)) == pytest.approx(episode_reward(t, cfg), abs=1e-9)
            assert len(turn_rewards(t, cfg)) == t.num_turns
    width = max(len(t.token_ids) for t in trajs)
    mask = torch.zeros((len(trajs), width))
    for i, t in enumerate(trajs):
        mask[i, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
    algo = OmegaConf.structured(AlgoConfig(group_size=2, adv_level="turn"))
    episode = torch.tensor([1.0, -1.0, 0.5, -0.5])
    adv = turn_token_advantages(trajs, episode, [turn_rewards(t, shaped) for t in trajs], mask, algo)
    from models.forward import turn_index
    from rl.grpo import discounted_returns, turn_advantages

    per_turn = turn_advantages(episode, [discounted_returns(turn_rewards(t, shaped), 0.95) for t in trajs],
                               [[tuple(p) for p in t.path[:-1]] for t in trajs], 2)
    turns = turn_index(mask)
    for i in range(len(trajs)):
        on = mask[i] > 0
        assert torch.allclose(adv[i][on], torch.tensor(per_turn[i])[turns[i][on]])
        assert (adv[i][~on] == 0).all()
    # every group shares its first cell: the first turns are compared, so the step term is not all zero
    assert any(abs(per_turn[i][0] - float(episode[i])) > 1e-9 for i in range(len(trajs)))


def test_per_turn_rows_get_their_episodes_and_turns_advantages():
    """env.history=K: build_batch trains one row per turn; each row's advantage is its episode's (episode level) or
    its own turn's GiGPO advantage (turn level), and DAPO's filter keeps or drops whole episodes' rows."""
    from omegaconf import OmegaConf

    from conf.schema import AlgoConfig, RewardConfig
    from maze import TrainSampler
    from maze.env import EnvSettings
    from maze.rewards import episode_reward, turn_rewards
    from models.engines.base import SamplingParams
    from models.engines.hf import HFEngine
    from models.tiny import build_tiny
    from rl.grpo import build_batch, discounted_returns, group_advantages, turn_advantages
    from rl.rollout import rollout
    from rl.update import Scoring

    model, processor = build_tiny(0)
    engine = HFEngine(model, processor)
    trajs = rollout(engine, processor, TrainSampler(seed=2).take(2), 2, EnvSettings(max_turns=4, history=1),
                    SamplingParams(temperature=1.0, max_new_tokens=10, seed=3))
    shaped = OmegaConf.structured(RewardConfig(name="shaped", progress=0.5, step_cost=0.01, bump_penalty=0.05,
                                               invalid_penalty=0.1, revisit_penalty=0.02))
    rewards = torch.tensor([episode_reward(t, shaped) for t in trajs]) + torch.tensor([0.3, 0.0, 0.0, 0.0])
    scoring = Scoring(engine.pad_id, model.config.image_token_id, engine.banned_token_ids, 1.0)
    episode = group_advantages(rewards, 2)
    plain = build_batch(trajs, rewards, OmegaConf.structured(AlgoConfig(group_size=2, adv_level="episode")), scoring)
    turn = build_batch(trajs, rewards, OmegaConf.structured(AlgoConfig(group_size=2, adv_level="turn")), scoring,
                       turn_rewards=[turn_rewards(t, shaped) for t in trajs])
    per_turn = turn_advantages(episode, [discounted_returns(turn_rewards(t, shaped), 0.95) for t in trajs],
                               [[tuple(p) for p in t.path[:-1]] for t in trajs], 2)
    rows = [(i, s.turn) for i, t in enumerate(trajs) for s in t.samples]
    assert len(plain.rows) == len(rows) == sum(t.num_turns for t in trajs) and plain.advantages.dim() == 1
    assert torch.allclose(plain.advantages, torch.stack([episode[i] for i, _ in rows]))
    assert torch.allclose(turn.advantages, torch.tensor([per_turn[i][k] for i, k in rows], dtype=torch.float32))
    assert plain.first_turn.tolist() == [k for _, k in rows]
    dapo = build_batch(trajs, torch.tensor([1.0, 0.0, 0.5, 0.5]), OmegaConf.structured(
        AlgoConfig(group_size=2, adv_level="episode", filter_zero_std=True)), scoring)
    assert dapo.kept == [r for r, (i, _) in enumerate(rows) if i < 2] and dapo.kept_episodes == 2


def test_against_thought_is_a_move_into_a_way_the_same_turn_called_a_pocket():
    """``maze.thought.against_thought`` (logged as ``rollout/moves_against_thought``): the parsed first move, synonyms
    included, against the pockets the turn's own thought named; no pocket named, another way, a stop, a malformed
    action or a pocket named only in free text are not against it."""
    from maze.thought import against_thought

    said = "<think>open up down left; not down left</think>"
    assert against_thought(said + "<action>down</action>")
    assert against_thought(said + "<action>South</action>")  # the env's synonym for down
    assert against_thought(said + "<action>left up</action>")  # first of several moves
    assert not against_thought(said + "<action>up</action>")
    assert not against_thought(said + "<action>stop</action>")
    assert not against_thought(said + "<action>sideways</action>")
    assert not against_thought("<think>open up down</think><action>down</action>")
    assert not against_thought("not down</think> ... <action>down")  # no complete action


def test_thought_reward_pays_turns_whose_thought_names_exactly_the_pockets():
    """reward.thought_pockets: hand-made turns on a maze with a pocket beside the start. The expert's thought (which
    names it) earns the weight; the same thought without the pocket, or naming a way that is no pocket, earns 0; the
    per-turn rewards still sum to the episode's, with the sparse and the shaped reward."""
    from omegaconf import OmegaConf

    from conf.schema import RewardConfig
    from maze.core import MOVES, dead_ends, generate_maze
    from maze.rewards import episode_reward, thought_reward, turn_rewards
    from maze.thought import thought
    from rl.rollout import Trajectory

    m = next(m for s in range(50) if dead_ends(m := generate_maze(size=9, seed=s), m.start, 8))
    pockets = dead_ends(m, m.start, 8)
    opens = [k for k, (dr, dc) in MOVES.items() if m.is_floor((m.start[0] + dr, m.start[1] + dc))]
    not_pocket = next(k for k in opens if k not in pockets) if len(opens) > len(pockets) else None
    right = thought(m, m.start, "right", 8)
    blind = right.split(";")[0] + "</think>"
    t = Trajectory(maze=m, group=0)
    info = {"position": m.start, "success": False, "optimal_steps": 16, "distance_to_goal": 16, "turns": 1,
            "bumps": 1, "invalid_actions": 0, "revisits": 0, "stopped_wrong": False}
    t.actions = [right + "<action>left</action>", blind + "<action>left</action>", "<action>left</action>"]
    if not_pocket:
        t.actions.append(blind.replace("</think>", f"; not {not_pocket}</think>") + "<action>left</action>")
    t.infos = [dict(info, turns=k + 1, bumps=k + 1) for k in range(len(t.actions))]  # bumps in place
    sparse = OmegaConf.structured(RewardConfig(name="sparse", thought_pockets=0.25))
    assert thought_reward(t, sparse) == [0.25] + [0.0] * (len(t.actions) - 1)
    assert episode_reward(t, sparse) == pytest.approx(0.25)
    shaped = OmegaConf.structured(RewardConfig(name="shaped", progress=0.5, step_cost=0.01, bump_penalty=0.05,
                                               thought_pockets=0.25))
    for cfg in (sparse, shaped):
        assert sum(turn_rewards(t, cfg)) == pytest.approx(episode_reward(t, cfg), abs=1e-9)
    assert turn_rewards(t, shaped)[0] == pytest.approx(0.25 - 0.01 - 0.05)
    assert thought_reward(t, OmegaConf.structured(RewardConfig(name="sparse"))) == [0.0] * len(t.actions)
