// SPDX-License-Identifier: Apache-2.0
/*
 * wm_torch: the PyTorch bridge of wm (a tutorial extension; see README.md beside this file).
 *
 * What it shows:
 *  - A wm::communicator made from ids that torch.distributed carries (wm_torch.py broadcasts the
 *    unique id with broadcast_object_list); one process per GPU, as under torchrun.
 *  - wm::embedding tables (wm_torch_tables.hpp: device tables, host tables with a device cache)
 *    fed with CUDA tensors by pointer and the current stream: `gather` into a tensor the caller
 *    allocated, `apply_gradients` from the keys and gradients autograd produced. No copies.
 *  - A wm::swap_scope as the storage behind torch.autograd.graph.saved_tensors_hooks: `pack`
 *    copies a saved CUDA tensor into a swappable buffer of the scope's device pool and queues its
 *    page-out (the copy runs on the current stream; the page-out waits for it by an event);
 *    `unpack` returns a tensor over the buffer's device memory (`data(stream)` on the current
 *    stream: a page-in if it is not resident) whose deleter releases the buffer stream-ordered.
 *
 * The Python side (wm_torch.py) builds this file with torch.utils.cpp_extension.load and wraps
 * it in torch.nn.Module / optimizer / hooks classes; everything here checks its inputs and
 * raises Python exceptions with a message that says what was expected.
 */
#include <wm/comm.hpp>
#include <wm/detail/base/deadline.hpp>
#include <wm/error.hpp>
#include <wm/swap.cuh>

#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <c10/cuda/CUDAGuard.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <torch/extension.h>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "wm_torch_codec.hpp"
#include "wm_torch_tables.hpp"

namespace py = pybind11;

namespace wm_torch {
namespace {

// ---------------------------------------------------------------------------------------------
// Errors and checks of what crosses from Python
//
// No C++ exception leaves this file through pybind11's translators: a failed check sets the
// Python exception itself (PyErr_SetString) and throws py::error_already_set, which pybind11's
// dispatcher restores before it consults any translator; every binding runs its body under
// `guarded`, which turns the exceptions of wm (std::exception) and of torch (c10::Error) into
// Python exceptions the same way. The checks never build a c10::Error (whose constructor walks
// the whole C++ stack for its backtrace) and never reach torch's translator.

/// Sets a Python exception of @p type with @p msg and throws py::error_already_set (GIL held).
[[noreturn]] void raise_py(PyObject* type, std::string const& msg) {
  PyErr_SetString(type, msg.c_str());
  throw py::error_already_set();
}

// Messages are put together with std::to_string, not with std::ostream (nor c10::str, which
// streams): on the GPU machine's torch 2.11 environment, `std::ostringstream << int` in code
// built by torch.utils.cpp_extension crashed the process (a plain load_inline probe: `s << 5`
// segfaults, `std::to_string(5)` and `s << "abc"` do not; bench/NOTES.md).
inline void append(std::string& s, char const* x) {
  s += x;
}
inline void append(std::string& s, std::string const& x) {
  s += x;
}
inline void append(std::string& s, std::string_view x) {
  s += x;
}
template <class T>
requires std::is_arithmetic_v<T>
void append(std::string& s, T x) {
  s += std::to_string(x);
}
inline void append(std::string& s, c10::Device const& d) {
  s += d.str();
}
inline void append(std::string& s, c10::ScalarType t) {
  s += c10::toString(t);
}
inline void append(std::string& s, c10::IntArrayRef r) {
  s += '[';
  for (std::size_t i = 0; i < r.size(); ++i) {
    if (i != 0) { s += ", "; }
    s += std::to_string(r[i]);
  }
  s += ']';
}
template <class... Parts>
[[nodiscard]] std::string message(Parts const&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}

/// Raises ValueError (expect_value) or TypeError (expect_type) with the message of @p parts
/// unless @p ok.
template <class... Parts>
void expect_value(bool ok, Parts const&... parts) {
  if (!ok) [[unlikely]] { raise_py(PyExc_ValueError, message(parts...)); }
}
template <class... Parts>
void expect_type(bool ok, Parts const&... parts) {
  if (!ok) [[unlikely]] { raise_py(PyExc_TypeError, message(parts...)); }
}

/**
 * Runs @p body (with the GIL held; a py::gil_scoped_release inside it is gone before a catch
 * here runs) and turns a C++ exception into the Python exception a torch user expects:
 * c10::ValueError / TypeError / IndexError / NotImplementedError as such, std::bad_alloc as
 * MemoryError, any other c10::Error or std::exception (wm::logic_error, cuda_error, comm_error,
 * io_error) as RuntimeError, with its message.
 */
template <class Body>
decltype(auto) guarded(Body&& body) {
  try {
    return std::forward<Body>(body)();
  } catch (py::error_already_set const&) { throw; } catch (c10::ValueError const& e) {
    raise_py(PyExc_ValueError, e.what_without_backtrace());
  } catch (c10::TypeError const& e) {
    raise_py(PyExc_TypeError, e.what_without_backtrace());
  } catch (c10::IndexError const& e) {
    raise_py(PyExc_IndexError, e.what_without_backtrace());
  } catch (c10::NotImplementedError const& e) {
    raise_py(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (c10::Error const& e) {
    raise_py(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (py::builtin_exception const&) {
    throw;  // pybind11's own (cast_error, ...): its default translator handles them
  } catch (std::bad_alloc const&) {
    raise_py(PyExc_MemoryError, "wm_torch: out of memory (std::bad_alloc)");
  } catch (std::exception const& e) { raise_py(PyExc_RuntimeError, e.what()); }
}

/// A binding of member function @p f whose body runs under `guarded`.
template <class C, class R, class... A>
[[nodiscard]] auto guarded_method(R (C::*f)(A...)) {
  return [f](C& self, A... a) -> R {
    return guarded([&]() -> R { return (self.*f)(std::forward<A>(a)...); });
  };
}
template <class C, class R, class... A>
[[nodiscard]] auto guarded_method(R (C::*f)(A...) const) {
  return [f](C const& self, A... a) -> R {
    return guarded([&]() -> R { return (self.*f)(std::forward<A>(a)...); });
  };
}

void check_cuda(torch::Tensor const& t, char const* what, int device) {
  expect_value(t.defined(), "wm_torch: ", what, " is undefined");
  expect_value(t.is_cuda(), "wm_torch: ", what, " must be a CUDA tensor (on cuda:", device,
               "), got a tensor on ", t.device());
  expect_value(t.device().index() == device, "wm_torch: ", what, " must be on cuda:", device,
               " (the communicator's GPU), got ", t.device());
  expect_value(t.is_contiguous(), "wm_torch: ", what,
               " must be contiguous (call .contiguous() first)");
}

void check_keys(torch::Tensor const& keys, int device) {
  check_cuda(keys, "keys", device);
  expect_type(keys.scalar_type() == torch::kInt64,
              "wm_torch: keys must be int64 (torch.long), got ", keys.scalar_type());
}

void check_rows(torch::Tensor const& values, char const* what, torch::Tensor const& keys,
                std::size_t dim, int device) {
  check_cuda(values, what, device);
  expect_type(values.scalar_type() == torch::kFloat32, "wm_torch: ", what,
              " must be float32 (the table's type), got ", values.scalar_type());
  expect_value(values.numel() == keys.numel() * static_cast<std::int64_t>(dim), "wm_torch: ", what,
               " must hold keys.numel() x dim = ", keys.numel(), " x ", dim, " values, got ",
               values.numel(), " (shape ", values.sizes(), ")");
}

[[nodiscard]] cudaStream_t current_stream(int device) {
  return at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

// ---------------------------------------------------------------------------------------------
// Communicator

/// A wm::communicator shared by the tables made from it (they keep it alive).
struct communicator_handle {
  std::shared_ptr<wm::communicator> comm;
};

[[nodiscard]] py::bytes create_unique_id() {
  auto const b = wm::unique_id::create().bytes();
  return py::bytes(reinterpret_cast<char const*>(b.data()), b.size());
}

[[nodiscard]] communicator_handle make_communicator(py::bytes const& id, int rank, int size) {
  std::string const s = id;
  auto const uid      = wm::unique_id::from_bytes(
           std::span<std::byte const>{reinterpret_cast<std::byte const*>(s.data()), s.size()});
  py::gil_scoped_release nogil;  // waits for the other ranks
  return communicator_handle{std::make_shared<wm::communicator>(uid, rank, size)};
}

// ---------------------------------------------------------------------------------------------
// Tables

/// A table and the communicator it needs (declared first: destroyed after the table).
struct table_handle {
  std::shared_ptr<wm::communicator> comm;
  std::unique_ptr<table> t;
  int device{0};

  table_handle(communicator_handle const& c, table_options const& o) : comm{c.comm} {
    expect_value(comm && comm->valid(), "wm_torch: the communicator is not valid");
    expect_value(o.rows > 0 && o.dim > 0, "wm_torch: a table needs rows > 0 and dim > 0, got ",
                 o.rows, " x ", o.dim);
    device = comm->device();
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device)};
    expect_value(o.location == "device" || o.location == "host",
                 "wm_torch: location must be 'device' or 'host', not '", o.location, "'");
    std::string bad;  // a combination of policies that no table unit instantiates
    {
      py::gil_scoped_release nogil;  // collective
      try {
        t = o.location == "device" ? make_device_table(*comm, o) : make_host_table(*comm, o);
      } catch (std::invalid_argument const& e) { bad = e.what(); }
    }
    expect_value(bad.empty(), bad);
  }

  void gather(torch::Tensor const& keys, torch::Tensor& out) {
    check_keys(keys, device);
    check_rows(out, "out", keys, t->dim(), device);
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device)};
    cudaStream_t const s = current_stream(device);
    py::gil_scoped_release nogil;
    t->gather(keys.data_ptr<std::int64_t>(), static_cast<std::size_t>(keys.numel()),
              out.data_ptr<float>(), s);
  }

  void apply_gradients(torch::Tensor const& keys, torch::Tensor const& grads, double lr) {
    expect_value(t->trainable(), "wm_torch: this table has no optimizer (", t->description(), ")");
    check_keys(keys, device);
    check_rows(grads, "grads", keys, t->dim(), device);
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device)};
    cudaStream_t const s = current_stream(device);
    py::gil_scoped_release nogil;  // collective; synchronizes the stream
    t->apply_gradients(keys.data_ptr<std::int64_t>(), static_cast<std::size_t>(keys.numel()),
                       grads.data_ptr<float>(), static_cast<float>(lr), s);
  }

