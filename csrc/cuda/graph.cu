// CUDA graphs for decoding (issue 34): one decode step captured once through PyTorch's own
// at::cuda::CUDAGraph (so the caching allocator gives the step a private memory pool and the
// default generator's Philox offsets advance on replay), then replayed per token with one launch.
//
// The protocol (src/kernels/cuda.rs wraps it): `enter` moves the calling thread onto a side stream
// (capture cannot run on the default stream) after the work already queued; the caller runs the
// step once there eagerly (warm-up: cuBLAS's per-stream workspace, lazy inits; skipped for a step
// the process has captured before with ATTNLAB_GRAPH_WARM_ONCE=1, then replayed once), then `capture`,
// runs the step again (recorded, not executed) and `leave` ends the capture and moves back, the
// original stream waiting for the side one. `replay` launches the graph on the current stream.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <vector>

namespace {

struct Graph {
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream outer;
  c10::cuda::CUDAStream side;
  bool capturing = false;
  Graph(c10::cuda::CUDAStream outer, c10::cuda::CUDAStream side) : outer(outer), side(side) {}
};

// Every capture on a device takes the same side stream (not the pool's next one): the cuBLAS
// workspace a stream gets on its first use is then made once, outside any capture, so that a later
// capture of a step this process has already run may skip the eager warm-up
// (`ATTNLAB_GRAPH_WARM_ONCE`, src/kernels/cuda.rs).
c10::cuda::CUDAStream side_stream(int device) {
  static std::mutex mu;
  static std::vector<std::optional<c10::cuda::CUDAStream>> streams;
  std::lock_guard<std::mutex> lock(mu);
  if (streams.size() <= static_cast<size_t>(device)) streams.resize(device + 1);
  auto& s = streams[device];
  if (!s) s = c10::cuda::getStreamFromPool(false, device);
  return *s;
}

// `b` runs after everything queued on `a` so far.
void wait(c10::cuda::CUDAStream a, c10::cuda::CUDAStream b) {
  cudaEvent_t ev;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(ev, a.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(b.stream(), ev, 0));
  // Destroying a recorded event is safe: the wait is already queued.
  C10_CUDA_CHECK(cudaEventDestroy(ev));
}

}  // namespace

extern "C" char* attnlab_graph_enter(int device, void** out) {
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    auto outer = c10::cuda::getCurrentCUDAStream(device);
    auto side = side_stream(device);
    auto* g = new Graph(outer, side);
    wait(outer, side);
    c10::cuda::setCurrentCUDAStream(side);
    *out = g;
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}

extern "C" char* attnlab_graph_capture(void* h) {
  try {
    auto* g = static_cast<Graph*>(h);
    g->graph.capture_begin();
    g->capturing = true;
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}

extern "C" char* attnlab_graph_leave(void* h) {
  auto* g = static_cast<Graph*>(h);
  char* err = nullptr;
  try {
    if (g->capturing) {
      g->capturing = false;
      g->graph.capture_end();
    }
  } catch (const std::exception& e) {
    err = strdup(e.what());
  }
  // Back on the caller's stream whatever happened, after the side stream's work.
  try {
    wait(g->side, g->outer);
    c10::cuda::setCurrentCUDAStream(g->outer);
  } catch (const std::exception& e) {
    if (!err) err = strdup(e.what());
  }
  return err;
}

extern "C" char* attnlab_graph_replay(void* h) {
  try {
    static_cast<Graph*>(h)->graph.replay();
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}

extern "C" void attnlab_graph_free(void* h) {
  delete static_cast<Graph*>(h);
}
