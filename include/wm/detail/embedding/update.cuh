// SPDX-License-Identifier: Apache-2.0
// Owner side of wm::embedding::apply_gradients: sort the batch's local rows, find the runs of
// equal rows, sum long runs in segments, then one fused optimizer update per run.
#pragma once

#include <wm/detail/base/cuda.cuh>
#include <wm/detail/base/workspace.cuh>
#include <wm/detail/embedding/kernels.cuh>
#include <wm/detail/tensor/table_rows.cuh>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace wm::detail {

/**
 * The workspace layout of update_owner_rows for @p m gradient rows of @p dim values over local
 * keys of @p bits bits: the sort, the runs and the segment sums of long runs. Computed before the
 * exchange's rows move, so that the owner's room is reserved, and agreed on, with the batch
 * (docs/design.md, "Exchange words").
 */
struct update_room {
  int bits{};
  long_runs longs{128, 128, nullptr, nullptr, nullptr, nullptr, nullptr, 0};
  std::size_t cub_sort{}, cub_select{};
  carver c;
  std::size_t o_pos{}, o_keys{}, o_skeys{}, o_spos{}, o_offs{}, o_desc{}, o_runs{}, o_first{},
      o_sbeg{}, o_slen{}, o_sums{}, o_cub{};
  update_room(std::size_t m, std::size_t dim, int key_bits, cudaStream_t s) : bits{key_bits} {
    int const mi = static_cast<int>(m);
    // Runs of more than 128 gradients: segments of 128, so at most 2 m / 129 of them.
    longs.bound = 2 * m / static_cast<std::size_t>(longs.long_run + 1) + 1;
    thrust::counting_iterator<int> const positions{0};
    WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(
        nullptr, cub_sort, static_cast<std::uint32_t const*>(nullptr),
        static_cast<std::uint32_t*>(nullptr), static_cast<int const*>(nullptr),
        static_cast<int*>(nullptr), mi, 0, bits, s));
    WM_CUDA_TRY(cub::DeviceSelect::If(nullptr, cub_select, positions, static_cast<int*>(nullptr),
                                      static_cast<int*>(nullptr), mi, run_head{nullptr}, s));
    o_pos   = c.add<int>(m);
    o_keys  = c.add<std::uint32_t>(m);
    o_skeys = c.add<std::uint32_t>(m);
    o_spos  = c.add<int>(m);
    o_offs  = c.add<int>(m);
    o_desc  = c.add<run_desc>(m);
    o_runs  = c.add<int>(2);  // runs, segments
    o_first = c.add<int>(m);
    o_sbeg  = c.add<int>(longs.bound);
    o_slen  = c.add<int>(longs.bound);
    o_sums  = c.add<float>(longs.bound * dim);
    o_cub   = c.add<std::byte>(std::max(cub_sort, cub_select));
  }
  [[nodiscard]] std::size_t total() const noexcept { return c.total(); }
};

/**
 * Applies @p m gradient rows @p g (dense, `dim` values each) to the local rows @p keys with
 * optimizer @p opt; duplicates are summed first. Each row is found through @p loc (table_rows:
 * the table; a cache's line_locator: its line or the table), whose rows have the table's shape
 * @p table (row widths and alignment). Keys not below @p key_rows set *err and nothing is
 * written. @p ws: the sort's, runs' and segment sums' room (update_room for m, dim and
 * row_bits(key_rows); callers reserve it first, see update_room). Enqueued on @p s.
 */
