// A process-wide on/off switch: read once from an environment variable (on when it equals
// `on_value`), settable from code (tests and benchmarks flip it; set returns the previous state).
#pragma once
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace mb {

class EnvFlag {
 public:
  constexpr EnvFlag(const char* name, const char* on_value) : name_(name), on_(on_value) {}

  bool get() const {
    int v = state_.load(std::memory_order_relaxed);
    if (v < 0) {
      const char* env = std::getenv(name_);
      v = env && std::strcmp(env, on_) == 0 ? 1 : 0;
      state_.store(v, std::memory_order_relaxed);
    }
    return v == 1;
  }
  bool set(bool on) {
    const bool prev = get();
    state_.store(on ? 1 : 0, std::memory_order_relaxed);
    return prev;
  }

 private:
  const char* name_;
  const char* on_;
  mutable std::atomic<int> state_{-1};  // -1: not read from the environment yet
};

}  // namespace mb
