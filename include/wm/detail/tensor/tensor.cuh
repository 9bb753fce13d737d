// Bodies of wm::tensor (declared in <wm/tensor.cuh>): mapped gather/scatter, the distributed
// (model-parallel) dispatch path, the reusable workspace and the index error state.
#pragma once

#include <wm/detail/memory/plan.hpp>
#include <wm/detail/tensor/plan.hpp>
#include <wm/detail/tensor/kernels.cuh>
#include <wm/tensor.cuh>

#include <cub/device/device_radix_sort.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <exception>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace wm {
namespace detail {

/// Device memory reused across calls; grows (stream-ordered) when a call needs more.
class workspace {
 public:
  workspace() = default;
  workspace(workspace const&)            = delete;
  workspace& operator=(workspace const&) = delete;
  ~workspace()
  {
    if (ptr_ != nullptr) { (void)cudaFree(ptr_); }
  }
  /// At least @p bytes of device memory, valid for work ordered after this on @p stream.
  [[nodiscard]] std::byte* reserve(std::size_t bytes, cudaStream_t stream)
  {
    if (bytes > bytes_) {
      if (ptr_ != nullptr) { WM_CUDA_TRY(cudaFreeAsync(ptr_, stream)); }
      ptr_   = nullptr;
      bytes_ = 0;
      std::size_t const grown = round_up(bytes + bytes / 4, std::size_t{1} << 20);
      WM_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&ptr_), grown, stream));
      bytes_ = grown;
    }
    return ptr_;
  }

 private:
  std::byte* ptr_{};
  std::size_t bytes_{};
};

/// Carves aligned arrays out of a workspace: first `add` every array, then `reserve`, then `take`.
class carver {
 public:
  template <class T>
  std::size_t add(std::size_t n)
  {
    std::size_t const at = total_;
    total_               = round_up(total_ + n * sizeof(T), 256);
    return at;
  }
  void add_bytes(std::size_t n) { total_ = round_up(total_ + n, 256); }
  [[nodiscard]] std::size_t total() const noexcept { return total_ == 0 ? 256 : total_; }
  template <class T>
  T* take(std::byte* base, std::size_t offset) const
  {
    return reinterpret_cast<T*>(base + offset);
  }

 private:
  std::size_t total_{};
};

/// Streams and events for the distributed gather, made on first use. The side stream (highest
/// priority) moves rows between ranks and puts arrived pieces in the caller's order while the
/// caller's stream gathers the next piece; the aux stream serves this rank's own rows meanwhile.
class side_stream {
 public:
  side_stream() = default;
  side_stream(side_stream const&)            = delete;
  side_stream& operator=(side_stream const&) = delete;
  ~side_stream()
  {
    // Only what was made: destroying a null handle fails, and that error would surface at the
    // next launch check of an unrelated call.
    auto const drop = [](auto const& set) {
      for (auto e : set) {
        if (e != nullptr) { (void)cudaEventDestroy(e); }
      }
    };
    drop(ready_);
    drop(arrived_);
    drop(copied_);
    drop(marks_);
    for (auto st : {stream_, aux_}) {
      if (st != nullptr) { (void)cudaStreamDestroy(st); }
    }
  }
  [[nodiscard]] cudaStream_t get()
  {
    make();
    return stream_;
  }
  /// Whether the streams and events exist (the first `get` or `aux` makes them).
  [[nodiscard]] bool made() const noexcept { return stream_ != nullptr; }
  /// Waits for everything on both streams (errors ignored: for teardown and regrowth).
  void synchronize() const noexcept
  {
    for (cudaStream_t st : {stream_, aux_}) {
      if (st != nullptr) { (void)cudaStreamSynchronize(st); }
    }
  }
  /// The stream that serves this rank's own rows while the others cross (rows put by kernels), or
  /// that hands gathered pieces to the copy engine (rows copied).
  [[nodiscard]] cudaStream_t aux()
  {
    make();
    return aux_;
  }
  /// Piece k is gathered (recorded on the caller's stream).
  [[nodiscard]] cudaEvent_t ready(int k) const { return ready_[static_cast<std::size_t>(k)]; }
  /// Piece k is copied into the peers' mailboxes (recorded on the aux stream).
  [[nodiscard]] cudaEvent_t copied(int k) const { return copied_[static_cast<std::size_t>(k)]; }
  /// Piece k has crossed (recorded on the side stream).
  [[nodiscard]] cudaEvent_t arrived(int k) const { return arrived_[static_cast<std::size_t>(k)]; }
  /// The caller's stream reached the fork (aux waits for it).
  [[nodiscard]] cudaEvent_t forked() const { return marks_[0]; }
  /// The aux stream's work is done (the caller's stream waits for it).
  [[nodiscard]] cudaEvent_t joined() const { return marks_[1]; }
  /// Makes @p s wait for everything on both streams (a call that failed half-way: what it left
  /// there still uses the scratch buffers). Errors ignored.
  void join_into(cudaStream_t s) noexcept
  {
    if (stream_ == nullptr || marks_[2] == nullptr) { return; }
    for (cudaStream_t st : {stream_, aux_}) {  // a wait takes the event as last recorded
      if (cudaEventRecord(marks_[2], st) == cudaSuccess) { (void)cudaStreamWaitEvent(s, marks_[2], 0); }
    }
  }

