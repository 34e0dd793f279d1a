"""A forward input as a spec: built as a tensor, and written as the Python source that builds it (the draft)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Sizes of the probed inputs.
BATCH = 2
TEXT = 4
SIDE = 8  # latent height and width
FRAMES = 2
SEQ = 8


@dataclass(frozen=True)
class TensorInput:
    """A tensor input, as built and as Python source: ``randn``/``zeros``/``ones`` of ``shape``, ``full`` of
    ``shape`` with ``values[0]``, ``randint(high)`` or a fixed ``tensor`` of ``values`` (laid out in ``shape``
    where one is given: a mask of text and image slots); ``dtype`` for ``zeros``, ``ones`` and ``tensor``."""

    kind: str
    shape: tuple[int, ...] = ()
    high: int = 0
    values: tuple[float, ...] = ()
    dtype: str | None = None

    def build(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype) if self.dtype else None
        if self.kind == "randn":
            return torch.randn(*self.shape)
        if self.kind in ("zeros", "ones"):
            return getattr(torch, self.kind)(*self.shape, dtype=dtype)
        if self.kind == "full":
            return torch.full(self.shape, self.values[0])
        if self.kind == "randint":
            return torch.randint(0, self.high, self.shape)
        values = torch.tensor(list(self.values), dtype=dtype)
        return values.reshape(self.shape) if self.shape else values

    def source(self) -> str:
        shape = ", ".join(map(str, self.shape))
        dtype = f", dtype=torch.{self.dtype}" if self.dtype else ""
        if self.kind == "randn":
            return f"torch.randn({shape})"
        if self.kind in ("zeros", "ones"):
            return f"torch.{self.kind}({shape}{dtype})"
        if self.kind == "full":
            return f"torch.full(({shape}{',' if len(self.shape) == 1 else ''}), {self.values[0]!r})"
        if self.kind == "randint":
            return f"torch.randint(0, {self.high}, ({shape}{',' if len(self.shape) == 1 else ''}))"
        values = ", ".join(repr(v) for v in self.values)
        layout = f".reshape({shape}{',' if len(self.shape) == 1 else ''})" if self.shape else ""
        return f"torch.tensor([{values}]{dtype}){layout}"
