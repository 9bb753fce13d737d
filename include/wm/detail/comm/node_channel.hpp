// SPDX-License-Identifier: Apache-2.0
// Bodies of wm::node_channel (declared in <wm/comm.hpp>): descriptor passing between the ranks
// of one node over AF_UNIX sockets with SCM_RIGHTS. Host-only; compiles with g++.
#pragma once

#include <wm/comm.hpp>
#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/hash.hpp>
#include <wm/detail/base/posix.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <sys/un.h>
#include <thread>
#include <utility>
#include <vector>

namespace wm {
namespace detail {

/// What a node-channel message carries before its descriptor (one datagram, exactly this size).
struct node_wire_header {
  std::uint64_t magic;    ///< node_wire_magic
  std::uint64_t token;    ///< the group token
  std::int32_t src;       ///< sender's rank
  std::uint32_t fds;      ///< descriptors that come with it: 0 or 1
  std::uint64_t tag;      ///< what the receiver asks for
  std::uint64_t payload;  ///< one word of data
};
static_assert(sizeof(node_wire_header) == 40);

inline constexpr std::uint64_t node_wire_magic = 0x3265646f6e2d6d77ull;  // "wm-node2"

/// Most connections kept open while their message has not arrived; the oldest goes first.
inline constexpr std::size_t node_channel_max_open = 64;

[[nodiscard]] inline std::pair<sockaddr_un, socklen_t> abstract_address(std::string const& name) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  // Abstract namespace: sun_path starts with a NUL byte; the name is not NUL-terminated.
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  return {addr, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())};
}

/// The user id of the process at the other end of a connected AF_UNIX socket, or -1.
[[nodiscard]] inline long long peer_uid(int fd) noexcept {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred)) {
    return -1;
  }
  return static_cast<long long>(cred.uid);
}

}  // namespace detail

inline std::string node_channel::socket_name(std::uint64_t token, int rank) {
  char data[32];
  int const n           = std::snprintf(data, sizeof(data), "wm-node-channel/%d", rank);
  std::uint64_t const h = detail::siphash24(token, 0x6e6f64652d6e616dull,
                                            std::string_view{data, static_cast<std::size_t>(n)});
  char buf[32];
  std::snprintf(buf, sizeof(buf), "wm-%016llx", static_cast<unsigned long long>(h));
  return buf;
}

inline node_channel::node_channel(std::uint64_t token, int rank, std::vector<int> node_ranks,
                                  std::chrono::milliseconds timeout)
    : token_{token}, rank_{rank}, node_ranks_{std::move(node_ranks)}, timeout_{timeout} {
  WM_EXPECTS(std::is_sorted(node_ranks_.begin(), node_ranks_.end()) &&
                 std::find(node_ranks_.begin(), node_ranks_.end(), rank) != node_ranks_.end(),
             "node_ranks must be ascending and contain this rank");
  listen_.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listen_.valid()) { throw comm_error{"wm: node channel: socket(): " + detail::errno_text()}; }
  auto [addr, len] = detail::abstract_address(name(rank_));
  if (::bind(listen_.get(), reinterpret_cast<sockaddr const*>(&addr), len) != 0) {
    int const err = errno;
    listen_.reset();
    throw comm_error{"wm: node channel: cannot bind socket '" + name(rank_) +
                     "': " + detail::errno_text(err) + " (another group with the same id?)"};
  }
  if (::listen(listen_.get(), 256) != 0) {
    int const err = errno;
    listen_.reset();
    throw comm_error{"wm: node channel: listen(): " + detail::errno_text(err)};
  }
}

inline void node_channel::send(int dst, std::uint64_t tag, int fd, std::uint64_t payload) const {
  check_peer(dst);
  detail::unique_fd s{::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0)};
  if (!s.valid()) { throw comm_error{"wm: node channel: socket(): " + detail::errno_text()}; }
  auto [addr, len]    = detail::abstract_address(name(dst));
  auto const deadline = detail::deadline_after(timeout_);
  auto unreachable    = [&](std::string const& why) {
    return comm_error{"wm: node channel: rank " + std::to_string(rank_) + " cannot reach rank " +
                      std::to_string(dst) + ": " + why};
  };
  auto pause = std::chrono::microseconds{100};
  // Non-blocking: a full backlog (EAGAIN) is retried until the deadline, never waited on.
  while (::connect(s.get(), reinterpret_cast<sockaddr const*>(&addr), len) != 0) {
    if (errno == EINTR) { continue; }
    if (errno != ECONNREFUSED && errno != ENOENT && errno != EAGAIN) {
      throw unreachable(detail::errno_text());
    }
    if (detail::clock_type::now() >= deadline) {
      throw unreachable(detail::errno_text() + " until the timeout (" +
                        detail::timeout_text(timeout_) + "; peer not running?)");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds{20000});
  }
  // The listener must be a process of this user: descriptors go to no one else.
  if (detail::peer_uid(s.get()) != static_cast<long long>(::geteuid())) {
    throw unreachable("the socket '" + name(dst) + "' belongs to another user");
  }
  detail::node_wire_header h{detail::node_wire_magic, token_, rank_,
                             fd >= 0 ? 1u : 0u,       tag,    payload};
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
  while (true) {
    ssize_t const sent = ::sendmsg(s.get(), &msg, MSG_NOSIGNAL);
    if (sent == static_cast<ssize_t>(sizeof(h))) { return; }
    if (sent < 0 && errno == EINTR) { continue; }
    if (sent < 0 && errno == EAGAIN && detail::clock_type::now() < deadline) {
      pollfd p{s.get(), POLLOUT, 0};
      (void)::poll(&p, 1, std::min(detail::millis_left(deadline), 100));
      continue;
    }
    throw comm_error{"wm: node channel: sending to rank " + std::to_string(dst) +
                     " failed: " + (sent < 0 ? detail::errno_text() : "short write")};
  }
}