  void write_rows(torch::Tensor const& keys, torch::Tensor const& values) {
    check_keys(keys, device);
    check_rows(values, "values", keys, t->dim(), device);
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device)};
    cudaStream_t const s = current_stream(device);
    py::gil_scoped_release nogil;  // collective; synchronizes the stream
    t->write_rows(keys.data_ptr<std::int64_t>(), static_cast<std::size_t>(keys.numel()),
                  values.data_ptr<float>(), s);
  }

  void prefetch(torch::Tensor const& keys) {
    check_keys(keys, device);
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device)};
    cudaStream_t const s = current_stream(device);
    py::gil_scoped_release nogil;
    t->prefetch(keys.data_ptr<std::int64_t>(), static_cast<std::size_t>(keys.numel()), s);
  }

  void flush() {
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device)};
    t->flush(current_stream(device));
  }
  void invalidate() {
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device)};
    t->invalidate(current_stream(device));
  }

  [[nodiscard]] py::dict cache_stats() {
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device)};
    wm::cache_statistics st;
    {
      py::gil_scoped_release nogil;
      st = t->cache_stats();
    }
    py::dict d;
    d["requests"]          = st.requests;
    d["distinct_keys"]     = st.distinct_keys;
    d["hits"]              = st.hits;
    d["misses"]            = st.misses;
    d["evictions"]         = st.evictions;
    d["write_backs"]       = st.write_backs;
    d["bytes_from_host"]   = st.bytes_from_host;
    d["bytes_from_peers"]  = st.bytes_from_peers;
    d["bypasses"]          = st.bypasses;
    d["bypass_rows"]       = st.bypass_rows;
    d["hit_first_gathers"] = st.hit_first_gathers;
    return d;
  }
};

// ---------------------------------------------------------------------------------------------
// Swap scope and saved-tensor hooks

class swap_handle;

/// One saved tensor's copy: a swappable buffer and the tensor's metadata.
struct saved_buffer {
  std::shared_ptr<swap_handle> owner;  // keeps the scope alive while the buffer lives
  wm::swappable<std::byte> buf;
  std::vector<std::int64_t> sizes;
  std::vector<std::int64_t> strides;
  c10::ScalarType dtype{};
  int device{0};
  std::size_t bytes{0};
  // Direct mode (page-outs from the tensor's memory, page-ins into torch's memory):
  bool direct{false};
  torch::Tensor staged;                 // paged in ahead of its unpack (its copy may still run)
  cudaStream_t staged_stream{nullptr};  // where `staged` was allocated (it waits before a drop)
  torch::Tensor held;                   // keep_last: the tensor itself, not (yet) paged out
  std::int64_t held_version{0};
  // compress: the slab holds the zero encoding (wm::zero_codec) of numel elements of elem bytes
  bool encoded{false};
  std::size_t numel{0};
  std::size_t elem{0};
  std::size_t encoded_bytes{0};
  cudaEvent_t decoded{nullptr};  // on the page-in stream, after the decode of the last page-in
  torch::Tensor dev;  // what unpack returned: a second unpack (a shared save) gets it again
  // The saved tensor itself while it is alive and unchanged: unpack returns it, no page-in.
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> source;
  void const* source_data{nullptr};  // its storage's data pointer at pack time
  std::int64_t source_offset{0};
  std::optional<c10::VariableVersion> source_version_counter;
  std::uint32_t source_version{0};
  ~saved_buffer();
};

/// Where a saved tensor came from, to hand the same buffer to a second save of the same data.
struct saved_key {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // expired once the tensor's memory is freed
  std::int64_t offset{0};
  std::vector<std::int64_t> sizes;
  std::vector<std::int64_t> strides;
  c10::ScalarType dtype{};
  std::int64_t version{0};
  std::weak_ptr<saved_buffer> saved;
};

/**
 * A swap scope with the bookkeeping of the hooks: which storages were saved (the same tensor
 * saved twice, e.g. a ReLU output that the next Linear saves too, is copied once), the order of
 * the saves (the backward pass needs them in reverse), the storages never to copy (parameters),
 * and counters. One recursive mutex guards it: a buffer's destructor (from a tensor's deleter,
 * on whichever thread frees it) may run while this thread holds it.
 */
