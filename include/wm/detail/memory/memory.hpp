// Bodies of wm::memory (declared in <wm/memory.cuh>): allocation of the six kinds, release,
// and raw file load/store.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/comm/posix.hpp>
#include <wm/detail/memory/driver.hpp>
#include <wm/detail/memory/plan.hpp>
#include <wm/error.hpp>
#include <wm/partition.hpp>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace wm {
namespace detail {

enum class memory_kind {
  continuous_device,
  continuous_host,
  chunked_device,
  chunked_host,
  distributed_device,
  distributed_host
};

template <class Location, class Layout>
constexpr memory_kind kind_of()
{
  constexpr bool h = Location::is_host;
  if constexpr (std::is_same_v<Layout, continuous>) {
    return h ? memory_kind::continuous_host : memory_kind::continuous_device;
  } else if constexpr (std::is_same_v<Layout, chunked>) {
    return h ? memory_kind::chunked_host : memory_kind::chunked_device;
  } else {
    return h ? memory_kind::distributed_host : memory_kind::distributed_device;
  }
}

/// What one rank holds for one allocation. The destructor releases it all (not collective).
struct memory_resources {
  communicator* comm{};
  memory_kind kind{};
  block_partition part;
  std::size_t total{};
  std::size_t gran{};
  int device{};

  std::byte* local{};              // device-accessible start of this rank's part
  std::byte* local_host{};         // host-accessible start of this rank's part (host locations)
  std::byte* base{};               // continuous layouts: the whole range
  std::vector<std::byte*> chunks;  // mapped layouts: start of each rank's part
  std::size_t* meta{};             // device copy: world + 1 starts, then world chunk pointers

  // continuous·device (VMM)
  CUdeviceptr va{};
  std::size_t va_bytes{};
  std::vector<std::pair<std::size_t, std::size_t>> mapped;  // (offset, bytes) mapped into va
  CUmemGenericAllocationHandle own_handle{};
  bool own_handle_held{false};
  // chunked·device (CUDA IPC)
  void* own{};
  std::vector<void*> opened;
  // host layouts (shared memfd mapping) and distributed·host (pinned)
  void* host_map{};
  std::size_t host_map_bytes{};
  bool registered{false};
  void* pinned{};

  memory_resources()                                   = default;
  memory_resources(memory_resources const&)            = delete;
  memory_resources& operator=(memory_resources const&) = delete;

  /// Closes what this rank imported from peers (IPC handles). Peers may free after this.
  void release_imports() noexcept
  {
    for (void* p : opened) { (void)cudaIpcCloseMemHandle(p); }
    opened.clear();
  }

  ~memory_resources()
  {
    int previous{};
    bool const restore = cudaGetDevice(&previous) == cudaSuccess;
    (void)cudaSetDevice(device);
    release_imports();
    if (meta != nullptr) { (void)cudaFree(meta); }
    if (va != 0) {
      auto const& d = driver_api::get();
      for (auto [offset, bytes] : mapped) { (void)d.mem_unmap(va + offset, bytes); }
      (void)d.address_free(va, va_bytes);
    }
    if (own_handle_held) { (void)driver_api::get().mem_release(own_handle); }
    if (own != nullptr) { (void)cudaFree(own); }
    if (registered) { (void)cudaHostUnregister(host_map); }
    if (host_map != nullptr) { (void)::munmap(host_map, host_map_bytes); }
    if (pinned != nullptr) { (void)cudaFreeHost(pinned); }
    if (restore) { (void)cudaSetDevice(previous); }
  }
};

/**
 * Runs @p step on every rank, then exchanges outcomes (collective): if any rank failed, every
 * rank throws @p Error naming the ranks and their messages. Keeps a local failure from leaving
 * the other ranks waiting in the next collective.
 */
template <class Error = comm_error, class F>
void collective_step(communicator& comm, std::string const& what, F&& step)
{
  std::string err;
  try {
    step();
  } catch (std::exception const& e) {
    err = e.what();
    if (err.empty()) { err = "unknown error"; }
  }
  auto const all = comm.all_gather_bytes(std::as_bytes(std::span{err.data(), err.size()}));
  std::string msg;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) { continue; }
    msg += (msg.empty() ? "" : "; ") + std::string{"rank "} + std::to_string(r) + ": " +
           std::string{reinterpret_cast<char const*>(all[r].data()), all[r].size()};
  }
  if (!msg.empty()) { throw Error{"wm: " + what + " failed: " + msg}; }
}

