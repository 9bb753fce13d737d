// SPDX-License-Identifier: Apache-2.0
/**
 * @file decl/comm.hpp
 * @brief The declarations of `<wm/comm.hpp>` without their bodies, for `<wm/wm.cuh>`: every
 * type and signature, none of the definitions (docs/design.md, "Compile time").
 */
#pragma once

#include <wm/detail/base/deadline.hpp>
#include <wm/detail/base/posix.hpp>
#include <wm/detail/comm/nccl.hpp>
#include <wm/error.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace wm {

/**
 * @brief Identity of a communicator before it exists: an NCCL unique id plus a random token
 * that names the group's node-local sockets.
 *
 * One rank calls `unique_id::create()`; the launcher carries `bytes()` or `to_string()` to every
 * rank (MPI broadcast, a file, a pipe, an environment variable), which rebuilds it with
 * `from_bytes` / `from_string`. Treat it as a secret of the job: whoever holds it can join the
 * group.
 */
class unique_id {
 public:
  static constexpr std::size_t size_bytes = 16 + sizeof(ncclUniqueId);  ///< serialized size

  unique_id() = default;  ///< an invalid id (all zero)

  /**
   * @brief Creates a fresh id (calls `ncclGetUniqueId`; touches no GPU).
   * @throw wm::comm_error if NCCL cannot create an id
   */
  [[nodiscard]] static unique_id create();

  /// Builds an id from @p token and raw NCCL id bytes (tests, custom bootstraps).
  [[nodiscard]] static unique_id from_parts(std::uint64_t token, ncclUniqueId const& nccl) noexcept;

  /// The serialized form: exactly `size_bytes` bytes.
  [[nodiscard]] std::array<std::byte, size_bytes> bytes() const noexcept;

  /**
   * @brief Rebuilds an id from `bytes()`.
   * @throw wm::logic_error if the size or the format marker is wrong
   */
  [[nodiscard]] static unique_id from_bytes(std::span<std::byte const> b);

  /// Lower-case hexadecimal of `bytes()` (2 * size_bytes characters), e.g. for an env variable.
  [[nodiscard]] std::string to_string() const;

  /// Parses `to_string()` (either case). @throw wm::logic_error on a wrong length or a non-hex
  /// character
  [[nodiscard]] static unique_id from_string(std::string_view s);

  [[nodiscard]] bool valid() const noexcept { return magic_ == magic; }  ///< made by create()
  [[nodiscard]] std::uint64_t token() const noexcept { return token_; }  ///< the group token
  [[nodiscard]] ncclUniqueId const& nccl_id() const noexcept { return nccl_; }  ///< NCCL's id

  friend bool operator==(unique_id const& a, unique_id const& b) noexcept {
    return a.bytes() == b.bytes();
  }

 private:
  static constexpr std::uint64_t magic = 0x31302d64692d6d77ull;  // "wm-id-01"
  static std::uint64_t random_token();

  std::uint64_t magic_{};
  std::uint64_t token_{};
  ncclUniqueId nccl_{};
};

/**
 * @brief Node-local channel that passes POSIX file descriptors between the ranks of one host,
 * over AF_UNIX `SOCK_SEQPACKET` sockets with `SCM_RIGHTS`.
 *
 * Used by `wm::memory` to share VMM allocations (`cuMemExportToShareableHandle` fds) and shared
 * host memory (`memfd_create` fds). Ranks are addressed by their rank in the owning
 * communicator; only ranks listed in `node_ranks` can be reached.
 *
 * Each rank listens on an abstract-namespace socket (no file system entry: nothing is left
 * behind after a crash) whose name is a keyed hash (SipHash-2-4) of the group token and the
 * rank: `/proc/net/unix` shows the name, never the token. A message is one datagram on a fresh
 * connection: a header (format marker, token, source rank, tag, payload, whether a descriptor
 * follows) plus at most one descriptor. The receiver takes a message only from a process of its
 * own user (`SO_PEERCRED`), with the group's token, a source rank of this node, and exactly the
 * descriptors the header announces; anything else is dropped and every descriptor that came with it
 * closed. Connections are accepted and read without blocking, all at once: a process that connects
 * and sends nothing delays no message and no deadline. Messages that arrive early (a later tag,
 * another source) are kept until they are asked for.
 */
