// Variant 3 of the fused insert (contract.md sections 3 and 4, the contract of
// csrc/norm_rope_insert.cu): a PERSISTENT kernel whose row loads are software-pipelined
// through shared memory with cp.async, so that the bytes in flight cost no registers.
// Instantiated by csrc/nri_stream_{bf16,f16}.cu (one translation unit per activation
// format, compiled in parallel); simulated on the CPU by csrc/nri_stream_host.cpp.
//
// Why: variants 0-2 give every (token, head block) its own short-lived block; their loads
// in flight live in registers, and the register caps (24-32 warps per SM) leave DRAM
// less than half busy. Here a block owns whole tokens for the whole launch and keeps S - 1 of
// them in flight as cp.async copies into shared memory while it computes another.
//
// Grid: min(N, SMs x resident blocks per SM) blocks (cudaOccupancyMaxActiveBlocksPerMultiprocessor
// of the instantiation with its dynamic shared memory), W warps each (warps_per_block:
// 1, 2, 4, 8). Work item = one token; block b takes tokens b, b + gridDim.x, ...
//
// Pipeline (S = stages, 2..kStreamMaxStages; item u of the block goes to stage u % S):
//   prologue: issue items 0 .. S-2, one cp.async group each (empty groups past the end);
//   iteration t: cp.async.wait_group S-2 (item t has landed, for this thread's copies);
//                __syncthreads (everyone's copies visible; everyone done with item t-1,
//                whose stage is the one refilled next);
//                issue item t+S-1 into stage (t+S-1) % S, commit (a group even when empty);
//                compute item t from stage t % S.
// One block barrier per token. Issuing an item = 16-byte cp.async.cg copies of the row
// bytes the token needs: q | k | v | index_q (contiguous in the row; index_q only when
// transformed) and index_k (when written), the table row of its position (16-byte copies
// when R % 8 == 0 and the table is 16-byte aligned, else 4-byte cp.async.ca; a position
// outside the table copies nothing: the src-size 0 form zero-fills), the slot and index
// slot (4- or 8-byte cp.async.ca), and a flag "position inside the table" (a plain shared
// store). The position itself is read one item ahead into a register by the threads that
// copy the table (its latency overlaps a token's compute).
//
// Stage layout (bytes): [row: (Hq + 2 Hkv + Hi) D codes as in the row, then index_k's D |
// table row, R codes rounded up to 16 bytes | slot (8) | index slot (8) | position flag
// (4) | pad to 32]. Before the stages: 1 + w of the four kinds as fp32 [4][D] (once per
// block) and each warp's scratch of U x 32 lanes x 8 fp32 (the normalised values of the
// heads in flight, for the RoPE partners). Model row (Hq 64, Hkv 4, Hi 4 + index_k, D 128,
// R 64): 19,872 bytes per stage; S = 3, W = 4, U = 2: 69,856 bytes, 3 blocks per SM.
//
// Compute (per token): the lane layout of csrc/nri_vec.cuh (lane l of a head's group holds
// dims c = 8 l .. c + 7, a head D / 8 lanes, G = 256 / D heads per warp instruction); each
// warp takes U x G heads per pass (heads_per_warp = G U, U = 1, 2, 4, processed together
// for instruction-level parallelism), the block W G U heads per pass, passes until the
// token's heads are done. A lane reads its 8 x codes from the stage (one 16-byte shared
// load), cos and signed sin of its dims once per token. Arithmetic exactly that of variants
// 1 and 2 (explicitly rounded operations, the sum of squares per lane in dim order with
// __fmaf_rn then the butterfly over the head's lanes, rsqrtf, n = (x r) (1 + w),
// y = fma(n', s, n c)): BIT-IDENTICAL outputs (1 + w is the same fp32 value whether formed
// per use or once). RoPE partners: every lane writes its normalised values to the warp's
// scratch (two 16-byte stores, [half][lane] so conflict-free), __syncwarp, and reads its
// partner dims d +- R/2 back (two 16-byte loads when R/2 % 8 == 0, else element by
// element): any even R, no shuffles; a __syncwarp before the writes orders them after the
// previous pass's reads. Stores go straight to global memory from registers through
// store_head (csrc/nri_vec.cuh, shared with variants 1 and 2): 16-byte where aligned, q to
// q_out, k and index_k in place in the row, K/V and index_k into the caches at the slots
// read from the stage (negative / out-of-range slots write nothing; V from the stage).
//
// Requirements (nri_launch checks them, stream_eligible, and otherwise runs variant 1 with
// its default shape: the same bits): rows 16-byte aligned with a row stride of a multiple
// of 8 elements; table 4-byte aligned with an even row stride; slot arrays aligned to their
// element size. Shared memory S x stage + the rest must fit the device's opt-in limit per
// block (227 KB on sm_90): with stages = 0 (default) nri_launch takes the largest S <= 3
// that fits (variant 1 when not even S = 2 fits); an explicit S that does not fit is
// rejected (cudaErrorInvalidValue; the binding raises ValueError naming num_stages).
#pragma once

