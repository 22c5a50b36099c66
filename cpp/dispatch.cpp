#include "dispatch.h"

#include <cstdlib>
#include <stdexcept>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace zerofn {
namespace {

bool cpu_has(const std::string& name) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();  // libgcc also checks that the OS saves the wider registers
  if (name == "avx512") return __builtin_cpu_supports("avx512f");
  if (name == "avx2")
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#endif
  return name == "generic";
}

const KernelTable* table_for(const std::string& name) {
  const KernelTable* t = name == "avx512" ? avx512_table()
                         : name == "avx2" ? avx2_table()
                         : name == "generic" ? generic_table()
                                             : nullptr;
  return t != nullptr && cpu_has(name) ? t : nullptr;
}

const KernelTable* best_table() {
  if (const char* forced = std::getenv("ZEROFN_CPU_ISA")) {
    if (const KernelTable* t = table_for(forced)) return t;
    throw std::invalid_argument(std::string("ZEROFN_CPU_ISA=") + forced +
                                " is not available on this CPU/build");
  }
  for (const char* name : {"avx512", "avx2", "generic"})
    if (const KernelTable* t = table_for(name)) return t;
  return generic_table();
}

const KernelTable* g_active = nullptr;

// Below this many elements per thread, waking a thread costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 15;
// Pieces start on multiples of 64 elements: whole cache lines for fp32 and 16-bit data.
constexpr int64_t kAlign = 64;

}  // namespace

const KernelTable& active_kernels() {
  if (g_active == nullptr) g_active = best_table();
  return *g_active;
}

void set_isa(const std::string& name) {
  const KernelTable* t = table_for(name);
  if (t == nullptr)
    throw std::invalid_argument("ISA '" + name + "' is not available on this CPU/build");
  g_active = t;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (const char* name : {"avx512", "avx2", "generic"})
    if (table_for(name) != nullptr) names.emplace_back(name);
  return names;
}

int max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

int parallel_ranges(int64_t n, void (*body)(void*, int, int64_t, int64_t), void* ctx) {
  int64_t want = n / kMinPerThread;
  int threads = want < max_threads() ? int(want) : max_threads();
  if (threads <= 1) {
    body(ctx, 0, 0, n);
    return 1;
  }
  int64_t per = (n + threads - 1) / threads;
  per = (per + kAlign - 1) / kAlign * kAlign;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static, 1) num_threads(threads)
#endif
  for (int t = 0; t < threads; ++t) {
    int64_t b = t * per, e = b + per < n ? b + per : n;
    if (b < e) body(ctx, t, b, e);
  }
  return threads;
}

}  // namespace zerofn
