"""The evaluation harness: methods registry, perplexity/KL with the cache in the loop, NIAH, recall, GSM8K, CLI."""

import csv
import json
import random
import re
import string

import pytest
import torch
from helpers import make_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from oscar_hf import OscarConfig, OscarRotations, autocalibrate, cli
from oscar_hf.cli import main
from oscar_hf.evaluation import METHODS, make_cache, recall, runner
from oscar_hf.evaluation.gsm8k import evaluate_gsm8k, extract_answer, load_gsm8k
from oscar_hf.evaluation.niah import NEEDLE, evaluate_niah, misses_where_reference_found, needle_prompt
from oscar_hf.evaluation.perplexity import evaluate_perplexity, text_segments
from oscar_hf.evaluation.recall import ASK, evaluate_recall, recall_items, recall_prompt, score_copy
from oscar_hf.evaluation.runner import format_results, run_eval

CHARS = string.ascii_letters + string.digits + " .,?!'\n:-"
TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. " * 40
    + "Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years. " * 40
)


def char_tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (ids < 96) with a minimal chat template, built offline; with ``bos`` it puts
    its BOS ``<s>`` (id 1) before every text on its own, as Gemma's does."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    return tok


def test_methods_registry_presets():
    model = make_model("llama-mha-d64")
    assert list(METHODS) == [
        "bf16",
        "int4",
        "naive-int2",
        "quarot-int2",
        "kivi-2",
        "oscar",
        "oscar-bundle",
        "oscar-uncentered",
        "oscar-k4",
        "oscar-int4",
        "oscar-k4-half",
        "oscar-k4-half-symmetric",
        "oscar-symmetric",
        "oscar-k4-half-compact",
        "oscar-compact",
        "oscar-channel-k",
        "oscar-lloyd-max",
        "oscar-pq1",
        "oscar-pq2",
        "quanto-int2",
        "hqq-int2",
    ]
    assert type(make_cache("bf16", model)).__name__ == "DynamicCache"
    int4 = make_cache("int4", model)
    assert (int4.config.bits, int4.config.group_size, int4.config.k_clip) == (4, 64, 1.0)
    oscar4 = make_cache("oscar-int4", model, OscarRotations.hadamard(model.config))
    assert oscar4.config.side_bits == {"key": 4, "value": 4} and oscar4.config.side_clip == {"key": 1.0, "value": 1.0}
    assert oscar4.config.centering
    symmetric = make_cache("oscar-symmetric", model, OscarRotations.hadamard(model.config))
    assert symmetric.config.quantizer == "symmetric" and symmetric.config.bits_per_element(64) == 2.25
    compact = make_cache("oscar-compact", model, OscarRotations.hadamard(model.config))
    assert compact.config.quantizer == "compact" and compact.config.bits_per_element(64) == 2.25
    assert make_cache("quarot-int2", model).rotations.method == "hadamard"
    assert make_cache("naive-int2", model).rotations.method == "identity"
    bundle = OscarRotations.hadamard(model.config)
    bundle.config = OscarConfig(k_clip=0.9, scale_dtype="float32", sink_tokens=16, flush_tokens=8)
    kivi = make_cache("kivi-2", model, bundle)  # the preset replaces whatever the bundle recommends
    assert kivi.rotations.method == "identity" and kivi.config.to_dict() == {
        **kivi.config.to_dict(),
        "bits": 2,
        "key_quantization": "per-channel",
        "flush_tokens": 32,
        "group_size": 32,
        "sink_tokens": 0,
        "recent_tokens": 112,
        "k_clip": 1.0,
        "v_clip": 1.0,
        "centering": False,
        "quantizer": "uniform",
        "scale_dtype": "float16",
    }
    calibrated = OscarRotations.hadamard(model.config)
    calibrated.method = "oscar"
    oscar = make_cache("oscar-lloyd-max", model, calibrated)
    assert (oscar.config.quantizer, oscar.config.k_clip, oscar.rotations.method) == ("lloyd-max", 0.96, "oscar")
    channel_k = make_cache("oscar-channel-k", model, calibrated)  # identity K rotations, the bundle's V rotations
    assert torch.equal(channel_k.rotations.key_rotation, torch.eye(64).expand(2, 64, 64))
    assert torch.equal(channel_k.rotations.value_rotation, calibrated.value_rotation)
    cfg = channel_k.config
    assert (cfg.key_quantization, cfg.flush_tokens, cfg.group_size, cfg.k_clip, cfg.v_clip) == (
        "per-channel", 64, 64, 1.0, 0.92)
    assert cfg.centered_sides == ("value",) and cfg.bits_per_element(64) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="calibrated rotations"):
        make_cache("oscar", model)
    calibrated.config = OscarConfig(key_bits=4)  # a bundle recommending 4-bit keys: the 2-bit presets stay 2-bit
    assert make_cache("oscar", model, calibrated).config.side_bits == {"key": 2, "value": 2}
    assert make_cache("quarot-int2", model, calibrated).config.side_bits == {"key": 2, "value": 2}
    k4 = make_cache("oscar-k4", model, calibrated).config
    assert k4.side_bits == {"key": 4, "value": 2} and k4.bits_per_element(64) == pytest.approx(3.5)
    with pytest.raises(ValueError, match="diagnostics"):
        make_cache("oscar-k4-half", model, calibrated)
    assert not METHODS["oscar-k4-half"].runs_with(calibrated) and METHODS["oscar-k4"].runs_with(calibrated)
    assert not METHODS["oscar-channel-k"].runs_with(None) and METHODS["quarot-int2"].runs_with(None)
    calibrated.diagnostics = [{"layer": 0, "score_kl": 0.1}, {"layer": 1, "score_kl": 0.3}]
    half = make_cache("oscar-k4-half", model, calibrated)
    assert half.config.key_bits_layers == [1]
    per_channel = calibrated.config.replace(key_quantization="per-channel", flush_tokens=64, k_clip=1.0)
    calibrated.config = per_channel  # a bundle recommending per-channel K: the per-token baselines stay per token
    for name in ("int4", "naive-int2", "quarot-int2"):
        assert make_cache(name, model, calibrated).config.key_quantization == "per-token", name
    assert make_cache("oscar", model, calibrated).config.key_quantization == "per-channel"
    calibrated.config = OscarConfig(centering=False, key_bits=4, key_bits_layers=[0], sink_tokens=8)
    assert make_cache("oscar-bundle", model, calibrated).config == calibrated.config  # no preset over the bundle's
    assert [layer.config.side_bits["key"] for layer in half.layers] == [2, 4]
    calibrated.config = OscarConfig(key_bits=4, key_bits_layers=[0])  # the 2-bit presets drop the layer list too
    assert make_cache("oscar", model, calibrated).config.key_bits_layers is None


