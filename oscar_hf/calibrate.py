"""Calibration: attention-aware covariances from a model's own activations → OscarRotations.

K target (default "qqt"): the uncentered query covariance of each KV head's query group, so K is
rotated to where queries look. V target (default "sst"): the value covariance weighted per token
by ``w_t = k_t·C_h·k_tᵀ`` (the OSCAR reference's proxy for softmax-weighted values; ``C_h`` the
query covariance of head h, weights normalized to mean 1), which needs a second pass; "softmax"
is the exact ``VᵀSᵀSV`` (the covariance of the attention outputs). Moments are accumulated in
float64 per KV head (a KV head's query moments summed over its GQA group), then averaged over the
KV heads (one rotation per layer) or, with ``per_head``, kept per KV head (one rotation per layer
and KV head), eigendecomposed, and composed as ``R = U·H·P``: eigenvectors, normalized Hadamard,
bit-reversal permutation by eigenvalue rank.

Data-parallel with accelerate: each process takes a contiguous share of the chunks and the sums
are reduced with ``reduction="sum"``, so N processes give one process's result. A model loaded with
``tp_plan`` (tensor-parallel over every process) instead runs every chunk on every rank, as its
all-reduces need, and the capture gathers each rank's heads: every rank computes the whole bundle.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm

from .capture import run_capture
from .codebooks import CODEBOOK_BITS, KeyCodebook, fit_codebook
from .config import OscarConfig
from .diagnostics import diagnose
from .hadamard import bit_reversal_order
from .layout_choice import choose_layout as choose_layout_within
from .layout_choice import quantized_layers
from .model_support import check_model_supported
from .parallel import TensorParallel
from .rotations import OscarRotations, hadamard_matrix
from .tokens import bos_prefix, prefixed_chunks, text_tokens_in

K_TARGETS = ("qqt", "ktk", "identity", "hadamard")
V_TARGETS = ("sst", "softmax", "vtv", "identity", "hadamard")
EIGEN_ORDERS = ("ascending", "descending")
DATA_FREE = {"identity": torch.eye, "hadamard": hadamard_matrix}


# --------------------------------------------------------------------------- rotation algebra
def bit_reversal_permutation(eigenvalues: torch.Tensor) -> torch.Tensor:
    """``perm`` with ``perm[rev(i)] = argsort(λ, descending)[i]``, ``rev`` the bit reversal (any head_dim:
    :func:`oscar_hf.hadamard.bit_reversal_order`); the matrix is ``I[:, perm]``."""
    perm = torch.empty(eigenvalues.numel(), dtype=torch.long)
    perm[bit_reversal_order(eigenvalues.numel())] = torch.argsort(eigenvalues, descending=True, stable=True)
    return perm


def compose_rotation(eigenvectors: torch.Tensor, eigenvalues: torch.Tensor, composition: str = "UHP") -> torch.Tensor:
    """The product, in order, of the factors named in ``composition`` (letters U, H, P; e.g. "UHP", "HP", "U")."""
    d = eigenvectors.shape[0]
    factors = {
        "U": lambda: eigenvectors,
        "H": lambda: hadamard_matrix(d).to(eigenvectors),
        "P": lambda: torch.eye(d, dtype=eigenvectors.dtype)[:, bit_reversal_permutation(eigenvalues)],
    }
    if not composition or set(composition) - set(factors) or len(set(composition)) != len(composition):
        raise ValueError(f"composition must be distinct letters from 'UHP' (e.g. 'UHP'); got {composition!r}")
    rotation = torch.eye(d, dtype=eigenvectors.dtype)
    for letter in composition:
        rotation = rotation @ factors[letter]()
    return rotation


def rotation_from_covariance(
    cov: torch.Tensor, composition: str, eigen_order: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, eigenvalues in ascending order) for a symmetric covariance ``[D, D]`` (float64)."""
    values, vectors = torch.linalg.eigh((cov + cov.mT) / 2)
    if eigen_order == "descending":
        vectors = vectors.flip(-1)
    return compose_rotation(vectors, values, composition), values


