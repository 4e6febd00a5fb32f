// hprt from C++: select a platform, move bytes through pinned memory, all-reduce across threads.
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

  HprtMemoryStats m;
  CHECK(hprt_platform_memory_stats(p, &m));
  std::printf("device bytes: current %zu, peak %zu\n", m.device_current, m.device_peak);
  return m.device_current == 0 ? 0 : 1;
}
