// SPDX-License-Identifier: Apache-2.0
// GPU tests of wm::communicator. [gpu]: one rank; [multi_gpu]: as many ranks as GPUs (>= 2).
// Every rank is a forked process with its own GPU; checks inside ranks throw (RANK_REQUIRE) and
// wm::launch turns that into a launch_error that fails the test in the parent.
#include <wm/comm.hpp>
#include <wm/launch.hpp>

#include <array>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <sys/mman.h>
#include <thread>
#include <vector>

#include "catch.hpp"
#include "rank_check.hpp"
#include "ranks.hpp"

using namespace std::chrono_literals;

namespace {

int ranks_for_multi() {
  return wm::local_device_count();
}

// Value that rank `src` sends to rank `dst` at position i; distinct for every triple.
__host__ __device__ inline long long payload(int src, int dst, std::size_t i, long long salt) {
  return salt ^ ((static_cast<long long>(src) << 48) | (static_cast<long long>(dst) << 40) |
                 static_cast<long long>(i));
}

__global__ void fill_sends(long long* out, std::size_t const* offsets, std::size_t const* counts,
                           int src, int world, long long salt) {
  for (int dst = 0; dst < world; ++dst) {
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < counts[dst];
         i += gridDim.x * blockDim.x) {
      out[offsets[dst] + i] = payload(src, dst, i, salt);
    }
  }
}

// Count matrix shared by all ranks (same seed): counts[src][dst], with zeros and uneven sizes.
std::vector<std::vector<std::size_t>> count_matrix(int world, std::uint64_t seed) {
  std::mt19937_64 rng{seed};
  std::vector<std::vector<std::size_t>> c(
      static_cast<std::size_t>(world), std::vector<std::size_t>(static_cast<std::size_t>(world)));
  for (auto& row : c) {
    for (auto& x : row) {
      auto const pick = rng() % 4;
      x               = pick == 0   ? 0
                        : pick == 1 ? 1 + rng() % 7
                        : pick == 2 ? 1000 + rng() % 5000
                                    : rng() % 300000;
    }
  }
  return c;
}

void check_all_to_all(wm::communicator& comm, std::uint64_t seed, bool all_zero) {
  int const world = comm.size();
  int const me    = comm.rank();
  auto counts     = count_matrix(world, seed);
  if (all_zero) {
    for (auto& row : counts) { std::fill(row.begin(), row.end(), 0); }
  }
  long long const salt                 = static_cast<long long>(seed * 7919);
  std::vector<std::size_t> send_counts = counts[static_cast<std::size_t>(me)];
  std::vector<std::size_t> recv_counts(static_cast<std::size_t>(world));
  for (int p = 0; p < world; ++p) {
    recv_counts[static_cast<std::size_t>(p)] =
        counts[static_cast<std::size_t>(p)][static_cast<std::size_t>(me)];
  }
  std::vector<std::size_t> send_off(static_cast<std::size_t>(world) + 1, 0);
  std::vector<std::size_t> recv_off(static_cast<std::size_t>(world) + 1, 0);
  std::partial_sum(send_counts.begin(), send_counts.end(), send_off.begin() + 1);
  std::partial_sum(recv_counts.begin(), recv_counts.end(), recv_off.begin() + 1);
  std::size_t const n_send = send_off.back();
  std::size_t const n_recv = recv_off.back();

  long long* send   = nullptr;
  long long* recv   = nullptr;
  std::size_t* meta = nullptr;
  WM_CUDA_TRY(cudaMalloc(&send, std::max<std::size_t>(n_send, 1) * sizeof(long long)));
  WM_CUDA_TRY(cudaMalloc(&recv, std::max<std::size_t>(n_recv, 1) * sizeof(long long)));
  WM_CUDA_TRY(cudaMalloc(&meta, 2 * static_cast<std::size_t>(world) * sizeof(std::size_t)));
  WM_CUDA_TRY(
      cudaMemcpy(meta, send_off.data(), world * sizeof(std::size_t), cudaMemcpyHostToDevice));
  WM_CUDA_TRY(cudaMemcpy(meta + world, send_counts.data(), world * sizeof(std::size_t),
                         cudaMemcpyHostToDevice));
  WM_CUDA_TRY(
      cudaMemset(recv, 0xA5, std::max<std::size_t>(n_recv, 1) * sizeof(long long)));  // poison
  cudaStream_t stream{};
  WM_CUDA_TRY(cudaStreamCreate(&stream));
  fill_sends<<<120, 256, 0, stream>>>(send, meta, meta + world, me, world, salt);
  WM_CHECK_LAUNCH();
  comm.all_to_all_v(send, std::span<std::size_t const>{send_counts}, recv,
                    std::span<std::size_t const>{recv_counts}, cuda::stream_ref{stream});
  WM_CUDA_TRY(cudaStreamSynchronize(stream));
  std::vector<long long> got(n_recv);
  WM_CUDA_TRY(cudaMemcpy(got.data(), recv, n_recv * sizeof(long long), cudaMemcpyDeviceToHost));
  for (int src = 0; src < world; ++src) {
    for (std::size_t i = 0; i < recv_counts[static_cast<std::size_t>(src)]; ++i) {
      auto const v = got[recv_off[static_cast<std::size_t>(src)] + i];
      RANK_REQUIRE_MSG(v == payload(src, me, i, salt),
                       "rank " << me << " element " << i << " from rank " << src);
    }
  }
  WM_CUDA_TRY(cudaStreamDestroy(stream));
  WM_CUDA_TRY(cudaFree(send));
  WM_CUDA_TRY(cudaFree(recv));
  WM_CUDA_TRY(cudaFree(meta));
}

