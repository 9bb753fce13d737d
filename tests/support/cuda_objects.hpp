// SPDX-License-Identifier: Apache-2.0
// Live CUDA objects of this process, counted for leak checks: events, streams, device
// allocations (cudaMalloc, cudaMallocAsync, VMM handles) and pinned host memory
// (cudaMallocHost/cudaHostAlloc, cudaHostRegister), with their bytes.
//
// CUDA has no query for how many events or streams a process holds, and cudaMemGetInfo sees
// device memory in 2 MiB pages (a leak of a few KiB per round stays below it for hundreds of
// rounds). So this counts the driver calls that make and destroy them, through CUPTI's callback
// API (loaded with dlopen, so the test programs need no link to it), which reports the driver
// calls that the runtime, NCCL and wm make, from any thread; start() checks that it does. A
// count is the creations minus the destructions since counting began: compare two snapshots.
//
//   auto& objects = wm_test::cuda_objects::start();  // in the process (rank) that does the work
//   if (!objects.counting()) { ... objects.why_not() ... }
//   auto const before = objects.now();
//   ... rounds ...
//   auto const grew = objects.now() - before;  // all zero: nothing leaked
//
// CUPTI takes one subscriber per process: where another tool holds it (Nsight Systems, Nsight
// Compute, cuda-gdb; possibly compute-sanitizer), or libcupti is missing, counting() is false
// and why_not() says why (then say so in the test's result: wm_test::skip, skip.hpp). start()
// checks that callbacks really come (it makes and destroys an event and a stream and sees them
// counted) before it reports counting() true. Start it in a rank, not in a test main that forks
// afterwards.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cupti_callbacks.h>
#include <cupti_driver_cbid.h>
#include <dlfcn.h>
#include <mutex>
#include <string>
#include <unordered_map>

namespace wm_test {

/// Live objects (creations minus destructions since counting began) of each kind.
struct cuda_object_counts {
  std::int64_t events{};
  std::int64_t streams{};
  std::int64_t device_allocations{};  ///< cuMemAlloc*, cuMemAllocAsync*, cuMemCreate
  std::int64_t device_bytes{};
  std::int64_t pinned_host{};  ///< cuMemAllocHost, cuMemHostAlloc, cuMemHostRegister
  std::int64_t pinned_host_bytes{};

  [[nodiscard]] friend cuda_object_counts operator-(cuda_object_counts a,
                                                    cuda_object_counts const& b) noexcept {
    a.events -= b.events;
    a.streams -= b.streams;
    a.device_allocations -= b.device_allocations;
    a.device_bytes -= b.device_bytes;
    a.pinned_host -= b.pinned_host;
    a.pinned_host_bytes -= b.pinned_host_bytes;
    return a;
  }
  [[nodiscard]] friend bool operator==(cuda_object_counts const&,
                                       cuda_object_counts const&) = default;

  /// True when any count of @p after exceeds @p before's: objects made and not destroyed. Fewer
  /// is not a leak (a free of something made before the baseline, e.g. NCCL's buffers).
  [[nodiscard]] friend bool grew(cuda_object_counts const& before,
                                 cuda_object_counts const& after) noexcept {
    return after.events > before.events || after.streams > before.streams ||
           after.device_allocations > before.device_allocations ||
           after.device_bytes > before.device_bytes || after.pinned_host > before.pinned_host ||
           after.pinned_host_bytes > before.pinned_host_bytes;
  }

  /// "events +1, streams 0, ..." for messages.
  [[nodiscard]] std::string to_string() const {
    auto f = [](char const* name, std::int64_t v) {
      return std::string{name} + " " + (v > 0 ? "+" : "") + std::to_string(v);
    };
    return f("events", events) + ", " + f("streams", streams) + ", " +
           f("device allocations", device_allocations) + " (" + f("bytes", device_bytes) + "), " +
           f("pinned host", pinned_host) + " (" + f("bytes", pinned_host_bytes) + ")";
  }
};

/// The process's counter of CUDA objects (see the file's notes).
class cuda_objects {
 public:
  /// Starts counting at the first call (later calls return the same counter).
  [[nodiscard]] static cuda_objects& start() {
    static cuda_objects c;
    return c;
  }

  /// True when every kind is counted.
  [[nodiscard]] bool counting() const noexcept { return why_not_.empty(); }
  /// Why nothing is counted (empty while counting).
  [[nodiscard]] std::string const& why_not() const noexcept { return why_not_; }

  /// The counts now (all zero when not counting).
  [[nodiscard]] cuda_object_counts now() const {
    std::lock_guard lock{mutex_};
    return live_;
  }

