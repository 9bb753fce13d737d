// Bodies of wm::embedding (declared in <wm/embedding.cuh>): initialization, the gradient
// dispatch to owners, the duplicate sum and the fused optimizer kernel; checkpoints in
// checkpoint.cuh.
#pragma once

#include <wm/detail/tensor/tensor.cuh>
#include <wm/embedding.cuh>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>

namespace wm {

WM_HOST_DEVICE inline float embedding_init::value(std::size_t row, std::size_t col, std::size_t dim) const noexcept
{
  if (how == kind::zeros) { return 0.0f; }
  auto hash = [](std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  std::uint64_t const z  = hash(seed ^ hash(row * dim + col));
  float const u1         = (static_cast<float>(z >> 40) + 1.0f) * (1.0f / 16777216.0f);  // (0, 1]
  if (how == kind::uniform) { return a + (b - a) * u1; }
  float const u2 = static_cast<float>(hash(z) >> 40) * (1.0f / 16777216.0f);
  return a + b * sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795864f * u2);
}

namespace detail {

template <class T>
[[nodiscard]] __device__ inline float to_float(T x)
{
  return static_cast<float>(x);
}
template <class T>
[[nodiscard]] __device__ inline T from_float(float x)
{
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return static_cast<T>(x);
  }
}

/// Global row of local row l: first + l * step (block: first row, 1; cyclic: rank, world).
struct local_rows_map {
  std::size_t first;
  std::size_t step;
};

template <class T>
__global__ void init_rows_kernel(matrix_view<T> w, embedding_init init, local_rows_map map)
{
  std::size_t const n = w.rows * w.cols;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += gridDim.x * std::size_t{blockDim.x}) {
    std::size_t const l = i / w.cols;
    std::size_t const j = i % w.cols;
    w(l, j)             = from_float<T>(init.value(map.first + l * map.step, j, w.cols));
  }
}

template <class T>
__global__ void fill_rows_kernel(matrix_view<T> v, T value)
{
  std::size_t const n = v.rows * v.cols;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += gridDim.x * std::size_t{blockDim.x}) {
    v(i / v.cols, i % v.cols) = value;
  }
}

/// V consecutive values of T, loaded and stored as one access.
template <class T, int V>
struct alignas(sizeof(T) * V) vec_of {
  T v[V];
};

/**
 * Gradient sums of long runs of equal keys (skewed batches: one hot row can collect most of a
 * batch). A run longer than `long_run` is cut into segments of at most `segment` sorted
 * gradients; each segment is summed by one block, and the run's update sums its segments in
 * order. Sums depend only on the sorted order, never on timing.
 */
struct long_runs {
  int long_run;       // runs longer than this use segments
  int segment;        // gradients per segment
  int* count;         // segments made (device)
  int* first;         // first segment of run u (long runs only)
  int* seg_begin;     // segment -> first sorted position
  int* seg_len;       // segment -> gradients in it
  float* sums;        // segment -> dim floats
  std::size_t bound;  // most segments a batch can make
  [[nodiscard]] WM_HOST_DEVICE int segments(int len) const { return (len + segment - 1) / segment; }
};

/// Runs of equal sorted keys: run u is [offsets[u], offsets[u + 1]), the last one ends at m.
struct runs_view {
  int const* offsets;
  int const* count;  // device
  int m;
  [[nodiscard]] __device__ int end(int u, int runs) const { return u + 1 < runs ? offsets[u + 1] : m; }
};

/// Selects the first position of each run of equal sorted keys.
struct run_head {
  std::uint32_t const* keys;
  [[nodiscard]] __device__ bool operator()(int i) const { return i == 0 || keys[i] != keys[i - 1]; }
};

/// One run of equal sorted keys, as the update reads it: one 16-byte load per row.
struct alignas(16) run_desc {
  std::uint32_t key;  // local row
  int pos0;           // position of its first gradient in the caller's batch
  int off;            // first sorted position
  int len;            // gradients in the run (0: no run)
};

