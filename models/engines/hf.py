"""Transformers rollout engine: one batched ``generate`` (KV cache) over all live episodes.

The CPU default. It shares the policy module with the trainer, so ``update_weights`` has
nothing to copy; ``sleep``/``wake`` are no-ops.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from models.engines.base import Completion, Prompt, SamplingParams, banned_token_ids, derive_seed, output_vocab_size
from rl.logprobs import collate, encoder_outputs_supported, masked_logits


class HFEngine:
    def __init__(self, model, processor, micro_batch: int = 64, compute_dtype: torch.dtype = torch.float32):
        self.model, self.processor = model, processor
        self.compute_dtype = compute_dtype  # an fp32 module shared with the trainer samples under its autocast
        self.tokenizer = processor.tokenizer
        self.banned_token_ids = banned_token_ids(self.tokenizer, output_vocab_size(model))
        self.eos_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = self.tokenizer.pad_token_id
        self.image_token_id = model.config.image_token_id
        self.micro_batch = micro_batch

    def _cut(self, tokens: list[int], stop: tuple[str, ...]) -> tuple[int, str]:
        """Length to keep: through the first EOS or the first completed stop string."""
        for i, tok in enumerate(tokens):
            if tok == self.eos_id:
                return i + 1, "stop"
            if stop and any(s in self.tokenizer.decode(tokens[max(0, i - 15):i + 1]) for s in stop):
                return i + 1, "stop"
        return len(tokens), "length"

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Completion]:
        from models.distributed import compute_context

        out: list[Completion] = []
        for lo in range(0, len(prompts), self.micro_batch):
            part = sampling  # each micro-batch its own seed, so no two rows share a random stream
            if sampling.seed is not None and lo > 0:
                part = replace(sampling, seed=derive_seed(sampling.seed, lo))
            with compute_context(self.model, self.compute_dtype):
                out.extend(self._generate(prompts[lo:lo + self.micro_batch], part))
        return out

    def _encode_images(self, prompts: list[Prompt]):
        """Vision features of every image in ``prompts``, each image encoded once per rollout.

        A multi-turn context holds all earlier frames; re-running the vision tower on them every
        turn would cost O(turns^2) encodes. Features are cached on the ``ImageInput`` (which lives
        for one rollout, i.e. one set of weights) and passed as ``mm_encoder_outputs``.
        """
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        flat = [im for p in prompts for im in p.images]
        todo = list({id(im): im for im in flat if im.features is None}.values())
        if todo:
            p = next(self.model.parameters())
            out = self.model.model.get_image_features(torch.cat([im.pixels() for im in todo]).to(p.device, p.dtype),
                                                      torch.stack([im.grid_thw for im in todo]).to(p.device))
            for k, im in enumerate(todo):
                im.features = (out.pooler_output[k], [layer[k] for layer in out.deepstack_features])
        if not flat:
            return None
        layers = len(flat[0].features[1])
        return {"image": BaseModelOutputWithDeepstackFeatures(
            pooler_output=tuple(im.features[0] for im in flat),
            deepstack_features=[tuple(im.features[1][lay] for im in flat) for lay in range(layers)])}

    def _generate(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Completion]:
        cached = encoder_outputs_supported(self.model)  # else (transformers < 5.19) re-encode from pixels
        batch = collate([p.token_ids for p in prompts], [p.images for p in prompts], self.pad_id,
                        self.image_token_id, left_pad=True, with_pixels=not cached)
        param = next(self.model.parameters())
        batch = {k: v.to(param.device, param.dtype) if k == "pixel_values" else v.to(param.device)
                 for k, v in batch.items()}
        encoded = self._encode_images(prompts) if cached else None
        if encoded is not None:
            batch["mm_encoder_outputs"] = encoded
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        was_training = self.model.training
        self.model.eval()
        self.model.model.rope_deltas = None
        kwargs = dict(do_sample=not sampling.greedy, max_new_tokens=sampling.max_new_tokens,
                      suppress_tokens=self.banned_token_ids, eos_token_id=self.eos_id,
                      pad_token_id=self.pad_id, return_dict_in_generate=True, output_logits=True,
                      stop_strings=list(sampling.stop) or None, tokenizer=self.tokenizer)
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        gen = self.model.generate(**batch, **kwargs)
        if was_training:
            self.model.train()
        width = batch["input_ids"].shape[1]
        new_tokens = gen.sequences[:, width:]  # (B, L)
        logits = torch.stack(gen.logits, dim=1)  # (B, L, V) raw
        temp = sampling.temperature if not sampling.greedy else 1.0
        logp = torch.log_softmax(masked_logits(logits, self.banned_token_ids, temp), dim=-1)
        logp = logp.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # (B, L)
        completions = []
        for row in range(new_tokens.shape[0]):
            tokens = new_tokens[row].tolist()
            keep, reason = self._cut(tokens, sampling.stop)
            completions.append(Completion(tokens[:keep], logp[row, :keep].tolist(), reason))
        return completions

    def update_weights(self, named_tensors=None) -> None:
        """Copy new weights into the engine's module, one tensor at a time as they arrive (``named_tensors``:
        a dict or an iterator of (name, tensor), e.g. ``models.distributed.stream_full_weights``); None when the
        module is the trainer's own. Every entry of the module's state dict must arrive."""
        if named_tensors is None:
            return
        target = self.model.state_dict()
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        seen = set()
        with torch.no_grad():
            for name, t in items:
                if name not in target:
                    raise RuntimeError(f"weight push: {name} is not a parameter of the engine's model")
                target[name].copy_(t)
                seen.add(name)
        if seen != set(target):
            missed = sorted(set(target) - seen)
            raise RuntimeError(f"weight push left {len(missed)} tensors unchanged ({', '.join(missed[:5])})")

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass

    def wake(self) -> None:
        pass