#ifdef __CUDACC__
#include <mutex>
#endif

#include "nri_vec.cuh"

namespace nri_dev {

constexpr int kStreamMaxWarps = 8;
constexpr int kStreamMaxStages = 8;
constexpr int kStreamDefaultWarps = 4;
constexpr int kStreamDefaultStages = 3;
constexpr int kStreamRounds = 2;  // head rounds per warp and pass: the only instantiation
constexpr int kStreamScratch = 32 * nri::kChunk;  // fp32 per warp and head round: 1 KB
constexpr int kStreamScalarBytes = 32;            // slot, index slot, position flag, pad

// Byte / element geometry of one launch (all fits in int: nri_launch bounds the row width
// and the shared memory).
struct StreamGeo {
  int main_elems;   // (Hq + 2 Hkv + Hi) D: q | k | v | index_q, at their row columns
  int row_chunks;   // 16-byte copies of the row part: (main_elems + write_ik D) / 8
  int tab_off;      // byte offset of the table row in a stage
  int tab_chunks;   // copies of the table row: R / 8 of 16 bytes, or R / 2 of 4 bytes
  int scal_off;     // byte offset of slot (+0), index slot (+8), position flag (+16)
  int stage_bytes;  // one stage, a multiple of 16
  int head_bytes;   // weights [4][D] + scratch [warps][rounds][kStreamScratch], fp32
};

NRI_HD bool stream_table16(const NriParams& p) {
  return p.rotary_dim % 8 == 0 && reinterpret_cast<uintptr_t>(p.table) % 16 == 0 &&
         p.table_stride % 8 == 0;
}

NRI_HD StreamGeo stream_geo(const NriParams& p, int warps, int rounds) {
  StreamGeo g;
  const int d = (int)p.head_dim;
  g.main_elems = (int)((p.hq + 2 * p.hkv + p.hi) * p.head_dim);
  g.row_chunks = (g.main_elems + (int)p.write_ik * d) / 8;
  g.tab_off = g.row_chunks * 16;
  const int rot = (int)p.rotary_dim;
  g.tab_chunks = stream_table16(p) ? rot / 8 : rot / 2;
  g.scal_off = g.tab_off + (rot * 2 + 15) / 16 * 16;
  g.stage_bytes = g.scal_off + kStreamScalarBytes;
  g.head_bytes = (4 * d + warps * rounds * kStreamScratch) * 4;
  return g;
}

// Dynamic shared memory of a launch (64-bit: called on unchecked sizes).
inline int64_t stream_smem_bytes(const NriParams& p, int64_t warps, int64_t rounds,
                                 int64_t stages) {
  const int64_t row = ((p.hq + 2 * p.hkv + p.hi + p.write_ik) * p.head_dim) * 2;
  const int64_t stage = row + (p.rotary_dim * 2 + 15) / 16 * 16 + kStreamScalarBytes;
  return (4 * p.head_dim + warps * rounds * kStreamScratch) * 4 + stages * stage;
}

// The alignments the cp.async copies need (else nri_launch runs variant 1).
inline bool stream_eligible(const NriParams& p) {
  const auto al = [](const void* q, uintptr_t a) {
    return reinterpret_cast<uintptr_t>(q) % a == 0;
  };
  const uintptr_t sb = p.slots_is64 ? 8 : 4, ib = p.islots_is64 ? 8 : 4;
  return al(p.rows, 16) && p.row_stride % 8 == 0 && p.ik_col % 8 == 0 && al(p.table, 4) &&
         p.table_stride % 2 == 0 && al(p.slots, sb) && (!p.write_ik || al(p.islots, ib));
}

// ------------------------------------------------------------------- cp.async helpers
// On the host (csrc/cuda_sim.h) the copies complete at once.

__device__ __forceinline__ void cp_async16(void* dst, const void* src, uint32_t src_bytes) {
#ifdef __CUDA_ARCH__
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(src_bytes)
               : "memory");
#else
  memset(dst, 0, 16);
  memcpy(dst, src, src_bytes);
#endif
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src, uint32_t src_bytes) {
#ifdef __CUDA_ARCH__
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src),
               "r"(src_bytes)
               : "memory");
