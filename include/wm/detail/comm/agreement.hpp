// SPDX-License-Identifier: Apache-2.0
// The host-side agreement of wm::communicator (declared in <wm/comm.hpp>): what each rank says
// about every host-side collective (a descriptor: name, sequence number, arguments), the
// exchange that compares the descriptors of every rank before any payload moves (so ranks that
// call different collectives all throw instead of hanging), and its teardown form agree_within.
// Host-only.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/comm/nccl.hpp>
#include <wm/error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace wm {
namespace detail {

/// What every rank contributes to each host-side collective; compared across ranks.
struct collective_descriptor {
  std::uint64_t magic;
  std::uint64_t seq;
  std::uint64_t args;
  std::uint64_t bytes;  // payload size of this rank (may differ; not compared)
  char name[32];
};
static_assert(sizeof(collective_descriptor) == 64);

inline constexpr std::uint64_t descriptor_magic = 0x31637365642d6d77ull;  // "wm-desc1"

[[nodiscard]] inline std::string describe(collective_descriptor const& d) {
  if (d.magic != descriptor_magic) { return "<garbage>"; }
  std::string name{d.name, strnlen(d.name, sizeof(d.name))};
  char args[32];
  std::snprintf(args, sizeof(args), "0x%llx", static_cast<unsigned long long>(d.args));
  return name + "(" + args + ") as collective #" + std::to_string(d.seq);
}

}  // namespace detail

inline std::vector<std::vector<std::byte>> communicator::exchange(std::string_view what,
                                                                  std::uint64_t args,
                                                                  std::span<std::byte const> mine) {
  check_usable();
  if (s_->size == 1) {  // nothing to agree on or wait for: no NCCL round trip, no stream sync
    ++s_->seq;
    return {std::vector<std::byte>(mine.begin(), mine.end())};
  }
  auto const n        = static_cast<std::size_t>(s_->size);
  auto const me       = static_cast<std::size_t>(s_->rank);
  constexpr auto desc = sizeof(detail::collective_descriptor);
  ensure_scratch(n * desc);

  detail::collective_descriptor d{detail::descriptor_magic, s_->seq++, args, mine.size(), {}};
  std::memcpy(d.name, what.data(), std::min(what.size(), sizeof(d.name) - 1));
  std::memcpy(s_->staging + me * desc, &d, desc);
  WM_CUDA_TRY(cudaMemcpyAsync(s_->scratch + me * desc, s_->staging + me * desc, desc,
                              cudaMemcpyHostToDevice, s_->stream));
  WM_NCCL_TRY(
      ncclAllGather(s_->scratch + me * desc, s_->scratch, desc, ncclUint8, s_->comm, s_->stream));
  wait_nccl(what);
  WM_CUDA_TRY(
      cudaMemcpyAsync(s_->staging, s_->scratch, n * desc, cudaMemcpyDeviceToHost, s_->stream));
  wait_stream(what, s_->stream);

  std::vector<detail::collective_descriptor> all(n);
  std::memcpy(all.data(), s_->staging, n * desc);
  std::size_t longest = 0;
  bool same           = true;
  for (auto const& x : all) {
    same = same && x.magic == d.magic && x.seq == d.seq && x.args == d.args &&
           std::memcmp(x.name, d.name, sizeof(d.name)) == 0;
    longest = std::max<std::size_t>(longest, x.bytes);
  }
  if (!same) {
    std::string msg = "wm: mismatched collective calls across ranks:";
    for (std::size_t r = 0; r < n; ++r) {
      msg += " rank " + std::to_string(r) + " called " + detail::describe(all[r]) + ";";
    }
    msg += " every rank must call the same collectives in the same order with the same arguments";
    throw comm_error{msg};
  }

  std::vector<std::vector<std::byte>> out(n);
  if (longest == 0) { return out; }
  ensure_scratch(n * longest);
  std::memcpy(s_->staging + me * longest, mine.data(), mine.size());
  WM_CUDA_TRY(cudaMemcpyAsync(s_->scratch + me * longest, s_->staging + me * longest, longest,
                              cudaMemcpyHostToDevice, s_->stream));
  WM_NCCL_TRY(ncclAllGather(s_->scratch + me * longest, s_->scratch, longest, ncclUint8, s_->comm,
                            s_->stream));
  wait_nccl(what);
  WM_CUDA_TRY(
      cudaMemcpyAsync(s_->staging, s_->scratch, n * longest, cudaMemcpyDeviceToHost, s_->stream));
  wait_stream(what, s_->stream);
  for (std::size_t r = 0; r < n; ++r) {
    auto const* p = s_->staging + r * longest;
    out[r].assign(p, p + all[r].bytes);
  }
  return out;
}

inline bool communicator::agree_within(std::string_view what, std::uint64_t args,
                                       std::chrono::milliseconds limit) noexcept {
  if (s_ == nullptr) { return false; }
  auto const saved = s_->timeout;
  s_->timeout      = std::min(saved, limit);  // every wait below takes its deadline from it
  bool agreed      = true;
  try {
    (void)exchange(what, args, {});
  } catch (...) { agreed = false; }
  s_->timeout = saved;
  if (!agreed) { abort(); }
  return agreed;
}

}  // namespace wm
