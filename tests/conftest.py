"""Test setup: fully offline, tiny random models built from configs."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import oscar_hf  # noqa: E402,F401  (registers the "oscar" attention)

VOCAB = 96

# name -> (config class, extra config fields). Small enough for fast CPU generate.
ARCHITECTURES = {
    "llama-mha-d64": ("LlamaConfig", dict(num_attention_heads=2, num_key_value_heads=2, head_dim=64, hidden_size=128)),
    "qwen2-gqa-bias-d64": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=256)),
    "qwen3-gqa-qknorm-d128": (
        "Qwen3Config",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128, hidden_size=128),
    ),
    "mistral-gqa-d64": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64, hidden_size=128, sliding_window=None),
    ),
}


def make_model(
    arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
) -> transformers.PreTrainedModel:
    """A tiny random decoder of architecture ``arch`` (a key of ARCHITECTURES), in eval mode."""
    config_name, fields = ARCHITECTURES[arch]
    defaults = dict(
        vocab_size=VOCAB,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = getattr(transformers, config_name)(**{**defaults, **fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # random models would stop at random; keep lengths fixed
    return model.eval()


@pytest.fixture(params=list(ARCHITECTURES))
def arch(request) -> str:
    return request.param


# ------------------------------------------------------------------------------ Triton's interpreter, faster
def _share_the_launchs_language_patch(interpreter) -> bool:
    """Under TRITON_INTERPRET=1 every call of a ``@triton.jit`` helper from inside a kernel patches
    ``triton.language`` again (an ``inspect.getmembers`` of each module per call: ~40% of the kernel tests' time),
    although the launch that runs it has patched the same modules already and keeps them patched until it ends.
    Skip that second patch where the helper sees no language module that the launch, or a helper before it (whose
    patch the interpreter never undoes), patched; run everything else as the interpreter does. Returns False (and changes nothing) on an interpreter whose code is not the one this
    was written against (triton 3.9's)."""
    import inspect

    executor, function = getattr(interpreter, "GridExecutor", None), getattr(interpreter, "InterpretedFunction", None)
    if executor is None or function is None or getattr(function, "_oscar_hf_tests_patched", False):
        return False
    try:
        call_source = inspect.getsource(function.__call__)
        launch_source = inspect.getsource(executor.__call__)
    except (OSError, TypeError):
        return False
    expected = ((call_source, "_patch_lang(self.fn)"), (call_source, "self.rewrite()"),
                (launch_source, "_patch_lang(self.fn)"), (launch_source, ".restore()"))
    if not all(text in source for source, text in expected) or "restore" in call_source:
        return False
    tl = interpreter.tl
    patched: list[frozenset] = []  # per launch in progress: the language modules it patched
    seen: dict = {}

    def languages(fn) -> frozenset:
        """The modules _patch_lang patches for ``fn`` (a rewritten function: its module's globals are final)."""
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[fn]

    launch, device_call = executor.__call__, function.__call__

    def launch_with_record(self, *args, **kwargs):
        patched.append(languages(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def device_call_without_repatch(self, *args, **kwargs):
        fn = self.rewrite()
        if not patched:
            return device_call(self, *args, **kwargs)
        if not languages(fn) <= patched[-1]:  # (triton's own helpers, tl.max and the like, also see tl.core)
            patched[-1] |= languages(fn)  # a device call's patch is never undone: it holds for the rest of the launch
            return device_call(self, *args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    executor.__call__, function.__call__ = launch_with_record, device_call_without_repatch
    function._oscar_hf_tests_patched = True
    return True


@pytest.fixture(scope="session", autouse=True)
def faster_triton_interpreter():
    """Applies _share_the_launchs_language_patch to the interpreter the kernels run in (test_kernels re-imports triton
    with TRITON_INTERPRET=1 while the tests are collected, so it is done here, when they run)."""
    import sys

    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is not None and os.environ.get("TRITON_INTERPRET") == "1":
        _share_the_launchs_language_patch(interpreter)
    yield
