// repair.cuh: exact recomputation of the rows that a masked tile made non-finite.
//
// On a tile that straddles a bound of the mask, a query i and a key j that i may not see still meet
// in the tensor-core products, with P_ij = 0 (or dS_ij = 0). If the other operand of that product
// (v_j, dO_i, q_i or k_j) is NaN or Inf, 0 * NaN = NaN reaches an output that must not depend on
// it. A finite accumulator element cannot have been touched this way (0 times a finite value is 0),
// so the kernels visit the masked tiles first and then:
//   1. nonfinite_rows: flag every accumulator row that holds a non-finite value (a bit per row);
//   2. run the unmasked tiles as usual;
//   3. recompute_*_rows, in the epilogue once the accumulators are staged in shared memory: each
//      flagged row is recomputed whole by scalar code from global memory, skipping the invisible
//      pairs, and written over its staged row.
// With finite inputs this costs one finiteness check per accumulator element per block. Only rows
// that meet a non-finite value in a masked tile are flagged (about one tile of rows per
// non-finite input element), and rows that are not flagged are bitwise what the tensor cores
// computed. Step 3 runs where the accumulators are dead, so that the main loop keeps its
// registers.
//
// Fragment layout (mma.cuh, also the wgmma accumulator of each warp): for a 16-row tile, lane
// (g = lane / 4, t = lane % 4) holds rows g (r = 0) and g + 8 (r = 1) and, of every n8 tile nt,
// columns 8 nt + 2 t + {0, 1}, as acc[nt][2 r + {0, 1}]. Row flag bits are 2 mt + r. The
// recomputation goes one row at a time, by the whole warp: lane x owns the columns x, x + 32, ...
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "score_mod.cuh"

namespace cuflash {

__device__ __forceinline__ bool is_finite_f32(float x) { return fabsf(x) <= 3.402823466e38f; }

// ---------------------------------------------------------------------------------------------
// Step 1: flags

template <int NT>
__device__ __forceinline__ bool row_has_nonfinite(const float (&acc)[NT][4], int r) {
  bool bad = false;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) bad |= !is_finite_f32(acc[nt][2 * r]) | !is_finite_f32(acc[nt][2 * r + 1]);
  return bad;
}

// A row is shared by the 4 lanes of a quad: it is flagged when any of them holds a non-finite value.
__device__ __forceinline__ bool quad_any(bool x) {
  int v = x;
  v |= __shfl_xor_sync(0xffffffffu, v, 1);
  v |= __shfl_xor_sync(0xffffffffu, v, 2);
  return v != 0;
}

// The rows of MT 16-row tiles of one accumulator (O, dQ) that hold a non-finite value.
template <int MT, int NT>
__device__ __forceinline__ unsigned nonfinite_rows(const float (&acc)[MT][NT][4]) {
  unsigned rows = 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (quad_any(row_has_nonfinite(acc[mt], r))) rows |= 1u << (2 * mt + r);
  return rows;
}

// The same for dK and dV (one 16-key tile): a key row is flagged when either accumulator is bad.
template <int NT>
__device__ __forceinline__ unsigned nonfinite_rows(const float (&acc_dk)[NT][4],
                                                   const float (&acc_dv)[NT][4]) {
  unsigned rows = 0;
#pragma unroll
  for (int r = 0; r < 2; ++r)
    if (quad_any(row_has_nonfinite(acc_dk, r) || row_has_nonfinite(acc_dv, r))) rows |= 1u << r;
  return rows;
}

// Where a flag register live through the main loop would push a configuration into spills, the
// flags wait in memory that the kernel owns and does not touch again before the epilogue.
// Volatile accesses keep the compiler from forwarding the value in a register.
struct FlagSlot {
  unsigned* addr;
  bool owner;  // does this lane park a word there?
};

// The forward pass's own lse output, written at the end anyway: lane 4 g parks its word as the lse
// of its row g (its rows g + 8, ... are padding when row g is not real).
__device__ __forceinline__ FlagSlot lse_flag_slot(float* lse_row_g, bool real_row_g, int lane) {
  return FlagSlot{reinterpret_cast<unsigned*>(lse_row_g), (lane & 3) == 0 && real_row_g};
}

