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
 *  - A wm::saved_tensors (the swap module's scheduling of a framework's saved activations) behind
 *    torch.autograd.graph.saved_tensors_hooks: `pack` hands a saved CUDA tensor to
 *    `saved_tensors::save` (paged out from its own memory in the direct mode, zero-encoded with
 *    compress, shared among saves of the same data), `unpack` returns what
 *    `saved_tensors::restore` gives on the current stream. `torch_memory` is all this file adds:
 *    torch's allocator, record_stream, storages and version counters as the library's
 *    `saved_memory` policy.
 *
 * The Python side (wm_torch.py) builds this file with torch.utils.cpp_extension.load and wraps
 * it in torch.nn.Module / optimizer / hooks classes; everything here checks its inputs and
 * raises Python exceptions with a message that says what was expected.
 */
#include <wm/comm.hpp>
#include <wm/error.hpp>
#include <wm/swap.cuh>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <chrono>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <torch/extension.h>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

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
// Swap scope and saved-tensor hooks: wm::saved_tensors over torch's memory

/**
 * Torch's memory as wm::saved_tensors uses it (wm::saved_memory): tensors as handles, torch's
 * caching allocator for restores and encodings (allocated under a stream guard: reused in that
 * stream's order), `record_stream` for the streams that read a tensor, the storage and the
 * version counter to tell whether a saved tensor is still alive and unchanged.
 */
struct torch_memory {
  using handle_type = torch::Tensor;
  /// A saved tensor's identity (its storage, weakly), layout and version.
  struct watch_type {
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;  // expires with the memory
    void const* storage_data{nullptr};  // the storage's data pointer at the save
    std::int64_t offset{0};
    std::vector<std::int64_t> sizes;
    std::vector<std::int64_t> strides;
    c10::ScalarType dtype{};
    std::int64_t version{0};
    // The version counter, if enabled: reuse() returns the tensor only while it has not moved.
    std::optional<c10::VariableVersion> counter;
    std::uint32_t counter_version{0};
  };

  int device{0};  ///< the scope's GPU

  [[nodiscard]] c10::cuda::CUDAStream stream(cudaStream_t s) const {
    return c10::cuda::getStreamFromExternal(s, static_cast<c10::DeviceIndex>(device));
  }

  /// 0 (keep it as it is) unless a dense tensor with storage on this GPU.
  [[nodiscard]] std::size_t bytes(torch::Tensor const& t) const {
    if (!t.defined() || !t.is_cuda() || t.device().index() != device || !t.has_storage() ||
        !t.is_non_overlapping_and_dense()) {
      return 0;
    }
    return static_cast<std::size_t>(t.numel()) * t.element_size();
  }
  [[nodiscard]] std::size_t element_bytes(torch::Tensor const& t) const {
    return static_cast<std::size_t>(t.element_size());
  }
  // A dense tensor with non-negative strides starts at its lowest address and fills its bytes.
  [[nodiscard]] void* data(torch::Tensor const& t) const { return t.data_ptr(); }
  [[nodiscard]] void const* base(torch::Tensor const& t) const { return t.storage().data(); }

  [[nodiscard]] watch_type watch(torch::Tensor const& t) const {
    watch_type w;
    w.storage.emplace(t.storage().getWeakStorageImpl());
    w.storage_data = static_cast<void const*>(t.storage().unsafeGetStorageImpl()->data_ptr().get());
    w.offset       = t.storage_offset();
    w.sizes        = t.sizes().vec();
    w.strides      = t.strides().vec();
    w.dtype        = t.scalar_type();
    w.version      = t._version();
    if (auto const& vc = t.unsafeGetTensorImpl()->version_counter(); vc.enabled()) {
      w.counter         = vc;
      w.counter_version = vc.current_version();
    }
    return w;
  }

