// Host tests of fd passing between forked processes over the node channel.
#include "catch.hpp"
#include "rank_check.hpp"

#include <wm/comm.hpp>
#include <wm/launch.hpp>

#include <fstream>
#include <random>
#include <string>

#include <sys/mman.h>

using namespace std::chrono_literals;

namespace {
std::string text_of(int rank, std::uint64_t salt)
{
  return "rank " + std::to_string(rank) + " salt " + std::to_string(salt);
}

bool socket_listed(std::string const& name)
{
  std::ifstream in{"/proc/net/unix"};
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("@" + name) != std::string::npos) { return true; }
  }
  return false;
}
}  // namespace

TEST_CASE("node_channel passes file descriptors between forked ranks", "[host]")
{
  int const n = GENERATE(1, 2, 4);
  std::mt19937_64 rng{std::random_device{}()};
  std::uint64_t const token = rng();
  std::uint64_t const salt  = rng();
  std::vector<int> ranks(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) { ranks[static_cast<std::size_t>(r)] = r; }

  REQUIRE_NOTHROW(wm::detail::fork_ranks(
    n,
    [&](wm::detail::rank_context& ctx) {
      int const me = ctx.rank();
      wm::node_channel ch{token, me, ranks, 10s};
      // Each rank shares a memfd holding its own text; every rank reads every rank's text.
      wm::detail::unique_fd mine{::memfd_create("wm-test", MFD_CLOEXEC)};
      RANK_REQUIRE(mine.valid());
      auto const text = text_of(me, salt);
      RANK_REQUIRE(::pwrite(mine.get(), text.data(), text.size(), 0) ==
                   static_cast<ssize_t>(text.size()));
      for (int round = 0; round < 3; ++round) {  // repeated collectives stay in step
        auto fds = ch.all_gather(mine.get());
        RANK_REQUIRE(fds.size() == static_cast<std::size_t>(n));
        for (int r = 0; r < n; ++r) {
          auto const expect = text_of(r, salt);
          std::string got(expect.size(), '\0');
          RANK_REQUIRE(fds[static_cast<std::size_t>(r)].valid());
          RANK_REQUIRE(::pread(fds[static_cast<std::size_t>(r)].get(), got.data(), got.size(),
                               0) == static_cast<ssize_t>(got.size()));
          RANK_REQUIRE_MSG(got == expect, "round " << round << " from rank " << r);
        }
      }
      // Point to point, received out of the order sent: tags keep messages apart.
      int const next = (me + 1) % n;
      int const prev = (me + n - 1) % n;
      ch.send(next, 7, -1, 700 + static_cast<std::uint64_t>(me));
      ch.send(next, 5, mine.get(), 500 + static_cast<std::uint64_t>(me));
      auto m7 = ch.receive(prev, 7);
      auto m5 = ch.receive(prev, 5);
      RANK_REQUIRE(m7.payload == 700 + static_cast<std::uint64_t>(prev));
      RANK_REQUIRE(!m7.fd.valid());
      RANK_REQUIRE(m5.payload == 500 + static_cast<std::uint64_t>(prev));
      RANK_REQUIRE(m5.fd.valid());
      RANK_REQUIRE(socket_listed(ch.name(me)));
    },
    {30s, 2s}));
  // Abstract sockets vanish with their processes: nothing is left behind.
  for (int r = 0; r < n; ++r) {
    wm::node_channel probe;
    CHECK_FALSE(socket_listed("wm-" + [&] {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%016llx-%d", static_cast<unsigned long long>(token), r);
      return std::string{buf};
    }()));
  }
}

TEST_CASE("node_channel reports a missing peer instead of hanging", "[host]")
{
  std::mt19937_64 rng{std::random_device{}()};
  std::uint64_t const token = rng();
  wm::node_channel ch{token, 0, {0, 1}, 300ms};
  auto const start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS((void)ch.receive(1, 1), wm::comm_error);
  CHECK_THROWS_AS(ch.send(1, 1, -1), wm::comm_error);  // rank 1 never listens
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  CHECK_THROWS_AS(ch.send(2, 1, -1), wm::logic_error);  // not a node rank
  // A second channel with the same name cannot bind: two groups never share sockets.
  CHECK_THROWS_AS((wm::node_channel{token, 0, {0, 1}, 300ms}), wm::comm_error);
}
