"""cuflash: exact attention (FlashAttention-2) as CUDA C++ compiled at run time by CuPy.

    o = cuflash.attention(q, k, v, causal=False, scale=None, layout="bshd")
    o, lse = cuflash.attention_forward(q, k, v, ...)
    o, lse = cuflash.attention_forward_fp8(q, k, v, q_descale=..., ...)  # e4m3 inputs, sm_90
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, ...)
    o, lse = cuflash.attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)  # packed
    o, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, ...)  # decoding
    o, lse = cuflash.combine(o_partials, lse_partials)  # merge results over disjoint key sets

Inputs are any DLPack arrays (NumPy, CuPy, PyTorch, JAX); results come back in the caller's
library. ``cuflash.reference`` is the float64 NumPy reference the kernels are tested against.
CuPy is imported only when a CUDA array arrives, so the CPU backend needs NumPy alone.
"""

from . import reference
from .api import (
    attention,
    attention_backward,
    attention_forward,
    attention_forward_fp8,
    attention_varlen,
    attention_varlen_backward,
    attention_varlen_forward,
    attention_with_kvcache,
    combine,
)

__version__ = "0.1.0"
__all__ = [
    "attention",
    "attention_forward",
    "attention_forward_fp8",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_forward",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "combine",
    "reference",
    "__version__",
]
