"""Padding-free packing: logprobs equal to the padded batch, positions and attention per trajectory."""

import itertools

import pytest
import torch

from maze import TrainSampler
from maze.env import EnvSettings
from models.engines.base import banned_token_ids
from models.forward import (
    collate,
    encoder_outputs_supported,
    pack_rows,
    packed_batch,
    packed_token_logprobs,
    token_logprobs,
)
from models.tiny import build_tiny
from rl.experts import expert_trajectory
from rl.rollout import Conversation


def test_pack_rows_first_fit_decreasing():
    rows = pack_rows([5, 3, 8, 2, 4], capacity=8)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3, 4]
    assert all(sum([5, 3, 8, 2, 4][i] for i in r) <= 8 for r in rows)
    assert rows == [[2], [0, 1], [4, 3]]
    assert pack_rows([10, 1, 9], capacity=4) == [[0], [2, 1]]  # capacity grows to the longest sequence


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(0)
    model, processor = build_tiny(0)
    conv = Conversation(processor)
    env = EnvSettings(pixels_per_cell=16, pad_to=32, max_turns=30)
    mazes = TrainSampler(sizes=(5, 7), seed=3).take(5)
    trajs = [expert_trajectory(m, conv, env, "bfs", noise=0.3, seed=k) for k, m in enumerate(mazes)]
    assert len({len(t.token_ids) for t in trajs}) > 2  # lengths differ, so padding would be wasted
    return model, processor, trajs