# ------------------------------------------------------------------------------- statistics
# second moment each target needs in pass 1 (sst also needs a second, weighted pass)
TARGET_MOMENTS = {"qqt": "qq", "ktk": "kk", "vtv": "vv", "softmax": "oo", "sst": "qq"}


class MomentObserver:
    """Float64 sums per layer and KV head, zero-initialised on ``device`` (so a process that gets no
    chunk still takes part in the reduction). Pass 1: q qᵀ, k kᵀ, v vᵀ or o oᵀ as the targets need.
    Pass 2 (``query_cov`` given, for "sst"): Σ w v vᵀ and Σ w with ``w = k·C_h·kᵀ``."""

    def __init__(self, targets: tuple[str, ...], shape, device, query_cov: dict[int, torch.Tensor] | None = None):
        self.query_cov = query_cov
        self.wanted = set() if query_cov else {TARGET_MOMENTS[t] for t in targets if t in TARGET_MOMENTS}
        self.sums = {}
        for layer, (h, d) in enumerate(zip(shape.kv_heads, shape.head_dims)):
            sizes = {name: (h, d, d) for name in self.wanted} | {"tokens": ()}
            if shape.latent is not None:
                sizes["latent"] = (1, d, d)
            if query_cov is not None:
                sizes |= {"wvv": (h, d, d), "wsum": (h,)}
            self.sums |= {f"{layer}.{name}": torch.zeros(size, dtype=torch.float64, device=device)
                          for name, size in sizes.items()}

    def _add(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] += value.to(self.sums[name].device)

    def observe_latent(self, layer_idx: int, latent: torch.Tensor, weights: torch.Tensor) -> None:
        """A multi-head latent attention layer's latent ``[B, 1, T, r]`` and the attention each token receives
        ``[B, T]``: the latent's attention-weighted second moment ``Σ w c cᵀ`` and ``Σ w``."""
        if self.query_cov is None:
            x, w = latent.double(), weights.double().to(latent.device)
            self._add(f"{layer_idx}.latent", torch.einsum("bt,bhtd,bhte->hde", w, x, x))
            self.sums[f"{layer_idx}.tokens"] += w.sum().to(self.sums[f"{layer_idx}.tokens"].device)

    def observe(self, layer_idx, query, key, value, output, scaling) -> None:
        b, h, t, d = key.shape
        tensors = {"qq": query, "kk": key, "vv": value, "oo": output}
        for name in self.wanted:
            x = tensors[name].double().reshape(b, h, -1, d)  # query groups: [B, H, g·T, D]
            self._add(f"{layer_idx}.{name}", torch.einsum("bhnd,bhne->hde", x, x))
        self.sums[f"{layer_idx}.tokens"] += b * t
        if self.query_cov is not None:
            k, v = key.double(), value.double()
            weights = torch.einsum("bhtd,hde,bhte->bht", k, self.query_cov[layer_idx].to(k.device), k)
            self._add(f"{layer_idx}.wvv", torch.einsum("bht,bhtd,bhte->hde", weights, v, v))
            self._add(f"{layer_idx}.wsum", weights.sum(dim=(0, 2)))


def _reduce(sums: dict[str, torch.Tensor], data_parallel: bool) -> dict[str, torch.Tensor]:
    from accelerate.utils import reduce

    if not data_parallel:
        return sums
    return dict(reduce(dict(sorted(sums.items())), reduction="sum"))


