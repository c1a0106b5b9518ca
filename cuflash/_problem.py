"""The description of one validated attention call: sizes, dtype, layout, mask, scale, device.

Everything downstream (the dispatch, the plans, the CPU backend) reads the call from here; the
arrays themselves travel beside it as ArrayInfo (cuflash/_interop.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _mask

FP8_DTYPE = "float8_e4m3fn"  # the FP8 forward's inputs (cuflash/_kernels.py names it too)


@dataclass(frozen=True)
class Problem:
    """The validated shape of one attention call."""

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str
    layout: str  # "bshd" or "bhsd" ("bshd" for 2-D input)
    two_d: bool
    window: tuple[int | None, int | None]  # (left, right) around the bottom-right diagonal
    scale: float
    device: tuple[str, int]
    library: str
    softcap: float | None = None  # S = softcap * tanh(S / softcap)
    alibi: bool = False  # ALiBi slopes come with the call (their array travels beside it)
    # Packed variable-length sequences (attention_varlen_*): q (total_q, Hq, d), k and v
    # (total_k, Hkv, d), lse (Hq, total_q); `batch` sequences given by cu_seqlens offsets, seq_q and
    # seq_k the longest sequence's rows and keys (max_seqlen_q, max_seqlen_k).
    packed: bool = False
    total_q: int = 0
    total_k: int = 0

    @property
    def mask(self) -> _mask.Mask:
        """Who sees whom (cuflash/_mask.py, the host's mirror of kernels_cu/mask.cuh)."""
        return _mask.Mask.of(self.seq_q, self.seq_k, self.window)

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads_q // self.heads_kv if self.heads_kv else 1

    @property
    def lse_dtype(self) -> str:
        """float32, or float64 for float64 inputs (the exact path keeps full precision)."""
        return "float64" if self.dtype == "float64" else "float32"

    def shape(self, seq: int, heads: int) -> tuple[int, ...]:
        if self.two_d:
            return (seq, self.head_dim)
        if self.layout == "bshd":
            return (self.batch, seq, heads, self.head_dim)
        return (self.batch, heads, seq, self.head_dim)

    def extent(self, tensor: str) -> tuple[int, int]:
        """(rows, heads) of a tensor of the call: q, o, dout and dq have the query rows and heads,
        k, v, dk and dv the keys and key/value heads."""
        if tensor in ("k", "v", "dk", "dv"):
            return self.seq_k, self.heads_kv
        return self.seq_q, self.heads_q

    def map_shape(self, tensor: str) -> tuple[int, int, int, int]:
        """(d, rows, heads, batch) of a q/k/v-shaped tensor as a TMA map covers it (_tma.py):
        packed, the whole packed tensor as one sequence (the kernels add each sequence's first
        row to the map's row coordinate); "vt", the FP8 forward's V^T (keys_padded)."""
        if tensor == "vt":  # the FP8 forward's V^T: (keys, d, heads, batch), keys innermost
            return (self.keys_padded, self.head_dim, self.heads_kv, self.batch)
        rows, heads = self.extent(tensor)
        if self.packed:
            total = self.total_k if tensor in ("k", "v", "dk", "dv") else self.total_q
            return (self.head_dim, total, heads, 1)
        return (self.head_dim, rows, heads, self.batch)

    @property
    def out_dtype(self) -> str:
        """O's dtype: q's, or bfloat16 for the FP8 forward's float8_e4m3fn inputs."""
        return "bfloat16" if self.dtype == FP8_DTYPE else self.dtype

    @property
    def keys_padded(self) -> int:
        """The FP8 forward's keys of V^T (kernels_cu/fp8_transpose.cu): seq_k rounded up to 16."""
        return -(-self.seq_k // 16) * 16

    @property
    def q_shape(self) -> tuple[int, ...]:
        if self.packed:
            return (self.total_q, self.heads_q, self.head_dim)
        return self.shape(self.seq_q, self.heads_q)

    @property
    def kv_shape(self) -> tuple[int, ...]:
        if self.packed:
            return (self.total_k, self.heads_kv, self.head_dim)
        return self.shape(self.seq_k, self.heads_kv)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        if self.packed:
            return (self.heads_q, self.total_q)
        return (self.seq_q,) if self.two_d else (self.batch, self.heads_q, self.seq_q)

    @property
    def rows_q(self) -> int:
        """Query rows of every head: B * Hq * Nq (packed: Hq * total_q)."""
        if self.packed:
            return self.heads_q * self.total_q
        return self.batch * self.heads_q * self.seq_q

    @property
    def has_work(self) -> bool:
        """Whether a kernel has anything to compute (some query row and some key)."""
        if self.packed:
            keys = self.heads_kv * self.total_k * self.seq_k
            return self.batch * self.rows_q * self.seq_q > 0 and keys > 0
        return self.rows_q > 0 and self.batch * self.heads_kv * self.seq_k > 0

    def bhs_strides(self, strides: tuple[int, ...]) -> tuple[int, int, int]:
        """(batch, head, sequence) strides of a q/k/v-shaped array in this problem's layout
        (packed: no batch stride; the kernels find each sequence's rows by its offsets)."""
        if self.packed:
            return (0, strides[1], strides[0])
        if self.two_d:
            return (0, 0, strides[0])
        if self.layout == "bshd":
            return (strides[0], strides[2], strides[1])
        return (strides[0], strides[1], strides[2])

    def lse_strides(self, strides: tuple[int, ...]) -> tuple[int, int, int]:
        """(batch, head, row) strides of an lse-shaped array."""
        if self.packed:  # (Hq, total_q)
            return (0, strides[0], strides[1])
        return (0, 0, strides[0]) if self.two_d else (strides[0], strides[1], strides[2])