/// Describes every run and cuts the long ones into segments (the order of runs in the segment
/// list does not matter). A template only so that every translation unit may define it.
template <class Runs>
__global__ void describe_runs_kernel(long_runs lr, Runs rv, std::uint32_t const* sorted_keys, int const* sorted_pos, run_desc* desc)
{
  int const runs     = *rv.count;
  int const* offsets = rv.offsets;
  for (int u = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); u < runs; u += static_cast<int>(gridDim.x * blockDim.x)) {
    int const off = offsets[u];
    int const len = rv.end(u, runs) - off;
    desc[u]       = {sorted_keys[off], sorted_pos[off], off, len};
    if (len <= lr.long_run) { continue; }
    int const n    = lr.segments(len);
    int const base = atomicAdd(lr.count, n);
    lr.first[u]    = base;
    for (int q = 0; q < n; ++q) {
      lr.seg_begin[base + q] = off + q * lr.segment;
      lr.seg_len[base + q]   = min(lr.segment, len - q * lr.segment);
    }
  }
}

/// One block per segment: rows r, r + R, ... are summed by row group r; groups combine in order.
template <class T, int V>
__global__ void __launch_bounds__(256) sum_segments_kernel(long_runs lr, int const* sorted_pos, T const* grads, std::size_t dim, int group)
{
  __shared__ float part[256 * V];
  int const lane = static_cast<int>(threadIdx.x) % group;
  int const r    = static_cast<int>(threadIdx.x) / group;
  int const R    = static_cast<int>(blockDim.x) / group;
  int const segs = *lr.count;
  for (int seg = static_cast<int>(blockIdx.x); seg < segs; seg += static_cast<int>(gridDim.x)) {
    int const begin = lr.seg_begin[seg];
    int const len   = lr.seg_len[seg];
    for (std::size_t c0 = 0; c0 < dim; c0 += static_cast<std::size_t>(group) * V) {
      std::size_t const j = c0 + static_cast<std::size_t>(lane) * V;
      float acc[V]        = {};
      if (j < dim) {
        for (int q = r; q < len; q += R) {
          auto const g = *reinterpret_cast<vec_of<T, V> const*>(grads + static_cast<std::size_t>(sorted_pos[begin + q]) * dim + j);
#pragma unroll
          for (int e = 0; e < V; ++e) { acc[e] += to_float(g.v[e]); }
        }
      }
#pragma unroll
      for (int e = 0; e < V; ++e) { part[threadIdx.x * V + e] = acc[e]; }
      __syncthreads();
      if (r == 0 && j < dim) {
        for (int q = 1; q < R; ++q) {
#pragma unroll
          for (int e = 0; e < V; ++e) { acc[e] += part[(q * group + lane) * V + e]; }
        }
#pragma unroll
        for (int e = 0; e < V; ++e) { lr.sums[static_cast<std::size_t>(seg) * dim + j + static_cast<std::size_t>(e)] = acc[e]; }
      }
      __syncthreads();
    }
  }
}

/**
 * One group of lanes per unique row, U rows per group at a time: sums each row's gradients
 * (float), reads its weight and state once, applies the optimizer, writes them once; each lane
 * moves V values per access. A row's loads wait on its run descriptor (one 16-byte load); the
 * next round's descriptors are loaded before this round's rows, so a row's weight, state and
 * first gradient wait on no index load of their own (Adam's per-row step count and the
 * positions of further duplicates still do). The run count is read from device memory (no host
 * round trip). Nothing is written when *abort is set (an invalid index was found).
 */
