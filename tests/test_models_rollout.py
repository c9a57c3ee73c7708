"""Tiny Qwen3-VL offline, the hf engine, and multi-turn token-in/token-out rollouts."""

import importlib.util
from dataclasses import replace

import pytest
import torch

import maze
from maze.env import EnvSettings
from models import forward as models_forward
from models.engines.base import SamplingParams, banned_token_ids
from models.engines.hf import HFEngine
from models.forward import collate, token_logprobs
from models.tiny import CHAT_TEMPLATE, build_tiny
from rl.rollout import rollout


@pytest.fixture(scope="module")
def tiny():
    model, processor = build_tiny(seed=0)
    return model, processor


def test_tiny_is_deterministic_and_roundtrips_offline(tiny, tmp_path):
    import json

    from transformers import AutoModelForImageTextToText

    from models.tiny import load_processor, save_processor

    model, processor = tiny
    again, _ = build_tiny(seed=0)
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    other, _ = build_tiny(seed=1)
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    model.save_pretrained(tmp_path)
    save_processor(processor, tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path)
    proc2 = load_processor(tmp_path)
    assert type(loaded).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(proc2).__name__ == type(processor).__name__
    assert type(proc2.image_processor) is type(processor.image_processor)  # PIL, with or without torchvision
    # the checkpoint carries a full Qwen3VLProcessor (image, video, tokenizer), which is what vLLM loads
    config = json.loads((tmp_path / "processor_config.json").read_text())
    assert config["processor_class"] == "Qwen3VLProcessor"
    assert config["video_processor"]["patch_size"] == config["image_processor"]["patch_size"] == 16
    if importlib.util.find_spec("torchvision") is not None:  # the vLLM CPU test environment
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

        full = Qwen3VLProcessor.from_pretrained(tmp_path)
        assert type(full.video_processor).__name__ == "Qwen3VLVideoProcessor"
    for (n, p), (_, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(p, q), n
    text = "You moved up. <action>left</action>"
    assert proc2.tokenizer.encode(text) == processor.tokenizer.encode(text)
    assert proc2.tokenizer.decode(processor.tokenizer.encode(text)) == text


def test_processor_expands_one_token_per_cell(tiny):
    _, processor = tiny
    env = maze.MazeEnv(size=9, view="global", pixels_per_cell=32, pad_before=0)
    obs, _ = env.reset(seed=0)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": obs["text"]}]}],
        add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=[obs["image"]], return_tensors="pt")
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((out["input_ids"] == image_id).sum()) == 81  # 288 px / 32 px per merged token = 9 x 9
    assert out["mm_token_type_ids"].sum() == 81


@pytest.fixture(scope="module")
def trajectories(tiny):
    model, processor = tiny
    engine = HFEngine(model, processor)
    mazes = maze.TrainSampler(seed=3).take(2)
    env = EnvSettings(max_turns=3)
    return engine, rollout(engine, processor, mazes, 3, env, SamplingParams(temperature=1.0, max_new_tokens=12,
                                                                            seed=7))


def test_trainer_logprobs_match_engine_on_every_sampled_token(tiny, trajectories):
    model, _ = tiny
    engine, trajs = trajectories
    batch = collate([t.token_ids for t in trajs], [t.images for t in trajs], engine.pad_id, engine.image_token_id)
    logp = token_logprobs(model, batch, engine.banned_token_ids, 1.0)
    worst = 0.0
    for row, t in enumerate(trajs):
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        assert mask.any()
        diff = (logp[row, :len(t.token_ids)][mask] - torch.tensor(t.rollout_logprobs)[mask]).abs().max()
        worst = max(worst, float(diff.detach()))
    assert worst < 1e-4, worst


