// The launch parameters of the fused norm + RoPE + KV/index-cache insert
// (csrc/norm_rope_insert.cu), shared with the ctypes binding kernels/cuda_norm_rope_insert.py.
// Every field is 8 bytes (pointers, int64_t, double), so the struct has no padding; the
// binding's ctypes.Structure lists the same fields in the same order and checks them at load
// time against nri_params_fields() (generated from the one list below).
// Strides and offsets are in ELEMENTS of the tensor they belong to.
#pragma once

#include <stdint.h>

// X(type, name), in struct order.
#define NRI_PARAMS_FIELDS(X)                                                                 \
  /* packed rows [N, q | k | v | index_q | index_k] (model dtype); k, index_k in place */    \
  X(void*, rows)                                                                            \
  X(int64_t, row_stride)                                                                    \
  /* positions [N] (int32 or int64) and the cos|sin table [max_pos, R] (model dtype) */      \
  X(const void*, positions)                                                                 \
  X(int64_t, pos_stride)                                                                    \
  X(int64_t, pos_is64)                                                                      \
  X(const void*, table)                                                                     \
  X(int64_t, table_stride)                                                                  \
  X(int64_t, max_pos)                                                                       \
  /* norm weights [D] (model dtype, contiguous) */                                          \
  X(const void*, w_q)                                                                       \
  X(const void*, w_k)                                                                       \
  X(const void*, w_iq)                                                                      \
  X(const void*, w_ik)                                                                      \
  /* q output [N, Hq, D] (model dtype; may be the rows), token and head strides */           \
  X(void*, q_out)                                                                           \
  X(int64_t, q_s0)                                                                          \
  X(int64_t, q_s1)                                                                          \
  /* index_q output [N, Hi, D]: model dtype, or uint8 codes when iq_fmt is fp8 */            \
  X(void*, iq_out)                                                                          \
  X(int64_t, iq_s0)                                                                         \
  X(int64_t, iq_s1)                                                                         \
  X(int64_t, iq_fmt)                                                                        \
  /* main cache, logical [num_pages, Hkv, P, 2D]: page, head and offset strides */           \
  X(void*, kv)                                                                              \
  X(int64_t, kv_s0)                                                                         \
  X(int64_t, kv_s1)                                                                         \
  X(int64_t, kv_s2)                                                                         \
  X(int64_t, page_size)                                                                     \
  X(int64_t, num_slots)                                                                     \
  X(int64_t, kv_fmt)                                                                        \
  X(const void*, slots)                                                                     \
  X(int64_t, slot_stride)                                                                   \
  X(int64_t, slots_is64)                                                                    \
  /* float32 scales: strides (0, 0) for a scalar, else those of [Hkv, num_slots] */          \
  X(const float*, k_scale)                                                                  \
  X(int64_t, ks_s0)                                                                         \
  X(int64_t, ks_s1)                                                                         \
  X(const float*, v_scale)                                                                  \
  X(int64_t, vs_s0)                                                                         \
  X(int64_t, vs_s1)                                                                         \
  /* index cache [num_pages', P', D]: page and offset strides */                            \
  X(void*, ic)                                                                              \
  X(int64_t, ic_s0)                                                                         \
  X(int64_t, ic_s1)                                                                         \
  X(int64_t, ic_page)                                                                       \
  X(int64_t, ic_num_slots)                                                                  \
  X(int64_t, ic_fmt)                                                                        \
  X(const void*, islots)                                                                    \
  X(int64_t, islot_stride)                                                                  \
  X(int64_t, islots_is64)                                                                   \
  /* sizes: heads transformed per kind (hi = 0 / write_ik = 0: those heads untouched), */   \
  /* the row column of index_k, D, R, activation format (4 bf16, 5 fp16), heads/block */    \
  X(int64_t, n)                                                                             \
  X(int64_t, hq)                                                                            \
  X(int64_t, hkv)                                                                           \
  X(int64_t, hi)                                                                            \
  X(int64_t, write_ik)                                                                      \
  X(int64_t, ik_col)                                                                        \
  X(int64_t, head_dim)                                                                      \
  X(int64_t, rotary_dim)                                                                    \
  X(int64_t, act_fmt)                                                                       \
  X(int64_t, heads_per_block)                                                               \
  /* launch variant (0: a warp per head, the original kernel; 1: 16-byte lanes, RoPE    */   \
  /* partners by warp shuffles; 2: 16-byte lanes, partners re-read from global memory;    */   \
  /* 3: persistent, rows pipelined through shared memory by cp.async), warps per block,   */   \
  /* heads per warp, grid order, pipeline stages of variant 3 (0 for any: the default)   */   \
  X(int64_t, variant)                                                                       \
  X(int64_t, warps_per_block)                                                               \
  X(int64_t, heads_per_warp)                                                                \
  X(int64_t, heads_fast)                                                                    \
  X(int64_t, stages)                                                                        \
  X(double, eps)

extern "C" {

struct NriParams {
#define NRI_DECLARE_FIELD(type, name) type name;
  NRI_PARAMS_FIELDS(NRI_DECLARE_FIELD)
#undef NRI_DECLARE_FIELD
};

// Launches the kernel on `stream` (a cudaStream_t); returns the cudaError_t as int
// (cudaGetLastError after the launch; invalid parameters give cudaErrorInvalidValue).
int nri_launch(const NriParams* p, void* stream);

// Variant 3's dynamic shared memory per block for these parameters (launch-shape fields 0:
// the defaults, 4 warps, 2 head rounds, 3 stages), -1 for an unsupported head dim; and the
// current device's opt-in limit per block (returns the cudaError_t).
int64_t nri_stream_smem_bytes(const NriParams* p);
int nri_device_smem_optin(int64_t* bytes);

// "type:name,type:name,..." of NriParams in order, and sizeof(NriParams).
const char* nri_params_fields(void);
int64_t nri_params_size(void);

// cudaGetErrorString of a code returned by a launch function.
const char* csrc_error_string(int code);
}