#else
  memset(dst, 0, 4);
  memcpy(dst, src, src_bytes);
#endif
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
#ifdef __CUDA_ARCH__
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(d), "l"(src) : "memory");
#else
  memcpy(dst, src, 8);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// cp.async.wait_group n (an immediate): n = S - 2, uniform over the launch.
__device__ __forceinline__ void cp_async_wait(int n) {
#ifdef __CUDA_ARCH__
  switch (n) {
#define NRI_WAIT_CASE(k) \
  case k: asm volatile("cp.async.wait_group " #k ";\n" ::: "memory"); break;
    NRI_WAIT_CASE(0)
    NRI_WAIT_CASE(1)
    NRI_WAIT_CASE(2)
    NRI_WAIT_CASE(3)
    NRI_WAIT_CASE(4)
    NRI_WAIT_CASE(5)
    default: asm volatile("cp.async.wait_group 6;\n" ::: "memory"); break;
#undef NRI_WAIT_CASE
  }
#else
  (void)n;
#endif
}

#ifdef __CUDACC__
#define NRI_DYNAMIC_SMEM(name) extern __shared__ uint4 name[]
#else
#define NRI_DYNAMIC_SMEM(name) uint4* const name = reinterpret_cast<uint4*>(cuda_sim::dynamic_smem())
#endif

// ---------------------------------------------------------------------------- kernel

// Issues the copies of token tok (position pos, read by the threads with table chunks)
// into stage st. Every thread of the block calls it.
__device__ __forceinline__ void stream_issue(const NriParams& p, const StreamGeo& g,
                                             bool tab16, char* st, int64_t tok, int64_t pos) {
  const int tid = (int)threadIdx.x, nt = (int)blockDim.x;
  const uint16_t* row = static_cast<const uint16_t*>(p.rows) + tok * p.row_stride;
  for (int k = tid; k < g.row_chunks; k += nt) {
    const int e = k * 8;
    const int src = e < g.main_elems ? e : (int)p.ik_col + (e - g.main_elems);
    cp_async16(st + 2 * e, row + src, 16);
  }
  if (tid < g.tab_chunks) {
    const bool ok = pos >= 0 && pos < p.max_pos;
    // A position outside the table copies no byte (src-size 0: zero fill) from row 0.
    const uint16_t* trow = static_cast<const uint16_t*>(p.table) + (ok ? pos : 0) * p.table_stride;
    if (tab16) {
      for (int k = tid; k < g.tab_chunks; k += nt)
        cp_async16(st + g.tab_off + 16 * k, trow + 8 * k, ok ? 16u : 0u);
    } else {
      for (int k = tid; k < g.tab_chunks; k += nt)
        cp_async4(st + g.tab_off + 4 * k, trow + 2 * k, ok ? 4u : 0u);
    }
    if (tid == 0) *reinterpret_cast<int*>(st + g.scal_off + 16) = ok ? 1 : 0;
  }
  if (tid == nt - 1) {
    char* dst = st + g.scal_off;
    if (p.slots_is64)
      cp_async8(dst, static_cast<const int64_t*>(p.slots) + tok * p.slot_stride);
    else
      cp_async4(dst, static_cast<const int32_t*>(p.slots) + tok * p.slot_stride, 4);
    if (p.write_ik) {
      if (p.islots_is64)
        cp_async8(dst + 8, static_cast<const int64_t*>(p.islots) + tok * p.islot_stride);
      else
        cp_async4(dst + 8, static_cast<const int32_t*>(p.islots) + tok * p.islot_stride, 4);
    }
  }
}

// The token index slot of a stage (4 or 8 bytes as copied).
__device__ __forceinline__ int64_t stage_index(const char* q, int64_t is64) {
  return is64 ? *reinterpret_cast<const int64_t*>(q) : *reinterpret_cast<const int32_t*>(q);
}

// The normalised values of the partner dims of the lane's dims c .. c + 7 from the warp's
// scratch of one head round ([half][lane] float4s; the head's lanes are grp * LPH ..).
template <int LPH>
__device__ __forceinline__ void scratch_partners(const float* scr, int grp, int c, int rot,
                                                 int hr, float (&np)[nri::kChunk]) {
  constexpr int C = nri::kChunk;
  if (c >= rot) {
#pragma unroll
    for (int j = 0; j < C; ++j) np[j] = 0.f;
  } else if ((hr & 7) == 0) {  // the 8 partners are one lane's 8 values
    const int src = grp * LPH + (nri::partner_chunk(c, hr) >> 3);
    const float4 a = reinterpret_cast<const float4*>(scr)[src];
    const float4 b = reinterpret_cast<const float4*>(scr)[32 + src];
    np[0] = a.x, np[1] = a.y, np[2] = a.z, np[3] = a.w;
    np[4] = b.x, np[5] = b.y, np[6] = b.z, np[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < C; ++j) {
      const int d = c + j;
      if (d < rot) {
        const int pd = nri::partner_dim(d, hr);
        const int src = grp * LPH + (pd >> 3), e = pd & 7;
        np[j] = scr[((e >> 2) * 32 + src) * 4 + (e & 3)];
      } else {
        np[j] = 0.f;
      }
    }
  }
}

// Norm + RoPE + stores of token tok from stage st.
template <int ACT, int D, int U>
__device__ __forceinline__ void stream_compute(const NriParams& p, const StreamGeo& g,
                                               const char* st, int64_t tok, const float* w1,
                                               float* scr) {
  constexpr int C = nri::kChunk;
  constexpr int LPH = nri::Geo<D>::kLanesPerHead;
  constexpr int G = nri::Geo<D>::kHeadsPerPass;
  constexpr int HPW = G * U;
  const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
  const int nwarps = (int)blockDim.x >> 5;
  const int grp = lane / LPH, l = lane % LPH, c = l * C;
  const int rot = (int)p.rotary_dim, hr = rot >> 1;
  const int total = (int)(p.hq + p.hkv + p.hi + p.write_ik);
  const uint16_t* srow = reinterpret_cast<const uint16_t*>(st);
  const uint16_t* stab = reinterpret_cast<const uint16_t*>(st + g.tab_off);

  // cos and signed sin of the lane's dims (as variant 1: 0 for pass-through dims and for
  // positions outside the table; the first half's sine negated).
  float cs[C], sn[C];
#pragma unroll
  for (int j = 0; j < C; ++j) cs[j] = sn[j] = 0.f;
  if (*reinterpret_cast<const int*>(st + g.scal_off + 16) && c < rot) {
    uint32_t cw[4] = {0, 0, 0, 0}, sw[4] = {0, 0, 0, 0};
    if ((hr & 7) == 0) {  // the lane's 8 dims lie in one half: 16-byte aligned in the stage
      const int ci = nri::cos_chunk(c, hr);
      const uint4 a = *reinterpret_cast<const uint4*>(stab + ci);
      const uint4 b = *reinterpret_cast<const uint4*>(stab + hr + ci);
      cw[0] = a.x, cw[1] = a.y, cw[2] = a.z, cw[3] = a.w;
      sw[0] = b.x, sw[1] = b.y, sw[2] = b.z, sw[3] = b.w;
    } else {
#pragma unroll
      for (int j = 0; j < C; ++j) {
        const int ci = nri::cos_index(c + j, hr);
        const bool in = c + j < rot;
        cw[j >> 1] |= (in ? (uint32_t)stab[ci] : 0u) << (16 * (j & 1));
        sw[j >> 1] |= (in ? (uint32_t)stab[hr + ci] : 0u) << (16 * (j & 1));
      }
    }
#pragma unroll
    for (int j = 0; j < C; ++j)
      if (nri::rope_role(c + j, hr) == 0) sw[j >> 1] ^= 0x8000u << (16 * (j & 1));
#pragma unroll
    for (int j = 0; j < C; ++j) cs[j] = widen<ACT>(cw, j), sn[j] = widen<ACT>(sw, j);
  }
  const int64_t slot = stage_index(st + g.scal_off, p.slots_is64);
  const int64_t islot = p.write_ik ? stage_index(st + g.scal_off + 8, p.islots_is64) : -1;
  uint16_t* row = static_cast<uint16_t*>(p.rows) + tok * p.row_stride;
  const float eps = (float)p.eps;

  // Warp-uniform loop: every lane makes the same passes (full-mask shuffles, __syncwarp).
  for (int first = warp * HPW; first < total; first += nwarps * HPW) {
    HeadRef hd[U];
    uint32_t xb[U][4];
    float ss[U], n[U][C];
#pragma unroll
    for (int r = 0; r < U; ++r) {
      hd[r] = head_ref<D>(p, nri::round_head(first, r, grp, G), total);
      const int scol = hd[r].kind == 3 ? g.main_elems : hd[r].col;  // none: column 0
      const uint4 v = *reinterpret_cast<const uint4*>(srow + scol + c);
      xb[r][0] = v.x, xb[r][1] = v.y, xb[r][2] = v.z, xb[r][3] = v.w;
      ss[r] = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) {
        const float x = widen<ACT>(xb[r], j);
        ss[r] = __fmaf_rn(x, x, ss[r]);
      }
    }
#pragma unroll
    for (int o = LPH / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int r = 0; r < U; ++r) ss[r] = __fadd_rn(ss[r], __shfl_xor_sync(0xFFFFFFFFu, ss[r], o));
    }
#pragma unroll
    for (int r = 0; r < U; ++r) {
      const float rs = rsqrtf(__fadd_rn(__fmul_rn(ss[r], 1.f / D), eps));  // / D: exact
      const float* w = w1 + (hd[r].kind > 0 ? hd[r].kind : 0) * D + c;
      const float4 wa = *reinterpret_cast<const float4*>(w);
      const float4 wb = *reinterpret_cast<const float4*>(w + 4);
      const float wv[C] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
      for (int j = 0; j < C; ++j) n[r][j] = __fmul_rn(__fmul_rn(widen<ACT>(xb[r], j), rs), wv[j]);
    }
    __syncwarp();  // the previous pass's partner reads are done before the scratch is rewritten
#pragma unroll
    for (int r = 0; r < U; ++r) {
      float4* s4 = reinterpret_cast<float4*>(scr + r * kStreamScratch);
      s4[lane] = make_float4(n[r][0], n[r][1], n[r][2], n[r][3]);
      s4[32 + lane] = make_float4(n[r][4], n[r][5], n[r][6], n[r][7]);
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < U; ++r) {
      float np[C], y[C];
      scratch_partners<LPH>(scr + r * kStreamScratch, grp, c, rot, hr, np);
#pragma unroll
      for (int j = 0; j < C; ++j)
        y[j] = nri::rope_role(c + j, hr) == 2 ? n[r][j]
                                               : __fmaf_rn(np[j], sn[j], __fmul_rn(n[r][j], cs[j]));
      const int kind = hd[r].kind;
      if (kind < 0) continue;
      int64_t kv_base = -1, ic_base = -1;
      uint32_t vb[4] = {0, 0, 0, 0};
      if (kind == 1) {
        const uint4 v = *reinterpret_cast<const uint4*>(srow + (p.hq + p.hkv + hd[r].h) * D + c);
        vb[0] = v.x, vb[1] = v.y, vb[2] = v.z, vb[3] = v.w;
        if (slot >= 0 && slot < p.num_slots)
          kv_base = (slot / p.page_size) * p.kv_s0 + (slot % p.page_size) * p.kv_s2;
      } else if (kind == 3) {
        if (islot >= 0 && islot < p.ic_num_slots)
          ic_base = (islot / p.ic_page) * p.ic_s0 + (islot % p.ic_page) * p.ic_s1;
      }
      store_head<ACT, D>(p, hd[r], tok, row, c, y, vb, kv_scales(p, hd[r], slot, kv_base),
                         kv_base, ic_base);
    }
  }
}