 private:
  void make()
  {
    if (stream_ != nullptr) { return; }
    // Events and the aux stream first, the side stream last: after a failure here the next call
    // tries again.
    auto const make_all = [](auto& set) {
      for (auto& x : set) {
        if (x == nullptr) { WM_CUDA_TRY(cudaEventCreateWithFlags(&x, cudaEventDisableTiming)); }
      }
    };
    make_all(ready_);
    make_all(arrived_);
    make_all(copied_);
    make_all(marks_);
    if (aux_ == nullptr) { WM_CUDA_TRY(cudaStreamCreateWithFlags(&aux_, cudaStreamNonBlocking)); }
    // Highest priority: its blocks start as soon as the gather's blocks leave an SM.
    int least = 0, greatest = 0;
    WM_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    WM_CUDA_TRY(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
  }
  cudaStream_t stream_{};
  cudaStream_t aux_{};
  std::array<cudaEvent_t, max_pieces> ready_{};
  std::array<cudaEvent_t, max_pieces> arrived_{};
  std::array<cudaEvent_t, max_pieces> copied_{};
  std::array<cudaEvent_t, 3> marks_{};
};

/// Where the distributed gather's owners store rows for this rank: a receive buffer of equal
/// size on every rank, mapped into every peer (chunked device memory over CUDA IPC), so an
/// owner's gather kernel writes the rows straight into the asking rank's buffer over NVLink
/// instead of gathering them first and handing them to NCCL. Made (and grown) collectively by
/// the gather; used only when every rank shares one node. With `copy` the owner gathers the rows
/// into its own memory and the copy engines move them into the mailbox, leaving the SMs free.
struct mailbox {
  enum class state { unknown, on, off };
  state mode{state::unknown};
  bool copy{};  // rows reach the mailbox by cudaMemcpyAsync, not by the gather kernel's stores
  std::optional<memory<device, chunked>> buffer;
  std::vector<std::byte*> at;  // every rank's buffer, as this GPU addresses it
  std::size_t bytes{};         // per rank
  mailbox() = default;
  mailbox(mailbox const&)            = delete;
  mailbox& operator=(mailbox const&) = delete;
  // (~tensor_scratch waits for this rank's work that writes into peers' buffers or reads this one.)
};

struct tensor_scratch {
  workspace a;  // sized by the caller's batch
  workspace b;  // sized by what this rank receives (mapped layouts: rotated keys of long gathers)
  side_stream side;
  mailbox mail;
  unsigned* err{};
  unsigned* err_host{};
  unsigned long long* counts_host{};  // pinned: send counts (world + 1), then 3 words per peer (plan)
  cudaEvent_t last{};                 // the end of the last call that used a, b or the mailboxes
  tensor_scratch(tensor_scratch const&)            = delete;
  tensor_scratch& operator=(tensor_scratch const&) = delete;
  explicit tensor_scratch(int world)
  {
    try {
      WM_CUDA_TRY(cudaEventCreateWithFlags(&last, cudaEventDisableTiming));
      WM_CUDA_TRY(cudaMalloc(&err, sizeof(unsigned)));
      WM_CUDA_TRY(cudaMemset(err, 0, sizeof(unsigned)));
      WM_CUDA_TRY(cudaMallocHost(&err_host, sizeof(unsigned)));
      WM_CUDA_TRY(cudaMallocHost(&counts_host, (4 * static_cast<std::size_t>(world) + 1) * sizeof(unsigned long long)));
    } catch (...) {
      free_own();
      throw;
    }
  }
  ~tensor_scratch()
  {
    // This rank's work may still use the buffers, or write into peers' mailboxes.
    if (last != nullptr) { (void)cudaEventSynchronize(last); }
    side.synchronize();
    free_own();
  }

 private:
  void free_own() noexcept
  {
    if (last != nullptr) { (void)cudaEventDestroy(last); }
    (void)cudaFree(err);
    (void)cudaFreeHost(err_host);
    (void)cudaFreeHost(counts_host);
  }
};

/// For the span of a call that uses a tensor's scratch buffers (workspaces, mailboxes): the call
/// starts after the last one that used them has finished with them, on whatever stream that ran
/// (the buffers are reused; calls on one stream are ordered anyway), and marks its own end.
class scratch_use {
 public:
  scratch_use(tensor_scratch& sc, cudaStream_t s) : sc_{sc}, s_{s} { WM_CUDA_TRY(cudaStreamWaitEvent(s, sc.last, 0)); }
  scratch_use(scratch_use const&)            = delete;
  scratch_use& operator=(scratch_use const&) = delete;
  ~scratch_use()
  {
    // A call that threw may have left work on the side streams that it had not joined yet.
    if (std::uncaught_exceptions() > unwinding_) { sc_.side.join_into(s_); }
    (void)cudaEventRecord(sc_.last, s_);
  }

 private:
  tensor_scratch& sc_;
  cudaStream_t s_;
  int unwinding_{std::uncaught_exceptions()};
};

/// Batches at least this long are read in ascending row order from host memory.
inline constexpr std::size_t host_sort_threshold = std::size_t{1} << 16;

template <class Index>
struct sorted_indices {
  Index* keys;
  std::size_t* positions;
};

/// Stable radix sort of (index, position) pairs in workspace @p ws.
/// Radix-sort bits that order every valid index below @p rows (invalid ones are still carried
/// along and flagged by the kernels; their order does not matter).
[[nodiscard]] inline int row_bits(std::size_t rows)
{
  int b = 1;
  while (b < 63 && (std::size_t{1} << b) < rows) { ++b; }
  return b;
}

/// @p bits: the low key bits to sort on (all of them where keys may be invalid and order matters).
template <class Index>
sorted_indices<Index> sort_with_positions(Index const* idx, std::size_t n, int bits, workspace& ws, cudaStream_t s)
{
  bits = std::min(bits, int{sizeof(Index) * 8});
  carver c;
  auto const o_pos  = c.add<std::size_t>(n);
  auto const o_keys = c.add<Index>(n);
  auto const o_spos = c.add<std::size_t>(n);
  std::size_t cub_bytes = 0;
  WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<Index const*>(nullptr), static_cast<Index*>(nullptr),
                                              static_cast<std::size_t const*>(nullptr), static_cast<std::size_t*>(nullptr),
                                              std::max<std::size_t>(n, 1), 0, bits, s));
  auto const o_cub = c.add<std::byte>(cub_bytes);
  std::byte* base  = ws.reserve(c.total(), s);
  auto* pos        = c.take<std::size_t>(base, o_pos);
  sorted_indices<Index> out{c.take<Index>(base, o_keys), c.take<std::size_t>(base, o_spos)};
  if (n == 0) { return out; }
  iota_kernel<<<elementwise_blocks(n), 256, 0, s>>>(pos, n);
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(c.take<std::byte>(base, o_cub), cub_bytes, idx, out.keys, pos, out.positions, n,
                                              0, bits, s));
  return out;
}

/// Valid rows k become (k + by) mod rows; invalid indices stay as they are (still invalid).
template <class Index>
__global__ void rotate_rows_kernel(Index const* in, Index* out, std::size_t n, std::size_t rows, std::size_t by)
{
  for (std::size_t j = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; j < n; j += gridDim.x * std::size_t{blockDim.x}) {
    Index const k = in[j];
    out[j]        = valid_index(k, rows) ? static_cast<Index>((static_cast<std::size_t>(k) + by) % rows) : k;
  }
}

