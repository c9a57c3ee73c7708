"""The trainer's forward and collectives as the GPU path needs them: chunked vocabulary projection (no
full-vocab tensor kept for backward), bf16 compute on fp32 masters, collectives on the group's device."""

import pytest
import torch

import models.forward as L
from maze import TrainSampler
from maze.env import EnvSettings
from models.engines.base import banned_token_ids
from models.forward import collate, compute_context, token_logprobs
from models.tiny import build_tiny
from rl import dist as D
from rl.experts import expert_trajectory
from rl.rollout import Conversation


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(0)
    model, processor = build_tiny(0)
    conv = Conversation(processor)
    env = EnvSettings(pixels_per_cell=16, pad_to=32, max_turns=12)
    trajs = [expert_trajectory(m, conv, env, "bfs", noise=0.3, seed=k)
             for k, m in enumerate(TrainSampler(sizes=(5, 7), seed=3).take(3))]
    tok = processor.tokenizer
    b = collate([t.token_ids for t in trajs], [t.images for t in trajs], tok.pad_token_id, model.config.image_token_id)
    return model, b, banned_token_ids(tok)


def full_vocab_reference(model, batch, banned, temperature):
    """The unchunked definition: log-softmax over the whole vocabulary (what the trainer computed before)."""
    model.model.rope_deltas = None
    logits = L.masked_logits(model(**batch, use_cache=False).logits[:, :-1], banned, temperature)
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    lp = torch.nn.functional.pad(torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp)), (1, 0))
    probs = logp_all.exp()
    ent = -(probs * torch.where(probs > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    return lp, torch.nn.functional.pad(ent, (1, 0))


@pytest.mark.parametrize("chunk", [7, 10**6])  # positions per chunk: many (one straddles rows), and one chunk
def test_chunked_logprobs_and_gradients_equal_full_vocab(batch, chunk, monkeypatch):
    model, b, banned = batch
    mask = (b["attention_mask"] * torch.rand(b["input_ids"].shape).lt(0.7)).float()
    grads = []
    for use_chunks in (False, True):
        model.zero_grad()
        if use_chunks:
            monkeypatch.setattr(L, "LOGPROB_CHUNK", chunk * model.lm_head.weight.shape[0])
            lp, ent = token_logprobs(model, b, banned, 0.9, with_entropy=True)
        else:
            lp, ent = full_vocab_reference(model, b, banned, 0.9)
        ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        grads.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, lp, ent))
    (g_ref, lp_ref, ent_ref), (g, lp, ent) = grads
    torch.testing.assert_close(lp, lp_ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent * (b["attention_mask"] > 0), ent_ref * (b["attention_mask"] > 0), atol=2e-5, rtol=0)
    assert g.keys() == g_ref.keys() and "lm_head.weight" in g
    for n in g:
        torch.testing.assert_close(g[n], g_ref[n], atol=1e-4, rtol=1e-3, msg=n)


def _saved_vocab_bytes(model, fn) -> int:
    """Bytes of tensors saved for backward whose last dimension is the vocabulary."""
    vocab = model.lm_head.weight.shape[0]
    seen = []

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == vocab and t.data_ptr() != model.lm_head.weight.data_ptr():
            seen.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.sum().backward()
    return sum(seen)


def test_no_full_vocabulary_tensor_is_kept_for_backward(batch):
    model, b, banned = batch
    full = _saved_vocab_bytes(model, lambda: full_vocab_reference(model, b, banned, 1.0)[0])
    assert full > 0  # the check sees the full-vocab tensors the unchunked forward keeps
    assert _saved_vocab_bytes(model, lambda: token_logprobs(model, b, banned, 1.0, with_entropy=True)[0]) == 0


def test_bf16_compute_on_fp32_masters_without_fsdp(batch):
    """One process / DDP: fp32 parameters, forward under bf16 autocast, fp32 gradients."""
    model, b, banned = batch
    seen = {}
    hook = model.model.language_model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, i, o: seen.update(out=o.dtype))
    model.zero_grad()
    with compute_context(model, torch.bfloat16):
        lp = token_logprobs(model, b, banned, 1.0)
    hook.remove()
    lp.sum().backward()
    assert seen["out"] == torch.bfloat16 and lp.dtype == torch.float32
    assert all(p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
               for p in model.parameters())


def test_collectives_use_the_groups_device(monkeypatch):
    assert D.device_for_backend("nccl", 3) == torch.device("cuda", 3)
    assert D.device_for_backend("gloo", 3) == torch.device("cpu")
    # an NCCL group: the helpers build their buffer on cuda:LOCAL_RANK (this CPU-only torch then refuses, which
    # is the proof that the buffer was headed there; before, a CPU tensor reached NCCL and failed at run time)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "nccl")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert D.collective_device() == torch.device("cuda", 1)
    reached = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None: reached.append(t.device))
    if torch.cuda.is_available():
        D.all_reduce_sum(1.0)
        D.all_reduce_sums(torch.ones(3))
        assert reached == [torch.device("cuda", 1)] * 2
    else:
        for call in (lambda: D.all_reduce_sum(1.0), lambda: D.all_reduce_sums(torch.ones(3)),
                     lambda: D.all_reduce_max(2.0)):
            with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
                call()
        assert reached == []
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")
    assert D.all_reduce_sum(2.0) == 2.0 and reached == [torch.device("cpu")]


def test_a_bf16_export_of_fp32_masters_says_bfloat16_in_its_config(tmp_path):
    """The checkpoint's HF export holds the compute dtype's weights (``export_dtype``), and its config.json must say
    so (it said float32, the masters' dtype, over bf16 weights); the live model keeps its fp32 config."""
    import json

    from models.build import load_policy_dir
    from models.tiny import build_tiny
    from rl.checkpoint import save_checkpoint

    model, processor = build_tiny(0)
    ckpt = save_checkpoint(tmp_path, 1, model.float(), processor, export_dtype=torch.bfloat16)
    assert json.loads((ckpt / "policy" / "config.json").read_text())["dtype"] == "bfloat16"
    assert str(model.config.dtype).removeprefix("torch.") == "float32"
    loaded, _ = load_policy_dir(ckpt / "policy", dtype="bfloat16")
    assert next(loaded.parameters()).dtype == torch.bfloat16
