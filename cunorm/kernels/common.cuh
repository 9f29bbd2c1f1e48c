// common.cuh: storage types, conversions and vector access shared by every
// kernel family.
//
// The kernels include no CUDA header at all: 16-bit floats are carried as
// their raw bits and converted with single PTX instructions. That keeps the
// compiled source a pure function of the files in this folder (the loader
// inlines them and hashes the result), and lets CI compile every kernel with
// NVRTC alone, without the CUDA include tree.
//
// Requires compute capability 8.0 or newer (cvt.rn.bf16.f32 is sm_80+).
#pragma once

namespace cunorm {

struct half_t { unsigned short bits; };  // IEEE binary16, raw bits
struct bf16_t { unsigned short bits; };  // bfloat16, raw bits
struct none_t {};                        // "no weight / no bias" marker

// Accumulation type: float for 16- and 32-bit storage, double for float64.
template <class T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

template <class A, class B> struct same_type { static constexpr bool value = false; };
template <class A> struct same_type<A, A> { static constexpr bool value = true; };

// widen: storage -> accumulation type. Exact for every storage type.
__device__ __forceinline__ float widen(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
}
__device__ __forceinline__ float widen(bf16_t b) {
    return __uint_as_float(static_cast<unsigned>(b.bits) << 16);
}
__device__ __forceinline__ float widen(float f) { return f; }
__device__ __forceinline__ double widen(double d) { return d; }

// narrow: accumulation type -> storage, round to nearest even (once, at the
// very end of each element's computation).
__device__ __forceinline__ void narrow(float f, half_t& out) {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.bits) : "f"(f));
}
__device__ __forceinline__ void narrow(float f, bf16_t& out) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out.bits) : "f"(f));
}
__device__ __forceinline__ void narrow(float f, float& out) { out = f; }
__device__ __forceinline__ void narrow(double d, double& out) { out = d; }

// A vector of N consecutive elements, aligned to its full size so that the
// compiler emits one 16-byte (or 8-, 4-byte) access for it. The planner only
// picks N > 1 when the base pointer, the strides and the extent allow it.
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <class T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// Elementwise epilogue shared by every family:
//   y = (x * scale + shift) [* weight] [+ bias], computed in the accumulation
//   type and rounded once to the storage type.
template <class A>
struct Affine {
    A scale;
    A shift;
};

template <class W, class A>
__device__ __forceinline__ A apply_weight(A value, const W* w, long long i) {
    if constexpr (same_type<W, none_t>::value) {
        return value;
    } else {
        return value * static_cast<A>(widen(w[i]));
    }
}

}  // namespace cunorm
