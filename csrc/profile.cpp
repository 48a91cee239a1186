// Where the time goes (issue 28): libtorch's own profiler (Kineto; CUDA kernels through CUPTI, the
// same machinery as torch.profiler) around a region of `attnlab bench --profile`, saved as a Chrome
// trace that scripts/profile_table.py summarises; and named scopes (user annotations in the trace)
// that the Rust side and the DAR op open around their pieces. A scope costs one thread-local check
// when no profiler is running.
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace prof = torch::profiler::impl;

namespace {
thread_local std::vector<std::unique_ptr<at::RecordFunction>> scopes;
bool cuda_requested = false;
}  // namespace

#define GUARD_BEGIN try {
#define GUARD_END                   \
  return nullptr;                   \
  }                                 \
  catch (const std::exception& e) { \
    return strdup(e.what());        \
  }

extern "C" {

// Start profiling CPU ops (and CUDA kernels, memcpys and memsets when cuda != 0) on this process.
char* attnlab_profiler_start(int cuda) {
  GUARD_BEGIN
  std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
  if (cuda) activities.insert(prof::ActivityType::CUDA);
  prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  cuda_requested = cuda != 0;
  GUARD_END
}

// Stop, write the Chrome trace to `path` and the number of events on the device (kernels, copies)
// to *device_events. Profiling CUDA and seeing none of its events is an error: the trace would say
// nothing about the GPU (CUPTI not loaded, or nothing ran there).
char* attnlab_profiler_stop(const char* path, int64_t* device_events) {
  GUARD_BEGIN
  auto result = torch::autograd::profiler::disableProfiler();
  int64_t n = 0;
  for (const auto& e : result->events()) n += e.deviceType() == c10::DeviceType::CUDA;
  *device_events = n;
  result->save(path);
  TORCH_CHECK(!cuda_requested || n > 0, "the profiler recorded no CUDA kernels (is CUPTI, libcupti.so, loadable?); trace at ", path);
  GUARD_END
}

// Open a named scope on this thread (a user annotation in the trace); close it with scope_pop.
char* attnlab_scope_push(const char* name) {
  GUARD_BEGIN
  auto rf = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (rf->isActive()) rf->before(std::string_view(name), c10::ArrayRef<const c10::IValue>{});
  scopes.push_back(std::move(rf));
  GUARD_END
}

char* attnlab_scope_pop() {
  GUARD_BEGIN
  TORCH_CHECK(!scopes.empty(), "scope_pop without a scope open");
  scopes.pop_back();  // RecordFunction's destructor ends the range
  GUARD_END
}

}  // extern "C"