template <class T, int V, class Opt>
__global__ void __launch_bounds__(256, Opt::states >= 1 ? 4 : 3) update_rows_kernel(Opt opt,
                                                          matrix_view<T> w,
                                                          matrix_view<float> st,
                                                          std::int64_t* steps,
                                                          std::int64_t global_step,
                                                          run_desc const* desc,
                                                          int const* run_count,
                                                          int const* sorted_pos,
                                                          T const* grads,
                                                          long_runs lr,
                                                          float lr_rate,
                                                          int group,
                                                          unsigned const* abort)
{
  if (*abort != 0) { return; }
  constexpr int S          = Opt::states > 0 ? Opt::states : 1;
  // Rows per group in flight: two for stateless SGD; one where state rows fill the registers
  // (two made Adam 8% slower; with the next descriptors held, two spilled for AdaGrad).
  constexpr int U          = Opt::states >= 1 ? 1 : 2;
  std::size_t const dim    = w.cols;
  std::size_t const tid    = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  std::size_t const groups = gridDim.x * std::size_t{blockDim.x} / static_cast<std::size_t>(group);
  std::size_t const round  = groups * U;  // runs one round of the grid covers
  int const lane           = static_cast<int>(tid % static_cast<std::size_t>(group));
  unsigned const lane_base = (threadIdx.x % 32) / static_cast<unsigned>(group) * static_cast<unsigned>(group);
  unsigned const mask      = (group == 32 ? 0xffffffffu : ((1u << group) - 1u)) << lane_base;
  auto const runs          = static_cast<std::size_t>(*run_count);
  using wvec               = vec_of<T, V>;
  using fvec               = vec_of<float, V>;
  auto desc_of = [&](std::size_t u) { return u < runs ? desc[u] : run_desc{0u, 0, 0, 0}; };
  std::size_t const u_first = tid / static_cast<std::size_t>(group);
  run_desc cur[U];
#pragma unroll
  for (int r = 0; r < U; ++r) { cur[r] = desc_of(u_first + static_cast<std::size_t>(r) * groups); }
  for (std::size_t u0 = u_first; u0 < runs; u0 += round) {
    run_desc next[U];
#pragma unroll
    for (int r = 0; r < U; ++r) { next[r] = desc_of(u0 + round + static_cast<std::size_t>(r) * groups); }
    std::int64_t t[U];
#pragma unroll
    for (int r = 0; r < U; ++r) { t[r] = steps != nullptr && cur[r].len > 0 ? steps[cur[r].key] + 1 : global_step; }
    for (std::size_t j = static_cast<std::size_t>(lane) * V; j < dim; j += static_cast<std::size_t>(group) * V) {
      wvec wv[U];
      fvec s[U][S];
      float g[U][V];
#pragma unroll
      for (int r = 0; r < U; ++r) {
#pragma unroll
        for (int e = 0; e < V; ++e) { g[r][e] = 0.0f; }
        if (cur[r].len > 0) {
          wv[r] = *reinterpret_cast<wvec const*>(&w(cur[r].key, j));
#pragma unroll
          for (int k = 0; k < Opt::states; ++k) {
            s[r][k] = *reinterpret_cast<fvec const*>(&st(cur[r].key, static_cast<std::size_t>(k) * dim + j));
          }
        }
      }
      // The first gradient of every short run first (most runs have one), then the rest.
#pragma unroll
      for (int r = 0; r < U; ++r) {
        if (cur[r].len > 0 && cur[r].len <= lr.long_run) {
          auto const p = *reinterpret_cast<wvec const*>(grads + static_cast<std::size_t>(cur[r].pos0) * dim + j);
#pragma unroll
          for (int e = 0; e < V; ++e) { g[r][e] += to_float(p.v[e]); }
        }
      }
#pragma unroll
      for (int r = 0; r < U; ++r) {
        if (cur[r].len > lr.long_run) {
          int const first = lr.first[u0 + static_cast<std::size_t>(r) * groups];
          for (int q = 0; q < lr.segments(cur[r].len); ++q) {
            auto const p = *reinterpret_cast<fvec const*>(lr.sums + static_cast<std::size_t>(first + q) * dim + j);
#pragma unroll
            for (int e = 0; e < V; ++e) { g[r][e] += p.v[e]; }
          }
        } else {
#pragma unroll 4
          for (int q = 1; q < cur[r].len; ++q) {
            auto const p = *reinterpret_cast<wvec const*>(grads + static_cast<std::size_t>(sorted_pos[cur[r].off + q]) * dim + j);
#pragma unroll
            for (int e = 0; e < V; ++e) { g[r][e] += to_float(p.v[e]); }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < U; ++r) {
        if (cur[r].len == 0) { continue; }
#pragma unroll
        for (int e = 0; e < V; ++e) {
          float x = to_float(wv[r].v[e]);
          float se[S];
#pragma unroll
          for (int k = 0; k < Opt::states; ++k) { se[k] = s[r][k].v[e]; }
          opt.update(x, g[r][e], se, update_step<float>{lr_rate, t[r]});
          wv[r].v[e] = from_float<T>(x);
#pragma unroll
          for (int k = 0; k < Opt::states; ++k) { s[r][k].v[e] = se[k]; }
        }
        *reinterpret_cast<wvec*>(&w(cur[r].key, j)) = wv[r];
#pragma unroll
        for (int k = 0; k < Opt::states; ++k) {
          *reinterpret_cast<fvec*>(&st(cur[r].key, static_cast<std::size_t>(k) * dim + j)) = s[r][k];
        }
      }
    }
    __syncwarp(mask);  // every lane of the group has read steps[key]
    if (steps != nullptr && lane == 0) {
#pragma unroll
      for (int r = 0; r < U; ++r) {
        if (cur[r].len > 0) { steps[cur[r].key] = t[r]; }
      }
    }
#pragma unroll
    for (int r = 0; r < U; ++r) { cur[r] = next[r]; }
  }
}

/// The arguments of the two owner-side kernels, launched with V values per access.
template <class T, class Opt>
struct update_launch {
  Opt opt;
  matrix_view<T> w;
  matrix_view<float> st;
  std::int64_t* steps;
  std::int64_t step;
  run_desc const* desc;
  int const* run_count;
  int const* sorted_pos;
  T const* grads;
  long_runs longs;
  float lr;
  int group;
  int blocks;
  unsigned const* abort;
  template <int V>
  void run(cudaStream_t s) const
  {
    static int const sms = sm_count();
    sum_segments_kernel<T, V><<<sms * 4, 256, 0, s>>>(longs, sorted_pos, grads, w.cols, group);
    WM_CHECK_LAUNCH();
    // As many blocks as fit at once: the loop strides over the runs (no second wave).
    static int const resident = [] {
      int per_sm = 0;
      WM_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, update_rows_kernel<T, V, Opt>, 256, 0));
      return std::max(per_sm, 1) * sm_count();
    }();
    int const grid = std::max(1, std::min(blocks, resident));
    update_rows_kernel<T, V><<<grid, 256, 0, s>>>(opt, w, st, steps, step, desc, run_count, sorted_pos, grads, longs,
                                                    lr, group, abort);
    WM_CHECK_LAUNCH();
  }
};

