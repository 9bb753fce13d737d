// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::embedding::store / load (declared in <wm/embedding.cuh>; included at the end of
// detail/embedding/embedding.cuh). All or nothing: `load` checks the whole file set on every
// rank in one collective step before it changes anything; `store` writes every file under a
// temporary name, then removes the old `.meta`, renames the parts, and renames the new `.meta`
// last, so that a checkpoint either loads whole or is refused.
#pragma once

#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/files.hpp>
#include <wm/detail/base/posix.hpp>
#include <wm/detail/embedding/checkpoint_meta.hpp>
#include <wm/embedding.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <vector>

namespace wm {
namespace detail {

/// The name a checkpoint records for the weights' element type.
template <class T>
[[nodiscard]] constexpr char const* dtype_name() noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return "float32";
  } else if constexpr (std::is_same_v<T, __half>) {
    return "float16";
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return "bfloat16";
  } else if constexpr (std::is_same_v<T, double>) {
    return "float64";
  } else {
    return "bytes";
  }
}

/// Flushes every directory that holds one of @p files (each once). @throw wm::io_error
inline void sync_directories(std::vector<std::filesystem::path> const& files) {
  std::vector<std::filesystem::path> done;
  for (auto const& f : files) {
    auto const dir = f.parent_path();
    if (std::find(done.begin(), done.end(), dir) != done.end()) { continue; }
    sync_directory(dir);
    done.push_back(dir);
  }
}

/**
 * Before store or load use the table: every gather and prefetch that @p source (a cache) has
 * issued is done, on whatever stream it ran (store's flush and load's invalidate run on the legacy
 * stream, which a non-blocking stream's work does not precede: a pending admission would move
 * rows in and out of lines beside them). Waits at most the communicator's timeout.
 * @throw wm::comm_error on every rank if a rank's calls did not end in time
 */
template <class Source>
void wait_for_cache_calls(communicator& comm, Source const& source, std::string const& what) {
  collective_step<comm_error>(
      comm, what + " (waiting for the cache's gathers and prefetches)", [&] {
        if (!source.wait_for_calls(comm.timeout())) {
          throw comm_error{"they did not end within " + timeout_text(comm.timeout())};
        }
      });
}

}  // namespace detail

#define WM_CHECKPOINT_TEMPLATE                                                                \
  template <class T, cache_policy CachePolicy, optimizer_policy Optimizer, location Location, \
            layout Layout, mapping Mapping>
#define WM_CHECKPOINT_EMBEDDING embedding<T, CachePolicy, Optimizer, Location, Layout, Mapping>

WM_CHECKPOINT_TEMPLATE
void WM_CHECKPOINT_EMBEDDING::store(std::filesystem::path const& prefix) {
  if constexpr (detail::caching_policy<CachePolicy>) {
    // Every update is in the table before it is written (lines stay cached, now clean), and no
    // admission still moves rows between lines and the table while the flush runs.
    detail::wait_for_cache_calls(*comm_, source_, "embedding store");
    cudaStream_t const s{};
    flush(cuda::stream_ref{s});
    WM_CUDA_TRY(cudaDeviceSynchronize());
    if (comm_->size() > 1) { comm_->barrier(); }  // every rank's lines are in the table
  }
  auto& comm          = *comm_;
  int const world     = comm.size();
  auto const me       = static_cast<std::size_t>(comm.rank());
  std::string const p = prefix.string();
  std::filesystem::path const meta{p + ".meta"};
  std::filesystem::path const meta_tmp = detail::temporary_name(meta);

  // 1. Every part under a temporary name (each tensor's store is collective and fails on every
  //    rank alike). This rank's files, to rename or, on failure, to remove.
  std::vector<std::pair<std::filesystem::path, std::filesystem::path>> mine;  // temporary, final
  auto remove_temporaries = [&] {
    std::error_code ec;
    for (auto const& [tmp, final_name] : mine) { std::filesystem::remove(tmp, ec); }
    if (me == 0) { std::filesystem::remove(meta_tmp, ec); }
  };
  auto write = [&](auto& t, char const* part) {
    auto const finals = memory<Location, Layout>::part_files(p + part, world);
    std::vector<std::filesystem::path> tmps;
    for (auto const& f : finals) { tmps.push_back(detail::temporary_name(f)); }
    mine.emplace_back(tmps[me], finals[me]);
    t.store(std::span<std::filesystem::path const>{tmps});
  };
  try {
    write(weights_, ".weights");
    if (states_) { write(*states_, ".states"); }
    if (steps_) { write(*steps_, ".steps"); }
    // 2. Parts on the disk, the new meta beside them (rank 0).
    detail::collective_step<io_error>(comm, "embedding store (flushing '" + p + "')", [&] {
      for (auto const& [tmp, final_name] : mine) { detail::sync_file(tmp); }
      if (me != 0) { return; }
      detail::checkpoint_meta m;
      m.rows          = rows();
      m.dim           = dim();
      m.world         = world;
      m.global_step   = global_step_;
      m.dtype         = detail::dtype_name<T>();
      m.dtype_bytes   = sizeof(T);
      m.optimizer     = Optimizer::name;
      m.optimizer_tag = wm::checkpoint_tag(opt_);
      m.states        = Optimizer::states;
      m.steps         = steps_.has_value();
      {
        std::ofstream out{meta_tmp, std::ios::trunc};
        out << detail::format_meta(m);
        out.close();
        if (!out) { throw io_error{"cannot write '" + meta_tmp.string() + "'"}; }
      }
      detail::sync_file(meta_tmp);
    });
  } catch (...) {
    remove_temporaries();
    throw;
  }
  // 3. From here a crash leaves no .meta (the checkpoint is refused) until the new one is in
  //    place: the old meta goes first, then every rank's parts, then the new meta. Each step's
  //    directory entries are on the disk before the next step starts (the files themselves
  //    were flushed in step 2), so the disk never holds a later step without the earlier ones.
  detail::collective_step<io_error>(
      comm, "embedding store (replacing '" + meta.string() + "')", [&] {
        std::error_code ec;
        if (me == 0 && !std::filesystem::remove(meta, ec) && ec) {
          throw io_error{"cannot remove the old '" + meta.string() + "': " + ec.message()};
        }
        if (me == 0) { detail::sync_directory(meta.parent_path()); }
      });
  detail::collective_step<io_error>(comm, "embedding store (renaming the parts of '" + p + "')",
                                    [&] {
                                      std::vector<std::filesystem::path> finals;
                                      for (auto const& [tmp, final_name] : mine) {
                                        detail::rename_file(tmp, final_name);
                                        finals.push_back(final_name);
                                      }
                                      detail::sync_directories(finals);
                                    });
  detail::collective_step<io_error>(comm, "embedding store (renaming '" + meta_tmp.string() + "')",
                                    [&] {
                                      if (me != 0) { return; }
                                      detail::rename_file(meta_tmp, meta);
                                      detail::sync_directory(meta.parent_path());
                                    });
}

