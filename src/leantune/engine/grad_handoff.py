"""The e4m3 codes of a fused layer's input gradient, handed to the layer below.

On an FP8 base whose input-gradient GEMMs run on cuBLAS (which reads e4m3 codes), a layer's
input gradient dx [N, H] is the next dX GEMM's input in the layer below: its down projection's
(dX = d out W_down). The RMSNorm backward that writes dx can write its codes too
(kernels/rmsnorm.rms_norm_bwd `quant`), sparing that GEMM a quantisation pass over dx. dx reaches
the layer below through autograd, so the codes go beside it: the layer above `give`s (dx, its
kernels/fp8_quant.QuantizedRows), the layer below `take`s them for the gradient autograd hands
it, and gets them only where that gradient is dx itself, unchanged:

- the same memory, shape and strides (dx is held here until taken, so its memory cannot have
  been handed to another tensor meanwhile), and
- the same version counter (nothing wrote into it in between).

Anything else (a hook or another consumer that made a new gradient tensor, a layer of another
kind between) gets None, and its GEMM quantises as before. One carrier at a time: `give` and
`take` drop the previous one, and every layer's forward `clear`s it, so at most one [N, H]
gradient and its codes are held past their use.
"""

from __future__ import annotations

import torch

from ..kernels.fp8_quant import QuantizedRows


class GradHandoff:
    """One fused layer's input gradient and its codes, for the layer below (module docstring);
    shared by the executors of one Engine."""

    def __init__(self):
        self._held: tuple[torch.Tensor, int, QuantizedRows] | None = None

    def give(self, dx: torch.Tensor, q: QuantizedRows) -> None:
        """Hold dx [N, H] (as returned to autograd, or a view of it) and its carrier q."""
        self._held = (dx, dx._version, q)

    def take(self, dout: torch.Tensor) -> QuantizedRows | None:
        """The held carrier, as dout's, where dout [N, H] is the held gradient unchanged; else
        None. Either way nothing is held after."""
        held, self._held = self._held, None
        if held is None:
            return None
        dx, version, q = held
        if (dout.device != dx.device or dout.data_ptr() != dx.data_ptr()
                or dout.shape != q.x.shape or dout.stride() != q.x.stride()
                or dout._version != version):
            return None
        return q.of(dout)

    def clear(self) -> None:
        self._held = None

    @property
    def holding(self) -> bool:
        return self._held is not None


__all__ = ["GradHandoff"]
