// metal_emu_threads.h: the emulator's threadgroups (see metal_emu.h for the model):
// threads that pass a baton, barriers of a threadgroup or a simdgroup, the launch grid.
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

#include "metal_emu_types.h"

namespace emu {

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
