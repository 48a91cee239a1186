// attnlab's thin C++ layer over aten ops that tch 0.24 does not wrap (see ../shared/GPU.md §6–7).
// Every entry point takes at::Tensor* (tch's C_tensor), never throws across the FFI boundary, and
// returns nullptr on success or a malloc'ed error string the Rust side frees.
#include <ATen/core/Tensor.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/stack.h>
#include <cstring>
#include <vector>

typedef at::Tensor* tensor;

static std::vector<at::Tensor> list(tensor* ts, int64_t n) {
  std::vector<at::Tensor> v;
  v.reserve(n);
  for (int64_t i = 0; i < n; ++i) v.push_back(*ts[i]);
  return v;
}

#define GUARD_BEGIN try {
#define GUARD_END                                \
  return nullptr;                                \
  }                                              \
  catch (const std::exception& e) {              \
    return strdup(e.what());                     \
  }

extern "C" {

// Autocast on CUDA casts to fp16 by default; attnlab trains in bf16.
char* attnlab_set_autocast_bf16() {
  GUARD_BEGIN
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  GUARD_END
}

// Enter (enabled = 1) or leave (enabled = 0) a CUDA autocast region with the non-deprecated API
// (tch's autocast calls the deprecated one, which prints a warning on every call). Entering writes
// the previous state to *prev; leaving restores `restore` and clears the cast cache at nesting 0.
char* attnlab_autocast_enter(int* prev) {
  GUARD_BEGIN
  *prev = at::autocast::is_autocast_enabled(at::kCUDA) ? 1 : 0;
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  at::autocast::increment_nesting();
  GUARD_END
}

char* attnlab_autocast_leave(int restore) {
  GUARD_BEGIN
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(at::kCUDA, restore != 0);
  GUARD_END
}

// One AdamW step over a parameter group with aten's fused kernel (CPU and CUDA). `steps` are f32
// scalar tensors on the parameters' device holding the 1-based update count (the caller increments).
char* attnlab_fused_adamw(tensor* params, tensor* grads, tensor* exp_avgs, tensor* exp_avg_sqs,
                          tensor* steps, int64_t n, double lr, double beta1, double beta2,
                          double weight_decay, double eps) {
  GUARD_BEGIN
  if (n == 0) return nullptr;
  at::_fused_adamw_(list(params, n), list(grads, n), list(exp_avgs, n), list(exp_avg_sqs, n), {},
                    list(steps, n), lr, beta1, beta2, weight_decay, eps, /*amsgrad=*/false,
                    /*maximize=*/false);
  GUARD_END
}

// Global-norm clipping without a host synchronisation: grads *= min(1, max_norm / (norm + 1e-6)).
// Writes the (pre-clip) global L2 norm, a 0-dim f32 tensor, to *norm_out.
char* attnlab_clip_grad_norm(tensor* grads, int64_t n, double max_norm, tensor* norm_out) {
  GUARD_BEGIN
  auto gs = list(grads, n);
  auto norms = at::_foreach_norm(gs, 2, at::kFloat);
  auto total = at::stack(norms).norm();
  if (max_norm > 0) {
    auto coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
    at::_foreach_mul_(gs, coef);
  }
  *norm_out = new at::Tensor(total);
  GUARD_END
}

// Peak bytes allocated by the CUDA caching allocator on `device` since the last reset (the number
// torch.cuda.max_memory_allocated reports). reset != 0 resets the peak after reading it.
char* attnlab_cuda_peak_memory(int64_t device, int reset, int64_t* out) {
  GUARD_BEGIN
  auto* alloc = c10::getDeviceAllocator(c10::DeviceType::CUDA);
  auto stats = alloc->getDeviceStats(static_cast<c10::DeviceIndex>(device));
  *out = stats.allocated_bytes[0].peak;  // index 0 = StatType::AGGREGATE
  if (reset) alloc->resetPeakStats(static_cast<c10::DeviceIndex>(device));
  GUARD_END
}

// Bytes a new allocation on `device` can still get: the device's free memory plus what the caching
// allocator holds unused (torch.cuda.mem_get_info()[0] + reserved − allocated).
char* attnlab_cuda_free_memory(int64_t device, int64_t* out) {
  GUARD_BEGIN
  auto* alloc = c10::getDeviceAllocator(c10::DeviceType::CUDA);
  auto idx = static_cast<c10::DeviceIndex>(device);
  auto info = alloc->getMemoryInfo(idx);
  auto stats = alloc->getDeviceStats(idx);
  *out = static_cast<int64_t>(info.first) + stats.reserved_bytes[0].current - stats.allocated_bytes[0].current;
  GUARD_END
}

}  // extern "C"