@pytest.mark.parametrize("name", list(METHODS))
def test_callers_follow_the_registrys_rule_for_calibration(name, tmp_path, monkeypatch):
    """A method runs without a calibrated bundle exactly when its registry entry says it needs none
    (``Method.needs_calibration``; the diagnostics and the package it needs, too: ``Method.unmet``), and every
    caller follows that one rule, refusing before any work: make_cache, run_eval and ``oscar-hf eval`` (before the
    model loads)."""
    method = METHODS[name]
    model = make_model("llama-mha-d64")
    bundle = OscarRotations.hadamard(model.config)
    bundle.diagnostics = [{"layer": 0, "score_kl": 0.1}, {"layer": 1, "score_kl": 0.3}]
    bundle.save_pretrained(tmp_path / "bundle")

    class Loading(Exception):
        """The command got past its checks and loads the model."""

    def load_model(name, dtype):
        raise Loading

    monkeypatch.setattr(cli, "load_model", load_model)
    for calibrated in (None, bundle):
        runs = method.runs_with(calibrated)
        needs_codebooks = method.key_codebook_bits is not None  # (the bundle here has none)
        assert runs == (method.installed() and not needs_codebooks and (calibrated is not None or
                                                                        not method.needs_calibration)), calibrated
        assert method.needs_calibration == (method.rotations in ("calibrated", "calibrated-values"))
        if runs:
            make_cache(name, model, calibrated)
            assert run_eval(model, None, "m", [name], [], tmp_path / "out", calibrated=calibrated) == []
        else:
            with pytest.raises(ValueError, match="calibrated rotations" if calibrated is None and method.installed()
                               else "codebooks" if method.installed() else "pip install"):
                make_cache(name, model, calibrated)
            with pytest.raises(ValueError, match=re.escape(method.unmet(calibrated))):
                run_eval(model, None, "m", [name], [], tmp_path / "out", calibrated=calibrated)
        bundle_args = ["--rotations", str(tmp_path / "bundle") if calibrated else "none"]
        with pytest.raises(Loading if runs else SystemExit):
            main(["eval", "--model", "m", "--methods", name, "--out", str(tmp_path / "out"), *bundle_args])


