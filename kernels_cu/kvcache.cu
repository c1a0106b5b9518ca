// kvcache.cu: attention over a key/value cache (cuflash.attention_with_kvcache).
//
// Decoding reads a long cache for a few query rows per sequence: the work is bound by memory
// bandwidth, and one block per (sequence, head) would leave most multiprocessors idle. So:
//   kvcache_append      writes k_new / v_new into the cache rows after each sequence's cache_seqlens
//                       (through the block table when the cache is paged);
//   attention_decode    split-KV ("flash decoding"): a block owns one KV head of one sequence, the
//                       query rows of every query head of its group (the group packed into one
//                       16-row tile, so the cache is read once per KV head, not once per query head)
//                       and one split of the keys; its warps share the key tiles (each takes 16 keys
//                       of every tile, with its own online softmax) and merge at the end. One split:
//                       O and lse directly; several: float32 partials for
//   attention_decode_combine, which merges them with their lse, as cuflash.combine does.
// Longer query blocks (chunked prefill) and the exact dtypes take the packed forward kernels
// instead: kvcache_pack_offsets and kvcache_gather lay each sequence's keys out as a packed batch.
//
// Who sees whom is the one rule of mask.cuh, per sequence: nq = seq_q query positions against the
// sequence's nk keys in use (cache_seqlens + the appended rows), aligned bottom-right.
// Row r of a block's tile is query position r / group of query head kv_head * group + r % group.
#include "common.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "features.cuh"
#include "softmax.cuh"
#include "gemm.cuh"
#include "tma.cuh"

namespace cuflash {

// Where the rows of one sequence's cache live. Contiguous caches (no block table): row r of
// sequence b is row r of batch b. Paged: page block_table[b][r / page_size], slot r % page_size.
// A row outside the capacity or on a page index outside [0, num_pages) is in no page: it is read
// as zeros and never written, so untrusted lengths and tables cannot reach outside the cache.
struct CacheRows {
  const int* table;
  i64 table_stride;
  int page_size, num_pages, capacity;