[[nodiscard]] inline int owner_bits(int world)
{
  int bits = 1;
  while ((1 << bits) <= world) { ++bits; }
  return bits;
}

}  // namespace detail

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
tensor<T, Location, Layout, Mapping>::tensor(communicator& comm, std::size_t rows, std::size_t cols, std::size_t stride)
  : comm_{&comm},
    rows_{rows},
    cols_{cols},
    stride_{stride == 0 ? cols : stride},
    mem_{[&]() -> memory<Location, Layout> {
      WM_EXPECTS(cols >= 1, "a tensor row needs at least one element");
      WM_EXPECTS(stride == 0 || stride >= cols, "the row stride (" + std::to_string(stride) +
                                                  ") must be at least the row width (" + std::to_string(cols) + ")");
      std::size_t const s = stride == 0 ? cols : stride;
      auto const counts = Mapping::counts(rows, comm.size());  // the mapping sizes the parts
      return memory<Location, Layout>{comm, rows * s * sizeof(T), s * sizeof(T), counts};
    }()},
    scratch_{std::make_unique<detail::tensor_scratch>(comm.size())}
{
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
tensor<T, Location, Layout, Mapping>::tensor(tensor&&) noexcept = default;
template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
tensor<T, Location, Layout, Mapping>& tensor<T, Location, Layout, Mapping>::operator=(tensor&&) noexcept = default;
template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
tensor<T, Location, Layout, Mapping>::~tensor() = default;

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
mapping_ref<Mapping> tensor<T, Location, Layout, Mapping>::map_ref() const noexcept
{
  return make_mapping_ref<Mapping>(mem_.device_partition());
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
row_location tensor<T, Location, Layout, Mapping>::locate(std::size_t k) const
{
  WM_EXPECTS(k < rows_, "row " + std::to_string(k) + " is out of range [0, " + std::to_string(rows_) + ")");
  auto const& p = mem_.partition();
  return make_mapping_ref<Mapping>(p.ref(p.starts().data())).locate(k);  // host starts
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
matrix_view<T> tensor<T, Location, Layout, Mapping>::local_view() const noexcept
{
  auto const v = mem_.local_view();
  return {reinterpret_cast<T*>(v.data), v.entries, cols_, stride_};
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
void tensor<T, Location, Layout, Mapping>::throw_if_error(cudaStream_t stream, char const* what)
{
  WM_CUDA_TRY(cudaMemcpyAsync(scratch_->err_host, scratch_->err, sizeof(unsigned), cudaMemcpyDeviceToHost, stream));
  if constexpr (std::same_as<Layout, distributed>) {
    comm_->synchronize(cuda::stream_ref{stream}, what);  // exchanges with peers: a peer that failed is an error
  } else {
    WM_CUDA_TRY(cudaStreamSynchronize(stream));  // local work: no deadline
  }
  if (*scratch_->err_host != 0) {
    WM_CUDA_TRY(cudaMemsetAsync(scratch_->err, 0, sizeof(unsigned), stream));
    WM_CUDA_TRY(cudaStreamSynchronize(stream));
    throw logic_error{std::string{"wm: "} + what + ": an index was negative or not below the row count " +
                      std::to_string(rows_) + " (its output row is zero / nothing was written)"};
  }
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
void tensor<T, Location, Layout, Mapping>::check_errors(cuda::stream_ref stream)
{
  throw_if_error(stream.get(), "tensor gather/scatter");
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
template <index_type Index>
void tensor<T, Location, Layout, Mapping>::gather_async(std::span<Index const> indices, T* out, cuda::stream_ref stream)
{
  WM_EXPECTS(indices.empty() || (indices.data() != nullptr && out != nullptr), "gather: null indices or output");
  if constexpr (Layout::mapped) {
    auto const view = mem_.chunked_view();
    detail::mapped_rows<Mapping> const rows{view.chunks, map_ref(), stride_bytes()};
    detail::packed_rows const dst{reinterpret_cast<std::byte*>(out), row_bytes()};
    std::size_t const n  = indices.size();
    cudaStream_t const s = stream.get();
    // Host memory and CUDA IPC mappings (chunked device) are slow to translate for random reads
    // over many GiB; reading long batches in ascending row order keeps the pages in flight few.
    // Output order is kept by writing each row to its original position.
    // One rank's chunked memory is its own plain allocation: nothing to translate.
    bool const sort_long = Location::is_host || (std::same_as<Layout, chunked> && comm_->size() > 1);
    bool const fresh     = Location::is_host;  // other GPUs may have written these rows
    if (sort_long && n >= detail::host_sort_threshold) {
      detail::scratch_use const use{*scratch_, s};
      // Chunked device rows with block mapping: ascending order starts at the next rank's rows
      // and wraps around; ranks that all began at row 0 read the same owner at the same time
      // (seen with 4 ranks: chunked gathers at 0.59 of the peer-copy floor, continuous ones at
      // 0.87). Host rows have one home: nothing to spread. Rotated rows must fit in Index.
      std::size_t start = 0;
      if constexpr (contiguous_mapping<Mapping> && !Location::is_host) {
        if (rows_ > 0 && rows_ <= static_cast<std::size_t>(std::numeric_limits<Index>::max())) {
          start = mem_.entry_range((comm_->rank() + 1) % comm_->size()).begin % rows_;
        }
      }
      Index const* keys = indices.data();
      if (start != 0) {
        auto* rotated = reinterpret_cast<Index*>(scratch_->b.reserve(n * sizeof(Index), s));
        detail::rotate_rows_kernel<<<detail::elementwise_blocks(n), 256, 0, s>>>(keys, rotated, n, rows_, rows_ - start);
        WM_CHECK_LAUNCH();
        keys = rotated;
      }
      auto const sorted = detail::sort_with_positions(keys, n, detail::row_bits(rows_), scratch_->a, s);
      if (start != 0) {
        detail::rotate_rows_kernel<<<detail::elementwise_blocks(n), 256, 0, s>>>(sorted.keys, sorted.keys, n, rows_, start);
        WM_CHECK_LAUNCH();
      }
      detail::launch_gather(rows, sorted.keys, sorted.positions, n, dst, row_bytes(), stride_bytes(), scratch_->err, s, fresh);
    } else {
      detail::launch_gather(rows, indices.data(), static_cast<std::size_t const*>(nullptr), n, dst, row_bytes(),
                            stride_bytes(), scratch_->err, s, fresh);
    }
  } else {
    detail::scratch_use const use{*scratch_, stream.get()};
    gather_dispatch(indices.data(), indices.size(), out, stream.get());
  }
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
template <index_type Index>
void tensor<T, Location, Layout, Mapping>::gather(std::span<Index const> indices, T* out, cuda::stream_ref stream)
{
  gather_async(indices, out, stream);
  throw_if_error(stream.get(), "gather");
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
template <index_type Index>
void tensor<T, Location, Layout, Mapping>::scatter_async(std::span<Index const> indices, T const* values,
                                                         cuda::stream_ref stream)
{
  WM_EXPECTS(indices.empty() || (indices.data() != nullptr && values != nullptr), "scatter: null indices or values");
  if constexpr (Layout::mapped) {
    std::size_t const n = indices.size();
    if (n == 0) { return; }
    cudaStream_t const s = stream.get();
    detail::scratch_use const use{*scratch_, s};
    // Sort (index, position) stably on every bit: the last occurrence of each index is the last
    // of its run (an invalid index sharing a valid one's low bits must not split the run).
    auto const sorted = detail::sort_with_positions(indices.data(), n, int{sizeof(Index) * 8}, scratch_->a, s);
    auto const view = mem_.chunked_view();
    detail::launch_scatter(detail::mapped_rows<Mapping>{view.chunks, map_ref(), stride_bytes()}, sorted.keys, sorted.positions, n,
                           detail::packed_rows{reinterpret_cast<std::byte*>(const_cast<T*>(values)), row_bytes()},
                           row_bytes(), stride_bytes(), scratch_->err, s, Location::is_host);
  } else {
    detail::scratch_use const use{*scratch_, stream.get()};
    scatter_dispatch(indices.data(), indices.size(), values, stream.get());
  }
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
template <index_type Index>
void tensor<T, Location, Layout, Mapping>::scatter(std::span<Index const> indices, T const* values, cuda::stream_ref stream)
{
  scatter_async(indices, values, stream);
  throw_if_error(stream.get(), "scatter");
}

// ---- the distributed (model-parallel) path ----------------------------------------------------

namespace detail {

/// Step 1 of both directions: owner and local row of each index, grouped by owner (stable), and
/// the per-peer counts exchanged. Host-side counts are valid on return (one stream sync).
template <class Index>
struct dispatch_plan_device {
  int* owner{};
  Index* local{};
  std::size_t* order{};       // positions in the caller's batch, grouped by owner
  Index* send_keys{};         // local rows to request, in send order
  std::vector<std::size_t> send_counts;
  std::vector<std::size_t> recv_counts;
  std::size_t n_sent{};
  std::size_t n_recv{};
  /// Per peer q: where, in rows, this rank's answer starts in q's mailbox (q's rows from the
  /// other ranks packed by owner, q's own share left out).
  std::vector<std::size_t> mail_offsets;
  /// The most rows any rank takes from other ranks in this call (the mailbox must hold them).
  std::size_t most_remote{};
};

/// Three words per peer q for the count exchange: the rows asked of q, where q's answer starts
/// among the rows this rank asks of other ranks, and how many rows that is in all. Also where
/// each owner's group starts in the send order (world + 1 entries, the invalid indices last).
template <class Word>
__global__ void dispatch_words_kernel(Word const* counts, int world, int me, Word* words, Word* starts)
{
  if (blockIdx.x != 0 || threadIdx.x != 0) { return; }
  Word at = 0, sent = 0;
  for (int q = 0; q < world; ++q) {
    words[3 * q]     = counts[q];
    words[3 * q + 1] = at;
    starts[q]        = sent;
    if (q != me) { at += counts[q]; }
    sent += counts[q];
  }
  starts[world] = sent;
  for (int q = 0; q < world; ++q) { words[3 * q + 2] = at; }
}

template <class Mapping, class Index>
dispatch_plan_device<Index> plan_dispatch_device(communicator& comm,
                                                 mapping_ref<Mapping> map,
                                                 Index const* idx,
                                                 std::size_t n,
                                                 tensor_scratch& scratch,
                                                 cudaStream_t s,
                                                 bool in_order = true)
{
  int const world  = comm.size();
  auto const w     = static_cast<std::size_t>(world);
  int const bits   = owner_bits(world);
  // Without the caller's order inside each owner's group, one placing pass replaces the sort.
  bool const place = !in_order && world < place_shared_ranks;
  carver c;
  auto const o_owner  = c.add<int>(n);
  auto const o_sowner = c.add<int>(place ? 0 : n);
  auto const o_local  = c.add<Index>(n);
  auto const o_pos    = c.add<std::size_t>(place ? 0 : n);
  auto const o_order  = c.add<std::size_t>(n);
  auto const o_keys   = c.add<Index>(n);
  auto const o_counts = c.add<unsigned long long>(8 * w + 2);  // counts, invalid, words in, words out, starts
  std::size_t cub_bytes = 0;
  if (!place) {
    WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<int const*>(nullptr), static_cast<int*>(nullptr),
                                                static_cast<std::size_t const*>(nullptr), static_cast<std::size_t*>(nullptr),
                                                std::max<std::size_t>(n, 1), 0, bits, s));
  }
  auto const o_cub = c.add<std::byte>(cub_bytes);
  std::byte* base  = scratch.a.reserve(c.total(), s);

  dispatch_plan_device<Index> p;
  p.owner       = c.take<int>(base, o_owner);
  p.local       = c.take<Index>(base, o_local);
  p.order       = c.take<std::size_t>(base, o_order);
  p.send_keys   = c.take<Index>(base, o_keys);
  auto* counts  = c.take<unsigned long long>(base, o_counts);  // world + 1 (last: invalid)
  auto* recv    = counts + w + 1;                               // 3 words per peer
  auto* words   = recv + 3 * w;                                 // 3 words per peer
  auto* starts  = words + 3 * w;                                // world + 1
  auto* pos     = c.take<std::size_t>(base, o_pos);
  auto* sowner  = c.take<int>(base, o_sowner);
  WM_CUDA_TRY(cudaMemsetAsync(counts, 0, (w + 1) * sizeof(unsigned long long), s));
  if (n > 0) {
    std::size_t const shared = world < locate_shared_ranks ? (w + 1) * sizeof(unsigned long long) : 0;
    locate_kernel<<<elementwise_blocks(n), 256, shared, s>>>(map, idx, n, world, p.owner, p.local, place ? nullptr : pos, counts,
                                                                scratch.err);
    WM_CHECK_LAUNCH();
  }
  // Counts travel on the device (three words per peer), then both directions come back at once.
  dispatch_words_kernel<<<1, 1, 0, s>>>(counts, world, comm.rank(), words, starts);
  WM_CHECK_LAUNCH();
  if (place) {
    launch_place_by_owner(p.owner, p.local, n, world, starts, p.order, p.send_keys, s, elementwise_blocks(n));
  } else if (n > 0) {
    WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(c.take<std::byte>(base, o_cub), cub_bytes, p.owner, sowner, pos, p.order,
                                                n, 0, bits, s));
    permute_kernel<<<elementwise_blocks(n), 256, 0, s>>>(p.local, p.order, n, p.send_keys);
    WM_CHECK_LAUNCH();
  }
  std::vector<std::size_t> const three(w, 3);
  comm.all_to_all_v(static_cast<unsigned long long const*>(words), std::span<std::size_t const>{three}, recv,
                    std::span<std::size_t const>{three}, cuda::stream_ref{s});
  WM_CUDA_TRY(cudaMemcpyAsync(scratch.counts_host, counts, (4 * w + 1) * sizeof(unsigned long long), cudaMemcpyDeviceToHost, s));
  comm.synchronize(cuda::stream_ref{s}, "the distributed gather/scatter's count exchange");  // a peer that failed: an error
  auto const* got = scratch.counts_host + w + 1;
  p.send_counts.assign(scratch.counts_host, scratch.counts_host + w);
  for (std::size_t q = 0; q < w; ++q) {
    p.recv_counts.push_back(got[3 * q]);
    p.mail_offsets.push_back(got[3 * q + 1]);
    p.most_remote = std::max<std::size_t>(p.most_remote, got[3 * q + 2]);
  }
  p.n_sent = std::accumulate(p.send_counts.begin(), p.send_counts.end(), std::size_t{0});
  p.n_recv = std::accumulate(p.recv_counts.begin(), p.recv_counts.end(), std::size_t{0});
  return p;
}

inline std::vector<std::size_t> scaled(std::vector<std::size_t> v, std::size_t f)
{
  for (auto& x : v) { x *= f; }
  return v;
}

}  // namespace detail

namespace detail {

/// Exclusive prefix sums: where each peer's block starts (size + 1 entries).
[[nodiscard]] inline std::vector<std::size_t> block_starts(std::vector<std::size_t> const& counts)
{
  std::vector<std::size_t> at(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), at.begin() + 1);
  return at;
}

}  // namespace detail

namespace detail {

/// Whether this call's rows go through the mailboxes (see `mailbox`); makes or grows them first.
/// Collective: every rank passes the same @p bytes (from the count exchange). The first call
/// decides, for the life of the tensor, with every rank's vote: one node, more than one rank, and
/// `WM_DISPATCH_ROWS` not set to `nccl`; rows are copied by the copy engines unless some rank has
/// `WM_DISPATCH_ROWS=put` (then the gather kernels store them; measured on 2 H200s, 1M keys:
/// copy 0.844 ms, put 1.030 ms). A mailbox that cannot be made (no peer access between the GPUs, no
/// memory) leaves the tensor on the NCCL path on every rank. Any other value of the variable on
/// any rank throws on every rank (the vote stays open).
inline bool mailbox_ready(communicator& comm, tensor_scratch& sc, std::size_t bytes)
{
  mailbox& m = sc.mail;
  if (m.mode == mailbox::state::unknown) {
    char const* env = std::getenv("WM_DISPATCH_ROWS");
    std::string_view const how = env != nullptr ? env : "";
    // 0: NCCL, 1: put, 2: copy, -1: a value nobody knows.
    int want = how.empty() || how == "copy" ? 2 : how == "put" ? 1 : how == "nccl" ? 0 : -1;
    if (want > 0 && (comm.size() == 1 || !comm.single_node())) { want = 0; }
    auto const votes = comm.all_gather(want);
    if (std::ranges::any_of(votes, [](int v) { return v < 0; })) {
      throw logic_error{"wm: gather: WM_DISPATCH_ROWS must be unset, nccl, put or copy on every rank (this rank: '" +
                        std::string{how} + "')"};
    }
    m.mode = std::ranges::all_of(votes, [](int v) { return v != 0; }) ? mailbox::state::on : mailbox::state::off;
    m.copy = std::ranges::all_of(votes, [](int v) { return v == 2; });
  }
  if (m.mode == mailbox::state::off) { return false; }
  if (bytes <= m.bytes) { return true; }
  // Every rank's earlier gathers are done with every buffer before any is freed: this rank's
  // kernels by these syncs (the last call's work, joined into its stream, and anything left on
  // the side streams), peers' writes into this buffer because this rank waited for their flags,
  // and no rank frees before all have synced (the release is collective).
  WM_CUDA_TRY(cudaEventSynchronize(sc.last));
  sc.side.synchronize();
  m.buffer.reset();
  m.at.clear();
  m.bytes = 0;
  std::size_t const grown = round_up(bytes + bytes / 4, std::size_t{2} << 20);
  auto const world        = static_cast<std::size_t>(comm.size());
  try {
    m.buffer.emplace(comm, grown * world, grown);
  } catch (std::runtime_error const&) {
    // A comm_error or cuda_error. The allocation's steps are collective: a failure anywhere (no
    // memory, no peer access) is reported on every rank, which all land here. (A communicator
    // that failed meanwhile says so at the next call.)
    m.mode = mailbox::state::off;
    return false;
  }
  for (int q = 0; q < comm.size(); ++q) { m.at.push_back(m.buffer->part_data(q)); }
  m.bytes = grown;
  return true;
}

}  // namespace detail

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
row_path tensor<T, Location, Layout, Mapping>::gather_path() const noexcept
{
  if constexpr (!std::same_as<Layout, distributed>) {
    return row_path::direct;
  } else {
    switch (scratch_->mail.mode) {
      case detail::mailbox::state::unknown: return row_path::undecided;
      case detail::mailbox::state::off: return row_path::nccl;
      default: return scratch_->mail.copy ? row_path::copy : row_path::put;
    }
  }
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
template <class Index>
void tensor<T, Location, Layout, Mapping>::gather_dispatch(Index const* idx, std::size_t n, T* out, cudaStream_t s)
{
  auto& comm   = *comm_;
  auto& sc     = *scratch_;
  // The last call's mailbox reads (joined into its stream before it ended; the caller's
  // scratch_use waits for that end) come before peers' writes of this call, which follow this
  // rank's keys.
  // The order inside each owner's group does not matter here: every row finds its place by p.order.
  auto const p = detail::plan_dispatch_device(comm, map_ref(), idx, n, sc, s, false);
  std::size_t const rb = row_bytes();
  auto const world     = static_cast<std::size_t>(comm.size());
  auto const me        = static_cast<std::size_t>(comm.rank());
  bool const put       = detail::mailbox_ready(comm, sc, p.most_remote * rb);
  bool const copy      = put && sc.mail.copy;  // gathered here, then copied into the mailboxes
  // Rows this rank owns are served in place; only the other ranks' share crosses.
  auto remote_send = p.send_counts;  // keys out = rows back in
  auto remote_recv = p.recv_counts;  // keys in = rows out
  remote_send[me]  = 0;
  remote_recv[me]  = 0;
  auto const key_at  = detail::block_starts(p.send_counts);  // in p.send_keys and p.order
  auto const back_at = detail::block_starts(remote_send);    // in back (the mailbox when put)
  auto const recv_at = detail::block_starts(remote_recv);    // in recv_keys and rows_out
  detail::carver c;
  auto const o_keys  = c.add<Index>(recv_at[world]);
  auto const o_flags = c.add<unsigned>(2 * world);
  auto const o_rows  = c.add<std::byte>(put && !copy ? 0 : recv_at[world] * rb);
  auto const o_back  = c.add<std::byte>(put ? 0 : back_at[world] * rb);
  std::byte* base    = sc.b.reserve(c.total(), s);
  auto* recv_keys    = c.take<Index>(base, o_keys);
  auto* flags        = c.take<unsigned>(base, o_flags);
  auto* rows_out     = c.take<std::byte>(base, o_rows);
  auto* back         = !put || sc.mail.at.empty() ? c.take<std::byte>(base, o_back) : sc.mail.at[me];
  auto const local   = mem_.local_view();
  detail::local_rows const table{local.data, local.entries, stride_bytes()};
  detail::packed_rows const dst{reinterpret_cast<std::byte*>(out), rb};

  // 1. Keys to their owners (not to this rank).
  {
    std::vector<communicator::send_part> sends;
    std::vector<communicator::recv_part> recvs;
    for (std::size_t q = 0; q < world; ++q) {
      sends.push_back({static_cast<int>(q), p.send_keys + key_at[q], remote_send[q] * sizeof(Index)});
      recvs.push_back({static_cast<int>(q), recv_keys + recv_at[q], remote_recv[q] * sizeof(Index)});
    }
    comm.send_recv(sends, recvs, cuda::stream_ref{s});
  }
  // 2. Pipelined rows in pieces (both ends cut a peer's rows alike, see `pieces_of`). This stream
  //    gathers piece k of every peer's request — into the peer's mailbox, or into a send buffer
  //    that NCCL moves on the side stream — while the side stream puts piece k - 1 in the
  //    caller's order. While pieces are in flight the kernels get grids of a few blocks per SM
  //    at most (a smaller grid, not a per-SM limit): the gather kernel's blocks stay until its
  //    rows are done, and the other streams' blocks (NCCL's among them) need room beside them.
  int const room = 3;
  // Put kernels wait on NVLink stores, not on memory: they take every slot (measured on 2 H200s,
  // 1M keys: room 3 -> 8 took 1.27 -> 1.15 ms), and the own rows and the reordering, which
  // hide behind them, take little (bench/NOTES.md).
  int const put_room = 8, side_room = 4, own_room = 1;
  int pieces = 0;
  for (std::size_t q = 0; q < world; ++q) {
    pieces = std::max({pieces, detail::pieces_of(remote_send[q], rb), detail::pieces_of(remote_recv[q], rb)});
  }
  cudaStream_t const side = pieces > 0 || put ? sc.side.get() : nullptr;
  if (put && pieces > 0) { WM_CUDA_TRY(cudaMemsetAsync(flags, 0, 2 * world * sizeof(unsigned), s)); }
  // 3. This rank's own rows, straight from the table to their output rows: on the aux stream
  //    beside the pieces when kernels put the rows (they wait on NVLink, not on memory); after
  //    the pieces on this stream otherwise, while the last ones cross.
  bool const own_beside = put && !copy && pieces > 0;
  cudaStream_t const own = own_beside ? sc.side.aux() : s;
  if (own != s) {
    WM_CUDA_TRY(cudaEventRecord(sc.side.forked(), s));
    WM_CUDA_TRY(cudaStreamWaitEvent(own, sc.side.forked(), 0));
  }
  if (own_beside || pieces == 0) {
    detail::launch_gather(table, p.send_keys + key_at[me], p.order + key_at[me], p.send_counts[me], dst, rb, stride_bytes(),
                          sc.err, own, false, pieces > 0 ? own_room : 8);
  }
  if (own != s) { WM_CUDA_TRY(cudaEventRecord(sc.side.joined(), own)); }
  // Piece k of every peer's answer, arrived in `back`, to the caller's order: back row j of
  // peer q's block is output row order[key_at[q] + j].
  auto const reorder = [&](int k, cudaStream_t on, int blocks_per_sm) {
    for (std::size_t q = 0; q < world; ++q) {
      auto const in_piece    = detail::piece_of(remote_send[q], rb, k);
      std::size_t const n_in = in_piece.last - in_piece.first;
      if (n_in == 0) { continue; }
      detail::launch_gather(detail::local_rows{back + (back_at[q] + in_piece.first) * rb, n_in, rb},
                            static_cast<std::size_t const*>(nullptr), p.order + key_at[q] + in_piece.first, n_in, dst, rb, rb,
                            sc.err, on, false, blocks_per_sm);
    }
  };
  struct copy_part {
    std::byte* to;
    std::byte const* from;
    std::size_t bytes;
  };
  for (int k = 0; k < pieces; ++k) {
    std::vector<communicator::send_part> sends;
    std::vector<communicator::recv_part> recvs;
    std::vector<copy_part> copies;
    for (std::size_t i = 1; i <= world; ++i) {
      std::size_t const q = (me + i) % world;  // ranks start with different owners
      auto const out_piece = detail::piece_of(remote_recv[q], rb, k);
      auto const in_piece  = detail::piece_of(remote_send[q], rb, k);
      std::size_t const n_out = out_piece.last - out_piece.first;
      std::size_t const n_in  = in_piece.last - in_piece.first;
      std::byte* const mail = put ? sc.mail.at[q] + (p.mail_offsets[q] + out_piece.first) * rb : nullptr;
      std::byte* const rows = put && !copy ? mail : rows_out + (recv_at[q] + out_piece.first) * rb;
      if (n_out > 0) {
        detail::launch_gather(table, recv_keys + recv_at[q] + out_piece.first, static_cast<std::size_t const*>(nullptr), n_out,
                              detail::packed_rows{rows, rb}, rb, stride_bytes(), sc.err, s, false, put ? put_room : room);
        if (copy) { copies.push_back({mail, rows, n_out * rb}); }
      }
      if (put) {
        // Only a flag crosses NCCL: the rows are in q's mailbox once this stream's kernel is done.
        sends.push_back({static_cast<int>(q), flags + q, n_out > 0 ? sizeof(unsigned) : 0});
        recvs.push_back({static_cast<int>(q), flags + world + q, n_in > 0 ? sizeof(unsigned) : 0});
      } else {
        sends.push_back({static_cast<int>(q), rows, n_out * rb});
        recvs.push_back({static_cast<int>(q), back + (back_at[q] + in_piece.first) * rb, n_in * rb});
      }
    }
    WM_CUDA_TRY(cudaEventRecord(sc.side.ready(k), s));
    if (copy) {
      // The copy engines move piece k over NVLink (aux stream) while this stream gathers the next.
      cudaStream_t const ce = sc.side.aux();
      WM_CUDA_TRY(cudaStreamWaitEvent(ce, sc.side.ready(k), 0));
      for (auto const& part : copies) { WM_CUDA_TRY(cudaMemcpyAsync(part.to, part.from, part.bytes, cudaMemcpyDeviceToDevice, ce)); }
      WM_CUDA_TRY(cudaEventRecord(sc.side.copied(k), ce));
      WM_CUDA_TRY(cudaStreamWaitEvent(side, sc.side.copied(k), 0));
    } else {
      WM_CUDA_TRY(cudaStreamWaitEvent(side, sc.side.ready(k), 0));
    }
    comm.send_recv(sends, recvs, cuda::stream_ref{side});
    if (put) { reorder(k, side, side_room); }  // 4 (put): on the side stream, beside the next piece
    WM_CUDA_TRY(cudaEventRecord(sc.side.arrived(k), side));
  }
  // 3 (NCCL, copy). This rank's own rows while the last pieces cross.
  if (pieces > 0 && !own_beside) {
    detail::launch_gather(table, p.send_keys + key_at[me], p.order + key_at[me], p.send_counts[me], dst, rb, stride_bytes(),
                          sc.err, s, false, room);
  }
  if (put) {
    if (pieces > 0) { WM_CUDA_TRY(cudaStreamWaitEvent(s, sc.side.arrived(pieces - 1), 0)); }
    if (own != s) { WM_CUDA_TRY(cudaStreamWaitEvent(s, sc.side.joined(), 0)); }
  } else {
    // 4 (NCCL). Arrived pieces to the caller's order, on this stream.
    for (int k = 0; k < pieces; ++k) {
      WM_CUDA_TRY(cudaStreamWaitEvent(s, sc.side.arrived(k), 0));
      reorder(k, s, k + 1 < pieces ? room : 8);
    }
  }
  // Invalid indices sit at the end of the grouped order: zero rows (the error is already set).
  detail::launch_gather(detail::local_rows{back, 0, rb}, static_cast<std::size_t const*>(nullptr), p.order + p.n_sent,
                        n - p.n_sent, dst, rb, rb, sc.err, s);
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
template <class Index>
void tensor<T, Location, Layout, Mapping>::scatter_dispatch(Index const* idx, std::size_t n, T const* values, cudaStream_t s)
{
  auto& comm   = *comm_;
  auto const p = detail::plan_dispatch_device(comm, map_ref(), idx, n, *scratch_, s);
  std::size_t const rb = row_bytes();
  std::size_t cub_bytes = 0;
  WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<Index const*>(nullptr),
                                              static_cast<Index*>(nullptr), static_cast<std::size_t const*>(nullptr),
                                              static_cast<std::size_t*>(nullptr), std::max<std::size_t>(p.n_recv, 1), 0,
                                              int{sizeof(Index) * 8}, s));
  detail::carver c;
  auto const o_send = c.add<std::byte>(p.n_sent * rb);
  auto const o_keys = c.add<Index>(p.n_recv);
  auto const o_vals = c.add<std::byte>(p.n_recv * rb);
  auto const o_pos  = c.add<std::size_t>(p.n_recv);
  auto const o_sk   = c.add<Index>(p.n_recv);
  auto const o_sp   = c.add<std::size_t>(p.n_recv);
  auto const o_cub  = c.add<std::byte>(cub_bytes);
  std::byte* base   = scratch_->b.reserve(c.total(), s);
  auto* send_vals   = c.take<std::byte>(base, o_send);
  auto* recv_keys   = c.take<Index>(base, o_keys);
  auto* recv_vals   = c.take<std::byte>(base, o_vals);
  auto* pos         = c.take<std::size_t>(base, o_pos);
  auto* sorted_keys = c.take<Index>(base, o_sk);
  auto* sorted_pos  = c.take<std::size_t>(base, o_sp);

  // Value rows in send order, then keys and values to their owners. The caller's values need
  // only be aligned for T (e.g. an odd-element slice of half values): no vector wider than both
  // the row size and their address allows.
  std::uintptr_t const values_alignment = std::gcd(static_cast<std::uintptr_t>(rb), reinterpret_cast<std::uintptr_t>(values));
  detail::launch_gather(detail::local_rows{reinterpret_cast<std::byte*>(const_cast<T*>(values)), n, rb}, p.order,
                        static_cast<std::size_t const*>(nullptr), p.n_sent, detail::packed_rows{send_vals, rb}, rb,
                        values_alignment, scratch_->err, s);
  comm.all_to_all_v(p.send_keys, std::span<std::size_t const>{p.send_counts}, recv_keys,
                    std::span<std::size_t const>{p.recv_counts}, cuda::stream_ref{s});
  auto const recv_bytes = detail::scaled(p.recv_counts, rb);
  auto const send_bytes = detail::scaled(p.send_counts, rb);
  comm.all_to_all_v(send_vals, std::span<std::size_t const>{send_bytes}, recv_vals, std::span<std::size_t const>{recv_bytes},
                    cuda::stream_ref{s});
  if (p.n_recv == 0) { return; }
  // Owner side: stable sort by row; the last of each run (highest rank, then last position) wins.
  detail::iota_kernel<<<detail::elementwise_blocks(p.n_recv), 256, 0, s>>>(pos, p.n_recv);
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(c.take<std::byte>(base, o_cub), cub_bytes, recv_keys, sorted_keys, pos,
                                              sorted_pos, p.n_recv, 0, int{sizeof(Index) * 8}, s));
  auto const local = mem_.local_view();
  detail::launch_scatter(detail::local_rows{local.data, local.entries, stride_bytes()}, sorted_keys, sorted_pos, p.n_recv,
                         detail::packed_rows{recv_vals, rb}, rb, stride_bytes(), scratch_->err, s);
}

// ---- files ----------------------------------------------------------------------------------
//
// Files hold packed rows (cols elements each) in global row order, whatever the layout, mapping,
// stride or rank count: rank r stores and loads the rows [begin, end) of the block plan of
// `rows` over the ranks, moving them in bounded pieces through gather/scatter. Every rank runs
// the same number of pieces (the distributed layout's gather/scatter are collective); a file
// error on one rank is reported on every rank at the end.

namespace detail {

/// Fills @p out with first, first + 1, ... (n values).
template <class Index>
__global__ void iota_from_kernel(Index* out, std::size_t n, std::size_t first)
{
  for (std::size_t j = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; j < n; j += gridDim.x * std::size_t{blockDim.x}) {
    out[j] = static_cast<Index>(first + j);
  }
}

/// What moving rows between files and a tensor needs, one staging piece at a time: pinned host
/// and device rows, the rows' global indices, and a stream of its own (freed however load or
/// store ends).
struct row_piece_buffers {
  std::size_t piece{};  // rows per piece
  std::byte* host{};
  std::byte* dev{};
  std::int64_t* idx{};
  cudaStream_t stream{};
  explicit row_piece_buffers(std::size_t row_bytes) : piece{std::max<std::size_t>(1, staging_buffer::piece / row_bytes)}
  {
    WM_CUDA_TRY(cudaMallocHost(&host, piece * row_bytes));
    WM_CUDA_TRY(cudaMalloc(&dev, piece * row_bytes));
    WM_CUDA_TRY(cudaMalloc(&idx, piece * sizeof(std::int64_t)));
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  row_piece_buffers(row_piece_buffers const&)            = delete;
  row_piece_buffers& operator=(row_piece_buffers const&) = delete;
  ~row_piece_buffers()
  {
    (void)cudaFreeHost(host);
    (void)cudaFree(dev);
    (void)cudaFree(idx);
    if (stream != nullptr) { (void)cudaStreamDestroy(stream); }
  }
  /// Indices first .. first + n - 1 into idx.
  void number_rows(std::size_t first, std::size_t n) const
  {
    if (n == 0) { return; }
    iota_from_kernel<<<elementwise_blocks(n), 256, 0, stream>>>(idx, n, first);
    WM_CHECK_LAUNCH();
  }
};

/// Every rank learns whether a rank's file work failed (collective); @p failure: this rank's.
inline void agree_on_failure(communicator& comm, char const* what, std::string const& failure)
{
  collective_step<io_error>(comm, what, [&] {
    if (!failure.empty()) { throw io_error{failure}; }
  });
}

/**
 * Calls f(first, n) for the pieces of this rank's share of rows [0, rows) in global order (file
 * order: a block partition), `piece` rows at a time; every rank makes the same number of calls
 * (n = 0 once its share is done), so f may run collectives.
 */
template <class F>
void for_each_row_piece(std::size_t rows, communicator const& comm, std::size_t piece, F&& f)
{
  block_partition const plan{rows, comm.size()};
  std::size_t const begin = plan.begin(comm.rank());
  std::size_t const end   = plan.end(comm.rank());
  for (std::size_t it = 0, pieces = row_pieces(rows, comm.size(), piece); it < pieces; ++it) {
    std::size_t const first = begin + it * piece;
    f(first, first < end ? std::min(piece, end - first) : std::size_t{0});
  }
}

}  // namespace detail

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
void tensor<T, Location, Layout, Mapping>::load(std::span<std::filesystem::path const> files)
{
  auto& comm = *comm_;
  comm.expect_same("tensor.load", files.size());
  std::size_t const rb = row_bytes();
  std::vector<std::uint64_t> sizes;
  detail::collective_step<io_error>(comm, "tensor load (checking files)",
                                    [&] { sizes = detail::checked_sizes(files, rows_ * rb, rb); });
  detail::row_piece_buffers const buf{rb};
  std::string failure;
  detail::for_each_row_piece(rows_, comm, buf.piece, [&](std::size_t first, std::size_t n) {
    if (!failure.empty()) { n = 0; }  // keep taking part in the collective scatters
    try {
      if (n > 0) { detail::read_concatenated(files, sizes, first * rb, (first + n) * rb, buf.host); }
    } catch (std::exception const& e) {
      failure = e.what();
      n       = 0;
    }
    if (n > 0) { WM_CUDA_TRY(cudaMemcpyAsync(buf.dev, buf.host, n * rb, cudaMemcpyHostToDevice, buf.stream)); }
    buf.number_rows(first, n);
    scatter(std::span<std::int64_t const>{buf.idx, n}, reinterpret_cast<T const*>(buf.dev), cuda::stream_ref{buf.stream});
  });
  detail::agree_on_failure(comm, "tensor load (reading)", failure);
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
void tensor<T, Location, Layout, Mapping>::store(std::span<std::filesystem::path const> files)
{
  auto& comm = *comm_;
  comm.expect_same("tensor.store", files.size());
  std::size_t const rb = row_bytes();
  detail::unique_fd fd;
  detail::collective_step<io_error>(comm, "tensor store (creating files)", [&] {
    WM_EXPECTS(files.size() == static_cast<std::size_t>(comm.size()),
               "store needs one file per rank (" + std::to_string(comm.size()) + "), got " + std::to_string(files.size()));
    auto const& f = files[static_cast<std::size_t>(comm.rank())];
    fd.reset(::open(f.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd.valid()) { throw io_error{"cannot create '" + f.string() + "': " + detail::errno_text()}; }
  });
  detail::row_piece_buffers const buf{rb};
  std::string failure;
  detail::for_each_row_piece(rows_, comm, buf.piece, [&](std::size_t first, std::size_t n) {
    buf.number_rows(first, n);
    gather(std::span<std::int64_t const>{buf.idx, n}, reinterpret_cast<T*>(buf.dev), cuda::stream_ref{buf.stream});
    if (n > 0 && failure.empty()) {
      WM_CUDA_TRY(cudaMemcpy(buf.host, buf.dev, n * rb, cudaMemcpyDeviceToHost));
      if (!detail::write_all(fd.get(), buf.host, n * rb)) {
        failure = "writing '" + files[static_cast<std::size_t>(comm.rank())].string() + "': " + detail::errno_text();
      }
    }
  });
  if (failure.empty() && ::close(fd.release()) != 0) { failure = "closing the file: " + detail::errno_text(); }
  detail::agree_on_failure(comm, "tensor store (writing)", failure);
}

template <class T, location Location, layout Layout, mapping Mapping>
  requires std::is_trivially_copyable_v<T>
std::vector<std::filesystem::path> tensor<T, Location, Layout, Mapping>::store(std::filesystem::path const& prefix)
{
  auto files = memory<Location, Layout>::part_files(prefix, comm_->size());
  store(std::span<std::filesystem::path const>{files});
  return files;
}

}  // namespace wm