// Blocks of kStreamMaxWarps warps at most, at least 2 of them per SM by registers: at most
// 128 registers, where ptxas (CUDA 13.0, sm_90) spills nothing for 1, 2 or 4 head rounds
// (without a minimum it capped 2 rounds at 80 registers and spilled). The shared memory
// limits the resident blocks anyway (3 per SM at the model row with 3 stages and 4 warps).
template <int ACT, int D, int U>
__global__ void __launch_bounds__(kStreamMaxWarps * 32, 2) nri_stream_kernel(const NriParams p) {
  NRI_DYNAMIC_SMEM(smem_raw);
  char* const smem = reinterpret_cast<char*>(smem_raw);
  const int tid = (int)threadIdx.x, nt = (int)blockDim.x;
  const int warp = tid >> 5, nwarps = nt >> 5;
  const int S = (int)p.stages;
  const StreamGeo g = stream_geo(p, nwarps, U);
  const bool tab16 = stream_table16(p);
  float* const w1 = reinterpret_cast<float*>(smem);
  float* const scr = w1 + 4 * D + warp * U * kStreamScratch;
  char* const stage0 = smem + g.head_bytes;

  // 1 + w of the four kinds (kinds without heads: 1; never read).
  for (int i = tid; i < 4 * D; i += nt) {
    const int kind = i / D;
    const bool has = kind < 2 || (kind == 2 ? p.hi > 0 : p.write_ik != 0);
    w1[i] = has ? __fadd_rn(1.f, cvt::half_to_f32(weight_of(p, kind)[i - kind * D], ACT)) : 1.f;
  }

  const int64_t n = p.n, step = gridDim.x, tok0 = blockIdx.x;
  const int64_t count = tok0 < n ? (n - 1 - tok0) / step + 1 : 0;
  const bool tab_thread = tid < g.tab_chunks;
  for (int s = 0; s < S - 1; ++s) {
    if (s < count) {
      const int64_t tok = tok0 + s * step;
      const int64_t pos = tab_thread ? position_of(p, tok) : 0;
      stream_issue(p, g, tab16, stage0 + s * g.stage_bytes, tok, pos);
    }
    cp_async_commit();
  }
  int64_t pos_next = 0;
  if (tab_thread && S - 1 < count)
    pos_next = position_of(p, tok0 + (S - 1) * step);

  int s_cur = 0, s_next = S - 1;
  for (int64_t t = 0; t < count; ++t) {
    cp_async_wait(S - 2);
    __syncthreads();
    const int64_t u = t + S - 1;
    if (u < count) stream_issue(p, g, tab16, stage0 + s_next * g.stage_bytes, tok0 + u * step, pos_next);
    cp_async_commit();
    if (tab_thread && u + 1 < count)
      pos_next = position_of(p, tok0 + (u + 1) * step);
    stream_compute<ACT, D, U>(p, g, stage0 + s_cur * g.stage_bytes, tok0 + t * step, w1, scr);
    s_cur = s_cur + 1 == S ? 0 : s_cur + 1;
    s_next = s_next + 1 == S ? 0 : s_next + 1;
  }
}