class node_channel {
 public:
  node_channel() = default;  ///< a closed channel (`valid() == false`)

  /**
   * @brief Opens the channel of @p rank for the group identified by @p token.
   * @param token group identity shared by all ranks (from the unique id)
   * @param rank this process's rank in the group
   * @param node_ranks the ranks on this node, ascending, including @p rank
   * @param timeout how long a receive or a connection waits for a peer
   * (`milliseconds::max()`: no limit)
   * @throw wm::logic_error if @p node_ranks is not ascending or lacks @p rank
   * @throw wm::comm_error if the socket cannot be bound (e.g. the name is taken)
   */
  node_channel(std::uint64_t token, int rank, std::vector<int> node_ranks,
               std::chrono::milliseconds timeout);

  node_channel(node_channel&&) noexcept            = default;  ///< takes the socket
  node_channel& operator=(node_channel&&) noexcept = default;  ///< closes this, takes the other
  node_channel(node_channel const&)                = delete;
  node_channel& operator=(node_channel const&)     = delete;
  ~node_channel() = default;  ///< closes the socket, open connections and undelivered descriptors

  [[nodiscard]] int rank() const noexcept { return rank_; }  ///< this rank
  /// The ranks on this node, ascending.
  [[nodiscard]] std::vector<int> const& node_ranks() const noexcept { return node_ranks_; }
  [[nodiscard]] bool valid() const noexcept { return listen_.valid(); }  ///< open

  /**
   * @brief Sends a duplicate of @p fd (or no descriptor if @p fd < 0) with @p payload to @p dst.
   * The caller keeps ownership of @p fd. Waits up to the timeout for @p dst to listen.
   * @throw wm::logic_error if @p dst is not a rank of this node
   * @throw wm::comm_error if @p dst cannot be reached within the timeout, or the socket that
   * answers belongs to another user
   */
  void send(int dst, std::uint64_t tag, int fd, std::uint64_t payload = 0) const;

  /// One received message: the descriptor (may be invalid) and the payload word.
  struct message {
    detail::unique_fd fd;     ///< the descriptor sent, or invalid if none was
    std::uint64_t payload{};  ///< the sender's payload word
  };

  /**
   * @brief Receives the message that @p src sent with @p tag; waits up to the timeout.
   * @throw wm::logic_error if @p src is not a rank of this node
   * @throw wm::comm_error on timeout (the peer died or never sent)
   */
  [[nodiscard]] message receive(int src, std::uint64_t tag);

  /**
   * @brief Collective over the node's ranks: every rank contributes @p fd and receives one
   * descriptor per node rank (its own as a duplicate), in the order of `node_ranks()`.
   */
  [[nodiscard]] std::vector<detail::unique_fd> all_gather(int fd);

  /// The abstract socket name of @p rank in this group (for diagnostics).
  [[nodiscard]] std::string name(int rank) const { return socket_name(token_, rank); }

  /// The abstract socket name of @p rank in the group of @p token: "wm-" and 16 hex digits of
  /// SipHash-2-4 keyed by the token (the token cannot be read back from it).
  [[nodiscard]] static std::string socket_name(std::uint64_t token, int rank);

 private:
  struct connection {  // accepted, its message not read yet
    detail::unique_fd fd;
    detail::clock_type::time_point expires;
  };

  void check_peer(int r) const;
  void accept_ready();
  void read_message(int conn);
  void drop_expired(detail::clock_type::time_point now);

  detail::unique_fd listen_;
  std::uint64_t token_{};
  int rank_{-1};
  std::vector<int> node_ranks_;
  std::chrono::milliseconds timeout_{};
  std::uint64_t collective_seq_{};
  std::multimap<std::pair<int, std::uint64_t>, message> pending_;  // in arrival order
  std::vector<connection> open_;
};

/// Reduction of the device collectives `communicator::all_reduce` and `reduce_scatter`.
enum class reduce_op : std::uint8_t {
  sum,  ///< element-wise sum (an inf or NaN on any rank makes the result inf or NaN)
  max   ///< element-wise maximum
};

