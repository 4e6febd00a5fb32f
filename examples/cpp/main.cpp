// hprt from C++: select a platform, move bytes through pinned memory, all-reduce across threads,
// swap layer activations out and back.
// Built and run by scripts/test:  examples/cpp/run.sh
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "hprt.h"

// Every hprt call returns a status; turn failures into a message naming the call.
#define CHECK(call)                                                                   \
  do {                                                                                \
    HprtStatus s_ = (call);                                                           \
    if (s_ != HPRT_STATUS_OK) {                                                       \
      std::fprintf(stderr, "%s failed: %s: %s\n", #call, hprt_status_name(s_),        \
                   hprt_last_error_message());                                        \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

static const size_t kCount = 4096;

static void rank_main(const HprtPlatform* p, const std::vector<uint8_t>& id, size_t rank,
                      size_t world, bool* ok) {
  HprtStream* s = nullptr;
  HprtComm* comm = nullptr;
  HprtDeviceBuffer* dev = nullptr;
  HprtPinnedBuffer* host = nullptr;
  CHECK(hprt_stream_create(p, &s));
  CHECK(hprt_comm_init(p, id.data(), id.size(), rank, world, &comm));
  CHECK(hprt_device_alloc(p, kCount * sizeof(float), &dev));
  CHECK(hprt_pinned_alloc(p, kCount * sizeof(float), &host));
  void* hp = nullptr;
  CHECK(hprt_pinned_info(host, &hp, nullptr));
  float* v = static_cast<float*>(hp);
  for (size_t i = 0; i < kCount; ++i) v[i] = float(rank + 1) * float(i % 100);

  HprtMemRef d = {dev, nullptr, 0};
  HprtMemRef h = {nullptr, host, 0};
  CHECK(hprt_copy_async(p, d, h, kCount * sizeof(float), s));
  CHECK(hprt_all_reduce(p, comm, dev, 0, dev, 0, kCount, HPRT_DTYPE_F32, HPRT_REDUCE_OP_SUM, s));
  CHECK(hprt_copy_async(p, h, d, kCount * sizeof(float), s));
  CHECK(hprt_stream_synchronize(p, s));  // only now may the host read `v`

  float ranks_sum = float(world * (world + 1) / 2);
  *ok = true;
  for (size_t i = 0; i < kCount; ++i) {
    if (v[i] != ranks_sum * float(i % 100)) {
      std::fprintf(stderr, "rank %zu: element %zu is %g, want %g\n", rank, i, v[i],
                   ranks_sum * float(i % 100));
      *ok = false;
      break;
    }
  }
  CHECK(hprt_comm_destroy(p, comm));
  CHECK(hprt_device_free(p, dev));
  CHECK(hprt_pinned_free(p, host));
  CHECK(hprt_stream_destroy(p, s));
}

int main() {
  const HprtPlatform* p = nullptr;
  CHECK(hprt_platform_get(&p));  // HP_PLATFORM, or auto-detect
  const char* backend = nullptr;
  CHECK(hprt_platform_backend_name(p, &backend));
  std::printf("platform: %s\n", backend);

  // A typed error, not a crash: a copy past the end of a buffer.
  HprtDeviceBuffer* small = nullptr;
  HprtStream* s = nullptr;
  CHECK(hprt_device_alloc(p, 16, &small));
  CHECK(hprt_stream_create(p, &s));
  HprtMemRef a = {small, nullptr, 8};
  HprtMemRef b = {small, nullptr, 0};
  HprtStatus st = hprt_copy_async(p, a, b, 16, s);
  std::printf("copy past the end: %s (%s)\n", hprt_status_name(st), hprt_last_error_message());
  if (st != HPRT_STATUS_ERROR_OUT_OF_RANGE) return 1;
  CHECK(hprt_device_free(p, small));
  CHECK(hprt_stream_destroy(p, s));

  // Collectives: ranks are threads of this process on the cpu backend.
  const size_t world = 4;
  std::vector<uint8_t> id(HPRT_UNIQUE_ID_MAX_BYTES);
  size_t len = 0;
  CHECK(hprt_unique_id(p, id.data(), id.size(), &len));
  id.resize(len);
  std::vector<std::thread> ranks;
  bool ok[world] = {};
  for (size_t r = 0; r < world; ++r) ranks.emplace_back(rank_main, p, std::cref(id), r, world, &ok[r]);
  for (auto& t : ranks) t.join();
  for (size_t r = 0; r < world; ++r)
    if (!ok[r]) return 1;
  std::printf("all_reduce over %zu ranks: ok\n", world);

  // Layer-group swap: three linked layers each save a 1 MiB activation; after the forward only
  // the last layer's stays on the device, the backward brings every byte back.
  {
    const size_t kBytes = 1 << 20, kLayers = 3;
    HprtStream* compute = nullptr;
    HprtSwapManager* swap = nullptr;
    HprtPinnedBuffer* staging = nullptr;
    CHECK(hprt_stream_create(p, &compute));
    CHECK(hprt_swap_manager_create(p, /*host_budget=*/0, &swap));
    CHECK(hprt_pinned_alloc(p, kBytes, &staging));
    void* sp = nullptr;
    CHECK(hprt_pinned_info(staging, &sp, nullptr));
    uint8_t* host = static_cast<uint8_t*>(sp);
    size_t layer[kLayers];
    HprtDeviceBuffer* act[kLayers];
    HprtSavedRef saved[kLayers];
    for (size_t l = 0; l < kLayers; ++l) CHECK(hprt_swap_new_layer(swap, &layer[l]));
    for (size_t l = 0; l + 1 < kLayers; ++l)
      CHECK(hprt_swap_set_forward_prefetch_layer(swap, layer[l], layer[l + 1]));
    HprtMemoryStats before;
    CHECK(hprt_platform_memory_stats(p, &before));
    for (size_t l = 0; l < kLayers; ++l) {  // forward
      CHECK(hprt_swap_forward_pre(swap, layer[l]));
      CHECK(hprt_device_alloc(p, kBytes, &act[l]));
      std::memset(host, int(0x10 + l), kBytes);
      HprtMemRef d = {act[l], nullptr, 0}, h = {nullptr, staging, 0};
      CHECK(hprt_copy_async(p, d, h, kBytes, compute));
      CHECK(hprt_stream_synchronize(p, compute));  // the staging buffer is reused next layer
      CHECK(hprt_swap_save(swap, act[l], 0, kBytes, HPRT_DTYPE_U8, &saved[l]));
      CHECK(hprt_swap_forward_post(swap, layer[l], compute));
    }
    HprtMemoryStats mid;
    CHECK(hprt_platform_memory_stats(p, &mid));
    std::printf("swap: device bytes after forward %zu (without swap: %zu)\n",
                mid.device_current - before.device_current, kLayers * kBytes);
    bool swap_ok = mid.device_current - before.device_current < kLayers * kBytes;
    for (size_t l = kLayers; l-- > 0;) {  // backward
      CHECK(hprt_swap_backward_pre(swap, layer[l], compute));
      uintptr_t addr = 0;
      CHECK(hprt_swap_get(swap, saved[l], &addr));
      HprtMemRef d = {act[l], nullptr, 0}, h = {nullptr, staging, 0};
      CHECK(hprt_copy_async(p, h, d, kBytes, compute));
      CHECK(hprt_stream_synchronize(p, compute));
      for (size_t i = 0; i < kBytes; ++i)
        if (host[i] != uint8_t(0x10 + l)) {
          std::fprintf(stderr, "layer %zu byte %zu came back as %d\n", l, i, host[i]);
          return 1;
        }
      CHECK(hprt_swap_backward_post(swap, layer[l]));
    }
    HprtSwapStats st;
    CHECK(hprt_swap_stats(swap, &st));
    std::printf("swap: offloaded %llu bytes, reloaded %llu, every byte back: ok\n",
                (unsigned long long)st.offloaded_bytes, (unsigned long long)st.reloaded_bytes);
    CHECK(hprt_swap_end_iteration(swap));
    CHECK(hprt_swap_manager_destroy(swap));
    for (size_t l = 0; l < kLayers; ++l) CHECK(hprt_device_free(p, act[l]));
    CHECK(hprt_pinned_free(p, staging));
    CHECK(hprt_stream_destroy(p, compute));
    if (!swap_ok || st.offloaded_bytes == 0) return 1;
  }

  HprtMemoryStats m;
  CHECK(hprt_platform_memory_stats(p, &m));
  std::printf("device bytes: current %zu, peak %zu\n", m.device_current, m.device_peak);
  return m.device_current == 0 ? 0 : 1;
}
