"""One TMA store of a 64 x 64 tile of 16-bit elements, in isolation (NOTES v9): which boxes the
hardware accepts for the forward's O store. Each variant runs in a child process (a fault ends
the child, not the probe) and prints ok / WRONG / FAULT:

- plain, global, ws: a whole box; the map as a kernel parameter, in global memory, or issued by
  the first thread of a consumer warpgroup after setmaxnreg (the forward's structure);
- d40: a box wider than the tensor's last dimension (columns past d);
- row0_neg, rows_past_end, row0_at_end: boxes that reach before row 0 or past the last row, or
  start at it (which the loads of the forward use freely);
- fwd, fwd_registers: the library's forward (d = 64, 128, 256, causal or not, end-aligned row
  blocks) against SDPA, with O through TMA stores where a warpgroup's rows all exist, or from
  registers.

    python bench/tma_store_probe.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = (
    "plain",
    "global",
    "ws",
    "d40",
    "row0_neg",
    "rows_past_end",
    "row0_at_end",
    "fwd_registers",
    "fwd",
)

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(384, 1)
store_tile(const __grid_constant__ cuflash::TensorMap tm, const cuflash::TensorMap* tm_global,
           int use_global, int ws, int row0) {
  using namespace cuflash;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* tile = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const int t = threadIdx.x;
  if (ws) {
    if (t < 128) { warpgroup_release_registers<24>(); return; }
    warpgroup_claim_registers<240>();
    if (t >= 256) return;  // the second consumer warpgroup: registers claimed, nothing to do
  }
  const int c0 = ws ? 128 : 0;  // the issuing thread, first of its warpgroup
  // fill: element (r, c) = r * 64 + c, 16-byte chunks swizzled (chunk k of row r at k ^ (r % 8))
  for (int i = t - c0; i < 64 * 8; i += 128) {
    const int r = i / 8, k = i % 8;
    unsigned short* dst = reinterpret_cast<unsigned short*>(tile + r * 128 + ((k ^ (r & 7)) << 4));
    for (int e = 0; e < 8; ++e) dst[e] = static_cast<unsigned short>(r * 64 + k * 8 + e);
  }
  fence_proxy_async_shared();
  if (ws) warpgroup_sync(8); else __syncthreads();
  if (t == c0) {
    tma_store_4d(use_global ? tm_global : &tm, tile, 0, row0, 0, 0);
    bulk_commit();
    bulk_wait<0>();
  }
}
"""


def forward_child(variant: str) -> int:
    """The library's forward (d = 64, 128, 256, causal or not) against SDPA, O written through
    TMA stores where it may be or from registers."""
    import torch
    import torch.nn.functional as F

    import cuflash
    from cuflash import _kernels

    _kernels.set_tma_store(variant != "fwd_registers")
    ok = True
    for d in (64, 128, 256):
        for causal in (False, True):
            gen = torch.Generator(device="cuda").manual_seed(d)
            q, k, v = (
                torch.randn(2, 333, 4, d, generator=gen, device="cuda", dtype=torch.bfloat16)
                for _ in range(3)
            )
            o, _ = cuflash.attention_forward(q, k, v, causal=causal)
            torch.cuda.synchronize()
            ref = F.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal
            ).transpose(1, 2)
            err = (o.float() - ref.float()).abs().max().item()
            ok &= err < 2e-2
            print(f"tma store {variant}: d={d} causal={causal} max err {err:.3g}", flush=True)
    print(f"tma store {variant}: {'ok' if ok else 'WRONG'} (completed)", flush=True)
    return 0 if ok else 1


def child(variant: str) -> int:
    if variant.startswith("fwd"):
        return forward_child(variant)
    import cupy as cp
    import numpy as np

    from cuflash import _kernels, _tma

    d = 40 if variant == "d40" else 64
    rows = 64
    row0 = {"row0_neg": -8, "rows_past_end": 32, "row0_at_end": 64}.get(variant, 0)
    out = cp.full((1, rows, 1, d), 0xFFFF, dtype=cp.uint16)
    shape = (d, rows, 1, 1)
    strides = _tma.tma_strides(shape, (d, rows * d, rows * d), 2)
    tile_map = _tma.TileMap(shape, strides, 64, out.data.ptr)
    blob = np.frombuffer(tile_map.bytes_for(out.data.ptr), dtype=np.uint8)
    map_global = cp.asarray(blob)
    from cuflash import _cuda

    src = _kernels.expanded_source("tma.cuh") + SOURCE
    options = _kernels.COMPILE_OPTIONS + ("-arch=sm_90a",)
    kernel = cp.RawModule(code=src, options=options).get_function("store_tile")
    kernel.max_dynamic_shared_size_bytes = 64 * 128 + 1024
    ws = variant == "ws"
    spec = SimpleNamespace(threads=384 if ws else 128, smem_bytes=64 * 128 + 1024)
    loaded = SimpleNamespace(ptr=kernel.kernel.ptr, spec=spec)
    stream = cp.cuda.get_current_stream().ptr
    args = (bytes(blob), map_global.data.ptr, int(variant == "global"), int(ws), row0)
    _cuda._launch(loaded, 1, 0, stream, "128sQiii", args)
    cp.cuda.runtime.deviceSynchronize()
    got = out.get()[0, :, 0, :].astype(np.int64)
    r = np.arange(rows)[:, None]
    c = np.arange(d)[None, :]
    want = np.where((r - row0 >= 0) & (r - row0 < 64), (r - row0) * 64 + c, 0xFFFF)
    ok = np.array_equal(got, want)
    print(f"tma store {variant}: {'ok' if ok else 'WRONG'}", flush=True)
    if not ok:
        print(got[:3, :10], want[:3, :10])
    return 0 if ok else 1


def main() -> int:
    if len(sys.argv) > 1:
        try:
            return child(sys.argv[1])
        except Exception as exc:  # a CUDA error (the fault) surfaces as an exception
            print(f"tma store {sys.argv[1]}: FAULT {type(exc).__name__}: {str(exc)[:160]}")
            return 2
    for v in VARIANTS:
        proc = subprocess.run(
            [sys.executable, __file__, v], capture_output=True, text=True, timeout=120
        )
        out = proc.stdout.strip()
        if proc.returncode not in (0, 1, 2) or not out:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
            out += f"\ntma store {v}: FAULT (exit {proc.returncode}) {tail[0][:160]}"
        print(out.strip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