class swap_handle : public std::enable_shared_from_this<swap_handle> {
 public:
  swap_handle(wm::swap_options const& o, std::size_t min_bytes)
      : scope_{std::make_shared<wm::swap_scope>(with_torch_streams(o))}, min_bytes_{min_bytes} {
    device_        = scope_->options().device;
    capacity_      = o.device_budget / pool_alignment * pool_alignment;  // the pool's usable bytes
    host_capacity_ = o.host_bytes / pool_alignment * pool_alignment;
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device_)};
    void* p = nullptr;
    WM_CUDA_TRY(cudaHostAlloc(&p, nonzero_slots * sizeof(std::uint64_t), cudaHostAllocDefault));
    slots_ = static_cast<std::uint64_t*>(p);
    for (int i = 0; i < nonzero_slots; ++i) { free_slots_.push_back(i); }
  }

  swap_handle(swap_handle const&)            = delete;
  swap_handle& operator=(swap_handle const&) = delete;

  ~swap_handle() {
    int previous = 0;  // no CUDAGuard: its constructor may throw, and destructors must not
    bool const switched =
        cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(device_) == cudaSuccess;
    // The encode kernels write the slots: the host polls for them, at most the scope's timeout
    // in all; past it they are abandoned with a line on stderr and the slots left allocated.
    auto const deadline = wm::detail::deadline_after(scope_->options().timeout);
    bool stuck          = false;
    for (auto& p : pending_) {
      cudaError_t r = cudaSuccess;
      while (!stuck && p.done != nullptr && (r = cudaEventQuery(p.done)) == cudaErrorNotReady) {
        if (std::chrono::steady_clock::now() >= deadline) {
          stuck = true;
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds{20});
        }
      }
      if (r != cudaSuccess && r != cudaErrorNotReady) { (void)cudaGetLastError(); }
      give_event(p.done);  // destroyed or pooled, its work pending or not: CUDA allows both
    }
    pending_.clear();
    for (auto const& [e, n] : host_out_) { give_event(e); }
    for (cudaEvent_t e : free_events_) { (void)cudaEventDestroy(e); }
    if (stuck) {
      std::fprintf(stderr,
                   "wm_torch: SwapScope: the teardown gave up after %lld ms waiting for an "
                   "encode kernel; abandoned, left allocated: its pinned count slots (%p)\n",
                   static_cast<long long>(scope_->options().timeout.count()),
                   static_cast<void*>(slots_));
    } else {
      (void)cudaFreeHost(slots_);
    }
    if (switched) { (void)cudaSetDevice(previous); }
  }

  /**
   * @p o with two streams of torch's pool as the scope's copy streams. Tensors are
   * record_stream-ed on the copy streams (direct mode) and may be freed after this scope is gone;
   * torch's allocator then records an event on each stream it was given, so those streams must
   * outlive the scope: torch's pool streams live as long as the process (streams the scope made
   * itself would be destroyed with it, and that event record would fail).
   */
  static wm::swap_options with_torch_streams(wm::swap_options o) {
    if (o.device < 0) { o.device = static_cast<int>(c10::cuda::current_device()); }
    auto const dev   = static_cast<c10::DeviceIndex>(o.device);
    o.pageout_stream = c10::cuda::getStreamFromPool(false, dev).stream();
    o.pagein_stream  = c10::cuda::getStreamFromPool(false, dev).stream();
    while (o.pagein_stream == o.pageout_stream) {  // a pool of one stream: never in practice
      o.pagein_stream = c10::cuda::getStreamFromPool(true, dev).stream();
    }
    return o;
  }

  /**
   * Direct mode (for the saves from now on): pack pages a tensor out from its own memory
   * (swap_scope::pageout_from; the tensor's block is record_stream-ed on the page-out copy
   * stream, so torch's allocator reuses it only after the copy) and unpack pages it into a tensor
   * from torch's allocator (pagein_to), prefetched in backward order up to @p stage_bytes ahead
   * (at least one tensor). @p max_outstanding_bytes > 0: the current stream waits for the oldest
   * page-outs when more than that many bytes of them may still be running (the forward pass is
   * held to the link's pace; the tensors they read are freed in time). Off: the pool mode (pack
   * copies into the scope's device pool).
   */
  void set_direct(bool on, std::size_t max_outstanding_bytes, std::size_t stage_bytes,
                  std::size_t keep_last, bool compress, bool host_pacing) {
    std::lock_guard lk{mutex_};
    direct_        = on;
    max_out_bytes_ = max_outstanding_bytes;
    stage_bytes_   = stage_bytes;
    keep_last_     = keep_last;
    compress_      = compress;
    host_pacing_   = host_pacing;
  }

  /**
   * The end of the forward pass (leaving the hooks' `with` block): the encoded save still
   * waiting goes out, and with host pacing the host waits until every page-out is done, so that
   * torch's allocator can hand the memory of every saved tensor to what comes next (the loss).
   */
  void end_forward() {
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device_)};
    py::gil_scoped_release nogil;
    std::lock_guard lk{mutex_};
    issue_pending(0, current_stream(device_));
    while (host_pacing_ && !host_out_.empty()) { wait_host_oldest(); }
  }

  /// Storages (by data pointer) that pack never copies: parameters, buffers.
  void set_skip(std::vector<std::uintptr_t> const& ptrs) {
    std::lock_guard lk{mutex_};
    skip_.clear();
    skip_.insert(ptrs.begin(), ptrs.end());
  }

  /// The pack hook: a saved_buffer holding a copy of @p t, or None to keep @p t as it is (not
  /// on this GPU, smaller than min_bytes, not dense, a skipped storage, no room in the pool).
  py::object pack(torch::Tensor const& t) {
    std::shared_ptr<saved_buffer> sp;
    {
      py::gil_scoped_release nogil;
      sp = pack_impl(t);
    }
    if (!sp) { return py::none(); }
    return py::cast(sp);
  }

  /// The unpack hook: a tensor over the buffer's device memory, valid on the current stream.
  torch::Tensor unpack(std::shared_ptr<saved_buffer> const& sp) {
    expect_value(sp && sp->owner.get() == this, "wm_torch: unpack of a buffer of another scope");
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(sp->device)};
    cudaStream_t const s = current_stream(sp->device);
    void* p              = nullptr;
    // Buffers locked from weak pointers are dropped here, after the mutex and with the GIL (a
    // tensor handed to Python may need it to go).
    std::vector<std::shared_ptr<saved_buffer>> hold;
    torch::Tensor out;
    {
      py::gil_scoped_release nogil;
      std::lock_guard lk{mutex_};
      issue_pending(0, s);  // backward has started: the last encoded save goes out
      if (auto_prefetch_ && !order_.empty()) { prefetch_all_locked(hold); }
      ++unpacks_;
      if (sp->direct) {
        out = unpack_direct(*sp, s, hold);
      } else {
        p = sp->buf.data(cuda::stream_ref{s});
      }
    }
    if (sp->direct) { return out; }
    // The deleter holds the buffer: it goes back to the pool (after the work queued on `s` at
    // that time) when the last of the tensor and the packed handle is gone.
    std::shared_ptr<saved_buffer> keep = sp;
    return torch::from_blob(
        p, sp->sizes, sp->strides, [keep](void*) mutable { keep.reset(); },
        torch::TensorOptions{}.dtype(sp->dtype).device(torch::kCUDA, sp->device));
  }

  /// Queues every buffer saved since the last call for page-in, most recent first (the order
  /// in which the backward pass needs them), then starts the page-in queue.
  void prefetch_all() {
    std::vector<std::shared_ptr<saved_buffer>> hold;  // dropped after the mutex, with the GIL
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device_)};
    py::gil_scoped_release nogil;
    std::lock_guard lk{mutex_};
    prefetch_all_locked(hold);
  }

  void set_auto_prefetch(bool on) {
    std::lock_guard lk{mutex_};
    auto_prefetch_ = on;
  }

  /// Waits until every queued page-in is done (tests; not needed for correctness).
  void wait_prefetches() {
    py::gil_scoped_release nogil;
    scope_->wait_prefetches();
  }

  [[nodiscard]] py::dict statistics() {
    wm::swap_statistics st;
    {
      py::gil_scoped_release nogil;
      st = scope_->statistics();
    }
    py::dict d;
    d["bytes_out"]             = st.bytes_out;
    d["bytes_in"]              = st.bytes_in;
    d["out_gbps"]              = st.out_gbps();
    d["in_gbps"]               = st.in_gbps();
    d["pageouts"]              = st.pageouts;
    d["pageouts_cancelled"]    = st.pageouts_cancelled;
    d["passive_pageins"]       = st.passive_pageins;
    d["prefetches"]            = st.prefetches;
    d["consumer_waits"]        = st.consumer_waits;
    d["consumer_wait_seconds"] = st.consumer_wait_seconds;
    d["host_blocking_syncs"]   = st.host_blocking_syncs;
    d["host_wait_seconds"]     = st.host_wait_seconds;
    d["worker_waits"]          = st.worker_waits;
    d["resident_bytes"]        = st.resident_bytes;
    d["peak_resident_bytes"]   = st.peak_resident_bytes;
    d["device_allocations"]    = st.device_allocations;
    d["pinned_allocations"]    = st.pinned_allocations;
    std::lock_guard lk{mutex_};
    d["packs"]             = packs_;
    d["copies"]            = copies_;
    d["bytes_copied"]      = bytes_copied_;
    d["shared"]            = shared_;
    d["kept"]              = kept_;
    d["kept_no_room"]      = kept_no_room_;
    d["unpacks"]           = unpacks_;
    d["live_buffers"]      = live_;
    d["pageouts_from"]     = st.pageouts_from;
    d["pageins_to"]        = st.pageins_to;
    d["reused_sources"]    = reused_sources_;
    d["staged_unpacks"]    = staged_unpacks_;
    d["unstaged_unpacks"]  = unstaged_unpacks_;
    d["throttle_waits"]    = throttle_waits_;
    d["kept_last"]         = kept_last_;
    d["encoded"]           = encoded_;
    d["encoded_raw_bytes"] = encoded_raw_bytes_;
    d["encoded_bytes"]     = encoded_bytes_;
    d["host_waits"]        = host_waits_;
    // Not "host_wait_seconds": that key is the scope's (its host-blocking syncs), set above.
    d["hooks_host_wait_seconds"] = host_wait_seconds_;
    d["direct"]                  = direct_;
    d["device_pool_bytes"]       = capacity_;
    d["device_budget"]           = scope_->options().device_budget;
    d["host_bytes"]              = scope_->options().host_bytes;
    return d;
  }

  void reset_statistics() {
    py::gil_scoped_release nogil;
    std::lock_guard lk{mutex_};
    scope_->reset_statistics();
    packs_ = copies_ = bytes_copied_ = shared_ = kept_ = kept_no_room_ = unpacks_ = 0;
    reused_sources_ = staged_unpacks_ = unstaged_unpacks_ = throttle_waits_ = kept_last_ = 0;
    encoded_ = encoded_raw_bytes_ = encoded_bytes_ = host_waits_ = 0;
    host_wait_seconds_                                           = 0;
  }

  [[nodiscard]] int device() const noexcept { return device_; }

  void released() noexcept {
    std::lock_guard lk{mutex_};
    --live_;
  }
  void staged_dropped(std::size_t bytes) noexcept {
    std::lock_guard lk{mutex_};
    staged_bytes_ -= std::min(bytes, staged_bytes_);
  }
  std::recursive_mutex& mutex() noexcept { return mutex_; }

 private:
  std::shared_ptr<saved_buffer> pack_impl(torch::Tensor const& t) {
    std::lock_guard lk{mutex_};
    ++packs_;
    if (!t.defined() || !t.is_cuda() || t.device().index() != device_ || !t.has_storage()) {
      ++kept_;
      return nullptr;
    }
    std::size_t const bytes = static_cast<std::size_t>(t.numel()) * t.element_size();
    if (bytes == 0 || bytes < min_bytes_ || !t.is_non_overlapping_and_dense() ||
        skip_.contains(reinterpret_cast<std::uintptr_t>(t.storage().data()))) {
      ++kept_;
      return nullptr;
    }
    if (direct_ ? bytes > host_capacity_ : bytes > capacity_) {  // could never fit
      ++kept_;
      ++kept_no_room_;
      return nullptr;
    }
    auto const version         = t._version();
    auto const sizes           = t.sizes().vec();
    auto const strides         = t.strides().vec();
    c10::StorageImpl* const si = t.storage().unsafeGetStorageImpl();
    // 1. The same data saved before (and still alive): share its buffer.
    auto& keys = saved_[si];
    std::erase_if(keys,
                  [](saved_key const& k) { return k.storage.expired() || k.saved.expired(); });
    for (auto const& k : keys) {
      if (k.offset == t.storage_offset() && k.version == version && k.dtype == t.scalar_type() &&
          k.sizes == sizes && k.strides == strides) {
        if (auto sp = k.saved.lock()) {
          ++shared_;
          return sp;
        }
      }
    }
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device_)};
    cudaStream_t const s = current_stream(device_);
    auto sp              = std::make_shared<saved_buffer>();
    if (direct_) {
      // 2'. Direct: the page-out reads the tensor's own memory, after the current stream's work.
      // With keep_last the newest keep_last tensors wait (held) and go out when newer ones come;
      // those still held when backward starts are never copied (backward needs them first).
      bool issued = false;
      if (keep_last_ == 0) {
        try {
          issued = start_pageout(sp, t, bytes, s);
        } catch (wm::logic_error const&) {  // larger than the slab
          ++kept_;
          ++kept_no_room_;
          return nullptr;
        }
      } else {
        sp->held         = t;
        sp->held_version = version;
      }
      sp->owner   = shared_from_this();
      sp->direct  = true;
      sp->sizes   = sizes;
      sp->strides = strides;
      sp->dtype   = t.scalar_type();
      sp->device  = device_;
      sp->bytes   = bytes;
      if (auto const& vc = t.unsafeGetTensorImpl()->version_counter(); vc.enabled()) {
        sp->source.emplace(t.storage().getWeakStorageImpl());
        sp->source_data =
            static_cast<void const*>(t.storage().unsafeGetStorageImpl()->data_ptr().get());
        sp->source_offset          = t.storage_offset();
        sp->source_version_counter = vc;
        sp->source_version         = vc.current_version();
      }
      ++live_;
      if (keep_last_ == 0) {
        if (issued) { pace(sp, bytes, s); }
      } else {  // the oldest held beyond keep_last go out now
        deferred_.push_back(sp);
        while (deferred_.size() > keep_last_) {
          auto o = deferred_.front().lock();
          deferred_.pop_front();
          if (!o || !o->held.defined()) { continue; }
          torch::Tensor h = std::move(o->held);
          o->held.reset();
          if (start_pageout(o, h, o->bytes, s)) { pace(o, o->bytes, s); }  // fits: checked at pack
        }
      }
      keys.push_back(saved_key{t.storage().getWeakStorageImpl(), t.storage_offset(), sizes, strides,
                               t.scalar_type(), version, sp});
      order_.push_back(sp);
      ++copies_;
      bytes_copied_ += bytes;
      return sp;
    }
    // 2. A new buffer: device copy on the current stream, then the page-out after it.
    try {
      sp->buf = scope_->allocate<std::byte>(bytes, cuda::stream_ref{s});
    } catch (wm::logic_error const&) {  // every pool block held by buffers in use
      ++kept_;
      ++kept_no_room_;
      return nullptr;
    }
    sp->owner = shared_from_this();
    ++live_;
    sp->sizes   = sizes;
    sp->strides = strides;
    sp->dtype   = t.scalar_type();
    sp->device  = device_;
    sp->bytes   = bytes;
    // A dense tensor with non-negative strides starts at its lowest address and fills `bytes`.
    std::byte* const dst = sp->buf.data(cuda::stream_ref{s});
    WM_CUDA_TRY(cudaMemcpyAsync(dst, t.data_ptr(), bytes, cudaMemcpyDeviceToDevice, s));
    // The caching allocator must not hand the source to another stream before the copy ran.
    t.record_stream(at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)));
    (void)sp->buf.pageout(cuda::stream_ref{s});
    keys.push_back(saved_key{t.storage().getWeakStorageImpl(), t.storage_offset(), sizes, strides,
                             t.scalar_type(), version, sp});
    order_.push_back(sp);
    ++copies_;
    bytes_copied_ += bytes;
    if (saved_.size() > 4096) {  // drop the entries of freed storages now and then
      std::erase_if(saved_, [](auto const& e) {
        return std::all_of(e.second.begin(), e.second.end(), [](saved_key const& k) {
          return k.storage.expired() || k.saved.expired();
        });
      });
    }
    return sp;
  }

  /// Starts @p sp's page-out from @p t (direct mode): first the encoded save still waiting goes
  /// out (issue_pending), then, with compress, @p t is encoded on @p s into a tensor from torch's
  /// allocator, which goes out at the next save, at backward or at end_forward (returns false),
  /// else @p t's own memory is copied (issue_pageout; returns true).
  bool start_pageout(std::shared_ptr<saved_buffer> const& sp, torch::Tensor const& t,
                     std::size_t bytes, cudaStream_t s) {
    issue_pending(0, s);
    auto const n    = static_cast<std::size_t>(t.numel());
    auto const elem = static_cast<std::size_t>(t.element_size());
    if (compress_ && codec_supports(elem) && codec_max_encoded_bytes(n, elem) <= host_capacity_) {
      encode(sp, t, n, elem, s);
      return false;
    }
    issue_pageout(*sp, t, bytes, s);
    return true;
  }

  /// Encodes @p t (wm::zero_codec: a bit per element, then the nonzero elements) on @p s, its
  /// nonzero count into a pinned slot; the page-out waits in pending_ for the count (its size).
  /// @p t is read on @p s only, so torch's allocator may reuse it in @p s's order: no
  /// record_stream on a copy stream, nothing held until a copy ends.
  void encode(std::shared_ptr<saved_buffer> const& sp, torch::Tensor const& t, std::size_t n,
              std::size_t elem, cudaStream_t s) {
    auto const opts = torch::TensorOptions{}.dtype(torch::kUInt8).device(torch::kCUDA, device_);
    // (pack runs without the GIL: a wm::logic_error, not a Python error set here)
    WM_EXPECTS(!free_slots_.empty(), "wm_torch: no free slot for an encoding's count");
    pending_encoding p;
    p.sp    = sp;
    p.numel = n;
    p.elem  = elem;
    p.enc   = at::empty({static_cast<std::int64_t>(codec_max_encoded_bytes(n, elem))}, opts);
    std::size_t const scratch_bytes = codec_scratch_bytes(n, elem);
    auto scratch =
        at::empty({static_cast<std::int64_t>(std::max<std::size_t>(scratch_bytes, 1))}, opts);
    p.slot = free_slots_.back();
    free_slots_.pop_back();
    try {
      codec_encode(t.data_ptr(), n, elem, p.enc.data_ptr(), &slots_[p.slot], scratch.data_ptr(),
                   scratch_bytes, s);
      p.done = take_event();
      WM_CUDA_TRY(cudaEventRecord(p.done, s));
    } catch (...) {
      free_slots_.push_back(p.slot);
      give_event(p.done);
      throw;
    }
    // Read on s: a tensor made on another stream is kept until s has passed the encode.
    t.record_stream(c10::cuda::getStreamFromExternal(s, static_cast<c10::DeviceIndex>(device_)));
    sp->encoded = true;
    sp->numel   = n;
    sp->elem    = elem;
    pending_.push_back(std::move(p));
  }

  /// Issues the page-outs of the encodings in pending_ beyond the newest @p keep: the host waits
  /// for each encoding (one save behind the forward pass, so the GPU still has a layer queued),
  /// reads its nonzero count and pages out exactly the encoded bytes on the page-out stream; the
  /// encoding's tensor is record_stream-ed there and dropped.
  void issue_pending(std::size_t keep, cudaStream_t s) {
    while (pending_.size() > keep) {
      pending_encoding p = std::move(pending_.front());
      pending_.pop_front();
      std::uint64_t nonzeros = 0;
      try {
        wait_host(p.done, "the encoding of a saved tensor");
        nonzeros = *static_cast<std::uint64_t volatile*>(&slots_[p.slot]);
      } catch (...) {
        free_slots_.push_back(p.slot);
        give_event(p.done);
        throw;
      }
      free_slots_.push_back(p.slot);
      give_event(p.done);
      auto sp = p.sp.lock();
      if (!sp) { continue; }  // dropped before it went out: the encoding goes in s's order
      std::size_t const eb   = codec_encoded_bytes(p.numel, nonzeros, p.elem);
      cudaStream_t const out = scope_->pageout_stream();
      sp->buf = scope_->pageout_from(static_cast<std::byte const*>(p.enc.data_ptr()), eb,
                                     cuda::stream_ref{out});
      p.enc.record_stream(
          c10::cuda::getStreamFromExternal(out, static_cast<c10::DeviceIndex>(device_)));
      sp->encoded_bytes = eb;
      ++encoded_;
      encoded_raw_bytes_ += sp->bytes;
      encoded_bytes_ += eb;
      pace(sp, eb, s);
    }
  }

  /// The host waits for @p e (polling, within the scope's timeout); counted when it had to.
  void wait_host(cudaEvent_t e, char const* what) {
    auto const t0       = std::chrono::steady_clock::now();
    auto const deadline = wm::detail::deadline_after(scope_->options().timeout, t0);  // saturates
    bool waited         = false;
    for (;;) {
      cudaError_t const r = cudaEventQuery(e);
      if (r == cudaSuccess) { break; }
      if (r != cudaErrorNotReady) { WM_CUDA_TRY(r); }
      waited = true;
      if (std::chrono::steady_clock::now() > deadline) {
        throw wm::cuda_error{"wm_torch: SwapHooks gave up waiting for " + std::string{what} +
                                 " after " + wm::detail::timeout_text(scope_->options().timeout),
                             static_cast<int>(cudaErrorTimeout)};
      }
      std::this_thread::sleep_for(std::chrono::microseconds{20});
    }
    if (waited) {
      ++host_waits_;
      host_wait_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  }

  /// Host pacing: the host waits for the oldest page-out still listed and drops it.
  void wait_host_oldest() {
    auto [e, n] = host_out_.front();
    host_out_.pop_front();
    host_out_bytes_ -= n;
    try {
      wait_host(e, "a page-out (host pacing)");
    } catch (...) {
      give_event(e);
      throw;
    }
    give_event(e);
  }

  [[nodiscard]] cudaEvent_t take_event() {
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    WM_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

 public:
  void give_event(cudaEvent_t e) noexcept {
    if (e != nullptr) { free_events_.push_back(e); }
  }

 private:
  /// Queues @p b's page-out from @p t's memory after the work on @p s. The copy is issued
  /// (pageout_from returns after that): when the tensor is freed, torch's allocator records an
  /// event on the copy stream and reuses the block after it, i.e. after the copy. No reference is
  /// held: the memory goes as soon as both are done.
  void issue_pageout(saved_buffer& b, torch::Tensor const& t, std::size_t bytes, cudaStream_t s) {
    b.buf = scope_->pageout_from(static_cast<std::byte const*>(t.data_ptr()), bytes,
                                 cuda::stream_ref{s});
    t.record_stream(c10::cuda::getStreamFromExternal(scope_->pageout_stream(),
                                                     static_cast<c10::DeviceIndex>(device_)));
  }

  /// max_outstanding_bytes: holds the forward pass (stream @p s) to the link's pace.
  void pace(std::shared_ptr<saved_buffer> const& sp, std::size_t bytes, cudaStream_t s) {
    if (host_pacing_) {  // the host waits, so that the allocator sees the memory free in time
      cudaEvent_t e = take_event();
      try {
        WM_CUDA_TRY(cudaEventRecord(e, scope_->pageout_stream()));
      } catch (...) {
        give_event(e);
        throw;
      }
      host_out_.emplace_back(e, bytes);
      host_out_bytes_ += bytes;
      while (host_out_bytes_ > max_out_bytes_ && host_out_.size() > 1) { wait_host_oldest(); }
      return;
    }
    if (max_out_bytes_ == 0) { return; }
    outstanding_.emplace_back(sp, bytes);
    outstanding_bytes_ += bytes;
    while (outstanding_bytes_ > max_out_bytes_ && outstanding_.size() > 1) {
      auto [w, n] = outstanding_.front();
      outstanding_.pop_front();
      outstanding_bytes_ -= n;
      if (auto o = w.lock()) {
        o->buf.wait_pageout(cuda::stream_ref{s});
        ++throttle_waits_;
      }
    }
  }

  /// The saved tensor itself, if its storage is alive with the same memory and its version
  /// counter says it was not modified since the save; else undefined.
  [[nodiscard]] static torch::Tensor source_if_alive(saved_buffer const& b) {
    if (!b.source || !b.source_version_counter) { return {}; }
    c10::intrusive_ptr<c10::StorageImpl> si = b.source->lock();
    if (!si || static_cast<void const*>(si->data_ptr().get()) != b.source_data ||
        b.source_version_counter->current_version() != b.source_version) {
      return {};
    }
    auto t = at::empty({0}, torch::TensorOptions{}.dtype(b.dtype).device(torch::kCUDA, b.device));
    t.set_(c10::Storage{std::move(si)}, b.source_offset, b.sizes, b.strides);
    return t;
  }

  /// A tensor with sizes and strides of @p b from torch's allocator (on the current stream @p s),
  /// filled by pagein_to on the page-in copy stream after that stream's work so far.
  /// No record_stream on the page-in stream: its block would stay unusable for the allocator
  /// until the host had seen an event on that stream, and in backward the host runs far ahead
  /// of the GPU, so every page-in would take new memory. Instead @p s waits for the copy before
  /// any use (unpack_direct) or before the tensor is dropped unused (~saved_buffer), so that
  /// the block is reused in @p s's order only after the copy.
  [[nodiscard]] torch::Tensor page_in_new(saved_buffer& b, cudaStream_t s) {
    auto t = at::empty_strided(
        b.sizes, b.strides, torch::TensorOptions{}.dtype(b.dtype).device(torch::kCUDA, b.device));
    if (b.encoded) {  // the encoding comes in, then it is decoded into t on the page-in stream
      cudaStream_t const in = scope_->pagein_stream();
      auto const in_torch =
          c10::cuda::getStreamFromExternal(in, static_cast<c10::DeviceIndex>(b.device));
      auto const opts = torch::TensorOptions{}.dtype(torch::kUInt8).device(torch::kCUDA, b.device);
      std::size_t const scratch_bytes = codec_scratch_bytes(b.numel, b.elem);
      torch::Tensor enc;
      torch::Tensor scratch;
      {  // used on the page-in stream only: allocated there, reused in its order, no events
        c10::cuda::CUDAStreamGuard on_in{in_torch};
        enc =
            at::empty({static_cast<std::int64_t>(std::max<std::size_t>(b.encoded_bytes, 1))}, opts);
        scratch =
            at::empty({static_cast<std::int64_t>(std::max<std::size_t>(scratch_bytes, 1))}, opts);
      }
      b.buf.pagein_to(static_cast<std::byte*>(enc.data_ptr()), cuda::stream_ref{s});
      b.buf.wait_pagein(cuda::stream_ref{in});  // the copy is there already; to be sure
      codec_decode(enc.data_ptr(), b.numel, b.elem, t.data_ptr(), scratch.data_ptr(), scratch_bytes,
                   in);
      if (b.decoded == nullptr) { b.decoded = take_event(); }
      WM_CUDA_TRY(cudaEventRecord(b.decoded, in));
      return t;
    }
    b.buf.pagein_to(static_cast<std::byte*>(t.data_ptr()), cuda::stream_ref{s});
    return t;
  }

  /// Direct mode's unpack, on stream @p s: the tensor of an earlier unpack, the saved tensor
  /// itself while it is alive and unchanged, the staged page-in, or a page-in now; then the next
  /// buffers in backward order are staged.
  torch::Tensor unpack_direct(saved_buffer& b, cudaStream_t s,
                              std::vector<std::shared_ptr<saved_buffer>>& hold) {
    torch::Tensor t = b.dev;
    deferred_.clear();  // backward has started: what is still held stays on the device
    if (!t.defined() && b.held.defined()) {
      TORCH_CHECK(b.held._version() == b.held_version,
                  "wm_torch.SwapHooks: a tensor saved for backward was modified in place");
      t = std::move(b.held);
      b.held.reset();
      ++kept_last_;
      b.dev = t;
      t.record_stream(at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(b.device)));
      stage_more(s, hold);
      return t;
    }
    if (!t.defined()) {
      t = source_if_alive(b);
      if (t.defined()) {
        ++reused_sources_;
      } else if (b.staged.defined()) {
        t = std::move(b.staged);
        b.staged.reset();
        staged_bytes_ -= std::min(b.bytes, staged_bytes_);
        ++staged_unpacks_;
      } else {
        t = page_in_new(b, s);
        ++unstaged_unpacks_;
      }
      b.dev = t;
    }
    // Nothing once the copy has completed; a tensor keep_last held has no buffer.
    if (b.buf) { b.buf.wait_pagein(cuda::stream_ref{s}); }
    if (b.decoded != nullptr) { WM_CUDA_TRY(cudaStreamWaitEvent(s, b.decoded, 0)); }
    // Used on s (a no-op if s is where it was allocated).
    t.record_stream(at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(b.device)));
    stage_more(s, hold);
    return t;
  }

  /// Stages the next buffers of the backward order (page-ins into new tensors) while fewer than
  /// stage_bytes_ are staged and not yet unpacked (at least one).
  void stage_more(cudaStream_t s, std::vector<std::shared_ptr<saved_buffer>>& hold) {
    while (!in_order_.empty()) {
      auto o = in_order_.front().lock();
      if (!o || o->dev.defined() || o->staged.defined() || o->held.defined() ||
          source_if_alive(*o).defined()) {
        in_order_.pop_front();  // gone, unpacked, staged, or still on the device as it was
        if (o) { hold.push_back(std::move(o)); }
        continue;
      }
      if (staged_bytes_ > 0 && staged_bytes_ + o->bytes > stage_bytes_) { return; }
      o->staged        = page_in_new(*o, s);
      o->staged_stream = s;
      staged_bytes_ += o->bytes;
      in_order_.pop_front();
      hold.push_back(std::move(o));
    }
  }

  void prefetch_all_locked(std::vector<std::shared_ptr<saved_buffer>>& hold) {
    issue_pending(0, current_stream(device_));
    for (auto const& [e, n] : host_out_) { give_event(e); }
    host_out_.clear();
    host_out_bytes_ = 0;
    outstanding_.clear();  // backward: the forward's page-out pacing ends
    deferred_.clear();     // and what keep_last still holds stays on the device
    outstanding_bytes_ = 0;
    bool any_pool      = false;
    for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
      auto sp = it->lock();
      if (!sp) { continue; }
      if (sp->direct) {
        in_order_.push_back(sp);
      } else {
        any_pool = true;
      }
      hold.push_back(std::move(sp));
    }
    if (!in_order_.empty()) { stage_more(current_stream(device_), hold); }
    if (!any_pool) {
      order_.clear();
      return;
    }
    scope_->prefetch_init();
    for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
      auto sp = it->lock();
      if (sp && !sp->direct) { sp->buf.need_prefetch(); }
      if (sp) { hold.push_back(std::move(sp)); }
    }
    order_.clear();
    scope_->prefetch_all();
  }

  static constexpr std::size_t pool_alignment = 256;  // the scope hands out multiples of it
  std::shared_ptr<wm::swap_scope> scope_;
  std::size_t min_bytes_;
  std::size_t capacity_{0};
  std::size_t host_capacity_{0};
  int device_{0};
  bool direct_{false};
  std::size_t max_out_bytes_{0};  // direct: page-out bytes that may run before the stream waits
  std::size_t stage_bytes_{0};    // direct: bytes staged (paged in) ahead of their unpack
  std::size_t staged_bytes_{0};
  std::size_t outstanding_bytes_{0};
  std::deque<std::pair<std::weak_ptr<saved_buffer>, std::size_t>> outstanding_;
  std::deque<std::weak_ptr<saved_buffer>> in_order_;  // direct: still to stage, backward order
  std::deque<std::weak_ptr<saved_buffer>> deferred_;  // keep_last: held, newest last
  std::size_t keep_last_{0};
  std::uint64_t kept_last_{0};  // unpacks served by a tensor keep_last never paged out
  // compress: encodings whose page-out waits for their size (at most one: the previous save)
  struct pending_encoding {
    std::weak_ptr<saved_buffer> sp;
    torch::Tensor enc;  // max_encoded_bytes from torch's allocator, on the forward's stream
    cudaEvent_t done{nullptr};
    int slot{-1};
    std::size_t numel{0};
    std::size_t elem{0};
  };
  static constexpr int nonzero_slots = 8;
  bool compress_{false};
  bool host_pacing_{false};
  std::deque<pending_encoding> pending_;
  std::deque<std::pair<cudaEvent_t, std::size_t>> host_out_;  // host pacing: page-outs issued
  std::size_t host_out_bytes_{0};
  std::vector<cudaEvent_t> free_events_;
  std::uint64_t* slots_{nullptr};  // pinned: each encoding's nonzero count
  std::vector<int> free_slots_;
  std::uint64_t encoded_{0}, encoded_raw_bytes_{0}, encoded_bytes_{0}, host_waits_{0};
  double host_wait_seconds_{0};
  std::recursive_mutex mutex_;
  std::unordered_map<c10::StorageImpl*, std::vector<saved_key>> saved_;
  std::unordered_set<std::uintptr_t> skip_;
  std::vector<std::weak_ptr<saved_buffer>> order_;  // saves since the last prefetch_all
  bool auto_prefetch_{true};
  std::uint64_t packs_{0}, copies_{0}, bytes_copied_{0}, shared_{0}, kept_{0}, kept_no_room_{0},
      unpacks_{0}, live_{0}, reused_sources_{0}, staged_unpacks_{0}, unstaged_unpacks_{0},
      throttle_waits_{0};
};