template <class T, class Opt, class Index, class Loc>
void update_owner_rows(Opt const& opt, Loc const& loc, table_rows<T> const& table,
                       std::int64_t step, Index const* keys, T const* g, std::size_t m,
                       std::size_t key_rows, float lr, unsigned* err, workspace& ws,
                       cudaStream_t s) {
  if (m == 0) { return; }
  matrix_view<T> const local  = table.w;
  matrix_view<float> const st = table.st;
  std::size_t const dim       = local.cols;
  int const mi                = static_cast<int>(m);
  update_room room{m, dim, row_bits(key_rows), s};
  int const bits         = room.bits;
  long_runs longs        = room.longs;
  std::size_t cub_sort   = room.cub_sort;
  std::size_t cub_select = room.cub_select;
  thrust::counting_iterator<int> const positions{0};
  carver const& c   = room.c;
  std::byte* base   = ws.reserve(c.total(), s);
  auto* pos         = c.take<int>(base, room.o_pos);
  auto* keys32      = c.take<std::uint32_t>(base, room.o_keys);
  auto* sorted_keys = c.take<std::uint32_t>(base, room.o_skeys);
  auto* sorted_pos  = c.take<int>(base, room.o_spos);
  auto* offsets     = c.take<int>(base, room.o_offs);
  auto* desc        = c.take<run_desc>(base, room.o_desc);
  auto* runs        = c.take<int>(base, room.o_runs);
  auto* temp        = c.take<std::byte>(base, room.o_cub);
  longs.count       = runs + 1;
  longs.first       = c.take<int>(base, room.o_first);
  longs.seg_begin   = c.take<int>(base, room.o_sbeg);
  longs.seg_len     = c.take<int>(base, room.o_slen);
  longs.sums        = c.take<float>(base, room.o_sums);
  runs_view const rv{offsets, runs, mi};

  positions_kernel<<<elementwise_blocks(m), 256, 0, s>>>(keys, m, key_rows, keys32, pos, err);
  WM_CHECK_LAUNCH();
  WM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(temp, cub_sort, keys32, sorted_keys, pos, sorted_pos,
                                              mi, 0, bits, s));
  WM_CUDA_TRY(cudaMemsetAsync(runs + 1, 0, sizeof(int), s));
  WM_CUDA_TRY(cub::DeviceSelect::If(temp, cub_select, positions, offsets, runs, mi,
                                    run_head{sorted_keys}, s));
  describe_runs_kernel<<<elementwise_blocks(m), 256, 0, s>>>(longs, rv, sorted_keys, sorted_pos,
                                                             desc);
  WM_CHECK_LAUNCH();

  // Widest access (4, 2 or 1 values) that every row start and the row width allow.
  auto aligned = [&](int v) {
    auto ok = [&](void const* ptr, std::size_t elem) {
      return reinterpret_cast<std::uintptr_t>(ptr) % (elem * static_cast<std::size_t>(v)) == 0;
    };
    auto const uv = static_cast<std::size_t>(v);
    return dim % uv == 0 && local.stride % uv == 0 && ok(local.data, sizeof(T)) &&
           ok(g, sizeof(T)) &&
           (st.data == nullptr || (st.stride % uv == 0 && ok(st.data, sizeof(float))));
  };
  int const vec        = aligned(4) ? 4 : aligned(2) ? 2 : 1;
  auto const lanes_for = [&](int v) {
    int group = 1;
    while (group < 32 && static_cast<std::size_t>(group * v) < dim) { group *= 2; }
    return group;
  };
  int const group  = lanes_for(vec);
  int const sms    = sm_count();
  int const blocks = static_cast<int>(std::max<std::size_t>(
      1, std::min<std::size_t>((m + 256 / static_cast<std::size_t>(group) - 1) /
                                   (256 / static_cast<std::size_t>(group)),
                               static_cast<std::size_t>(sms) * 8)));
  // Cache lines (if any) are dim and states x dim wide from 256-byte aligned bases: the checks
  // on dim above cover them.
  update_launch<T, Opt, Loc> const u{opt, loc,   dim, step,  desc,   runs, sorted_pos,
                                     g,   longs, lr,  group, blocks, err};
  if (vec == 4) {
    u.template run<4>(s);
  } else if (vec == 2) {
    u.template run<2>(s);
  } else {
    u.template run<1>(s);
  }
}

}  // namespace wm::detail