// Grouped send/recv: every rank sends every rank (itself too) two pieces, in order, of sizes
// drawn from a shared seed (zero included); the second piece goes out before the first in
// memory, so pairing by order (not by address) is what is checked. Rank @p idle (if any) sends
// and receives only empty pieces (its call returns at once) while the others exchange.
void check_send_recv(wm::communicator& comm, std::uint64_t seed, int idle = -1) {
  int const world = comm.size();
  int const me    = comm.rank();
  auto size_of    = [&](int from, int to, int piece) {
    if (from == idle || to == idle) { return std::size_t{0}; }
    std::mt19937_64 rng{seed ^ (static_cast<std::uint64_t>(from) * 1000003u +
                                static_cast<std::uint64_t>(to) * 7919u +
                                static_cast<std::uint64_t>(piece))};
    return rng() % 3 == 0 ? std::size_t{0} : static_cast<std::size_t>(1 + rng() % 70000);
  };
  auto byte_of = [&](int from, int to, int piece, std::size_t i) {
    return static_cast<unsigned char>(
        (from * 31 + to * 17 + piece * 101 + static_cast<int>(i % 251)) & 0xff);
  };
  std::vector<wm::communicator::send_part> sends;
  std::vector<wm::communicator::recv_part> recvs;
  std::vector<unsigned char*> buffers;
  struct expected {
    unsigned char* at;
    int from;
    int piece;
    std::size_t bytes;
  };
  std::vector<expected> want;
  for (int q = 0; q < world; ++q) {
    for (int piece : {1, 0}) {  // piece 1 first in the list: it is sent first
      std::size_t const out = size_of(me, q, piece);
      std::vector<unsigned char> h(out);
      for (std::size_t i = 0; i < out; ++i) { h[i] = byte_of(me, q, piece, i); }
      unsigned char* d = nullptr;
      WM_CUDA_TRY(cudaMalloc(&d, std::max<std::size_t>(out, 1)));
      WM_CUDA_TRY(cudaMemcpy(d, h.data(), out, cudaMemcpyHostToDevice));
      buffers.push_back(d);
      sends.push_back({q, d, out});
      std::size_t const in = size_of(q, me, piece);
      unsigned char* r     = nullptr;
      WM_CUDA_TRY(cudaMalloc(&r, std::max<std::size_t>(in, 1)));
      WM_CUDA_TRY(cudaMemset(r, 0xEE, std::max<std::size_t>(in, 1)));  // poison
      buffers.push_back(r);
      recvs.push_back({q, r, in});
      want.push_back({r, q, piece, in});
    }
  }
  comm.send_recv(sends, recvs, cuda::stream_ref{cudaStream_t{}});
  WM_CUDA_TRY(cudaDeviceSynchronize());
  for (auto const& x : want) {
    std::vector<unsigned char> h(x.bytes);
    WM_CUDA_TRY(cudaMemcpy(h.data(), x.at, x.bytes, cudaMemcpyDeviceToHost));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < x.bytes; ++i) {
      wrong += h[i] != byte_of(x.from, me, x.piece, i) ? 1 : 0;
    }
    RANK_REQUIRE_MSG(wrong == 0, "send_recv: " << wrong << " of " << x.bytes << " bytes of piece "
                                               << x.piece << " from rank " << x.from << " differ");
  }
  for (auto* b : buffers) { WM_CUDA_TRY(cudaFree(b)); }
  // A peer outside the group is an input error, found before anything is sent.
  bool threw = false;
  try {
    std::vector<wm::communicator::send_part> const bad{{world, nullptr, 0}};
    comm.send_recv(bad, {}, cuda::stream_ref{cudaStream_t{}});
  } catch (wm::logic_error const&) { threw = true; }
  RANK_REQUIRE_MSG(threw, "send_recv accepted peer " << world);
}

