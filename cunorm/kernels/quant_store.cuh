// quant_store.cuh: the quantizing store stage (stages.cuh describes the
// stages and their members).
//
//   QuantStore<P, FLAGS, Q, SCALING, GROUP>
//       AffineStore's value over a scale (times its reciprocal), rounded to
//       nearest even in Q (e4m3_t, e5m2_t or signed char) and saturated to
//       Q's finite range; the scale the caller's (SCALING kStaticScale) or
//       the row's max |value| / Q's largest, floored (kRowScale;
//       kRowScaleBounded: max |value| capped by the caller's bound first);
//       GROUP > 0: one scale each GROUP elements of the row in place of one
//       a row (block formats with their own scale type would be further Q
//       and SCALING values)
#pragma once
#include "stages.cuh"

namespace cunorm {

// One-byte storage types of the quantizing store, as raw bits.
struct e4m3_t { unsigned char bits; };  // OCP FP8 E4M3 (finite, NaN 0x7f): largest 448
struct e5m2_t { unsigned char bits; };  // OCP FP8 E5M2 (IEEE-like): largest finite 57344

template <class Q> struct QuantMax;
template <> struct QuantMax<e4m3_t> { static constexpr float value = 448.0f; };
template <> struct QuantMax<e5m2_t> { static constexpr float value = 57344.0f; };
template <> struct QuantMax<signed char> { static constexpr float value = 127.0f; };

// Which FP8 format a storage type is (0: not FP8).
template <class Q> struct Fp8Kind { static constexpr int value = 0; };
template <> struct Fp8Kind<e4m3_t> { static constexpr int value = 1; };
template <> struct Fp8Kind<e5m2_t> { static constexpr int value = 2; };

// v rounded to nearest even in the format, saturated to its finite range
// (NaN stays NaN; int8 has none: NaN becomes 0). sm_89+ converts with one
// instruction; older GPUs with the same rounding in integer arithmetic.
__device__ __forceinline__ unsigned char fp8_bits_soft(float v, int mantissa_bits, int bias, unsigned max_bits) {
    const unsigned b = __float_as_uint(v);
    const unsigned sign = (b >> 24) & 0x80u;
    const float a = fabsf(v);
    if (a != a) return static_cast<unsigned char>(sign | 0x7fu);
    // the smallest normal: 2^(1 - bias); below it, steps of 2^(1 - bias - mantissa_bits)
    const float min_normal = __uint_as_float(static_cast<unsigned>(128 - bias) << 23);
    unsigned q;
    if (a < min_normal) {
        const float steps = a * __uint_as_float(static_cast<unsigned>(127 + bias - 1 + mantissa_bits) << 23);
        q = static_cast<unsigned>(__float2int_rn(steps));  // (a carry to the smallest normal encodes as one)
    } else {
        const unsigned drop = 23 - mantissa_bits;
        const unsigned ab = b & 0x7fffffffu;
        const unsigned rounded = ab + ((1u << (drop - 1)) - 1) + ((ab >> drop) & 1u);
        q = ((rounded >> 23) - 127 + bias) << mantissa_bits | ((rounded >> drop) & ((1u << mantissa_bits) - 1));
    }
    return static_cast<unsigned char>(sign | (q > max_bits ? max_bits : q));
}

__device__ __forceinline__ void quantize(float v, e4m3_t& out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(v));
    out.bits = static_cast<unsigned char>(pair & 0xffu);
#else
    out.bits = fp8_bits_soft(v, 3, 7, 0x7eu);
#endif
}
__device__ __forceinline__ void quantize(float v, e5m2_t& out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short pair;
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(v));
    out.bits = static_cast<unsigned char>(pair & 0xffu);
#else
    out.bits = fp8_bits_soft(v, 2, 15, 0x7bu);
