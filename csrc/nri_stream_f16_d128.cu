// Variant 3 of the fused insert for f16 activations and D = 128: the persistent kernel
// with its row loads pipelined through shared memory by cp.async (csrc/nri_stream.cuh).
#include "nri_stream.cuh"

NRI_STREAM_ENTRY(nri_launch_stream_f16_d128) {
  return nri_dev::launch_stream<cvt::FMT_F16, 128>(p, rounds, s);
}
