// metal_emu.h: just enough of the Metal Shading Language, as C++20, to run the bodies
// of `mx.fast.metal_kernel` kernels on the CPU (see metal_emu.py, which writes the
// signature the way MLX does and includes this first).
//
// Execution model. The threadgroups of a launch run one after another. The threads of a
// threadgroup are real std::threads, but exactly one runs at a time: a thread runs until
// it reaches a barrier (threadgroup_barrier, simdgroup_barrier, or a simd_* function,
// which is a barrier of its simdgroup), then hands over to another thread, chosen from a
// seeded shuffle. So a run is deterministic for a seed, and a missing barrier shows up
// reliably: one thread runs past the point where the others have not yet written (or
// have already overwritten) what it reads. A barrier that some threads of its scope never
// reach (they returned, or wait at another one) is reported as an error, not a hang.
// Threadgroup memory is `static` storage shared by the threadgroup's threads.
//
// What it cannot catch: Metal compiler errors (address-space mismatches such as a
// `constant` pointer assigned to a `device` one, Metal-only syntax, attribute typos that
// MLX would still detect by name), the 32 KiB threadgroup-memory limit, performance,
// races finer than barrier-to-barrier order (two threads' accesses between the same pair
// of barriers are never interleaved), out-of-bounds accesses that happen to read mapped
// memory, uninitialised threadgroup memory (it is zeroed once, then keeps the previous
// threadgroup's values), and SIMD lock-step behaviour beyond what the simd_* functions
// model: they need every lane of the simdgroup to call them (Metal allows divergent
// lanes; here that ends in an error, or in wrong results). Atomics and textures are not
// modelled. Outputs start as NaN bytes (MLX leaves them uninitialised): unwritten ones show.
#pragma once

#include "metal_emu_threads.h"

// ---------------------------------------------------------------- the Metal names
typedef _Float16 half;
using emu::bfloat;
typedef half float16_t;
typedef bfloat bfloat16_t;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

#define EMU_VEC_NAMES(T, name) \
  typedef emu::vec<T, 2> name##2; \
  typedef emu::vec<T, 3> name##3; \
  typedef emu::vec<T, 4> name##4;
EMU_VEC_NAMES(float, float)
EMU_VEC_NAMES(half, half)
EMU_VEC_NAMES(bfloat, bfloat)
EMU_VEC_NAMES(int, int)
EMU_VEC_NAMES(uint, uint)
EMU_VEC_NAMES(short, short)
EMU_VEC_NAMES(ushort, ushort)
EMU_VEC_NAMES(bool, bool)

namespace metal {
using std::abs, std::ceil, std::cos, std::exp, std::exp2, std::floor, std::fma, std::isinf, std::isnan, std::log,
    std::log2, std::pow, std::round, std::sin, std::sqrt, std::tanh, std::trunc;
template <class A, class B>
auto max(A a, B b) { return a > b ? a : b; }
template <class A, class B>
auto min(A a, B b) { return a < b ? a : b; }
template <class T>
T clamp(T x, T lo, T hi) { return x < lo ? lo : (x > hi ? hi : x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
template <class T, int N>
T dot(const emu::vec<T, N>& a, const emu::vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; i++) s += a[i] * b[i];
  return s;
}
namespace precise {
using std::exp, std::log, std::sqrt, std::tanh;
}
namespace fast {
using std::exp, std::log, std::sqrt, std::tanh;
}

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
inline void threadgroup_barrier(mem_flags) { emu::current_group->barrier(emu::Scope::threadgroup); }
inline void simdgroup_barrier(mem_flags) { emu::current_group->barrier(emu::Scope::simdgroup); }

// A whole-simdgroup reduction: every lane gets op folded over all lanes' values, in lane order.
template <class T, class Op>
T simd_fold_(T v, Op op) {
  return emu::simd_exchange(v, [op](auto read, int, int width) {
    T s = read(0);
    for (int l = 1; l < width; l++) s = op(s, read(l));
    return s;
  });
}
template <class T>
T simd_sum(T v) { return simd_fold_(v, [](T a, T b) { return a + b; }); }
template <class T>
T simd_prod(T v) { return simd_fold_(v, [](T a, T b) { return a * b; }); }
template <class T>
T simd_max(T v) { return simd_fold_(v, [](T a, T b) { return max(a, b); }); }
template <class T>
T simd_min(T v) { return simd_fold_(v, [](T a, T b) { return min(a, b); }); }
template <class T>
T simd_prefix_inclusive_sum(T v) {
  return emu::simd_exchange(v, [](auto read, int lane, int) {
    T s = read(0);
    for (int l = 1; l <= lane; l++) s += read(l);
    return s;
  });
}
template <class T>
T simd_prefix_exclusive_sum(T v) {
  return emu::simd_exchange(v, [](auto read, int lane, int) {
    T s = T(0);
    for (int l = 0; l < lane; l++) s += read(l);
    return s;
  });
}
// Shuffles from a lane outside the simdgroup return the caller's own value (Metal: undefined).
template <class T>
T simd_shuffle(T v, ushort lane) {
  return emu::simd_exchange(v, [lane](auto read, int me, int width) { return read(lane < width ? lane : me); });
}
template <class T>
T simd_broadcast(T v, ushort lane) { return simd_shuffle(v, lane); }
template <class T>
T simd_broadcast_first(T v) { return simd_shuffle(v, 0); }
template <class T>
T simd_shuffle_down(T v, ushort delta) {
  return emu::simd_exchange(v, [delta](auto read, int me, int width) {
    return read(me + delta < width ? me + delta : me);
  });
}
template <class T>
T simd_shuffle_up(T v, ushort delta) {
  return emu::simd_exchange(v, [delta](auto read, int me, int) { return read(me >= delta ? me - delta : me); });
}
template <class T>
T simd_shuffle_xor(T v, ushort mask) {
  return emu::simd_exchange(v, [mask](auto read, int me, int width) {
    int o = me ^ mask;
    return read(o < width ? o : me);
  });
}
inline bool simd_any(bool v) {
  return emu::simd_exchange(v, [](auto read, int, int width) {
    bool r = false;
    for (int l = 0; l < width; l++) r = r || read(l);
    return r;
  });
}
inline bool simd_all(bool v) {
  return emu::simd_exchange(v, [](auto read, int, int width) {
    bool r = true;
    for (int l = 0; l < width; l++) r = r && read(l);
    return r;
  });
}
}  // namespace metal
using namespace metal;

// Address spaces carry no meaning here; threadgroup storage is shared by all threads.
#define device
#define constant
#define thread
#define threadgroup static
#define METAL_FUNC inline
