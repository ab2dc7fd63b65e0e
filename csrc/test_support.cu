// GPU entry points for the tests (see codec_api.h): the conversions of fp8_convert.h run
// elementwise on the device, and a deliberately invalid launch for the error path.
#include <cuda_runtime.h>

#include "codec_api.h"
#include "fp8_convert.h"

namespace {

__global__ void cvt_kernel(int op, const void* in, void* out, int64_t n, int fmt, bool sat) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  switch (op) {
    case 0:
      static_cast<uint8_t*>(out)[i] = cvt::fp8_encode(static_cast<const float*>(in)[i], fmt, sat);
      break;
    case 1:
      static_cast<uint8_t*>(out)[i] = cvt::fp8_encode_sw(static_cast<const float*>(in)[i], fmt, sat);
      break;
    case 2:
      static_cast<float*>(out)[i] = cvt::fp8_decode(static_cast<const uint8_t*>(in)[i], fmt);
      break;
    case 3:
      static_cast<uint16_t*>(out)[i] = cvt::half_from_f32(static_cast<const float*>(in)[i], fmt);
      break;
    default:
      static_cast<float*>(out)[i] = cvt::half_to_f32(static_cast<const uint16_t*>(in)[i], fmt);
      break;
  }
}

__global__ void never_runs(int* p) {
  if (p) *p = 1;
}

}  // namespace

extern "C" int cvt_device(int op, const void* in, void* out, int64_t n, int fmt, int satfinite,
                          void* stream) {
  const bool fmt_ok = op <= 2 ? cvt::is_fp8(fmt) : (fmt == cvt::FMT_BF16 || fmt == cvt::FMT_F16);
  if (op < 0 || op > 4 || !fmt_ok || n < 0 || (n > 0 && (in == nullptr || out == nullptr)))
    return (int)cudaErrorInvalidValue;
  if (n == 0) return (int)cudaSuccess;
  const int64_t blocks = (n + 255) / 256;
  if (blocks > 0x7FFFFFFF) return (int)cudaErrorInvalidValue;
  cvt_kernel<<<(unsigned)blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      op, in, out, n, fmt, satfinite != 0);
  return (int)cudaGetLastError();
}

extern "C" int csrc_test_bad_launch(void* stream) {
  // 4096 threads per block exceeds every GPU's limit of 1024: the launch is rejected before
  // anything runs (a non-sticky error; the context stays usable).
  never_runs<<<1, 4096, 0, static_cast<cudaStream_t>(stream)>>>(nullptr);
  return (int)cudaGetLastError();
}
