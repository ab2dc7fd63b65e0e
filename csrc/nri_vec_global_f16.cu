// Variant 2 of the fused insert for fp16 activations: 16-byte lanes, RoPE partners re-read from
// global memory (csrc/nri_vec.cuh).
#include "nri_vec.cuh"

NRI_VEC_ENTRY(nri_launch_vec_global_f16) {
  return nri_dev::launch_vec<nri_dev::XCHG_GLOBAL, cvt::FMT_F16>(p, rounds, grid, block, s);
}
