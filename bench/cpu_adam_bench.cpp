/*
 * cpu_adam_bench (issue 20): the CPU AdamW of wm::zero_optimizer's host offload in parameters per
 * second, against the host's memory copy bandwidth measured in the same run, both counted at 28
 * bytes per parameter (read master, m, v and a 4-byte fp32 gradient, write master, m, v: 16 + 12;
 * or read a bf16 gradient and write a bf16 weight copy too: 14 + 14). The copy moves the same
 * bytes per step (14·N read, 14·N written) over the same threads.
 *
 * Usage: cpu_adam_bench [--params N] [--threads T] [--reps R] [--isa all|best] [--peer]
 *   --peer runs bench/peers/torch_cpu_adam.py on the same size and thread count (torch's
 *   AdamW default, foreach and fused on CPU tensors) and prints the ratio to torch fused.
 * Targets (issue 20): ≥ 1.1 × torch fused, ≥ 0.80 of the copy bandwidth at 28 B/param.
 */
#include <wm/detail/zero/cpu_adam.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace z = wm::detail::zero;

namespace {

struct free_deleter {
  void operator()(void* p) const noexcept { std::free(p); }
};
template <class T>
using buffer = std::unique_ptr<T[], free_deleter>;

template <class T>
buffer<T> allocate(std::size_t n) {
  std::size_t const bytes = (n * sizeof(T) + 63) / 64 * 64;
  auto* p = static_cast<T*>(std::aligned_alloc(64, std::max<std::size_t>(bytes, 64)));
  if (p == nullptr) {
    std::fprintf(stderr, "cpu_adam_bench: out of memory (%zu bytes)\n", bytes);
    std::exit(1);
  }
  return buffer<T>{p};
}

/// [first, last) of part t of n split like cpu_adam_update splits it (64-element blocks).
std::pair<std::size_t, std::size_t> part(std::size_t n, std::size_t parts, std::size_t t) {
  std::size_t const blocks = (n + 63) / 64;
  return {std::min(n, blocks * t / parts * 64), std::min(n, blocks * (t + 1) / parts * 64)};
}

template <class F>
double median_ms(int reps, F&& f) {
  for (int i = 0; i < 2; ++i) { f(); }
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    auto const t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double json_number(std::string const& line, char const* key) {
  std::string const k = std::string{"\""} + key + "\":";
  auto const at       = line.find(k);
  return at == std::string::npos ? -1.0 : std::atof(line.c_str() + at + k.size());
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t n    = std::size_t{1} << 27;
  unsigned threads = 0;
  int reps         = 10;
  bool all_isas    = true;
  bool peer        = false;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--params" && i + 1 < argc) {
      n = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--threads" && i + 1 < argc) {
      threads = static_cast<unsigned>(std::atoi(argv[++i]));
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--isa" && i + 1 < argc) {
      all_isas = std::string{argv[++i]} == "all";
    } else if (a == "--peer") {
      peer = true;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--params N] [--threads T] [--reps R] [--isa all|best] [--peer]\n",
                   argv[0]);
      return 2;
    }
  }
  z::thread_pool pool{threads};
  std::size_t const parts = pool.size();

  // Buffers, first touched by the thread that updates them.
  auto master                  = allocate<float>(n);
  auto m                       = allocate<float>(n);
  auto v                       = allocate<float>(n);
  auto grad                    = allocate<float>(n);
  auto grad16                  = allocate<z::bf16_bits>(n);
  auto out16                   = allocate<z::bf16_bits>(n);
  std::size_t const copy_bytes = 14 * n;
  auto copy_src                = allocate<char>(copy_bytes);
  auto copy_dst                = allocate<char>(copy_bytes);
  pool.run(parts, [&](std::size_t t) {
    auto const [first, last] = part(n, parts, t);
    std::mt19937 rng{static_cast<unsigned>(t) + 1};
    std::uniform_real_distribution<float> d{-1.0f, 1.0f};
    for (std::size_t i = first; i < last; ++i) {
      master[i] = d(rng);
      m[i]      = 0.0f;
      v[i]      = 0.0f;
      grad[i]   = 1e-3f * d(rng);
      std::uint32_t b;
      std::memcpy(&b, &grad[i], 4);
      grad16[i] = static_cast<z::bf16_bits>(b >> 16);
      out16[i]  = 0;
    }
    auto const [cf, cl] = part(copy_bytes, parts, t);
    std::memset(copy_src.get() + cf, 1, cl - cf);
    std::memset(copy_dst.get() + cf, 0, cl - cf);
  });

  double const copy_ms  = median_ms(reps, [&] {
    pool.run(parts, [&](std::size_t t) {
      auto const [cf, cl] = part(copy_bytes, parts, t);
      std::memcpy(copy_dst.get() + cf, copy_src.get() + cf, cl - cf);
    });
  });
  double const copy_gbs = 2.0 * static_cast<double>(copy_bytes) / (copy_ms * 1e6);
  // The same bytes read and written in place (as Adam does with master, m and v): no
  // read-for-ownership of a destination, whatever memcpy's store strategy is.
  auto* words                  = reinterpret_cast<std::uint32_t*>(copy_src.get());
  std::size_t const word_count = copy_bytes / 4;
  double const sweep_ms        = median_ms(reps, [&] {
    pool.run(parts, [&](std::size_t t) {
      auto const [first, last] = part(word_count, parts, t);
      for (std::size_t i = first; i < last; ++i) { words[i] += 1u; }
    });
  });
  double const sweep_gbs       = 2.0 * static_cast<double>(word_count * 4) / (sweep_ms * 1e6);
  double const limit_gbs       = std::max(copy_gbs, sweep_gbs);
  double const bound           = limit_gbs * 1e9 / 28.0;  // params/s the host memory allows

  std::printf("cpu_adam_bench: %zu parameters, %u threads, best ISA %s, median of %d\n", n,
              pool.size(), z::name_of(z::best_cpu_isa()), reps);
  std::printf(
      "host memcpy: %.1f GB/s; in-place read+write sweep: %.1f GB/s (both read + write, "
      "%.2f GB per pass); limit %.1f GB/s -> %.3f Gparams/s at 28 B\n",
      copy_gbs, sweep_gbs, 2.0 * static_cast<double>(copy_bytes) / 1e9, limit_gbs, bound / 1e9);
  std::printf(
      "| case | isa | ms | Gparams/s | GB/s at 28 B | vs limit |\n| --- | --- | --- | --- | --- | "
      "--- |\n");

  z::cpu_adam_options const opt;  // AdamW defaults: wd 0.01, eps 1e-8
  double best_fp32 = 0.0;
  for (auto isa : {z::cpu_isa::avx512, z::cpu_isa::avx2, z::cpu_isa::scalar}) {
    if (!z::cpu_supports(isa)) { continue; }
    if (!all_isas && isa != z::best_cpu_isa()) { continue; }
    for (int mode = 0; mode < 2; ++mode) {
      std::int64_t step = 0;
      double ms         = 0.0;
      if (mode == 0) {
        z::cpu_adam_arrays<float> const a{master.get(), m.get(), v.get(), grad.get(), nullptr, n};
        ms = median_ms(reps, [&] { z::cpu_adam_update(opt, {1e-3f, ++step, 1.0f}, a, pool, isa); });
      } else {
        z::cpu_adam_arrays<z::bf16_bits> const a{master.get(), m.get(),     v.get(),
                                                 grad16.get(), out16.get(), n};
        ms = median_ms(reps, [&] { z::cpu_adam_update(opt, {1e-3f, ++step, 1.0f}, a, pool, isa); });
      }
      double const pps = static_cast<double>(n) / (ms * 1e-3);
      if (mode == 0) { best_fp32 = std::max(best_fp32, pps); }
      std::printf("| %s | %s | %.2f | %.3f | %.1f | %.2f |\n",
                  mode == 0 ? "AdamW fp32 grad, fp32 out" : "AdamW bf16 grad, fp32 + bf16 out",
                  z::name_of(isa), ms, pps / 1e9, pps * 28.0 / 1e9, pps / bound);
    }
  }

  if (peer) {
    // The script beside this source file, or under bench/peers/ of the working directory (a
    // binary built elsewhere and run from the repository root).
    std::string script = "bench/peers/torch_cpu_adam.py";
    if (!std::filesystem::exists(script)) {
      std::string s = __FILE__;
      auto const at = s.rfind('/');
      script        = (at == std::string::npos ? std::string{"."} : s.substr(0, at)) +
               "/peers/torch_cpu_adam.py";
    }
    std::string const cmd = "python3 " + script + " --json --params " + std::to_string(n) +
                            " --threads " + std::to_string(pool.size()) + " --reps " +
                            std::to_string(reps);
    std::fflush(stdout);
    FILE* p = ::popen(cmd.c_str(), "r");
    std::string last;
    if (p == nullptr) {
      std::printf("torch peer: could not start: %s\n", cmd.c_str());
      return 0;
    }
    {
      char line[4096];
      while (std::fgets(line, sizeof line, p) != nullptr) { last = line; }
      int const rc = ::pclose(p);
      if (rc != 0 || last.find('{') == std::string::npos) {
        std::printf("torch peer: failed (exit %d): %s\n", rc, cmd.c_str());
        return 0;
      }
    }
    double const fused    = json_number(last, "fused");
    double const foreach_ = json_number(last, "foreach");
    double const plain    = json_number(last, "default");
    std::printf(
        "torch CPU AdamW (same size, %u threads): default %.3f, foreach %.3f, fused %.3f "
        "Gparams/s\n",
        pool.size(), plain / 1e9, foreach_ / 1e9, fused / 1e9);
    std::printf(
        "wm fp32 / torch fused: %.2f (target >= 1.1); wm fp32 / memory limit: %.2f (target "
        ">= 0.80)\n",
        best_fp32 / fused, best_fp32 / bound);
  }
  return 0;
}