  static __device__ __forceinline__ CacheRows of(const Params& p) {
    return CacheRows{p.block_table, p.block_table_stride, p.page_size, p.num_pages, p.seq_k};
  }
  // (page, slot) of row r of sequence b; false when the row is in no page.
  __device__ __forceinline__ bool locate(int b, i64 r, i64& page, i64& slot) const {
    if (r < 0 || r >= capacity) return false;
    page = b;
    slot = r;
    if (table != nullptr) {
      const int index = static_cast<int>(r / page_size);
      page = table[b * table_stride + index];
      slot = r - static_cast<i64>(index) * page_size;
      if (page < 0 || page >= num_pages) return false;
    }
    return true;
  }
  // Element offset of (row r of sequence b, head) in a cache tensor; -1 when the row is in no page.
  __device__ __forceinline__ i64 offset(const TensorRef& t, int b, i64 r, int head) const {
    i64 page, slot;
    if (!locate(b, r, page, slot)) return -1;
    return page * t.batch + slot * t.seq + static_cast<i64>(head) * t.head;
  }
};

// Rows of sequence b's cache in use before the append (seqused_k, or cache_len for all).
__device__ __forceinline__ i64 cache_rows_before(const Params& p, int b) {
  return p.seqused_k != nullptr ? p.seqused_k[b] : p.cache_len;
}

// Keys sequence b attends to: its rows before the append and the appended ones, clamped to the
// capacity (untrusted lengths).
__device__ __forceinline__ int cache_keys(const Params& p, int b) {
  const i64 used = cache_rows_before(p, b) + p.seq_new;
  return static_cast<int>(min(max(used, i64(0)), static_cast<i64>(p.seq_k)));
}

// ---------------------------------------------------------------------------------------------
// Append: element (b, j, h, c) of k_new / v_new goes to row cache_rows_before(b) + j.

constexpr int APPEND_THREADS = 256;

template <typename S>
__global__ void __launch_bounds__(APPEND_THREADS) kvcache_append(const __grid_constant__ Params p) {
  const CacheRows cache = CacheRows::of(p);
  const int d = p.head_dim;
  const i64 total = static_cast<i64>(p.batch) * p.seq_new * p.heads_kv * d;
  const i64 step = static_cast<i64>(gridDim.x) * APPEND_THREADS;
  for (i64 idx = static_cast<i64>(blockIdx.x) * APPEND_THREADS + threadIdx.x; idx < total; idx += step) {
    const int c = static_cast<int>(idx % d);
    i64 rest = idx / d;
    const int h = static_cast<int>(rest % p.heads_kv);
    rest /= p.heads_kv;
    const int j = static_cast<int>(rest % p.seq_new);
    const int b = static_cast<int>(rest / p.seq_new);
    const i64 row = cache_rows_before(p, b) + j;
    const i64 k_at = cache.offset(p.k, b, row, h), v_at = cache.offset(p.v, b, row, h);
    const S* k_src = head_rows<const S>(p.k_new, b, h).row(j);
    const S* v_src = head_rows<const S>(p.v_new, b, h).row(j);
    if (k_at >= 0) static_cast<S*>(p.k.ptr)[k_at + c] = k_src[c];
    if (v_at >= 0) static_cast<S*>(p.v.ptr)[v_at + c] = v_src[c];
  }
}

// ---------------------------------------------------------------------------------------------
// Split-KV decoding on the tensor cores (float16 / bfloat16).

constexpr int DECODE_ROWS = 16;  // query rows of a block: one m16 tile
constexpr int DECODE_WARPS = 4;
constexpr int DECODE_WARP_KEYS = 16;  // keys of each key tile a warp takes
constexpr int DECODE_BN = DECODE_WARPS * DECODE_WARP_KEYS;

// A block's rows: tile row r is query position r / group of query head kv_head * group + r % group.
struct DecodeRows {
  int r0, rows, group, kv_head;  // first tile row, rows of the call (seq_q * group)
  __device__ __forceinline__ bool real(int r) const { return r0 + r < rows; }
  __device__ __forceinline__ int position(int r) const { return (r0 + r) / group; }
  __device__ __forceinline__ int head(int r) const { return kv_head * group + (r0 + r) % group; }
};

// Loads ROWS rows of HD elements into a shared tile of pitch PITCH, with THREADS threads from
// thread FIRST on: row r from `src(r)` (a pointer, or null for a row of zeros); columns >= d are
// zeros. `vec`: 16-byte copies (cp.async).
template <int ROWS, int HD, int PITCH, int FIRST, int THREADS, typename RowSource>
__device__ __forceinline__ void load_rows(unsigned short* smem, const RowSource& src, int d, bool vec) {
  const int tid = static_cast<int>(threadIdx.x) - FIRST;
  if (tid < 0 || tid >= THREADS) return;
  if (vec) {
    constexpr int CPR = HD / 8;  // 16-byte chunks of a row
#pragma unroll 4
    for (int idx = tid; idx < ROWS * CPR; idx += THREADS) {
      const int r = idx / CPR, c = (idx % CPR) * 8;
      const unsigned short* row = src(r);
      const bool valid = row != nullptr && c < d;
      cp_async_16(smem_addr(smem + r * PITCH + c), valid ? row + c : src.base, valid);
    }
    return;
  }
  for (int idx = tid; idx < ROWS * HD; idx += THREADS) {
    const int r = idx / HD, c = idx % HD;
    const unsigned short* row = src(r);
    smem[r * PITCH + c] = (row != nullptr && c < d) ? row[c] : static_cast<unsigned short>(0);
  }
}

// The query rows of a block.
struct QuerySource {
  const unsigned short* base;
  const Params* p;
  DecodeRows rows;
  int batch;
  __device__ __forceinline__ const unsigned short* operator()(int r) const {
    if (!rows.real(r)) return nullptr;
    return head_ptr<const unsigned short>(p->q, batch, rows.head(r)) +
           static_cast<i64>(rows.position(r)) * p->q.seq;
  }
};

// Key rows n0 .. n0 + BN of one sequence's cache (rows outside [begin, end) read as zeros).
struct CacheSource {
  const unsigned short* base;
  const TensorRef* t;
  CacheRows cache;
  int batch, head, n0, begin, end;
  __device__ __forceinline__ const unsigned short* operator()(int r) const {
    if (n0 + r < begin || n0 + r >= end) return nullptr;
    const i64 at = cache.offset(*t, batch, n0 + r, head);
    return at < 0 ? nullptr : base + at;
  }
};

// Key rows of a tile whose element offsets were looked up ahead into shared memory (-1: no row).
struct OffsetSource {
  const unsigned short* base;
  const i64* offsets;
  __device__ __forceinline__ const unsigned short* operator()(int r) const {
    const i64 at = offsets[r];
    return at < 0 ? nullptr : base + at;
  }
};

// One row of HD elements of a key or value tile on the bulk-copy path (BULK, sm_90): `src` (a
// pointer, or null for a row of zeros) into `dst`, completing on `bar` (one arrival per thread and
// tile). With 16-byte copies (`vec`) the TMA unit copies the row's d elements; columns d .. HD were
// zeroed at the start and no copy writes them. Otherwise the thread stores the row itself (zeros,
// or an unaligned row element by element) and fences its stores from a later bulk copy into it.
template <int HD>
__device__ __forceinline__ void bulk_row(unsigned short* dst, const unsigned short* src, int d,
                                         bool vec, unsigned long long* bar) {
  if (src != nullptr && vec) {
    mbar_arrive_expect_tx(bar, 2u * d);
    bulk_load(dst, src, 2u * d, bar);
    return;
  }
  if (src == nullptr) {
#pragma unroll
    for (int c = 0; c < HD; c += 8) *reinterpret_cast<uint4*>(dst + c) = make_uint4(0, 0, 0, 0);
  } else {
    for (int c = 0; c < HD; ++c) dst[c] = c < d ? src[c] : static_cast<unsigned short>(0);
  }
  fence_proxy_async_shared();
  mbar_arrive(bar);
}

// O += P V for one warp's 16 keys with CUDA-core products that skip P = 0, so that a hidden key's
// Inf or NaN in V never reaches a row (the tensor cores compute 0 x NaN = NaN). P is rounded to
// Elem as the tensor-core path rounds it. Lane 4 g + t holds P[g][j], P[g + 8][j] for its keys
// j = 8 nt + 2 t + (e & 1) (mma.cuh's layout) and O[g][c], O[g + 8][c] for c = 8 n + 2 t, + 1.
template <typename Elem, int NT_O, typename TileV>
__device__ __forceinline__ void pv_skipping_zeros(float (&acc)[1][NT_O][4], const float (&s)[1][2][4],
                                                  const unsigned short* sV, int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int key = 0; key < 16; ++key) {
    const int nt = key >> 3, owner = (lane & ~3) | ((key & 7) >> 1), e = key & 1;
    float p_lo = __shfl_sync(0xffffffffu, s[0][nt][e], owner);
    float p_hi = __shfl_sync(0xffffffffu, s[0][nt][2 + e], owner);
    p_lo = ElemTraits<Elem>::to_acc(ElemTraits<Elem>::from_acc(p_lo));
    p_hi = ElemTraits<Elem>::to_acc(ElemTraits<Elem>::from_acc(p_hi));
#pragma unroll
    for (int n = 0; n < NT_O; ++n) {
      const unsigned short* v = sV + TileV::at(key, 8 * n + 2 * t);  // two elements of one unit
      const float v0 = ElemTraits<Elem>::to_acc(v[0]);
      const float v1 = ElemTraits<Elem>::to_acc(v[1]);
      if (p_lo != 0.f) {
        acc[0][n][0] = fmaf(p_lo, v0, acc[0][n][0]);
        acc[0][n][1] = fmaf(p_lo, v1, acc[0][n][1]);
      }
      if (p_hi != 0.f) {
        acc[0][n][2] = fmaf(p_hi, v0, acc[0][n][2]);
        acc[0][n][3] = fmaf(p_hi, v1, acc[0][n][3]);
      }
    }
  }
}

