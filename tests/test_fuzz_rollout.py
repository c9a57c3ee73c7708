"""Hostile model output: a rollout never crashes, whatever text or token ids the engine returns."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import maze
from maze.env import EnvSettings
from models.engines.base import Completion, SamplingParams
from models.tiny import build_tiny
from rl.rollout import rollout

_TINY = {}


def tiny():
    if not _TINY:
        _TINY["processor"] = build_tiny(0)[1]
    return _TINY["processor"]


class ScriptedEngine:
    """An engine double that answers with given outputs: the fuzz target is rollout + env + parser."""

    def __init__(self, outputs):
        self.outputs, self.calls, self.banned_token_ids = outputs, 0, []

    def generate(self, prompts, sampling):
        out = []
        for _ in prompts:
            ids = self.outputs[self.calls % len(self.outputs)]
            self.calls += 1
            out.append(Completion(list(ids), [-1.0] * len(ids), "length"))
        return out


texts = st.one_of(st.text(max_size=300), st.just("<action>" * 50),
                  st.text(alphabet="<>/actionupdwlfrgs ,\n", max_size=120),
                  st.sampled_from(["<action>up</action>", "<action></action>", "</action><action>"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(texts.map(lambda t: ("text", t)),
                          st.lists(st.integers(0, 498), max_size=80).map(lambda ids: ("ids", ids))),
                min_size=1, max_size=6))
def test_rollout_survives_arbitrary_model_output(outputs):
    processor = tiny()
    tok = processor.tokenizer
    encoded = [tok.encode(v, add_special_tokens=False) if kind == "text" else v for kind, v in outputs]
    engine = ScriptedEngine(encoded)
    m = maze.TrainSampler(seed=2).take(1)
    env = EnvSettings(max_turns=4, max_context_tokens=2048)
    trajs = rollout(engine, processor, m, 2, env, SamplingParams(max_new_tokens=32))
    for t in trajs:
        assert len(t.token_ids) == len(t.loss_mask) == len(t.rollout_logprobs)
        assert 1 <= t.num_turns <= 4 and t.finish in ("success", "stop_wrong", "max_turns", "context")
        assert len(t.token_ids) <= env.max_context_tokens
        # the per-turn limit holds even when the engine returns more
        runs, cur = [], 0
        for mask in t.loss_mask + [0]:
            if mask:
                cur += 1
            elif cur:
                runs.append(cur)
                cur = 0
        assert all(r <= 32 for r in runs)


def test_context_limit_ends_episodes():
    processor = tiny()
    long_text = processor.tokenizer.encode("You moved up. " * 10, add_special_tokens=False)
    trajs = rollout(ScriptedEngine([long_text]), processor, maze.TrainSampler(seed=2).take(1), 1,
                    EnvSettings(max_turns=40, max_context_tokens=600), SamplingParams(max_new_tokens=48))
    assert trajs[0].finish == "context" and len(trajs[0].token_ids) <= 600


@pytest.mark.parametrize("text", ["", "\x00\x01\x02", "<action>" * 10_000, "💥" * 500])
def test_env_step_takes_any_text(text):
    env = maze.MazeEnv(size=7)
    env.reset(seed=1)
    _, _, _, _, info = env.step(text)
    assert info["invalid_actions"] == 1