def test_loss_mask_is_exactly_the_generated_tokens_and_decoding_gives_the_conversation(tiny, trajectories):
    _, processor = tiny
    _, trajs = trajectories
    tok = processor.tokenizer
    for t in trajs:
        assert len(t.token_ids) == len(t.loss_mask) == len(t.rollout_logprobs)
        # mask-1 runs are the generated turns, in order
        runs, cur = [], []
        for tid, m in zip(t.token_ids, t.loss_mask):
            if m:
                cur.append(tid)
            elif cur:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
        assert [tok.decode(r, skip_special_tokens=True) for r in runs] == t.actions
        assert all(lp == 0.0 for lp, m in zip(t.rollout_logprobs, t.loss_mask) if not m)
        # rebuild the conversation with the chat template and compare text
        messages = [{"role": "system", "content": maze.SYSTEM_PROMPT},
                    {"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": maze.MazeEnv().task_prompt}]}]
        for k, run in enumerate(runs):
            messages.append({"role": "assistant", "content": tok.decode([x for x in run if x != tok.eos_token_id])})
            if k < len(t.infos) - 1:
                feedback = _feedback_of(t, k)
                messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": feedback}]})
        text = processor.apply_chat_template(messages, tokenize=False, chat_template=CHAT_TEMPLATE)
        n_img = t.images[0].num_tokens
        text = text.replace("<|image_pad|>", "<|image_pad|>" * n_img)
        assert tok.decode(t.token_ids) == text


def _feedback_of(t, k):
    """Re-play the episode's env to get the feedback after turn k."""
    env = maze.MazeEnv(size=t.maze.size, pixels_per_cell=32, max_turns=3)
    env.reset(options={"maze": t.maze})
    obs = None
    for action in t.actions[:k + 1]:
        obs, *_ = env.step(action)
    return obs["text"]


def test_banned_tokens_are_never_sampled(tiny, trajectories):
    _, processor = tiny
    _, trajs = trajectories
    banned = set(banned_token_ids(processor.tokenizer))
    assert len(banned) == 6
    for t in trajs:
        assert not banned & {tid for tid, m in zip(t.token_ids, t.loss_mask) if m}


def test_groups_share_a_maze_and_episodes_end(trajectories):
    _, trajs = trajectories
    assert len(trajs) == 6
    assert [t.group for t in trajs] == [0, 0, 0, 1, 1, 1]
    assert trajs[0].maze == trajs[2].maze and trajs[0].maze != trajs[3].maze
    assert all(t.finish in ("success", "stop_wrong", "max_turns", "context") for t in trajs)
    assert all(1 <= t.num_turns <= 3 for t in trajs)


