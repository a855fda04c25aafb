"""One rank of a tensor-parallel run (torchrun; gloo on the CPU, NCCL on GPUs) for the tensor-parallel tests, what
it runs on each rank and on one process alike, and its launcher.

argv: model folder, output folder, the caches' dtype, bundle folders. Writes ``rank{r}.safetensors``: per bundle, the
logits of a prompt and of teacher-forced decode steps through an OscarQuantizedCache, greedy tokens, and the cache's
bytes; and each rank saves the bundles it calibrated on the tensor-parallel model in float32 (shared and per head,
with diagnostics).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

# windows small enough that most of the prompt reaches the INT2 history
CACHE_SETTINGS = dict(sink_tokens=4, recent_tokens=16, flush_tokens=8)
PROMPT, STEPS = 96, 6


@torch.no_grad()
def run_cache(model, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits ``[PROMPT + STEPS, V]`` (on the CPU) of a prompt and of ``STEPS`` teacher-forced one-token steps
    through ``cache``, and the greedy tokens ``[8]`` of a generate through the same cache, reset."""
    ids = torch.randint(3, 96, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(1)).to(model.device)
    logits = [model(ids[:, :PROMPT], past_key_values=cache, use_cache=True).logits[0]]
    for t in range(PROMPT, PROMPT + STEPS):
        logits.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[0])
    cache.reset()
    tokens = model.generate(ids[:, :PROMPT], past_key_values=cache, max_new_tokens=8, do_sample=False,
                            pad_token_id=0)[0, PROMPT:]
    return torch.cat(logits).float().cpu(), tokens.cpu()


def calibrate_both(model) -> dict:
    """Bundles of ``model`` on fixed tokens: shared and per KV head, with diagnostics."""
    from helpers import quick_calibrate, token_ids

    from oscar_hf import OscarConfig

    return {per_head: quick_calibrate(model, token_ids(3, 48), max_length=48, num_tokens=96, diagnostic_tokens=48,
                                      per_head=per_head, config=OscarConfig(sink_tokens=4))
            for per_head in (False, True)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model_dir: Path, out: Path, dtype: str, bundles: list[Path]) -> list[tuple[dict, dict]]:
    """Run this file on two processes; per rank, its tensors and its caches' bytes by bundle name."""
    from safetensors import safe_open

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), __file__, str(model_dir), str(out), dtype, *map(str, bundles)]
    root = str(Path(__file__).parents[2])  # oscar_hf, where it is not installed
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = []
    for rank in range(2):
        with safe_open(out / f"rank{rank}.safetensors", "pt") as f:
            ranks.append(({k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["nbytes"])))
    return ranks


def main(model_dir: str, out: str, dtype: str, *bundles: str) -> None:
    import transformers
    from safetensors.torch import save_file

    from oscar_hf import OscarQuantizedCache, OscarRotations
    from oscar_hf.parallel import TensorParallel

    def load(dtype: torch.dtype):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=dtype).eval()
        model.generation_config.eos_token_id = None
        return model

    model = load(getattr(torch, dtype))
    tp = TensorParallel.of(model)
    assert tp is not None and tp.size == 2, tp
    tensors, nbytes = {}, {}
    for path in bundles:
        cache = OscarQuantizedCache.from_pretrained(OscarRotations.from_pretrained(path), model=model, **CACHE_SETTINGS)
        logits, tokens = run_cache(model, cache)
        name = Path(path).name
        tensors |= {f"{name}.logits": logits.contiguous(), f"{name}.tokens": tokens.contiguous()}
        nbytes[name] = cache.nbytes
    for per_head, rotations in calibrate_both(model if dtype == "float32" else load(torch.float32)).items():
        rotations.save_pretrained(Path(out) / f"calibrated-per-head-{per_head}-rank{tp.rank}")
    save_file(tensors, str(Path(out) / f"rank{tp.rank}.safetensors"), metadata={"nbytes": json.dumps(nbytes)})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, for helpers
    main(*sys.argv[1:])
