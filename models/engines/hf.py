"""Transformers rollout engine: all live episodes decoded as one batch, their KV caches kept across turns.

The CPU default. It shares the policy module with the trainer (or holds a copy under FSDP2, which
``update_weights`` fills), ``sleep``/``wake`` are no-ops.

**Constant-cost turns** (``kv_reuse``, the default). A multi-turn episode's prompt at turn k is its prompt
at turn k-1, the tokens sampled then, and the new feedback and frame. The engine keeps each episode's KV
cache (``Prompt.key``) between turns and prefills only the new tokens, so a turn costs the same at turn 25
as at turn 1 (re-prefilling the whole context makes it grow with the episode). The live episodes share one
batched ``DynamicCache``: each turn's new segments are left-padded to a common length and the padding stays
in the cache as masked holes; episodes that ended leave the batch; Qwen3-VL's 3D (mrope) positions are
passed explicitly, each segment's computed by ``get_rope_index`` on the segment alone and shifted to
continue its episode (mrope positions are translation-equivariant: an image block starts one past the
largest position before it). The decode loop samples, gathers logprobs and detects EOS and the stop
strings' token sequences on tensors. A cached episode is reused only if its cached tokens and images are a
prefix of the new prompt; otherwise (context dropped by ``env.max_images_in_context``, a stop string
written in an unusual tokenisation) that episode is prefilled afresh. ``kv_reuse=False`` is the previous
path (``generate`` re-prefilling every turn), kept as the benchmark's baseline.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

from models.engines.base import Completion, Prompt, SamplingParams, banned_token_ids, derive_seed, output_vocab_size
from models.forward import collate, compute_context, encoder_outputs_supported, masked_logits


@functools.cache
def native_gqa_on_cpu() -> bool:
    """Let transformers' sdpa attention use torch's grouped-query support on CPU when a mask is given.

    transformers enables ``enable_gqa`` only without a mask (the condition for CUDA's fused kernels) and
    otherwise copies every key/value head ``n_rep`` times per layer per forward (``repeat_kv``): with a KV cache
    of L tokens that is an O(L) copy per decoded token, most of a late turn's time on CPU. torch's CPU kernel
    takes a mask with ``enable_gqa`` and gives the same numbers (tests/test_models_rollout.py). Returns whether
    the switch is in place (False where this transformers has no such hook)."""
    try:
        from transformers.integrations import sdpa_attention as sdpa  # absent from some transformers
    except ImportError:
        return False
    original = getattr(sdpa, "use_gqa_in_sdpa", None)
    if original is None:
        return False

    def use_gqa_in_sdpa(attention_mask, key, value):
        if key.device.type == "cpu" and key.shape[-1] == value.shape[-1]:
            return True
        return original(attention_mask, key, value)

    sdpa.use_gqa_in_sdpa = use_gqa_in_sdpa
    return True


@functools.cache
def _growing_layer_class():
    class GrowingLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys/values live in a buffer grown by doubling: appending a turn's tokens or one
        decoded token writes in place instead of concatenating the whole cache (which costs O(length) per decoded
        token and made late turns slow); ``keys``/``values`` are views of the filled part."""

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.length = 0
                self._kbuf = self._vbuf = None
            n = key_states.shape[-2]
            need = self.length + n
            if self._kbuf is None or need > self._kbuf.shape[-2]:
                cap = max(need, 2 * (self._kbuf.shape[-2] if self._kbuf is not None else 128))
                kbuf = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))
                vbuf = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
                if self.length:
                    kbuf[..., :self.length, :] = self._kbuf[..., :self.length, :]
                    vbuf[..., :self.length, :] = self._vbuf[..., :self.length, :]
                self._kbuf, self._vbuf = kbuf, vbuf
            self._kbuf[..., self.length:need, :] = key_states
            self._vbuf[..., self.length:need, :] = value_states
            self.length = need
            self.keys, self.values = self._kbuf[..., :need, :], self._vbuf[..., :need, :]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def _select(self, idx):
            if self.is_initialized and self._kbuf is not None:
                self._kbuf = self._kbuf.index_select(0, idx.to(self._kbuf.device))
                self._vbuf = self._vbuf.index_select(0, idx.to(self._vbuf.device))
                self.keys, self.values = self._kbuf[..., :self.length, :], self._vbuf[..., :self.length, :]

        def reorder_cache(self, beam_idx):
            self._select(beam_idx)

        def batch_select_indices(self, indices):
            self._select(indices)

    return GrowingLayer