template <bool C, typename A, typename B>
struct Pick {
  typedef A type;
};
template <typename A, typename B>
struct Pick<false, A, B> {
  typedef B type;
};

// BOXES: the key and value tiles are boxes of the caches' tensor maps (DecodeMaps), in the layout
// the TMA unit writes them (Swizzled128Tile); otherwise rows of PITCH elements.
template <typename Elem, int HD, int STAGES, bool BULK, int FEATURES, bool BOXES = false>
struct DecodeTraits {
  static constexpr int PITCH = HD + 8;  // +16 bytes a row: conflict-free ldmatrix
  static constexpr int NT_O = HD / 8;
  static constexpr int K_QK = HD / 16;
  static constexpr int THREADS = DECODE_WARPS * 32;
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<> ScoreMod;
  static_assert(!BOXES || (BULK && HD % 64 == 0 && HD <= 128), "boxes: sm_90, d = 64 or 128");
  typedef typename Pick<BOXES, Swizzled128Tile<DECODE_BN>, PitchedTile<PITCH>>::type KVTile;
  static constexpr int TILE = DECODE_BN * (BOXES ? HD : PITCH);  // elements of a K or V tile
  static constexpr int ALIGN = BOXES ? 1024 : 0;  // the swizzle's alignment of the tiles
  // shared memory: (BOXES) up to 1 KB to align the tiles, STAGES stages of K tiles and of V tiles
  // (the merge reuses them), Q, the K and V row offsets of two key tiles, then (BULK) a barrier
  // per stage
  static constexpr int SMEM = ALIGN + 2 * STAGES * TILE * 2 + DECODE_ROWS * PITCH * 2 +
                              2 * 2 * DECODE_BN * 8 + (BULK ? STAGES * 8 : 0);
  // The merge's rows of the warps' outputs, in floats: a warp's float2 stores of its 8 rows x 8
  // columns then take the two passes 256 bytes need (with a pitch of HD: one per row, 8).
  static constexpr int OUT_PITCH = HD + 8;
  static_assert(DECODE_WARPS * DECODE_ROWS * OUT_PITCH * 4 + 2 * DECODE_WARPS * DECODE_ROWS * 4 <=
                    2 * STAGES * TILE * 2,
                "the warps' partial outputs fit where the key and value tiles were");
};

// The caches as tensor maps (d, rows, Hkv, sequences or pages), read in boxes of DECODE_BN rows of
// 64 columns under the 128-byte swizzle (cuflash/_kvcache_cuda.py, decode_box_maps).
struct DecodeMaps {
  TensorMap k, v;
};

