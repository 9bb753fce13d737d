// SPDX-License-Identifier: Apache-2.0
/**
 * @file optimizer.hpp
 * @brief Sparse optimizer policies for `wm::embedding`: `wm::sgd`, `wm::adam`, `wm::rmsprop`,
 * `wm::adagrad`, `wm::no_optimizer` for inference-only tables, and the `wm::sparse_optimizer`
 * concept that a user-written optimizer satisfies to train an embedding unchanged.
 *
 * Each policy holds its hyper-parameters (defaults as in PyTorch) and carries everything the
 * table needs from it: the number of float state slots per weight (`states`), their initial
 * value (`initial_state()`), whether the table keeps a step count per row (`needs_steps()`),
 * and the per-element update rule, written once for float (device) and double (host
 * reference). An update sees one row's summed gradient g (duplicates already added), its weight
 * w and its state slots; `lr` comes with each call. Weight decay is L2 (added to the gradient)
 * unless `adam::decoupled` (AdamW).
 *
 * Compiles with a plain C++20 compiler as well as nvcc.
 */
#pragma once

#include <wm/partition.hpp>  // WM_HOST_DEVICE

#include <cmath>
#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>

namespace wm {

/// Per-call values an update needs besides the hyper-parameters.
template <class F>
struct update_step {
  F lr;               ///< learning rate of this call
  std::int64_t step;  ///< 1-based: the row's own update count if the optimizer `needs_steps()`,
                      ///< else the table's global step (`apply_gradients` calls, this one included)
};

/** @brief Plain SGD: w -= lr (g + wd w). */
struct sgd {
  static constexpr char const* name = "sgd";  ///< recorded in checkpoints
  static constexpr int states       = 0;      ///< no state
  float weight_decay{0.0f};                   ///< L2 decay wd, added to the gradient

  /// No step counts.
  [[nodiscard]] constexpr bool needs_steps() const noexcept { return false; }
  /// Unused (no state slots).
  [[nodiscard]] constexpr float initial_state() const noexcept { return 0.0f; }
  /// Updates weight @p w with the summed gradient @p g (F = float on the device, double for
  /// host references).
  template <class F>
  WM_HOST_DEVICE void update(F& w, F g, F*, update_step<F> s) const noexcept {
    g += static_cast<F>(weight_decay) * w;
    w -= s.lr * g;
  }
};

/** @brief How Adam corrects the bias of its moments. */
enum class adam_bias_correction {
  per_row,     ///< lazy Adam: each row counts its own updates (default; the table keeps the counts)
  global_step  ///< one step count for the table, advanced by every call (torch.optim.SparseAdam)
};

/**
 * @brief Where Adam adds epsilon, with c1 = 1 - b1^t and c2 = 1 - b2^t. The two forms differ
 * only where sqrt(v) is not large against eps (small gradients): at step 1 with g = 1e-6 and
 * lr = 1 the torch form moves a weight by 0.990, the SparseAdam form by 0.760.
 */
enum class adam_epsilon {
  torch_adam,  ///< w -= lr / c1 · m / (sqrt(v) / sqrt(c2) + eps): torch.optim.Adam and AdamW
  sparse_adam  ///< w -= lr · sqrt(c2) / c1 · m / (sqrt(v) + eps): torch.optim.SparseAdam, TF Adam
};

/**
 * @brief Adam on the rows present in a batch (rows absent keep their moments):
 * m = b1 m + (1-b1) g; v = b2 v + (1-b2) g²; then the step of `epsilon`'s form.
 *
 * Weight decay: L2 (g += wd · w, torch.optim.Adam) or, with `decoupled`, w -= lr · wd · w
 * before the step (torch.optim.AdamW). The defaults are torch's (betas 0.9/0.999, eps 1e-8,
 * epsilon placed as torch's Adam/AdamW); note that torch.optim.AdamW's default weight decay is
 * 0.01, wm's 0. On batches that contain every row, per-row and global steps agree, and
 * `{decoupled = false}` computes torch.optim.Adam, `{decoupled = true, weight_decay = 0.01}`
 * torch.optim.AdamW. torch.optim.SparseAdam (no weight decay) is
 * `{bias_correction = global_step, epsilon = sparse_adam}` on any batches.
 */
struct adam {
  static constexpr char const* name = "adam";  ///< recorded in checkpoints
  static constexpr int states       = 2;       ///< m, v
  /// Decay of the first moment m.
  float beta1{0.9f};
  /// Decay of the second moment v.
  float beta2{0.999f};
  /// Added to the denominator, placed as `epsilon` says.
  float eps{1e-8f};
  /// Weight decay: L2 (added to the gradient), or decoupled (AdamW) with `decoupled`.
  float weight_decay{0.0f};
  /// true: AdamW, w -= lr · wd · w before the step; false: L2 decay as torch.optim.Adam.
  bool decoupled{false};
  /// Per-row (lazy) or global step counts.
  adam_bias_correction bias_correction{adam_bias_correction::per_row};
  /// Where eps enters the step: torch's Adam/AdamW or SparseAdam.
  adam_epsilon epsilon{adam_epsilon::torch_adam};

