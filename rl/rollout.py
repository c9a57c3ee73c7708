"""Multi-turn rollouts: B mazes x G samples, token-in / token-out, one batched engine call a turn.

A trajectory is built by appending token ids, never by re-tokenising decoded text:

    [system + user(image, task) + "<|im_start|>assistant\\n"]   mask 0   (turn-0 prompt)
    [generated tokens]                                           mask 1   (engine logprobs kept)
    ["<|im_end|>\\n<|im_start|>user\\n" image feedback "<|im_end|>\\n<|im_start|>assistant\\n"]  mask 0
    ...

so decoding the ids gives the chat-template rendering of the conversation, and the trainer
scores exactly the ids the engine sampled. Episodes leave the batch when they end (success,
stop, max turns, context limit). ``max_images_in_context`` removes the oldest image span from
the context; earlier turns were sampled with it present, so their engine logprobs no longer
match the trainer's on the shortened sequence (the logprob gap metric shows it; ``algo.tis_cap``
corrects for it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from maze.core import Maze
from maze.env import SYSTEM_PROMPT, EnvSettings, MazeEnv
from models.engines.base import Engine, ImageInput, Prompt, SamplingParams, derive_seed

IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class TurnSample:
    """One turn as its own training sequence (``env.history=K``): exactly the ids the engine was given for that turn
    (the system prompt and the last K turns before it, with their frames) and the ids it wrote (mask 1)."""

    token_ids: list[int]  # (T,)
    loss_mask: list[int]  # (T,) 1 on the turn's response
    rollout_logprobs: list[float]  # (T,) engine logprobs; 0 where mask 0
    images: list[ImageInput]  # the window's frames, in order
    turn: int  # the turn's index in its episode


@dataclass
class Trajectory:
    maze: Maze
    group: int  # index of the maze within the step (all G samples of a group share it)
    token_ids: list[int] = field(default_factory=list)  # (T,) the whole conversation
    loss_mask: list[int] = field(default_factory=list)  # (T,) 1 on model-written tokens
    rollout_logprobs: list[float] = field(default_factory=list)  # (T,) engine logprobs; 0 where mask 0
    images: list[ImageInput] = field(default_factory=list)  # images still in the context, in order
    actions: list[str] = field(default_factory=list)  # decoded text of each assistant turn
    infos: list[dict] = field(default_factory=list)  # env info after each turn
    finish: str = ""  # success | stop_wrong | max_turns | context
    images_dropped: int = 0  # images removed by env.max_images_in_context
    samples: list[TurnSample] = field(default_factory=list)  # env.history=K: each turn as trained (else empty)

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        """Extend the sequence by ``ids``, all with loss ``mask``; logprobs default to 0 (not sampled)."""
        self.token_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.rollout_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    @property
    def success(self) -> bool:
        return bool(self.infos and self.infos[-1]["success"])

    @property
    def num_turns(self) -> int:
        return len(self.actions)

    @property
    def final_info(self) -> dict:
        return self.infos[-1] if self.infos else {}

    @property
    def path(self) -> list[tuple[int, int]]:
        return [self.maze.start] + [tuple(i["position"]) for i in self.infos]


def finish_reason(info: dict) -> str:
    """How an episode that the env ended finished: success | stop_wrong | max_turns."""
    return "success" if info["success"] else ("stop_wrong" if info["stopped_wrong"] else "max_turns")


class Conversation:
    """Turns text segments and images into token ids with expanded image placeholders."""

    def __init__(self, processor, keep_pixels: bool = True):
        self.processor, self.tok = processor, processor.tokenizer
        self.image_pad = self.tok.convert_tokens_to_ids("<|image_pad|>")
        self.vision_start = self.tok.convert_tokens_to_ids("<|vision_start|>")
        self.vision_end = self.tok.convert_tokens_to_ids("<|vision_end|>")
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.assistant_close = self.tok.encode("<|im_end|>\n", add_special_tokens=False)
        self.newline = self.tok.encode("\n", add_special_tokens=False)
        self.keep_pixels = keep_pixels
        self._cache: dict[bytes, ImageInput] = {}

    def _preprocess(self, array) -> torch.Tensor:
        return self.processor.image_processor(images=[array], return_tensors="pt")["pixel_values"]

    def image(self, array) -> ImageInput:
        key = array.tobytes()  # identical frames (a group's first turn) are encoded once
        if key not in self._cache:
            out = self.processor.image_processor(images=[array], return_tensors="pt")
            if self.keep_pixels:
                self._cache[key] = ImageInput(out["pixel_values"], out["image_grid_thw"][0], array)
            else:
                self._cache[key] = ImageInput(None, out["image_grid_thw"][0], array, self._preprocess)
        return self._cache[key]

    def encode(self, text: str, images: list[ImageInput]) -> list[int]:
        """Tokenise ``text`` whose image slots hold one ``<|image_pad|>`` each, then expand them."""
        ids = self.tok.encode(text, add_special_tokens=False)
        out, k = [], 0
        for t in ids:
            if t == self.image_pad:
                out.extend([t] * images[k].num_tokens)
                k += 1
            else:
                out.append(t)
        assert k == len(images), "one image per image slot"
        return out

    def first_turn(self, task_text: str, image: ImageInput, system: str = SYSTEM_PROMPT) -> list[int]:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": task_text}]}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text, [image])

    def next_turn(self, feedback: str, image: ImageInput, closed: bool) -> list[int]:
        """Tokens after an assistant turn: close it (if the model did not), then user + image."""
        head = "\n" if closed else "<|im_end|>\n"
        text = f"{head}<|im_start|>user\n{IMAGE_SLOT}{feedback}<|im_end|>\n<|im_start|>assistant\n"
        return self.encode(text, [image])

    def drop_oldest_image(self, traj: Trajectory) -> None:
        start = traj.token_ids.index(self.vision_start)
        end = traj.token_ids.index(self.vision_end, start) + 1
        for seq in (traj.token_ids, traj.loss_mask, traj.rollout_logprobs):
            del seq[start:end]
        traj.images.pop(0)
        traj.images_dropped += 1


def start_episode(maze: Maze, conv: Conversation, env: EnvSettings, group: int = 0,
                  max_turns: int | None = None) -> tuple[MazeEnv, Trajectory]:
    """Reset a MazeEnv on ``maze`` and open its trajectory with the turn-0 prompt (mask 0)."""
    e = MazeEnv(env, turn_limit=max_turns or env.turns_for(maze.size))
    obs, _ = e.reset(options={"maze": maze})
    t = Trajectory(maze=maze, group=group)
    image = conv.image(obs["image"])
    t.images.append(image)
    t.append(conv.first_turn(obs["text"], image, e.system_prompt), 0)
    return e, t


def window_prompt(conv: Conversation, parts: list[dict], history: int, system: str) -> tuple[list[int], list]:
    """``env.history=K``: the prompt of the newest turn in ``parts`` (one dict per turn: its frame ``image``, the
    ``text`` the env gave with it, and for all but the newest the ``response`` ids and whether it ``closed``), with
    only the last K turns before it. The window opens with the task text (then that turn's feedback) and its
    frame; the turns after it are laid out as in the whole-episode sequence. Returns (ids, images)."""
    s = max(0, len(parts) - 1 - history)
    head = parts[s]["text"] if s == 0 else f"{parts[0]['text']}\n{parts[s]['text']}"
    ids = conv.first_turn(head, parts[s]["image"], system)
    for prev, cur in zip(parts[s:-1], parts[s + 1:]):
        ids = ids + prev["response"] + conv.next_turn(cur["text"], cur["image"], prev["closed"])
    return ids, [p["image"] for p in parts[s:]]


_ROLLOUTS = itertools.count()


@torch.no_grad()
def rollout(engine: Engine, processor, mazes: list[Maze], group_size: int, env: EnvSettings,
            sampling: SamplingParams, progress: bool = False, desc: str = "rollout") -> list[Trajectory]:
    """Play ``group_size`` episodes on each maze; returns B*G trajectories, group-major.

    ``env.history`` = K: each turn is prompted with the last K turns only (``window_prompt``) and kept as its own
    ``TurnSample``; the trajectory's whole-episode sequence is still recorded (transcripts, token counts)."""
    conv = Conversation(processor)
    trajs, envs, parts, prompts = [], [], [], []
    history = env.history
    for g, maze in enumerate(mazes):
        for _ in range(group_size):
            e, t = start_episode(maze, conv, env, group=g)
            trajs.append(t)
            envs.append(e)
            if history is not None:
                parts.append([{"image": t.images[0], "text": e.task_prompt}])
                prompts.append(window_prompt(conv, parts[-1], history, e.system_prompt))
    live = list(range(len(trajs)))
    episode_ids = next(_ROLLOUTS)  # keys this rollout's episodes apart from any other's in the engine's cache
    bar = tqdm(total=max(env.turns_for(m.size) for m in mazes), desc=desc, disable=not progress, leave=False)
    turn = 0
    while live:
        seed = None if sampling.seed is None else derive_seed(sampling.seed, turn)
        params = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens,
                                sampling.stop, seed)
        if history is None:
            requests = [Prompt(trajs[i].token_ids, trajs[i].images, (episode_ids, i)) for i in live]
        else:
            requests = [Prompt(prompts[i][0], prompts[i][1], (episode_ids, i)) for i in live]
        completions = engine.generate(requests, params)
        still = []
        for i, comp in zip(live, completions):
            t, e = trajs[i], envs[i]
            keep = sampling.max_new_tokens  # the per-turn limit holds whatever the engine returns
            t.append(comp.token_ids[:keep], 1, comp.logprobs[:keep])
            if history is not None:
                (ids, images), out = prompts[i], comp.token_ids[:keep]
                t.samples.append(TurnSample(ids + out, [0] * len(ids) + [1] * len(out),
                                            [0.0] * len(ids) + list(comp.logprobs[:keep]), images, turn))
            text = processor.tokenizer.decode(comp.token_ids[:keep], skip_special_tokens=True)
            t.actions.append(text)
            obs, _, terminated, truncated, info = e.step(text)
            t.infos.append(info)
            closed = bool(comp.token_ids[:keep]) and comp.token_ids[:keep][-1] == conv.eos
            if terminated or truncated:
                t.finish = finish_reason(info)
                t.append(conv.newline if closed else conv.assistant_close, 0)
                continue
            image = conv.image(obs["image"])
            nxt = conv.next_turn(obs["text"], image, closed)
            length = len(t.token_ids) + len(nxt)  # the next prompt's length
            if history is not None:
                parts[i][-1].update(response=comp.token_ids[:keep], closed=closed)
                parts[i].append({"image": image, "text": obs["text"]})
                prompts[i] = window_prompt(conv, parts[i], history, e.system_prompt)
                length = len(prompts[i][0])
            if length + sampling.max_new_tokens > env.max_context_tokens:
                t.finish = "context"
                t.append(conv.newline if closed else conv.assistant_close, 0)
                continue
            t.images.append(image)
            t.append(nxt, 0)
            while env.max_images_in_context and len(t.images) > env.max_images_in_context:
                conv.drop_oldest_image(t)
            still.append(i)
        live = still
        turn += 1
        bar.update(1)
    bar.close()
    return trajs