// BULK (sm_90): each thread has one row of every key/value tile copied by the TMA unit
// (bulk_row), completing on the stage's barrier, where cp.async copies take 16 instructions a
// thread and occupy the multiprocessor's load tracking (docs/perf/NOTES.md, v15).
// BOXES (sm_90, d = 64 or 128, `maps`): thread 0 has each tile copied as boxes of the tensor maps,
// HD / 64 of K and as many of V. A bulk copy's addresses are per thread, so a warp issues its 32
// row copies one lane at a time: ~9 instructions a copy and most of a tile's time at d = 128,
// where the boxes take 4 copies a tile (docs/perf/NOTES.md, v24).
template <typename Elem, int HD, int STAGES, bool BULK, int FEATURES, bool BOXES>
__device__ __forceinline__ void decode_block(const Params& p, const DecodeMaps* maps) {
  typedef DecodeTraits<Elem, HD, STAGES, BULK, FEATURES, BOXES> Tr;
  typedef typename Tr::KVTile KVTile;
  constexpr int PITCH = Tr::PITCH, NT_O = Tr::NT_O, BN = DECODE_BN, TILE = Tr::TILE;
  // The combine (launched programmatically after this kernel on sm_90) may place its blocks
  // beside this kernel's last ones; they wait there for its results.
  if constexpr (BULK) launch_dependents();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned short* sK = reinterpret_cast<unsigned short*>(  // STAGES tiles of BN rows
      smem_raw + (Tr::ALIGN ? (Tr::ALIGN - (smem_addr(smem_raw) & (Tr::ALIGN - 1))) & (Tr::ALIGN - 1) : 0));
  unsigned short* sV = sK + STAGES * TILE;
  unsigned short* sQ = sV + STAGES * TILE;
  i64* s_offsets = reinterpret_cast<i64*>(sQ + DECODE_ROWS * PITCH);  // [buffer][K, V][BN]
  unsigned long long* s_full = reinterpret_cast<unsigned long long*>(s_offsets + 2 * 2 * BN);

  // block -> (KV head, split, row tile, sequence), KV heads adjacent: the blocks that run
  // together read the same cache rows' heads, whole rows of a (B, N, Hkv, d) cache between them.
  i64 bid = blockIdx.x;
  const int kv_head = static_cast<int>(bid % p.heads_kv);
  bid /= p.heads_kv;
  const int split = static_cast<int>(bid % p.num_splits);
  bid /= p.num_splits;
  const int tile = static_cast<int>(bid % p.num_blocks);
  const int b = static_cast<int>(bid / p.num_blocks);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int d = p.head_dim;
  const bool vec = p.vec != 0;

  DecodeRows rows{tile * DECODE_ROWS, p.seq_q * p.group, p.group, kv_head};
  const int nk = cache_keys(p, b);
  const typename Tr::Mask mask{p.seq_q, nk, p.window_left, p.window_right};
  const CacheRows cache = CacheRows::of(p);

  // The keys some row of the block sees, within this split.
  const int last_r = min(DECODE_ROWS, rows.rows - rows.r0) - 1;
  const int split0 = split * p.keys_per_split;
  const int key_begin = max(mask.keys_of(rows.position(0)).first, split0);
  const int key_end = min(mask.keys_of(rows.position(last_r)).last + 1, split0 + p.keys_per_split);
  const int tile0 = key_begin / BN;
  const int tiles = key_begin < key_end ? ceil_div(key_end, BN) - tile0 : 0;

  const QuerySource q_src{static_cast<const unsigned short*>(p.q.ptr), &p, rows, b};
  const unsigned short* k_base = static_cast<const unsigned short*>(p.k.ptr);
  const unsigned short* v_base = static_cast<const unsigned short*>(p.v.ptr);
  // K and V of key tile t into stage `stage`: half the threads copy K, half V. The prologue's
  // tiles look their rows up as they copy; later tiles read offsets looked up before the
  // iteration's products (`lookup`), so that no copy waits on a block table read.
  constexpr int HALF = Tr::THREADS / 2;
  static_assert(!BULK || HALF == BN, "BULK: a thread per key row and per value row");
  // BULK: thread r < BN has key row r copied, thread BN + r value row r.
  const bool loads_k = threadIdx.x < BN;
  const int bulk_r = loads_k ? threadIdx.x : threadIdx.x - BN;
  // One tile's K rows from `ks` and V rows from `vs` (row sources: CacheSource, OffsetSource).
  auto load_tile = [&](const auto& ks, const auto& vs, int stage) {
    if constexpr (BULK) {
      unsigned short* tile = (loads_k ? sK : sV) + stage * TILE;
      bulk_row<HD>(tile + bulk_r * PITCH, loads_k ? ks(bulk_r) : vs(bulk_r), d, vec, &s_full[stage]);
    } else {
      load_rows<BN, HD, PITCH, 0, HALF>(sK + stage * TILE, ks, d, vec);
      load_rows<BN, HD, PITCH, HALF, HALF>(sV + stage * TILE, vs, d, vec);
    }
  };
  // BOXES: tile t is the boxes at row `slot` of sequence or page `page`; a tile in no page (a row
  // past the capacity, a page index out of range) is read at a row past every map's rows, which
  // the TMA unit fills with zeros. The boxes also hold the cache's rows outside [key_begin,
  // key_end): the tile's warps clear those of V before their products (below).
  auto load_boxes = [&](int t, int stage) {
    if constexpr (BOXES) {
      if (threadIdx.x != 0) return;
      i64 page = 0, slot = 0;
      if (!cache.locate(b, static_cast<i64>(t) * BN, page, slot)) page = 0, slot = i64(1) << 30;
      unsigned long long* bar = &s_full[stage];
      mbar_arrive_expect_tx(bar, 2u * TILE * 2);
#pragma unroll
      for (int c = 0; c < HD / 64; ++c) {
        tma_load_4d(sK + stage * TILE + c * BN * 64, &maps->k, bar, c * 64, static_cast<int>(slot),
                    kv_head, static_cast<int>(page));
        tma_load_4d(sV + stage * TILE + c * BN * 64, &maps->v, bar, c * 64, static_cast<int>(slot),
                    kv_head, static_cast<int>(page));
      }
    }
  };
  auto load_kv_direct = [&](int t, int stage) {
    if constexpr (BOXES) {
      load_boxes(t, stage);
      return;
    }
    load_tile(CacheSource{k_base, &p.k, cache, b, kv_head, t * BN, key_begin, key_end},
              CacheSource{v_base, &p.v, cache, b, kv_head, t * BN, key_begin, key_end}, stage);
  };
  auto load_kv = [&](int t, int stage) {
    if constexpr (BOXES) {
      load_boxes(t, stage);
      return;
    }
    const i64* offsets = s_offsets + (t & 1) * 2 * BN;
    load_tile(OffsetSource{k_base, offsets}, OffsetSource{v_base, offsets + BN}, stage);
  };
  auto lookup = [&](int t) {
    if (!BOXES && threadIdx.x < BN) {
      const int n = t * BN + threadIdx.x;
      i64 page = 0, slot = 0;
      const bool in_cache = n >= key_begin && n < key_end && cache.locate(b, n, page, slot);
      i64* offsets = s_offsets + (t & 1) * 2 * BN;
      offsets[threadIdx.x] = in_cache ? page * p.k.batch + slot * p.k.seq + kv_head * p.k.head : -1;
      offsets[BN + threadIdx.x] = in_cache ? page * p.v.batch + slot * p.v.seq + kv_head * p.v.head : -1;
    }
  };
  load_rows<DECODE_ROWS, HD, PITCH, 0, Tr::THREADS>(sQ, q_src, d, vec);
  if constexpr (BULK) {
    // The barriers; and columns d .. HD of every stage, which the bulk copies never write.
    cp_async_commit();
    if (threadIdx.x == 0) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s) mbar_init(&s_full[s], BOXES ? 1 : Tr::THREADS);
      fence_barrier_init();
    }
    if (!BOXES && d < HD) {  // (the boxes' columns past d are out of the maps: zeros)
      for (int idx = threadIdx.x; idx < 2 * STAGES * BN * HD; idx += Tr::THREADS)
        sK[(idx / HD) * PITCH + idx % HD] = 0;  // sV follows sK: rows 2 STAGES BN in all
      fence_proxy_async_shared();
    }
    __syncthreads();
  }
  // Every stage is filled before the loop, and a stage is filled again as soon as the block is
  // done with it (at the end of an iteration), so that STAGES tiles are in flight while the block
  // waits: the loop is bound by the cache's stream (docs/perf/NOTES.md, v24).