  /// Lazy Adam counts each row's updates; global-step Adam uses the table's step.
  [[nodiscard]] constexpr bool needs_steps() const noexcept {
    return bias_correction == adam_bias_correction::per_row;
  }
  /// Moments start at 0.
  [[nodiscard]] constexpr float initial_state() const noexcept { return 0.0f; }
  /// The settings that give the stored moments and steps their meaning (checked by `load`).
  [[nodiscard]] std::string checkpoint_tag() const {
    return std::string{"bias_correction="} +
           (bias_correction == adam_bias_correction::per_row ? "per_row" : "global_step") +
           " epsilon=" + (epsilon == adam_epsilon::torch_adam ? "torch_adam" : "sparse_adam");
  }

  /// Updates weight @p w with the summed gradient @p g (F = float on the device, double for
  /// host references). @p state: m, v.
  template <class F>
  WM_HOST_DEVICE void update(F& w, F g, F* state, update_step<F> s) const noexcept {
    F const b1 = beta1;
    F const b2 = beta2;
    F const e  = eps;
    if (decoupled) {
      w -= s.lr * static_cast<F>(weight_decay) * w;
    } else {
      g += static_cast<F>(weight_decay) * w;
    }
    F& m            = state[0];
    F& v            = state[1];
    m               = b1 * m + (F{1} - b1) * g;
    v               = b2 * v + (F{1} - b2) * g * g;
    F const t       = static_cast<F>(s.step);
    F const c1      = one_minus_pow_(b1, t);
    F const sqrt_c2 = sqrt_(one_minus_pow_(b2, t));
    // torch's lr / c1 · m / (sqrt(v) / sqrt(c2) + eps), with numerator and denominator times
    // sqrt(c2): one division per value, as in the SparseAdam form.
    F const step_size = s.lr * sqrt_c2 / c1;
    F const eps_hat   = epsilon == adam_epsilon::torch_adam ? e * sqrt_c2 : e;
    w -= step_size * m / (sqrt_(v) + eps_hat);
  }

 private:
  /// 1 - b^t without cancellation: in float, 1 - pow(0.999, 1) keeps only 4 of its 7 digits
  /// (b - 1 is exact for b in [0.5, 1], and log1p/expm1 keep full precision near 0).
  template <class F>
  WM_HOST_DEVICE static F one_minus_pow_(F b, F t) noexcept {
    using std::expm1;
    using std::log1p;
    return -expm1(t * log1p(b - F{1}));
  }
  template <class F>
  WM_HOST_DEVICE static F sqrt_(F x) noexcept {
    using std::sqrt;
    return sqrt(x);
  }
};

/** @brief RMSProp: v = a v + (1-a) g²; w -= lr g / (sqrt(v) + eps). */
struct rmsprop {
  static constexpr char const* name = "rmsprop";  ///< recorded in checkpoints
  static constexpr int states       = 1;          ///< v
  /// Decay of the mean square v.
  float alpha{0.99f};
  /// Added to sqrt(v).
  float eps{1e-8f};
  /// L2 decay, added to the gradient.
  float weight_decay{0.0f};

