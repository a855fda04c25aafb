"""Left-padded batches: each row stored as that row alone would be.

``generate`` left-pads a batch of prompts of unequal lengths, so a row's first tokens sit after its pads. Stored as
given, the pads would fill the sink and push the row's own first tokens into the 2-bit history, and they would join
the history's mean. A layer that meets a padded prompt stores each row as ``own first tokens (≤ sink) ‖ pads ‖ the
rest``, so that the sink, the history and the recent window hold what they hold for the row alone (the pads, masked
out, sit at the history's front); the pads themselves are stored as the mean of the row's own tokens, and the
history's mean counts only real tokens. Attention masks, in the model's token order, are read in that order.
"""

from __future__ import annotations

import torch


class LeftPadding:
    """Where a padded prompt's pads sit: in batch row ``b``, the stored tokens ``[start[b], start[b] + pads[b])``.

    ``start`` and ``pads`` are int64 ``[B]`` on the storage's device. Stored position ``j < start + pads`` holds the
    prompt's token ``(j + pads) mod (start + pads)``; later positions hold their own token.
    """

    def __init__(self, start: torch.Tensor, pads: torch.Tensor):
        self.start, self.pads = start, pads
        self._index: torch.Tensor | None = None  # index(T) of a static cache's masks, [B, T]

    @classmethod
    def of_prompt(cls, mask: torch.Tensor | None, tokens: int, sink_tokens: int) -> "LeftPadding | None":
        """The padding of a prompt of ``tokens`` tokens from its bool attention mask ``[B, 1, q, >= tokens]`` (True =
        attend): the keys no query can see, where they lead every row (left padding). None where no row is padded,
        or where the masked keys are not a prefix (another kind of mask: stored as given)."""
        if mask is None or mask.dtype != torch.bool or mask.shape[-1] < tokens:
            return None
        hidden = ~mask[:, 0, :, :tokens].any(dim=1)
        pads = hidden.long().cumprod(-1).sum(-1)
        if not pads.any() or not torch.equal(pads, hidden.sum(-1)) or (pads >= tokens).any():
            return None
        return cls((tokens - pads).clamp(max=sink_tokens), pads)

    def index(self, tokens: int) -> torch.Tensor:
        """``[B, tokens]``: the model's position of each stored position."""
        j = torch.arange(tokens, device=self.pads.device)
        span = (self.start + self.pads)[:, None]
        return torch.where(j < span, (j + self.pads[:, None]) % span.clamp(min=1), j)

    def is_pad(self, start: int, tokens: int) -> torch.Tensor:
        """bool ``[B, tokens]``: which of the stored positions ``[start, start + tokens)`` are pads."""
        j = torch.arange(start, start + tokens, device=self.pads.device)
        return (j >= self.start[:, None]) & (j < (self.start + self.pads)[:, None])

    def store_order(self, x: torch.Tensor) -> torch.Tensor:
        """A padded prompt's K or V ``[B, H, n, D]`` in the stored order, its pads replaced by the mean of the row's
        own tokens (so that a mean or a scale over stored rows is not pulled by them)."""
        b, h, n, d = x.shape
        own = (torch.arange(n, device=x.device) >= self.pads[:, None]).float()[:, None, :, None]  # pads lead
        mean = (x.float() * own).sum(2, keepdim=True) / own.sum(2, keepdim=True).clamp(min=1)
        stored = x.gather(2, self.index(n)[:, None, :, None].expand(b, h, n, d))
        return torch.where(self.is_pad(0, n)[:, None, :, None], mean.to(x.dtype), stored)

    def mean(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        """fp32 ``[B, H, 1, D]``: the mean of stored rows ``[B, H, n, D]`` at positions ``start ...`` over the real
        tokens only (every row where a batch row has none)."""
        own = (~self.is_pad(start, rows.shape[2])).float()[:, None, :, None]
        own = torch.where(own.sum(2, keepdim=True) > 0, own, torch.ones_like(own))
        return (rows.float() * own).sum(2, keepdim=True) / own.sum(2, keepdim=True)

    def index_masks_of(self, tokens: int) -> None:
        """Keep :meth:`index` of masks of ``tokens`` keys (a static cache's), so that reading one computes nothing."""
        self._index = self.index(tokens)

    def mask(self, mask: torch.Tensor) -> torch.Tensor:
        """An attention mask ``[B, 1, q, T]`` in the model's order, read in the stored order."""
        tokens = mask.shape[-1]
        index = self._index if self._index is not None and self._index.shape[-1] == tokens else self.index(tokens)
        return mask.gather(-1, index[:, None, None, :].expand(mask.shape))

    def map(self, fn) -> None:
        """Apply a batch reordering ``fn`` (beam search, batch selection) to the rows."""
        self.start, self.pads = fn(self.start), fn(self.pads)
        if self._index is not None:
            self.index_masks_of(self._index.shape[-1])