// A send_recv whose pieces are all empty (null buffers included) returns at once, on every rank
// together or on one rank alone while the others exchange; input errors are still found;
// exchanges with data after it still arrive intact.
void check_empty_send_recv(wm::communicator& comm, std::uint64_t seed) {
  int const world = comm.size();
  std::vector<wm::communicator::send_part> sends;
  std::vector<wm::communicator::recv_part> recvs;
  for (int q = 0; q < world; ++q) {
    sends.push_back({q, nullptr, 0});
    recvs.push_back({q, nullptr, 0});
  }
  cudaStream_t stream{};
  WM_CUDA_TRY(cudaStreamCreate(&stream));
  comm.send_recv(sends, recvs, cuda::stream_ref{stream});
  comm.send_recv({}, {}, cuda::stream_ref{stream});
  std::vector<std::size_t> const zeros(static_cast<std::size_t>(world), 0);
  comm.all_to_all_v<float>(nullptr, std::span<std::size_t const>{zeros}, nullptr,
                           std::span<std::size_t const>{zeros}, cuda::stream_ref{stream});
  WM_CUDA_TRY(cudaStreamSynchronize(stream));
  WM_CUDA_TRY(cudaStreamDestroy(stream));
  bool threw = false;
  try {
    std::vector<wm::communicator::recv_part> const bad{{-1, nullptr, 0}};
    comm.send_recv({}, bad, cuda::stream_ref{cudaStream_t{}});
  } catch (wm::logic_error const&) { threw = true; }
  RANK_REQUIRE_MSG(threw, "an empty send_recv accepted peer -1");
  check_send_recv(comm, seed);
  check_send_recv(comm, seed + 1, 0);  // rank 0 idle: its empty call must not hold up the others
  check_send_recv(comm, seed + 2);
}

void check_all_gather(wm::communicator& comm, std::uint64_t seed) {
  int const me     = comm.rank();
  int const world  = comm.size();
  auto const ranks = comm.all_gather(me * 10 + 3);
  RANK_REQUIRE(ranks.size() == static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    RANK_REQUIRE(ranks[static_cast<std::size_t>(r)] == r * 10 + 3);
  }
  // Byte buffers of different sizes per rank, one of them empty.
  auto bytes_of = [&](int r) {
    std::mt19937_64 rng{seed + static_cast<std::uint64_t>(r)};
    std::vector<std::byte> b(r == 1 ? 0 : 1 + static_cast<std::size_t>(rng() % 9000));
    for (auto& x : b) { x = static_cast<std::byte>(rng()); }
    return b;
  };
  auto const mine  = bytes_of(me);
  auto const parts = comm.all_gather_bytes(mine);
  RANK_REQUIRE(parts.size() == static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    RANK_REQUIRE_MSG(parts[static_cast<std::size_t>(r)] == bytes_of(r), "bytes of rank " << r);
  }
}

}  // namespace

TEST_CASE("one rank: identity, all-gather, all-to-all-v to itself, split", "[gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(1, [&](wm::communicator& comm) {
    RANK_REQUIRE(comm.rank() == 0 && comm.size() == 1);
    RANK_REQUIRE(comm.local_rank() == 0 && comm.local_size() == 1 && comm.single_node());
    int dev = -1;
    WM_CUDA_TRY(cudaGetDevice(&dev));
    RANK_REQUIRE(dev == comm.device());
    check_all_gather(comm, seed);
    check_all_to_all(comm, seed, false);
    check_all_to_all(comm, seed + 1, true);
    check_send_recv(comm, seed + 3);
    check_empty_send_recv(comm, seed + 4);
    comm.barrier();
    auto sub = comm.split(5, 0);
    RANK_REQUIRE(sub.valid() && sub.size() == 1 && sub.rank() == 0);
    RANK_REQUIRE(sub.token() != comm.token());
    check_all_gather(sub, seed + 2);
    auto none = comm.split(-1, 0);
    RANK_REQUIRE(!none.valid());
    // Wrong count vectors are an input error.
    std::vector<std::size_t> two(2, 0);
    std::vector<std::size_t> one(1, 0);
    bool threw = false;
    try {
      comm.all_to_all_v<float>(nullptr, std::span<std::size_t const>{two}, nullptr,
                               std::span<std::size_t const>{one}, cuda::stream_ref{cudaStream_t{}});
    } catch (wm::logic_error const&) { threw = true; }
    RANK_REQUIRE(threw);
  });
}

