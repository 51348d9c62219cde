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
// lanes; here that is reported as an error). Atomics and textures are not modelled.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <semaphore>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

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

// ---------------------------------------------------------------- scheduler
struct Abort {};  // unwinds every thread of a failed threadgroup

enum class Scope { threadgroup, simdgroup };

struct Ids {  // the thread-position attributes MLX can pass, by their Metal names
  vec<uint32_t, 3> thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  vec<uint32_t, 3> threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, grid_size, grid_origin;
  vec<uint32_t, 3> dispatch_threads_per_threadgroup;
  uint32_t thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width;
  uint32_t dispatch_simdgroups_per_threadgroup, thread_index_in_quadgroup, quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

constexpr int kSimdWidth = 32;

class Group;
inline thread_local Group* current_group = nullptr;
inline thread_local int current_thread = -1;

// One threadgroup: its threads pass a baton; a barrier hands it on and waits for its scope.
class Group {
 public:
  Group(int n, uint64_t seed)
      : n_(n), rng_(seed), state_(n, kReady), wait_scope_(n, Scope::threadgroup), sems_(n), slots_(n) {
    for (auto& s : sems_) s = std::make_unique<std::binary_semaphore>(0);
  }

  int size() const { return n_; }
  int simd_width(int t) const { return std::min(kSimdWidth, n_ - t / kSimdWidth * kSimdWidth); }
  void* slot(int t) { return slots_[t].data; }

  // Runs body(t) on n threads; returns "" or the first error.
  std::string run(const std::function<void(int)>& body) {
    std::vector<std::thread> threads;
    for (int t = 0; t < n_; t++) threads.emplace_back([this, t, &body] { thread_main(t, body); });
    {
      std::vector<int> all(n_);
      for (int t = 0; t < n_; t++) all[t] = t;
      std::lock_guard<std::mutex> lock(mu_);
      make_ready(all);
      pass_on();
    }
    for (auto& th : threads) th.join();
    return error_;
  }

  // Called by thread t at a barrier of `scope`.
  void barrier(Scope scope) {
    int t = current_thread;
    std::unique_lock<std::mutex> lock(mu_);
    auto members = scope_of(t, scope);
    for (int u : members) {
      if (state_[u] == kDone) fail(lock, "a barrier was reached by thread " + std::to_string(t) + " after thread " +
                                             std::to_string(u) + " of its " + name(scope) + " had returned");
      if (state_[u] == kWaiting && wait_scope_[u] != scope)
        fail(lock, "threads of one " + name(scope) + " wait at barriers of different scopes");
    }
    state_[t] = kWaiting;
    wait_scope_[t] = scope;
    bool all = std::all_of(members.begin(), members.end(), [&](int u) { return state_[u] == kWaiting; });
    if (all) make_ready(members);
    pass_on();
    lock.unlock();
    sleep(t);
  }

 private:
  enum State { kReady, kRunning, kWaiting, kDone };

  std::vector<int> scope_of(int t, Scope scope) const {
    std::vector<int> out;
    int lo = scope == Scope::threadgroup ? 0 : t / kSimdWidth * kSimdWidth;
    int hi = scope == Scope::threadgroup ? n_ : std::min(n_, lo + kSimdWidth);
    for (int u = lo; u < hi; u++) out.push_back(u);
    return out;
  }
  static std::string name(Scope s) { return s == Scope::threadgroup ? "threadgroup" : "simdgroup"; }

  void make_ready(std::vector<int> threads) {
    std::shuffle(threads.begin(), threads.end(), rng_);
    for (int u : threads) {
      state_[u] = kReady;
      ready_.push_back(u);
    }
  }

  // Gives the baton to the next ready thread (mu_ held). None ready: done or deadlocked.
  void pass_on() {
    if (!ready_.empty()) {
      int u = ready_.front();
      ready_.erase(ready_.begin());
      state_[u] = kRunning;
      sems_[u]->release();
      return;
    }
    bool finished = std::all_of(state_.begin(), state_.end(), [](State s) { return s == kDone; });
    if (!finished && error_.empty()) {
      error_ = "deadlock: threads wait at a barrier that the others never reach";
      abort_all();
    }
  }

  [[noreturn]] void fail(std::unique_lock<std::mutex>& lock, const std::string& why) {
    if (error_.empty()) error_ = why;
    abort_all();
    lock.unlock();
    throw Abort{};
  }

  void abort_all() {  // wakes every live thread once; each then throws Abort
    if (aborted_) return;
    aborted_ = true;
    for (int u = 0; u < n_; u++)
      if (state_[u] != kDone) sems_[u]->release();
  }

  void sleep(int t) {
    sems_[t]->acquire();
    if (aborted_) throw Abort{};
  }

  void thread_main(int t, const std::function<void(int)>& body) {
    current_group = this;
    current_thread = t;
    try {
      sleep(t);
      body(t);
    } catch (const Abort&) {
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.empty()) error_ = e.what();
      abort_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    state_[t] = kDone;
    if (!aborted_) {
      // A finished thread completes no barrier: a scope waiting for it is divergent.
      for (int u = 0; u < n_; u++) {
        if (state_[u] != kWaiting) continue;
        auto members = scope_of(u, wait_scope_[u]);
        if (std::find(members.begin(), members.end(), t) != members.end()) {
          error_ = "thread " + std::to_string(t) + " returned while thread " + std::to_string(u) +
                   " waits for it at a barrier";
          abort_all();
          return;
        }
      }
      pass_on();
    }
  }