def test_cli_eval_runs_every_method_the_bundle_allows(tmp_path, monkeypatch):
    """Without --methods, ``oscar-hf eval`` runs the methods the registry says can run: with --rotations none, the
    data-free ones (those installed); by default (--rotations auto) also those that need a calibrated bundle, on
    the rotations made for the model on demand, which has no diagnostics."""
    chosen, made = [], []
    model = make_model("llama-mha-d64")
    monkeypatch.setattr(cli, "load_model", lambda name, dtype: (model, "tokenizer"))
    monkeypatch.setattr(runner, "run_eval", lambda model, tokenizer, name, methods, *_, calibrated, **__:
                        chosen.append((methods, calibrated)))
    monkeypatch.setattr(autocalibrate, "rotations_for_model", lambda model, tokenizer, **_: made.append(tokenizer) or
                        OscarRotations.hadamard(model.config))
    main(["eval", "--model", "m", "--out", str(tmp_path), "--rotations", "none"])
    assert chosen == [([m.name for m in METHODS.values() if not m.needs_calibration and m.installed()], None)]
    main(["eval", "--model", "m", "--out", str(tmp_path)])
    assert chosen[1][0] == [m.name for m in METHODS.values()
                            if m.installed() and not m.needs_diagnostics and m.key_codebook_bits is None]
    assert chosen[1][1].method == "hadamard" and made == ["tokenizer"]
    with pytest.raises(SystemExit):  # a method the bundle made on demand cannot serve: before the model loads
        main(["eval", "--model", "m", "--out", str(tmp_path), "--methods", "oscar-k4-half"])
    assert len(made) == 1


def test_perplexity_puts_the_cache_in_the_loop():
    model = make_model("qwen3-gqa-qknorm-d128")
    segments = torch.randint(3, 90, (2, 48), generator=torch.Generator().manual_seed(0))
    methods = ["bf16", "naive-int2", "quarot-int2"]
    covered = evaluate_perplexity(model, segments, [32], methods)  # 48 tokens < 64 + 256: nothing quantized
    for row in covered:
        expected = {"kl_to_bf16": 0.0, "top1_agreement": 1.0}.get(row["metric"])
        if expected is not None:
            assert row["value"] == pytest.approx(expected, abs=1e-6), row
    full = {r["method"]: r["value"] for r in covered if r["metric"] == "perplexity"}
    with torch.no_grad():
        logits = model(segments).logits[:, 31:-1]
    reference_nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), segments[:, 32:].flatten())
    assert full["bf16"] == pytest.approx(float(reference_nll.exp()), rel=1e-4)


def test_small_windows_make_methods_differ(monkeypatch):
    import oscar_hf.evaluation.perplexity as perplexity

    model = make_model("qwen3-gqa-qknorm-d128")
    original = perplexity.make_cache
    monkeypatch.setattr(
        perplexity,
        "make_cache",
        lambda name, m, cal: original(
            name, m, cal, **({} if name == "bf16" else {"sink_tokens": 2, "recent_tokens": 2})
        ),
    )
    segments = torch.randint(3, 90, (2, 48), generator=torch.Generator().manual_seed(0))
    rows = evaluate_perplexity(model, segments, [32], ["bf16", "int4", "naive-int2"])
    kl = {r["method"]: r["value"] for r in rows if r["metric"] == "kl_to_bf16"}
    bits = {r["method"]: r["bits_per_element"] for r in rows}
    assert 0 < kl["int4"] < kl["naive-int2"]
    assert bits["naive-int2"] < bits["int4"] < bits["bf16"]


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos"])
def test_text_segments_start_with_bos_when_the_tokenizer_adds_one(bos):
    segments = text_segments(char_tokenizer(bos), TEXT, 3, 40)
    ids = char_tokenizer()(TEXT)["input_ids"]
    start = len(ids) // 3
    assert segments.shape == (3, 40) and segments[:, 0].eq(1).all() == bos
    assert segments[:, int(bos) :].flatten().tolist() == ids[start : start + 3 * (40 - bos)]


