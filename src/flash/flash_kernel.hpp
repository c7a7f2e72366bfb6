// flash/flash_kernel.hpp — host interface of the Flash persistent kernel (flash_kernel.cu): the whole MoE
// layer forward of one rank as one cooperative launch. The twin of cpu::flash_forward (cpu/kernels.hpp):
// same Params (device pointers here, bf16 storage), the stream last.
// Plain host C++: the engine and the tests include it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "core/flash_protocol.hpp"

namespace dmoe {
class Backend;
}

namespace dmoe::cuda {

// Why the kernel cannot run `shape` on the current device ("" when it can): needs an sm_90 GPU and a build
// for sm_90a, bf16 storage, H a multiple of 16 and I a multiple of 8, latest-tokens capacity, and tables
// that fit in shared memory.
std::string flash_unusable_reason(const flash::Shape& shape);

// Blocks of the launch: every multiprocessor this process may use times the blocks of the kernel that fit
// on one (measured occupancy; 1 with its shared memory), so that the cooperative launch holds them all.
int32_t flash_grid_blocks(const flash::Shape& shape);

// Whether the router's logits are computed by the split gate (flash::Shape::split_gate_items): every
// (token chunk, column chunk) item on a block of its own. DMOE_FLASH_GATE: block — each block its own tokens;
// auto (the default) — split where the items fit one wave of `shape.grid`
// blocks and H has at least 16 column chunks (fewer: a block's own rounds are few and the split's extra grid barrier
// costs more); split — always (where the items do not fit, an input error).
bool flash_split_gate(const flash::Shape& shape);

// Whether the combine spreads (token, column slice) items over every block's consumer warps
// (flash::Shape::spread_combine). DMOE_FLASH_COMBINE: token — each block sums its own tokens, a warp a
// token; slice (the default) — spread (at T = 1 one warp summing the token took ~14 us on an H100, the spread ~4).
// Each output element is the same sum in the same order either way.
bool flash_spread_combine();

// Whether a down tile's producer, finding its row tile's up tiles not yet done, first fetches the tile's w2 box
// into L2 (flash::Shape::prefetch_down; a hint, the results are the same bits). DMOE_FLASH_PREFETCH: 0 (the default:
// measured slower on an H100, docs/perf.md) or 1.
bool flash_prefetch_down();

// One rank's forward: a cooperative launch of flash_grid_blocks(shape) = p.shape.grid blocks on `stream`.
// Nothing synchronises; the kernel advances the epoch in p.local's Control itself, so launches may follow
// each other (or be captured in a CUDA graph) with no host work between them.
void flash_forward(const flash::Params& p, cudaStream_t stream);

// One rank's backward of its last train forward (flash_backward.cu; the twin of cpu::flash_backward): the
// protocol of flash::BackwardParams as a sequence of launches on `stream`, the arithmetic on `backend`'s kernels
// (a bf16 CUDA backend whose stream is `stream`, f32 accumulators). Waits for `stream` once (the row counts).
void flash_backward(const flash::BackwardParams& p, Backend& backend, cudaStream_t stream);

}  // namespace dmoe::cuda
