// fp8_transpose.cu: V^T for the FP8 forward (forward_sm90_tma.cu with e4m3 elements).
//
// 8-bit wgmma reads its shared-memory B operand only K-major, so O += P V needs V with the keys
// contiguous: each (batch, key/value head) of v (rows of d bytes) becomes d rows of keys_pad bytes
// (keys rounded up to 16, the padding zero), in a buffer (batch, heads_kv, d, keys_pad) that the
// forward reads through a tensor map. The keys of every 16 are written in the order of P's A
// fragments (forward_sm90.cuh, to_a_fragments): position 4t + i holds key
// 2t + (i & 1) + 8 (i >> 1), so that the forward packs its probabilities with no shuffle. One
// pass over V, in and out: 33-53 us for 32 MB on the H100, 4-8% of an FP8 forward call at N = 4k
// and 1-4% at 16k (docs/perf/NOTES.md, v27; FlashAttention-3 transposes inside its kernel).
//
// A block transposes KEYS keys of one head: 16-byte loads of whole key rows into shared memory
// (the host runs it where v's base and strides are 16-byte aligned and d is a multiple of 16),
// then 16-byte stores of 16 permuted keys of one row of V^T each.
#include "common.cuh"
#include "params.cuh"

namespace cuflash {

constexpr int TRANSPOSE_KEYS = 64, TRANSPOSE_THREADS = 256;

// Position p of a group of 16 keys holds key transposed_key(p).
__device__ __forceinline__ int transposed_key(int p) {
  return 2 * (p >> 2) + (p & 1) + 8 * ((p >> 1) & 1);
}

// Params: v (its strides: batch, head, row), o (V^T, contiguous: its row stride is keys_pad,
// head stride d keys_pad, batch stride heads_kv d keys_pad), seq_k, heads_kv, head_dim. A block
// per KEYS keys of every (batch, key/value head), heads of a batch adjacent.
template <int HD>
__global__ void __launch_bounds__(TRANSPOSE_THREADS)
    transpose_v_fp8(const __grid_constant__ Params p) {
  constexpr int PITCH = HD + 16;  // bytes a key row in shared memory (16-byte aligned, staggered)
  __shared__ __align__(16) unsigned char tile[TRANSPOSE_KEYS * PITCH];
  const int keys_pad = static_cast<int>(p.o.seq);
  const int key_blocks = ceil_div(keys_pad, TRANSPOSE_KEYS);
  const int bh = blockIdx.x / key_blocks, head = bh % p.heads_kv, batch = bh / p.heads_kv;
  const int n0 = (blockIdx.x - bh * key_blocks) * TRANSPOSE_KEYS;
  const int d = p.head_dim, chunks = d / 16;
  const unsigned char* v = head_ptr<const unsigned char>(p.v, batch, head);
  for (int idx = threadIdx.x; idx < TRANSPOSE_KEYS * chunks; idx += TRANSPOSE_THREADS) {
    const int key = idx / chunks, c = idx - key * chunks;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (n0 + key < p.seq_k)
      x = *reinterpret_cast<const uint4*>(v + static_cast<i64>(n0 + key) * p.v.seq + 16 * c);
    *reinterpret_cast<uint4*>(tile + key * PITCH + 16 * c) = x;
  }
  __syncthreads();
  // Row `row` of V^T, 16 keys from n0 + 16 g: 16 bytes, one per thread.
  unsigned char* vt = head_ptr<unsigned char>(p.o, batch, head);
  for (int idx = threadIdx.x; idx < d * (TRANSPOSE_KEYS / 16); idx += TRANSPOSE_THREADS) {
    const int row = idx / (TRANSPOSE_KEYS / 16), g = idx - row * (TRANSPOSE_KEYS / 16);
    if (n0 + 16 * g >= keys_pad) continue;
    unsigned words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      unsigned word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b)
        word |= static_cast<unsigned>(tile[(16 * g + transposed_key(4 * w + b)) * PITCH + row])
                << (8 * b);
      words[w] = word;
    }
    *reinterpret_cast<uint4*>(vt + static_cast<i64>(row) * keys_pad + n0 + 16 * g) =
        make_uint4(words[0], words[1], words[2], words[3]);
  }
}

}  // namespace cuflash
