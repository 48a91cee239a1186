// Runs csrc/cuda's kernels on the CPU (cuda_emu.h) against their references: `make cuda-emu-test`,
// part of `make test`. Exit 1 naming each failed test; a deadlocked kernel (a shuffle or barrier
// not every thread reaches) is ended by an alarm and fails the run.
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

static const char* running = "";

static void on_alarm(int) {
  std::fprintf(stderr, "cuda-emu: %s did not finish in 300 s: a deadlock (a shuffle or __syncthreads not every thread reaches)?\n", running);
  std::_Exit(2);
}

int main(int argc, char** argv) {
  std::signal(SIGALRM, on_alarm);
  int failed = 0, ran = 0;
  for (auto& t : emu_test::registry()) {
    if (argc > 1 && std::string(t.name).find(argv[1]) == std::string::npos) continue;
    running = t.name;
    alarm(300);
    std::printf("%s\n", t.name);
    std::fflush(stdout);
    const bool ok = t.run();
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
