/**
 * @file optimizer.hpp
 * @brief Sparse optimizer policies for `wm::embedding`: `wm::sgd`, `wm::adam`, `wm::rmsprop`,
 * `wm::adagrad`, and `wm::no_optimizer` for inference-only tables.
 *
 * Each policy holds its hyper-parameters (defaults as in PyTorch) and the per-element update
 * rule, written once for float (device) and double (host reference). An update sees one row's
 * summed gradient g (duplicates already added), its weight w and its state slots; `lr` comes
 * with each call. Weight decay is L2 (added to the gradient) unless `adam::decoupled` (AdamW).
 *
 * Compiles with a plain C++20 compiler as well as nvcc.
 */
#pragma once

#include <wm/partition.hpp>  // WM_HOST_DEVICE

#include <cmath>
#include <concepts>
#include <cstdint>

namespace wm {

/// Per-call values an update needs besides the hyper-parameters.
template <class F>
struct update_step {
  F lr;              ///< learning rate of this call
  std::int64_t step; ///< Adam: 1-based step used for bias correction (per row or global)
};

/** @brief Plain SGD: w -= lr (g + wd w). */
struct sgd {
  static constexpr char const* name = "sgd";
  static constexpr int states       = 0;
  float weight_decay{0.0f};
  template <class F>
  WM_HOST_DEVICE void update(F& w, F g, F*, update_step<F> s) const noexcept
  {
    g += static_cast<F>(weight_decay) * w;
    w -= s.lr * g;
  }
};

/** @brief How Adam corrects the bias of its moments. */
enum class adam_bias_correction {
  per_row,     ///< lazy Adam: each row counts its own updates (default)
  global_step  ///< one step count for the table, advanced by every call (torch SparseAdam)
};

/**
 * @brief Adam on the rows present in a batch (rows absent keep their moments):
 * m = b1 m + (1-b1) g; v = b2 v + (1-b2) g²;
 * w -= lr · sqrt(1-b2^t)/(1-b1^t) · m / (sqrt(v) + eps)  (the form of torch.optim.SparseAdam).
 * `decoupled` (AdamW): w -= lr · wd · w before the step instead of adding wd · w to g.
 */
struct adam {
  static constexpr char const* name = "adam";
  static constexpr int states       = 2;  // m, v
  float beta1{0.9f};
  float beta2{0.999f};
  float eps{1e-8f};
  float weight_decay{0.0f};
  bool decoupled{false};
  adam_bias_correction bias_correction{adam_bias_correction::per_row};

  template <class F>
  WM_HOST_DEVICE void update(F& w, F g, F* state, update_step<F> s) const noexcept
  {
    F const b1 = beta1;
    F const b2 = beta2;
    if (decoupled) {
      w -= s.lr * static_cast<F>(weight_decay) * w;
    } else {
      g += static_cast<F>(weight_decay) * w;
    }
    F& m = state[0];
    F& v = state[1];
    m    = b1 * m + (F{1} - b1) * g;
    v    = b2 * v + (F{1} - b2) * g * g;
    F const t  = static_cast<F>(s.step);
    F const c1 = one_minus_pow_(b1, t);
    F const c2 = one_minus_pow_(b2, t);
    w -= s.lr * sqrt_(c2) / c1 * m / (sqrt_(v) + static_cast<F>(eps));
  }

 private:
  /// 1 - b^t without cancellation: in float, 1 - pow(0.999, 1) keeps only 4 of its 7 digits
  /// (b - 1 is exact for b in [0.5, 1], and log1p/expm1 keep full precision near 0).
  template <class F>
  WM_HOST_DEVICE static F one_minus_pow_(F b, F t) noexcept
  {
    using std::expm1;
    using std::log1p;
    return -expm1(t * log1p(b - F{1}));
  }
  template <class F>
  WM_HOST_DEVICE static F sqrt_(F x) noexcept
  {
    using std::sqrt;
    return sqrt(x);
  }
};

/** @brief RMSProp: v = a v + (1-a) g²; w -= lr g / (sqrt(v) + eps). */
struct rmsprop {
  static constexpr char const* name = "rmsprop";
  static constexpr int states       = 1;
  float alpha{0.99f};
  float eps{1e-8f};
  float weight_decay{0.0f};
  template <class F>
  WM_HOST_DEVICE void update(F& w, F g, F* state, update_step<F> s) const noexcept
  {
    using std::sqrt;
    g += static_cast<F>(weight_decay) * w;
    F& v = state[0];
    v    = static_cast<F>(alpha) * v + (F{1} - static_cast<F>(alpha)) * g * g;
    w -= s.lr * g / (sqrt(v) + static_cast<F>(eps));
  }
};

/** @brief AdaGrad: s += g²; w -= lr g / (sqrt(s) + eps); s starts at `initial_accumulator`. */
struct adagrad {
  static constexpr char const* name = "adagrad";
  static constexpr int states       = 1;
  float eps{1e-10f};
  float initial_accumulator{0.0f};
  float weight_decay{0.0f};
  template <class F>
  WM_HOST_DEVICE void update(F& w, F g, F* state, update_step<F> s) const noexcept
  {
    using std::sqrt;
    g += static_cast<F>(weight_decay) * w;
    F& acc = state[0];
    acc += g * g;
    w -= s.lr * g / (sqrt(acc) + static_cast<F>(eps));
  }
};

/** @brief No optimizer: an inference-only table; `apply_gradients` does not compile. */
struct no_optimizer {
  static constexpr char const* name = "none";
  static constexpr int states       = 0;
};

/** @brief A sparse optimizer policy: hyper-parameters plus a per-element update rule. */
template <class O>
concept sparse_optimizer = requires(O const& o, float& w, float* st, double& wd, double* sd) {
  { O::name } -> std::convertible_to<char const*>;
  { O::states } -> std::convertible_to<int>;
  o.update(w, 1.0f, st, update_step<float>{1.0f, 1});
  o.update(wd, 1.0, sd, update_step<double>{1.0, 1});
};

/// Optimizers with state memory per row beyond the weights.
template <class O>
inline constexpr bool needs_steps = std::same_as<O, adam>;

/// Initial value of each state slot.
template <class O>
[[nodiscard]] constexpr float initial_state(O const& o) noexcept
{
  if constexpr (std::same_as<O, adagrad>) {
    return o.initial_accumulator;
  } else {
    return 0.0f;
  }
}

}  // namespace wm
