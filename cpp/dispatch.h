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

// How [0, n) is cut: `pieces` contiguous ranges of `per` elements (the last shorter),
// each a multiple of 256 elements so every piece starts on a cache line and on an
// 8-bit quantization block.
struct Split {
  int threads;
  int64_t pieces, per;
};
Split split_for(int64_t n);

// Runs body(ctx, piece, begin, end) over split_for(n) on up to `threads` OpenMP threads.
// A few large pieces per thread, handed out dynamically: each core still streams long
// contiguous ranges, and a core slowed by another process takes fewer of them.
void parallel_ranges(int64_t n, void (*body)(void* ctx, int64_t piece, int64_t b, int64_t e),
                     void* ctx);

}  // namespace zerofn
