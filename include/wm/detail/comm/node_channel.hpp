// wm::node_channel: passes POSIX file descriptors between the ranks of one node over AF_UNIX
// sockets with SCM_RIGHTS. Host-only; compiles with g++.
//
// Each rank listens on an abstract-namespace socket named from the group's token and its rank.
// Abstract sockets have no file system entry: nothing is left behind after a crash. A message is
// one SOCK_SEQPACKET datagram on a fresh connection: a header (token, source rank, tag) plus at
// most one descriptor. The receiver keeps messages that arrive early (a later tag, another
// source) until they are asked for.
#pragma once

#include <wm/detail/comm/posix.hpp>
#include <wm/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

namespace wm {

/**
 * @brief Node-local channel that passes POSIX file descriptors between ranks of one host.
 *
 * Used by `wm::memory` to share VMM allocations (`cuMemExportToShareableHandle` fds) and shared
 * host memory (`memfd_create` fds). Ranks are addressed by their rank in the owning
 * communicator; only ranks listed in `node_ranks` can be reached.
 */
class node_channel {
 public:
  node_channel() = default;

  /**
   * @brief Opens the channel of @p rank for the group identified by @p token.
   * @param token group identity shared by all ranks (from the unique id)
   * @param rank this process's rank in the group
   * @param node_ranks the ranks on this node, ascending, including @p rank
   * @param timeout how long a receive or a connection waits for a peer
   * @throw wm::comm_error if the socket cannot be bound (e.g. the name is taken)
   */
  node_channel(std::uint64_t token,
               int rank,
               std::vector<int> node_ranks,
               std::chrono::milliseconds timeout)
    : token_{token}, rank_{rank}, node_ranks_{std::move(node_ranks)}, timeout_{timeout}
  {
    WM_EXPECTS(std::is_sorted(node_ranks_.begin(), node_ranks_.end()) &&
                 std::find(node_ranks_.begin(), node_ranks_.end(), rank) != node_ranks_.end(),
               "node_ranks must be ascending and contain this rank");
    listen_.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!listen_.valid()) { throw comm_error{"wm: node channel: socket(): " + detail::errno_text()}; }
    auto [addr, len] = address(rank_);
    if (::bind(listen_.get(), reinterpret_cast<sockaddr const*>(&addr), len) != 0) {
      throw comm_error{"wm: node channel: cannot bind socket '" + name(rank_) +
                       "': " + detail::errno_text() + " (another group with the same id?)"};
    }
    if (::listen(listen_.get(), 256) != 0) {
      throw comm_error{"wm: node channel: listen(): " + detail::errno_text()};
    }
  }