// The 8 padding columns (PITCH = HD + 8) of this lane's row g of a shared-memory tile: one word for
// each lane of the quad.
__device__ __forceinline__ FlagSlot padding_flag_slot(unsigned short* tile_row_g, int hd, int lane) {
  return FlagSlot{reinterpret_cast<unsigned*>(tile_row_g + hd) + (lane & 3), true};
}

__device__ __forceinline__ void park_flags(const FlagSlot& slot, unsigned rows) {
  if (slot.owner) *reinterpret_cast<volatile unsigned*>(slot.addr) = rows;
}

__device__ __forceinline__ unsigned unpark_flags(const FlagSlot& slot) {
  return slot.owner ? *reinterpret_cast<const volatile unsigned*>(slot.addr) : 0u;
}

// ---------------------------------------------------------------------------------------------
// Step 3: recomputation

// Sum over the 32 lanes of a warp.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// lse in log2 units for P = exp2(s scale_log2 - lse2); a row that sees no key gets +inf (P = 0).
__device__ __forceinline__ float lse_log2(float lse) {
  return lse == -inf_f32() ? inf_f32() : lse * 1.4426950408889634f;
}

// Row rl of a warp's MT 16-row tiles (tile rl / 16, half rl / 8 % 2) is held by lanes 4 (rl % 8)
// .. + 3: its flag and its entry of a per-row array, broadcast from lane 4 (rl % 8).
template <int MT>
__device__ __forceinline__ bool row_flag(unsigned rows, int rl) {
  const int bit = 2 * (rl >> 4) + ((rl >> 3) & 1);
  return (__shfl_sync(0xffffffffu, rows, 4 * (rl & 7)) >> bit) & 1;
}

template <int MT>
__device__ __forceinline__ float row_value(const float (&per_row)[MT][2], int rl) {
  float mine = 0.f;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (mt == (rl >> 4) && r == ((rl >> 3) & 1)) mine = per_row[mt][r];
  return __shfl_sync(0xffffffffu, mine, 4 * (rl & 7));
}

// This lane's share (columns lane + 32 n < d, n < N) of the dot product of two rows.
template <typename Elem, int N, typename S = typename ElemTraits<Elem>::storage>
__device__ __forceinline__ float lane_dot(const S* a, const S* b, int d, int lane) {
  float s = 0.f;
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const int c = lane + 32 * n;
    if (c < d) s = fmaf(ElemTraits<Elem>::to_acc(a[c]), ElemTraits<Elem>::to_acc(b[c]), s);
  }
  return s;
}

// out[n] += w * row[col0 + lane + 32 n] over this lane's columns of a slice [col0, col0 + width).
template <typename Elem, int N, typename S = typename ElemTraits<Elem>::storage>
__device__ __forceinline__ void lane_axpy(float (&out)[N], float w, const S* row, int col0,
                                          int width, int d, int lane) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const int c = lane + 32 * n;
    if (c < width && col0 + c < d) out[n] = fmaf(w, ElemTraits<Elem>::to_acc(row[col0 + c]), out[n]);
  }
}

// dst[lane + 32 n] = scale * out[n], rounded to Elem, over a slice of `width` columns.
template <typename Elem, int N>
__device__ __forceinline__ void lane_store(unsigned short* dst, const float (&out)[N], float scale,
                                           int width, int lane) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const int c = lane + 32 * n;
    if (c < width) dst[c] = ElemTraits<Elem>::from_acc(out[n] * scale);
  }
}

// Forward: flagged rows recomputed whole over every key they see, from the lse the main loop found
// (correct: the scores are masked with a select, so no 0 * NaN reaches it), and written over their
// normalised rows (row rl of this warp at out + rl * pitch, columns [0, width): a staging tile in
// shared memory, or O itself), as Out times o_factor (the FP8 forward: bf16, v's descale factor).
// lse_rows: this lane's rows' lse (natural log).
template <typename Elem, int HD, int MT, typename Out = Elem, typename Mask, typename Mod,
          typename Pitch, typename In = const typename ElemTraits<Elem>::storage>
