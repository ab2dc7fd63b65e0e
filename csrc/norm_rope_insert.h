// The launch parameters of the fused norm + RoPE + KV/index-cache insert
// (csrc/norm_rope_insert.cu), shared with the ctypes binding kernels/cuda_norm_rope_insert.py.
// Every field is 8 bytes (pointers, int64_t, double) so the layout has no padding and the
// ctypes.Structure mirrors it field for field; keep the two in the same order.
// Strides and offsets are in ELEMENTS of the tensor they belong to.
#pragma once

#include <stdint.h>

extern "C" {

struct NriParams {
  // packed rows [N, q | k | v | index_q | index_k], model dtype; k and index_k written in place
  void* rows;
  int64_t row_stride;
  // positions [N] (int32 or int64) and the cos|sin table [max_pos, R] (model dtype)
  const void* positions;
  int64_t pos_stride;
  int64_t pos_is64;
  const void* table;
  int64_t table_stride;
  int64_t max_pos;
  // norm weights [D] (model dtype, contiguous)
  const void* w_q;
  const void* w_k;
  const void* w_iq;
  const void* w_ik;
  // q output [N, Hq, D] (model dtype), strides over tokens and heads (may be the rows)
  void* q_out;
  int64_t q_s0;
  int64_t q_s1;
  // index_q output [N, Hi, D]: model dtype, or uint8 codes when iq_fmt is an fp8 format
  void* iq_out;
  int64_t iq_s0;
  int64_t iq_s1;
  int64_t iq_fmt;
  // main cache, logical [num_pages, Hkv, P, 2D] (strides over pages, heads, offsets)
  void* kv;
  int64_t kv_s0;
  int64_t kv_s1;
  int64_t kv_s2;
  int64_t page_size;
  int64_t num_slots;
  int64_t kv_fmt;
  const void* slots;
  int64_t slot_stride;
  int64_t slots_is64;
  // float32 scales; strides (0, 0) for a scalar, else [Hkv, num_slots] strides
  const float* k_scale;
  int64_t ks_s0;
  int64_t ks_s1;
  const float* v_scale;
  int64_t vs_s0;
  int64_t vs_s1;
  // index cache [num_pages', P', D] (strides over pages and offsets)
  void* ic;
  int64_t ic_s0;
  int64_t ic_s1;
  int64_t ic_page;
  int64_t ic_num_slots;
  int64_t ic_fmt;
  const void* islots;
  int64_t islot_stride;
  int64_t islots_is64;
  // sizes: heads of each kind transformed (hi = 0 / write_ik = 0: not touched), the column
  // of index_k in the row, head dim, rotary dim, activation format (4 bf16, 5 fp16)
  int64_t n;
  int64_t hq;
  int64_t hkv;
  int64_t hi;
  int64_t write_ik;
  int64_t ik_col;
  int64_t head_dim;
  int64_t rotary_dim;
  int64_t act_fmt;
  int64_t heads_per_block;
  double eps;
};

// Launches the kernel on `stream` (a cudaStream_t); returns the cudaError_t as int
// (cudaGetLastError after the launch; invalid parameters give cudaErrorInvalidValue).
int nri_launch(const NriParams* p, void* stream);

// cudaGetErrorString of a code returned by a launch function.
const char* csrc_error_string(int code);
}