#pragma unroll
  for (int s = 0; s < STAGES; ++s) {
    if (s < tiles) load_kv_direct(tile0 + s, s);
    if constexpr (!BULK) cp_async_commit();
  }

  // This lane's accumulator rows g and g + 8: their query positions and score modifiers.
  const int g = lane >> 2, t4 = lane & 3;
  const float scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
  const float unit = static_cast<float>(p.scale);
  const Extents<true> ext{p.seq_q, nk};
  int pos[2];
  bool real[2];
  typename Tr::ScoreMod mod[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    real[h] = rows.real(r);
    pos[h] = rows.real(r) ? rows.position(r) : rows.position(0);
    mod[h] = Tr::ScoreMod::of(p, b, rows.real(r) ? rows.head(r) : rows.head(0), unit, ext);
  }

  // The per-tile savings below (Q in registers, the mask only on tiles that need it, the rescale
  // skipped where no row max moved) where registers allow: on sm_90 (BULK, whose loads take
  // fewer registers) up to HD = 128. At HD = 256, and on sm_80 at HD = 128, the kernel spilled
  // with them (docs/perf/NOTES.md, v15).
  constexpr bool LEAN_TILES = BULK && HD <= 128;
  // Keys that every row of the block sees and that are loaded: tiles inside them skip the mask.
  const int every_begin = max(key_begin, mask.keys_of(rows.position(last_r)).first);
  const int every_end = min(key_end, mask.keys_of(rows.position(0)).last + 1);
  // Q as A fragments, held through the loop where registers allow (HD <= 128), else read from
  // shared memory at each tile.
  constexpr bool Q_IN_REGISTERS = LEAN_TILES;
  unsigned q_frags[1][Q_IN_REGISTERS ? Tr::K_QK : 1][4];
  if constexpr (Q_IN_REGISTERS) {
    cp_async_wait<0>();  // Q (and, without BULK, the prologue's tiles)
    __syncthreads();
    load_a_frags<1, Tr::K_QK, PITCH>(q_frags, sQ, lane);
  }

  float acc_o[1][NT_O][4];
  fill(acc_o, 0.f);
  OnlineSoftmax<1> softmax;
  softmax.init(p.p_shift);

  if constexpr (BULK && !Q_IN_REGISTERS) {
    cp_async_wait<0>();  // Q, whose rows every thread copied
    __syncthreads();
  }
  for (int it = 0; it < tiles; ++it) {
    const int stage = it % STAGES;
    if constexpr (BULK) {
      mbar_wait(&s_full[stage], (it / STAGES) & 1);
    } else {
      cp_async_wait<STAGES - 1>();
      __syncthreads();  // every thread's copies of tile it have landed
    }
    // The rows of the tile this stage takes next, read after this iteration's closing sync (the
    // offsets' buffer was last read by the copies of tile it + STAGES - 2, before the last sync).
    if (it + STAGES < tiles) lookup(tile0 + it + STAGES);
    // this warp's 16 rows of the stage's tiles (a multiple of 8 rows: the swizzle's period)
    const unsigned short* sKw = sK + stage * TILE + KVTile::at(warp * DECODE_WARP_KEYS, 0);
    unsigned short* sVw = sV + stage * TILE + KVTile::at(warp * DECODE_WARP_KEYS, 0);
    const int n0 = (tile0 + it) * BN + warp * DECODE_WARP_KEYS;
    if constexpr (BOXES) {
      // Rows of V outside [key_begin, key_end) hold the cache's data (stale rows past the keys in
      // use may be NaN): zeros, as the row copies leave them, before P V reads them.
      if (n0 < key_begin || n0 + DECODE_WARP_KEYS > key_end) {
        for (int idx = lane; idx < DECODE_WARP_KEYS * HD / 8; idx += 32) {
          const int r = idx / (HD / 8), unit = idx % (HD / 8);
          if (n0 + r < key_begin || n0 + r >= key_end)
            *reinterpret_cast<uint4*>(sVw + KVTile::at(r, unit * 8)) = make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async_shared();  // before the boxes of a later tile land here
        __syncwarp();
      }
    }

    float s[1][2][4];
    fill(s, 0.f);
    if constexpr (Q_IN_REGISTERS) gemm_abt_in<Elem, 1, 2, Tr::K_QK, KVTile>(s, q_frags, sKw, lane);
    else gemm_abt<Elem, 1, 2, Tr::K_QK, PITCH, PITCH>(s, sQ, sKw, lane);
    bool hides_data = false;  // a real row does not see a key whose row of V was loaded
    // The band of mask.cuh; keys outside the split or past the keys in use are hidden too (their
    // rows were not loaded: zeros).
    auto hide_unseen = [&](float x, int h, int j) {
      const bool loaded = j >= key_begin && j < key_end;
      if (loaded && mask.visible(pos[h], j)) return x;
      hides_data |= loaded && real[h];
      return -inf_f32();
    };
    // Without LEAN_TILES every tile is masked, in the same pass as the score modifier (separate
    // passes spilled at HD = 32 on sm_80); with it, only the tiles that straddle a bound.
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1, j = n0 + nt * 8 + 2 * t4 + (e & 1);
        const float x = mod[h](s[0][nt][e], mod[h].row_pos(pos[h]), static_cast<float>(j));
        s[0][nt][e] = LEAN_TILES ? x : hide_unseen(x, h, j);
      }
    const int tile_n0 = (tile0 + it) * BN;
    if (LEAN_TILES && (tile_n0 < every_begin || tile_n0 + BN > every_end)) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1, j = n0 + nt * 8 + 2 * t4 + (e & 1);
          s[0][nt][e] = hide_unseen(s[0][nt][e], h, j);
        }
    }
    softmax.template update<2, NT_O, LEAN_TILES>(s, acc_o, scale_log2);
    // O += P V: on the tensor cores, except where a row does not see a loaded key: there 0 x an
    // Inf or NaN of V would reach the row, so those tiles take exact products that skip P = 0
    // (rare: the last keys under a causal mask with Nq > 1, a window's edges)
    if (__any_sync(0xffffffffu, hides_data))
      pv_skipping_zeros<Elem, NT_O, KVTile>(acc_o, s, sVw, lane);
    else
      gemm_pb_in<Elem, 1, NT_O, 1, KVTile>(acc_o, s, sVw, lane);
    __syncthreads();  // every warp is done with the stage: it takes tile it + STAGES
    if (it + STAGES < tiles) load_kv(tile0 + it + STAGES, stage);
    if constexpr (!BULK) cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the tiles: the stages hold the merge from here

  // Merge the warps' online softmaxes: each publishes its rows' max and sum, then its output
  // rescaled to the common max and divided by the common sum; the block adds them in warp order.
  float* s_max = reinterpret_cast<float*>(sK);          // [warp][row]
  float* s_sum = s_max + DECODE_WARPS * DECODE_ROWS;    // [warp][row]
  float* s_out = s_sum + DECODE_WARPS * DECODE_ROWS;    // [warp][row][OUT_PITCH]
  constexpr int OUT_PITCH = Tr::OUT_PITCH;
  float row_sum[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) row_sum[h] = quad_sum(softmax.row_sum[0][h]);
  if (t4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      s_max[warp * DECODE_ROWS + g + 8 * h] = softmax.row_max[0][h];
      s_sum[warp * DECODE_ROWS + g + 8 * h] = row_sum[h];
    }
  }
  __syncthreads();
  float lse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    float m = -inf_f32();
    for (int w = 0; w < DECODE_WARPS; ++w) m = fmaxf(m, s_max[w * DECODE_ROWS + r]);
    const float m_scaled = softmax.scaled_max(m, scale_log2);
    float total = 0.f;
    for (int w = 0; w < DECODE_WARPS; ++w)
      total += s_sum[w * DECODE_ROWS + r] * fast_exp2(s_max[w * DECODE_ROWS + r] * scale_log2 - m_scaled);
    const float mine = fast_exp2(softmax.row_max[0][h] * scale_log2 - m_scaled);
    const float factor = total > 0.f ? mine / total : 0.f;
    lse[h] = total > 0.f ? (m_scaled + log2f(total) + softmax.shift) * 0.6931471805599453f : -inf_f32();
    if (!rows.real(r)) continue;  // (a group of fewer than 16 rows: never stored)
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) {
      float* out = s_out + (warp * DECODE_ROWS + r) * OUT_PITCH + nt * 8 + 2 * t4;
      *reinterpret_cast<float2*>(out) = make_float2(acc_o[0][nt][2 * h] * factor, acc_o[0][nt][2 * h + 1] * factor);
    }
  }
  __syncthreads();

  // Store: one split gives O (Elem) and lse; several give float32 partials for the combine.
  const bool partial = p.num_splits > 1;
  for (int idx = threadIdx.x; idx < DECODE_ROWS * HD; idx += Tr::THREADS) {
    const int r = idx / HD, c = idx % HD;
    if (!rows.real(r) || c >= d) continue;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) o += s_out[(w * DECODE_ROWS + r) * OUT_PITCH + c];
    const i64 row = rows.position(r);
    if (partial) {
      head_ptr<float>(p.o_accum, split * p.batch + b, rows.head(r))[row * p.o_accum.seq + c] = o;
    } else {
      head_ptr<unsigned short>(p.o, b, rows.head(r))[row * p.o.seq + c] = ElemTraits<Elem>::from_acc(o);
    }
  }
  if (t4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = g + 8 * h;
      if (!rows.real(r)) continue;
      const i64 row = rows.position(r);
      if (partial) head_ptr<float>(p.lse_accum, split * p.batch + b, rows.head(r))[row * p.lse_accum.seq] = lse[h];
      else head_ptr<float>(p.lse, b, rows.head(r))[row * p.lse.seq] = lse[h];
    }
  }
}

