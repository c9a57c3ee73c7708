"""Run under torchrun (2 gloo ranks): each rank builds its own colocated vLLM engine, as train.py does.

Checks, per rank: the engine's worker has this process's rank and local rank, a tensor-parallel group of
its own (data-parallel engines), and samples its own prompt with logprobs equal to the trainer's. Writes
``rank<r>.json`` per rank into the given directory (stdout lines of two ranks can interleave).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models.engines.base import Prompt, SamplingParams  # noqa: E402
from models.forward import masked_logits  # noqa: E402
from models.tiny import build_tiny_text  # noqa: E402


def placement(worker) -> dict:
    """Runs in the vLLM worker: its rank, local rank, device and groups."""
    from vllm.distributed import parallel_state as ps

    return {"rank": worker.rank, "local_rank": worker.local_rank, "device": str(worker.device),
            "tp_ranks": list(ps.get_tp_group().ranks), "world_ranks": list(ps.get_world_group().ranks)}


def main() -> None:
    from models.engines.vllm import VLLMEngine

    rank = int(os.environ["RANK"])
    model, tok = build_tiny_text(0)
    path = Path(sys.argv[1]) / f"rank{rank}"
    model.save_pretrained(path)  # before the process group: save_pretrained writes the config on rank 0 only
    tok.save_pretrained(path)
    dist.init_process_group("gloo")  # the trainer's world group
    engine = VLLMEngine(str(path), tok, dtype="float32", enforce_eager=True, max_model_len=512)
    where = engine.llm.collective_rpc(placement)[0]
    text = f"<|im_start|>user\nRank {rank}: you moved {'up' if rank else 'down'}.<|im_end|>\n<|im_start|>assistant\n"
    prompt = Prompt(tok.encode(text, add_special_tokens=False))
    comp = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=8, seed=rank))[0]
    ids = torch.tensor([prompt.token_ids + comp.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt.token_ids) - 1:-1]
    ref = torch.log_softmax(masked_logits(logits, engine.banned_token_ids, 1.0), -1)
    ref = ref.gather(-1, torch.tensor(comp.token_ids)[:, None])[:, 0]
    gap = float((ref - torch.tensor(comp.logprobs)).abs().max())
    dist.barrier()  # the trainer's group still works after both engines came up
    row = {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "world": dist.get_world_size(),
           "engine": where, "gap": gap}
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(row))
    engine.close()  # vLLM's teardown ends the default process group too
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