@pytest.mark.parametrize("capacity", [0, 10**6])  # rows as long as the longest; everything in one row
def test_packed_logprobs_equal_padded(batch, capacity):
    model, processor, trajs = batch
    tok = processor.tokenizer
    banned = banned_token_ids(tok)
    pad, img = tok.pad_token_id, model.config.image_token_id
    seqs, ims = [t.token_ids for t in trajs], [t.images for t in trajs]
    with torch.no_grad():
        ref, ref_ent = token_logprobs(model, collate(seqs, ims, pad, img), banned, 1.0, with_entropy=True)
        lp, ent = packed_token_logprobs(model, seqs, ims, pad, img, banned, 1.0, with_entropy=True,
                                        capacity=capacity)
    assert lp.shape == ref.shape
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        torch.testing.assert_close(lp[i, :n], ref[i, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[i, 1:n], ref_ent[i, 1:n], atol=1e-5, rtol=0)
        assert (lp[i, n:] == 0).all()


def test_packing_really_packs_and_isolates(batch):
    model, processor, trajs = batch
    tok = processor.tokenizer
    seqs, ims = [t.token_ids for t in trajs], [t.images for t in trajs]
    b, place = packed_batch(model, seqs, ims, tok.pad_token_id, model.config.image_token_id, capacity=10**6)
    assert b["input_ids"].shape == (1, sum(len(s) for s in seqs))
    assert "attention_mask" not in b
    # every trajectory's text positions restart at 0; its mrope positions are those it has alone
    for i, (r, start, n) in enumerate(place):
        assert b["position_ids"][0, r, start:start + n].tolist() == list(range(n))
        alone, _ = packed_batch(model, [seqs[i]], [ims[i]], tok.pad_token_id, model.config.image_token_id)
        assert torch.equal(b["position_ids"][:, r, start:start + n], alone["position_ids"][:, 0])
    # a change in one trajectory leaves every other trajectory's logprobs unchanged (no cross-attention)
    banned = banned_token_ids(tok)
    pad, img = tok.pad_token_id, model.config.image_token_id
    with torch.no_grad():
        base = packed_token_logprobs(model, seqs, ims, pad, img, banned, 1.0, capacity=10**6)
        seqs2 = [list(s) for s in seqs]
        seqs2[0][-3] = tok.convert_tokens_to_ids("<|endoftext|>")
        changed = packed_token_logprobs(model, seqs2, ims, pad, img, banned, 1.0, capacity=10**6)
    assert not torch.allclose(base[0], changed[0])
    torch.testing.assert_close(base[1:], changed[1:], atol=1e-6, rtol=0)


def test_shared_image_encoding_gives_the_same_logprobs_and_gradients():
    """A group's samples share frames; encoding each distinct frame once must not change anything."""
    from models.forward import collate

    torch.manual_seed(0)
    model, processor = build_tiny(0)
    conv = Conversation(processor)
    env = EnvSettings(pixels_per_cell=16, pad_to=32, max_turns=6)
    m = TrainSampler(sizes=(7,), seed=5).take(1)[0]
    trajs = [expert_trajectory(m, conv, env, "wall_follower", noise=0.5, seed=k) for k in range(4)]
    flat = [im for t in trajs for im in t.images]
    assert len({id(im) for im in flat}) < len(flat)  # frames really are shared
    tok = processor.tokenizer
    banned = banned_token_ids(tok)
    pad, img = tok.pad_token_id, model.config.image_token_id
    seqs, ims = [t.token_ids for t in trajs], [t.images for t in trajs]

    def run(**kw):
        model.zero_grad()
        if kw.pop("packed"):
            lp = packed_token_logprobs(model, seqs, ims, pad, img, banned, 1.0, **kw)
        else:
            lp = token_logprobs(model, collate(seqs, ims, pad, img), banned, 1.0, **kw)
        lp.sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_lp, ref_g = run(packed=False)
    # transformers < 5.19 has no mm_encoder_outputs: the shared path falls back to pixels (and must still agree)
    cases = [dict(packed=False, images=flat)] if encoder_outputs_supported(model) else []
    for kw in cases + [dict(packed=True, share_images=True)]:
        lp, g = run(**kw)
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
        assert g.keys() == ref_g.keys() and any("visual" in n for n in g)
        for n in g:
            torch.testing.assert_close(g[n], ref_g[n], atol=1e-5, rtol=1e-4)


SPY = "vlmaze_flash_spy"


def _flash_like(calls: list):
    """An attention function that does what transformers' flash-attention path does with what it is given, in
    plain torch on the CPU (``modeling_flash_attention_utils._flash_attention_forward``): explicit ``cu_seq_lens``
    -> those sequences; a 2D padding mask -> each row's valid tokens; else sequences found from the position ids
    only when the batch has one row (``_is_packed_sequence``); else every row is one sequence. Each call's
    sequences are recorded."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    def attend(module, q, k, v, attention_mask, scaling=None, dropout=0.0, position_ids=None, cu_seq_lens_q=None,
               is_causal=None, **kwargs):
        b, heads, length, dim = q.shape
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
        causal = module.is_causal if is_causal is None else is_causal
        flat = [x.transpose(1, 2).reshape(b * length, heads, dim) for x in (q, k, v)]  # (B*L, H, D)
        if cu_seq_lens_q is not None:
            bounds = cu_seq_lens_q.tolist()
        elif attention_mask is not None:  # right padding: each row's valid prefix, the rest left at zero
            bounds = [(r * length, r * length + int(attention_mask[r].sum())) for r in range(b)]
        elif position_ids is not None and _is_packed_sequence(position_ids, b):
            bounds = prepare_fa_kwargs_from_position_ids(position_ids)[0][0].tolist()
        else:
            bounds = [r * length for r in range(b + 1)]
        spans = bounds if isinstance(bounds[0], tuple) else list(zip(bounds[:-1], bounds[1:]))
        calls.append((type(module).__name__, spans))
        out = torch.zeros_like(flat[0])
        for lo, hi in spans:
            qs, ks, vs = (x[lo:hi].transpose(0, 1) for x in flat)  # (H, n, D)
            out[lo:hi] = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=causal, scale=scaling).transpose(0, 1)
        return out.view(b, length, heads, dim), None

    return attend


def test_packing_under_flash_attention_keeps_trajectories_apart(batch):
    """Flash-attention gets no mask; transformers finds packed trajectories from the positions of a one-row batch
    only. With a spy that attends as flash-attention would, the packed logprobs still equal the padded batch's
    under sdpa, and no attention call spans two trajectories (several rows per micro-batch mixed them)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    from models.forward import packs_into_one_row

    model, processor, trajs = batch
    tok = processor.tokenizer
    banned, pad, img = banned_token_ids(tok), tok.pad_token_id, model.config.image_token_id
    seqs, ims = [t.token_ids for t in trajs], [t.images for t in trajs]
    with torch.no_grad():
        ref = token_logprobs(model, collate(seqs, ims, pad, img), banned, 1.0)
    calls: list = []
    AttentionInterface.register(SPY, _flash_like(calls))
    ALL_MASK_ATTENTION_FUNCTIONS.register(SPY, flash_attention_mask)
    configs = (model.config, model.config.text_config, model.config.vision_config)
    before = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = SPY
        assert packs_into_one_row(model)
        with torch.no_grad():
            # rows of 1,100 tokens: without one-row packing, two trajectories would share a row
            lp = packed_token_logprobs(model, seqs, ims, pad, img, banned, 1.0, capacity=1100)
    finally:
        for c, impl in zip(configs, before):
            c._attn_implementation = impl
    assert not packs_into_one_row(model)
    for i, t in enumerate(trajs):  # each trajectory scored as if alone
        n = len(t.token_ids)
        torch.testing.assert_close(lp[i, :n], ref[i, :n], atol=1e-5, rtol=0)
    ends = set(itertools.accumulate(len(s) for s in sorted(seqs, key=len, reverse=True)))
    text_calls = [spans for name, spans in calls if "Text" in name]
    assert text_calls, "the language model's attention never ran through the spy"
    for spans in text_calls:  # every sequence the language model attended over is one whole trajectory
        assert {hi for _, hi in spans} <= ends, spans
