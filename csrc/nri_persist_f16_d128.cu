// Variant 4 of the fused insert for f16 activations and D = 128: persistent warps over
// (token, head chunk) items (csrc/nri_persist.cuh); variant 5's fallback when R != D / 2.
#include "nri_persist.cuh"

NRI_PERSIST_ENTRY(nri_launch_persist_f16_d128) {
  return nri_dev::launch_persist<cvt::FMT_F16, 128, false>(p, rounds, s);
}