#endif
}
__device__ __forceinline__ void quantize(float v, signed char& out) {
    const int q = __float2int_rn(v);  // (NaN: 0)
    out = static_cast<signed char>(q > 127 ? 127 : q < -127 ? -127 : q);
}
// Two adjacent values: sm_89+ converts a pair of FP8 values with one
// instruction (a in the low byte, b in the high), half the conversions and
// byte moves of two single ones; the rounding is the same.
template <class Q>
__device__ __forceinline__ void quantize_pair(float a, float b, Q& qa, Q& qb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    constexpr bool kE4M3 = Fp8Kind<Q>::value == 1;
    constexpr bool kE5M2 = Fp8Kind<Q>::value == 2;
    if constexpr (kE4M3 || kE5M2) {
        unsigned short pair;
        if constexpr (kE4M3) {
            asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(b), "f"(a));
        } else {
            asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(b), "f"(a));
        }
        qa.bits = static_cast<unsigned char>(pair & 0xffu);
        qb.bits = static_cast<unsigned char>(pair >> 8);
        return;
    }
#endif
    quantize(a, qa);
    quantize(b, qb);
}

enum Scaling { kStaticScale = 0, kRowScale = 1, kRowScaleBounded = 2 };

template <class P, int FLAGS, class Q, int SCALING, int GROUP>
struct QuantStore : AffineStore<P, FLAGS, Q> {
    static_assert(GROUP == 0 || (SCALING != kStaticScale && (GROUP & (GROUP - 1)) == 0),
                  "groups take a dynamic scale and a power-of-two size");
    using Base = AffineStore<P, FLAGS, Q>;
    template <int VEC>
    using Params = typename Base::template Params<VEC>;
    // The same value stored unquantized in Y (y returned beside q on request).
    template <class Y>
    using Plain = AffineStore<P, FLAGS, Y>;
    static constexpr float kMax = QuantMax<Q>::value;
    // An all-zero row's scale: max |y| / kMax never goes below this (vLLM's floor).
    static constexpr float kMinScale = 1.0f / (kMax * 512.0f);

    // The scale and its reciprocal, which every value is multiplied by
    // (one division a row, not one an element; as vLLM's kernels quantize):
    // a value within an ulp of a rounding boundary may round the other way
    // than value / scale would.
    struct Scale {
        float scale;
        float inverse;
    };
    static constexpr bool kQuantized = true;
    static constexpr bool kRowScale = SCALING != kStaticScale;
    static constexpr int kGroup = GROUP;  // elements a scale covers (0: the whole row)
    __device__ __forceinline__ static Scale static_scale(const float* quant_scale) {
        if constexpr (SCALING == kStaticScale) {
            const float s = *quant_scale;
            return Scale{s, __frcp_rn(s)};
        } else {
            return Scale{1.0f, 1.0f};
        }
    }
    // The largest |value| of a vector (NaN left out).
    template <class T, int VEC>
    __device__ __forceinline__ static float amax(const Vec<T, VEC>& in, const Params<VEC>& p, const Affine<float>& f,
                                                 float pivot) {
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float shifted = static_cast<float>(widen_at(in, j)) - pivot;
            m = fmaxf(m, fabsf(Base::template value<T>(shifted, f, Base::template scalars_at<float>(p, j))));
        }
        return m;
    }
    __device__ __forceinline__ static Scale row_scale(float amax, const float* quant_scale) {
        if constexpr (SCALING == kRowScaleBounded) amax = fminf(amax, *quant_scale);
        const float s = fmaxf(__fdiv_rn(amax, kMax), kMinScale);
        return Scale{s, __frcp_rn(s)};
    }
    template <class T, int VEC>
    __device__ __forceinline__ static Vec<Q, VEC> apply(const Vec<T, VEC>& in, const Params<VEC>& p,
                                                        const Affine<float>& f, float pivot, Scale s) {
        Vec<Q, VEC> out;
        float v[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float shifted = static_cast<float>(widen_at(in, j)) - pivot;
            v[j] = Base::template value<T>(shifted, f, Base::template scalars_at<float>(p, j)) * s.inverse;
        }
#pragma unroll
        for (int j = 0; j + 1 < VEC; j += 2) quantize_pair(v[j], v[j + 1], out.v[j], out.v[j + 1]);
        if constexpr (VEC % 2 != 0) quantize(v[VEC - 1], out.v[VEC - 1]);
        return out;
    }
};

}  // namespace cunorm