/// Keys as 32-bit local rows (the sort moves half the bytes of 64-bit ones) and positions
/// 0..n-1; sets *err if a key is negative or not below @p rows (its 32-bit key is then 0).
template <class Index>
__global__ void positions_kernel(Index const* keys, std::size_t n, std::size_t rows, std::uint32_t* keys32, int* pos, unsigned* err)
{
  for (std::size_t j = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; j < n; j += gridDim.x * std::size_t{blockDim.x}) {
    Index const k = keys[j];
    bool const ok = valid_index(k, rows);
    keys32[j]     = ok ? static_cast<std::uint32_t>(k) : 0u;
    pos[j]        = static_cast<int>(j);
    if (!ok) { atomicOr(err, 1u); }
  }
}

struct embedding_scratch {
  tensor_scratch plan;
  workspace exchange;  // keys and gradients on their way to the owners
  workspace owner;     // the owner's sort, runs and segment sums
  explicit embedding_scratch(int world) : plan{world} {}
};

/**
 * Checks the table's shape before anything is allocated (collective) and returns @p rows. The
 * update sorts local rows as 32-bit keys: at most 2^32 - 1 rows per rank. Ranks first agree on
 * rows and dim, so the bound, computed from them and the rank count, fails on every rank or none.
 */
[[nodiscard]] inline std::size_t embedding_rows(communicator& comm, std::size_t rows, std::size_t dim)
{
  comm.expect_same("embedding", mix64(rows, dim));
  auto const world = static_cast<std::size_t>(comm.size());
  WM_EXPECTS(rows / world + (rows % world != 0 ? 1 : 0) <= std::size_t{0xffffffffu},
             "embedding: " + std::to_string(rows) + " rows over " + std::to_string(world) +
               " ranks puts more than 2^32 - 1 rows on one rank; use more ranks");
  return rows;
}

