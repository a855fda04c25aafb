"""One rank of a tensor-parallel run (torchrun, gloo on the CPU) for test_tensor_parallel.py, and what it runs on
each rank and on one process alike.

argv: model folder, output folder, bundle folders. Writes ``rank{r}.safetensors``: per bundle, the logits of a prompt
and of teacher-forced decode steps through an OscarQuantizedCache, greedy tokens, and the cache's bytes; rank 0 also
saves bundles calibrated on the tensor-parallel model (shared and per head, with diagnostics).
"""

import json
import sys
from pathlib import Path

import torch

# windows small enough that most of the prompt reaches the INT2 history
CACHE_SETTINGS = dict(sink_tokens=4, recent_tokens=16, flush_tokens=8)
PROMPT, STEPS = 96, 6


@torch.no_grad()
def run_cache(model, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[PROMPT + STEPS, V]`` of a prompt and of ``STEPS`` teacher-forced one-token steps through ``cache``,
    and the greedy tokens ``[8]`` of a generate through the same cache, reset."""
    ids = torch.randint(3, 96, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    logits = [model(ids[:, :PROMPT], past_key_values=cache, use_cache=True).logits[0]]
    for t in range(PROMPT, PROMPT + STEPS):
        logits.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[0])
    cache.reset()
    tokens = model.generate(ids[:, :PROMPT], past_key_values=cache, max_new_tokens=8, do_sample=False)[0, PROMPT:]
    return torch.cat(logits).float(), tokens


def calibrate_both(model) -> dict:
    """Bundles of ``model`` on fixed tokens: shared and per KV head, with diagnostics."""
    from helpers import quick_calibrate, token_ids

    return {per_head: quick_calibrate(model, token_ids(3, 48), max_length=48, num_tokens=96, diagnostic_tokens=48,
                                      per_head=per_head) for per_head in (False, True)}


def main(model_dir: str, out: str, *bundles: str) -> None:
    import transformers
    from safetensors.torch import save_file

    from oscar_hf import OscarQuantizedCache, OscarRotations
    from oscar_hf.parallel import TensorParallel

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tp = TensorParallel.of(model)
    assert tp is not None and tp.size == 2, tp
    tensors, nbytes = {}, {}
    for path in bundles:
        cache = OscarQuantizedCache.from_pretrained(OscarRotations.from_pretrained(path), model=model, **CACHE_SETTINGS)
        logits, tokens = run_cache(model, cache)
        name = Path(path).name
        tensors |= {f"{name}.logits": logits.contiguous(), f"{name}.tokens": tokens.contiguous()}
        nbytes[name] = cache.nbytes
    for per_head, rotations in calibrate_both(model).items():
        if tp.rank == 0:
            rotations.save_pretrained(Path(out) / f"calibrated-per-head-{per_head}")
    save_file(tensors, str(Path(out) / f"rank{tp.rank}.safetensors"), metadata={"nbytes": json.dumps(nbytes)})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, for helpers
    main(*sys.argv[1:])
