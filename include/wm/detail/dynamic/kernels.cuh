// SPDX-License-Identifier: Apache-2.0
// Kernels of wm::dynamic_embedding: hashing and checking keys, the bucketed upsert (one warp per
// bucket of the call's sorted keys), lookups, erasure, the rows a call writes out or assigns,
// counting and export. docs/design.md, "Dynamic embeddings".
#pragma once

#include <wm/decl/dynamic_embedding.cuh>
#include <wm/detail/base/cuda.cuh>
#include <wm/detail/dynamic/buckets.cuh>
#include <wm/embedding.cuh>  // from_float (detail/embedding/kernels.cuh), through the public header

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace wm::detail::dynamic {

/// Error bits a call's kernels set.
enum error_bits : unsigned {
  reserved_key    = 1u,  ///< a key is dynamic_empty_key or dynamic_locked_key
  bucket_overflow = 2u   ///< a bucket cannot take the call's new keys and may not evict
};

/// What an inserting call did with one key (per position of the batch).
enum class key_status : std::uint8_t {
  not_inserted = 0,  ///< no slot (bucket used up by the call, or the score rule refused it)
  found        = 1,  ///< present before the call
  inserted     = 2   ///< inserted by the call
};

/// Rows, optimizer state and steps in slot order (one more slot at the end: the sink row that
/// takes the gradients of keys the table does not hold).
template <class T>
struct slot_rows {
  T* w{};                   ///< slots × dim
  float* st{};              ///< slots × states × dim (null: no state)
  std::int64_t* steps{};    ///< slots (null: no per-row steps)
  std::size_t dim{};        ///< values per row
  std::size_t state_len{};  ///< states × dim
  float initial{};          ///< initial value of every state slot
};

/// Where an upsert writes the keys it evicts (null count: nowhere).
template <class T>
struct evicted_view {
  std::uint64_t* keys{};
  T* values{};
  float* states{};
  std::int64_t* steps{};
  std::uint64_t* scores{};
  unsigned long long* count{};
};

/// Hashes of the keys and positions 0..n-1 (the sort's input); flags reserved keys.
template <class Key>
__global__ void hash_keys_kernel(buckets_view v, Key const* keys, std::size_t n, std::uint64_t* h,
                                 int* pos, unsigned* err) {
  for (std::size_t i = grid_thread(); i < n; i += grid_threads()) {
    auto const k = static_cast<std::uint64_t>(keys[i]);
    if (reserved(k)) { atomicOr(err, reserved_key); }
    h[i]   = v.hash(k);
    pos[i] = static_cast<int>(i);
  }
}

/// Flags reserved keys.
template <class Key>
__global__ void check_keys_kernel(Key const* keys, std::size_t n, unsigned* err) {
  for (std::size_t i = grid_thread(); i < n; i += grid_threads()) {
    if (reserved(static_cast<std::uint64_t>(keys[i]))) { atomicOr(err, reserved_key); }
  }
}

/// Selects the first position of each bucket's run of sorted hashes.
struct bucket_head {
  buckets_view v;
  std::uint64_t const* sorted;
  [[nodiscard]] __device__ bool operator()(int i) const {
    return i == 0 || v.bucket(sorted[i]) != v.bucket(sorted[i - 1]);
  }
};

/// Writes @p slot and @p st at the positions of the sorted run of hash @p h that starts at @p i
/// (a key and its duplicates), all lanes.
__device__ inline void write_key_run(std::uint64_t const* sorted_h, int const* sorted_pos, int i,
                                     int e, std::uint64_t h, std::uint32_t slot, key_status st,
                                     std::uint32_t* slots, key_status* status, unsigned lane) {
  for (int k0 = i;; k0 += 32) {
    int const k     = k0 + static_cast<int>(lane);
    bool const same = k < e && sorted_h[k] == h;
    if (same) {
      auto const p = static_cast<std::size_t>(sorted_pos[k]);
      slots[p]     = slot;
      status[p]    = st;
    }
    if (!__all_sync(full_warp, same)) { break; }
  }
}

/// The arguments of one upsert.
template <class T, class Key>
struct upsert_args {
  buckets_view v;
  slot_rows<T> rows;
  Key const* keys;
  std::uint64_t const* user_scores;  ///< per position (custom_score), else null
  std::uint64_t const* sorted_h;
  int const* sorted_pos;
  int const* offsets;  ///< first sorted position of each bucket's run
  int const* runs;     ///< number of runs (device)
  int n;
  score_context ctx;
  embedding_init init;
  bool init_weights;  ///< new keys get the initializer's row (else the caller assigns it)
  evicted_view<T> evicted;
  std::uint32_t* slots;  ///< per position
  key_status* status;    ///< per position
  unsigned* err;
};

/**
 * One warp per bucket's run of the call's keys, sorted by hash (so duplicates are adjacent and
 * the order is fixed). Phase 1 finds the present keys, updates their scores once each and
 * protects their slots; phase 2 inserts each missing key into the lowest free unprotected slot,
 * else (if the rule evicts) replaces the lowest (score, slot) among unprotected slots when the
 * rule admits it; the slot taken is protected in turn. With Check, nothing is written: the run
 * only finds out whether a bucket that may not evict would overflow.
 */
template <class Rule, bool Check, class T, class Key>
__global__ void __launch_bounds__(256) upsert_kernel(upsert_args<T, Key> a) {
  unsigned const lane     = threadIdx.x % 32;
  std::size_t const warp  = grid_thread() / 32;
  std::size_t const warps = grid_threads() / 32;
  auto const runs         = static_cast<std::size_t>(*a.runs);
  buckets_view const& v   = a.v;
  auto user = [&](int p) { return a.user_scores != nullptr ? a.user_scores[p] : 0ull; };
  for (std::size_t r = warp; r < runs; r += warps) {
    int const begin        = a.offsets[r];
    int const end          = r + 1 < runs ? a.offsets[r + 1] : a.n;
    std::uint32_t const b  = v.bucket(a.sorted_h[begin]);
    std::size_t const base = buckets_view::first(b);
    unsigned prot          = 0;  // this lane's 4 slots used by the call
    // Phase 1: present keys.
    for (int i = begin; i < end; ++i) {
      std::uint64_t const h = a.sorted_h[i];
      if (i > begin && a.sorted_h[i - 1] == h) { continue; }
      int const p    = a.sorted_pos[i];
      auto const key = static_cast<std::uint64_t>(a.keys[p]);
      int const s    = warp_find(v, b, key, buckets_view::digest(h), lane);
      if (s < 0) { continue; }
      if (static_cast<int>(lane) == s / 4) { prot |= 1u << (s % 4); }
      if constexpr (!Check) {
        std::size_t const slot = base + static_cast<std::size_t>(s);
        if (lane == 0) { v.scores[slot] = Rule::hit(v.scores[slot], a.ctx, user(p)); }
        write_key_run(a.sorted_h, a.sorted_pos, i, end, h, static_cast<std::uint32_t>(slot),
                      key_status::found, a.slots, a.status, lane);
      }
      __syncwarp();
    }
    // Phase 2: missing keys.
    for (int i = begin; i < end; ++i) {
      std::uint64_t const h = a.sorted_h[i];
      if (i > begin && a.sorted_h[i - 1] == h) { continue; }
      int const p          = a.sorted_pos[i];
      auto const key       = static_cast<std::uint64_t>(a.keys[p]);
      std::uint8_t const d = buckets_view::digest(h);
      if (warp_find(v, b, key, d, lane) >= 0) { continue; }
      std::uint64_t const score = Rule::inserted(a.ctx, user(p));
      std::size_t const mine    = base + static_cast<std::size_t>(lane) * 4;
      unsigned free_bits        = 0;
      std::uint64_t best_score  = ~0ull;
      int best_slot             = slots_per_bucket;  // none
      for (int j = 0; j < 4; ++j) {
        if (((prot >> j) & 1u) != 0) { continue; }
        std::uint64_t const k = v.keys[mine + static_cast<std::size_t>(j)];
        if (k == empty_key) {
          free_bits |= 1u << j;
        } else {
          std::uint64_t const sc = v.scores[mine + static_cast<std::size_t>(j)];
          if (best_slot == slots_per_bucket || sc < best_score) {
            best_score = sc;
            best_slot  = static_cast<int>(lane) * 4 + j;
          }
        }
      }
      int target                   = -1;
      bool victim                  = false;
      std::uint32_t const has_free = __ballot_sync(full_warp, free_bits != 0);
      if (has_free != 0) {
        int const l = __ffs(static_cast<int>(has_free)) - 1;
        int const j = __ffs(static_cast<int>(__shfl_sync(full_warp, free_bits, l))) - 1;
        target      = l * 4 + j;
      } else if constexpr (Rule::evicts) {
        for (int off = 16; off > 0; off /= 2) {
          std::uint64_t const os = __shfl_xor_sync(full_warp, best_score, off);
          int const ot           = __shfl_xor_sync(full_warp, best_slot, off);
          if (ot != slots_per_bucket && (best_slot == slots_per_bucket || os < best_score ||
                                         (os == best_score && ot < best_slot))) {
            best_score = os;
            best_slot  = ot;
          }
        }
        if (best_slot != slots_per_bucket && Rule::admits(score, best_score)) {
          target = best_slot;
          victim = true;
        }
      } else {
        if (lane == 0) { atomicOr(a.err, bucket_overflow); }
      }
      if (target < 0) {
        if constexpr (!Check) {
          write_key_run(a.sorted_h, a.sorted_pos, i, end, h, no_slot, key_status::not_inserted,
                        a.slots, a.status, lane);
        }
        continue;
      }
      if (static_cast<int>(lane) == target / 4) { prot |= 1u << (target % 4); }
      if constexpr (!Check) {
        std::size_t const slot    = base + static_cast<std::size_t>(target);
        slot_rows<T> const& rows  = a.rows;
        evicted_view<T> const& ev = a.evicted;
        if (victim && ev.count != nullptr) {
          unsigned long long at = 0;
          if (lane == 0) { at = atomicAdd(ev.count, 1ull); }
          auto const e = static_cast<std::size_t>(__shfl_sync(full_warp, at, 0));
          if (lane == 0) {
            if (ev.keys != nullptr) { ev.keys[e] = v.keys[slot]; }
            if (ev.scores != nullptr) { ev.scores[e] = v.scores[slot]; }
            if (ev.steps != nullptr && rows.steps != nullptr) { ev.steps[e] = rows.steps[slot]; }
          }
          if (ev.values != nullptr) {
            for (std::size_t j = lane; j < rows.dim; j += 32) {
              ev.values[e * rows.dim + j] = rows.w[slot * rows.dim + j];
            }
          }
          if (ev.states != nullptr && rows.st != nullptr) {
            for (std::size_t j = lane; j < rows.state_len; j += 32) {
              ev.states[e * rows.state_len + j] = rows.st[slot * rows.state_len + j];
            }
          }
        }
        __syncwarp();
        if (lane == 0) {
          v.keys[slot]    = key;
          v.digests[slot] = d;
          v.scores[slot]  = score;
          if (rows.steps != nullptr) { rows.steps[slot] = 0; }
        }
        if (a.init_weights) {
          for (std::size_t j = lane; j < rows.dim; j += 32) {
            rows.w[slot * rows.dim + j] =
                from_float<T>(a.init.value(static_cast<std::size_t>(key), j, rows.dim));
          }
        }
        if (rows.st != nullptr) {
          for (std::size_t j = lane; j < rows.state_len; j += 32) {
            rows.st[slot * rows.state_len + j] = rows.initial;
          }
        }
        write_key_run(a.sorted_h, a.sorted_pos, i, end, h, static_cast<std::uint32_t>(slot),
                      key_status::inserted, a.slots, a.status, lane);
      }
      __syncwarp();
    }
  }
}

/// One warp per key: its slot (or @p missing) and status; flags reserved keys.
template <class Key>
__global__ void find_kernel(buckets_view v, Key const* keys, std::size_t n, std::uint32_t missing,
                            std::uint32_t* slots, key_status* status, unsigned* err) {
  unsigned const lane = threadIdx.x % 32;
  for (std::size_t i = grid_thread() / 32; i < n; i += grid_threads() / 32) {
    auto const key = static_cast<std::uint64_t>(keys[i]);
    if (reserved(key)) {
      if (lane == 0) {
        atomicOr(err, reserved_key);
        slots[i]  = missing;
        status[i] = key_status::not_inserted;
      }
      continue;
    }
    std::uint64_t const h = v.hash(key);
    std::uint32_t const b = v.bucket(h);
    int const s           = warp_find(v, b, key, buckets_view::digest(h), lane);
    if (lane == 0) {
      slots[i] =
          s >= 0 ? static_cast<std::uint32_t>(buckets_view::first(b) + static_cast<std::size_t>(s))
                 : missing;
      status[i] = s >= 0 ? key_status::found : key_status::not_inserted;
    }
  }
}

/// out[i, :] = the row of slot slots[i], or for no_slot the initializer's row of keys[i] (or
/// zeros); found[i] = whether the key was present before the call.
template <class T, class Key>
__global__ void rows_out_kernel(slot_rows<T> rows, Key const* keys, std::uint32_t const* slots,
                                key_status const* status, std::size_t n, T* out, bool* found,
                                embedding_init init, bool zeros) {
  std::size_t const dim = rows.dim;
  for (std::size_t x = grid_thread(); x < n * dim; x += grid_threads()) {
    std::size_t const i   = x / dim;
    std::size_t const j   = x % dim;
    std::uint32_t const s = slots[i];
    if (out != nullptr) {
      if (s != no_slot) {
        out[x] = rows.w[static_cast<std::size_t>(s) * dim + j];
      } else if (zeros) {
        out[x] = from_float<T>(0.0f);
      } else {
        out[x] = from_float<T>(
            init.value(static_cast<std::size_t>(static_cast<std::uint64_t>(keys[i])), j, dim));
      }
    }
    if (j == 0 && found != nullptr) { found[i] = status[i] == key_status::found; }
  }
}

/// Assigns values[p, :] to the slot of each key's last occurrence p in the batch.
template <class T>
__global__ void assign_rows_kernel(slot_rows<T> rows, std::uint64_t const* sorted_h,
                                   int const* sorted_pos, std::size_t n, std::uint32_t const* slots,
                                   T const* values) {
  std::size_t const dim = rows.dim;
  for (std::size_t x = grid_thread(); x < n * dim; x += grid_threads()) {
    std::size_t const i = x / dim;
    std::size_t const j = x % dim;
    if (i + 1 < n && sorted_h[i + 1] == sorted_h[i]) { continue; }
    auto const p          = static_cast<std::size_t>(sorted_pos[i]);
    std::uint32_t const s = slots[p];
    if (s != no_slot) { rows.w[static_cast<std::size_t>(s) * dim + j] = values[p * dim + j]; }
  }
}

/// One warp per key: removes it if present (once, whatever the duplicates) and counts it.
template <class Key>
__global__ void erase_kernel(buckets_view v, Key const* keys, std::size_t n,
                             unsigned long long* erased) {
  unsigned const lane = threadIdx.x % 32;
  for (std::size_t i = grid_thread() / 32; i < n; i += grid_threads() / 32) {
    auto const key        = static_cast<std::uint64_t>(keys[i]);
    std::uint64_t const h = v.hash(key);
    std::uint32_t const b = v.bucket(h);
    int const s           = warp_find(v, b, key, buckets_view::digest(h), lane);
    if (s >= 0 && lane == 0) {
      std::size_t const slot = buckets_view::first(b) + static_cast<std::size_t>(s);
      auto* word             = reinterpret_cast<unsigned long long*>(v.keys + slot);
      if (atomicCAS(word, static_cast<unsigned long long>(key),
                    static_cast<unsigned long long>(empty_key)) == key) {
        v.digests[slot] = 0;
        v.scores[slot]  = 0;
        atomicAdd(erased, 1ull);
      }
    }
  }
}

/// Counts the held keys (a template only so that every translation unit may define it).
template <int = 0>
__global__ void count_kernel(buckets_view v, std::size_t slots, unsigned long long* count) {
  unsigned long long mine = 0;
  for (std::size_t s = grid_thread(); s < slots; s += grid_threads()) {
    mine += v.keys[s] != empty_key ? 1u : 0u;
  }
  for (int off = 16; off > 0; off /= 2) { mine += __shfl_xor_sync(full_warp, mine, off); }
  if (threadIdx.x % 32 == 0 && mine != 0) { atomicAdd(count, mine); }
}

/// Writes every held key that @p pred accepts, with its row and score.
template <class T, class Pred>
__global__ void export_kernel(buckets_view v, slot_rows<T> rows, std::size_t slots, Pred pred,
                              std::uint64_t* keys, T* values, std::uint64_t* scores,
                              unsigned long long* count) {
  for (std::size_t s = grid_thread(); s < slots; s += grid_threads()) {
    std::uint64_t const k = v.keys[s];
    if (k == empty_key || !pred(k, v.scores[s])) { continue; }
    auto const at = static_cast<std::size_t>(atomicAdd(count, 1ull));
    keys[at]      = k;
    if (scores != nullptr) { scores[at] = v.scores[s]; }
    if (values != nullptr) {
      for (std::size_t j = 0; j < rows.dim; ++j) {
        values[at * rows.dim + j] = rows.w[s * rows.dim + j];
      }
    }
  }
}

}  // namespace wm::detail::dynamic