template <class M>
[[nodiscard]] local_rows_map local_map_of(communicator const& comm, std::size_t first_block_row)
{
  if constexpr (std::is_same_v<M, cyclic>) {
    return {static_cast<std::size_t>(comm.rank()), static_cast<std::size_t>(comm.size())};
  } else {
    return {first_block_row, 1};
  }
}

}  // namespace detail

#define WM_EMBEDDING_TEMPLATE                                                                         \
  template <class T, cache_policy CachePolicy, optimizer_policy Optimizer, location Location, layout Layout, \
            mapping Mapping>
#define WM_EMBEDDING embedding<T, CachePolicy, Optimizer, Location, Layout, Mapping>

WM_EMBEDDING_TEMPLATE
WM_EMBEDDING::embedding(communicator& comm, std::size_t rows, std::size_t dim, Optimizer optimizer, embedding_init init)
  : comm_{&comm},
    opt_{optimizer},
    weights_{comm, detail::embedding_rows(comm, rows, dim), dim},
    scratch_{std::make_unique<detail::embedding_scratch>(comm.size())}
{
  cudaStream_t const s = nullptr;
  auto const map       = detail::local_map_of<Mapping>(comm, weights_.storage().local_entry_range().begin);
  auto const w         = weights_.local_view();
  if (w.rows > 0) {
    detail::init_rows_kernel<<<detail::elementwise_blocks(w.rows * w.cols), 256, 0, s>>>(w, init, map);
    WM_CHECK_LAUNCH();
  }
  if constexpr (Optimizer::states > 0) {
    states_.emplace(comm, rows, static_cast<std::size_t>(Optimizer::states) * dim);
    auto const v = states_->local_view();
    if (v.rows > 0) {
      detail::fill_rows_kernel<<<detail::elementwise_blocks(v.rows * v.cols), 256, 0, s>>>(v, opt_.initial_state());
      WM_CHECK_LAUNCH();
    }
  }
  if (opt_.needs_steps()) {
    steps_.emplace(comm, rows, 1);
    auto const v = steps_->local_view();
    if (v.rows > 0) { WM_CUDA_TRY(cudaMemset(v.data, 0, v.rows * sizeof(std::int64_t))); }
  }
  WM_CUDA_TRY(cudaDeviceSynchronize());
  comm.barrier();  // every rank's rows are initialized before anyone gathers
}

WM_EMBEDDING_TEMPLATE
WM_EMBEDDING::embedding(embedding&&) noexcept = default;
WM_EMBEDDING_TEMPLATE
WM_EMBEDDING& WM_EMBEDDING::operator=(embedding&&) noexcept = default;
WM_EMBEDDING_TEMPLATE
WM_EMBEDDING::~embedding() = default;