WM_CHECKPOINT_TEMPLATE
void WM_CHECKPOINT_EMBEDDING::load(std::filesystem::path const& prefix) {
  auto& comm          = *comm_;
  std::string const p = prefix.string();
  if constexpr (detail::caching_policy<CachePolicy>) {
    // Lines would be stale after the read: flushed (a refused load leaves the table whole) and
    // emptied first, after every admission already issued (one still running would fill lines
    // with rows of the table before the read).
    detail::wait_for_cache_calls(comm, source_, "embedding load");
    cudaStream_t const s{};
    invalidate(cuda::stream_ref{s});
    WM_CUDA_TRY(cudaDeviceSynchronize());
    if (comm_->size() > 1) { comm_->barrier(); }  // no write-back lands after the read
  }
  // 1. Everything checked on every rank before anything changes: the meta against this table
  //    (shape, element type, optimizer and the settings its states depend on), then every part
  //    file of every set (present, exact size).
  detail::checkpoint_meta m;
  detail::collective_step<io_error>(comm, "embedding load (checking '" + p + "')", [&] {
    auto const meta_file = p + ".meta";
    m                    = detail::parse_meta(detail::read_text_file(meta_file), meta_file);
    detail::checkpoint_meta here;
    here.rows          = rows();
    here.dim           = dim();
    here.dtype         = detail::dtype_name<T>();
    here.dtype_bytes   = sizeof(T);
    here.optimizer     = Optimizer::name;
    here.optimizer_tag = wm::checkpoint_tag(opt_);
    here.states        = Optimizer::states;
    here.steps         = steps_.has_value();
    detail::check_meta_fits(m, here, p);
    auto check = [&](char const* part, std::size_t row_bytes) {
      auto const files = memory<Location, Layout>::part_files(p + part, m.world);
      auto const sizes = detail::part_sizes(rows(), m.world, row_bytes);
      detail::check_part_files(files, sizes);
    };
    check(".weights", m.weight_row_bytes());
    if (m.states > 0) { check(".states", m.state_row_bytes()); }
    if (m.steps) { check(".steps", sizeof(std::int64_t)); }
  });
  // 2. The reads (each collective; a read error now is an io_error on every rank).
  auto load_part = [&](auto& t, char const* part) {
    auto const files = memory<Location, Layout>::part_files(p + part, m.world);
    t.load(std::span<std::filesystem::path const>{files});
  };
  load_part(weights_, ".weights");
  if (states_) { load_part(*states_, ".states"); }
  if (steps_) { load_part(*steps_, ".steps"); }
  global_step_ = m.global_step;
}

#undef WM_CHECKPOINT_EMBEDDING
#undef WM_CHECKPOINT_TEMPLATE

}  // namespace wm