template <typename Elem, int HD, int STAGES, bool BULK, int FEATURES>
__global__ void __launch_bounds__(DECODE_WARPS * 32)
    attention_decode(const __grid_constant__ Params p) {
  decode_block<Elem, HD, STAGES, BULK, FEATURES, false>(p, nullptr);
}

// The key and value tiles as boxes of `maps` (sm_90, d = 64 and 128; cuflash/_kvcache_cuda.py
// takes it where the caches have maps and the call's pointers are 16-byte aligned).
template <typename Elem, int HD, int STAGES, int FEATURES>
__global__ void __launch_bounds__(DECODE_WARPS * 32)
    attention_decode_boxes(const __grid_constant__ DecodeMaps maps, const __grid_constant__ Params p) {
  decode_block<Elem, HD, STAGES, true, FEATURES, true>(p, &maps);
}

// ---------------------------------------------------------------------------------------------
// Combine: one block per (sequence, query head, position) merges the splits' partial results:
// lse = log sum_s exp(lse_s), o = sum_s exp(lse_s - lse) o_s (float32), as cuflash.combine does.
// A row no split saw (every lse_s = -inf) gives o = 0 and lse = -inf. The splits' rows of o are
// few and short, so the block reads them all at once: warp w takes splits w, w + 8, ..., each lane
// four columns at a time (o_accum rows are padded to whole float4s); the warps' sums are then
// added in warp order (the same bits every run).

