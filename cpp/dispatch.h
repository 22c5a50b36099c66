// Picks the kernel table for this CPU and splits work across OpenMP threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"

namespace zerofn {

// The table in use: the best the CPU supports, or the one forced by set_isa() or the
// ZEROFN_CPU_ISA environment variable (read once, at first use).
const KernelTable& active_kernels();
// Throws std::invalid_argument for an unknown name or one this CPU/build cannot run.
void set_isa(const std::string& name);
std::vector<std::string> available_isas();
int max_threads();

// Runs body(thread_index, begin, end) on contiguous, cache-line-aligned pieces of
// [0, n): one piece per thread, static, so each core streams one long range.
// Returns how many pieces ran (their indices are 0..pieces-1).
int parallel_ranges(int64_t n, void (*body)(void* ctx, int piece, int64_t b, int64_t e),
                    void* ctx);

}  // namespace zerofn