TEST_CASE("one rank: communicators made and destroyed in a loop free what they hold, promptly",
          "[gpu]") {
  std::uint64_t const seed = std::random_device{}();
  wm::launch(1, [&](wm::communicator& comm) {
    check_send_recv(comm, seed);  // the launcher's communicator is in use meanwhile
    auto const used = [] {
      std::size_t free = 0, total = 0;
      WM_CUDA_TRY(cudaDeviceSynchronize());
      WM_CUDA_TRY(cudaMemGetInfo(&free, &total));
      return total - free;
    };
    std::size_t held[2] =
        {};  // GPU memory of a communicator and a split of it: without, with the twin
    auto const cycle = [&](int i, bool twin) {
      wm::communicator_options options;
      options.exchange_twin  = twin;
      std::size_t const from = used();
      wm::communicator c{wm::unique_id::create(), 0, 1, options};
      check_send_recv(c, seed + static_cast<std::uint64_t>(i));  // through the twin, or not
      auto sub = c.split(0, 0);                                  // the split's own twin, if any
      check_send_recv(sub, seed + 100 + static_cast<std::uint64_t>(i));
      std::size_t const now = used();
      held[twin ? 1 : 0]    = now > from ? now - from : 0;
    };
    cycle(0, true);  // NCCL's one-time setup (its kernels, its first communicator) before measuring
    cycle(0, false);
    std::size_t const before = used();
    auto const start         = std::chrono::steady_clock::now();
    for (int i = 1; i <= 8; ++i) { cycle(i, i % 2 == 0); }
    auto const seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::size_t const now  = used();
    std::size_t const lost = now > before ? now - before : 0;
    // A communicator holds its NCCL communicators' buffers (hundreds of MiB on an H200): one
    // left behind by any of the 8 would show.
    RANK_REQUIRE_MSG(lost < (std::size_t{32} << 20),
                     (lost >> 20) << " MiB of GPU memory not given back by 8 communicators");
    RANK_REQUIRE_MSG(held[1] > held[0], "with the twin " << (held[1] >> 20) << " MiB, without "
                                                         << (held[0] >> 20)
                                                         << " MiB: the option made no difference");
    // Destruction finalizes without waiting out the timeout (300 s; a finalize that hung would).
    RANK_REQUIRE_MSG(seconds < 60.0, "8 communicators took " << seconds << " s");
  });
}

// Spins until @p ns nanoseconds of the GPU's global timer have passed.
__global__ void spin_for(unsigned long long ns) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}

