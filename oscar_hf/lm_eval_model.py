"""lm-evaluation-harness model "hf-oscar": lm-eval's Hugging Face model with an OSCAR KV cache in the loop.

``lm_eval --model hf-oscar`` finds it without importing this module: oscar-hf installs an import hook
(``_oscar_hf_lm_eval.py``, run by ``oscar_hf_lm_eval.pth``) that registers it with lm-eval 0.4.13, and declares the
``lm_eval.models`` entry point that lm-eval's plugin loader reads. In Python, ``lm_eval.simple_evaluate(
model="hf-oscar", ...)`` works the same way, as does passing an :class:`OscarHFLM` instance.

Every request type goes through a fresh cache of the chosen method:

* ``generate_until``: each batch generates with its own cache (prompt prefill, then decode).
* ``loglikelihood`` and ``loglikelihood_rolling`` (one request per rolling window): the context but its
  last token is prefilled into a fresh cache as one chunk (attending to itself at full precision, as a
  prompt does in generation); then the last context token and the continuation are teacher-forced one
  token at a time through the decode path. Every scored token, the first one included, is thus
  predicted by a query over the quantized history, exactly as a generated token would be (a prefill
  ending at the context would predict the first token at full precision: one-token answers, as in
  most multiple-choice tasks, would score exactly as BF16). Contexts of equal length share a batch, and
  a context is prefilled once for all its continuations (the choices of a multiple-choice question);
  continuations are right-padded.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from itertools import groupby

import torch
import torch.nn.functional as F
from tqdm import tqdm

from oscar_hf._extras import require
from oscar_hf.cache import OscarQuantizedCache
from oscar_hf.config import OscarConfig
from oscar_hf.evaluation.methods import METHODS, make_cache
from oscar_hf.model_support import cache_kwargs
from oscar_hf.models import PYPI_MODELS, pypi_model_folder
from oscar_hf.rotations import OscarRotations

# Importing lm_eval.models.huggingface imports lm_eval.models first, which registers lm-eval's built-in models;
# registering "hf-oscar" before that would hide them (get_model only loads them into an empty registry).
HFLM = require("lm_eval.models.huggingface", "the hf-oscar lm-eval model").HFLM
register_model = require("lm_eval.api.registry", "the hf-oscar lm-eval model").register_model

# model_args that are OscarConfig overrides -> OscarConfig field. HFLM already takes "backend" (causal/seq2seq).
CONFIG_ARGS = {f.name: f.name for f in dataclasses.fields(OscarConfig) if f.name != "backend"}
CONFIG_ARGS["oscar_backend"] = "backend"


def check_model_args(method: str, rotations: OscarRotations | None, overrides: dict, on_demand: bool = False) -> None:
    """Raise ValueError naming the model_arg at fault: an unknown ``method``, one that cannot run with the loaded
    ``rotations`` bundle (the registry's ``Method.unmet``), OscarConfig ``overrides`` for a method that is not an
    OSCAR cache or that OscarConfig rejects. ``on_demand``: the bundle is yet to be made (a calibrated method
    without ``rotations=``), so only what does not depend on it is checked."""
    if method not in METHODS:
        raise ValueError(f"hf-oscar: unknown method={method!r}; known methods: {', '.join(METHODS)}")
    reason = None if on_demand else METHODS[method].unmet(rotations)
    if on_demand and not METHODS[method].installed():
        reason = METHODS[method].unmet(None)
    if reason:
        raise ValueError(f"hf-oscar: {reason}")
    if overrides and not METHODS[method].is_oscar:
        raise ValueError(f"hf-oscar: method={method!r} is not an OSCAR cache; it takes no {sorted(overrides)}")
    try:
        OscarConfig().replace(**overrides)
    except ValueError as err:
        raise ValueError(f"hf-oscar model_args: {err}") from None


@register_model("hf-oscar")
class OscarHFLM(HFLM):
    """HFLM whose generation and scoring run through an OSCAR quantized KV cache.

    Args:
        pretrained: model id or folder, a name in oscar_hf.models.PYPI_MODELS ("smollm2", "qwen2.5-coder-1.5b", ...: the
            converted folder, made on first use), or a loaded model (whose attention is then switched to "oscar").
        rotations: rotation bundle folder or Hub repo (OscarRotations.from_pretrained), whose recommended config is
            the base of every method's config. Without it, a calibrated method calibrates the model on demand (once:
            the bundle is kept in the Hugging Face cache folder, :func:`oscar_hf.rotations_for_model`).
        rotations_subfolder: subfolder of ``rotations``.
        method: a name in oscar_hf.evaluation.METHODS ("oscar", "oscar-lloyd-max", "quarot-int2",
            "naive-int2", "int4", "bf16", ...); default "oscar". ``Method.needs_calibration`` says which need
            ``rotations``.
        **kwargs: OscarConfig fields (``recent_tokens=128``, ``k_clip=1.0``; its ``backend`` is
            ``oscar_backend``), applied on top of the method's config; everything else goes to HFLM.
    """

    def __init__(self, pretrained, rotations: str | None = None, rotations_subfolder: str | None = None,
                 method: str = "oscar", **kwargs):
        overrides = {CONFIG_ARGS[name]: kwargs.pop(name) for name in list(kwargs) if name in CONFIG_ARGS}
        self.oscar_rotations = (
            OscarRotations.from_pretrained(rotations, subfolder=rotations_subfolder) if rotations else None
        )
        on_demand = self.oscar_rotations is None and method in METHODS and METHODS[method].needs_calibration
        check_model_args(method, self.oscar_rotations, overrides, on_demand)  # before the model loads
        self.oscar_method = method
        self.oscar_overrides = overrides
        self.oscar_rotations_source = "/".join(filter(None, [rotations, rotations_subfolder])) or None
        if isinstance(pretrained, str) and pretrained in PYPI_MODELS:
            pretrained = str(pypi_model_folder(pretrained))
        super().__init__(pretrained, **kwargs)
        if on_demand:
            from oscar_hf.autocalibrate import rotations_for_model

            bits = METHODS[method].key_codebook_bits
            self.oscar_rotations = rotations_for_model(self.model, self.tokenizer,
                                                       key_codebook_bits=() if bits is None else (bits,))
            self.oscar_rotations_source = "on demand"
            check_model_args(method, self.oscar_rotations, overrides)
        # A first cache checks model, bundle and config together and routes the model's attention through oscar_hf.
        cache = self.new_cache()
        self.oscar_config = cache.config if isinstance(cache, OscarQuantizedCache) else None

    def new_cache(self):
        """A fresh, empty cache of the method: an OscarQuantizedCache (a DynamicCache for "bf16")."""
        return make_cache(self.oscar_method, self.model, self.oscar_rotations, **self.oscar_overrides)

    def get_model_info(self) -> dict:
        return {
            **super().get_model_info(),
            "oscar_method": self.oscar_method,
            "oscar_rotations": self.oscar_rotations_source,
            "oscar_config": self.oscar_config.to_dict() if self.oscar_config else None,
        }

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """Generate from left-padded ``context [B, T]`` with a fresh cache for this batch."""
        return super()._model_generate(context, max_length, stop, **cache_kwargs(self.model, self.new_cache()),
                                       cache_implementation=None, **generation_kwargs)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """``(log P(continuation | context), continuation is the greedy one)`` for each request
        ``(strings or None, context ids, continuation ids)``, in order, scored through the cache.

        A batch is up to ``batch_size`` distinct contexts of one length with all their continuations: each context
        is prefilled once, however many continuations (multiple-choice answers) it has.
        """
        if self.backend != "causal":
            raise NotImplementedError("hf-oscar scores decoder-only (causal) models only")
        batch_size = override_bs or (self._detect_batch_size() if self.batch_size == "auto" else self.batch_size)
        by_context = defaultdict(list)  # context ids -> [(request index, continuation ids)]
        for i, (_, context, continuation) in enumerate(requests):
            tokens = (context + continuation)[-(self.max_length + 1):]  # left-truncated like HFLM's
            split = len(tokens) - len(continuation)
            by_context[tuple(tokens[:split])].append((i, tokens[split:]))
        contexts = sorted(by_context, key=len, reverse=True)
        results = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="hf-oscar loglikelihood")
        for _, same_length in groupby(contexts, key=len):
            same_length = list(same_length)
            for start in range(0, len(same_length), batch_size):
                batch = {context: [cont for _, cont in by_context[context]]
                         for context in same_length[start : start + batch_size]}
                indices = [i for context in batch for i, _ in by_context[context]]
                for i, score in zip(indices, self._score(batch), strict=True):
                    results[i] = score
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
                pbar.update(len(indices))
        pbar.close()
        return results

    @torch.inference_mode()
    def _score(self, batch: dict[tuple[int, ...], list[list[int]]]) -> list[tuple[float, bool]]:
        """Score the continuations of U contexts of one length L, B continuations in all.

        The contexts but their last token, ``[U, max(L - 1, 1)]``, are prefilled into a fresh cache, which then
        holds each context once per continuation (``reorder_cache``; transformers' QuantizedCache, which cannot
        reorder, gets the prefill of every row instead); the rest of each row (last context token, continuation),
        right-padded to ``[B, width]``, is fed one token at a time (padding never reaches a row's own scores:
        attention is causal). Returns (sum of the continuation's log-probabilities, all greedy) per continuation,
        in the order of ``batch``.
        """
        contexts = list(batch)
        length = len(contexts[0])
        rows = [(u, continuation) for u, context in enumerate(contexts) for continuation in batch[context]]
        width = length + max(len(continuation) for _, continuation in rows)
        ids = torch.tensor([[*contexts[u], *continuation] + [0] * (width - length - len(continuation))
                            for u, continuation in rows], device=self.device)  # [B, width]
        owner = torch.tensor([u for u, _ in rows], device=self.device)  # row -> its context
        prefill = max(length - 1, 1)  # a one-token context is prefilled whole: it predicts from itself alone
        cache = self.new_cache()
        through = cache_kwargs(self.model, cache)
        shared = len(rows) > len(contexts) and METHODS[self.oscar_method].quantized_cache is None
        prefill_ids = torch.tensor(contexts, device=self.device)[:, :prefill] if shared else ids[:, :prefill]
        picked, greedy = [], []  # per scored position: [B] log-probability of the target, [B] target is the argmax

        def score(logits: torch.Tensor, target: int) -> None:
            logprobs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
            picked.append(logprobs.gather(-1, ids[:, target, None])[:, 0])
            greedy.append(logprobs.argmax(-1) == ids[:, target])

        with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                            enabled=self.mixed_precision_dtype is not None):
            out = self.model(input_ids=prefill_ids, **through, use_cache=True, logits_to_keep=1)
            if shared:
                cache.reorder_cache(owner)
            if prefill == length:
                score(out.logits[owner, -1] if shared else out.logits[:, -1], length)
            for t in range(prefill, width - 1):  # feeding token t predicts token t + 1
                score(self.model(input_ids=ids[:, t : t + 1], **through, use_cache=True).logits[:, -1], t + 1)
        picked, greedy = torch.stack(picked, dim=1), torch.stack(greedy, dim=1)  # [B, width - length]
        return [(float(picked[b, : len(c)].sum()), bool(greedy[b, : len(c)].all())) for b, (_, c) in enumerate(rows)]
