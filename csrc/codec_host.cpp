// Host build of the conversions (g++ -O2 -shared -fPIC -Icsrc): see codec_api.h.
#include "codec_api.h"

#include "fp8_convert.h"

extern "C" {

void cvt_encode_fp8(const float* x, uint8_t* out, int64_t n, int fmt, int satfinite) {
  for (int64_t i = 0; i < n; ++i) out[i] = cvt::fp8_encode(x[i], fmt, satfinite != 0);
}

void cvt_decode_fp8(const uint8_t* c, float* out, int64_t n, int fmt) {
  for (int64_t i = 0; i < n; ++i) out[i] = cvt::fp8_decode(c[i], fmt);
}

void cvt_round_half(const float* x, uint16_t* out, int64_t n, int fmt) {
  for (int64_t i = 0; i < n; ++i) out[i] = cvt::half_from_f32(x[i], fmt);
}

void cvt_decode_half(const uint16_t* c, float* out, int64_t n, int fmt) {
  for (int64_t i = 0; i < n; ++i) out[i] = cvt::half_to_f32(c[i], fmt);
}
}