inline void allocate_vmm(memory_resources& r)
{
  auto const& d  = driver_api::get();
  auto& comm     = *r.comm;
  int const me   = comm.rank();
  CUmemAllocationProp prop{};
  prop.type                 = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type        = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id          = r.device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  std::uint64_t vmm         = 0;
  unique_fd exported;
  std::vector<std::size_t> b;
  collective_step(comm, "continuous device memory: VMM granularity", [&] {
    std::size_t g = 0;
    WM_CU_TRY(d.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    vmm = g;
  });
  for (auto g : comm.all_gather(vmm)) { vmm = std::max(vmm, g); }  // same on every rank
  b          = vmm_boundaries(r.part.starts(), r.gran, vmm, r.total);
  r.va_bytes = b.back();
  std::size_t const mine = b[static_cast<std::size_t>(me) + 1] - b[static_cast<std::size_t>(me)];
  collective_step(comm, "continuous device memory: cuMemCreate of " + std::to_string(mine) + " bytes", [&] {
    if (mine == 0) { return; }
    WM_CU_TRY(d.mem_create(&r.own_handle, mine, &prop, 0));
    r.own_handle_held = true;
    int fd            = -1;
    WM_CU_TRY(d.mem_export(&fd, r.own_handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    exported.reset(fd);
  });
  auto fds = comm.channel().all_gather(exported.get());  // mapped layouts: node ranks == ranks
  collective_step(comm, "continuous device memory: mapping", [&] {
    if (r.va_bytes == 0) { return; }
    WM_CU_TRY(d.address_reserve(&r.va, r.va_bytes, vmm, 0, 0));
    for (int p = 0; p < comm.size(); ++p) {
      auto const off   = b[static_cast<std::size_t>(p)];
      auto const bytes = b[static_cast<std::size_t>(p) + 1] - off;
      if (bytes == 0) { continue; }
      CUmemGenericAllocationHandle h = r.own_handle;
      if (p != me) {
        WM_EXPECTS(fds[static_cast<std::size_t>(p)].valid(), "rank " + std::to_string(p) + " sent no allocation");
        WM_CU_TRY(d.mem_import(&h,
                               reinterpret_cast<void*>(static_cast<std::uintptr_t>(fds[static_cast<std::size_t>(p)].get())),
                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
      }
      CUresult const mapped = d.mem_map(r.va + off, bytes, 0, h, 0);
      if (p != me) { (void)d.mem_release(h); }  // the mapping keeps the memory alive
      WM_CU_TRY(mapped);
      r.mapped.emplace_back(off, bytes);
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id   = r.device;
    access.flags         = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    WM_CU_TRY(d.mem_set_access(r.va, r.va_bytes, &access, 1));
  });
  if (r.own_handle_held) {  // the mapping holds the memory from here on
    (void)d.mem_release(r.own_handle);
    r.own_handle_held = false;
  }
  r.base = reinterpret_cast<std::byte*>(r.va);
}

inline void allocate_ipc(memory_resources& r)
{
  auto& comm              = *r.comm;
  int const me            = comm.rank();
  std::size_t const bytes = r.part.count(me) * r.gran;
  cudaIpcMemHandle_t handle{};
  collective_step(comm, "chunked device memory: cudaMalloc of " + std::to_string(bytes) + " bytes", [&] {
    if (bytes == 0) { return; }
    WM_CUDA_TRY(cudaMalloc(&r.own, bytes));
    WM_CUDA_TRY(cudaIpcGetMemHandle(&handle, r.own));
  });
  auto const handles = comm.all_gather_bytes(
    bytes == 0 ? std::span<std::byte const>{} : std::as_bytes(std::span{&handle, 1}));
  r.chunks.assign(static_cast<std::size_t>(comm.size()), nullptr);
  collective_step(comm, "chunked device memory: opening peers' IPC handles", [&] {
    for (int p = 0; p < comm.size(); ++p) {
      auto const& h = handles[static_cast<std::size_t>(p)];
      if (p == me) {
        r.chunks[static_cast<std::size_t>(p)] = static_cast<std::byte*>(r.own);
      } else if (h.size() == sizeof(cudaIpcMemHandle_t)) {
        cudaIpcMemHandle_t peer{};
        std::memcpy(&peer, h.data(), sizeof(peer));
        void* ptr = nullptr;
        WM_CUDA_TRY(cudaIpcOpenMemHandle(&ptr, peer, cudaIpcMemLazyEnablePeerAccess));
        r.opened.push_back(ptr);
        r.chunks[static_cast<std::size_t>(p)] = static_cast<std::byte*>(ptr);
      }
    }
  });
  r.local = r.chunks[static_cast<std::size_t>(me)];
}

inline void allocate_shared_host(memory_resources& r)
{
  auto& comm = *r.comm;
  long const page = ::sysconf(_SC_PAGESIZE);
  r.host_map_bytes = round_up(r.total, static_cast<std::size_t>(page > 0 ? page : 4096));
  unique_fd created;
  collective_step(comm, "host memory: memfd_create", [&] {
    if (comm.rank() != 0 || r.host_map_bytes == 0) { return; }
    created.reset(::memfd_create("wm-memory", MFD_CLOEXEC));
    if (!created.valid()) { throw io_error{"memfd_create: " + errno_text()}; }
    if (::ftruncate(created.get(), static_cast<off_t>(r.host_map_bytes)) != 0) {
      throw io_error{"ftruncate to " + std::to_string(r.host_map_bytes) + " bytes: " + errno_text()};
    }
  });
  auto fds = comm.channel().all_gather(created.get());
  collective_step(comm, "host memory: mapping and registering", [&] {
    if (r.host_map_bytes == 0) { return; }
    void* p = ::mmap(nullptr, r.host_map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0].get(), 0);
    if (p == MAP_FAILED) { throw io_error{"mmap of shared host memory: " + errno_text()}; }
    r.host_map = p;
    WM_CUDA_TRY(cudaHostRegister(p, r.host_map_bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
    r.registered = true;
    void* dev    = nullptr;
    WM_CUDA_TRY(cudaHostGetDevicePointer(&dev, p, 0));
    r.base = static_cast<std::byte*>(dev);
  });
  r.chunks.resize(static_cast<std::size_t>(comm.size()));
  for (int p = 0; p < comm.size(); ++p) {
    r.chunks[static_cast<std::size_t>(p)] = r.base == nullptr ? nullptr : r.base + r.part.begin(p) * r.gran;
  }
  auto const offset = r.part.begin(comm.rank()) * r.gran;
  r.local           = r.base == nullptr ? nullptr : r.base + offset;
  r.local_host      = r.host_map == nullptr ? nullptr : static_cast<std::byte*>(r.host_map) + offset;
}

inline void allocate_private(memory_resources& r, bool host)
{
  auto& comm              = *r.comm;
  std::size_t const bytes = r.part.count(comm.rank()) * r.gran;
  collective_step(comm, std::string{"distributed "} + (host ? "host" : "device") + " memory: allocating " +
                          std::to_string(bytes) + " bytes", [&] {
    if (bytes == 0) { return; }
    if (host) {
      WM_CUDA_TRY(cudaMallocHost(&r.pinned, bytes));
      void* dev = nullptr;
      WM_CUDA_TRY(cudaHostGetDevicePointer(&dev, r.pinned, 0));
      r.local      = static_cast<std::byte*>(dev);
      r.local_host = static_cast<std::byte*>(r.pinned);
    } else {
      WM_CUDA_TRY(cudaMalloc(&r.own, bytes));
      r.local = static_cast<std::byte*>(r.own);
    }
  });
}

inline void allocate(memory_resources& r)
{
  switch (r.kind) {
    case memory_kind::continuous_device:
      allocate_vmm(r);
      r.chunks.resize(static_cast<std::size_t>(r.comm->size()));
      for (int p = 0; p < r.comm->size(); ++p) {
        r.chunks[static_cast<std::size_t>(p)] = r.base == nullptr ? nullptr : r.base + r.part.begin(p) * r.gran;
      }
      r.local = r.chunks[static_cast<std::size_t>(r.comm->rank())];
      break;
    case memory_kind::chunked_device: allocate_ipc(r); break;
    case memory_kind::continuous_host:
    case memory_kind::chunked_host: allocate_shared_host(r); break;
    case memory_kind::distributed_device: allocate_private(r, false); break;
    case memory_kind::distributed_host: allocate_private(r, true); break;
  }
  // Device copy of the partition starts and the chunk pointers, for chunked_view.
  auto const world = static_cast<std::size_t>(r.comm->size());
  std::vector<std::size_t> meta(2 * world + 1, 0);
  std::copy(r.part.starts().begin(), r.part.starts().end(), meta.begin());
  for (std::size_t p = 0; p < r.chunks.size(); ++p) {
    meta[world + 1 + p] = reinterpret_cast<std::uintptr_t>(r.chunks[p]);
  }
  collective_step(*r.comm, "memory: partition table", [&] {
    WM_CUDA_TRY(cudaMalloc(&r.meta, meta.size() * sizeof(std::size_t)));
    WM_CUDA_TRY(cudaMemcpy(r.meta, meta.data(), meta.size() * sizeof(std::size_t), cudaMemcpyHostToDevice));
  });
}

/// Pinned double buffer for moving file data to and from device memory in bounded pieces.
class staging_buffer {
 public:
  static constexpr std::size_t piece = std::size_t{32} << 20;

  explicit staging_buffer(bool needed)
  {
    if (!needed) { return; }
    WM_CUDA_TRY(cudaMallocHost(&buf_, 2 * piece));
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (auto& e : done_) { WM_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  }
  staging_buffer(staging_buffer const&)            = delete;
  staging_buffer& operator=(staging_buffer const&) = delete;
  ~staging_buffer()
  {
    if (stream_ != nullptr) { (void)cudaStreamSynchronize(stream_); }
    for (auto& e : done_) {
      if (e != nullptr) { (void)cudaEventDestroy(e); }
    }
    if (stream_ != nullptr) { (void)cudaStreamDestroy(stream_); }
    if (buf_ != nullptr) { (void)cudaFreeHost(buf_); }
  }
  /// Piece @p i's host buffer, once the copy that last used it has finished.
  [[nodiscard]] std::byte* acquire(std::size_t i)
  {
    WM_CUDA_TRY(cudaEventSynchronize(done_[i % 2]));
    return buf_ + (i % 2) * piece;
  }
  void copy(void* dst, void const* src, std::size_t n, cudaMemcpyKind kind, std::size_t i)
  {
    WM_CUDA_TRY(cudaMemcpyAsync(dst, src, n, kind, stream_));
    WM_CUDA_TRY(cudaEventRecord(done_[i % 2], stream_));
  }
  void finish() { WM_CUDA_TRY(cudaStreamSynchronize(stream_)); }

 private:
  std::byte* buf_{};
  cudaStream_t stream_{};
  std::array<cudaEvent_t, 2> done_{};
};

/// Reads this rank's byte range of the concatenated @p files into its part.
inline void read_part(memory_resources& r,
                      std::span<std::filesystem::path const> files,
                      std::span<std::uint64_t const> sizes)
{
  auto const me    = r.comm->rank();
  auto const begin = r.part.begin(me) * r.gran;
  auto const end   = r.part.end(me) * r.gran;
  auto const plan  = plan_reads(sizes, begin, end);
  bool const host  = r.local_host != nullptr;
  staging_buffer staging{!host && !plan.empty()};
  std::size_t piece_no = 0;
  for (auto const& s : plan) {
    unique_fd fd{::open(files[s.file].c_str(), O_RDONLY | O_CLOEXEC)};
    if (!fd.valid()) { throw io_error{"cannot open '" + files[s.file].string() + "': " + errno_text()}; }
    ::posix_fadvise(fd.get(), static_cast<off_t>(s.offset), static_cast<off_t>(s.length), POSIX_FADV_SEQUENTIAL);
    std::uint64_t done = 0;
    while (done < s.length) {
      std::size_t const n = static_cast<std::size_t>(std::min<std::uint64_t>(s.length - done, staging_buffer::piece));
      std::byte* dst      = host ? r.local_host + s.dest + done : staging.acquire(piece_no);
      std::size_t got     = 0;
      while (got < n) {
        auto const k = ::pread(fd.get(), dst + got, n - got, static_cast<off_t>(s.offset + done + got));
        if (k < 0 && errno == EINTR) { continue; }
        if (k <= 0) {
          throw io_error{"reading '" + files[s.file].string() + "' at byte " +
                         std::to_string(s.offset + done + got) + ": " + (k == 0 ? std::string{"unexpected end of file"} : errno_text())};
        }
        got += static_cast<std::size_t>(k);
      }
      if (!host) { staging.copy(r.local + s.dest + done, dst, n, cudaMemcpyHostToDevice, piece_no++); }
      done += n;
    }
  }
  if (!host && !plan.empty()) { staging.finish(); }
}

/// Writes this rank's part to @p file (an empty file if it owns nothing).
inline void write_part(memory_resources const& r, std::filesystem::path const& file)
{
  auto const bytes = r.part.count(r.comm->rank()) * r.gran;
  unique_fd fd{::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (!fd.valid()) { throw io_error{"cannot create '" + file.string() + "': " + errno_text()}; }
  bool const host = r.local_host != nullptr;
  staging_buffer staging{!host && bytes > 0};
  std::size_t const pieces = (bytes + staging_buffer::piece - 1) / staging_buffer::piece;
  auto piece_bytes = [&](std::size_t i) { return std::min(staging_buffer::piece, bytes - i * staging_buffer::piece); };
  if (!host && pieces > 0) {
    staging.copy(staging.acquire(0), r.local, piece_bytes(0), cudaMemcpyDeviceToHost, 0);
  }
  for (std::size_t i = 0; i < pieces; ++i) {
    std::byte const* src = host ? r.local_host + i * staging_buffer::piece : staging.acquire(i);
    if (!host && i + 1 < pieces) {  // next piece travels while this one is written
      staging.copy(staging.acquire(i + 1), r.local + (i + 1) * staging_buffer::piece, piece_bytes(i + 1),
                   cudaMemcpyDeviceToHost, i + 1);
    }
    if (!write_all(fd.get(), src, piece_bytes(i))) {
      throw io_error{"writing '" + file.string() + "': " + errno_text()};
    }
  }
  if (::close(fd.release()) != 0) { throw io_error{"closing '" + file.string() + "': " + errno_text()}; }
}

}  // namespace detail

// ---- memory members ---------------------------------------------------------------------------

template <location Location, layout Layout>
memory<Location, Layout>::memory(communicator& comm, std::size_t total_bytes, std::size_t granularity)
  : memory(comm, total_bytes, granularity, std::span<std::size_t const>{})
{
}

template <location Location, layout Layout>
memory<Location, Layout>::memory(communicator& comm,
                                 std::size_t total_bytes,
                                 std::size_t granularity,
                                 std::span<std::size_t const> entries_per_rank)
{
  WM_EXPECTS(comm.valid(), "the communicator is empty");
  WM_EXPECTS(granularity > 0, "the granularity must be at least 1 byte");
  WM_EXPECTS(total_bytes % granularity == 0,
             "the total size " + std::to_string(total_bytes) +
               " is not a multiple of the granularity " + std::to_string(granularity));
  if constexpr (Layout::mapped) {
    WM_EXPECTS(comm.single_node(), std::string{"the "} + Layout::name +
                                     " layout maps every rank's memory and needs all ranks on one "
                                     "node; use wm::distributed across nodes");
  }
  std::uint64_t args = detail::mix64(total_bytes, granularity);
  args = detail::fnv1a(Location::name, detail::fnv1a(Layout::name, args));
  for (auto c : entries_per_rank) { args = detail::mix64(args, c); }
  comm.expect_same("memory", args);

  auto r   = std::make_unique<detail::memory_resources>();
  r->comm  = &comm;
  r->kind  = detail::kind_of<Location, Layout>();
  r->total = total_bytes;
  r->gran  = granularity;
  r->part  = entries_per_rank.empty()
               ? block_partition{total_bytes / granularity, comm.size()}
               : block_partition{total_bytes / granularity, comm.size(), entries_per_rank};
  WM_CUDA_TRY(cudaGetDevice(&r->device));
  try {
    detail::allocate(*r);
  } catch (...) {
    // The steps fail on every rank together. As in `release`: an owner frees its part (when r
    // goes) only after every peer closed its mapping of it.
    if (r->kind == detail::memory_kind::chunked_device) {
      r->release_imports();
      try {
        comm.barrier();
      } catch (...) {
      }
    }
    throw;
  }
  r_ = std::move(r);
}

template <location Location, layout Layout>
memory<Location, Layout>::memory(memory&&) noexcept = default;

template <location Location, layout Layout>
memory<Location, Layout>& memory<Location, Layout>::operator=(memory&& other) noexcept
{
  if (this != &other) {
    release();
    r_ = std::move(other.r_);
  }
  return *this;
}

template <location Location, layout Layout>
memory<Location, Layout>::~memory()
{
  release();
}

template <location Location, layout Layout>
void memory<Location, Layout>::release() noexcept
{
  if (!r_) { return; }
  // Collective: nobody may still be reading a peer's part, and an owner may free its part only
  // after every peer closed its mapping of it.
  try {
    r_->comm->barrier();
  } catch (...) {
  }
  r_->release_imports();
  if (r_->kind == detail::memory_kind::chunked_device) {
    try {
      r_->comm->barrier();
    } catch (...) {
    }
  }
  r_.reset();
}

template <location Location, layout Layout>
std::size_t memory<Location, Layout>::total_bytes() const noexcept { return r_->total; }
template <location Location, layout Layout>
std::size_t memory<Location, Layout>::granularity() const noexcept { return r_->gran; }
template <location Location, layout Layout>
std::size_t memory<Location, Layout>::entries() const noexcept { return r_->part.entries(); }
template <location Location, layout Layout>
block_partition const& memory<Location, Layout>::partition() const noexcept { return r_->part; }
template <location Location, layout Layout>
int memory<Location, Layout>::rank() const noexcept { return r_->comm->rank(); }
template <location Location, layout Layout>
int memory<Location, Layout>::world() const noexcept { return r_->comm->size(); }

template <location Location, layout Layout>
index_range memory<Location, Layout>::entry_range(int rank) const
{
  WM_EXPECTS(rank >= 0 && rank < world(), "rank " + std::to_string(rank) + " is out of range");
  return {r_->part.begin(rank), r_->part.end(rank)};
}

template <location Location, layout Layout>
index_range memory<Location, Layout>::byte_range(int rank) const
{
  auto const e = entry_range(rank);
  return {e.begin * r_->gran, e.end * r_->gran};
}

template <location Location, layout Layout>
wm::local_view memory<Location, Layout>::local_view() const noexcept
{
  int const me = rank();
  return {r_->local, r_->part.begin(me), r_->part.count(me), r_->gran};
}

template <location Location, layout Layout>
wm::chunked_view memory<Location, Layout>::chunked_view() const noexcept
  requires mapped_layout<Layout>
{
  auto const world = static_cast<std::size_t>(r_->comm->size());
  return {reinterpret_cast<std::byte* const*>(r_->meta + world + 1), r_->part.ref(r_->meta), r_->gran};
}

template <location Location, layout Layout>
std::byte* memory<Location, Layout>::part_data(int rank) const
  requires mapped_layout<Layout>
{
  WM_EXPECTS(rank >= 0 && rank < world(), "part_data: rank " + std::to_string(rank) + " is not in [0, " +
                                            std::to_string(world()) + ")");
  return r_->chunks[static_cast<std::size_t>(rank)];
}

template <location Location, layout Layout>
partition_ref memory<Location, Layout>::device_partition() const noexcept
{
  return r_->part.ref(r_->meta);
}

template <location Location, layout Layout>
wm::continuous_view memory<Location, Layout>::continuous_view() const noexcept
  requires std::same_as<Layout, continuous>
{
  return {r_->base, r_->part.entries(), r_->gran};
}

template <location Location, layout Layout>
void memory<Location, Layout>::load(std::span<std::filesystem::path const> files)
{
  auto& comm = *r_->comm;
  comm.expect_same("memory.load", files.size());
  std::vector<std::uint64_t> sizes(files.size());
  detail::collective_step<io_error>(comm, "memory load (checking files)", [&] {
    WM_EXPECTS(!files.empty(), "load needs at least one file");
    std::vector<std::string> names;
    for (std::size_t f = 0; f < files.size(); ++f) {
      names.push_back(files[f].string());
      std::error_code ec;
      if (!std::filesystem::is_regular_file(files[f], ec)) {
        throw io_error{"'" + files[f].string() + "' is not a readable file" +
                       (ec ? ": " + ec.message() : std::string{})};
      }
      sizes[f] = std::filesystem::file_size(files[f], ec);
      if (ec) { throw io_error{"cannot read the size of '" + files[f].string() + "': " + ec.message()}; }
    }
    if (auto const bad = detail::check_file_sizes(sizes, names, r_->total, r_->gran); !bad.empty()) {
      throw io_error{bad};
    }
  });
  detail::collective_step<io_error>(comm, "memory load (reading)", [&] { detail::read_part(*r_, files, sizes); });
}

template <location Location, layout Layout>
void memory<Location, Layout>::store(std::span<std::filesystem::path const> files) const
{
  auto& comm = *r_->comm;
  comm.expect_same("memory.store", files.size());
  detail::collective_step<io_error>(comm, "memory store", [&] {
    WM_EXPECTS(files.size() == static_cast<std::size_t>(comm.size()),
               "store needs one file per rank (" + std::to_string(comm.size()) + "), got " +
                 std::to_string(files.size()));
    detail::write_part(*r_, files[static_cast<std::size_t>(comm.rank())]);
  });
}

template <location Location, layout Layout>
std::vector<std::filesystem::path> memory<Location, Layout>::part_files(std::filesystem::path const& prefix,
                                                                        int world)
{
  std::vector<std::filesystem::path> out;
  for (int r = 0; r < world; ++r) {
    out.emplace_back(prefix.string() + ".rank" + std::to_string(r) + "-of-" + std::to_string(world) + ".bin");
  }
  return out;
}

template <location Location, layout Layout>
std::vector<std::filesystem::path> memory<Location, Layout>::store(std::filesystem::path const& prefix) const
{
  auto files = part_files(prefix, world());
  store(std::span<std::filesystem::path const>{files});
  return files;
}

}  // namespace wm