  node_channel(node_channel&&) noexcept            = default;
  node_channel& operator=(node_channel&&) noexcept = default;
  node_channel(node_channel const&)                = delete;
  node_channel& operator=(node_channel const&)     = delete;
  ~node_channel() = default;  // unique_fd members close the socket and undelivered descriptors

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] std::vector<int> const& node_ranks() const noexcept { return node_ranks_; }
  [[nodiscard]] bool valid() const noexcept { return listen_.valid(); }

  /**
   * @brief Sends a duplicate of @p fd (or no descriptor if @p fd < 0) with @p payload to @p dst.
   * The caller keeps ownership of @p fd. Waits up to the timeout for @p dst to listen.
   */
  void send(int dst, std::uint64_t tag, int fd, std::uint64_t payload = 0) const
  {
    check_peer(dst);
    detail::unique_fd s{::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)};
    if (!s.valid()) { throw comm_error{"wm: node channel: socket(): " + detail::errno_text()}; }
    auto [addr, len]    = address(dst);
    auto const deadline = detail::clock_type::now() + timeout_;
    auto pause          = std::chrono::microseconds{100};
    while (::connect(s.get(), reinterpret_cast<sockaddr const*>(&addr), len) != 0) {
      if (errno == EINTR) { continue; }
      if ((errno != ECONNREFUSED && errno != ENOENT && errno != EAGAIN) ||
          detail::clock_type::now() >= deadline) {
        throw comm_error{"wm: node channel: rank " + std::to_string(rank_) +
                         " cannot reach rank " + std::to_string(dst) + ": " +
                         detail::errno_text() + " (peer not running?)"};
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds{20000});
    }
    header h{magic, token_, rank_, tag, payload};
    iovec iov{&h, sizeof(h)};
    msghdr msg{};
    msg.msg_iov    = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))]{};
    if (fd >= 0) {
      msg.msg_control    = control;
      msg.msg_controllen = sizeof(control);
      auto* c            = CMSG_FIRSTHDR(&msg);
      c->cmsg_level      = SOL_SOCKET;
      c->cmsg_type       = SCM_RIGHTS;
      c->cmsg_len        = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    ssize_t sent{};
    do {
      sent = ::sendmsg(s.get(), &msg, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    if (sent != static_cast<ssize_t>(sizeof(h))) {
      throw comm_error{"wm: node channel: sending to rank " + std::to_string(dst) +
                       " failed: " + detail::errno_text()};
    }
  }

  /// One received message: the descriptor (may be invalid) and the payload word.
  struct message {
    detail::unique_fd fd;
    std::uint64_t payload{};
  };

  /**
   * @brief Receives the message that @p src sent with @p tag; waits up to the timeout.
   * @throw wm::comm_error on timeout (the peer died or never sent)
   */
  [[nodiscard]] message receive(int src, std::uint64_t tag)
  {
    check_peer(src);
    auto const deadline = detail::clock_type::now() + timeout_;
    while (true) {
      if (auto it = pending_.find({src, tag}); it != pending_.end()) {
        message m = std::move(it->second);
        pending_.erase(it);
        return m;
      }
      pollfd p{listen_.get(), POLLIN, 0};
      int const ready = ::poll(&p, 1, detail::millis_left(deadline));
      if (ready < 0 && errno == EINTR) { continue; }
      if (ready == 0) {
        throw comm_error{"wm: node channel: rank " + std::to_string(rank_) +
                         " got nothing from rank " + std::to_string(src) + " (tag " +
                         std::to_string(tag) + ") within " + std::to_string(timeout_.count()) +
                         " ms; did that rank fail or skip a collective call?"};
      }
      if (ready < 0) { throw comm_error{"wm: node channel: poll(): " + detail::errno_text()}; }
      accept_one();
    }
  }

  /**
   * @brief Collective over the node's ranks: every rank contributes @p fd and receives one
   * descriptor per node rank (its own as a duplicate), in the order of `node_ranks()`.
   */
  [[nodiscard]] std::vector<detail::unique_fd> all_gather(int fd)
  {
    std::uint64_t const tag = (std::uint64_t{1} << 63) | collective_seq_++;
    for (int r : node_ranks_) {
      if (r != rank_) { send(r, tag, fd); }
    }
    std::vector<detail::unique_fd> out;
    out.reserve(node_ranks_.size());
    for (int r : node_ranks_) {
      if (r == rank_) {
        out.emplace_back(fd >= 0 ? ::fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1);
      } else {
        out.push_back(receive(r, tag).fd);
      }
    }
    return out;
  }

  /// The abstract socket name of @p rank in this group (for diagnostics).
  [[nodiscard]] std::string name(int rank) const
  {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "wm-%016llx-%d", static_cast<unsigned long long>(token_), rank);
    return buf;
  }

 private:
  static constexpr std::uint64_t magic = 0x776d2d6e6f646531ull;  // "wm-node1"

  struct header {
    std::uint64_t magic;
    std::uint64_t token;
    std::int32_t src;
    std::uint64_t tag;
    std::uint64_t payload;
  };

  [[nodiscard]] std::pair<sockaddr_un, socklen_t> address(int rank) const
  {
    sockaddr_un addr{};
    addr.sun_family     = AF_UNIX;
    std::string const n = name(rank);
    // Abstract namespace: sun_path starts with a NUL byte; the name is not NUL-terminated.
    std::memcpy(addr.sun_path + 1, n.data(), n.size());
    return {addr, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n.size())};
  }

  void check_peer(int r) const
  {
    WM_EXPECTS(listen_.valid(), "node channel is not open");
    WM_EXPECTS(std::binary_search(node_ranks_.begin(), node_ranks_.end(), r),
               "rank " + std::to_string(r) + " is not on this node");
  }

  void accept_one()
  {
    detail::unique_fd conn{::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC)};
    if (!conn.valid()) { return; }  // peer gave up; ignore
    header h{};
    iovec iov{&h, sizeof(h)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))]{};
    msghdr msg{};
    msg.msg_iov        = &iov;
    msg.msg_iovlen     = 1;
    msg.msg_control    = control;
    msg.msg_controllen = sizeof(control);
    ssize_t got{};
    do {
      got = ::recvmsg(conn.get(), &msg, MSG_CMSG_CLOEXEC);
    } while (got < 0 && errno == EINTR);
    detail::unique_fd passed;
    for (auto* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        int fd{};
        std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
        passed.reset(fd);
      }
    }
    if (got != static_cast<ssize_t>(sizeof(h)) || h.magic != magic || h.token != token_) {
      return;  // not ours: drop it (and close any descriptor that came with it)
    }
    pending_[{h.src, h.tag}] = message{std::move(passed), h.payload};
  }

  detail::unique_fd listen_;
  std::uint64_t token_{};
  int rank_{-1};
  std::vector<int> node_ranks_;
  std::chrono::milliseconds timeout_{};
  std::uint64_t collective_seq_{};
  std::map<std::pair<int, std::uint64_t>, message> pending_;
};

}  // namespace wm
