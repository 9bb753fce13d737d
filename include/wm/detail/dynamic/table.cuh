// SPDX-License-Identifier: Apache-2.0
// The memory of one rank's wm::dynamic_embedding: the buckets (keys, digests, scores), the rows,
// optimizer states and steps in slot order (plus one sink row), the error word and counter, and
// the workspace of the calls' sorts. Held by the public class through one pointer.
#pragma once

#include <wm/detail/base/resources.hpp>
#include <wm/detail/base/workspace.cuh>
#include <wm/detail/dynamic/kernels.cuh>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <utility>

namespace wm::detail::dynamic {

/// Buckets, rows and scratch of one rank's table.
template <class T>
struct table {
  std::uint32_t buckets;
  std::size_t slots;  ///< buckets × 128
  std::size_t dim;
  std::size_t state_len;  ///< states × dim
  float initial;
  std::uint64_t seed;
  device_buffer<std::uint64_t> keys;
  device_buffer<std::uint8_t> digests;
  device_buffer<std::uint64_t> scores;
  device_buffer<T> w;                 ///< (slots + 1) × dim
  device_buffer<float> st;            ///< (slots + 1) × state_len, or none
  device_buffer<std::int64_t> steps;  ///< slots + 1, or none
  device_buffer<unsigned> err;
  device_buffer<unsigned long long> counter;
  pinned_buffer<unsigned long long> host;  ///< err and counter read back
  workspace ws;                            ///< the call's hashes, sort and slots
  workspace update;                        ///< apply_gradients' sort and runs

  table(std::uint32_t n_buckets, std::size_t d, int states, bool with_steps, float init_state,
        std::uint64_t hash_seed)
      : buckets{n_buckets},
        slots{std::size_t{n_buckets} * slots_per_bucket},
        dim{d},
        state_len{static_cast<std::size_t>(states) * d},
        initial{init_state},
        seed{hash_seed},
        keys{slots},
        digests{slots},
        scores{slots},
        w{(slots + 1) * d},
        st{state_len == 0 ? 0 : (slots + 1) * state_len},
        steps{with_steps ? slots + 1 : 0},
        err{1},
        counter{1},
        host{2} {
    WM_CUDA_TRY(cudaMemset(keys.data(), 0xff, slots * sizeof(std::uint64_t)));
    WM_CUDA_TRY(cudaMemset(digests.data(), 0, slots));
    WM_CUDA_TRY(cudaMemset(scores.data(), 0, slots * sizeof(std::uint64_t)));
    WM_CUDA_TRY(cudaMemset(w.data(), 0, w.size() * sizeof(T)));
    if (st.size() != 0) { WM_CUDA_TRY(cudaMemset(st.data(), 0, st.size() * sizeof(float))); }
    if (steps.size() != 0) {
      WM_CUDA_TRY(cudaMemset(steps.data(), 0, steps.size() * sizeof(std::int64_t)));
    }
    WM_CUDA_TRY(cudaMemset(err.data(), 0, sizeof(unsigned)));
    WM_CUDA_TRY(cudaMemset(counter.data(), 0, sizeof(unsigned long long)));
    WM_CUDA_TRY(cudaDeviceSynchronize());
  }

  [[nodiscard]] buckets_view view() const noexcept {
    return {keys.data(), digests.data(), scores.data(), buckets, seed};
  }
  [[nodiscard]] slot_rows<T> rows() const noexcept {
    return {w.data(),
            st.size() != 0 ? st.data() : nullptr,
            steps.size() != 0 ? steps.data() : nullptr,
            dim,
            state_len,
            initial};
  }

  /// Reads the error word and the counter back (synchronizes @p s) and resets both.
  [[nodiscard]] std::pair<unsigned, unsigned long long> read_back(cudaStream_t s) {
    WM_CUDA_TRY(cudaMemcpyAsync(host.data(), counter.data(), sizeof(unsigned long long),
                                cudaMemcpyDeviceToHost, s));
    auto* e = reinterpret_cast<unsigned*>(host.data() + 1);
    WM_CUDA_TRY(cudaMemcpyAsync(e, err.data(), sizeof(unsigned), cudaMemcpyDeviceToHost, s));
    WM_CUDA_TRY(cudaMemsetAsync(err.data(), 0, sizeof(unsigned), s));
    WM_CUDA_TRY(cudaMemsetAsync(counter.data(), 0, sizeof(unsigned long long), s));
    WM_CUDA_TRY(cudaStreamSynchronize(s));
    return {*e, host.data()[0]};
  }
};

}  // namespace wm::detail::dynamic
