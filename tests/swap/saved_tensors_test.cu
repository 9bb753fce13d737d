// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::saved_tensors (the swap_saved_test program) with wm::stream_memory: saves
// paged out and restored bit for bit, direct (from the source's memory) and through the pool,
// compressed (zero codec: the encoding's size checked against a host count) and not, staged
// ahead and not, paced by the stream or by the host; fresh random data with zero runs, odd sizes
// and every element width; the memory a restore fills is poisoned first, and the sources are
// freed or overwritten after the save (after their copy), so that a missing or wrong copy shows.
// Also: the source itself comes back while it is alive and unchanged, not once its version
// moved; the same data saved twice is one save; keep_last holds the newest saves; declined saves
// (0 bytes, under min_bytes, skipped, larger than the slab or the pool); saves that outlive
// their saved_tensors.
#include <wm/error.hpp>
#include <wm/swap.cuh>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "stream_guard.hpp"

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

using wm_test::stream_guard;

constexpr unsigned char poison = 0xA5;

// stream_memory whose new memory is poisoned on its stream: a restore that leaves bytes unwritten
// returns 0xA5 there. Counts what it allocated for restores.
struct poisoned_memory : wm::stream_memory {
  std::shared_ptr<std::size_t> restores_made = std::make_shared<std::size_t>(0);
  [[nodiscard]] handle_type allocate(std::size_t bytes, cudaStream_t s) {
    auto h = stream_memory::allocate(bytes, s);
    if (bytes > 0) { WM_CUDA_TRY(cudaMemsetAsync(h->data(), poison, bytes, s)); }
    return h;
  }
  [[nodiscard]] handle_type allocate_like(watch_type const& w, cudaStream_t s) {
    auto h = stream_memory::allocate_like(w, s);
    if (h->bytes() > 0) { WM_CUDA_TRY(cudaMemsetAsync(h->data(), poison, h->bytes(), s)); }
    ++*restores_made;
    return h;
  }
};
static_assert(wm::saved_memory<poisoned_memory>);
static_assert(wm::saved_memory<wm::stream_memory>);

using saves_type = wm::saved_tensors<poisoned_memory>;

// @p count elements of @p elem bytes: each all zeros with probability @p zeros, else random
// bytes; one in 16 of those a lone sign bit (-0.0 in a float: not zero to the codec).
std::vector<unsigned char> random_bytes(std::size_t count, std::size_t elem, double zeros,
                                        std::mt19937_64& rng) {
  std::vector<unsigned char> v(count * elem, 0);
  std::uniform_real_distribution<double> u{0.0, 1.0};
  for (std::size_t i = 0; i < count; ++i) {
    if (u(rng) < zeros) { continue; }
    if (rng() % 16 == 0) {
      v[i * elem + elem - 1] = 0x80;
      continue;
    }
    for (std::size_t b = 0; b < elem; ++b) { v[i * elem + b] = static_cast<unsigned char>(rng()); }
  }
  return v;
}

// Elements whose bytes are not all zero.
std::size_t nonzeros(std::vector<unsigned char> const& v, std::size_t elem) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < v.size(); i += elem) {
    n += std::any_of(v.begin() + static_cast<std::ptrdiff_t>(i),
                     v.begin() + static_cast<std::ptrdiff_t>(i + elem),
                     [](unsigned char c) { return c != 0; })
             ? 1
             : 0;
  }
  return n;
}

std::size_t encoded_size(std::size_t n, std::size_t nz, std::size_t elem) {
  switch (elem) {
    case 1: return wm::zero_codec<std::uint8_t>::encoded_bytes(n, nz);
    case 2: return wm::zero_codec<std::uint16_t>::encoded_bytes(n, nz);
    case 4: return wm::zero_codec<std::uint32_t>::encoded_bytes(n, nz);
    default: return wm::zero_codec<std::uint64_t>::encoded_bytes(n, nz);
  }
}

wm::stream_memory::handle_type upload(std::vector<unsigned char> const& h, std::size_t elem,
                                      cudaStream_t s) {
  auto d = wm::stream_memory::make(h.size(), elem, s);
  if (!h.empty()) {
    WM_CUDA_TRY(cudaMemcpyAsync(d->data(), h.data(), h.size(), cudaMemcpyHostToDevice, s));
    WM_CUDA_TRY(cudaStreamSynchronize(s));  // h is pageable: the copy may still read it
  }
  return d;
}

