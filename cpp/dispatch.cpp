#include "dispatch.h"

#include <cstdlib>
#include <stdexcept>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace zerofn {
namespace {

bool cpu_has(const std::string& name) {
#if defined(ZEROFN_X86_KERNELS)
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
// Enough pieces per thread to rebalance when a core is busy elsewhere, few enough
// that each stays megabytes long.
constexpr int64_t kPiecesPerThread = 8;
// Pieces start on multiples of 256 elements: whole cache lines for every dtype, and
// whole 8-bit quantization blocks (kQuantBlock), whose scales one piece owns alone.
constexpr int64_t kAlign = kQuantBlock;

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

Split split_for(int64_t n) {
  const int64_t want = n / kMinPerThread;
  const int threads = want < max_threads() ? int(want) : max_threads();
  if (threads <= 1) return {1, 1, n};
  int64_t per = (n + threads * kPiecesPerThread - 1) / (threads * kPiecesPerThread);
  per = per < kMinPerThread ? kMinPerThread : per;
  per = (per + kAlign - 1) / kAlign * kAlign;
  return {threads, (n + per - 1) / per, per};
}

void parallel_ranges(int64_t n, void (*body)(void*, int64_t, int64_t, int64_t), void* ctx) {
  const Split s = split_for(n);
  if (s.threads == 1) return body(ctx, 0, 0, n);
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) num_threads(s.threads)
#endif
  for (int64_t i = 0; i < s.pieces; ++i) {
    const int64_t b = i * s.per, e = b + s.per < n ? b + s.per : n;
    body(ctx, i, b, e);
  }
}

}  // namespace zerofn