inline node_channel::message node_channel::receive(int src, std::uint64_t tag) {
  check_peer(src);
  auto const deadline = detail::deadline_after(timeout_);
  std::vector<pollfd> polls;
  while (true) {
    if (auto it = pending_.find({src, tag}); it != pending_.end()) {
      message m = std::move(it->second);
      pending_.erase(it);
      return m;
    }
    auto const now = detail::clock_type::now();
    drop_expired(now);
    if (now >= deadline) {
      throw comm_error{"wm: node channel: rank " + std::to_string(rank_) +
                       " got nothing from rank " + std::to_string(src) + " (tag " +
                       std::to_string(tag) + ") within " + detail::timeout_text(timeout_) +
                       "; did that rank fail or skip a collective call?"};
    }
    // The listening socket and every accepted connection at once: one that stays silent holds
    // up no other. Woken at the deadline, or when the oldest connection expires.
    auto wake = deadline;
    polls.assign(1, pollfd{listen_.get(), POLLIN, 0});
    for (auto const& c : open_) {
      polls.push_back({c.fd.get(), POLLIN, 0});
      wake = std::min(wake, c.expires);
    }
    int const ready = ::poll(polls.data(), polls.size(), detail::millis_left(wake));
    if (ready < 0 && errno != EINTR) {
      throw comm_error{"wm: node channel: poll(): " + detail::errno_text()};
    }
    if (ready <= 0) { continue; }
    // Connections first (their indices shift when one closes), newest last.
    for (std::size_t i = polls.size(); i-- > 1;) {
      if (polls[i].revents != 0) { read_message(polls[i].fd); }
    }
    if ((polls[0].revents & POLLIN) != 0) { accept_ready(); }
  }
}

inline std::vector<detail::unique_fd> node_channel::all_gather(int fd) {
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

inline void node_channel::check_peer(int r) const {
  WM_EXPECTS(listen_.valid(), "node channel is not open");
  WM_EXPECTS(std::binary_search(node_ranks_.begin(), node_ranks_.end(), r),
             "rank " + std::to_string(r) + " is not on this node");
}

inline void node_channel::accept_ready() {
  // A connection gets the channel's timeout (at most a minute) to deliver its one message.
  auto const life = std::min<std::chrono::milliseconds>(timeout_, std::chrono::minutes{1});
  while (true) {
    detail::unique_fd conn{
        ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK)};
    if (!conn.valid()) {
      if (errno == EINTR || errno == ECONNABORTED) { continue; }
      return;  // EAGAIN: none left (other errors: the next poll tells)
    }
    if (detail::peer_uid(conn.get()) != static_cast<long long>(::geteuid())) {
      continue;  // another user's process: closed unread
    }
    if (open_.size() >= detail::node_channel_max_open) { open_.erase(open_.begin()); }
    open_.push_back({std::move(conn), detail::deadline_after(life)});
  }
}

inline void node_channel::drop_expired(detail::clock_type::time_point now) {
  std::erase_if(open_, [&](connection const& c) { return c.expires <= now; });
}

inline void node_channel::read_message(int conn) {
  auto const at = std::find_if(open_.begin(), open_.end(),
                               [&](connection const& c) { return c.fd.get() == conn; });
  if (at == open_.end()) { return; }
  detail::node_wire_header h{};
  iovec iov{&h, sizeof(h)};
  // Room for more descriptors than a message may carry: extra ones arrive, are seen and closed.
  alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))]{};
  msghdr msg{};
  msg.msg_iov        = &iov;
  msg.msg_iovlen     = 1;
  msg.msg_control    = control;
  msg.msg_controllen = sizeof(control);
  ssize_t got{};
  do {
    got = ::recvmsg(conn, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  } while (got < 0 && errno == EINTR);
  if (got < 0 && errno == EAGAIN) { return; }  // woken by something else; keep waiting
  // Every descriptor that came is owned here first, so that whatever is rejected is closed.
  std::vector<detail::unique_fd> passed;
  bool odd_control = (msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) != 0;
  if (got >= 0) {
    for (auto* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
        odd_control = true;
        continue;
      }
      std::size_t const count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd{};
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        passed.emplace_back(fd);
      }
    }
  }
  open_.erase(at);  // one message per connection: done with it, whatever it held
  bool const ours = got == static_cast<ssize_t>(sizeof(h)) && !odd_control &&
                    h.magic == detail::node_wire_magic && h.token == token_ &&
                    std::binary_search(node_ranks_.begin(), node_ranks_.end(), h.src) &&
                    h.fds <= 1 && passed.size() == h.fds;
  if (!ours) { return; }  // not a message of this group: dropped, its descriptors closed
  message m{h.fds == 1 ? std::move(passed.front()) : detail::unique_fd{}, h.payload};
  pending_.emplace(std::pair{h.src, h.tag}, std::move(m));
}

}  // namespace wm