#ifdef __CUDACC__
constexpr int kStreamMaxDevices = 64;

// The device's SM count and opt-in shared memory per block (the current device).
inline cudaError_t stream_device_limits(int* sms, int* smem_optin) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  return e;
}

// The persistent grid's size for an instantiation (SMs x resident blocks, from
// cudaOccupancyMaxActiveBlocksPerMultiprocessor with its dynamic shared memory), after
// raising its dynamic shared memory limit where needed (never lowered: a concurrent launch
// may need more). Cached per instantiation for the last (device, threads, bytes), so that a
// launch inside a CUDA graph capture after a first eager one only queries the device.
template <int ACT, int D, int U>
cudaError_t stream_grid_cap(int threads, int64_t smem, int64_t* cap) {
  static std::mutex mu;
  static int raised[kStreamMaxDevices] = {};  // dynamic shared memory limit set, per device
  static int c_dev = -1, c_threads = 0;
  static int64_t c_smem = -1, c_cap = 0;
  int dev = 0, sms = 0, optin = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  if (dev == c_dev && threads == c_threads && smem == c_smem) {
    *cap = c_cap;
    return cudaSuccess;
  }
  e = stream_device_limits(&sms, &optin);
  if (e != cudaSuccess) return e;
  if (smem > optin || dev < 0 || dev >= kStreamMaxDevices) return cudaErrorInvalidValue;
  void (*kernel)(const NriParams) = nri_stream_kernel<ACT, D, U>;
  if (smem > 48 * 1024 && smem > raised[dev]) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    raised[dev] = (int)smem;
  }
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, (size_t)smem);
  if (e != cudaSuccess) return e;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  c_dev = dev, c_threads = threads, c_smem = smem, c_cap = (int64_t)sms * per_sm;
  *cap = c_cap;
  return cudaSuccess;
}