  /// What CUPTI calls on the entry and exit of every driver call (@p self: the counter); it
  /// counts the successful exits of the calls that make or destroy an object of a counted kind.
  /// Public for the host test of the bookkeeping, which feeds it made-up call records.
  static void CUPTIAPI callback(void* self, CUpti_CallbackDomain domain, CUpti_CallbackId id,
                                void const* data) {
    auto const& d = *static_cast<CUpti_CallbackData const*>(data);
    if (domain != CUPTI_CB_DOMAIN_DRIVER_API || d.callbackSite != CUPTI_API_EXIT) { return; }
    if (d.functionReturnValue == nullptr ||
        *static_cast<CUresult const*>(d.functionReturnValue) != CUDA_SUCCESS) {
      return;
    }
    static_cast<cuda_objects*>(self)->count(id, d.functionParams);
  }

  /// A counter that CUPTI does not feed (counting() is false): for that host test.
  struct unsubscribed {};
  explicit cuda_objects(unsubscribed) : why_not_{"not subscribed to CUPTI"} {}

  cuda_objects(cuda_objects const&)            = delete;
  cuda_objects& operator=(cuda_objects const&) = delete;

 private:
  enum class kind { device, pinned };

  cuda_objects() {
    void* lib = nullptr;
    for (char const* name : {"libcupti.so", "libcupti.so.13", "libcupti.so.12"}) {
      if ((lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) { break; }
    }
    if (lib == nullptr) {
      why_not_ = std::string{"CUPTI cannot be loaded: "} + ::dlerror();
      return;
    }
    auto const subscribe =
        reinterpret_cast<decltype(&cuptiSubscribe)>(::dlsym(lib, "cuptiSubscribe"));
    auto const enable =
        reinterpret_cast<decltype(&cuptiEnableDomain)>(::dlsym(lib, "cuptiEnableDomain"));
    auto const text =
        reinterpret_cast<decltype(&cuptiGetResultString)>(::dlsym(lib, "cuptiGetResultString"));
    if (subscribe == nullptr || enable == nullptr) {
      why_not_ = "libcupti lacks cuptiSubscribe or cuptiEnableDomain";
      return;
    }
    auto const say = [text](CUptiResult r) {
      char const* what = nullptr;
      if (text == nullptr || text(r, &what) != CUPTI_SUCCESS || what == nullptr) { what = "?"; }
      return std::string{what} + " (" + std::to_string(static_cast<int>(r)) + ")";
    };
    CUpti_SubscriberHandle handle{};
    if (CUptiResult const r = subscribe(&handle, &callback, this); r != CUPTI_SUCCESS) {
      why_not_ = "cuptiSubscribe: " + say(r) +
                 " (another CUPTI subscriber, a profiler or compute-sanitizer? no driver?)";
      return;
    }
    if (CUptiResult const r = enable(1, handle, CUPTI_CB_DOMAIN_DRIVER_API); r != CUPTI_SUCCESS) {
      why_not_ = "cuptiEnableDomain: " + say(r);
      return;
    }
    // The subscription stays for the process's life (CUPTI calls back into this object).
    // Callbacks must come for the runtime's calls, or nothing would ever read as a leak.
    auto const base = now();
    cudaEvent_t e{};
    cudaStream_t s{};
    bool const made = cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess &&
                      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess;
    auto const during = now() - base;
    if (e != nullptr) { (void)cudaEventDestroy(e); }
    if (s != nullptr) { (void)cudaStreamDestroy(s); }
    auto const after = now() - base;
    if (!made) {
      (void)cudaGetLastError();
      why_not_ = "cannot make the event and stream of the self-check";
    } else if (during.events != 1 || during.streams != 1 || after != cuda_object_counts{}) {
      why_not_ = "CUPTI's callbacks did not count the self-check's event and stream (" +
                 during.to_string() + "; after destruction: " + after.to_string() + ")";
    }
  }

  template <class Params>
  static Params const& as(void const* p) noexcept {
    return *static_cast<Params const*>(p);
  }

  // The calls' parameters, as generated_cuda_meta.h lays them out (that header needs the
  // driver's internal v1 types, so it is not included): the fields read, up to the last one.
  struct alloc_params {  // cuMemAlloc_v2, cuMemAllocManaged, cuMemAllocAsync(FromPool)(_ptsz)
    CUdeviceptr* dptr;
    std::size_t bytesize;
  };
  struct alloc_pitch_params {  // cuMemAllocPitch_v2
    CUdeviceptr* dptr;
    std::size_t* pitch;
    std::size_t width;
    std::size_t height;
  };
  struct free_params {  // cuMemFree_v2, cuMemFreeAsync(_ptsz)
    CUdeviceptr dptr;
  };
  struct create_params {  // cuMemCreate
    CUmemGenericAllocationHandle* handle;
    std::size_t size;
  };
  struct release_params {  // cuMemRelease
    CUmemGenericAllocationHandle handle;
  };
  struct host_alloc_params {  // cuMemAllocHost_v2, cuMemHostAlloc
    void** pp;
    std::size_t bytesize;
  };
  struct host_params {  // cuMemHostRegister_v2 (then its size), cuMemFreeHost, cuMemHostUnregister
    void* p;
    std::size_t bytesize;
  };

  void count(CUpti_CallbackId id, void const* p) {
    std::lock_guard lock{mutex_};
    switch (id) {
      case CUPTI_DRIVER_TRACE_CBID_cuEventCreate: ++live_.events; break;
      case CUPTI_DRIVER_TRACE_CBID_cuEventDestroy:
      case CUPTI_DRIVER_TRACE_CBID_cuEventDestroy_v2: --live_.events; break;
      case CUPTI_DRIVER_TRACE_CBID_cuStreamCreate:
      case CUPTI_DRIVER_TRACE_CBID_cuStreamCreateWithPriority: ++live_.streams; break;
      case CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy:
      case CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy_v2: --live_.streams; break;
      case CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2:
      case CUPTI_DRIVER_TRACE_CBID_cuMemAllocManaged:
      case CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync:
      case CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync_ptsz:
      case CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync:
      case CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync_ptsz: {
        auto const& a = as<alloc_params>(p);
        made(kind::device, *a.dptr, a.bytesize);
        break;
      }
      case CUPTI_DRIVER_TRACE_CBID_cuMemAllocPitch_v2: {
        auto const& a = as<alloc_pitch_params>(p);
        made(kind::device, *a.dptr, *a.pitch * a.height);
        break;
      }
      case CUPTI_DRIVER_TRACE_CBID_cuMemFree_v2:
      case CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync:
      case CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync_ptsz:
        gone(kind::device, as<free_params>(p).dptr);
        break;
      case CUPTI_DRIVER_TRACE_CBID_cuMemCreate: {  // VMM: a physical allocation's handle
        auto const& a = as<create_params>(p);
        made(kind::device, *a.handle, a.size);
        break;
      }
      case CUPTI_DRIVER_TRACE_CBID_cuMemRelease:
        gone(kind::device, as<release_params>(p).handle);
        break;
      case CUPTI_DRIVER_TRACE_CBID_cuMemAllocHost_v2:
      case CUPTI_DRIVER_TRACE_CBID_cuMemHostAlloc: {
        auto const& a = as<host_alloc_params>(p);
        made(kind::pinned, reinterpret_cast<std::uintptr_t>(*a.pp), a.bytesize);
        break;
      }
      case CUPTI_DRIVER_TRACE_CBID_cuMemHostRegister_v2: {
        auto const& a = as<host_params>(p);
        made(kind::pinned, reinterpret_cast<std::uintptr_t>(a.p), a.bytesize);
        break;
      }
      case CUPTI_DRIVER_TRACE_CBID_cuMemFreeHost:
      case CUPTI_DRIVER_TRACE_CBID_cuMemHostUnregister:
        gone(kind::pinned, reinterpret_cast<std::uintptr_t>(as<host_params>(p).p));
        break;
      default: break;
    }
  }

  // Keys: the address (a VMM handle for cuMemCreate), the kind in bit 0 of a shifted copy.
  static std::uint64_t key(kind k, std::uint64_t address) noexcept {
    return (address << 1) | (k == kind::pinned ? 1u : 0u);
  }

  void made(kind k, std::uint64_t address, std::size_t bytes) {
    sizes_[key(k, address)] = bytes;
    auto const n            = static_cast<std::int64_t>(bytes);
    if (k == kind::device) {
      ++live_.device_allocations;
      live_.device_bytes += n;
    } else {
      ++live_.pinned_host;
      live_.pinned_host_bytes += n;
    }
  }

  // An object made before counting began is not in the table: it counts one less, with no bytes.
  void gone(kind k, std::uint64_t address) {
    std::int64_t n = 0;
    if (auto const at = sizes_.find(key(k, address)); at != sizes_.end()) {
      n = static_cast<std::int64_t>(at->second);
      sizes_.erase(at);
    }
    if (k == kind::device) {
      --live_.device_allocations;
      live_.device_bytes -= n;
    } else {
      --live_.pinned_host;
      live_.pinned_host_bytes -= n;
    }
  }

  mutable std::mutex mutex_;
  cuda_object_counts live_;
  std::unordered_map<std::uint64_t, std::size_t> sizes_;
  std::string why_not_;
};

}  // namespace wm_test
