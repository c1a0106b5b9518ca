// fp8_transpose.cu: V^T for the FP8 forward (forward_sm90_tma.cu with e4m3 elements).
//
// 8-bit wgmma reads its shared-memory B operand only K-major, so O += P V needs V with the keys
// contiguous: each (batch, key/value head) of v (rows of d bytes) becomes d rows of keys_pad bytes
// (keys rounded up to 16, the padding zero), in a buffer (batch, heads_kv, d, keys_pad) that the
// forward reads through a tensor map. The keys of every 16 are written in the order of P's A
// fragments (forward_sm90.cuh, to_a_fragments): position 4t + i holds key
// 2t + (i & 1) + 8 (i >> 1), so that the forward packs its probabilities with no shuffle. One
// pass over V, in and out: 27-35 us for 32 MB on the H100 (2.3 TB/s), 3-5% of an FP8 forward
// call at N = 4k and about 1% at 16k (docs/perf/NOTES.md, v27 and v28; FlashAttention-3
// transposes inside its kernel).
//
// A block transposes KEYS keys of one head: 16-byte loads of whole key rows into shared memory
// (the host runs it where v's base and strides are 16-byte aligned and d is a multiple of 16),
// then each thread turns 16 keys x 4 rows of d into 4 rows of V^T: 16 four-byte shared loads
// (no bank conflict), a 4 x 4 byte transpose per 4 keys (byte_perm), 16-byte stores. (The first
// version read a byte per shared load, 4-way conflicted; docs/perf/NOTES.md, v28.)
#include "common.cuh"
#include "params.cuh"

namespace cuflash {

constexpr int TRANSPOSE_KEYS = 128, TRANSPOSE_THREADS = 256;

// Position p of a group of 16 keys holds key transposed_key(p).
__host__ __device__ constexpr int transposed_key(int p) {
  return 2 * (p >> 2) + (p & 1) + 8 * ((p >> 1) & 1);
}

// Rows r .. r + 3 of four keys (word b: key b's bytes r .. r + 3) -> keys 0 .. 3 of each row (word
// i: row r + i's bytes of keys 0 .. 3).
__device__ __forceinline__ void transpose_4x4_bytes(const unsigned (&in)[4], unsigned (&out)[4]) {
  const unsigned lo01 = __byte_perm(in[0], in[1], 0x5140), hi01 = __byte_perm(in[0], in[1], 0x7362);
  const unsigned lo23 = __byte_perm(in[2], in[3], 0x5140), hi23 = __byte_perm(in[2], in[3], 0x7362);
  out[0] = __byte_perm(lo01, lo23, 0x5410);
  out[1] = __byte_perm(lo01, lo23, 0x7632);
  out[2] = __byte_perm(hi01, hi23, 0x5410);
  out[3] = __byte_perm(hi01, hi23, 0x7632);
}

// Params: v (its strides: batch, head, row), o (V^T, contiguous: its row stride is keys_pad,
// head stride d keys_pad, batch stride heads_kv d keys_pad), seq_k, heads_kv, head_dim. A block
// per KEYS keys of every (batch, key/value head), heads of a batch adjacent.
template <int HD>
__global__ void __launch_bounds__(TRANSPOSE_THREADS)
    transpose_v_fp8(const __grid_constant__ Params p) {
  // Key `key`'s row in shared memory at key PITCH + 16 (key / 16): rows 16-byte aligned and
  // staggered, and each group of 16 keys 16 bytes further on, so that the 8 lanes that read the
  // same rows of 8 groups (below) hit 8 different bank quads.
  constexpr int PITCH = HD + 16;
  constexpr int GROUPS = TRANSPOSE_KEYS / 16;
  __shared__ __align__(16) unsigned char tile[TRANSPOSE_KEYS * PITCH + 16 * GROUPS];
  const int keys_pad = static_cast<int>(p.o.seq);
  const int key_blocks = ceil_div(keys_pad, TRANSPOSE_KEYS);
  const int bh = blockIdx.x / key_blocks, head = bh % p.heads_kv, batch = bh / p.heads_kv;
  const int n0 = (blockIdx.x - bh * key_blocks) * TRANSPOSE_KEYS;
  const int d = p.head_dim;
  const unsigned char* v = head_ptr<const unsigned char>(p.v, batch, head);
  // Every load of the thread issued before the first is stored. (Measured against a loop that
  // stored each load before issuing the next: no difference, 47-66 us either way while the stores
  // below were 16-byte pieces of 32 rows; kept, as the version the figures were taken with.)
  constexpr int CHUNKS = HD / 16, LOADS = TRANSPOSE_KEYS * CHUNKS / TRANSPOSE_THREADS;
  static_assert(TRANSPOSE_KEYS * CHUNKS % TRANSPOSE_THREADS == 0, "whole loads per thread");
  uint4 x[LOADS];
#pragma unroll
  for (int l = 0; l < LOADS; ++l) {
    const int idx = threadIdx.x + l * TRANSPOSE_THREADS, key = idx / CHUNKS, c = idx % CHUNKS;
    x[l] = make_uint4(0, 0, 0, 0);
    if (n0 + key < p.seq_k && 16 * c < d)
      x[l] = *reinterpret_cast<const uint4*>(v + static_cast<i64>(n0 + key) * p.v.seq + 16 * c);
  }
#pragma unroll
  for (int l = 0; l < LOADS; ++l) {
    const int idx = threadIdx.x + l * TRANSPOSE_THREADS, key = idx / CHUNKS, c = idx % CHUNKS;
    *reinterpret_cast<uint4*>(tile + key * PITCH + 16 * (key >> 4) + 16 * c) = x[l];
  }
  __syncthreads();
  // Rows r0 .. r0 + 3 of V^T, the 16 keys from n0 + 16 g: 16 bytes of each row. The 8 lanes of
  // one r0 write the block's 128 keys of each row (whole 128-byte lines; lanes on consecutive
  // rows, 16 bytes each, ran at 47-66 us for 32 MB at d = 128 and 256).
  unsigned char* vt = head_ptr<unsigned char>(p.o, batch, head);
  for (int idx = threadIdx.x; idx < (d / 4) * GROUPS; idx += TRANSPOSE_THREADS) {
    const int g = idx % GROUPS, r0 = 4 * (idx / GROUPS);
    if (n0 + 16 * g >= keys_pad) continue;
    const unsigned char* keys = tile + 16 * g * PITCH + 16 * g + r0;
    unsigned rows[4][4];  // [row within the quad][word: positions 4w .. 4w + 3]
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      unsigned in[4], out[4];
#pragma unroll
      for (int b = 0; b < 4; ++b)
        in[b] = *reinterpret_cast<const unsigned*>(keys + transposed_key(4 * w + b) * PITCH);
      transpose_4x4_bytes(in, out);
#pragma unroll
      for (int i = 0; i < 4; ++i) rows[i][w] = out[i];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
      *reinterpret_cast<uint4*>(vt + static_cast<i64>(r0 + i) * keys_pad + n0 + 16 * g) =
          make_uint4(rows[i][0], rows[i][1], rows[i][2], rows[i][3]);
  }
}

}  // namespace cuflash
