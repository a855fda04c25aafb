"""Multi-head latent attention (MLA) layers: the compressed latent stored like a K side, the RoPE key as it is."""

from __future__ import annotations

from types import MethodType

import torch
from torch.utils._pytree import tree_map_only

from ..config import OscarConfig
from ..kernels import dequantize_backend
from ..kernels.latent.reference import absorbed_attention
from ..quantizer import QuantizedRows
from .layer import OscarLayer, is_identity
from .segments import Segment

# set, in a model's config and in the bundle absorb_latent_rotation returns, where kv_b_proj holds the latent rotation
LATENT_ABSORBED = "latent_rotation_absorbed"
# updates of at most this many tokens (decode and verify steps) over a quantized history attend the latent absorbed
ABSORBED_QUERY_TOKENS = 16


class LatentKV:
    """What a latent layer's ``update`` hands on in place of the latent ``[B, 1, T, r]`` for a decode step over a
    quantized history: the layer. The MLA attention's ``expand_kv`` passes it through (:func:`absorb_expand_kv`,
    installed by ``oscar_hf.enable``), and the attention function calls :meth:`attend`, which reads the latent as
    stored instead of expanding it through ``kv_b_proj``. Anything else that reads it as a tensor (an attention
    module left unpatched) gets the dense latent, as ``update`` returns it otherwise."""

    __slots__ = ("layer",)

    def __init__(self, layer: "LatentOscarLayer"):
        self.layer = layer

    def attend(self, module, query, rope, attention_mask, scaling, **kwargs):
        """The attention function's call: ``(output [B, q, H, d_v], None)``."""
        return self.layer.attend_absorbed(module, query, rope, attention_mask, scaling), None

    def dense(self) -> torch.Tensor:
        """The latent sequence in the model's basis and dtype."""
        return self.layer.materialize()

    @property
    def shape(self) -> torch.Size:
        sink = self.layer.windows["sink"]["latent"]
        return torch.Size((sink.shape[0], sink.shape[1], self.layer.length, sink.shape[-1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.dtype

    @property
    def device(self) -> torch.device:
        return self.layer.device

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(LatentKV, LatentKV.dense, (args, kwargs or {}))
        return func(*args, **kwargs)


def absorbs(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an MLA attention whose decode steps can attend the latent absorbed: an ``expand_kv``
    and a dense floating-point ``kv_b_proj`` weight."""
    weight = getattr(getattr(module, "kv_b_proj", None), "weight", None)
    return (callable(getattr(module, "expand_kv", None)) and isinstance(weight, torch.Tensor)
            and weight.is_floating_point() and weight.dim() == 2 and hasattr(module, "qk_nope_head_dim"))


def absorb_expand_kv(module: torch.nn.Module) -> None:
    """Make ``module.expand_kv`` (an MLA attention's, :func:`absorbs`) pass a :class:`LatentKV` through to the attention
    function, and expand everything else as its class does. A method bound to the module, so that a copy of the
    model expands with its own weights. Idempotent."""
    if getattr(module.__dict__.get("expand_kv"), "__func__", None) is not _expand_kv:
        module.expand_kv = MethodType(_expand_kv, module)


def _expand_kv(self, kv_nope, k_rot):
    if isinstance(kv_nope, LatentKV):
        return kv_nope, k_rot
    return type(self).expand_kv(self, kv_nope, k_rot)


class LatentOscarLayer(OscarLayer):
    """A multi-head latent attention layer's storage: the compressed latent ``[B, 1, T, r]`` (what DeepSeek-V3 and its
    kin hand to ``update`` as K) as ``sink ‖ history ‖ recent``, the history rotated (``c @ R``), centered and
    quantized in the per-token K layout; the RoPE part of the key ``[B, 1, T, rope]`` (handed as V) kept in the model
    dtype for every token, since 2-bit RoPE keys wreck attention. ``update`` returns both whole and dense, the history
    dequantized and rotated back, for the model to expand through ``kv_b_proj`` (its attention then runs on plain
    tensors): a dequantize path, no fused kernel. Host-side updates only.

    ``absorbed``: the rotation is folded into ``kv_b_proj`` (:func:`oscar_hf.absorb_latent_rotation`), so ``update``
    returns the latent in the rotated basis: the windows rotated (a few hundred rows), the history as stored."""

    def __init__(self, config: OscarConfig, rotation: torch.Tensor, absorbed: bool = False):
        super().__init__(config, 3)  # sink, history, recent
        self.latent_rotation = rotation.detach().clone()  # [r, r]
        self.rotates = not is_identity(rotation)
        self.absorbed = absorbed

    def lazy_initialization(self, latent: torch.Tensor, rope: torch.Tensor) -> None:
        batch, heads, _, dim = latent.shape
        if self.latent_rotation.shape != (dim, dim):
            raise ValueError(f"a latent rotation {tuple(self.latent_rotation.shape)} does not fit a latent of {dim} "
                             "channels")
        self.dtype, self.device = latent.dtype, latent.device
        cfg = self.config
        self.group_size = cfg.resolved_group_size(dim)
        self.latent_rotation = self.latent_rotation.to(self.device, torch.float32)
        # what materialize applies in the model dtype: R to the windows (absorbed), else Rᵀ to the history
        rotation = self.latent_rotation if self.absorbed else self.latent_rotation.mT
        self.rotation_mt = rotation.to(self.dtype).contiguous()
        self.dequantize = dequantize_backend(cfg.backend, self.device)

        def empty(*tail: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(batch, heads, 0, *tail, dtype=dtype, device=self.device)

        self.windows = {name: Segment({"latent": empty(dim, dtype=self.dtype)}) for name in ("sink", "recent")}
        bits, groups = cfg.side_bits["key"], dim // self.group_size
        self.history = Segment({"codes": empty(dim * bits // 8, dtype=torch.uint8),
                                "scale": empty(groups, dtype=cfg.meta_dtypes[0]),
                                "zero": empty(groups * cfg.grid.stores_zero, dtype=cfg.meta_dtypes[1])})
        self.center = Segment({"latent": torch.zeros(batch, heads, 1, dim, device=self.device)})
        self.rope = Segment({"rope": empty(rope.shape[-1], dtype=rope.dtype)})
        self.is_initialized = True

    def update(self, latent: torch.Tensor, rope: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``latent [B, 1, n, r]`` and ``rope [B, 1, n, rope]``; return the whole sequence of each: the latent
        dense, or for a step of at most :data:`ABSORBED_QUERY_TOKENS` tokens over a quantized history a
        :class:`LatentKV` that attends it absorbed."""
        if not self.is_initialized:
            self.lazy_initialization(latent, rope)
        total = self.length + latent.shape[2]
        self.rope.grow_history(self.length, total)
        self.rope.write(self.length, {"rope": rope})
        self._append(latent)
        rope = self.rope["rope"][:, :, :total]
        if latent.shape[2] <= ABSORBED_QUERY_TOKENS and self.n_history:
            return LatentKV(self), rope
        return self.materialize(), rope

    def attend_absorbed(self, module: torch.nn.Module, query: torch.Tensor, rope: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of ``query [B, H, q, d_nope + d_rope]`` over the stored latent, absorbed
        (:func:`oscar_hf.kernels.latent.reference.absorbed_attention`) in the history's basis: the windows rotated
        into it (a few hundred rows), the history as dequantized, the rotation taken into the queries and out of the
        output where ``kv_b_proj`` does not hold it. Returns ``[B, q, H, d_v]``."""
        basis = self.rotation_mt.mT if self.rotates and not self.absorbed else None  # R, model dtype
        return absorbed_attention(query, rope, self.materialize(stored_basis=True), module.kv_b_proj.weight,
                                  nope_dim=module.qk_nope_head_dim, attention_mask=attention_mask, scaling=scaling,
                                  basis=basis)

    def _append(self, latent: torch.Tensor) -> None:
        cfg, sink, recent = self.config, self.windows["sink"], self.windows["recent"]
        to_sink = min(cfg.sink_tokens - self.n_sink, latent.shape[2])
        if to_sink:
            sink.grow_window(self.n_sink, self.n_sink + to_sink, cfg.sink_tokens)
            sink.write(self.n_sink, {"latent": latent[:, :, :to_sink]})
            self.n_sink += to_sink
        rest, limit = latent[:, :, to_sink:], cfg.recent_tokens + cfg.flush_tokens - 1
        if self.n_recent + rest.shape[2] <= limit:  # no demotion (most decode steps): append in place
            recent.grow_window(self.n_recent, self.n_recent + rest.shape[2], limit)
            recent.write(self.n_recent, {"latent": rest})
            self.n_recent += rest.shape[2]
            return
        window = torch.cat([recent["latent"][:, :, :self.n_recent], rest], dim=2)
        demoted = (window.shape[2] - cfg.recent_tokens) // cfg.flush_tokens * cfg.flush_tokens
        self._quantize_into_history(window[:, :, :demoted])
        self.n_recent = window.shape[2] - demoted
        recent.grow_window(0, self.n_recent, limit)
        recent.write(0, {"latent": window[:, :, demoted:]})

    def _quantize_into_history(self, rows: torch.Tensor) -> None:
        cfg = self.config
        rows = rows.float() @ self.latent_rotation if self.rotates else rows.float()
        center = self.center["latent"]
        if not self.n_history and cfg.centering:
            center.copy_(rows.mean(dim=2, keepdim=True))
        quantized = cfg.key_layout.quantize(rows - center, bits=cfg.side_bits["key"], clip=cfg.side_clip["key"],
                                            group_size=self.group_size, config=cfg)  # the per-token K layout
        self.history.grow_history(self.n_history, self.n_history + rows.shape[2])
        self.history.write(self.n_history, quantized._asdict())
        self.n_history += rows.shape[2]

    def materialize(self, stored_basis: bool = False) -> torch.Tensor:
        """The latent sequence ``[B, 1, T, r]`` in the model dtype, in the basis ``kv_b_proj`` reads: the windows as
        stored; the history dequantized with its center added (the dequantize kernel on CUDA, its twin elsewhere) and
        rotated back, both in the model dtype. (The rotation back is a ``[T, r] × [r, r]`` product every step: in
        fp32 it would cost more than the model's own expansion of the latent through ``kv_b_proj``.) Absorbed, or
        with ``stored_basis``: in the history's basis, the windows rotated instead, the history as dequantized."""
        out = torch.empty(*self.center["latent"].shape[:2], self.length, self.latent_rotation.shape[0],
                          dtype=self.dtype, device=self.device)
        n_sink, n_history, n_recent = self.counts
        out[:, :, :n_sink] = self.windows["sink"]["latent"][:, :, :n_sink]
        history = out[:, :, n_sink:n_sink + n_history]
        stored = self.history.read(n_history)
        center = self.center["latent"] if self.config.centering else None
        self.dequantize(QuantizedRows(stored["codes"], stored["scale"], stored["zero"]), center, history,
                        bits=self.config.side_bits["key"])
        out[:, :, n_sink + n_history:] = self.windows["recent"]["latent"][:, :, :n_recent]
        if self.rotates and (self.absorbed or stored_basis):
            rotation = self.rotation_mt if self.absorbed else self.rotation_mt.mT  # R either way
            for window in (out[:, :, :n_sink], out[:, :, n_sink + n_history:]):
                window.copy_(window @ rotation)
        elif self.rotates and n_history:
            history.copy_(history @ self.rotation_mt)
        return out

    # ------------------------------------------------------------------ cache bookkeeping API
    def _segments(self) -> tuple[Segment, ...]:
        return (*self.windows.values(), self.history, self.rope, self.center) if self.is_initialized else ()

    def reset(self) -> None:
        self._counts = [0, 0, 0]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (from the recent window, then the history, then the sink: the
        history's dropped tokens cannot return to the window, so a crop past it keeps its quantized ones)."""
        if int(tokens_to_remove) > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove; got {int(tokens_to_remove)}")
        remove = min(-int(tokens_to_remove), self.length)
        for i in (2, 1, 0):
            taken = min(remove, self._counts[i])
            self._counts[i] -= taken
            remove -= taken

    def _fixed_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.latent_rotation, self.rotation_mt) if self.rotates else ()

    def _used_bytes(self, history_only: bool) -> int:
        center = self.center.used_bytes(1) if self.n_history and self.config.centering else 0
        history = self.history.used_bytes(self.n_history) + self.rope.used_bytes(self.n_history) + center
        if history_only:
            return history
        windows = self.windows["sink"].used_bytes(self.n_sink) + self.windows["recent"].used_bytes(self.n_recent)
        return windows + history + self.rope.used_bytes(self.length) - self.rope.used_bytes(self.n_history)

    def _elements_per_token(self) -> int:
        b, h, _, r = self.windows["sink"]["latent"].shape
        return b * h * (r + self.rope["rope"].shape[-1])