def test_every_perplexity_context_keeps_the_bos(tmp_path, monkeypatch):
    import oscar_hf.evaluation.runner as runner

    seen = {}

    def spy(model, segments, contexts, *args, **kwargs):
        seen[contexts[0]] = segments
        return evaluate_perplexity(model, segments, contexts, *args, **kwargs)

    monkeypatch.setattr(runner, "evaluate_perplexity", spy)
    run_eval(make_model("llama-mha-d64"), char_tokenizer(bos=True), "m", ["bf16"], ["perplexity"], tmp_path,
             text=TEXT, contexts=(16, 32), score_tokens=8, segments=2)
    assert seen[32].shape == (2, 40) and seen[16].shape == (2, 24)
    assert seen[32][:, 0].eq(1).all() and seen[16][:, 0].eq(1).all()
    assert torch.equal(seen[16][:, 1:], seen[32][:, 17:])  # the same 8 scored tokens after 15 of the same text


def test_needle_prompt_and_niah_rows():
    tok = char_tokenizer()
    ids = needle_prompt(tok, TEXT, length=300, depth=0.5, number=4242424)
    text = tok.decode(ids[0])
    assert NEEDLE.format(number=4242424) in text and 250 < ids.shape[1] < 360
    model = make_model("llama-mha-d64")
    rows = evaluate_niah(model, tok, TEXT, [200], [0.0, 1.0], ["bf16", "quarot-int2"], needles=2)
    assert len(rows) == 8 and {r["metric"] for r in rows} == {"needle_found"}
    assert all(r["value"] in (0.0, 1.0) for r in rows)
    assert sorted((r["depth"], r["needle"]) for r in rows if r["method"] == "bf16") == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(ValueError, match="needles"):
        evaluate_niah(model, tok, TEXT, [200], [0.0], ["bf16"], needles=0)


def test_recall_prompt_ends_its_prefill_with_the_list_and_asks_for_it_after_the_text():
    tok = char_tokenizer()
    items = recall_items(random.Random(0), 4)
    assert len(set(items)) == 4 and all(re.fullmatch(r"[A-Z][a-z]+: \d{4}", item) for item in items)
    pool = tok(TEXT, add_special_tokens=False)["input_ids"]
    ids, prefill = recall_prompt(tok, items, pool[:30], pool[30:330])
    assert tok.decode(ids[0, :prefill]).endswith("\n".join(items))
    ask = tok.decode(tok(ASK, add_special_tokens=False)["input_ids"])  # (the toy vocabulary has no parentheses)
    assert tok.decode(ids[0, prefill:]).endswith(ask) and ids.shape[1] - prefill >= 300
    with pytest.raises(ValueError, match="items must be"):
        recall_items(random.Random(0), 0)


def test_recall_scores_exact_lines_only():
    items = ["Tiger: 1234", "Lemon: 5678", "Anchor: 1111"]
    assert score_copy("Tiger: 1234\nLemons: 5678\n  Anchor: 1111  \nlemon: 5678", items) == 2
    assert score_copy("Tiger: 12345", items) == 0