  /// No step counts.
  [[nodiscard]] constexpr bool needs_steps() const noexcept { return false; }
  /// v starts at 0.
  [[nodiscard]] constexpr float initial_state() const noexcept { return 0.0f; }
  /// Updates weight @p w with the summed gradient @p g (F = float on the device, double for
  /// host references). @p state: v.
  template <class F>
  WM_HOST_DEVICE void update(F& w, F g, F* state, update_step<F> s) const noexcept {
    using std::sqrt;
    g += static_cast<F>(weight_decay) * w;
    F& v = state[0];
    v    = static_cast<F>(alpha) * v + (F{1} - static_cast<F>(alpha)) * g * g;
    w -= s.lr * g / (sqrt(v) + static_cast<F>(eps));
  }
};

/** @brief AdaGrad: s += g²; w -= lr g / (sqrt(s) + eps); s starts at `initial_accumulator`. */
struct adagrad {
  static constexpr char const* name = "adagrad";  ///< recorded in checkpoints
  static constexpr int states       = 1;          ///< s, the sum of squared gradients
  /// Added to sqrt(s).
  float eps{1e-10f};
  /// The value s starts at.
  float initial_accumulator{0.0f};
  /// L2 decay, added to the gradient.
  float weight_decay{0.0f};

  /// No step counts.
  [[nodiscard]] constexpr bool needs_steps() const noexcept { return false; }
  /// s starts at `initial_accumulator`.
  [[nodiscard]] constexpr float initial_state() const noexcept { return initial_accumulator; }
  /// Updates weight @p w with the summed gradient @p g (F = float on the device, double for
  /// host references). @p state: s.
  template <class F>
  WM_HOST_DEVICE void update(F& w, F g, F* state, update_step<F> s) const noexcept {
    using std::sqrt;
    g += static_cast<F>(weight_decay) * w;
    F& acc = state[0];
    acc += g * g;
    w -= s.lr * g / (sqrt(acc) + static_cast<F>(eps));
  }
};

/** @brief No optimizer: an inference-only table; `apply_gradients` does not compile. */
struct no_optimizer {
  static constexpr char const* name = "none";  ///< recorded in checkpoints
  static constexpr int states       = 0;       ///< no state
  /// No step counts.
  [[nodiscard]] constexpr bool needs_steps() const noexcept { return false; }
  /// Unused (no state slots).
  [[nodiscard]] constexpr float initial_state() const noexcept { return 0.0f; }
};

/**
 * @brief A sparse optimizer policy: what `wm::embedding` needs from an optimizer, all of it
 * supplied by the type (the table never asks which optimizer it got). A type `O` provides:
 * - `static constexpr char const* name`: recorded in checkpoints, which load only into a table
 *   whose optimizer has the same name;
 * - `static constexpr int states` (>= 0): float state slots per weight, laid out as `states`
 *   blocks of `dim` floats per row;
 * - `bool needs_steps() const noexcept`: whether the table keeps an update count per row (then
 *   `update_step::step` is the row's own count, else the global step);
 * - `float initial_state() const noexcept`: the value every state slot starts with;
 * - `update(F& w, F g, F* state, update_step<F>) const` for F = float (the device kernel, so it
 *   must be `__host__ __device__`, e.g. `WM_HOST_DEVICE`) and F = double (host references);
 * - optionally `std::string checkpoint_tag() const`: the settings that give the stored states
 *   their meaning; `load` refuses a checkpoint whose tag differs.
 * The type is trivially copyable: the kernel gets it by value.
 */
template <class O>
concept sparse_optimizer = std::is_trivially_copyable_v<O> &&
    requires(O const& o, float& w, float* st, double& wd, double* sd) {
  { O::name } -> std::convertible_to<char const*>;
  { O::states } -> std::convertible_to<int>;
  requires O::states >= 0;
  { o.needs_steps() }
  noexcept->std::same_as<bool>;
  { o.initial_state() }
  noexcept->std::convertible_to<float>;
  o.update(w, 1.0f, st, update_step<float>{1.0f, 1});
  o.update(wd, 1.0, sd, update_step<double>{1.0, 1});
};

/// The initial value of each state slot of @p o (forwards to `o.initial_state()`).
template <class O>
[[nodiscard]] constexpr float initial_state(O const& o) noexcept {
  return static_cast<float>(o.initial_state());
}

/// `o.checkpoint_tag()` if @p O has one, else empty.
template <class O>
[[nodiscard]] std::string checkpoint_tag(O const& o) {
  if constexpr (requires {
                  { o.checkpoint_tag() } -> std::convertible_to<std::string>;
                }) {
    return o.checkpoint_tag();
  } else {
    return {};
  }
}

}  // namespace wm