TEST_CASE("one rank: synchronize waits for a stream, and gives up on it after the timeout",
          "[gpu]") {
  wm::launch(1, [&](wm::communicator&) {
    wm::communicator_options options;
    options.timeout = std::chrono::milliseconds{500};
    wm::communicator c{wm::unique_id::create(), 0, 1, options};
    cudaStream_t s{};
    WM_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    auto const seconds_since = [](auto t0) {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    // Work that ends within the timeout is waited for.
    spin_for<<<1, 1, 0, s>>>(200'000'000ull);  // 0.2 s
    auto t0 = std::chrono::steady_clock::now();
    c.synchronize(cuda::stream_ref{s});
    double const waited = seconds_since(t0);
    RANK_REQUIRE_MSG(waited > 0.1 && cudaStreamQuery(s) == cudaSuccess,
                     "returned after " << waited << " s");
    // Work that does not: an error once the timeout has passed (the abort waits for the kernel
    // that runs, as freeing device memory does), and the communicator is failed from then on.
    spin_for<<<1, 1, 0, s>>>(1'500'000'000ull);
    t0 = std::chrono::steady_clock::now();
    std::string error;
    try {
      c.synchronize(cuda::stream_ref{s}, "a long spin");
    } catch (wm::comm_error const& e) { error = e.what(); }
    double const gave_up = seconds_since(t0);
    RANK_REQUIRE_MSG(error.find("timed out") != std::string::npos &&
                         error.find("a long spin") != std::string::npos,
                     "error: '" << error << "'");
    RANK_REQUIRE_MSG(gave_up > 0.4 && gave_up < 30.0, "gave up after " << gave_up << " s");
    bool failed = false;
    try {
      c.barrier();
    } catch (wm::comm_error const&) { failed = true; }
    RANK_REQUIRE(failed);
    WM_CUDA_TRY(cudaStreamSynchronize(s));
    WM_CUDA_TRY(cudaStreamDestroy(s));
  });
}

TEST_CASE("ranks: all-gather and all-to-all-v with uneven and zero counts", "[multi_gpu]") {
  int const n              = ranks_for_multi();
  std::uint64_t const seed = std::random_device{}();
  wm::launch(n, [&](wm::communicator& comm) {
    RANK_REQUIRE(comm.size() == n);
    RANK_REQUIRE(comm.local_size() == n);  // one host
    RANK_REQUIRE(comm.local_rank() == comm.rank());
    RANK_REQUIRE(comm.device() == comm.rank() % n);
    check_all_gather(comm, seed);
    for (std::uint64_t round = 0; round < 3; ++round) {
      check_all_to_all(comm, seed + round, false);
    }
    check_all_to_all(comm, seed + 9, true);
    check_send_recv(comm, seed + 11);
    check_empty_send_recv(comm, seed + 12);
  });
}

TEST_CASE("ranks: one rank without the exchange twin turns it off for all; exchanges still work",
          "[multi_gpu]") {
  int const n              = ranks_for_multi();
  std::uint64_t const seed = std::random_device{}();
  wm::launch(n, [&](wm::communicator& comm) {
    for (int without = 0; without < n; ++without) {
      wm::communicator_options options;
      options.exchange_twin = comm.rank() != without;
      options.timeout =
          std::chrono::seconds{30};  // a rank left out of the twin's split would hang here
      auto const mine = comm.rank() == 0 ? wm::unique_id::create().bytes()
                                         : std::array<std::byte, wm::unique_id::size_bytes>{};
      auto const id   = comm.all_gather(mine)[0];  // rank 0's
      wm::communicator c{wm::unique_id::from_bytes(id), comm.rank(), n, options};
      check_send_recv(c, seed + static_cast<std::uint64_t>(without));
      check_all_to_all(c, seed + 50 + static_cast<std::uint64_t>(without), false);
      c.barrier();
    }
  });
}

TEST_CASE("ranks: split by color and key", "[multi_gpu]") {
  int const n              = ranks_for_multi();
  std::uint64_t const seed = std::random_device{}();
  wm::launch(n, [&](wm::communicator& comm) {
    int const me = comm.rank();
    // Two colors; the key reverses the order inside each color.
    auto sub = comm.split(me % 2, -me);
    std::vector<int> members;
    for (int r = 0; r < n; ++r) {
      if (r % 2 == me % 2) { members.push_back(r); }
    }
    std::reverse(members.begin(), members.end());
    RANK_REQUIRE(sub.size() == static_cast<int>(members.size()));
    auto const pos = std::find(members.begin(), members.end(), me) - members.begin();
    RANK_REQUIRE(sub.rank() == pos);
    auto const seen = sub.all_gather(me);
    for (std::size_t i = 0; i < members.size(); ++i) { RANK_REQUIRE(seen[i] == members[i]); }
    check_all_to_all(sub, seed, false);
    // Only rank 0 joins a color; the others opt out.
    auto solo = comm.split(me == 0 ? 1 : -1, 0);
    RANK_REQUIRE(solo.valid() == (me == 0));
    if (me == 0) { RANK_REQUIRE(solo.size() == 1); }
    comm.barrier();  // the parent communicator still works
  });
}

TEST_CASE("ranks: barrier waits for the slowest rank", "[multi_gpu]") {
  int const n = ranks_for_multi();
  wm::launch(n, [&](wm::communicator& comm) {
    comm.barrier();
    auto const start = std::chrono::steady_clock::now();
    if (comm.rank() == n - 1) { std::this_thread::sleep_for(400ms); }
    comm.barrier();
    auto const waited = std::chrono::steady_clock::now() - start;
    RANK_REQUIRE_MSG(waited >= 350ms, "rank " << comm.rank() << " left the barrier early");
  });
}

TEST_CASE("ranks: mismatched collectives are errors on every rank, not hangs", "[multi_gpu]") {
  int const n = ranks_for_multi();
  wm::launch(n, [&](wm::communicator& comm) {
    bool threw = false;
    try {
      if (comm.rank() == 0) {
        comm.barrier();
      } else {
        comm.expect_same("memory", 42);
      }
    } catch (wm::comm_error const& e) {
      threw = std::string{e.what()}.find("mismatched collective") != std::string::npos;
    }
    RANK_REQUIRE(threw);
    // Same call, different arguments.
    threw = false;
    try {
      comm.expect_same("memory", static_cast<std::uint64_t>(comm.rank() == 0 ? 1 : 2));
    } catch (wm::comm_error const&) { threw = true; }
    RANK_REQUIRE(threw);
    comm.barrier();  // the group is still in step
    auto const all = comm.all_gather(comm.rank());
    RANK_REQUIRE(all.back() == n - 1);
  });
}

TEST_CASE("ranks: file descriptors travel over the node channel", "[multi_gpu]") {
  int const n = ranks_for_multi();
  wm::launch(n, [&](wm::communicator& comm) {
    wm::detail::unique_fd fd{::memfd_create("wm-test", MFD_CLOEXEC)};
    RANK_REQUIRE(fd.valid());
    long long const mine = 1000 + comm.rank();
    RANK_REQUIRE(::pwrite(fd.get(), &mine, sizeof(mine), 0) == sizeof(mine));
    auto fds = comm.channel().all_gather(fd.get());
    RANK_REQUIRE(fds.size() == static_cast<std::size_t>(comm.local_size()));
    for (int r = 0; r < comm.local_size(); ++r) {
      long long v = 0;
      RANK_REQUIRE(::pread(fds[static_cast<std::size_t>(r)].get(), &v, sizeof(v), 0) == sizeof(v));
      RANK_REQUIRE(v == 1000 + comm.node_ranks()[static_cast<std::size_t>(r)]);
    }
  });
}

TEST_CASE("ranks: a failing rank is named within seconds; the others do not hang", "[multi_gpu]") {
  int const n = ranks_for_multi();
  SECTION("a rank throws while the others wait in a barrier") {
    auto const start = std::chrono::steady_clock::now();
    try {
      wm::launch(n, [&](wm::communicator& comm) {
        if (comm.rank() == 1) { throw std::runtime_error{"rank one gives up"}; }
        comm.barrier();
      });
      FAIL("no launch_error");
    } catch (wm::launch_error const& e) {
      CHECK(std::chrono::steady_clock::now() - start < 30s);
      REQUIRE_FALSE(e.failures().empty());
      CHECK(e.failures().front().rank == 1);
      CHECK(e.failures().front().reason.find("rank one gives up") != std::string::npos);
    }
  }
  SECTION("a rank dies of a signal") {
    try {
      wm::launch(n, [&](wm::communicator& comm) {
        if (comm.rank() == n - 1) { std::raise(SIGKILL); }
        comm.barrier();
      });
      FAIL("no launch_error");
    } catch (wm::launch_error const& e) {
      REQUIRE_FALSE(e.failures().empty());
      CHECK(e.failures().front().rank == n - 1);
      CHECK(e.failures().front().reason.find("signal 9") != std::string::npos);
    }
  }
  SECTION("a peer that left: the waiting rank's own timeout ends the wait") {
    ::setenv("WM_TIMEOUT_S", "4", 1);
    try {
      wm::launch(n,
                 [&](wm::communicator& comm) {
                   if (comm.rank() != 0) { return; }  // the peers leave without the barrier
                   bool timed_out = false;
                   try {
                     comm.barrier();
                   } catch (wm::comm_error const& e) { timed_out = true; }
                   RANK_REQUIRE(timed_out);
                 },
                 {std::chrono::seconds{60}, std::chrono::seconds{30}});
    } catch (...) {
      ::unsetenv("WM_TIMEOUT_S");
      throw;
    }
    ::unsetenv("WM_TIMEOUT_S");
  }
}

TEST_CASE("ranks: the environment entry point joins a group through an id file", "[multi_gpu]") {
  int const n = ranks_for_multi();
  std::mt19937_64 rng{std::random_device{}()};
  auto const path =
      std::filesystem::temp_directory_path() / ("wm-env-test-" + std::to_string(rng()) + ".id");
  // A file left by an earlier run that died during bootstrap: well-formed, another job, an id
  // whose NCCL root no longer exists. Taking it would hang the ranks until their timeout.
  ncclUniqueId dead{};
  for (auto& c : dead.internal) { c = static_cast<char>(rng()); }
  {
    std::ofstream stale{path};
    stale << wm::detail::format_id_file({"earlier-run", wm::detail::unix_ms_now(),
                                         wm::unique_id::from_parts(rng(), dead).to_string()});
  }
  std::string const job = "this-run-" + std::to_string(rng());
  wm::detail::fork_ranks(
      n,
      [&](wm::detail::rank_context& ctx) {
        ::setenv("WM_JOB_ID", job.c_str(), 1);
        ::setenv("WM_TIMEOUT_S", "60", 1);
        ::setenv("RANK", std::to_string(ctx.rank()).c_str(), 1);
        ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
        ::setenv("LOCAL_RANK", std::to_string(ctx.rank()).c_str(), 1);
        ::setenv("WM_ID_FILE", path.c_str(), 1);
        if (ctx.rank() == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds{500});
        }  // others see the stale file
        auto comm = wm::communicator_from_env();
        RANK_REQUIRE(comm.rank() == ctx.rank() && comm.size() == n);
        RANK_REQUIRE(comm.device() == ctx.rank() % n);
        auto const seen = comm.all_gather(comm.rank());
        RANK_REQUIRE(seen.back() == n - 1);
        comm.barrier();
        RANK_REQUIRE(!std::filesystem::exists(path));  // rank 0 removed it after everyone joined
      },
      {std::chrono::seconds{120}, std::chrono::seconds{5}});
}

// ---- cases run inside every rank (--ranks; tests/support/ranks.hpp) ----------------------------

TEST_CASE("ranked: every rank runs this case with its own communicator and GPU", "[ranked]") {
  auto& comm       = wm_test::comm();
  auto const ranks = comm.all_gather(comm.rank());
  REQUIRE(static_cast<int>(ranks.size()) == comm.size());
  for (int r = 0; r < comm.size(); ++r) { CHECK(ranks[static_cast<std::size_t>(r)] == r); }
  int device = -1;
  REQUIRE(cudaGetDevice(&device) == cudaSuccess);
  CHECK(device == comm.device());
}

TEST_CASE("ranked: a device all-to-all between every pair of ranks", "[ranked][multi]") {
  auto& comm    = wm_test::comm();
  auto const w  = static_cast<std::size_t>(comm.size());
  auto const me = static_cast<std::size_t>(comm.rank());
  // Rank r sends q + 1 ints of value 1000 r + q to rank q.
  std::vector<std::size_t> send_counts(w), recv_counts(w);
  std::vector<int> send;
  for (std::size_t q = 0; q < w; ++q) {
    send_counts[q] = q + 1;
    recv_counts[q] = me + 1;
    for (std::size_t i = 0; i <= q; ++i) { send.push_back(static_cast<int>(1000 * me + q)); }
  }
  std::size_t const n_recv = w * (me + 1);
  int *d_send = nullptr, *d_recv = nullptr;
  REQUIRE(cudaMalloc(&d_send, send.size() * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMalloc(&d_recv, n_recv * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMemcpy(d_send, send.data(), send.size() * sizeof(int), cudaMemcpyHostToDevice) ==
          cudaSuccess);
  REQUIRE(cudaMemset(d_recv, 0xff, n_recv * sizeof(int)) == cudaSuccess);  // poisoned
  comm.all_to_all_v(d_send, std::span<std::size_t const>{send_counts}, d_recv,
                    std::span<std::size_t const>{recv_counts}, cuda::stream_ref{cudaStreamLegacy});
  comm.synchronize(cuda::stream_ref{cudaStreamLegacy}, "ranked all-to-all");
  std::vector<int> got(n_recv);
  REQUIRE(cudaMemcpy(got.data(), d_recv, n_recv * sizeof(int), cudaMemcpyDeviceToHost) ==
          cudaSuccess);
  for (std::size_t q = 0; q < w; ++q) {
    for (std::size_t i = 0; i <= me; ++i) {
      CHECK(got[q * (me + 1) + i] == static_cast<int>(1000 * q + me));
    }
  }
  (void)cudaFree(d_send);
  (void)cudaFree(d_recv);
}