/** @brief Settings of a communicator. */
struct communicator_options {
  /// How long any wait for peers may take before it fails with `wm::comm_error`;
  /// `std::chrono::milliseconds::max()` (or any value too large for the clock) means no limit.
  /// The environment variable `WM_TIMEOUT_S` (seconds; `inf` for no limit) overrides the default
  /// of 300 s.
  std::chrono::milliseconds timeout{default_timeout()};
  /// Device exchanges (`send_recv`, `all_to_all_v`, and the distributed gather and scatter
  /// built on them) through a blocking twin of the NCCL communicator: ~10 us of host time per
  /// call instead of 60-110 us, for a second NCCL communicator's GPU memory (~0.2-0.4 GiB per
  /// GPU measured with NCCL 2.28 on an H200 with one rank; its connections to peers add to it).
  /// `WM_EXCHANGE_TWIN=0` turns the default off; if any rank turns it off, no rank uses it.
  bool exchange_twin{default_exchange_twin()};

  /// `WM_TIMEOUT_S` if set, else 300 s. @throw wm::logic_error if `WM_TIMEOUT_S` is malformed
  [[nodiscard]] static std::chrono::milliseconds default_timeout() {
    if (char const* s = std::getenv("WM_TIMEOUT_S"); s != nullptr && *s != '\0') {
      return detail::parse_timeout_seconds(s, "WM_TIMEOUT_S");
    }
    return std::chrono::seconds{300};
  }
  /// false if `WM_EXCHANGE_TWIN` is `0`, else true.
  [[nodiscard]] static bool default_exchange_twin() {
    char const* s = std::getenv("WM_EXCHANGE_TWIN");
    return s == nullptr || std::string_view{s} != "0";
  }
};

/**
 * @brief A group of ranks, one process per GPU, with NCCL collectives and host-side exchange.
 *
 * Construction is collective: every rank calls it with the same id and size and its own rank,
 * after selecting its GPU with `cudaSetDevice`. Move-only; memory, tensors and embeddings keep
 * its address, so do not move it while any of them lives.
 */
class communicator {
 public:
  /// An empty communicator (`valid() == false`), e.g. what `split` gives a rank with color < 0.
  communicator() = default;

  /**
   * @brief Joins the group (collective).
   * @param id the id that one rank created with `unique_id::create()`
   * @param rank this process's rank, in [0, size)
   * @param size the number of ranks
   * @param options timeouts
   * @throw wm::logic_error on a bad rank or size or an invalid id
   * @throw wm::comm_error if the group cannot be formed within the timeout
   */
  communicator(unique_id const& id, int rank, int size, communicator_options options = {});

  communicator(communicator&&) noexcept            = default;  ///< takes the group
  communicator& operator=(communicator&&) noexcept = default;  ///< drops this group, takes other
  communicator(communicator const&)                = delete;
  communicator& operator=(communicator const&)     = delete;
  /// Finalizes NCCL (waiting at most the timeout). A failed communicator, or one destroyed by
  /// stack unwinding (this rank is failing), is aborted instead, so that peers get errors
  /// rather than waiting for this rank.
  ~communicator() = default;