def process_state():
    """accelerate's process state (gloo on CPU-only machines, so torchrun on CPU works too)."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


# ----------------------------------------------------------------------------------- inputs
HELD_OUT_LENGTH = 1024  # longest held-out chunk for the diagnostics (they hold [T, T] attention scores)


def token_chunks(
    tokenizer, texts, num_tokens: int, max_length: int, held_out_tokens: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The first tokens of ``texts``, documents joined by EOS: ``num_tokens`` of them in calibration chunks
    ``[≤ max_length]``, then ``held_out_tokens`` in held-out chunks ``[≤ min(max_length, 1024)]``.

    Every chunk starts with the tokenizer's BOS if it adds one on its own (``bos_prefix``; none for token-id
    inputs without a tokenizer); that BOS counts in the chunk lengths and in both totals.
    ``texts``: a list of strings, a ``datasets.Dataset`` with a "text" column, a 1-D or 2-D token-id
    tensor, or a list of 1-D token-id tensors.
    """
    bos = bos_prefix(tokenizer)
    ids, count = _calibration_ids(tokenizer, texts, num_tokens, max_length, held_out_tokens, bos)
    held_out = prefixed_chunks(ids[count:], _held_out_length(max_length), bos)
    return prefixed_chunks(ids[:count], max_length, bos), held_out


def calibration_token_ids(tokenizer, texts, num_tokens: int, max_length: int, held_out_tokens: int = 0
                          ) -> torch.Tensor:
    """The token ids ``[N]`` (no BOS) that ``token_chunks`` cuts into chunks, calibration ones then held-out ones.
    Given as ``[ids]`` in place of ``texts`` (with the same tokenizer and counts), they make the same chunks."""
    return _calibration_ids(tokenizer, texts, num_tokens, max_length, held_out_tokens, bos_prefix(tokenizer))[0]


def first_held_out_length(tokenizer, ids: torch.Tensor, num_tokens: int, max_length: int) -> int:
    """Text tokens in the first held-out chunk ``token_chunks`` cuts from ``ids`` (``calibration_token_ids``' output
    for these counts): 0 where the text leaves none after the calibration tokens."""
    held_out = len(ids) - min(len(ids), text_tokens_in(num_tokens, max_length, bos_prefix(tokenizer)))
    return min(held_out, _held_out_length(max_length))


def _held_out_length(max_length: int) -> int:
    return min(max_length, HELD_OUT_LENGTH)


def _calibration_ids(tokenizer, texts, num_tokens, max_length, held_out_tokens, bos) -> tuple[torch.Tensor, int]:
    """(the ids of ``calibration_token_ids``, how many of them are calibration tokens)."""
    count = text_tokens_in(num_tokens, max_length, bos)
    held_out = text_tokens_in(held_out_tokens, _held_out_length(max_length), bos)
    return _token_ids(tokenizer, texts, count + held_out), count