  /// The saved tensor itself, if its storage is alive with the same memory and its version
  /// counter says it was not modified since the save.
  [[nodiscard]] std::optional<torch::Tensor> reuse(watch_type const& w) const {
    if (!w.storage || !w.counter) { return std::nullopt; }
    c10::intrusive_ptr<c10::StorageImpl> si = w.storage->lock();
    if (!si || static_cast<void const*>(si->data_ptr().get()) != w.storage_data ||
        w.counter->current_version() != w.counter_version) {
      return std::nullopt;
    }
    auto t = at::empty({0}, torch::TensorOptions{}.dtype(w.dtype).device(torch::kCUDA, device));
    t.set_(c10::Storage{std::move(si)}, w.offset, w.sizes, w.strides);
    return t;
  }

  /// The same live storage, offset, layout, dtype and version.
  [[nodiscard]] bool same(watch_type const& a, watch_type const& b) const {
    if (!a.storage || !b.storage) { return false; }
    auto const x = a.storage->lock();
    return x && x.get() == b.storage->lock().get() && a.offset == b.offset &&
           a.version == b.version && a.dtype == b.dtype && a.sizes == b.sizes &&
           a.strides == b.strides;
  }

  [[nodiscard]] bool unchanged(torch::Tensor const& t, watch_type const& w) const {
    return t._version() == w.version;
  }

  [[nodiscard]] torch::Tensor allocate(std::size_t bytes, cudaStream_t s) {
    c10::cuda::CUDAStreamGuard on{stream(s)};
    return at::empty({static_cast<std::int64_t>(bytes)},
                     torch::TensorOptions{}.dtype(torch::kUInt8).device(torch::kCUDA, device));
  }

  [[nodiscard]] torch::Tensor allocate_like(watch_type const& w, cudaStream_t s) {
    c10::cuda::CUDAStreamGuard on{stream(s)};
    return at::empty_strided(w.sizes, w.strides,
                             torch::TensorOptions{}.dtype(w.dtype).device(torch::kCUDA, device));
  }

  void record_stream(torch::Tensor const& t, cudaStream_t s) { t.record_stream(stream(s)); }
};

using saved_tensors = wm::saved_tensors<torch_memory>;
using saved_buffer  = saved_tensors::save_type;

/**
 * The Python SwapScope: a wm::saved_tensors over torch's memory, whose scope copies on two
 * streams of torch's pool. Everything it schedules is the library's; this class converts
 * tensors, streams and statistics.
 */
class swap_handle {
 public:
  swap_handle(wm::swap_options const& o, std::size_t min_bytes)
      : swap_handle{with_torch_streams(o), initial_options(min_bytes)} {}

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

  /// Pool mode until SwapHooks picks one (set_direct).
  static wm::saved_tensors_options initial_options(std::size_t min_bytes) {
    wm::saved_tensors_options o;
    o.mode      = wm::save_mode::pool;
    o.min_bytes = min_bytes;
    return o;
  }

  /// The mode of the saves from now on (wm::saved_tensors_options, wm_torch.py's SwapHooks).
  void set_direct(bool on, std::size_t max_outstanding_bytes, std::size_t stage_bytes,
                  std::size_t keep_last, bool compress, bool host_pacing) {
    auto o                  = saves_.options();
    o.mode                  = on ? wm::save_mode::direct : wm::save_mode::pool;
    o.max_outstanding_bytes = max_outstanding_bytes;
    o.stage_bytes           = stage_bytes;
    o.keep_last             = keep_last;
    o.compress              = compress;
    o.host_pacing           = host_pacing;
    saves_.set_options(o);
  }

  void set_auto_prefetch(bool on) {
    auto o          = saves_.options();
    o.auto_prefetch = on;
    saves_.set_options(o);
  }

  /// Storages (by data pointer) that pack never copies: parameters, buffers.
  void set_skip(std::vector<std::uintptr_t> const& ptrs) {
    std::vector<void const*> bases;
    bases.reserve(ptrs.size());
    for (auto p : ptrs) { bases.push_back(reinterpret_cast<void const*>(p)); }
    saves_.set_skip(bases);
  }

