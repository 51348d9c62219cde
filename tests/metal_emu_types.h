// metal_emu_types.h: Metal's vector types and bfloat for the emulator (see metal_emu.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace emu {

// ---------------------------------------------------------------- vector types
template <class T, int N>
struct vec;

#define EMU_VEC_OPS(N)                                                                     \
  T& operator[](int i) { return (&x)[i]; }                                                 \
  const T& operator[](int i) const { return (&x)[i]; }                                     \
  template <class U>                                                                       \
  explicit vec(const vec<U, N>& o) {                                                       \
    for (int i = 0; i < N; i++) (*this)[i] = T(o[i]);                                     \
  }

template <class T>
struct vec<T, 2> {
  T x{}, y{};
  vec() = default;
  vec(T s) : x(s), y(s) {}
  vec(T a, T b) : x(a), y(b) {}
  EMU_VEC_OPS(2)
};
template <class T>
struct vec<T, 3> {
  T x{}, y{}, z{};
  vec() = default;
  vec(T s) : x(s), y(s), z(s) {}
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  EMU_VEC_OPS(3)
};
template <class T>
struct vec<T, 4> {
  T x{}, y{}, z{}, w{};
  vec() = default;
  vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  EMU_VEC_OPS(4)
};

#define EMU_VEC_BINOP(op)                                                          \
  template <class T, int N>                                                        \
  vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) {                         \
    for (int i = 0; i < N; i++) a[i] = a[i] op b[i];                               \
    return a;                                                                      \
  }                                                                                \
  template <class T, int N, class S>                                               \
  vec<T, N> operator op(vec<T, N> a, S s) {                                        \
    for (int i = 0; i < N; i++) a[i] = a[i] op T(s);                               \
    return a;                                                                      \
  }                                                                                \
  template <class T, int N, class S>                                               \
  vec<T, N> operator op(S s, vec<T, N> a) {                                        \
    for (int i = 0; i < N; i++) a[i] = T(s) op a[i];                               \
    return a;                                                                      \
  }                                                                                \
  template <class T, int N, class S>                                               \
  vec<T, N>& operator op##=(vec<T, N>& a, const S& b) {                            \
    return a = a op b;                                                             \
  }
EMU_VEC_BINOP(+)
EMU_VEC_BINOP(-)
EMU_VEC_BINOP(*)
EMU_VEC_BINOP(/)

// ---------------------------------------------------------------- bfloat
// bfloat16 stored as bits; arithmetic goes through float (rounded when stored back).
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  template <class U>
  bfloat(U v) {
    float f = float(v);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) {
      bits = 0x7FC0;
    } else {
      u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
      bits = uint16_t(u >> 16);
    }
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  template <class U>
  bfloat& operator+=(U v) { return *this = bfloat(float(*this) + float(v)); }
  template <class U>
  bfloat& operator-=(U v) { return *this = bfloat(float(*this) - float(v)); }
  template <class U>
  bfloat& operator*=(U v) { return *this = bfloat(float(*this) * float(v)); }
  template <class U>
  bfloat& operator/=(U v) { return *this = bfloat(float(*this) / float(v)); }
};

}  // namespace emu
