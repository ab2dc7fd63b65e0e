// Variant 1 of the fused insert for bf16 activations: 16-byte lanes, RoPE partners by warp shuffles
// (csrc/nri_vec.cuh).
#include "nri_vec.cuh"

NRI_VEC_ENTRY(nri_launch_vec_shfl_bf16) {
  return nri_dev::launch_vec<nri_dev::XCHG_SHFL, cvt::FMT_BF16>(p, rounds, grid, block, s);
}
