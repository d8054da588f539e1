"""Small @triton.jit helpers shared by the kernels."""

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (reference path only)
    triton = None

if triton is not None:

    @triton.jit
    def tanh(x):
        # 1 - 2 / (e^{2x} + 1); |x| clamped at 15, where tanh is +-1 in fp32 (no inf).
        x = tl.minimum(tl.maximum(x, -15.0), 15.0)
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