def _token_ids(tokenizer, texts, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` token ids ``[≤ num_tokens]`` of ``texts`` (as in ``token_chunks``), no BOS."""
    if hasattr(texts, "column_names"):
        if "text" not in texts.column_names:
            raise ValueError(f"the dataset has no 'text' column (columns: {texts.column_names})")
        texts = texts["text"]
    if isinstance(texts, torch.Tensor):
        texts = list(texts) if texts.ndim == 2 else [texts]
    if isinstance(texts, str) or not hasattr(texts, "__iter__"):
        raise TypeError("texts must be a list of strings, a datasets.Dataset or token-id tensors")
    separator = [] if tokenizer is None or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids: list[int] = []
    for doc in texts:
        if len(ids) >= num_tokens:
            break
        if isinstance(doc, torch.Tensor):
            ids += doc.flatten().tolist()
            continue
        if not doc.strip():
            continue
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to calibrate on text")
        for piece in _paragraph_pieces(doc):  # long documents are tokenized only as far as needed
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
            if len(ids) >= num_tokens:
                break
        ids += separator
    ids = ids[:num_tokens]
    if not ids:
        raise ValueError("no calibration tokens: texts are empty")
    return torch.tensor(ids)


def _paragraph_pieces(text: str, size: int = 16384):
    """``text`` in consecutive pieces of about ``size`` characters, cut after paragraph breaks."""
    start = 0
    while start < len(text):
        cut = text.find("\n\n", start + size)
        end = len(text) if cut < 0 else cut + 2
        yield text[start:end]
        start = end


def _data_parallel(model) -> bool:
    """Whether the processes split the chunks (several processes, the model whole on each), or each runs them all
    (one process, or a tensor-parallel model over all of them)."""
    processes = process_state().num_processes
    tp = TensorParallel.of(model)
    if tp is None:
        return processes > 1
    if tp.size != processes:
        raise ValueError(f"calibration runs a tensor-parallel model over all its processes: the model's mesh has "
                         f"{tp.size} ranks and there are {processes} processes")
    return False


def _forward_all(model, observer, chunks, batch_size: int, desc: str, show_progress: bool) -> None:
    state = process_state()
    with (state.split_between_processes(chunks) if _data_parallel(model) else nullcontext(chunks)) as mine:
        bar = tqdm(
            total=sum(c.numel() for c in mine),
            unit="tok",
            desc=desc,
            disable=not show_progress or not state.is_local_main_process,
        )
        for start in range(0, len(mine), batch_size):
            batch = mine[start : start + batch_size]
            for same_length in _group_by_length(batch):
                run_capture(model, observer, torch.stack(same_length))
                bar.update(sum(c.numel() for c in same_length))
        bar.close()


def _group_by_length(chunks: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[int, list[torch.Tensor]] = {}
    for chunk in chunks:
        groups.setdefault(chunk.numel(), []).append(chunk)
    return list(groups.values())


# ------------------------------------------------------------------------------ entry point
def calibrate(
    model: torch.nn.Module,
    tokenizer,
    texts,
    *,
    num_tokens: int = 30000,
    max_length: int = 2048,
    k_target: str = "qqt",
    v_target: str = "sst",
    composition: str = "UHP",
    eigen_order: str = "ascending",
    batch_size: int = 1,
    diagnostic_tokens: int = 2048,
    config: OscarConfig | None = None,
    show_progress: bool = True,
    per_head: bool = False,
    choose_layout: bool | None = None,
    bit_budget: float | None = None,
    key_codebook_bits: Sequence[int] = (),
) -> OscarRotations:
    """Make OSCAR rotations for ``model`` from its own activations on ``texts``.

    Args:
        texts: strings, a ``datasets.Dataset`` with a "text" column, or token-id tensors.
        num_tokens: calibration tokens (per layer); max_length: tokens per forward chunk. Every chunk starts
            with the tokenizer's BOS if it adds one on its own, counted in both (see ``token_chunks``).
        k_target: "qqt" (query covariance), "ktk", "identity" or "hadamard".
        v_target: "sst" (key-weighted value covariance, as the reference), "softmax" (exact
            VᵀSᵀSV), "vtv", "identity" or "hadamard".
        composition: factors of R in order, from U (eigenvectors), H (Hadamard), P (bit reversal).
        eigen_order: column order of U: "ascending" eigenvalues (reference) or "descending".
        diagnostic_tokens: held-out tokens after the calibration ones for per-layer diagnostics
            (stored in ``rotations.diagnostics``); 0 skips them.
        config: the OscarConfig the diagnostics use, stored in the bundle as its recommendation.
        per_head: one rotation per layer and KV head, each from its own head's covariance (K: its query group's
            queries, or its keys; V: its values, weighted by its own query covariance for "sst"), instead of one per
            layer from the covariance averaged over the KV heads.
        choose_layout: choose the bundle's config (a 2-bit K layout per token or per channel, centering, then
            4-bit K in the layers where it pays) on the held-out tokens, within ``bit_budget`` history bits per
            element (default 2.6, or the 2-bit layout's cost where that is more): :mod:`oscar_hf.layout_choice`.
            Needs held-out tokens (``diagnostic_tokens > 0``, and text enough for them). None (default): choose
            where no ``config`` is given and the first held-out chunk outlasts the default windows (so that the
            layouts are scored on quantized tokens), as the on-demand path and ``oscar-hf calibrate`` do; a
            multi-head latent attention model keeps its latent layout.
        key_codebook_bits: bit widths (1, 2) of product-quantized key codebooks to train on the calibration tokens
            (:mod:`oscar_hf.codebooks`), for ``key_quantization="product"``; ``config``'s own are always trained.
    Returns:
        OscarRotations with float32 ``[layers, D, D]`` rotations (``[layers, H, D, D]`` per head) and ascending
        eigenvalues.
    """
    for name, value, allowed in (
        ("k_target", k_target, K_TARGETS),
        ("v_target", v_target, V_TARGETS),
        ("eigen_order", eigen_order, EIGEN_ORDERS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}; got {value!r}")
    for name, value in (("per_head", per_head), ("choose_layout", choose_layout)):
        if not isinstance(value, bool) and not (name == "choose_layout" and value is None):
            raise ValueError(f"{name} must be True or False{' or None' if name == 'choose_layout' else ''}; got "
                             f"{value!r}")
    if choose_layout and diagnostic_tokens < 1:
        raise ValueError("choose_layout scores the layouts on held-out tokens: give diagnostic_tokens > 0")
    if bit_budget is not None and choose_layout is False:
        raise ValueError("bit_budget is the budget of choose_layout=True")
    given_config = config is not None
    for name, value in (("num_tokens", num_tokens), ("max_length", max_length), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    compose_rotation(torch.eye(2, dtype=torch.float64), torch.ones(2), composition)  # validates the letters
    shape = check_model_supported(model)
    config = config or OscarConfig()
    codebook_bits = _codebook_bits(key_codebook_bits, config)
    if choose_layout and config.key_layout.uses_codebook:
        raise ValueError("choose_layout chooses among the INT2 K layouts and would replace a product-key config: "
                         "calibrate it with choose_layout=False")
    if codebook_bits and shape.latent is not None:
        raise ValueError("key codebooks are for per-head K/V: a multi-head latent attention model stores its latent")
    chunks, held_out = token_chunks(tokenizer, texts, num_tokens, max_length, diagnostic_tokens)
    used = sum(c.numel() for c in chunks)
    if choose_layout is None:
        choose_layout = bit_budget is not None or (
            not given_config and shape.latent is None and bool(held_out)
            and held_out[0].numel() > config.sink_tokens + config.recent_tokens)

    data_parallel = _data_parallel(model)
    device = process_state().device if data_parallel else model.device
    moments = MomentObserver((k_target, v_target), shape, device)
    if moments.wanted or shape.latent is not None:
        _forward_all(model, moments, chunks, batch_size, "calibrate (pass 1)", show_progress)
    sums = _reduce(moments.sums, data_parallel)
    groups = [shape.num_heads // h for h in shape.kv_heads]  # query heads per KV head, by layer
    # the layers with K/V of their own: not linear-attention or state-space layers, nor KV-sharing ones (whose
    # queries count towards the layer they read)
    layers = [i for i in range(shape.num_layers) if shape.reads_own_kv(i) and shape.attention(i) is not None]

    if v_target == "sst" and shape.latent is None:
        query_cov = {i: sums[f"{i}.qq"] / (sums[f"{i}.tokens"] * groups[i]) for i in layers}
        weighted = MomentObserver((), shape, device, query_cov=query_cov)
        _forward_all(model, weighted, chunks, batch_size, "calibrate (pass 2)", show_progress)
        sums.update(_reduce(weighted.sums, data_parallel))

    def covariances(layer: int, target: str) -> list[torch.Tensor]:
        """The layer's covariances ``[D, D]`` of ``target``: one per KV head, or their mean. A latent attention
        layer's are its latent's attention-weighted second moment, whatever the target."""
        if shape.latent is not None:
            per_kv_head = sums[f"{layer}.latent"] / sums[f"{layer}.tokens"]
        elif target == "sst":
            per_kv_head = sums[f"{layer}.wvv"] / sums[f"{layer}.wsum"][:, None, None]
        else:
            group = groups[layer]
            name, per_row = {"qqt": ("qq", group), "ktk": ("kk", 1), "vtv": ("vv", 1), "softmax": ("oo", group)}[
                target]
            per_kv_head = sums[f"{layer}.{name}"] / (sums[f"{layer}.tokens"] * per_row)
        per_kv_head = per_kv_head.cpu()
        return list(per_kv_head) if per_head else [per_kv_head.mean(0)]

    def rotations_for(target: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer: rotations ``[(H,) D, D]`` and eigenvalues ``[(H,) D]`` for ``target`` (the identity where a
        layer has no K/V of its own)."""
        out = []
        for i, (h, d) in enumerate(zip(shape.kv_heads, shape.head_dims)):
            heads = (h,) if per_head else ()
            if target in DATA_FREE or i not in layers:
                matrix = DATA_FREE[target](d) if target in DATA_FREE else torch.eye(d, dtype=torch.float64)
                out.append((matrix.double().expand(*heads, d, d), torch.zeros(*heads, d)))
                continue
            pairs = [rotation_from_covariance(cov, composition, eigen_order) for cov in covariances(i, target)]
            rotation, values = torch.stack([r for r, _ in pairs]), torch.stack([v for _, v in pairs])  # [H or 1, ...]
            out.append((rotation, values) if per_head else (rotation[0], values[0]))
        return [r.float() for r, _ in out], [v.float() for _, v in out]

    key_rotation, key_eigenvalues = rotations_for(k_target)
    # a latent attention layer has one rotation, its latent's (in K's place); V's place holds the identity
    value_rotation, value_eigenvalues = rotations_for("identity" if shape.latent is not None else v_target)
    rotations = OscarRotations(
        key_rotation,
        value_rotation,
        key_eigenvalues=key_eigenvalues,
        value_eigenvalues=value_eigenvalues,
        num_kv_heads=shape.kv_heads,
        source_model=getattr(model.config, "_name_or_path", None) or None,
        method="oscar",
        calibration={
            "tokens": used,
            "max_length": max_length,
            "k_target": k_target,
            "v_target": v_target,
            "composition": composition,
            "eigen_order": eigen_order,
            "per_head": per_head,
        },
        config=config,
    )
    if choose_layout:
        if not held_out:
            raise ValueError(f"choose_layout scores the layouts on held-out tokens, and the text left none after the "
                             f"{used} calibration tokens: give more text or fewer num_tokens")
        rotations = choose_layout_within(model, rotations, held_out, config, bit_budget)
        if codebook_bits:  # in the chosen K basis
            _add_key_codebooks(model, rotations, chunks, codebook_bits, rotations.config, show_progress)
        return rotations
    if codebook_bits:
        _add_key_codebooks(model, rotations, chunks, codebook_bits, config, show_progress)
    if held_out:
        rotations.diagnostics = diagnose(model, rotations, held_out, config)
    return rotations


def _codebook_bits(requested: Sequence[int], config: OscarConfig) -> list[int]:
    """The key codebook widths to train: ``requested``, and those ``config`` stores K in where it uses codebooks."""
    if isinstance(requested, (str, bytes)) or not all(b in CODEBOOK_BITS and type(b) is int for b in requested):
        raise ValueError(f"key_codebook_bits must be a list of {' and '.join(map(str, CODEBOOK_BITS))}; got "
                         f"{requested!r}")
    bits = set(requested)
    if config.key_layout.uses_codebook:
        bits.add(config.side_bits["key"])
        if config.key_bits_layers is not None:
            bits.add(config.bits)
    return sorted(bits)


def _add_key_codebooks(model, rotations: OscarRotations, chunks, bits: list[int], config: OscarConfig,
                       show_progress: bool) -> None:
    """Train ``bits``-bit key codebooks into ``rotations`` for the layers a cache of ``config`` quantizes (not the
    sliding-window layers it leaves to transformers), in the bundle's K basis."""
    plain = config.replace(key_quantization="per-token", key_bits=None, key_bits_layers=None, centering=True)
    stored = quantized_layers(model.config, rotations, plain)
    books = train_key_codebooks(model, rotations, chunks, bits, sink_tokens=config.sink_tokens, layers=stored,
                                show_progress=show_progress)
    missing = [i for i in stored if any(books[b][i] is None for b in bits)]
    if missing:
        raise ValueError(f"no keys past the first {config.sink_tokens} tokens of a chunk reached layers {missing}: "
                         "key codebooks need longer chunks (max_length) or more text")
    rotations.key_codebooks = books
    rotations.calibration["key_codebook_bits"] = bits


class _KeyObserver:
    """Collects, per layer, rotated keys centered per chunk (the tokens after the sink, at most ``max_keys`` per KV
    head, spread over the chunks) and the queries' second moment in the rotated basis, per KV head."""

    def __init__(self, rotations: OscarRotations, sink_tokens: int, max_keys: int, generator: torch.Generator):
        self.rotations, self.sink, self.max_keys, self.generator = rotations, sink_tokens, max_keys, generator
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.query_moment: dict[int, torch.Tensor] = {}
        self.query_rows: dict[int, int] = {}

    def observe(self, layer_idx, query, key, value, output, scaling) -> None:
        rotation = self.rotations.key_rotation[layer_idx].to(key.device)
        batch, heads, tokens, dim = key.shape
        body = (key.float() @ rotation)[:, :, self.sink:]  # [B, H, n, D]
        if body.shape[2] == 0:
            return
        body = body - body.mean(dim=2, keepdim=True)
        keep = torch.randperm(body.shape[2], generator=self.generator)[: self.max_keys].to(key.device)
        self.keys.setdefault(layer_idx, []).append(body.index_select(2, keep).transpose(0, 1).flatten(1, 2).cpu())
        q = query.float().reshape(batch, heads, -1, tokens, dim) @ rotation[:, None] if rotation.ndim == 3 else (
            query.float().reshape(batch, heads, -1, tokens, dim) @ rotation)
        moment = torch.einsum("bhgtd,bhgte->hde", q, q).cpu()  # [H, D, D]
        self.query_moment[layer_idx] = self.query_moment.get(layer_idx, 0) + moment
        self.query_rows[layer_idx] = self.query_rows.get(layer_idx, 0) + q.shape[0] * q.shape[2] * q.shape[3]


@torch.no_grad()
def train_key_codebooks(
    model, rotations: OscarRotations, chunks: list[torch.Tensor], bits: Sequence[int], *, sink_tokens: int = 64,
    max_keys: int = 16384, iterations: int = 20, seed: int = 0, layers: list[int] | None = None,
    show_progress: bool = True,
) -> dict[int, list[KeyCodebook | None]]:
    """Key codebooks of each width in ``bits``: ``{bits: [one per layer]}`` (None for a layer with no K of its own,
    or not in ``layers``), shared by the KV heads or one per KV head as the rotations are, from the model's keys on
    the token ``chunks`` (at most ``max_keys`` per codebook, spread over the chunks, after each chunk's first
    ``sink_tokens``)."""
    generator = torch.Generator().manual_seed(seed)
    per_chunk = -(-max_keys // max(1, len(chunks)))
    observer = _KeyObserver(rotations, sink_tokens, per_chunk, generator)
    for chunk in chunks:
        run_capture(model, observer, chunk.reshape(1, -1))
    books: dict[int, list[KeyCodebook | None]] = {b: [None] * rotations.num_layers for b in bits}
    for i in tqdm(range(rotations.num_layers), desc="key codebooks", unit="layer", disable=not show_progress):
        if i not in observer.keys or (layers is not None and i not in layers):
            continue
        keys = torch.cat(observer.keys[i], dim=1)  # [H, N, D]
        moment = observer.query_moment[i] / observer.query_rows[i]  # [H, D, D]
        if not rotations.per_head:  # one codebook for the pooled heads, from max_keys of their keys
            keys, moment = keys.flatten(0, 1), moment.mean(0, keepdim=True)
            keys = keys[torch.randperm(keys.shape[0], generator=generator)[:max_keys]][None]
        device = next(model.parameters()).device  # (k-means runs where the model does)
        for b in bits:
            books[b][i] = fit_codebook(keys.to(device), moment.to(device), b, iterations=iterations,
                                       seed=seed + i).to("cpu")
    return books