saved_buffer::~saved_buffer() {
  if (!owner) { return; }  // never held pool memory
  std::lock_guard lk{owner->mutex()};
  if (staged.defined()) {  // never unpacked: its stream waits for the page-in before the drop
    owner->staged_dropped(bytes);
    try {
      if (buf) { buf.wait_pagein(cuda::stream_ref{staged_stream}); }
      if (decoded != nullptr) { (void)cudaStreamWaitEvent(staged_stream, decoded, 0); }
    } catch (...) {  // destructors never throw; the copy's error resurfaces on the next check
    }
  }
  owner->give_event(decoded);
  buf.reset();  // after the work queued so far on the stream of its last data() call
  owner->released();
}  // then the tensors (after the lock), and `owner`: the last buffer of a dropped scope
   // destroys the scope

/// Raises one error by one of the paths an error can take to Python (tests/pytorch/
/// error_probe.py runs each in its own process to tell which path, if any, kills it).
void error_probe(std::string const& kind) {
  if (kind == "expect") {  // the bridge's checks: PyErr_SetString + error_already_set
    expect_value(false, "wm_torch probe: expect_value");
  } else if (kind == "guarded_wm") {  // a wm exception caught by guarded
    guarded([] { throw wm::logic_error{"wm_torch probe: wm::logic_error under guarded"}; });
  } else if (kind == "guarded_c10") {  // a c10::ValueError (built, then caught by guarded)
    guarded([] { TORCH_CHECK_VALUE(false, "wm_torch probe: TORCH_CHECK_VALUE under guarded"); });
  } else if (kind == "translator_std") {  // a std::exception through pybind11's translators
    throw std::runtime_error{"wm_torch probe: std::runtime_error through the translators"};
  } else if (kind == "translator_c10") {  // the path of the bridge before: c10 + translators
    TORCH_CHECK_VALUE(false, "wm_torch probe: TORCH_CHECK_VALUE through the translators");
  } else {
    expect_value(false, "wm_torch probe: unknown kind '", kind, "'");
  }
}

}  // namespace
}  // namespace wm_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace wm_torch;
  m.doc() = "wm_torch: wm tables, communicators and swap scopes for PyTorch (see wm_torch.py)";

  m.def("_error_probe", &error_probe, py::arg("kind"),
        "Raises an error by one path (expect, guarded_wm, guarded_c10, translator_std, "
        "translator_c10); tests/pytorch/error_probe.py");
  m.def(
      "create_unique_id", [] { return guarded([] { return create_unique_id(); }); },
      "A new wm::unique_id as bytes (rank 0 makes it; every rank passes it to Communicator)");

  py::class_<communicator_handle>(m, "Communicator")
      .def(py::init([](py::bytes const& id, int rank, int size) {
             return guarded([&] { return make_communicator(id, rank, size); });
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("size"),
           "Joins the group (collective; select the GPU with torch.cuda.set_device first)")
      .def_property_readonly("rank", [](communicator_handle const& c) { return c.comm->rank(); })
      .def_property_readonly("size", [](communicator_handle const& c) { return c.comm->size(); })
      .def_property_readonly("device",
                             [](communicator_handle const& c) { return c.comm->device(); })
      .def_property_readonly("local_rank",
                             [](communicator_handle const& c) { return c.comm->local_rank(); })
      .def_property_readonly("local_size",
                             [](communicator_handle const& c) { return c.comm->local_size(); })
      .def(
          "barrier",
          [](communicator_handle& c) {
            guarded([&] {
              py::gil_scoped_release nogil;
              c.comm->barrier();
            });
          },
          "Waits for every rank (collective)")
      .def(
          "all_gather_int",
          [](communicator_handle& c, std::int64_t value) {
            return guarded([&] {
              std::vector<std::int64_t> all;
              {
                py::gil_scoped_release nogil;
                all = c.comm->all_gather(value);
              }
              py::list out;
              for (auto v : all) { out.append(v); }
              return out;
            });
          },
          py::arg("value"), "Every rank's value, in rank order (collective)");

  py::class_<table_options>(m, "TableOptions")
      .def(py::init<>())
      .def_readwrite("rows", &table_options::rows)
      .def_readwrite("dim", &table_options::dim)
      .def_readwrite("location", &table_options::location)
      .def_readwrite("cache", &table_options::cache)
      .def_readwrite("cache_ratio", &table_options::cache_ratio)
      .def_readwrite("cache_hash_seed", &table_options::cache_hash_seed)
      .def_readwrite("optimizer", &table_options::optimizer)
      .def_readwrite("weight_decay", &table_options::weight_decay)
      .def_readwrite("beta1", &table_options::beta1)
      .def_readwrite("beta2", &table_options::beta2)
      .def_readwrite("eps", &table_options::eps)
      .def_readwrite("decoupled", &table_options::decoupled)
      .def_readwrite("global_step", &table_options::global_step)
      .def_readwrite("sparse_adam_epsilon", &table_options::sparse_adam_epsilon)
      .def_readwrite("init", &table_options::init)
      .def_readwrite("init_a", &table_options::init_a)
      .def_readwrite("init_b", &table_options::init_b)
      .def_readwrite("init_seed", &table_options::init_seed);

  py::class_<table_handle>(m, "Table")
      .def(py::init([](communicator_handle const& c, table_options const& o) {
             return guarded([&] { return std::make_unique<table_handle>(c, o); });
           }),
           py::arg("comm"), py::arg("options"), "Allocates and initializes a table (collective)")
      .def("gather", guarded_method(&table_handle::gather), py::arg("keys"), py::arg("out"),
           "out[i, :] = row keys[i] on the current stream (keys int64, out float32, contiguous)")
      .def("apply_gradients", guarded_method(&table_handle::apply_gradients), py::arg("keys"),
           py::arg("grads"), py::arg("lr"),
           "Sums the gradients of duplicate keys and updates each row once (collective; "
           "synchronizes the current stream)")
      .def("write_rows", guarded_method(&table_handle::write_rows), py::arg("keys"),
           py::arg("values"),
           "Overwrites rows (collective: every rank calls it, with its own keys or none; every "
           "rank's cache is flushed and emptied first; synchronizes the current stream)")
      .def("prefetch", guarded_method(&table_handle::prefetch), py::arg("keys"),
           "Admits the rows of the next batch into the cache")
      .def("flush", guarded_method(&table_handle::flush))
      .def("invalidate", guarded_method(&table_handle::invalidate))
      .def("cache_stats", guarded_method(&table_handle::cache_stats))
      .def("reset_cache_stats",
           [](table_handle& h) {
             guarded([&] {
               c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(h.device)};
               h.t->reset_cache_stats();
             });
           })
      .def_property_readonly("cache_lines",
                             [](table_handle const& h) { return h.t->cache_lines(); })
      .def_property_readonly("global_step",
                             [](table_handle const& h) { return h.t->global_step(); })
      .def_property_readonly("rows", [](table_handle const& h) { return h.t->rows(); })
      .def_property_readonly("dim", [](table_handle const& h) { return h.t->dim(); })
      .def_property_readonly("device", [](table_handle const& h) { return h.device; })
      .def_property_readonly("trainable", [](table_handle const& h) { return h.t->trainable(); })
      .def_property_readonly("cached", [](table_handle const& h) { return h.t->cached(); })
      .def_property_readonly("description",
                             [](table_handle const& h) { return h.t->description(); })
      .def(
          "store",
          [](table_handle& h, std::string const& prefix) {
            guarded([&] {
              c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(h.device)};
              py::gil_scoped_release nogil;
              h.t->store(prefix);
            });
          },
          py::arg("prefix"), "Writes a checkpoint (collective)")
      .def(
          "load",
          [](table_handle& h, std::string const& prefix) {
            guarded([&] {
              c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(h.device)};
              py::gil_scoped_release nogil;
              h.t->load(prefix);
            });
          },
          py::arg("prefix"), "Reads a checkpoint (collective)");

  py::class_<saved_buffer, std::shared_ptr<saved_buffer>>(m, "SavedBuffer")
      .def_property_readonly("nbytes", [](saved_buffer const& b) { return b.bytes; })
      .def_property_readonly("resident", [](saved_buffer const& b) { return b.buf.resident(); });

  py::class_<swap_handle, std::shared_ptr<swap_handle>>(m, "SwapScope")
      .def(py::init([](std::size_t device_budget, std::size_t host_bytes, int max_in_flight,
                       std::size_t coalesce_below, std::size_t coalesce_limit,
                       std::size_t prefetch_lookahead, double timeout_s, std::size_t min_bytes) {
             return guarded([&] {
               expect_value(host_bytes > 0, "wm_torch: a swap scope needs host bytes > 0");
               wm::swap_options o;
               o.device_budget      = device_budget;
               o.host_bytes         = host_bytes;
               o.max_in_flight      = max_in_flight;
               o.coalesce_below     = coalesce_below;
               o.coalesce_limit     = coalesce_limit;
               o.prefetch_lookahead = prefetch_lookahead;
               o.timeout = std::chrono::milliseconds{static_cast<std::int64_t>(timeout_s * 1000)};
               o.device  = static_cast<int>(c10::cuda::current_device());
               py::gil_scoped_release nogil;
               return std::make_shared<swap_handle>(o, min_bytes);
             });
           }),
           py::arg("device_budget"), py::arg("host_bytes"), py::arg("max_in_flight") = 4,
           py::arg("coalesce_below") = std::size_t{4} << 20,
           py::arg("coalesce_limit") = std::size_t{32} << 20, py::arg("prefetch_lookahead") = 0,
           py::arg("timeout_s") = 60.0, py::arg("min_bytes") = std::size_t{1} << 20,
           "A wm::swap_scope on the current GPU: a device pool of device_budget bytes and a "
           "pinned host slab of host_bytes")
      .def("set_direct", guarded_method(&swap_handle::set_direct), py::arg("on"),
           py::arg("max_outstanding_bytes") = std::size_t{0},
           py::arg("stage_bytes") = std::size_t{0}, py::arg("keep_last") = std::size_t{0},
           py::arg("compress") = false, py::arg("host_pacing") = false,
           "Direct mode: page-outs from the tensors' memory, page-ins into torch's memory")
      .def("end_forward", guarded_method(&swap_handle::end_forward),
           "The forward pass ended: the last encoded save goes out; with host pacing the host "
           "waits for every page-out")
      .def("set_skip", guarded_method(&swap_handle::set_skip), py::arg("storage_ptrs"),
           "Storages (data pointers) that pack never copies, e.g. parameters")
      .def("pack", guarded_method(&swap_handle::pack), py::arg("tensor"),
           "A SavedBuffer holding a copy of the tensor (page-out queued), or None to keep it")
      .def("unpack", guarded_method(&swap_handle::unpack), py::arg("saved"),
           "A tensor over the buffer's device memory, valid on the current stream")
      .def("prefetch_all", guarded_method(&swap_handle::prefetch_all),
           "Queues the buffers saved since the last call for page-in, most recent first")
      .def("set_auto_prefetch", guarded_method(&swap_handle::set_auto_prefetch), py::arg("on"))
      .def("wait_prefetches", guarded_method(&swap_handle::wait_prefetches))
      .def("statistics", guarded_method(&swap_handle::statistics))
      .def("reset_statistics", guarded_method(&swap_handle::reset_statistics))
      .def_property_readonly("device", &swap_handle::device);
}
