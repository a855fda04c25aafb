"""What the kernel tests share: seeded inputs on the kernels' device, and a PackedKV built from plain tensors with
the torch writer, as a layer would hold it, without any cache."""

import os

import torch

from oscar_hf import OscarConfig
from oscar_hf.kernels import PackedKV, quantize_kv
from oscar_hf.kernels.append.reference import rotate_rows
from oscar_hf.quantizer import QuantizedRows

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def assert_same_rows(got: QuantizedRows, want: QuantizedRows) -> None:
    for name, a, b in zip(want._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"


class Attn(torch.nn.Module):
    """The attention module the torch twin reads its GQA grouping and causality from."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def pack(key: torch.Tensor, value: torch.Tensor, *, sink: int, recent: int, ring_start: int = 0,
         key_rotation: torch.Tensor | None = None, value_rotation: torch.Tensor | None = None,
         center_tokens: int | None = None, **config) -> PackedKV:
    """The storage of ``key``/``value [B, H, T, D]`` (model dtype): the first ``sink`` tokens and the last ``recent``
    as given (the recent window a ring buffer whose oldest token is row ``ring_start``), the tokens between rotated
    (fp32 sums rounded once to the model dtype), centered where ``OscarConfig(**config)`` centers on the fp32 mean
    of their first ``center_tokens`` (default all: a layer's means are set by the first rows to reach its history),
    and written by the torch writer with that config's bits, group size, clips and scale dtype. Rotations
    ``[D, D]`` or ``[H, D, D]`` are stored in the model dtype (None: identity). Host counts."""
    cfg = OscarConfig(**config)
    batch, heads, total, dim = key.shape
    n_hist = total - sink - recent
    rotations = [None if r is None else r.to(key.dtype).to(key.device) for r in (key_rotation, value_rotation)]
    packed = PackedKV.empty(batch, heads, dim, sink=sink, history=n_hist, recent=recent, dtype=key.dtype,
                            device=key.device, key_bits=cfg.side_bits["key"], value_bits=cfg.bits,
                            group_size=cfg.group_size, scale_dtype=cfg.torch_scale_dtype, centered=cfg.centering,
                            key_rotation=rotations[0], value_rotation=rotations[1],
                            quantizer=cfg.quantizer)
    for sink_rows, recent_rows, x in ((packed.sink_k, packed.recent_k, key), (packed.sink_v, packed.recent_v, value)):
        sink_rows.copy_(x[:, :, :sink])
        recent_rows.copy_(x[:, :, total - recent:].roll(ring_start, dims=2))
    if n_hist:
        rows = [rotate_rows(x[:, :, sink:sink + n_hist], r) for x, r in zip((key, value), rotations)]
        for center, x in zip(packed.centers, rows):
            center.copy_(x[:, :, :center_tokens].mean(dim=2, keepdim=True, dtype=torch.float32))
        clip = cfg.side_clip
        written = quantize_kv(*rows, bits=cfg.bits, key_bits=cfg.side_bits["key"], group_size=packed.group_size,
                              k_clip=clip["key"], v_clip=clip["value"], scale_dtype=cfg.torch_scale_dtype,
                              method=cfg.quantizer, key_center=packed.key_center, value_center=packed.value_center)
        for stored, part in zip((*packed.key, *packed.value), (*written[0], *written[1])):
            stored.copy_(part)
    packed.counts = (sink, n_hist, recent, ring_start)
    return packed