def test_recall_teacher_forces_the_text_token_by_token_past_the_list(monkeypatch):
    """The list is behind every OSCAR layer's recent window (sink or INT2 history) when the copy is asked for, and
    the text after it went through the model one token per forward pass."""
    model = make_model("llama-mha-d64")
    caches, prefills, steps = [], [], []
    monkeypatch.setattr(recall, "make_cache", lambda *a, **k: caches.append(make_cache(*a, **k)) or caches[-1])
    real_prompt = recall.recall_prompt
    monkeypatch.setattr(recall, "recall_prompt", lambda *a: (lambda out: prefills.append(out[1]) or out)(
        real_prompt(*a)))
    model.register_forward_pre_hook(lambda module, args, kwargs: steps.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    rows = evaluate_recall(model, char_tokenizer(), TEXT, [80], ["bf16", "oscar"], OscarRotations.hadamard(
        model.config), items=3, after=400, trials=1)
    assert [(r["method"], r["task"], r["metric"], r["depth"]) for r in rows] == [
        ("bf16", "recall", "recall_exact", 80), ("oscar", "recall", "recall_exact", 80)]
    assert all(r["value"] in (0, 1 / 3, 2 / 3, 1) for r in rows)
    assert steps.count(1) >= 2 * 400 and rows[1]["bits_per_element"] < rows[0]["bits_per_element"] == 32
    for layer in caches[1].layers:
        assert layer.n_history > 0 and layer.n_sink + layer.n_history >= prefills[0]
    with pytest.raises(ValueError, match="fewer than"):
        evaluate_recall(model, char_tokenizer(), TEXT[:200], [80], ["bf16"], items=3, after=400)
    with pytest.raises(ValueError, match="depths must be"):
        evaluate_recall(model, char_tokenizer(), TEXT, [-5], ["bf16"], items=3, after=400)


def test_niah_misses_count_only_needles_the_reference_found():
    def row(method, depth, needle, value):
        return dict(task="niah", method=method, target_length=100, depth=depth, needle=needle, value=value)

    rows = [row("bf16", 0.0, 0, 1.0), row("bf16", 0.5, 0, 0.0), row("bf16", 0.5, 1, 1.0),
            row("a", 0.0, 0, 0.0), row("a", 0.5, 0, 0.0), row("a", 0.5, 1, 1.0),
            row("b", 0.0, 0, 1.0), row("b", 0.5, 0, 1.0), row("b", 0.5, 1, 0.0)]
    assert misses_where_reference_found(rows) == {"a": 1, "b": 1}
    assert "missed where bf16 found" in format_results([{**r, "metric": "needle_found", "context": 100,
                                                          "bits_per_element": 2.0} for r in rows])


def test_gsm8k_loading_and_scoring(tmp_path):
    assert extract_answer("so 3 + 4 = 7. The answer is 1,234.") == "1234"
    assert extract_answer("no digits") is None
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(
        "\n".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"work\n#### {i + 1}"}) for i in range(3))
    )
    items = load_gsm8k(path, limit=2)
    assert items == [{"question": "What is 0 + 1?", "answer": "1"}, {"question": "What is 1 + 1?", "answer": "2"}]
    rows = evaluate_gsm8k(
        make_model("llama-mha-d64"), char_tokenizer(), items, ["bf16", "naive-int2"], max_new_tokens=4
    )
    assert [r["metric"] for r in rows] == ["accuracy", "accuracy"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}))
    with pytest.raises(ValueError, match="####"):
        load_gsm8k(bad)


def test_frontier_is_the_best_quality_at_each_budget():
    rows = [dict(task="perplexity", metric="kl_to_bf16", context=c, method=m, value=v, history_bits=b)
            for m, b, v in (("a", 2.5, 0.3), ("b", 2.5, 0.1), ("c", 3.0, 0.2), ("d", 4.5, 0.01)) for c in (8, 16)]
    rows += [dict(task="recall", metric="recall_exact", method=m, value=v, history_bits=b, context=1, depth=0)
             for m, b, v in (("a", 2.5, 0.0), ("b", 2.5, 0.5), ("c", 3.0, 1.0), ("d", 4.5, 1.0))]
    kl = runner.frontier_points(rows, "perplexity", "kl_to_bf16")
    assert kl == {"a": (2.5, 0.3), "b": (2.5, 0.1), "c": (3.0, 0.2), "d": (4.5, 0.01)}
    assert runner.pareto(kl, higher_is_better=False) == ["b", "d"]
    assert runner.pareto(runner.frontier_points(rows, "recall", "recall_exact"), higher_is_better=True) == ["b", "c"]


