#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "base/dtype.h"
#include "gtest/gtest.h"

namespace sg {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(HalfTest, KnownValues) {
  EXPECT_EQ(F16ToF32(0x3c00), 1.0f);
  EXPECT_EQ(F16ToF32(0xc000), -2.0f);
  EXPECT_EQ(F16ToF32(0x7bff), 65504.0f);
  EXPECT_EQ(F16ToF32(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(F16ToF32(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(Bits(F16ToF32(0x8000)), 0x80000000u);
  EXPECT_EQ(F16ToF32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(F16ToF32(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(F16ToF32(0x7e00)));
  EXPECT_TRUE(std::isnan(F16ToF32(0x7c01)));

  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(65519.99f), 0x7bff);
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);  // halfway to the next step: rounds to inf
  EXPECT_EQ(F32ToF16(1e10f), 0x7c00);
  EXPECT_EQ(F32ToF16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie rounds to even (zero)
  EXPECT_EQ(F32ToF16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(F32ToF16(std::ldexp(3.0f, -25)), 0x0002);     // 1.5 units: tie to even 2
  EXPECT_EQ(F32ToF16(std::ldexp(1023.5f, -24)), 0x0400);  // rounds up into the normals
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToF16(1e-30f), 0x0000);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties go to the even mantissa.
  EXPECT_EQ(F32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  const uint16_t nan = F32ToF16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
  // A NaN whose payload lives only in the low bits must stay NaN.
  EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(FromBits(0x7f800001u)))));
}

TEST(HalfTest, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = F16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(f)))) << h;
    } else {
      EXPECT_EQ(F32ToF16(f), h) << h;
    }
  }
}

// The definition of round-to-nearest-even, by search: finite non-negative
// halves 0x0000..0x7bff increase with their bit pattern.
uint16_t ReferenceF32ToF16(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double magnitude = std::fabs(static_cast<double>(f));
  if (magnitude >= 65520.0) return sign | 0x7c00;
  uint16_t below = 0;  // largest half <= magnitude
  for (uint16_t step = 0x4000; step > 0; step >>= 1) {
    const uint16_t candidate = below + step;
    if (candidate <= 0x7bff && F16ToF32(candidate) <= magnitude) below = candidate;
  }
  const double low = F16ToF32(below);
  if (low == magnitude) return sign | below;
  const double high = below == 0x7bff ? 65536.0 : F16ToF32(below + 1);
  const double midpoint = (low + high) / 2;
  if (magnitude < midpoint) return sign | below;
  if (magnitude > midpoint) return sign | (below + 1);
  return sign | ((below & 1) ? below + 1 : below);
}

TEST(HalfTest, RoundsToNearestEven) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 300000; ++i) {
    uint32_t bits = any_bits(rng);
    // Every other sample gets an exponent near the half range (2^-31..2^18),
    // where rounding is interesting.
    if (i % 2 == 0) bits = (bits & 0x807fffffu) | ((96u + bits % 50u) << 23);
    // Every fourth: an exact tie, since only 11 significant bits survive.
    if (i % 4 == 0) bits = (bits & ~0x1fffu) | 0x1000u;
    const float f = FromBits(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(F32ToF16(f), ReferenceF32ToF16(f)) << "bits 0x" << std::hex << bits;
  }
}

}  // namespace
}  // namespace sg
