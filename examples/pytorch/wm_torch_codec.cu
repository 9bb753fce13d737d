// SPDX-License-Identifier: Apache-2.0
/*
 * The zero-suppressing codec's kernels for the element sizes of torch's dtypes. wm_torch.cpp is
 * compiled by the host compiler: the wm::saved_tensors it instantiates sees the codec's
 * declarations only and links against these explicit instantiations (docs/design.md, "Codec").
 */
#include <wm/zero_codec.cuh>

#include <cstdint>

template struct wm::zero_codec<std::uint8_t>;
template struct wm::zero_codec<std::uint16_t>;
template struct wm::zero_codec<std::uint32_t>;
template struct wm::zero_codec<std::uint64_t>;