std::vector<unsigned char> download(void const* p, std::size_t bytes, cudaStream_t s) {
  std::vector<unsigned char> h(bytes, 0x5A);
  if (bytes > 0) {
    WM_CUDA_TRY(cudaMemcpyAsync(h.data(), p, bytes, cudaMemcpyDeviceToHost, s));
    WM_CUDA_TRY(cudaStreamSynchronize(s));
  }
  return h;
}

// Overwrites @p d with other random bytes on @p s (after the work queued there) and says so.
void overwrite(wm::stream_memory::handle_type const& d, std::mt19937_64& rng, cudaStream_t s) {
  std::vector<unsigned char> junk(d->bytes());
  for (auto& c : junk) { c = static_cast<unsigned char>(rng() | 1); }  // never all zero
  WM_CUDA_TRY(cudaMemcpyAsync(d->data(), junk.data(), junk.size(), cudaMemcpyHostToDevice, s));
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  d->bump_version();
}

wm::swap_options scope_options(std::size_t device_budget, std::size_t host_bytes) {
  wm::swap_options o;
  o.device_budget = device_budget;
  o.host_bytes    = host_bytes;
  o.timeout       = std::chrono::milliseconds{30'000};
  return o;
}

struct source {
  std::vector<unsigned char> host;
  std::size_t elem;
};

}  // namespace

