"""A static, preallocated key/value cache with a length per batch row."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values: per layer, one tensor ``[batch, kv_heads, max_len, head_dim]`` each.

    One tensor per layer rather than one for all: a compiled forward then writes into its
    inputs in place; writing into a view of one big input made torch.compile copy the whole
    cache per write (20x slower steps).

    Rows are independent sequences. A row's K/V for position ``p`` lives at index ``p``;
    ``lengths[row]`` says how many positions are valid. Attention masks by position
    (a query at ``p`` sees keys ``<= p``), so entries past a row's length are never read
    before they are overwritten: rolling back is just lowering the length, O(1).
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len
        self.lengths = [0] * batch

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def truncate(self, row: int, length: int) -> None:
        """Roll row ``row`` back to its first ``length`` positions."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot truncate row {row} of length {self.lengths[row]} to {length}")
        self.lengths[row] = length

    def reset(self, row: int) -> None:
        self.lengths[row] = 0

    def copy(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy row ``src``'s positions ``start..end - 1`` into row ``dst``, which then holds ``end`` positions
        (``dst`` must hold ``start`` already: K/V of the same tokens at the same positions)."""
        if not (start <= self.lengths[dst] and end <= self.lengths[src]):
            raise ValueError(f"cannot copy positions {start}..{end} of row {src} (length {self.lengths[src]}) "
                             f"to row {dst} (length {self.lengths[dst]})")
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, start:end] = k[src, :, start:end]
            v[dst, :, start:end] = v[src, :, start:end]
        self.lengths[dst] = end

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)