__device__ __forceinline__ void recompute_forward_rows(unsigned short* out, Pitch pitch, int width,
                                                       unsigned rows, const float (&lse_rows)[MT][2],
                                                       float scale_log2, const HeadRows<In>& q,
                                                       const HeadRows<In>& k, const HeadRows<In>& v,
                                                       int row0, const Mask& mask, const Mod& mod,
                                                       int d, int lane, float o_factor = 1.f) {
  constexpr int CPL = (HD + 31) / 32;  // columns per lane
#pragma unroll 1
  for (int rl = 0; rl < 16 * MT; ++rl) {
    const int i = row0 + rl;
    // Rows outside [0, nq): padding (an end-aligned first block starts before row 0).
    if (!row_flag<MT>(rows, rl) || i < 0 || i >= mask.nq) continue;  // warp-uniform
    const float lse2 = row_value<MT>(lse_rows, rl) * 1.4426950408889634f;
    if (lse2 == -inf_f32()) continue;  // sees no key: stays 0
    float acc[CPL];
#pragma unroll
    for (int n = 0; n < CPL; ++n) acc[n] = 0.f;
    In* q_row = q.row(i);
    const Bounds keys = mask.keys_of(i);
#pragma unroll 1
    for (int j = keys.first; j <= keys.last; ++j) {
      const float s = mod(warp_sum(lane_dot<Elem, CPL>(q_row, k.row(j), d, lane)), mod.row_pos(i),
                          float(j));
      const float p = fast_exp2(fmaf(s, scale_log2, -lse2));
      lane_axpy<Elem, CPL>(acc, p, v.row(j), 0, HD, d, lane);
    }
    lane_store<Out, CPL>(out + rl * pitch, acc, o_factor, width, lane);
  }
}

// dQ: flagged query rows recomputed whole, dQ_i = scale sum_j dS_ij k_j over the keys row i sees,
// dS_ij = P_ij (dO_i . v_j - D_i), P_ij = exp2(s_ij scale_log2 - lse2_i), written over the dQ rows
// (row rl of this warp at out + rl * pitch, columns [0, width): a staging tile or dQ). lse and
// delta: the head's rows of lse and D.
template <typename Elem, int HD, int MT, typename Mask, typename Mod, typename Pitch>
__device__ __forceinline__ void recompute_dq_rows(unsigned short* out, Pitch pitch, int width,
                                                  unsigned rows, float scale, float scale_log2,
                                                  const Rows& q, const Rows& dout, const Rows& k,
                                                  const Rows& v, const HeadRows<const float>& lse,
                                                  const HeadRows<const float>& delta, int row0,
                                                  const Mask& mask, const Mod& mod, int d,
                                                  int lane) {
  constexpr int CPL = (HD + 31) / 32;
#pragma unroll 1
  for (int rl = 0; rl < 16 * MT; ++rl) {
    const int i = row0 + rl;
    if (!row_flag<MT>(rows, rl) || i >= mask.nq) continue;  // warp-uniform
    const float lse2 = lse_log2(*lse.row(i)), dlt = *delta.row(i);
    float acc[CPL];
#pragma unroll
    for (int n = 0; n < CPL; ++n) acc[n] = 0.f;
    const unsigned short *q_row = q.row(i), *do_row = dout.row(i);
    const Bounds keys = mask.keys_of(i);
#pragma unroll 1
    for (int j = keys.first; j <= keys.last; ++j) {
      const unsigned short *k_row = k.row(j), *v_row = v.row(j);
      float dcap;
      const float s = mod(warp_sum(lane_dot<Elem, CPL>(q_row, k_row, d, lane)), mod.row_pos(i),
                          float(j), dcap);
      const float dp = warp_sum(lane_dot<Elem, CPL>(do_row, v_row, d, lane));
      const float p = fast_exp2(fmaf(s, scale_log2, -lse2));
      lane_axpy<Elem, CPL>(acc, p * (dp - dlt) * dcap, k_row, 0, HD, d, lane);
    }
    lane_store<Elem, CPL>(out + rl * pitch, acc, scale, width, lane);
  }
}

