// Runs csrc/cuda's kernels on the CPU (cuda_emu.h) against their references: `make cuda-emu-test`,
// part of `make test`; each test twice, the second time with a jittered thread schedule. Exit 1
// naming each failed test; a deadlocked kernel (a shuffle or barrier not every thread reaches) is
// ended by an alarm and fails the run.
#include "emu_test.h"
#include <csignal>
#include <cstdlib>
#include <unistd.h>

namespace emu_test {
std::vector<Test>& registry() {
  static std::vector<Test> tests;
  return tests;
}
}  // namespace emu_test

// The emulated 16-bit conversions against known bit patterns: every kernel test rests on them.
static bool conversions() {
  struct {
    float f;
    uint16_t half, bf16;
  } known[] = {{1.f, 0x3c00, 0x3f80},   {-2.f, 0xc000, 0xc000},          {0.1f, 0x2e66, 0x3dcd},        {65504.f, 0x7bff, 0x4780},
               {65520.f, 0x7c00, 0x4780}, {0x1p-24f, 0x0001, 0x3380},   {0x1p-25f, 0x0000, 0x3300},    {0x1.8p-25f, 0x0001, 0x3340},
               {3.0e-5f, 0x01f7, 0x37fc}, {INFINITY, 0x7c00, 0x7f80},  {1.00048828125f, 0x3c00, 0x3f80}, {1.00146484375f, 0x3c02, 0x3f80}};
  bool ok = true;
  for (auto k : known) {
    const uint16_t h = __float2half(k.f).bits, b = __float2bfloat16(k.f).bits;
    const float back = __half2float(__half{k.half});
    const bool good = h == k.half && b == k.bf16 && (k.f > 65504.f || std::abs(back - k.f) <= std::abs(k.f) * 0x1p-11f + 0x1p-25f);
    if (!good) std::printf("  FAILED: %g → half %#06x (want %#06x), bf16 %#06x (want %#06x), half back %g\n", k.f, h, k.half, b, k.bf16, back);
    ok &= good;
  }
  std::printf("  16-bit conversions of %zu known values  %s\n", sizeof(known) / sizeof(known[0]), ok ? "ok" : "FAILED");
  return ok;
}
static emu_test::Register conversions_test("cuda_emu: bf16 / fp16 conversions by their bits", conversions);

static const char* running = "";
// Seconds one schedule of a test may take before it counts as a deadlock: 300, or
// CUDA_EMU_ALARM_S (the AddressSanitizer build runs several times slower).
static unsigned alarm_s = 300;

static void on_alarm(int) {
  std::fprintf(stderr, "cuda-emu: %s: a schedule did not finish in %u s: a deadlock (a shuffle or __syncthreads not every thread reaches)?\n", running, alarm_s);
  std::_Exit(2);
}

int main(int argc, char** argv) {
  std::signal(SIGALRM, on_alarm);
  if (const char* v = std::getenv("CUDA_EMU_ALARM_S")) alarm_s = static_cast<unsigned>(std::strtoul(v, nullptr, 10));
  int failed = 0, ran = 0;
  for (auto& t : emu_test::registry()) {
    if (argc > 1 && std::string(t.name).find(argv[1]) == std::string::npos) continue;
    running = t.name;
    alarm(alarm_s);
    std::printf("%s\n", t.name);
    std::fflush(stdout);
    emu::jitter = 0;
    bool ok = t.run();
    // Again with threads held back at random after barriers: a missing barrier shows as wrong results.
    std::printf(" with a jittered schedule:\n");
    std::fflush(stdout);
    emu::jitter = 0x5eed;
    alarm(alarm_s);
    ok &= t.run();
    emu::jitter = 0;
    // And with one warp of each block always ahead of the others.
    std::printf(" with one warp running ahead:\n");
    std::fflush(stdout);
    emu::run_ahead = true;
    alarm(alarm_s);
    ok &= t.run();
    emu::run_ahead = false;
    alarm(0);
    ++ran;
    if (!ok) {
      ++failed;
      std::printf("FAILED: %s\n", t.name);
    }
  }
  std::printf("cuda-emu: %d of %d kernel tests passed\n", ran - failed, ran);
  return failed == 0 && ran > 0 ? 0 : 1;
}