constexpr int COMBINE_WARPS = 8;
constexpr int COMBINE_MAX_SPLITS = 128;  // the host's cap on num_splits

template <typename Elem, int HD>
__global__ void __launch_bounds__(COMBINE_WARPS * 32)
    attention_decode_combine(const __grid_constant__ Params p) {
  constexpr int VECS = (HD + 127) / 128;                              // float4s of a lane
  constexpr int WARP_SPLITS = COMBINE_MAX_SPLITS / COMBINE_WARPS;     // splits of a warp, at most
  __shared__ float s_weight[COMBINE_MAX_SPLITS];
  __shared__ float s_reduce[2][COMBINE_WARPS];
  __shared__ __align__(16) float s_sum[COMBINE_WARPS][HD];
  const i64 row_id = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int i = static_cast<int>(row_id % p.seq_q);
  const i64 bh = row_id / p.seq_q;
  const int head = static_cast<int>(bh % p.heads_q), b = static_cast<int>(bh / p.heads_q);
  const int splits = p.num_splits, d = p.head_dim;
#if __CUDA_ARCH__ >= 900
  wait_for_prerequisite_grid();  // launched programmatically after the decoding kernel
#endif

  // Every load at once: thread s reads split s's lse, and warp w the rows of o of its splits
  // (w, w + 8, ...), which it weighs once the lse are reduced.
  const float lse_s = threadIdx.x < splits
                          ? head_ptr<const float>(p.lse_accum, threadIdx.x * p.batch + b, head)
                                [static_cast<i64>(i) * p.lse_accum.seq]
                          : -inf_f32();
  float4 part[WARP_SPLITS][VECS];
#pragma unroll
  for (int k = 0; k < WARP_SPLITS; ++k) {
    const int s = warp + k * COMBINE_WARPS;
    const float* row = head_ptr<const float>(p.o_accum, s * p.batch + b, head) +
                       static_cast<i64>(i) * p.o_accum.seq;
#pragma unroll
    for (int v = 0; v < VECS; ++v) {
      const int c = 4 * (lane + 32 * v);
      part[k][v] = s < splits && c < d ? *reinterpret_cast<const float4*>(row + c)
                                       : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }

  float m = lse_s;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) s_reduce[0][warp] = m;
  __syncthreads();
  m = s_reduce[0][0];
#pragma unroll
  for (int w = 1; w < COMBINE_WARPS; ++w) m = fmaxf(m, s_reduce[0][w]);
  float e = m == -inf_f32() ? 0.f : expf(lse_s - m);
  float total = e;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
  if (lane == 0) s_reduce[1][warp] = total;
  __syncthreads();
  total = 0.f;
#pragma unroll
  for (int w = 0; w < COMBINE_WARPS; ++w) total += s_reduce[1][w];
  const float lse = total > 0.f ? m + logf(total) : -inf_f32();
  if (threadIdx.x < COMBINE_MAX_SPLITS) s_weight[threadIdx.x] = total > 0.f ? e / total : 0.f;
  __syncthreads();

  float4 acc[VECS];
#pragma unroll
  for (int v = 0; v < VECS; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < WARP_SPLITS; ++k) {
    const int s = warp + k * COMBINE_WARPS;
    if (s >= splits) break;
    const float w = s_weight[s];  // 0 for a split that saw no key (its o is 0)
#pragma unroll
    for (int v = 0; v < VECS; ++v) {
      acc[v].x += w * part[k][v].x;
      acc[v].y += w * part[k][v].y;
      acc[v].z += w * part[k][v].z;
      acc[v].w += w * part[k][v].w;
    }
  }
#pragma unroll
  for (int v = 0; v < VECS; ++v) {
    const int c = 4 * (lane + 32 * v);
    if (c < HD) *reinterpret_cast<float4*>(&s_sum[warp][c]) = acc[v];
  }
  __syncthreads();
  typedef typename ElemTraits<Elem>::storage Storage;
  Storage* o_row = head_ptr<Storage>(p.o, b, head) + static_cast<i64>(i) * p.o.seq;
  for (int c = threadIdx.x; c < d; c += COMBINE_WARPS * 32) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < COMBINE_WARPS; ++w) o += s_sum[w][c];
    o_row[c] = ElemTraits<Elem>::from_acc(o);
  }
  if (threadIdx.x == 0) head_ptr<float>(p.lse, b, head)[static_cast<i64>(i) * p.lse.seq] = lse;
}