def _new_cache():
    cache = DynamicCache()
    cache.layer_class_to_replicate = _growing_layer_class()
    return cache


@dataclass
class _Batch:
    """Live episodes sharing one batched KV cache (holes masked)."""

    keys: list  # (R,) Prompt.key of each row
    cache: object  # transformers DynamicCache, batch R
    mask: torch.Tensor  # (R, L) long: 1 where the cache holds a real token of that row
    tokens: list  # (R,) each row's real tokens in the cache, in order
    images: list  # (R,) each row's images in the cache, in order
    next_pos: torch.Tensor  # (R,) long: the row's next text position (largest position so far + 1)

    def select(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)  # long even when rows == []
        self.cache.reorder_cache(idx)
        self.mask, self.next_pos = self.mask[idx], self.next_pos[idx]
        self.keys = [self.keys[r] for r in rows]
        self.tokens = [self.tokens[r] for r in rows]
        self.images = [self.images[r] for r in rows]


class HFEngine:
    def __init__(self, model, processor, micro_batch: int = 64, compute_dtype: torch.dtype = torch.float32,
                 kv_reuse: bool = True):
        self.model, self.processor = model, processor
        self.kv_reuse = kv_reuse
        native_gqa_on_cpu()
        self._batches: list[_Batch] = []
        self.stats = {"prompt_tokens": 0, "prefilled_tokens": 0}  # reuse = 1 - prefilled / prompt
        self.compute_dtype = compute_dtype  # an fp32 module shared with the trainer samples under its autocast
        self.tokenizer = processor.tokenizer
        self.banned_token_ids = banned_token_ids(self.tokenizer, output_vocab_size(model))
        self.eos_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = self.tokenizer.pad_token_id
        self.image_token_id = model.config.image_token_id
        self.micro_batch = micro_batch
        self._stop_ids: dict[tuple[str, ...], list[list[int]]] = {}

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
        if self.kv_reuse:
            with compute_context(self.model, self.compute_dtype):
                return self._generate_cached(prompts, sampling)
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

    # ------------------------------------------------------------------ the cached path
    def _stop_sequences(self, stop: tuple[str, ...]) -> list[list[int]]:
        if stop not in self._stop_ids:
            self._stop_ids[stop] = [self.tokenizer.encode(x, add_special_tokens=False) for x in stop if x]
        return self._stop_ids[stop]

    def _segment_positions(self, ids: list[int], images: list) -> torch.Tensor:
        """(3, n) mrope positions of a segment alone (shifted by the caller to continue its episode)."""
        t = torch.tensor(ids, dtype=torch.long)
        if not images:
            return torch.arange(len(ids)).view(1, -1).expand(3, -1)
        mm = (t == self.image_token_id).long()[None]
        pos, _ = self.model.model.get_rope_index(t[None], mm_token_type_ids=mm,
                                                 image_grid_thw=torch.stack([im.grid_thw for im in images]))
        return pos[:, 0]

    def _vision_inputs(self, images: list, device, dtype) -> dict:
        """The new images of a forward: cached vision features (``mm_encoder_outputs``) or, where this
        transformers lacks them, pixel values."""
        if not images:
            return {}
        grid = {"image_grid_thw": torch.stack([im.grid_thw for im in images]).to(device)}
        if encoder_outputs_supported(self.model):
            return {**grid, "mm_encoder_outputs": self._encode_images([Prompt([], images)])}
        return {**grid, "pixel_values": torch.cat([im.pixels() for im in images]).to(device, dtype)}

    def _forward(self, ids, mask, pos, cache, images=()):
        p = next(self.model.parameters())
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                         logits_to_keep=1, **self._vision_inputs(list(images), p.device, p.dtype))
        return out.logits[:, -1], out.past_key_values

    def _generate_cached(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Completion]:
        """Place each prompt on the row that caches its episode (if that row's tokens and images are a prefix of
        it), start a new batch for the rest, drop the rows no prompt continues, then run one turn per batch."""
        where: dict = {}
        for b, batch in enumerate(self._batches):
            for r, key in enumerate(batch.keys):
                where[key] = (b, r)
        plan: dict[int, list[tuple[int, int]]] = {}  # batch -> [(prompt index, row)]
        fresh = []
        for i, p in enumerate(prompts):
            b, r = where.get(p.key, (None, None)) if p.key is not None else (None, None)
            if b is not None:
                batch = self._batches[b]
                n, m = len(batch.tokens[r]), len(batch.images[r])
                if (n < len(p.token_ids) and p.token_ids[:n] == batch.tokens[r]
                        and all(x is y for x, y in zip(p.images[:m], batch.images[r])) and len(p.images) >= m):
                    plan.setdefault(b, []).append((i, r))
                    continue
            fresh.append(i)
        batches = []
        for b, pairs in plan.items():
            batch = self._batches[b]
            rows = [r for _, r in pairs]
            if rows != list(range(len(batch.keys))):  # episodes ended (or moved): keep the continued rows, in order
                batch.select(rows)
            batches.append((batch, [i for i, _ in pairs]))
        out: list[Completion | None] = [None] * len(prompts)
        for lo in range(0, len(fresh), self.micro_batch):
            part = fresh[lo:lo + self.micro_batch]
            device = next(self.model.parameters()).device
            batch = _Batch(keys=[prompts[i].key for i in part], cache=None,
                           mask=torch.zeros((len(part), 0), dtype=torch.long, device=device),
                           tokens=[[] for _ in part], images=[[] for _ in part],
                           next_pos=torch.zeros(len(part), dtype=torch.long, device=device))
            batches.append((batch, part))
        self._batches = [b for b, _ in batches]
        for k, (batch, idx) in enumerate(batches):
            part = sampling if k == 0 or sampling.seed is None else replace(sampling,
                                                                            seed=derive_seed(sampling.seed, k))
            for i, comp in zip(idx, self._turn(batch, [prompts[i] for i in idx], part)):
                out[i] = comp
        self._batches = [b for b in self._batches if b.keys]
        return out

    def _turn(self, batch: _Batch, prompts: list[Prompt], sampling: SamplingParams) -> list[Completion]:
        """Prefill each row's new segment, then decode until every row stops."""
        device = batch.mask.device
        rows = len(prompts)
        segs = [p.token_ids[len(batch.tokens[r]):] for r, p in enumerate(prompts)]
        new_images = [p.images[len(batch.images[r]):] for r, p in enumerate(prompts)]
        width = max(len(x) for x in segs)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        seg_mask = torch.zeros((rows, width), dtype=torch.long)
        pos = torch.zeros((3, rows, width), dtype=torch.long)
        for r, (seg, ims) in enumerate(zip(segs, new_images)):
            lo = width - len(seg)
            ids[r, lo:] = torch.tensor(seg, dtype=torch.long)
            seg_mask[r, lo:] = 1
            p = self._segment_positions(seg, ims) + int(batch.next_pos[r])
            pos[:, r, lo:] = p
            pos[:, r, :lo] = p[:, :1]  # holes: any position (masked)
            batch.next_pos[r] = int(p.max()) + 1
            batch.tokens[r] = batch.tokens[r] + list(seg)
            batch.images[r] = batch.images[r] + list(ims)
        self.stats["prompt_tokens"] += sum(len(p.token_ids) for p in prompts)
        self.stats["prefilled_tokens"] += sum(len(x) for x in segs)
        batch.mask = torch.cat([batch.mask, seg_mask.to(device)], dim=1)
        if hasattr(self.model.model, "rope_deltas"):
            self.model.model.rope_deltas = None
        self.model.eval()
        if batch.cache is None:
            batch.cache = _new_cache()
        logits, batch.cache = self._forward(ids.to(device), batch.mask, pos.to(device), batch.cache,
                                            [im for ims in new_images for im in ims])
        # ---- decode: everything on tensors; one host sync per step (all rows done?)
        gen = torch.Generator(device=device)
        if sampling.seed is not None:
            gen.manual_seed(sampling.seed)
        stops = [torch.tensor(x, device=device) for x in self._stop_sequences(tuple(sampling.stop))]
        temp = sampling.temperature if not sampling.greedy else 1.0
        tokens = torch.full((rows, sampling.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((rows, sampling.max_new_tokens), device=device)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        length = torch.zeros(rows, dtype=torch.long, device=device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        fed = torch.zeros(rows, dtype=torch.long, device=device)  # sampled tokens that went into the cache
        for step in range(sampling.max_new_tokens):
            lg = masked_logits(logits, self.banned_token_ids, temp)  # (R, V) fp32
            logp_all = torch.log_softmax(lg, dim=-1)
            if sampling.greedy:
                tok = lg.argmax(-1)
            else:
                probs = logp_all.exp()
                if sampling.top_p < 1.0:
                    sorted_p, order = probs.sort(-1, descending=True)
                    drop = sorted_p.cumsum(-1) - sorted_p > sampling.top_p  # keep the smallest set reaching top_p
                    probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
                tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            active = ~done
            tok = torch.where(active, tok, torch.full_like(tok, self.pad_id))
            tokens[:, step] = tok
            logps[:, step] = logp_all.gather(-1, tok[:, None]).squeeze(-1) * active
            length += active.long()
            hit = tok == self.eos_id
            for seq in stops:  # the stop string's token sequence ending at this step
                n = len(seq)
                if step + 1 >= n:
                    hit |= (tokens[:, step + 1 - n:step + 1] == seq).all(-1)
            stopped |= hit & active
            done |= hit
            if step == sampling.max_new_tokens - 1 or bool(done.all()):
                break
            step_pos = batch.next_pos.view(1, -1, 1).expand(3, -1, 1)
            batch.next_pos = batch.next_pos + active.long()
            batch.mask = torch.cat([batch.mask, active.long()[:, None]], dim=1)
            fed += active.long()
            logits, batch.cache = self._forward(tok[:, None], batch.mask, step_pos, batch.cache)
        tokens, logps, length, stopped = tokens.tolist(), logps.tolist(), length.tolist(), stopped.tolist()
        for r, n in enumerate(fed.tolist()):
            batch.tokens[r] = batch.tokens[r] + tokens[r][:n]
        completions, keep = [], []
        for r in range(rows):
            ids_r, lp_r = tokens[r][:length[r]], logps[r][:length[r]]
            reason = "stop" if stopped[r] else "length"
            if not stopped[r] and sampling.stop:  # a stop string in another tokenisation: cut once, here
                cut, reason = self._cut_once(ids_r, sampling.stop)
                if cut < len(ids_r):
                    ids_r, lp_r = ids_r[:cut], lp_r[:cut]
                    completions.append(Completion(ids_r, lp_r, reason))
                    continue  # the cache holds tokens past the cut: this episode is prefilled afresh next turn
            completions.append(Completion(ids_r, lp_r, reason))
            keep.append(r)
        if len(keep) < rows:
            batch.select(keep)
        return completions

    def _cut_once(self, tokens: list[int], stop: tuple[str, ...]) -> tuple[int, str]:
        """Length to keep when a stop string appears in the decoded text: the shortest prefix containing it
        (a binary search over prefixes: a few decodes per completion, none per generated token)."""
        if not tokens or not any(x in self.tokenizer.decode(tokens) for x in stop):
            return len(tokens), "length"
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if any(x in self.tokenizer.decode(tokens[:mid]) for x in stop):
                hi = mid
            else:
                lo = mid + 1
        return lo, "stop"

    def update_weights(self, named_tensors=None) -> None:
        """Copy new weights into the engine's module, one tensor at a time as they arrive (``named_tensors``:
        a dict or an iterator of (name, tensor), e.g. ``models.distributed.stream_full_weights``); None when the
        module is the trainer's own. Every entry of the module's state dict must arrive."""
        self._batches = []  # caches computed by the old weights
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
        """Drop the kept KV caches (the update needs the memory; the next rollout starts new episodes)."""
        self._batches = []

    def close(self) -> None:
        pass

    def wake(self) -> None:
        pass