TEST_CASE("saved_tensors: direct saves round-trip bit for bit", "[gpu][swap][saved]") {
  bool const compress          = GENERATE(false, true);
  bool const host_pacing       = GENERATE(false, true);
  std::size_t const stage      = GENERATE(std::size_t{0}, 64 * mib);
  std::size_t const max_out    = GENERATE(std::size_t{0}, 1 * mib);
  bool const explicit_prefetch = GENERATE(false, true);
  CAPTURE(compress, host_pacing, stage, max_out, explicit_prefetch);
  std::mt19937_64 rng{std::random_device{}()};
  stream_guard sg;
  cudaStream_t const s = sg.s;
  wm::saved_tensors_options o;
  o.mode                  = wm::save_mode::direct;
  o.min_bytes             = 1;
  o.compress              = compress;
  o.host_pacing           = host_pacing;
  o.stage_bytes           = stage;
  o.max_outstanding_bytes = max_out;
  o.auto_prefetch         = !explicit_prefetch;
  poisoned_memory mem;
  auto const made = mem.restores_made;
  saves_type saves{scope_options(0, 256 * mib), o, mem};

  // Every element width, odd counts, one save past 4 MiB (not coalesced), zero fractions 0..1.
  std::vector<std::size_t> const counts{1, 3, 31, 33, 4095, 4097, 100'003};
  std::vector<source> src;
  std::vector<saves_type::save_ptr> saved;
  std::size_t raw = 0;
  std::size_t enc = 0;
  for (std::size_t elem : {1, 2, 4, 8}) {
    for (std::size_t n : counts) {
      double const zeros = std::vector<double>{0.0, 0.5, 0.9, 1.0}[rng() % 4];
      source x{random_bytes(n, elem, zeros, rng), elem};
      auto d = upload(x.host, elem, s);
      saved.push_back(saves.save(d, s));
      REQUIRE(saved.back() != nullptr);
      REQUIRE(saved.back()->bytes() == n * elem);
      raw += n * elem;
      enc += encoded_size(n, nonzeros(x.host, elem), elem);
      src.push_back(std::move(x));
    }  // d dropped: freed after its copy (recorded on the copy stream); restores cannot reuse it
  }
  {
    auto d  = upload(random_bytes(5 * mib / 4, 4, 0.5, rng), 4, s);  // 5 MiB
    auto sp = saves.save(d, s);
    REQUIRE(sp != nullptr);
    std::vector<unsigned char> h = download(d->data(), d->bytes(), s);
    raw += h.size();
    enc += encoded_size(h.size() / 4, nonzeros(h, 4), 4);
    src.push_back(source{std::move(h), 4});
    saved.push_back(std::move(sp));
  }
  saves.end_forward(s);
  auto st = saves.statistics();
  CHECK(st.copies == saved.size());
  CHECK(st.bytes_copied == raw);
  CHECK(st.live == saved.size());
  CHECK(st.shared == 0);
  CHECK(st.kept == 0);
  if (compress) {
    CHECK(st.encoded == saved.size());
    CHECK(st.encoded_raw_bytes == raw);
    CHECK(st.encoded_bytes == enc);  // exactly the encodings' bytes, counted on the host
  } else {
    CHECK(st.encoded == 0);
  }
  if (explicit_prefetch) { saves.prefetch_all(s); }
  // Backward: latest first; each restore compared byte for byte with the source's data.
  std::size_t wrong = 0;
  for (std::size_t k = saved.size(); k-- > 0;) {
    auto const r = saves.restore(saved[k], s);
    REQUIRE(r.memory.has_value());
    REQUIRE(r.data == (*r.memory)->data());
    auto const got = download(r.data, saved[k]->bytes(), s);
    if (got != src[k].host) {
      ++wrong;
      UNSCOPED_INFO("save " << k << " (" << src[k].host.size() << " bytes of " << src[k].elem
                            << "-byte elements) came back different");
    }
    // A second restore of the same save gives the same memory (a shared save's second use).
    auto const again = saves.restore(saved[k], s);
    CHECK(again.data == r.data);
  }
  CHECK(wrong == 0);
  st = saves.statistics();
  CHECK(st.reused_sources == 0);
  CHECK(st.staged_restores + st.unstaged_restores == saved.size());
  CHECK(*made == saved.size());
  if (stage > 0) { CHECK(st.staged_restores >= saved.size() - 1); }
  CHECK((st.throttle_waits > 0) == (!host_pacing && max_out > 0));
  auto const sc = saves.scope().statistics();
  CHECK(sc.pageouts_from == saved.size());
  CHECK(sc.bytes_out == (compress ? enc : raw));
  CHECK(sc.host_blocking_syncs == 0);
  saved.clear();
  CHECK(saves.statistics().live == 0);
}

TEST_CASE("saved_tensors: pool saves round-trip bit for bit", "[gpu][swap][saved]") {
  std::mt19937_64 rng{std::random_device{}()};
  stream_guard sg;
  cudaStream_t const s = sg.s;
  wm::saved_tensors_options o;
  o.mode      = wm::save_mode::pool;
  o.min_bytes = 1;
  saves_type saves{scope_options(32 * mib, 256 * mib), o, poisoned_memory{}};
  CHECK(saves.pool_bytes() == 32 * mib);
  std::vector<source> src;
  std::vector<wm::stream_memory::handle_type> dev;
  std::vector<saves_type::save_ptr> saved;
  std::size_t total = 0;
  while (total < 96 * mib) {  // three times the pool: blocks change hands
    std::size_t const elem = std::size_t{1} << (rng() % 4);
    std::size_t const n    = (rng() % (3 * mib)) / elem + 1;
    source x{random_bytes(n, elem, 0.3, rng), elem};
    auto d = upload(x.host, elem, s);
    saved.push_back(saves.save(d, s));
    REQUIRE(saved.back() != nullptr);
    CHECK(saved.back()->mode() == wm::save_mode::pool);
    overwrite(d, rng, s);  // the pool copy was queued before it on s: the save keeps the old data
    total += n * elem;
    src.push_back(std::move(x));
    dev.push_back(std::move(d));
  }
  saves.end_forward(s);
  saves.scope().wait_pageouts();
  std::size_t wrong = 0;
  for (std::size_t k = saved.size(); k-- > 0;) {
    auto const r = saves.restore(saved[k], s);
    CHECK_FALSE(r.memory.has_value());
    auto const got = download(r.data, saved[k]->bytes(), s);
    wrong += got != src[k].host ? 1 : 0;
    saved[k].reset();  // its block goes back to the pool for the saves still to come
  }
  CHECK(wrong == 0);
  auto const st = saves.statistics();
  CHECK(st.copies == src.size());
  CHECK(st.reused_sources == 0);  // pool restores never return the source
  auto const sc = saves.scope().statistics();
  CHECK(sc.pageouts > 0);
  CHECK(sc.prefetches + sc.passive_pageins > 0);
  CHECK(st.live == 0);
}

TEST_CASE("saved_tensors: the source itself while alive and unchanged", "[gpu][swap][saved]") {
  bool const compress = GENERATE(false, true);
  CAPTURE(compress);
  std::mt19937_64 rng{std::random_device{}()};
  stream_guard sg;
  cudaStream_t const s = sg.s;
  wm::saved_tensors_options o;
  o.min_bytes = 1;
  o.compress  = compress;
  poisoned_memory mem;
  saves_type saves{scope_options(0, 64 * mib), o, mem};
  auto const a_host = random_bytes(777'777, 2, 0.5, rng);  // odd: 1,555,554 bytes
  auto const b_host = random_bytes(123'457, 4, 0.5, rng);
  auto a            = upload(a_host, 2, s);
  auto b            = upload(b_host, 4, s);
  auto sa           = saves.save(a, s);
  auto sb           = saves.save(b, s);
  REQUIRE((sa && sb));
  saves.end_forward(s);
  WM_CUDA_TRY(cudaStreamSynchronize(saves.scope().pageout_stream()));  // the copies are done
  overwrite(b, rng, s);  // b changes in place (its version moves); a stays as it was
  auto const rb = saves.restore(sb, s);
  auto const ra = saves.restore(sa, s);
  REQUIRE((ra.memory && rb.memory));
  CHECK(*ra.memory == a);  // a itself, no page-in
  CHECK(*rb.memory != b);  // b's saved data, paged in
  CHECK(download(ra.data, a_host.size(), s) == a_host);
  CHECK(download(rb.data, b_host.size(), s) == b_host);
  auto const st = saves.statistics();
  CHECK(st.reused_sources == 1);
  CHECK(st.staged_restores + st.unstaged_restores == 1);
  CHECK(*mem.restores_made == 1);
}

TEST_CASE("saved_tensors: the same data saved twice is one save", "[gpu][swap][saved]") {
  wm::save_mode const mode = GENERATE(wm::save_mode::direct, wm::save_mode::pool);
  CAPTURE(mode == wm::save_mode::direct);
  std::mt19937_64 rng{std::random_device{}()};
  stream_guard sg;
  cudaStream_t const s = sg.s;
  wm::saved_tensors_options o;
  o.mode      = mode;
  o.min_bytes = 1;
  saves_type saves{scope_options(16 * mib, 64 * mib), o, poisoned_memory{}};
  auto const h1 = random_bytes(300'001, 4, 0.2, rng);
  auto d        = upload(h1, 4, s);
  auto first    = saves.save(d, s);
  auto second   = saves.save(d, s);
  REQUIRE(first != nullptr);
  CHECK(first == second);
  auto st = saves.statistics();
  CHECK(st.saves == 2);
  CHECK(st.copies == 1);
  CHECK(st.shared == 1);
  // Another block of the same bytes is other data; the same block at a new version too.
  auto const other = upload(h1, 4, s);
  auto third       = saves.save(other, s);
  CHECK(third != first);
  saves.end_forward(s);
  WM_CUDA_TRY(cudaStreamSynchronize(s));
  WM_CUDA_TRY(cudaStreamSynchronize(saves.scope().pageout_stream()));
  auto const h2 = [&] {
    overwrite(d, rng, s);
    return download(d->data(), d->bytes(), s);
  }();
  auto fourth = saves.save(d, s);
  REQUIRE(fourth != nullptr);
  CHECK(fourth != first);
  st = saves.statistics();
  CHECK(st.copies == 3);
  CHECK(st.shared == 1);
  saves.end_forward(s);
  d.reset();  // direct: the restores page in (the source is gone)
  CHECK(download(saves.restore(fourth, s).data, h2.size(), s) == h2);
  CHECK(download(saves.restore(first, s).data, h1.size(), s) == h1);
  CHECK(download(saves.restore(second, s).data, h1.size(), s) == h1);
  CHECK(download(saves.restore(third, s).data, h1.size(), s) == h1);
}

TEST_CASE("saved_tensors: keep_last holds the newest saves", "[gpu][swap][saved]") {
  bool const compress = GENERATE(false, true);
  CAPTURE(compress);
  std::mt19937_64 rng{std::random_device{}()};
  stream_guard sg;
  cudaStream_t const s = sg.s;
  wm::saved_tensors_options o;
  o.min_bytes = 1;
  o.keep_last = 2;
  o.compress  = compress;
  saves_type saves{scope_options(0, 64 * mib), o, poisoned_memory{}};
  std::vector<std::vector<unsigned char>> host;
  std::vector<saves_type::save_ptr> saved;
  std::vector<wm::stream_memory::handle_type> dev;
  for (int i = 0; i < 5; ++i) {
    host.push_back(random_bytes(200'003 + 17 * i, 2, 0.5, rng));
    dev.push_back(upload(host.back(), 2, s));
    saved.push_back(saves.save(dev.back(), s));
    REQUIRE(saved.back() != nullptr);
  }
  saves.end_forward(s);
  WM_CUDA_TRY(cudaStreamSynchronize(saves.scope().pageout_stream()));
  // The three oldest went out: overwrite them, so that only a page-in restores their data.
  for (int i = 0; i < 3; ++i) { overwrite(dev[i], rng, s); }
  std::size_t wrong = 0;
  for (int i = 4; i >= 0; --i) {
    auto const r = saves.restore(saved[i], s);
    REQUIRE(r.memory);
    if (i >= 3) { CHECK(*r.memory == dev[i]); }  // held: the source itself
    wrong += download(r.data, host[i].size(), s) != host[i] ? 1 : 0;
  }
  CHECK(wrong == 0);
  auto const st = saves.statistics();
  CHECK(st.kept_last == 2);
  CHECK(st.copies == 5);
  CHECK(saves.scope().statistics().pageouts_from == 3);
  CHECK(st.encoded == (compress ? 3u : 0u));
}

TEST_CASE("saved_tensors: a held source changed in place is an error", "[gpu][swap][saved]") {
  stream_guard sg;
  cudaStream_t const s = sg.s;
  wm::saved_tensors_options o;
  o.min_bytes = 1;
  o.keep_last = 1;
  saves_type saves{scope_options(0, 16 * mib), o, poisoned_memory{}};
  auto d  = wm::stream_memory::make(4096, 4, s);
  auto sp = saves.save(d, s);
  REQUIRE(sp != nullptr);
  d->bump_version();
  CHECK_THROWS_AS(saves.restore(sp, s), wm::logic_error);
}

TEST_CASE("saved_tensors: declined saves keep the source", "[gpu][swap][saved]") {
  stream_guard sg;
  cudaStream_t const s = sg.s;
  wm::saved_tensors_options o;
  o.min_bytes = 4096;
  saves_type saves{scope_options(1 * mib, 1 * mib), o, poisoned_memory{}};
  auto const empty = wm::stream_memory::make(0, 4, s);
  auto const small = wm::stream_memory::make(4092, 4, s);
  auto const big   = wm::stream_memory::make(2 * mib, 2, s);
  auto const skip  = wm::stream_memory::make(8192, 8, s);
  auto const fits  = wm::stream_memory::make(8193, 1, s);
  saves.set_skip({skip->data()});
  CHECK(saves.save(nullptr, s) == nullptr);
  CHECK(saves.save(empty, s) == nullptr);
  CHECK(saves.save(small, s) == nullptr);
  CHECK(saves.save(skip, s) == nullptr);
  CHECK(saves.save(big, s) == nullptr);  // larger than the slab
  auto st = saves.statistics();
  CHECK(st.saves == 5);
  CHECK(st.kept == 5);
  CHECK(st.kept_no_room == 1);
  CHECK(st.copies == 0);
  auto const fitting = saves.save(fits, s);
  CHECK(fitting != nullptr);
  // Pool mode: larger than the pool.
  o.mode = wm::save_mode::pool;
  saves.set_options(o);
  CHECK(saves.options().mode == wm::save_mode::pool);
  auto const over = wm::stream_memory::make(1 * mib + 256, 1, s);
  CHECK(saves.save(over, s) == nullptr);
  st = saves.statistics();
  CHECK(st.kept_no_room == 2);
  CHECK(st.copies == 1);
  saves.reset_statistics();
  CHECK(saves.statistics().saves == 0);
  CHECK(saves.statistics().live == 1);  // `fitting`: live is a state, not a counter
  CHECK_THROWS_AS(saves.restore(nullptr, s), wm::logic_error);
  CHECK_THROWS_AS(wm::stream_memory::make(6, 4, s), wm::logic_error);
}

TEST_CASE("saved_tensors: saves outlive their saved_tensors", "[gpu][swap][saved]") {
  std::mt19937_64 rng{std::random_device{}()};
  stream_guard sg;
  cudaStream_t const s = sg.s;
  wm::saved_tensors_options o;
  o.min_bytes = 1;
  o.compress  = true;
  saves_type::save_ptr kept;
  {
    saves_type saves{scope_options(0, 16 * mib), o, poisoned_memory{}};
    auto d = upload(random_bytes(65'537, 4, 0.5, rng), 4, s);
    kept   = saves.save(d, s);
    REQUIRE(kept != nullptr);
    auto other = saves.save(upload(random_bytes(4099, 2, 0.5, rng), 2, s), s);
    REQUIRE(other != nullptr);
  }  // the encoding of `other` still waits; the scope lives on in `kept`
  CHECK(kept->bytes() == 65'537 * 4);
  CHECK_FALSE(kept->resident());
  kept.reset();  // the last save: the scope goes now
  WM_CUDA_TRY(cudaStreamSynchronize(s));
}
