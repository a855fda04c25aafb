"""Every ``oscar-hf`` command (generate, demo, calibrate, info, eval) on a tiny random model of each served family,
saved with a tokenizer in a folder as a user's model would be: each ends with its summary and exit 0, or with one
line saying why that family cannot do it."""

import string

import pytest
import torch
import transformers
from helpers import FAMILY_TINY, VOCAB, austen, build_family, make_model
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from oscar_hf import autocalibrate
from oscar_hf.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

SERVED = ["qwen3-dense", "mistral-all-sliding", "gpt-oss-sinks", "gemma2-softcap", "gemma4-kv-sharing",
          "llama4-chunked", "qwen3-next-hybrid", "falcon-h1-hybrid", "deepseek-v3-mla"]
CALIBRATION_TOKENS = 256


def tokenizer() -> PreTrainedTokenizerFast:
    """An offline character-level tokenizer of VOCAB ids, the tiny models' vocabulary: 4 specials, 92 characters."""
    chars = (string.ascii_letters + string.digits + " \n" + string.punctuation)[: VOCAB - 4]
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tok


def build(family: str) -> transformers.PreTrainedModel:
    if family == "qwen3-dense":
        return make_model("qwen3-gqa-qknorm-d128")
    if family == "mistral-all-sliding":  # Mistral-7B v0.1's kind: every layer sliding-window attention
        torch.manual_seed(0)
        config = transformers.MistralConfig(**FAMILY_TINY, num_hidden_layers=2, sliding_window=16)
        return transformers.AutoModelForCausalLM.from_config(config).eval()
    return build_family(family)


@pytest.fixture(scope="module", params=SERVED)
def family(request, tmp_path_factory):
    """(family, its model folder with the tokenizer beside it, a folder for the command's outputs), with the Hugging
    Face cache folder (on-demand rotations) in a temporary folder for the module and a small calibration budget."""
    folder = tmp_path_factory.mktemp(request.param)
    model = build(request.param)
    assert model.config.vocab_size == len(tokenizer()) == VOCAB
    model.save_pretrained(folder / "model")
    tokenizer().save_pretrained(folder / "model")
    (folder / "emma.txt").write_text(austen(4000), encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(folder / "hf"))
        patch.setattr(autocalibrate, "DEFAULT_TOKENS", CALIBRATION_TOKENS)
        yield request.param, folder


def run(capsys, *argv) -> str:
    """``oscar-hf argv``'s standard output; a SystemExit must carry one line of reason (and no traceback)."""
    threads = torch.get_num_threads()
    try:
        main([str(a) for a in argv])
    except SystemExit as exit_info:
        err = capsys.readouterr().err.strip()
        assert exit_info.code == 2 and len(err.splitlines()) == 1, err
        pytest.fail(f"oscar-hf {argv[0]} refused: {err}")
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


def test_generate(family, capsys):
    name, folder = family
    out = run(capsys, "generate", folder / "model", "--prompt", "Hello there", "--max-new-tokens", 3)
    assert ">>> Hello there" in out and "identical for the first 3 of 3 generated tokens" in out


def test_demo(family, capsys):
    name, folder = family
    out = run(capsys, "demo", "--model", folder / "model", "--dtype", "float32", "--threads", 1,
              "--calibration-tokens", CALIBRATION_TOKENS, "--context-tokens", 400, "--score-tokens", 4,
              "--max-new-tokens", 3)
    summary = out[out.index("Summary:"):]
    assert "OSCAR INT2" in summary and "The demo took" in out
    if name != "mistral-all-sliding":  # (its 16-token window drops tokens before they leave OSCAR's windows)
        assert "smaller here" in summary


def test_calibrate_and_info(family, capsys):
    name, folder = family
    out = run(capsys, "calibrate", folder / "model", "--data", folder / "emma.txt", "--out", folder / "bundle",
              "--num-tokens", CALIBRATION_TOKENS, "--max-length", 128, "--diagnostic-tokens", 256)
    assert "saved OscarRotations(" in out
    out = run(capsys, "info", folder / "bundle")
    assert "bits per element at 128K tokens" in out
    assert ("score_kl" in out) == (name != "deepseek-v3-mla")  # the diagnostics do not cover latent attention


def test_eval(family, capsys):
    name, folder = family
    out = run(capsys, "eval", "--model", folder / "model", "--methods", "bf16,quarot-int2,oscar", "--text",
              folder / "emma.txt", "--contexts", 400, "--score-tokens", 4, "--segments", 1, "--out", folder / "eval")
    assert "perplexity / kl_to_bf16 / 400" in out and (folder / "eval" / "results.csv").is_file()