def test_run_eval_writes_results_and_plots(tmp_path):
    model = make_model("llama-mha-d64")
    rows = run_eval(
        model,
        char_tokenizer(),
        "tiny-llama",
        ["bf16", "quarot-int2"],
        ["perplexity", "niah"],
        tmp_path,
        text=TEXT,
        contexts=(16, 32),
        score_tokens=8,
        segments=2,
        niah_lengths=(150,),
        niah_depths=(0.0, 1.0),
    )
    with open(tmp_path / "results.csv") as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows) and set(written[0]) == {
        "model",
        "method",
        "task",
        "context",
        "metric",
        "value",
        "bits_per_element",
        "history_bits",
        "depth",
        "needle",
    }
    assert {r["model"] for r in written} == {"tiny-llama"}
    assert all((tmp_path / name).stat().st_size > 0 for name in ("niah.png", "perplexity.png", "frontier.png"))
    with pytest.raises(ValueError, match="--text"):
        run_eval(model, char_tokenizer(), "m", ["bf16"], ["perplexity"], tmp_path)


def test_cli_eval_end_to_end(tmp_path, capsys):
    model = make_model("llama-mha-d64")
    model.save_pretrained(tmp_path / "model")
    char_tokenizer().save_pretrained(tmp_path / "model")
    OscarRotations.hadamard(model.config).save_pretrained(tmp_path / "rot")
    (tmp_path / "text.txt").write_text(TEXT)
    main(
        [
            "eval",
            "--model",
            str(tmp_path / "model"),
            "--rotations",
            str(tmp_path / "rot"),
            "--tasks",
            "perplexity,recall",
            "--text",
            str(tmp_path / "text.txt"),
            "--recall-depths",
            "8,40",
            "--recall-items",
            "2",
            "--recall-after",
            "20",
            "--recall-trials",
            "1",
            "--recall-step",
            "8",
            "--contexts",
            "16",
            "--score-tokens",
            "4",
            "--segments",
            "1",
            "--out",
            str(tmp_path / "out"),
            "--dtype",
            "float32",
        ]
    )
    table = capsys.readouterr().out
    assert "oscar-lloyd-max" in table and "kl_to_bf16" in table and "recall / recall_exact / depth 40" in table
    with open(tmp_path / "out" / "results.csv") as f:
        results = list(csv.DictReader(f))
    assert {"bf16", "oscar", "oscar-lloyd-max"} <= {row["method"] for row in results}
    assert {(row["method"], row["depth"]) for row in results if row["task"] == "recall"} >= {("oscar", "8"),
                                                                                          ("oscar", "40")}


def test_benchmark_environment_names_device_versions_and_commit():
    from oscar_hf.evaluation.environment import device_slug, environment

    env = environment("cpu")
    assert env["gpu"] == "cpu" and env["torch"] == torch.__version__ and env["commit"]
    assert device_slug({"gpu": "NVIDIA H100 80GB HBM3"}) == "nvidia-h100-80gb-hbm3"
    assert environment("cpu", "cpu-interpreter")["gpu"] == "cpu-interpreter"


def test_gpu_state_reads_clocks_and_names_clock_events():
    from oscar_hf.evaluation.environment import gpu_state, parse_gpu_state

    assert gpu_state("cpu") == {}
    state = parse_gpu_state("1980, 2619, 312.45, 39, 0x0000000000000000\n")
    assert state == {"sm_mhz": 1980.0, "mem_mhz": 2619.0, "power_w": 312.45, "temp_c": 39.0, "clock_events": "none"}
    throttled = parse_gpu_state("1410, 2619, 699.1, 84, 0x0000000000000024")
    assert throttled["sm_mhz"] == 1410.0 and throttled["clock_events"] == "sw-power-cap+sw-thermal"
    assert parse_gpu_state("1980, 2619, [N/A], 39, 0x0")["power_w"] is None
    assert parse_gpu_state("No devices were found") == {}
