// hprt from C++: select a platform, move bytes through pinned memory, all-reduce across threads,
// swap layer activations out and back, compress and decompress an activation, shard a parameter
// over threads (FSDP) and reduce its gradient.
// Built and run by scripts/test:  examples/cpp/run.sh
#include <algorithm>
#include <chrono>
#include <cmath>
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

// Each rank on a device of its own where there are enough (NCCL refuses two ranks on one GPU).
static HprtStatus use_rank_device(const HprtPlatform* p, size_t rank) {
  size_t n = 0;
  HprtStatus st = hprt_device_count(p, &n);
  return st != HPRT_STATUS_OK ? st : hprt_set_device(p, rank % n);
}

static void rank_main(const HprtPlatform* p, const std::vector<uint8_t>& id, size_t rank,
                      size_t world, bool* ok) {
  HprtStream* s = nullptr;
  HprtComm* comm = nullptr;
  HprtDeviceBuffer* dev = nullptr;
  HprtPinnedBuffer* host = nullptr;
  CHECK(use_rank_device(p, rank));
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

// Host <-> device through a pinned staging buffer, in `s` order (the copy back synchronizes).
static void upload(const HprtPlatform* p, HprtStream* s, HprtDeviceBuffer* dst, const void* src,
                   size_t bytes) {
  HprtPinnedBuffer* host = nullptr;
  void* hp = nullptr;
  CHECK(hprt_pinned_alloc(p, bytes, &host));
  CHECK(hprt_pinned_info(host, &hp, nullptr));
  std::memcpy(hp, src, bytes);
  HprtMemRef d = {dst, nullptr, 0}, h = {nullptr, host, 0};
  CHECK(hprt_copy_async(p, d, h, bytes, s));
  CHECK(hprt_pinned_free(p, host));  // freed once the queued copy finished
}

static void download(const HprtPlatform* p, HprtStream* s, HprtDeviceBuffer* src, void* dst,
                     size_t bytes) {
  HprtPinnedBuffer* host = nullptr;
  void* hp = nullptr;
  CHECK(hprt_pinned_alloc(p, bytes, &host));
  CHECK(hprt_pinned_info(host, &hp, nullptr));
  HprtMemRef d = {src, nullptr, 0}, h = {nullptr, host, 0};
  CHECK(hprt_copy_async(p, h, d, bytes, s));
  CHECK(hprt_stream_synchronize(p, s));
  std::memcpy(dst, hp, bytes);
  CHECK(hprt_pinned_free(p, host));
}

// A device address hprt handed out (an unsharded parameter, a gradient shard), read back the way
// a framework would use it: wrapped without taking ownership.
static void download_address(const HprtPlatform* p, HprtStream* s, uintptr_t address, void* dst,
                             size_t bytes) {
  HprtDeviceBuffer* view = nullptr;
  CHECK(hprt_device_wrap(p, address, bytes, nullptr, nullptr, &view));
  download(p, s, view, dst, bytes);
  CHECK(hprt_device_free(p, view));
}

// FSDP on one rank: a 10 x 4 weight sharded over `world` ranks (3 rows each, the last shard
// padded), gathered back whole, and a gradient averaged over ranks into this rank's shard.
static const size_t kRows = 10, kCols = 4;

static void fsdp_rank(const HprtPlatform* p, const std::vector<uint8_t>& id, size_t rank,
                      size_t world, bool* ok) {
  HprtStream* s = nullptr;
  HprtComm* comm = nullptr;
  HprtHsdp* dp = nullptr;
  CHECK(use_rank_device(p, rank));
  CHECK(hprt_stream_create(p, &s));
  CHECK(hprt_comm_init(p, id.data(), id.size(), rank, world, &comm));
  size_t mesh[1] = {world};
  CHECK(hprt_hsdp_create(p, comm, HPRT_DP_MODE_FSDP, mesh, 1, s, &dp));

  const size_t n = kRows * kCols;
  std::vector<float> weight(n), grad(n), back(n);
  for (size_t i = 0; i < n; ++i) weight[i] = 0.25f * float(i);
  for (size_t i = 0; i < n; ++i) grad[i] = float(rank + 1) * float(i);
  HprtDeviceBuffer* full = nullptr;
  HprtDeviceBuffer* g = nullptr;
  CHECK(hprt_device_alloc(p, n * sizeof(float), &full));
  CHECK(hprt_device_alloc(p, n * sizeof(float), &g));
  upload(p, s, full, weight.data(), n * sizeof(float));
  upload(p, s, g, grad.data(), n * sizeof(float));

  HprtHsdpParam* w = nullptr;
  size_t shape[2] = {kRows, kCols};
  CHECK(hprt_hsdp_param_create(dp, "weight", shape, 2, HPRT_DTYPE_F32, nullptr, full, 0, &w));
  CHECK(hprt_device_free(p, full));  // the parameter keeps only its shard
  HprtHsdpParamInfo info;
  CHECK(hprt_hsdp_param_info(w, &info));

  // Forward pre-hook: prefetch, then make the compute stream wait for the all-gather.
  CHECK(hprt_hsdp_param_unshard(w, /*async_op=*/true));
  CHECK(hprt_hsdp_param_wait_for_unshard(w));
  uintptr_t addr = 0;
  size_t bytes = 0;
  CHECK(hprt_hsdp_param_unsharded(w, &addr, &bytes));
  download_address(p, s, addr, back.data(), bytes);
  *ok = bytes == n * sizeof(float) && back == weight;
  CHECK(hprt_hsdp_param_shard(w));  // forward post-hook: free the gathered weight

  // Backward post-hook: average the gradient into this rank's shard.
  CHECK(hprt_hsdp_param_reduce_grad(w, g, 0, HPRT_DTYPE_F32, HPRT_REDUCE_OP_AVG, 1.0,
                                    /*async_op=*/true));
  CHECK(hprt_hsdp_param_wait_for_reduce(w));
  HprtShardView gv;
  CHECK(hprt_hsdp_param_sharded_grad(w, &gv));
  std::vector<float> shard(info.shard_numel);
  download_address(p, s, gv.address, shard.data(), gv.bytes);
  float mean_factor = float(world + 1) / 2;  // mean of (rank + 1) over ranks
  for (size_t i = 0; i < info.shard_numel; ++i) {
    size_t row = info.shard_index * info.rows_per_shard + i / kCols;
    float want = row < kRows ? mean_factor * float(row * kCols + i % kCols) : 0.0f;
    if (std::fabs(shard[i] - want) > 1e-4f * std::fmax(1.0f, std::fabs(want))) {
      std::fprintf(stderr, "rank %zu: gradient shard[%zu] is %g, want %g\n", rank, i, shard[i],
                   want);
      *ok = false;
      break;
    }
  }
  CHECK(hprt_stream_synchronize(p, s));
  CHECK(hprt_device_free(p, g));
  CHECK(hprt_hsdp_param_destroy(w));
  CHECK(hprt_hsdp_destroy(dp));
  CHECK(hprt_comm_destroy(p, comm));
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

  // Lossless compression of an activation-like f32 tensor with a few NaN payloads and
  // infinities: every bit must come back.
  {
    const size_t n = 1 << 16;
    std::vector<uint32_t> act(n);
    for (size_t i = 0; i < n; ++i) {
      float v = 0.8f * std::sin(0.013f * float(i)) + 0.01f * float(i % 7);
      std::memcpy(&act[i], &v, sizeof v);
    }
    act[3] = 0x7fc00001u;   // NaN with a payload
    act[99] = 0xffc12345u;  // negative NaN
    act[500] = 0x7f800000u; // +inf
    size_t cap = 0, len = 0, out = 0;
    CHECK(hprt_compress_max_size(HPRT_DTYPE_F32, n, &cap));
    std::vector<uint8_t> packed(cap);
    CHECK(hprt_compress(HPRT_DTYPE_F32, act.data(), n * 4, packed.data(), cap, &len));
    HprtCompressedInfo ci;
    CHECK(hprt_compressed_info(packed.data(), len, &ci));
    std::vector<uint32_t> back(n);
    CHECK(hprt_decompress(packed.data(), len, back.data(), n * 4, &out));
    if (out != n * 4 || ci.numel != n || back != act) {
      std::fprintf(stderr, "compress: round trip is not bit-exact\n");
      return 1;
    }
    std::printf("compress: %zu -> %zu bytes (ratio %.3f), bit-exact: ok\n", n * 4, len,
                double(n * 4) / double(len));
    packed[len / 2] ^= 0x01;  // one flipped bit: a typed error, never wrong data
    HprtStatus cs = hprt_decompress(packed.data(), len, back.data(), n * 4, &out);
    std::printf("compress: flipped bit -> %s\n", hprt_status_name(cs));
    if (cs != HPRT_STATUS_ERROR_CORRUPT_DATA) return 1;

    // The same tensor in device memory, through the device codec on a stream.
    HprtStream* cstream = nullptr;
    HprtDeviceBuffer* dsrc = nullptr;
    HprtDeviceBuffer* dpacked = nullptr;
    HprtDeviceBuffer* dback = nullptr;
    CHECK(hprt_stream_create(p, &cstream));
    CHECK(hprt_device_alloc(p, n * 4, &dsrc));
    CHECK(hprt_device_alloc(p, cap, &dpacked));
    CHECK(hprt_device_alloc(p, n * 4, &dback));
    upload(p, cstream, dsrc, act.data(), n * 4);
    size_t dlen = 0;
    CHECK(hprt_compress_device(p, dsrc, 0, HPRT_DTYPE_F32, n, dpacked, cstream, &dlen));
    CHECK(hprt_decompress_device(p, dpacked, dlen, HPRT_DTYPE_F32, n, dback, 0, cstream));
    std::fill(back.begin(), back.end(), 0u);
    download(p, cstream, dback, back.data(), n * 4);
    if (dlen != len || back != act) {
      std::fprintf(stderr, "compress: device round trip differs (%zu vs %zu bytes)\n", dlen, len);
      return 1;
    }
    std::printf("compress: device codec %zu bytes, bit-exact: ok\n", dlen);
    CHECK(hprt_device_free(p, dsrc));
    CHECK(hprt_device_free(p, dpacked));
    CHECK(hprt_device_free(p, dback));
    CHECK(hprt_stream_destroy(p, cstream));
  }

  // FSDP across threads: shard, unshard, reduce-scatter the gradient.
  {
    std::vector<uint8_t> fid(HPRT_UNIQUE_ID_MAX_BYTES);
    size_t flen = 0;
    CHECK(hprt_unique_id(p, fid.data(), fid.size(), &flen));
    fid.resize(flen);
    std::vector<std::thread> fsdp;
    bool fok[world] = {};
    for (size_t r = 0; r < world; ++r)
      fsdp.emplace_back(fsdp_rank, p, std::cref(fid), r, world, &fok[r]);
    for (auto& t : fsdp) t.join();
    for (size_t r = 0; r < world; ++r)
      if (!fok[r]) return 1;
    std::printf("fsdp over %zu ranks: unshard and averaged gradient shards: ok\n", world);
  }

  // Peers drop their references to a rank's buffers as their last collectives retire.
  HprtMemoryStats m;
  for (int i = 0; i < 2000; ++i) {
    CHECK(hprt_platform_memory_stats(p, &m));
    if (m.device_current == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::printf("device bytes: current %zu, peak %zu\n", m.device_current, m.device_peak);
  return m.device_current == 0 ? 0 : 1;
}