def test_max_images_in_context_drops_oldest(tiny):
    model, processor = tiny
    engine = HFEngine(model, processor)
    m = maze.TrainSampler(seed=5).take(1)
    trajs = rollout(engine, processor, m, 2, EnvSettings(max_turns=4, max_images_in_context=2),
                    SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for t in trajs:
        assert len(t.images) <= 2
        assert t.token_ids.count(image_id) == sum(im.num_tokens for im in t.images)
        if t.num_turns >= 3:
            assert t.images_dropped >= 1


def test_greedy_generation_is_reproducible(tiny):
    model, processor = tiny
    engine = HFEngine(model, processor)
    m = maze.TrainSampler(seed=9).take(2)
    a = rollout(engine, processor, m, 1, EnvSettings(max_turns=2), SamplingParams(temperature=0.0, max_new_tokens=8))
    b = rollout(engine, processor, m, 1, EnvSettings(max_turns=2), SamplingParams(temperature=0.0, max_new_tokens=8))
    assert [t.token_ids for t in a] == [t.token_ids for t in b]


def test_sft_noise_turns_are_untrained_and_followed_by_expert_recoveries():
    from maze import TrainSampler
    from maze.env import EnvSettings
    from models.tiny import build_tiny
    from rl.experts import expert_trajectory
    from rl.rollout import Conversation

    _, processor = build_tiny(0)
    conv = Conversation(processor)
    env = EnvSettings(pixels_per_cell=4, max_turns=30)
    mazes = TrainSampler(sizes=(9,), seed=2).take(6)
    clean = [expert_trajectory(m, conv, env, "wall_follower") for m in mazes]
    noisy = [expert_trajectory(m, conv, env, "wall_follower", noise=0.3, seed=k) for k, m in enumerate(mazes)]

    assert all(t.success for t in clean) and all(i["event"] != "bump" for t in clean for i in t.infos)
    assert all(sum(t.loss_mask) > 0 for t in clean)
    events = [i["event"] for t in noisy for i in t.infos]
    assert "bump" in events  # the noisy data holds what the policy will meet
    # every action's tokens are either all trained or all untrained; noisy ones are untrained
    tok = conv.tok
    for t in noisy:
        text_trained = tok.decode([i for i, m in zip(t.token_ids, t.loss_mask) if m])
        n_trained = text_trained.count("<action>")
        assert 0 < n_trained < len(t.actions)
        assert text_trained.count("</action>") == n_trained


def test_sft_thought_names_the_open_directions_heading_and_goal():
    from maze import TrainSampler
    from maze.core import MOVES
    from maze.env import EnvSettings, parse_action
    from models.tiny import build_tiny
    from rl.experts import expert_trajectory
    from rl.rollout import Conversation

    _, processor = build_tiny(0)
    conv = Conversation(processor)
    env = EnvSettings(pixels_per_cell=4, max_turns=30)
    solved = 0
    for k, m in enumerate(TrainSampler(sizes=(9,), seed=3).take(4)):
        t = expert_trajectory(m, conv, env, "wall_follower", noise=0.2, seed=k, with_thought=True)
        positions = [m.start] + [i["position"] for i in t.infos]
        facing = "down"
        for turn, (text, pos) in enumerate(zip(t.actions, positions)):
            thought = text[text.index("<think>") + 7:text.index("</think>")]
            if pos == m.goal:
                assert thought == "on the goal" and parse_action(text).moves == ("stop",)
                continue
            r, c = pos
            open_dirs = [d for d, (dr, dc) in MOVES.items() if m.is_floor((r + dr, c + dc))]
            assert thought == f"facing {facing}; open {' '.join(open_dirs)}"
            if positions[turn + 1] != pos:
                facing = parse_action(text).moves[0]  # the heading is the last move that moved the agent
        solved += t.success
        # the thought is trained on expert turns: the trained text holds as many thoughts as actions
        trained_text = conv.tok.decode([i for i, mk in zip(t.token_ids, t.loss_mask) if mk])
        assert trained_text.count("</think>") == trained_text.count("</action>") > 0
    assert solved >= 2  # the goal turn ('on the goal', stop) is checked too


def test_tiny_vision_tower_tells_wall_from_floor_at_init():
    """A bias-free patch embedding maps a gray wall patch (0.325 x white after normalisation) parallel to a
    white floor patch, and LayerNorm then makes them identical: the tiny model's init must break that."""
    import numpy as np

    from rl.rollout import Conversation

    model, processor = build_tiny(0)
    conv = Conversation(processor)
    floor = conv.image(np.full((32, 32, 3), 255, np.uint8)).pixel_values[:1]
    wall = conv.image(np.full((32, 32, 3), 169, np.uint8)).pixel_values[:1]
    proj = model.model.visual.patch_embed
    norm = torch.nn.functional.layer_norm
    with torch.no_grad():
        f, w = proj(floor), proj(wall)
        cos = torch.nn.functional.cosine_similarity(norm(f, f.shape[-1:]), norm(w, w.shape[-1:])).item()
        assert cos < 0.95
        bias = proj.proj.bias.clone()
        proj.proj.bias.zero_()  # the library default: blind
        f, w = proj(floor), proj(wall)
        blind = torch.nn.functional.cosine_similarity(norm(f, f.shape[-1:]), norm(w, w.shape[-1:])).item()
        proj.proj.bias.copy_(bias)
    assert blind == pytest.approx(1.0, abs=1e-5)


def test_random_start_moves_the_start_to_a_floor_cell_of_a_training_layout():
    import numpy as np

    from maze.suites import eval_layouts
    from rl.experts import random_start

    rng = np.random.default_rng(0)
    starts = set()
    for m in maze.TrainSampler(sizes=(9,), seed=5).take(8):
        moved = random_start(m, rng)
        starts.add(moved.start)
        assert moved.is_floor(moved.start) and moved.start != m.goal and moved.goal == m.goal
        assert (moved.grid == m.grid).all() and moved.placement == "random_start"
        assert moved.layout_hash not in eval_layouts()  # the layout, whatever the start, is never an eval one
    assert len(starts) > 4


def test_a_cached_batch_can_drop_every_row(tiny):
    """When every live row of a batch is cut at a stop string spelled in other tokens (the cache then holds tokens
    past the cut), the turn keeps none of them: selecting no rows must leave an empty batch (dropped before the next
    turn), not fail. A 17x17 evaluation of a GRPO end hit it: ``index_select(): Expected dtype int32 or int64``,
    from an index built of an empty list."""
    model, processor = tiny
    engine = HFEngine(model, processor)
    rollout(engine, processor, maze.TrainSampler(seed=3).take(2), 1, EnvSettings(max_turns=2),
            SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    batch = engine._batches[0]
    assert len(batch.keys) == 2 and batch.cache.get_seq_length() > 0
    batch.select([])
    assert batch.keys == [] and batch.mask.shape[0] == 0 and batch.next_pos.shape == (0,)
    assert batch.cache.get_seq_length() > 0 and batch.cache.layers[0].keys.shape[0] == 0


def test_kv_cache_kept_across_turns_gives_the_re_prefill_paths_episodes_and_logprobs():
    """The shipped SFT start, 12-turn episodes: keeping each episode's KV cache (prefilling only each turn's new
    tokens) gives the re-prefill path's greedy episodes token for token, the same sampled episodes from the same
    seed, engine logprobs the trainer reproduces, and serves most prompt tokens from the cache; dropping old
    frames (env.max_images_in_context) rebuilds the cache and still matches."""
    from models.build import SHIPPED_SFT, load_policy_dir

    model, processor = load_policy_dir(SHIPPED_SFT)
    env = EnvSettings(max_turns=12)  # the shipped start's observation: the defaults
    mazes = maze.TrainSampler(seed=11).take(3)
    for sampling in [SamplingParams(temperature=0.0, max_new_tokens=24),
                     SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)]:
        runs = {}
        for reuse in (False, True):
            engine = HFEngine(model, processor, kv_reuse=reuse)
            runs[reuse] = (engine, rollout(engine, processor, mazes, 3, env, sampling))
        assert [t.token_ids for t in runs[True][1]] == [t.token_ids for t in runs[False][1]]
        engine, trajs = runs[True]
        assert max(t.num_turns for t in trajs) >= 8
        assert 1 - engine.stats["prefilled_tokens"] / engine.stats["prompt_tokens"] > 0.8
    batch = collate([t.token_ids for t in trajs], [t.images for t in trajs], engine.pad_id, engine.image_token_id)
    with torch.no_grad():
        logp = token_logprobs(model, batch, engine.banned_token_ids, 1.0)
    for row, t in enumerate(trajs):
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        assert (logp[row, :len(t.token_ids)][mask] - torch.tensor(t.rollout_logprobs)[mask]).abs().max() < 1e-4
    dropping = replace(env, max_images_in_context=2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    kept = HFEngine(model, processor)
    a = rollout(kept, processor, mazes[:1], 2, dropping, greedy)
    b = rollout(HFEngine(model, processor, kv_reuse=False), processor, mazes[:1], 2, dropping, greedy)
    assert [t.token_ids for t in a] == [t.token_ids for t in b] and max(t.images_dropped for t in a) >= 1


def test_history_window_trains_each_turn_on_the_context_it_was_sampled_with():
    """env.history=K: every turn is its own sample holding exactly the prompt the engine was given (the task, the
    last K turns, its frame) and what it wrote; the trainer reproduces the engine's logprobs on each sample; the
    prompt stays bounded however long the episode; the cached and re-prefill engine paths agree."""
    from maze.env import EnvSettings as Settings
    from models.build import SHIPPED_SFT, load_policy_dir
    from models.forward import collate, token_logprobs
    from rl.rollout import Conversation, window_prompt
    from rl.update import training_rows

    model, processor = load_policy_dir(SHIPPED_SFT)
    mazes = maze.TrainSampler(seed=11).take(2)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)
    for k in (0, 2):
        env = Settings(max_turns=12, history=k)
        runs = {reuse: rollout(HFEngine(model, processor, kv_reuse=reuse), processor, mazes, 2, env, sampling)
                for reuse in (False, True)}
        trajs = runs[True]
        assert [[s.token_ids for s in t.samples] for t in trajs] == [[s.token_ids for s in t.samples]
                                                                     for t in runs[False]]
        assert max(t.num_turns for t in trajs) >= 6
        conv = Conversation(processor)
        image_pad = conv.image_pad
        for t in trajs:
            assert [s.turn for s in t.samples] == list(range(t.num_turns))
            for s in t.samples:
                assert len(s.images) == min(s.turn, k) + 1  # its own frame and the last K before it
                assert sum(tok == image_pad for tok in s.token_ids) == sum(im.num_tokens for im in s.images)
                response = [tok for tok, m in zip(s.token_ids, s.loss_mask) if m]
                assert response and s.loss_mask == [0] * (len(s.token_ids) - len(response)) + [1] * len(response)
                assert processor.tokenizer.decode(response, skip_special_tokens=True) == t.actions[s.turn]
        lengths = [len(s.token_ids) for t in trajs for s in t.samples]
        assert max(lengths) - min(lengths) < (k + 1) * 60  # bounded: no growth with the episode
        rows, episode, turn = training_rows(trajs)
        assert len(rows) == sum(t.num_turns for t in trajs) and turn == [s.turn for s in rows]
        batch = collate([r.token_ids for r in rows], [r.images for r in rows], 0, model.config.image_token_id)
        with torch.no_grad():
            logp = token_logprobs(model, batch, HFEngine(model, processor).banned_token_ids, 1.0)
        for i, r in enumerate(rows):
            m = torch.tensor(r.loss_mask, dtype=torch.bool)
            assert (logp[i, :len(r.token_ids)][m] - torch.tensor(r.rollout_logprobs)[m]).abs().max() < 1e-4
    # the window itself, by hand: K = 1 at turn 2 opens with the task text and turn 1's feedback and frame
    conv = Conversation(processor)
    frames = [conv.image(maze.MazeEnv().reset(seed=s)[0]["image"]) for s in range(3)]
    parts = [{"image": frames[0], "text": "TASK", "response": [7, 8], "closed": True},
             {"image": frames[1], "text": "FB1", "response": [9], "closed": False},
             {"image": frames[2], "text": "FB2"}]
    ids, images = window_prompt(conv, parts, 1, "SYS")
    assert images == frames[1:]
    assert ids == conv.first_turn("TASK\nFB1", frames[1], "SYS") + [9] + conv.next_turn("FB2", frames[2], False)


def test_tiny_architecture_keys_build_a_larger_model_that_runs():
    from models.tiny import build_tiny

    big, processor = build_tiny(0, layers=4, hidden=192, vision_depth=4, vision_hidden=192)
    small, _ = build_tiny(0)
    cfg = big.config
    assert (cfg.text_config.num_hidden_layers, cfg.text_config.hidden_size, cfg.vision_config.depth) == (4, 192, 4)
    assert cfg.vision_config.out_hidden_size == 192 and cfg.vision_config.deepstack_visual_indexes == [2, 3]
    assert (cfg.vision_config.hidden_size, cfg.vision_config.num_heads) == (192, 6)
    assert sum(p.numel() for p in big.parameters()) > 1.5 * sum(p.numel() for p in small.parameters())
    trajs = rollout(HFEngine(big, processor), processor, maze.TrainSampler(seed=1).take(1), 1,
                    EnvSettings(max_turns=2), SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    assert trajs[0].num_turns >= 1 and len(trajs[0].token_ids) > 0


def test_observation_scales_to_15_and_17_without_resizing_and_episodes_fit(tiny):
    """A policy trained at several sizes reads any of them: the default (egocentric, 4 px) frame of every size up to
    19 reaches the model at its own resolution (one merged token per 32 px, no resize), 15x15 and 17x17 are 25 image
    tokens a turn; whole episodes of both at their full budgets (56 and 72 turns, thought-length answers) fit the
    context. The 8 px frame (81 tokens at 17x17) does not fit a whole 17x17 episode, and ``env.history`` windows
    keep every turn's prompt short."""
    from rl.rollout import Conversation
    from tests.test_fuzz_rollout import ScriptedEngine

    _, processor = tiny
    conv = Conversation(processor)
    for size in range(5, 20, 2):
        obs, _ = maze.MazeEnv(size=size).reset(seed=0)
        image = conv.image(obs["image"])
        side = obs["image"].shape[0]
        assert int(image.grid_thw[1]) * 16 == side == int(image.grid_thw[2]) * 16  # not resized
        assert image.num_tokens == (side // 32) ** 2
    tokens = {size: conv.image(maze.MazeEnv(size=size).reset(seed=0)[0]["image"]).num_tokens for size in (9, 15, 17)}
    assert tokens == {9: 9, 15: 25, 17: 25}
    answer = processor.tokenizer.encode("<think>facing up; open up down left</think><action>up</action>",
                                        add_special_tokens=False) + [conv.eos]  # bumps every turn: the full budget
    env = EnvSettings()  # 9x9 budget 20, scaled by area: 15x15 gets 56 turns, 17x17 72
    sampling = SamplingParams(max_new_tokens=32)
    for size, turns in ((15, 56), (17, 72)):
        whole = rollout(ScriptedEngine([answer]), processor, maze.TrainSampler(sizes=[size]).take(1), 1, env,
                        sampling)[0]
        assert whole.finish == "max_turns" and whole.num_turns == turns
        assert len(whole.token_ids) <= env.max_context_tokens
    px8 = replace(env, pixels_per_cell=8, pad_before=8)
    assert conv.image(maze.MazeEnv(px8, size=17).reset(seed=0)[0]["image"]).num_tokens == 81
    whole17 = rollout(ScriptedEngine([answer]), processor, maze.TrainSampler(sizes=[17]).take(1), 1, px8, sampling)[0]
    assert whole17.finish == "context"  # 72 turns of 81 image tokens do not fit 8192
    windowed = rollout(ScriptedEngine([answer]), processor, maze.TrainSampler(sizes=[17]).take(1), 1,
                       replace(px8, history=2), sampling)[0]
    assert windowed.finish == "max_turns" and windowed.num_turns == 72
    assert max(len(s.token_ids) for s in windowed.samples) < 600


@pytest.mark.parametrize("history", [0, 2])
def test_sft_per_turn_samples_are_the_rollouts_prompts(tiny, history):
    """``env.history=K`` SFT: each expert turn is a sample laid out exactly as a rollout prompts the same turn
    (replaying the expert's answers through ``rollout`` gives the same ids and frames), and the SFT batch trains
    exactly the answers."""
    from rl.experts import expert_trajectory
    from rl.rollout import Conversation
    from rl.sft import batch as sft_batch
    from tests.test_fuzz_rollout import ScriptedEngine

    _, processor = tiny
    env = EnvSettings(history=history)
    m = maze.TrainSampler(seed=6).take(1)[0]
    expert = expert_trajectory(m, Conversation(processor), env, "bfs", with_thought=True, max_turns=env.max_turns)
    assert expert.success and len(expert.samples) == expert.num_turns
    answers = [s.token_ids[s.loss_mask.index(1):] for s in expert.samples]
    replay = rollout(ScriptedEngine(answers), processor, [m], 1, env, SamplingParams(max_new_tokens=64))[0]
    assert replay.success and len(replay.samples) == len(expert.samples)
    for a, b in zip(expert.samples, replay.samples):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.turn == b.turn
        assert [im.array.tobytes() for im in a.images] == [im.array.tobytes() for im in b.images]
        assert len(a.images) == min(a.turn, history) + 1
    batch = sft_batch([expert, expert], 1)  # the second is a zero-weight stand-in
    assert len(batch.rows) == 2 * len(expert.samples) and batch.kept == list(range(len(expert.samples)))
    assert int(batch.mask.sum()) == sum(len(x) for x in answers)


def test_greedy_sft_expert_follows_its_search_through_noise_turns(tiny):
    """The ``greedy`` expert (depth-first search toward the goal) keeps a consistent search when SFT noise moves the
    agent for it (several noise turns in a row included): it reaches the goal and never stops anywhere else."""
    from rl.experts import expert_trajectory
    from rl.rollout import Conversation

    _, processor = tiny
    env = EnvSettings()
    for seed, m in enumerate(maze.TrainSampler(seed=8).take(8)):
        t = expert_trajectory(m, Conversation(processor), env, "greedy", noise=0.1, seed=seed, max_turns=200,
                              with_thought=True, lookahead=8)
        assert t.success and not any(i["stopped_wrong"] for i in t.infos), seed
        clean = expert_trajectory(m, Conversation(processor), env, "greedy", max_turns=200)
        assert clean.success and clean.final_info["moves"] >= clean.final_info["optimal_steps"]


def test_auto_attention_is_flash_only_for_half_precision_on_cuda_and_a_broken_wheel_falls_back(monkeypatch, caplog):
    """``attn_implementation=auto`` with a usable flash-attn: flash_attention_2 for bf16/fp16 on CUDA, sdpa for the
    float32 default (flash-attn has no fp32 kernel: choosing it made `cluster=8gpu` die at its first forward) and on
    CPU. A flash_attn that transformers lists but that fails to import (a wheel built for another torch) is sdpa
    with one warning line."""
    import importlib

    import transformers.utils

    from models import build

    usable = lambda: True  # noqa: E731  (the question "is flash-attn usable here" answered yes)
    assert build.attn_implementation("auto", "cuda", "bfloat16", usable) == "flash_attention_2"
    assert build.attn_implementation("auto", "cuda", "float16", usable) == "flash_attention_2"
    assert build.attn_implementation("auto", "cuda", "float32", usable) == "sdpa"
    assert build.attn_implementation("auto", "cpu", "bfloat16", usable) == "sdpa"
    assert build.attn_implementation("eager", "cuda", "float32", usable) == "eager"
    assert build.attn_implementation("auto", "cuda", "bfloat16", lambda: False) == "sdpa"

    def broken(name, *args, **kwargs):
        if name == "flash_attn":
            raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c105ErrorC2E")
        return real_import(name, *args, **kwargs)

    real_import = importlib.import_module
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    monkeypatch.setattr(build.importlib, "import_module", broken)
    with caplog.at_level("WARNING", logger="models.build"):
        assert build.attn_implementation("auto", "cuda", "bfloat16") == "sdpa"
    assert [r.getMessage() for r in caplog.records] == [
        "flash_attn is installed but does not import (ImportError: flash_attn_2_cuda.so: undefined symbol: "
        "_ZN3c105ErrorC2E); using sdpa"]


@pytest.mark.parametrize("size,ppc,pad", [(9, 4, 12), (7, 4, 12), (13, 4, 12), (9, 2, 14), (9, 8, 8)])
def test_agent_token_is_the_merged_token_the_processor_puts_the_agents_cell_in(tiny, size, ppc, pad):
    """``maze.env.agent_token``: the agent's disc (the only difference between a frame with the agent and one
    without) lands in exactly the merged image token it names, in the processor's patch order (four patches per
    merged token, row-major): the token the visual auxiliary target reads."""
    from maze.env import MazeRenderer, agent_token

    _, processor = tiny
    m = maze.generate_maze(size=size, seed=3)
    r = MazeRenderer(m, ppc, pad_to=32, pad_before=pad, view="egocentric")
    with_agent, without = (processor.image_processor(images=[r.frame(a)], return_tensors="pt")
                           for a in (m.start, None))
    side = r.shape[0]
    assert with_agent["image_grid_thw"][0].tolist() == [1, side // 16, side // 16]  # not resized
    rows = (with_agent["pixel_values"] != without["pixel_values"]).any(dim=1).nonzero().flatten()
    assert len(rows) and {int(k) // 4 for k in rows} == {agent_token(size, ppc, 32, pad)}


def test_the_visual_auxiliary_target_trains_the_vision_tower_alone_and_is_learnable():
    """SFT's visual auxiliary target (``algo.sft_aux_weight``): the expert's frames carry the open ways and pockets
    at the agent's cell for its token (``maze.thought.reading_target``); ``rl.sft.AuxReadout`` reads them from the
    trainer's own forward (``observing_vision``). Its term alone puts gradient on the vision tower and none on the
    language model, and a few optimizer steps on it alone lower it; the readout stays fixed (nothing to save)."""
    from maze.env import agent_token
    from maze.thought import reading_target
    from rl.experts import expert_trajectory
    from rl.rollout import Conversation
    from rl.sft import AuxReadout
    from rl.sft import batch as sft_batch
    from rl.update import Scoring, accumulate, update_step

    model, processor = build_tiny(seed=0)
    env = EnvSettings()
    token = agent_token(9, env.pixels_per_cell, env.pad_to, env.pad_before)
    conv = Conversation(processor, keep_pixels=False)
    trajs = [expert_trajectory(m, conv, env, "bfs", with_thought=True, lookahead=8, aux_token=token, max_turns=6)
             for m in maze.TrainSampler(seed=5).take(2)]
    t = trajs[0]
    assert t.images[0].target == (token, reading_target(t.maze, t.maze.start, 8))
    assert all(im.target is not None for tr in trajs for im in tr.images)
    b = sft_batch(trajs, len(trajs))
    e = HFEngine(model, processor)
    scoring = Scoring(e.pad_id, e.image_token_id, e.banned_token_ids, 1.0, share_images=True)
    aux = AuxReadout(weight=1.0)
    only_aux = aux.loss_fn(lambda lp, *rest: ((lp * 0).sum(), {}))

    aux.begin_step(b, b.kept, 8)

    def aux_step(opt):
        with models_forward.observing_vision(aux):
            stats, n, _ = update_step(model, opt, b, [b.kept], 8, 1e9, scoring, only_aux, fsdp=False, ddp=False)
        return stats

    visual = set(id(p) for p in model.model.visual.parameters())
    model.zero_grad()
    with models_forward.observing_vision(aux):
        stats = accumulate(model, b, b.kept, 8, scoring, only_aux)
    n_frames = len({id(im) for tr in trajs for im in tr.images})
    assert stats["aux_entries"] == 4 * n_frames  # every distinct frame once, four ways each
    # the term is the step's mean: the same in one micro-batch or in one per conversation
    model.zero_grad()
    aux.begin_step(b, b.kept, 1)
    with models_forward.observing_vision(aux):
        split = accumulate(model, b, b.kept, 1, scoring, only_aux)
    assert split["aux"] == pytest.approx(stats["aux"], rel=1e-5)
    model.zero_grad()
    aux.begin_step(b, b.kept, 8)
    with models_forward.observing_vision(aux):
        stats = accumulate(model, b, b.kept, 8, scoring, only_aux)
    grads = {id(p): p.grad for p in model.parameters()}
    assert any(g is not None and g.abs().sum() > 0 for k, g in grads.items() if k in visual)
    assert all(g is None or g.abs().sum() == 0 for k, g in grads.items() if k not in visual)
    opt = torch.optim.Adam(model.model.visual.parameters(), lr=3e-3)
    first = aux_step(opt)["aux"]
    for _ in range(8):
        last = aux_step(opt)["aux"]
    assert last < 0.7 * first
    w = aux.readout(0, 8, torch.zeros(1))  # the readout it trained against (drawn at its first use)
    assert torch.equal(w, AuxReadout(1.0).readout(w.shape[0], 8, torch.zeros(1)))  # a fixed draw: resume sees it