  /// Whether this is a group (false: default-made, moved from, or a split's color < 0).
  [[nodiscard]] bool valid() const noexcept { return s_ != nullptr; }
  [[nodiscard]] int rank() const noexcept { return s_->rank; }      ///< this rank
  [[nodiscard]] int size() const noexcept { return s_->size; }      ///< number of ranks
  [[nodiscard]] int device() const noexcept { return s_->device; }  ///< this rank's GPU
  /// Rank among the ranks on this host (same hostname and boot id), ordered by rank.
  [[nodiscard]] int local_rank() const noexcept { return s_->local_rank; }
  /// Number of ranks on this host.
  [[nodiscard]] int local_size() const noexcept { return static_cast<int>(s_->node_ranks.size()); }
  /// The ranks on this host, ascending.
  [[nodiscard]] std::vector<int> const& node_ranks() const noexcept { return s_->node_ranks; }
  /// True if every rank of the group is on this host.
  [[nodiscard]] bool single_node() const noexcept { return local_size() == size(); }
  /// The NCCL communicator, for users who issue their own NCCL calls. It is nonblocking
  /// (`config.blocking = 0`): after a call returns `ncclInProgress`, poll
  /// `ncclCommGetAsyncError` until it does not before the next NCCL call on it.
  [[nodiscard]] ncclComm_t nccl() const noexcept { return s_->comm; }
  /// The node-local descriptor channel (collective use: see `node_channel::all_gather`).
  [[nodiscard]] node_channel& channel() noexcept { return s_->channel; }
  /// The group token (unique per communicator; names node-local resources).
  [[nodiscard]] std::uint64_t token() const noexcept { return s_->token; }
  /// How long any wait for peers may take (`communicator_options::timeout`).
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return s_->timeout; }

  /** @brief Waits until every rank has called `barrier` (collective). */
  void barrier() { (void)exchange("barrier", 0, {}); }

  /**
   * @brief Host-side all-gather of small byte buffers (collective); sizes may differ by rank.
   * @return one buffer per rank, in rank order
   */
  [[nodiscard]] std::vector<std::vector<std::byte>> all_gather_bytes(
      std::span<std::byte const> mine) {
    return exchange("all_gather", 0, mine);
  }

  /** @brief Host-side all-gather of one trivially copyable value per rank (collective). */
  template <class T>
  requires std::is_trivially_copyable_v<T>
  [[nodiscard]] std::vector<T> all_gather(T const& mine) {
    auto const parts = exchange("all_gather", sizeof(T), std::as_bytes(std::span{&mine, 1}));
    std::vector<T> out(parts.size());
    for (std::size_t r = 0; r < parts.size(); ++r) {
      std::memcpy(&out[r], parts[r].data(), sizeof(T));
    }
    return out;
  }

  /**
   * @brief Checks that every rank called the same collective @p what with the same @p args
   * (collective). Higher modules call it at the start of their collective entry points.
   * @throw wm::comm_error on every rank if any rank differs
   */
  void expect_same(std::string_view what, std::uint64_t args) { (void)exchange(what, args, {}); }

  /// One piece of a grouped exchange: @p bytes at @p data go to rank @p peer.
  struct send_part {
    int peer{};           ///< the receiving rank
    void const* data{};   ///< device memory
    std::size_t bytes{};  ///< bytes to send
  };
  /// One piece of a grouped exchange: @p bytes from rank @p peer arrive at @p data.
  struct recv_part {
    int peer{};           ///< the sending rank
    void* data{};         ///< device memory
    std::size_t bytes{};  ///< bytes to receive
  };

  /**
   * @brief Grouped point-to-point exchange: every send and receive below is one `ncclSend` /
   * `ncclRecv` of one NCCL group, enqueued on @p stream (returns without synchronizing). Pieces
   * of zero bytes are skipped, and a call with no piece of more than zero bytes returns at once
   * (no NCCL call: point-to-point exchanges are not collective, no peer waits for it); several
   * pieces may name the same peer (they pair up in order).
   *
   * Each pair of ranks must agree on what it exchanges: the sizes one sends are what the other
   * receives, in the same order. A mismatch is a user error that this hot-path call does not
   * detect, and it hangs: the transfers never complete, so the work on @p stream never finishes
   * and the next wait for @p stream (your `cudaStreamSynchronize`, or that of the synchronizing
   * wm operation that made the exchange) blocks with no end. The communicator's timeout does not
   * cover it: this call returns once NCCL has accepted the operations, before they run.
   * @throw wm::logic_error on a peer outside the group or a null buffer of nonzero size
   * @throw wm::comm_error if NCCL rejects the operations or fails while accepting them (an NCCL
   * group this call opened is closed first)
   */
  void send_recv(std::span<send_part const> sends, std::span<recv_part const> recvs,
                 cuda::stream_ref stream) const;

  /**
   * @brief Waits for @p stream as the communicator waits for its own work: past the timeout, or
   * on an NCCL error, the communicator is aborted (which ends its pending transfers) and a
   * `wm::comm_error` names this rank. (NCCL's abort frees device memory, which waits for the
   * kernels running on the device: NCCL's end with the abort, others run to their end.) Use it
   * instead of `cudaStreamSynchronize` for a stream that holds exchanges with peers: a peer that
   * died or failed before its side of an exchange then gives an error instead of a wait with no
   * end. wm's own synchronizing operations use it.
   */
  void synchronize(cuda::stream_ref stream, std::string_view what = "synchronize") const {
    check_usable();
    wait_stream(what, stream.get());
  }

  /**
   * @brief Device all-to-all with per-peer counts (collective), grouped `ncclSend`/`ncclRecv`.
   *
   * Rank r sends `send_counts[p]` elements starting at `send + sum(send_counts[0..p))` to rank p
   * and receives `recv_counts[p]` elements from p into `recv + sum(recv_counts[0..p))`. Counts are
   * host values; zero counts are allowed. Enqueued on @p stream; returns without synchronizing.
   * Counts must agree pairwise (what p sends to r is what r receives from p). This hot-path call
   * exchanges no descriptors, so a disagreement is a user error that is not detected: it hangs
   * the work on @p stream, and the next wait for @p stream blocks with no end (the
   * communicator's timeout does not cover it; see `send_recv`).
   */
  template <class T>
  void all_to_all_v(T const* send, std::span<std::size_t const> send_counts, T* recv,
                    std::span<std::size_t const> recv_counts, cuda::stream_ref stream) const;

  /**
   * @brief Device all-to-all of @p count elements per peer (collective, `ncclAlltoAll` where
   * NCCL has it, grouped `ncclSend`/`ncclRecv` otherwise): rank r sends `send[p * count ...)` to
   * rank p and receives rank p's block into `recv[p * count ...)`. Enqueued on @p stream; returns
   * without synchronizing. Every rank must pass the same @p count.
   */
  template <class T>
  void all_to_all(T const* send, T* recv, std::size_t count, cuda::stream_ref stream) const;

  /**
   * @brief Device all-reduce (collective, `ncclAllReduce`): every rank's @p recv gets the
   * element-wise reduction (@p op) of the @p count elements at @p send on every rank. In place
   * when @p send == @p recv. Enqueued on @p stream; returns without synchronizing.
   *
   * Every rank must pass the same @p count, @p op and type, in the same order of collectives as
   * its peers. NCCL connects a collective's algorithm on the host at its first use, waiting for
   * every peer with no deadline of its own; so the first call of each shape (kind, type, op,
   * count; broadcast's root) on a communicator meets every rank first in a host-side collective
   * with the communicator's timeout: a peer that does not come (gone, late, in another
   * collective) gives a `wm::comm_error` after the timeout (the communicator is aborted), and
   * ranks whose first calls of a shape differ get a `wm::comm_error` on every rank (the
   * communicator stays usable). Later calls of a known shape check nothing (a hot-path call): a
   * disagreement hangs the work on @p stream, and `synchronize(stream)` ends that wait with a
   * `wm::comm_error` on every rank after the timeout. If NCCL rejects or fails the call, the
   * communicator is aborted (so no peer waits on this rank for ever) and a `wm::comm_error`
   * names this rank.
   * @tparam T float, double, `__nv_bfloat16`, `__half`, or a 8/32/64-bit integer
   * @throw wm::logic_error on a null buffer of nonzero size
   */
  template <class T>
  void all_reduce(T const* send, T* recv, std::size_t count, cuda::stream_ref stream,
                  reduce_op op = reduce_op::sum) const;

  /**
   * @brief Device reduce-scatter (collective, `ncclReduceScatter`): @p send holds `size() *
   * recv_count` elements on every rank; rank r's @p recv gets the reduction (@p op) over the
   * ranks of block r, `send[r * recv_count, (r + 1) * recv_count)`. In place when @p recv ==
   * @p send + rank() * recv_count. Enqueued on @p stream; same agreement and error rules as
   * `all_reduce`.
   * @throw wm::logic_error on a null buffer of nonzero size
   */
  template <class T>
  void reduce_scatter(T const* send, T* recv, std::size_t recv_count, cuda::stream_ref stream,
                      reduce_op op = reduce_op::sum) const;

  /**
   * @brief Device all-gather (collective, `ncclAllGather`): every rank's @p recv (`size() *
   * send_count` elements) gets rank q's @p send_count elements at `recv + q * send_count`. In
   * place when @p send == @p recv + rank() * send_count (each rank's block already in its
   * place). Enqueued on @p stream; same agreement and error rules as `all_reduce`.
   * @throw wm::logic_error on a null buffer of nonzero size
   */
  template <class T>
  void all_gather(T const* send, T* recv, std::size_t send_count, cuda::stream_ref stream) const;

  /**
   * @brief Device broadcast (collective, `ncclBroadcast`): @p count elements at @p send on rank
   * @p root arrive at @p recv on every rank (@p send is read on @p root only; in place when
   * @p send == @p recv). Enqueued on @p stream; same agreement and error rules as `all_reduce`.
   * @throw wm::logic_error on a root outside the group or a null buffer of nonzero size
   */
  template <class T>
  void broadcast(T const* send, T* recv, std::size_t count, int root,
                 cuda::stream_ref stream) const;

  /**
   * @brief Splits the group (collective): ranks with the same @p color form a new communicator,
   * ordered by @p key and then by rank. A rank with a negative color gets an empty communicator.
   */
  [[nodiscard]] communicator split(int color, int key);

  /**
   * @brief Fails the communicator: aborts NCCL so that no rank waits on it. Use after an error
   * from which the group cannot recover; any later call throws.
   */
  void abort() noexcept;

  /**
   * @brief Whether this communicator failed and was aborted (`abort()`, a timeout, an NCCL
   * error, a teardown agreement that failed): every later collective throws, and calls that
   * reach peers' memory without a collective (mapped gathers and scatters) throw
   * `wm::comm_error` instead of touching it. False for an empty communicator.
   */
  [[nodiscard]] bool aborted() const noexcept { return s_ != nullptr && s_->failed; }

  /**
   * @brief A host-side agreement for teardown paths (collective, never throws): as
   * `expect_same(what, args)`, but waiting at most @p limit (and at most the timeout). Returns
   * true if every rank made it with the same @p what and @p args in time; otherwise aborts the
   * communicator, so that no peer waits on this rank, and returns false.
   */
  [[nodiscard]] bool agree_within(std::string_view what, std::uint64_t args,
                                  std::chrono::milliseconds limit) noexcept;

 private:
  // Shared state lives on the heap so that moving a communicator never moves what NCCL and
  // the channel refer to.
  struct state {
    ncclComm_t comm{nullptr};  // nonblocking: every wait on it has a deadline
    ncclComm_t p2p{nullptr};   // blocking twin for send_recv (see finish_setup), if wanted
    bool twin{true};           // make p2p (communicator_options::exchange_twin)
    int rank{0};
    int size{0};
    int device{0};
    int local_rank{0};
    std::vector<int> node_ranks;
    std::vector<std::uint64_t> node_of_rank;
    std::uint64_t node{0};  // this rank's node identity (detail::node_key; kept by split)
    std::uint64_t token{0};
    std::chrono::milliseconds timeout{};
    node_channel channel;
    cudaStream_t stream{nullptr};  // internal stream for host-side collectives
    std::byte* scratch{nullptr};   // device scratch for host-side collectives
    std::size_t scratch_bytes{0};
    std::byte* staging{nullptr};  // pinned host mirror of scratch
    std::uint64_t seq{0};         // number of host-side collectives issued
    std::uint64_t split_seq{0};
    bool failed{false};
    /// The typed collectives' shapes (kind, type, op, count, root) that every rank has met once
    /// on the twin: NCCL connects a collective's algorithm at its first use (see
    /// `device_collective`).
    std::set<std::uint64_t> connected;

    state()                        = default;
    state(state const&)            = delete;
    state& operator=(state const&) = delete;
    ~state();  // frees the stream and buffers; finalizes (or aborts) NCCL; never throws
  };

  explicit communicator(std::unique_ptr<state> s) : s_{std::move(s)} {}

  void finish_setup();
  /// Polls @p which (default: the nonblocking communicator) until NCCL is done with it.
  void wait_nccl(std::string_view what, ncclComm_t which = nullptr) const;
  void wait_stream(std::string_view what, cudaStream_t stream) const;
  void ensure_scratch(std::size_t bytes);
  std::vector<std::vector<std::byte>> exchange(std::string_view what, std::uint64_t args,
                                               std::span<std::byte const> mine);
  void check_usable() const;
  /// Issues one device collective through @p issue(ncclComm_t) (the twin if there is one) and
  /// handles its result as `all_to_all` does. On the twin, the first call of each @p shape (a
  /// hash of the kind, type, op, count and root) first meets every rank in a host-side
  /// collective with the deadline.
  template <class Issue>
  void device_collective(std::string_view what, std::uint64_t shape, Issue&& issue) const;

  std::unique_ptr<state> s_;
};

}  // namespace wm
