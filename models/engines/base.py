"""The rollout-engine protocol: token ids + images in, token ids + logprobs out.

An engine never sees text it has to tokenise: prompts are token ids whose image placeholders
are already expanded, plus the images' preprocessed patches. Completions carry per-token
logprobs of the *sampling* distribution: logits with ``banned_token_ids`` removed, divided by
the temperature (top-p is not applied to the reported logprobs). The trainer recomputes
exactly that quantity (``models.forward``), so the two can be compared token by token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


@dataclass
class ImageInput:
    """One image: its raw pixels, patch grid and (unless kept lazy) its preprocessed patches.

    Rollouts keep ``pixel_values`` so an image is preprocessed once per step. Large datasets
    (SFT) keep only the uint8 ``array`` (~10x smaller) and set ``preprocess`` to recompute the
    patches when a batch needs them.
    """

    pixel_values: torch.Tensor | None  # (num_patches, channels * temporal_patch * patch * patch) float
    grid_thw: torch.Tensor  # (3,) long: temporal, height, width in patches
    array: object = None  # the original (H, W, 3) uint8 image, for engines that take raw images
    preprocess: object = None  # callable(array) -> pixel_values, used when pixel_values is None
    features: object = None  # engine-side cache of the vision tower's output for this image (no grad)
    target: object = None  # (token index, target vector): a recipe's auxiliary target for the vision tower's output
    # at that merged token of this image (SFT's algo.sft_aux_weight), else None

    def pixels(self) -> torch.Tensor:
        return self.pixel_values if self.pixel_values is not None else self.preprocess(self.array)

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens after the 2x2 spatial merge."""
        return int(self.grid_thw.prod()) // 4


@dataclass
class Prompt:
    token_ids: list[int]  # (T,) with image placeholders expanded
    images: list[ImageInput] = field(default_factory=list)  # in order of appearance
    key: object = None  # the episode this prompt continues (hashable): an engine may keep its KV cache between
    # turns under it; it still checks that the cached tokens are a prefix of ``token_ids`` before reusing them


@dataclass
class Completion:
    token_ids: list[int]  # (L,) generated tokens, cut after the stop string or EOS
    logprobs: list[float]  # (L,) log p(token) under the sampling distribution
    finish_reason: str  # "stop" (stop string or EOS) | "length"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 48
    stop: tuple[str, ...] = ("</action>",)
    seed: int | None = None  # None: unseeded; else each request gets derive_seed(seed, request index)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Engine(Protocol):
    """What the rollout and the trainer use of an engine (``models/engines/hf.py``, ``models/engines/vllm.py``)."""

    banned_token_ids: list[int]  # never sampled (special tokens, padded vocabulary rows)
    pad_id: int
    stats: dict  # prompt_tokens, prefilled_tokens: the last rollout's, for the prompt-cache hit rate

    def generate(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Completion]: ...

    def update_weights(self, named_tensors) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


def derive_seed(*parts: int) -> int:
    """A sampling seed in [0, 2**31) that depends on every part (run seed, step, rank, turn, request index).

    Hashing (numpy's SeedSequence) instead of arithmetic keeps nearby tuples apart: ``seed + turn`` would
    give rank 0's turn 1 the seeds of rank 1's turn 0.
    """
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0] >> 1)


def banned_token_ids(tokenizer, vocab_size: int | None = None) -> list[int]:
    """The one definition of what a policy may not write, used by every engine and by the trainer.

    Special tokens: vision markers and chat-structure tokens (sampling an ``<|image_pad|>`` into the text
    would desynchronise image features and placeholders on the next forward; ``<|im_start|>`` would let
    the model speak as the user). And the model's padded vocabulary rows, ids from ``len(tokenizer)`` to
    ``vocab_size`` (real checkpoints pad their embedding matrix): no text maps to them.
    """
    names = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>",
             "<|im_start|>", "<|endoftext|>"]
    ids = [tokenizer.convert_tokens_to_ids(n) for n in names]
    unk = getattr(tokenizer, "unk_token_id", None)
    special = {i for i in ids if i is not None and i != unk}
    return sorted(special | set(range(len(tokenizer), vocab_size or 0)))


def output_vocab_size(model) -> int:
    """Rows of a model's output layer (its logits' last dimension)."""
    return int(model.get_output_embeddings().weight.shape[0])