  /// The end of the forward pass (leaving the hooks' `with` block).
  void end_forward() {
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device())};
    cudaStream_t const s = current_stream(device());
    py::gil_scoped_release nogil;
    saves_.end_forward(s);
  }

  /// The pack hook: a SavedBuffer, or None to keep @p t as it is.
  py::object pack(torch::Tensor const& t) {
    std::shared_ptr<saved_buffer> sp;
    {
      c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device())};
      cudaStream_t const s = current_stream(device());
      py::gil_scoped_release nogil;
      sp = saves_.save(t, s);
    }
    if (!sp) { return py::none(); }
    return py::cast(sp);
  }

  /// The unpack hook: the saved tensor, valid on the current stream.
  torch::Tensor unpack(std::shared_ptr<saved_buffer> const& sp) {
    expect_value(saves_.owns(sp), "wm_torch: unpack of a buffer of another scope");
    int const dev = device();
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(dev)};
    cudaStream_t const s = current_stream(dev);
    saved_tensors::restored_type r;
    {
      py::gil_scoped_release nogil;
      r = saves_.restore(sp, s);
    }
    if (r.memory) { return std::move(*r.memory); }
    // Pool mode: a tensor over the pool buffer, whose deleter holds the save: the block goes
    // back (after the work queued on `s` at that time) when the tensor and the handle are gone.
    auto const& w                      = sp->source();
    std::shared_ptr<saved_buffer> keep = sp;
    return torch::from_blob(
        r.data, w.sizes, w.strides, [keep](void*) mutable { keep.reset(); },
        torch::TensorOptions{}.dtype(w.dtype).device(torch::kCUDA, dev));
  }

  /// Queues every buffer saved since the last call for page-in, most recent first.
  void prefetch_all() {
    c10::cuda::CUDAGuard guard{static_cast<c10::DeviceIndex>(device())};
    cudaStream_t const s = current_stream(device());
    py::gil_scoped_release nogil;
    saves_.prefetch_all(s);
  }

  /// Waits until every queued page-in is done (tests; not needed for correctness).
  void wait_prefetches() {
    py::gil_scoped_release nogil;
    saves_.wait_prefetches();
  }

  [[nodiscard]] py::dict statistics() {
    wm::swap_statistics st;
    wm::saved_tensors_statistics h;
    {
      py::gil_scoped_release nogil;
      st = saves_.scope().statistics();
      h  = saves_.statistics();
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
    d["packs"]                 = h.saves;
    d["copies"]                = h.copies;
    d["bytes_copied"]          = h.bytes_copied;
    d["shared"]                = h.shared;
    d["kept"]                  = h.kept;
    d["kept_no_room"]          = h.kept_no_room;
    d["unpacks"]               = h.restores;
    d["live_buffers"]          = h.live;
    d["pageouts_from"]         = st.pageouts_from;
    d["pageins_to"]            = st.pageins_to;
    d["reused_sources"]        = h.reused_sources;
    d["staged_unpacks"]        = h.staged_restores;
    d["unstaged_unpacks"]      = h.unstaged_restores;
    d["throttle_waits"]        = h.throttle_waits;
    d["kept_last"]             = h.kept_last;
    d["encoded"]               = h.encoded;
    d["encoded_raw_bytes"]     = h.encoded_raw_bytes;
    d["encoded_bytes"]         = h.encoded_bytes;
    d["host_waits"]            = h.host_waits;
    // Not "host_wait_seconds": that key is the scope's (its host-blocking syncs), set above.
    d["hooks_host_wait_seconds"] = h.host_wait_seconds;
    d["direct"]                  = saves_.options().mode == wm::save_mode::direct;
    d["device_pool_bytes"]       = saves_.pool_bytes();
    d["device_budget"]           = saves_.scope().options().device_budget;
    d["host_bytes"]              = saves_.scope().options().host_bytes;
    return d;
  }

  void reset_statistics() {
    py::gil_scoped_release nogil;
    saves_.reset_statistics();
  }

  [[nodiscard]] int device() const noexcept { return saves_.scope().options().device; }

 private:
  swap_handle(wm::swap_options const& o, wm::saved_tensors_options const& so)
      : saves_{o, so, torch_memory{o.device}} {}

  saved_tensors saves_;
};

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
      .def_property_readonly("nbytes", [](saved_buffer const& b) { return b.bytes(); })
      .def_property_readonly("resident", [](saved_buffer const& b) { return b.resident(); });

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