// dK and dV: flagged key rows (this warp's 16 keys from key0, columns [col0, col0 + W)) recomputed
// whole over the query rows that see them, of the query heads of key/value head `kv_head` of
// sequence `batch`: dV_j = sum_i P_ij dO_i, dK_j = scale sum_i dS_ij q_i, written over the rows
// (key row rl of this warp at out_dk / out_dv + rl * pitch, columns [col0, col0 + width): staging
// tiles, or dK and dV themselves). Mod: the ScoreMod type, built per query head.
// The query-row tensors and score modifiers of a query head of sequence `batch` (an int: a dense
// sequence of the batch) or `seq` (params.cuh, Seq: dense or packed).
template <typename T>
__device__ __forceinline__ HeadRows<T> query_rows_of(const TensorRef& t, int batch, int head) {
  return head_rows<T>(t, batch, head);
}
template <typename T, bool PACKED>
__device__ __forceinline__ HeadRows<T> query_rows_of(const TensorRef& t, const Seq<PACKED>& seq,
                                                     int head) {
  return seq.template q_rows<T>(t, head);
}
template <typename Mod>
__device__ __forceinline__ Mod mod_of(const Params& p, int batch, int head) {
  return Mod::of(p, batch, head, static_cast<float>(p.scale));
}
template <typename Mod, bool PACKED>
__device__ __forceinline__ Mod mod_of(const Params& p, const Seq<PACKED>& seq, int head) {
  return Mod::of(p, seq.batch, head, static_cast<float>(p.scale), seq.ext);
}

template <typename Elem, int HD, int W, typename Mod, typename Mask, typename Pitch, typename Where>
__device__ __forceinline__ void recompute_dkdv_rows(unsigned short* out_dk, unsigned short* out_dv,
                                                    Pitch pitch, int width, unsigned rows, float scale,
                                                    float scale_log2, const Params& p, const Where& batch,
                                                    int kv_head, const Rows& k, const Rows& v,
                                                    int key0, int col0, const Mask& mask, int lane) {
  constexpr int CPL = (HD + 31) / 32, OPL = (W + 31) / 32;  // dot columns, output columns per lane
  const int d = p.head_dim;
#pragma unroll 1
  for (int rl = 0; rl < 16; ++rl) {
    const int j = key0 + rl;
    if (!row_flag<1>(rows, rl) || j >= mask.nk) continue;  // warp-uniform
    const unsigned short *k_row = k.row(j), *v_row = v.row(j);
    const Bounds queries = mask.queries_of(j);
    float acc_dk[OPL], acc_dv[OPL];
#pragma unroll
    for (int n = 0; n < OPL; ++n) acc_dk[n] = acc_dv[n] = 0.f;
#pragma unroll 1
    for (int h = kv_head * p.group; h < (kv_head + 1) * p.group; ++h) {
      const Rows q = query_rows_of<const unsigned short>(p.q, batch, h);
      const Rows dout = query_rows_of<const unsigned short>(p.dout, batch, h);
      const HeadRows<const float> lse = query_rows_of<const float>(p.lse, batch, h);
      const HeadRows<const float> delta = query_rows_of<const float>(p.delta, batch, h);
      const Mod mod = mod_of<Mod>(p, batch, h);
#pragma unroll 1
      for (int i = queries.first; i <= queries.last; ++i) {
        const unsigned short *q_row = q.row(i), *do_row = dout.row(i);
        float dcap;
        const float s = mod(warp_sum(lane_dot<Elem, CPL>(k_row, q_row, d, lane)), mod.row_pos(i),
                            float(j), dcap);
        const float dp = warp_sum(lane_dot<Elem, CPL>(v_row, do_row, d, lane));
        const float pr = fast_exp2(fmaf(s, scale_log2, -lse_log2(*lse.row(i))));
        lane_axpy<Elem, OPL>(acc_dv, pr, do_row, col0, W, d, lane);
        lane_axpy<Elem, OPL>(acc_dk, pr * (dp - *delta.row(i)) * dcap, q_row, col0, W, d, lane);
      }
    }
    lane_store<Elem, OPL>(out_dk + rl * pitch + col0, acc_dk, scale, width, lane);
    lane_store<Elem, OPL>(out_dv + rl * pitch + col0, acc_dv, 1.f, width, lane);
  }
}

}  // namespace cuflash