  struct alignas(16) Slot {
    unsigned char data[64];
  };

  int n_;
  std::mt19937_64 rng_;
  std::mutex mu_;
  std::vector<State> state_;
  std::vector<Scope> wait_scope_;
  std::vector<std::unique_ptr<std::binary_semaphore>> sems_;
  std::vector<int> ready_;
  std::vector<Slot> slots_;
  bool aborted_ = false;
  std::string error_;
};

// Runs a launch: grid in threads, threadgroup clamped to the grid as MLX does; the last
// threadgroup of a dimension may be partial (non-uniform dispatch). Returns "" or an error.
inline std::string launch(const uint32_t grid[3], const uint32_t tg_req[3], uint64_t seed,
                          const std::function<void(const Ids&)>& kernel) {
  uint32_t tg[3], groups[3];
  for (int d = 0; d < 3; d++) {
    tg[d] = std::max<uint32_t>(1, std::min(tg_req[d], grid[d]));
    groups[d] = (grid[d] + tg[d] - 1) / tg[d];
  }
  for (uint32_t gz = 0; gz < groups[2]; gz++)
    for (uint32_t gy = 0; gy < groups[1]; gy++)
      for (uint32_t gx = 0; gx < groups[0]; gx++) {
        uint32_t pos[3] = {gx, gy, gz}, size[3];
        for (int d = 0; d < 3; d++) size[d] = std::min(tg[d], grid[d] - pos[d] * tg[d]);
        int n = int(size[0] * size[1] * size[2]);
        Group group(n, seed ^ (uint64_t(gx) << 40 ^ uint64_t(gy) << 20 ^ gz) * 0x9E3779B97F4A7C15ull);
        std::string err = group.run([&](int t) {
          Ids id{};
          uint32_t local[3] = {uint32_t(t) % size[0], uint32_t(t) / size[0] % size[1],
                               uint32_t(t) / (size[0] * size[1])};
          for (int d = 0; d < 3; d++) {
            id.thread_position_in_threadgroup[d] = local[d];
            id.threadgroup_position_in_grid[d] = pos[d];
            id.thread_position_in_grid[d] = pos[d] * tg[d] + local[d];
            id.threads_per_threadgroup[d] = size[d];
            id.dispatch_threads_per_threadgroup[d] = tg[d];
            id.threadgroups_per_grid[d] = groups[d];
            id.threads_per_grid[d] = id.grid_size[d] = grid[d];
          }
          id.thread_index_in_threadgroup = t;
          id.thread_index_in_simdgroup = t % kSimdWidth;
          id.simdgroup_index_in_threadgroup = t / kSimdWidth;
          id.simdgroups_per_threadgroup = (n + kSimdWidth - 1) / kSimdWidth;
          id.dispatch_simdgroups_per_threadgroup =
              (tg[0] * tg[1] * tg[2] + kSimdWidth - 1) / kSimdWidth;
          id.threads_per_simdgroup = id.thread_execution_width = kSimdWidth;
          id.thread_index_in_quadgroup = t % 4;
          id.quadgroup_index_in_threadgroup = t / 4;
          id.quadgroups_per_threadgroup = (n + 3) / 4;
          id.dispatch_quadgroups_per_threadgroup = (tg[0] * tg[1] * tg[2] + 3) / 4;
          kernel(id);
        });
        if (!err.empty()) return err;
      }
  return "";
}

// A simdgroup exchange: every lane publishes v, then f(read, lane, width) computes its
// result from the lanes' values; two simdgroup barriers keep the slots consistent.
template <class V, class F>
V simd_exchange(V v, F f) {
  static_assert(sizeof(V) <= 64, "simd value too large");
  Group& g = *current_group;
  int t = current_thread, base = t / kSimdWidth * kSimdWidth;
  std::memcpy(g.slot(t), &v, sizeof(V));
  g.barrier(Scope::simdgroup);
  auto read = [&](int lane) {
    V out;
    std::memcpy(&out, g.slot(base + lane), sizeof(V));
    return out;
  };
  V out = f(read, t - base, g.simd_width(t));
  g.barrier(Scope::simdgroup);
  return out;
}

}  // namespace emu

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

template <class T>
T simd_sum(T v) {
  return emu::simd_exchange(v, [](auto read, int, int width) {
    T s = read(0);
    for (int l = 1; l < width; l++) s += read(l);
    return s;
  });
}
template <class T>
T simd_prod(T v) {
  return emu::simd_exchange(v, [](auto read, int, int width) {
    T s = read(0);
    for (int l = 1; l < width; l++) s *= read(l);
    return s;
  });
}
template <class T>
T simd_max(T v) {
  return emu::simd_exchange(v, [](auto read, int, int width) {
    T s = read(0);
    for (int l = 1; l < width; l++) s = max(s, read(l));
    return s;
  });
}
template <class T>
T simd_min(T v) {
  return emu::simd_exchange(v, [](auto read, int, int width) {
    T s = read(0);
    for (int l = 1; l < width; l++) s = min(s, read(l));
    return s;
  });
}
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