// Launches one instantiation: the persistent grid min(N, SMs x resident blocks) with
// p.stages stages (explicit here), every CUDA return code checked.
template <int ACT, int D, int U>
cudaError_t launch_stream_k(const NriParams& p, cudaStream_t s) {
  const int threads = (int)p.warps_per_block * 32;
  const int64_t smem = stream_smem_bytes(p, p.warps_per_block, U, p.stages);
  int64_t cap = 0;
  const cudaError_t e = stream_grid_cap<ACT, D, U>(threads, smem, &cap);
  if (e != cudaSuccess) return e;
  const unsigned grid = (unsigned)(p.n < cap ? p.n : cap);
  nri_stream_kernel<ACT, D, U><<<grid, threads, (size_t)smem, s>>>(p);
  return cudaGetLastError();
}

// One (activation format, D) pair per translation unit (csrc/nri_stream_{bf16,f16}_d{64,128,
// 256}.cu, compiled in parallel), 2 head rounds only (the default; each other count would
// add a third of the cold build's work for a knob no sweep picked).
template <int ACT, int D>
cudaError_t launch_stream(const NriParams& p, int rounds, cudaStream_t s) {
  return rounds == kStreamRounds ? launch_stream_k<ACT, D, kStreamRounds>(p, s)
                                 : cudaErrorInvalidValue;
}
#endif  // __CUDACC__ (csrc/nri_stream_host.cpp runs the kernel on the CPU instead)

}  // namespace nri_dev