// ---------------------------------------------------------------------------------------------
// Chunked prefill and the exact dtypes: each sequence's keys in use laid out as a packed batch
// for the packed forward kernels. cu_seqlens_q / cu_seqlens_k (written here): sequence b's query
// rows b * seq_q .., its keys after those of the sequences before it.

__global__ void kvcache_pack_offsets(const __grid_constant__ Params p) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int* cu_q = const_cast<int*>(p.cu_seqlens_q);
  int* cu_k = const_cast<int*>(p.cu_seqlens_k);
  int keys = 0;
  for (int b = 0; b < p.batch; ++b) {
    cu_q[b] = b * p.seq_q;
    cu_k[b] = keys;
    keys += cache_keys(p, b);
  }
  cu_q[p.batch] = p.batch * p.seq_q;
  cu_k[p.batch] = keys;
}

constexpr int GATHER_THREADS = 128;

// One block per (sequence, key row): the row of every KV head into the packed k_new / v_new
// (here the gathered keys, (total rows, heads_kv, d)); rows of no page are zeros. `vec`: whole
// 16-byte units (aligned caches and rows of a multiple of 16 bytes).
template <typename S>
__global__ void __launch_bounds__(GATHER_THREADS) kvcache_gather(const __grid_constant__ Params p) {
  const i64 bid = blockIdx.x;
  const int b = static_cast<int>(bid / p.seq_k), r = static_cast<int>(bid % p.seq_k);
  if (r >= cache_keys(p, b)) return;
  const CacheRows cache = CacheRows::of(p);
  const i64 dst_row = p.cu_seqlens_k[b] + r;
  const bool vec = p.vec != 0;
  constexpr int PER_UNIT = 16 / sizeof(S);
  const int units = vec ? p.head_dim / PER_UNIT : p.head_dim;  // per head row
  for (int idx = threadIdx.x; idx < p.heads_kv * units; idx += GATHER_THREADS) {
    const int h = idx / units, u = idx % units;
    const i64 k_at = cache.offset(p.k, b, r, h), v_at = cache.offset(p.v, b, r, h);
    S* k_dst = head_ptr<S>(p.k_new, 0, h) + dst_row * p.k_new.seq;
    S* v_dst = head_ptr<S>(p.v_new, 0, h) + dst_row * p.v_new.seq;
    const S* k_src = static_cast<const S*>(p.k.ptr) + k_at;
    const S* v_src = static_cast<const S*>(p.v.ptr) + v_at;
    if (vec) {
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      reinterpret_cast<uint4*>(k_dst)[u] = k_at >= 0 ? reinterpret_cast<const uint4*>(k_src)[u] : zero;
      reinterpret_cast<uint4*>(v_dst)[u] = v_at >= 0 ? reinterpret_cast<const uint4*>(v_src)[u] : zero;
    } else {
      k_dst[u] = k_at >= 0 ? k_src[u] : S(0);
      v_dst[u] = v_at >= 0 ? v_src[u] : S(0);
    }
  }
}

}  // namespace cuflash
