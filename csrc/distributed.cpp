// c10d::TCPStore (libtorch's rendezvous key-value store, the one torchrun and
// torch.distributed use) behind a C API for src/train/distributed.rs. Rank 0 hosts the
// server; every rank is a client. Errors (timeouts, dead peers) come back as strdup'ed strings.
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {
char* err(const std::exception& e) { return strdup(e.what()); }
}

extern "C" {

char* attnlab_store_new(const char* host, int port, int is_server, int world, int64_t timeout_ms, void** out) {
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(port);
    o.isServer = is_server != 0;
    o.numWorkers = static_cast<std::size_t>(world);
    o.waitWorkers = true;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    *out = new c10d::TCPStore(std::string(host), o);
    return nullptr;
  } catch (const std::exception& e) {
    return err(e);
  }
}

void attnlab_store_free(void* s) { delete static_cast<c10d::TCPStore*>(s); }

char* attnlab_store_set(void* s, const char* key, const uint8_t* data, int64_t len) {
  try {
    static_cast<c10d::TCPStore*>(s)->set(key, std::vector<uint8_t>(data, data + len));
    return nullptr;
  } catch (const std::exception& e) {
    return err(e);
  }
}

// Blocks until the key exists (or the store's timeout passes). *data is malloc'ed: free() it.
char* attnlab_store_get(void* s, const char* key, uint8_t** data, int64_t* len) {
  try {
    auto v = static_cast<c10d::TCPStore*>(s)->get(key);
    *len = static_cast<int64_t>(v.size());
    *data = static_cast<uint8_t*>(malloc(v.size() ? v.size() : 1));
    if (!v.empty()) memcpy(*data, v.data(), v.size());
    return nullptr;
  } catch (const std::exception& e) {
    return err(e);
  }
}

char* attnlab_store_add(void* s, const char* key, int64_t delta, int64_t* out) {
  try {
    *out = static_cast<c10d::TCPStore*>(s)->add(key, delta);
    return nullptr;
  } catch (const std::exception& e) {
    return err(e);
  }
}

char* attnlab_store_delete(void* s, const char* key) {
  try {
    static_cast<c10d::TCPStore*>(s)->deleteKey(key);
    return nullptr;
  } catch (const std::exception& e) {
    return err(e);
  }
}

}  // extern "C"