WM_EMBEDDING_TEMPLATE
template <index_type Index>
void WM_EMBEDDING::apply_gradients(std::span<Index const> indices, T const* grads, float lr, cuda::stream_ref stream)
  requires sparse_optimizer<Optimizer>
{
  auto& comm           = *comm_;
  cudaStream_t const s = stream.get();
  std::size_t const n  = indices.size();
  WM_EXPECTS(n == 0 || (indices.data() != nullptr && grads != nullptr), "apply_gradients: null indices or gradients");
  detail::scratch_use const use{scratch_->plan, s};  // its workspaces, after the last call's
  std::size_t const rb        = dim() * sizeof(T);
  std::int64_t const step     = global_step_ + 1;
  auto const local            = weights_.local_view();
  unsigned* const err         = scratch_->plan.err;
  bool const one_rank         = comm.size() == 1;
  std::size_t const too_many  = std::size_t{1} << 31;

  // 1. The owner's batch: its local rows and one gradient row each. One rank owns every row:
  //    the caller's keys are its local rows (for both mappings) and are checked on the device.
  //    Several ranks: keys and gradients travel to their owners; bad keys are found first.
  Index const* keys = indices.data();
  T const* g        = grads;
  std::size_t m     = n;
  if (one_rank) {
    WM_EXPECTS(n < too_many, "apply_gradients: " + std::to_string(n) + " gradient rows in one call; split the batch below 2^31");
  } else {
    auto const p = detail::plan_dispatch_device(comm, weights_.device_mapping(), indices.data(), n, scratch_->plan, s);
    // Both checks from one all-gather, so that every rank throws the same error (a rank that
    // threw alone would leave the others waiting in the exchange below).
    struct batch_check {
      std::uint64_t invalid;  // indices outside the table
      std::uint64_t n_recv;   // gradient rows this rank would own
    };
    auto const seen = comm.all_gather(batch_check{static_cast<std::uint64_t>(n - p.n_sent), static_cast<std::uint64_t>(p.n_recv)});
    for (std::size_t r = 0; r < seen.size(); ++r) {
      if (seen[r].invalid != 0) {
        WM_CUDA_TRY(cudaMemsetAsync(err, 0, sizeof(unsigned), s));
        throw logic_error{"wm: apply_gradients: rank " + std::to_string(r) + " passed " + std::to_string(seen[r].invalid) +
                          " index(es) outside [0, " + std::to_string(rows()) + "); nothing was updated"};
      }
    }
    for (std::size_t r = 0; r < seen.size(); ++r) {
      WM_EXPECTS(seen[r].n_recv < too_many, "apply_gradients: rank " + std::to_string(r) + " would receive " +
                                              std::to_string(seen[r].n_recv) +
                                              " gradient rows in one call (all ranks' batches together); split the "
                                              "batches so that each owner receives fewer than 2^31");
    }
    // This rank's own share goes straight into its batch; only the other ranks' shares cross NCCL,
    // keys and gradients in one group.
    auto const me      = static_cast<std::size_t>(comm.rank());
    auto const key_at  = detail::block_starts(p.send_counts);  // in p.order and p.send_keys
    auto const recv_at = detail::block_starts(p.recv_counts);  // in the owner's batch
    std::size_t const own = p.send_counts[me];
    detail::carver c;
    auto const o_send  = c.add<std::byte>((p.n_sent - own) * rb);
    auto const o_keys  = c.add<Index>(p.n_recv);
    auto const o_grads = c.add<std::byte>(p.n_recv * rb);
    std::byte* base    = scratch_->exchange.reserve(c.total(), s);
    auto* send_grads   = c.take<std::byte>(base, o_send);
    auto* recv_keys    = c.take<Index>(base, o_keys);
    auto* recv_grads   = c.take<std::byte>(base, o_grads);
    detail::local_rows const caller{reinterpret_cast<std::byte*>(const_cast<T*>(grads)), n, rb};
    // The caller's rows start at grads, which need only be aligned for T (e.g. an odd-element
    // slice of half values): vectors no wider than both the row size and that address allows.
    std::uintptr_t const grads_alignment = std::gcd(static_cast<std::uintptr_t>(rb), reinterpret_cast<std::uintptr_t>(grads));
    auto pack = [&](std::size_t first, std::size_t count, std::byte* to) {
      detail::launch_gather(caller, p.order + first, static_cast<std::size_t const*>(nullptr), count,
                            detail::packed_rows{to, rb}, rb, grads_alignment, err, s);
    };
    pack(0, key_at[me], send_grads);  // peers before this rank, then those after it
    pack(key_at[me + 1], p.n_sent - key_at[me + 1], send_grads + key_at[me] * rb);
    pack(key_at[me], own, recv_grads + recv_at[me] * rb);
    if (own > 0) {
      WM_CUDA_TRY(cudaMemcpyAsync(recv_keys + recv_at[me], p.send_keys + key_at[me], own * sizeof(Index),
                                  cudaMemcpyDeviceToDevice, s));
    }
    std::vector<communicator::send_part> sends;
    std::vector<communicator::recv_part> recvs;
    for (std::size_t q = 0; q < p.send_counts.size(); ++q) {
      if (q == me) { continue; }
      std::size_t const sent_before = key_at[q] - (q > me ? own : 0);  // rows of send_grads before q's
      sends.push_back({static_cast<int>(q), p.send_keys + key_at[q], p.send_counts[q] * sizeof(Index)});
      sends.push_back({static_cast<int>(q), send_grads + sent_before * rb, p.send_counts[q] * rb});
      recvs.push_back({static_cast<int>(q), recv_keys + recv_at[q], p.recv_counts[q] * sizeof(Index)});
      recvs.push_back({static_cast<int>(q), recv_grads + recv_at[q] * rb, p.recv_counts[q] * rb});
    }
    comm.send_recv(sends, recvs, stream);
    keys = recv_keys;
    g    = reinterpret_cast<T const*>(recv_grads);
    m    = p.n_recv;
  }

  // 2. Owner side: sort (key, position) stably on the bits of the local row count, find the
  //    runs of equal rows, sum long runs in segments, then one fused update per run.
  if (m > 0) {
    int const mi   = static_cast<int>(m);
    int const bits = detail::row_bits(one_rank ? rows() : local.rows);
    // Runs of more than 128 gradients: segments of 128, so at most 2 m / 129 of them.
    detail::long_runs longs{128, 128, nullptr, nullptr, nullptr, nullptr, nullptr, 0};
    longs.bound = 2 * m / static_cast<std::size_t>(longs.long_run + 1) + 1;
    std::size_t cub_sort = 0, cub_select = 0;
    thrust::counting_iterator<int> const positions{0};
    WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(nullptr, cub_sort, static_cast<std::uint32_t const*>(nullptr), static_cast<std::uint32_t*>(nullptr),
                                                static_cast<int const*>(nullptr), static_cast<int*>(nullptr), mi, 0, bits, s));
    WM_CUDA_TRY(cub::DeviceSelect::If(nullptr, cub_select, positions, static_cast<int*>(nullptr), static_cast<int*>(nullptr), mi,
                                      detail::run_head{nullptr}, s));
    detail::carver c;
    auto const o_pos   = c.add<int>(m);
    auto const o_keys  = c.add<std::uint32_t>(m);
    auto const o_skeys = c.add<std::uint32_t>(m);
    auto const o_spos  = c.add<int>(m);
    auto const o_offs  = c.add<int>(m);
    auto const o_desc  = c.add<detail::run_desc>(m);
    auto const o_runs  = c.add<int>(2);  // runs, segments
    auto const o_first = c.add<int>(m);
    auto const o_sbeg  = c.add<int>(longs.bound);
    auto const o_slen  = c.add<int>(longs.bound);
    auto const o_sums  = c.add<float>(longs.bound * dim());
    auto const o_cub   = c.add<std::byte>(std::max(cub_sort, cub_select));
    std::byte* base    = scratch_->owner.reserve(c.total(), s);
    auto* pos          = c.take<int>(base, o_pos);
    auto* keys32       = c.take<std::uint32_t>(base, o_keys);
    auto* sorted_keys  = c.take<std::uint32_t>(base, o_skeys);
    auto* sorted_pos   = c.take<int>(base, o_spos);
    auto* offsets      = c.take<int>(base, o_offs);
    auto* desc         = c.take<detail::run_desc>(base, o_desc);
    auto* runs         = c.take<int>(base, o_runs);
    auto* temp         = c.take<std::byte>(base, o_cub);
    longs.count        = runs + 1;
    longs.first        = c.take<int>(base, o_first);
    longs.seg_begin    = c.take<int>(base, o_sbeg);
    longs.seg_len      = c.take<int>(base, o_slen);
    longs.sums         = c.take<float>(base, o_sums);
    detail::runs_view const rv{offsets, runs, mi};

    detail::positions_kernel<<<detail::elementwise_blocks(m), 256, 0, s>>>(keys, m, one_rank ? rows() : local.rows, keys32, pos, err);
    WM_CHECK_LAUNCH();
    WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(temp, cub_sort, keys32, sorted_keys, pos, sorted_pos, mi, 0, bits, s));
    WM_CUDA_TRY(cudaMemsetAsync(runs + 1, 0, sizeof(int), s));
    WM_CUDA_TRY(cub::DeviceSelect::If(temp, cub_select, positions, offsets, runs, mi, detail::run_head{sorted_keys}, s));
    detail::describe_runs_kernel<<<detail::elementwise_blocks(m), 256, 0, s>>>(longs, rv, sorted_keys, sorted_pos, desc);
    WM_CHECK_LAUNCH();

    matrix_view<float> st{};
    if (states_) { st = states_->local_view(); }
    std::int64_t* steps = nullptr;
    if (opt_.needs_steps()) { steps = steps_->local_view().data; }
    // Widest access (4, 2 or 1 values) that every row start and the row width allow.
    auto aligned = [&](int v) {
      auto ok = [&](void const* ptr, std::size_t elem) { return reinterpret_cast<std::uintptr_t>(ptr) % (elem * static_cast<std::size_t>(v)) == 0; };
      auto const uv = static_cast<std::size_t>(v);
      return dim() % uv == 0 && local.stride % uv == 0 && ok(local.data, sizeof(T)) && ok(g, sizeof(T)) &&
             (st.data == nullptr || (st.stride % uv == 0 && ok(st.data, sizeof(float))));
    };
    int const vec = aligned(4) ? 4 : aligned(2) ? 2 : 1;
    auto const lanes_for = [&](int v) {
      int group = 1;
      while (group < 32 && static_cast<std::size_t>(group * v) < dim()) { group *= 2; }
      return group;
    };
    int const group      = lanes_for(vec);
    static int const sms = detail::sm_count();
    int const blocks     = static_cast<int>(std::max<std::size_t>(
      1, std::min<std::size_t>((m + 256 / static_cast<std::size_t>(group) - 1) / (256 / static_cast<std::size_t>(group)),
                               static_cast<std::size_t>(sms) * 8)));
    detail::update_launch<T, Optimizer> const u{opt_, local, st, steps, step, desc, runs, sorted_pos,
                                                       g, longs, lr, group, blocks, err};
    if (vec == 4) {
      u.template run<4>(s);
    } else if (vec == 2) {
      u.template run<2>(s);
    } else {
      u.template run<1>(s);
    }
  }
  // 3. One rank: a bad key stopped the update kernels; say so. Several: checked before sending.
  WM_CUDA_TRY(cudaMemcpyAsync(scratch_->plan.err_host, err, sizeof(unsigned), cudaMemcpyDeviceToHost, s));
  if (one_rank) {
    WM_CUDA_TRY(cudaStreamSynchronize(s));
  } else {
    comm.synchronize(cuda::stream_ref{s}, "apply_gradients");  // a peer that failed: an error, not a hang
  }
  if (*scratch_->plan.err_host != 0) {
    WM_CUDA_TRY(cudaMemsetAsync(err, 0, sizeof(unsigned), s));
    WM_CUDA_TRY(cudaStreamSynchronize(s));
    throw logic_error{"wm: apply_gradients: an index was outside [0, " + std::to_string(rows()) + "); nothing was updated"};
  }
  global_step_ = step;
  // Mapped layouts: peers read this rank's rows directly in their next gather; they must not
  // start before every owner has finished its update (seen as stale rows without this).
  if constexpr (Layout::mapped) { comm.barrier(); }
}

#undef WM_EMBEDDING
#undef WM_EMBEDDING_TEMPLATE

}  // namespace wm

#include <wm/detail/embedding/checkpoint.cuh>
