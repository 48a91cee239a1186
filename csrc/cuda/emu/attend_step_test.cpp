// The fused decode step's kernels (csrc/cuda/attend_step.cuh) on the CPU against the step's
// definition in double: every distant key and value rebuilt from its latent (RoPE on the rotated
// dims), one masked softmax over the visible full-width slots and latents. Every loop of each part
// (full-width: 16-byte packs and one slot per warp; latents: one slot per warp, four with kr, four
// with RoPE absorbed into the query, and on the tensor cores, step_latent_mma), the
// shapes the models give (vanilla, a wrapped window ring, Pythia's DAR with biases and a quarter of
// the dims rotated, Llama's grouped heads with every dim rotated, uniform), left padding, bf16 and fp16;
// for the tensor-core path also Pythia-70M's shape, 12 heads over 4 and 18 over 6 (two head tiles),
// and the distant part's own Σ p·c / L before the roundings after it.
#include "emu_test.h"
#include "../attend_step.cuh"
#include <algorithm>
#include <cstring>

namespace {

using emu_test::Half;

struct Case {
  const char* name;
  int B, H, Hkv, hd;
  int W = 0, keep = 0;  // full-width slots (0: none) and the ring's slot count (0: slot j holds position j)
  int S = 0, r = 0, rot = 0, window = 0;  // latents (S = 0: none)
  bool bias = false;
  int64_t newest = 0;
  std::vector<int64_t> pad;
  int chunk = 32, ring_chunk = 32;
  int mma_chunk = 64;     // slots a block of step_latent_mma
  bool mma_only = false;  // the latents on the tensor cores alone, the full-width slots by packs (the emulator's time)
  bool no_mma = false;    // r outside the tensor-core kernels' list: the CUDA-core loops alone
};

template <typename T>
struct Inputs {
  Half<T> q, rk, rv, c, wk, wv, bk, bv;
  std::vector<float> cos, sin;  // [S, rot/2]
  std::vector<T> kr;            // [B, S, Hkv·rot], rounded as the launcher's matmul rounds it
};

template <typename T>
Inputs<T> make(const Case& k, std::mt19937& rng) {
  Inputs<T> in;
  in.q = emu_test::normal<T>(rng, size_t(k.B) * k.H * k.hd, 1.5);
  if (k.W) {
    in.rk = emu_test::normal<T>(rng, size_t(k.B) * k.Hkv * k.W * k.hd, 1.0);
    in.rv = emu_test::normal<T>(rng, size_t(k.B) * k.Hkv * k.W * k.hd, 1.0);
  }
  if (k.S) {
    in.c = emu_test::normal<T>(rng, size_t(k.B) * k.S * k.r, 1.0);
    in.wk = emu_test::normal<T>(rng, size_t(k.Hkv) * k.hd * k.r, 1.0 / std::sqrt(double(k.r)));
    in.wv = emu_test::normal<T>(rng, size_t(k.Hkv) * k.hd * k.r, 1.0 / std::sqrt(double(k.r)));
    if (k.bias) {
      in.bk = emu_test::normal<T>(rng, size_t(k.Hkv) * k.hd, 0.5);
      in.bv = emu_test::normal<T>(rng, size_t(k.Hkv) * k.hd, 0.5);
    }
    const int half = k.rot / 2;
    for (int s = 0; s < k.S; ++s)
      for (int i = 0; i < half; ++i) {
        const double a = s * std::pow(10000.0, -2.0 * i / k.rot);
        in.cos.push_back(float(std::cos(a)));
        in.sin.push_back(float(std::sin(a)));
      }
    for (int b = 0; b < k.B; ++b)
      for (int s = 0; s < k.S; ++s)
        for (int h = 0; h < k.Hkv; ++h)
          for (int d = 0; d < k.rot; ++d) {
            double x = 0;
            for (int j = 0; j < k.r; ++j) x += in.c.ref[(size_t(b) * k.S + s) * k.r + j] * in.wk.ref[(size_t(h) * k.hd + d) * k.r + j];
            in.kr.push_back(emu_test::to_half<T>(float(x)));
          }
  }
  return in;
}

int64_t ring_position(int64_t newest, int64_t s, int64_t keep) { return keep > 0 ? newest - (((newest - s) % keep) + keep) % keep : s; }

// Σ_i softmax(score)_i · rows[i] (rows `width` wide, one per score; zeros when there is none).
std::vector<double> softmax_mix(const std::vector<double>& score, const std::vector<double>& rows, int width) {
  double m = -INFINITY, z = 0;
  for (double s : score) m = std::max(m, s);
  std::vector<double> o(width, 0.0);
  for (size_t i = 0; i < score.size(); ++i) {
    const double e = std::exp(score[i] - m);
    z += e;
    for (int d = 0; d < width; ++d) o[d] += e * rows[i * width + d];
  }
  for (double& x : o) x = z > 0 ? x / z : 0.0;
  return o;
}

// The step's output [B, H, hd] by its definition; `window_shift` / `newest_shift` plant a mask one
// slot off (the test's own check that it can fail).
template <typename T>
std::vector<double> reference(const Case& k, const Inputs<T>& in, int window_shift, int newest_shift) {
  const int g = k.H / k.Hkv, half = k.rot / 2;
  const double scale = 1.0 / std::sqrt(double(k.hd));
  std::vector<double> out;
  for (int b = 0; b < k.B; ++b)
    for (int h = 0; h < k.H; ++h) {
      const int kv = h / g;
      const double* q = &in.q.ref[(size_t(b) * k.H + h) * k.hd];
      std::vector<double> score, val;  // val: one hd-row per visible slot
      const int64_t newest = k.newest - newest_shift;
      for (int j = 0; j < k.W; ++j) {
        const int64_t at = ring_position(k.newest, j, k.keep);
        if (at < k.pad[b] || at > newest) continue;
        const size_t o = ((size_t(b) * k.Hkv + kv) * k.W + j) * k.hd;
        double s = 0;
        for (int d = 0; d < k.hd; ++d) s += q[d] * in.rk.ref[o + d];
        score.push_back(s * scale);
        val.insert(val.end(), in.rv.ref.begin() + o, in.rv.ref.begin() + o + k.hd);
      }
      for (int s = 0; s < k.S; ++s) {
        if (k.newest - s < k.window + window_shift || s < k.pad[b]) continue;
        std::vector<double> key(k.hd), v(k.hd);
        for (int d = 0; d < k.hd; ++d) {
          double x = k.bias ? in.bk.ref[size_t(kv) * k.hd + d] : 0, y = k.bias ? in.bv.ref[size_t(kv) * k.hd + d] : 0;
          for (int j = 0; j < k.r; ++j) {
            const double c = in.c.ref[(size_t(b) * k.S + s) * k.r + j];
            x += in.wk.ref[(size_t(kv) * k.hd + d) * k.r + j] * c;
            y += in.wv.ref[(size_t(kv) * k.hd + d) * k.r + j] * c;
          }
          key[d] = x;
          v[d] = y;
        }
        std::vector<double> rk = key;
        for (int i = 0; i < half; ++i) {
          const double cs = in.cos[size_t(s) * half + i], sn = in.sin[size_t(s) * half + i];
          rk[i] = key[i] * cs - key[i + half] * sn;
          rk[i + half] = key[i + half] * cs + key[i] * sn;
        }
        double x = 0;
        for (int d = 0; d < k.hd; ++d) x += q[d] * rk[d];
        score.push_back(x * scale);
        val.insert(val.end(), v.begin(), v.end());
      }
      const std::vector<double> o = softmax_mix(score, val, k.hd);
      out.insert(out.end(), o.begin(), o.end());
    }
  return out;
}

// The distant part alone by its definition, before the 16-bit roundings after the partial kernels:
// per (b, h), Σ_s p_s·c_s (r wide) with p the softmax over the visible latents' scores.
template <typename T>
std::vector<double> reference_pc(const Case& k, const Inputs<T>& in) {
  const int g = k.H / k.Hkv, half = k.rot / 2;
  const double scale = 1.0 / std::sqrt(double(k.hd));
  std::vector<double> out;
  for (int b = 0; b < k.B; ++b)
    for (int h = 0; h < k.H; ++h) {
      const int kv = h / g;
      const double* q = &in.q.ref[(size_t(b) * k.H + h) * k.hd];
      std::vector<double> score, latents;  // latents: one r-row per visible slot
      for (int s = 0; s < k.S; ++s) {
        if (k.newest - s < k.window || s < k.pad[b]) continue;
        std::vector<double> key(k.hd);
        for (int d = 0; d < k.hd; ++d) {
          double x = k.bias ? in.bk.ref[size_t(kv) * k.hd + d] : 0;
          // The rotated dims from kr as the kernels read it (rounded to T), the rest from the latent.
          if (d < k.rot) x += emu_test::from_half(in.kr[(size_t(b) * k.S + s) * k.Hkv * k.rot + size_t(kv) * k.rot + d]);
          else
            for (int j = 0; j < k.r; ++j) x += in.wk.ref[(size_t(kv) * k.hd + d) * k.r + j] * in.c.ref[(size_t(b) * k.S + s) * k.r + j];
          key[d] = x;
        }
        double x = 0;
        for (int i = 0; i < half; ++i) {
          const double cs = in.cos[size_t(s) * half + i], sn = in.sin[size_t(s) * half + i];
          x += q[i] * (key[i] * cs - key[i + half] * sn) + q[i + half] * (key[i + half] * cs + key[i] * sn);
        }
        for (int d = k.rot; d < k.hd; ++d) x += q[d] * key[d];
        score.push_back(x * scale);
        const auto c = in.c.ref.begin() + (size_t(b) * k.S + s) * k.r;
        latents.insert(latents.end(), c, c + k.r);
      }
      const std::vector<double> pc = softmax_mix(score, latents, k.r);
      out.insert(out.end(), pc.begin(), pc.end());
    }
  return out;
}

// The latent chunks' partial outputs (ml, acc) merged in double: per (b, h), Σ p·c / L over them.
std::vector<double> merge_latent_chunks(const Case& k, const std::vector<float>& ml, const std::vector<float>& acc, int nchunks, int nring) {
  std::vector<double> out;
  for (int head = 0; head < k.B * k.H; ++head) {
    double M = -INFINITY, L = 0;
    for (int c = 0; c < nchunks; ++c) M = std::max(M, double(ml[(size_t(head) * (nchunks + nring) + c) * 2]));
    std::vector<double> pc(k.r, 0.0);
    for (int c = 0; c < nchunks && M != -INFINITY; ++c) {
      const double mc = ml[(size_t(head) * (nchunks + nring) + c) * 2];
      if (mc == -INFINITY) continue;
      const double f = std::exp(mc - M);
      L += f * ml[(size_t(head) * (nchunks + nring) + c) * 2 + 1];
      for (int j = 0; j < k.r; ++j) pc[j] += f * acc[(size_t(head) * nchunks + c) * k.r + j];
    }
    for (int j = 0; j < k.r; ++j) out.push_back(L > 0 ? pc[j] / L : 0.0);
  }
  return out;
}

// The same bits (empty vectors included: memcmp may not be given their null data()).
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// `fresh`: the new token's key, value and latent handed over as their own tensors while their
// cache slots hold stale values; the kernels must read the new ones and the combine kernel must
// write them into the caches (checked here: a failure returns NaNs).
// batched: the latents one slot per warp (0), four (1), four with RoPE absorbed (2), or on the tensor
// cores (3: step_latent_mma with its own chunks, step_partial for the ring alone); step_qw first in all.
// With `pc`, the latent chunks' partial outputs merged in double are returned there too.
template <typename T, int G>
std::vector<double> run(const Case& k, const Inputs<T>& in, int batched, bool vec, bool fresh, std::vector<double>* pc_out = nullptr) {
  const bool mma = batched == 3;
  std::vector<T> rk = in.rk.dev, rv = in.rv.dev, c = in.c.dev;  // the caches, written by a fresh step
  std::vector<T> nk, nv, nc;                                     // the new token's own rows
  const int64_t slot = k.keep > 0 ? k.newest % k.keep : k.newest;
  const T stale = emu_test::to_half<T>(100.f);
  if (fresh) {
    for (int b = 0; b < k.B; ++b)
      for (int h = 0; h < k.Hkv && k.W; ++h)
        for (int d = 0; d < k.hd; ++d) {
          const size_t o = ((size_t(b) * k.Hkv + h) * k.W + slot) * k.hd + d;
          nk.push_back(rk[o]);
          nv.push_back(rv[o]);
          rk[o] = rv[o] = stale;
        }
    for (int b = 0; b < k.B && k.S; ++b)
      for (int j = 0; j < k.r; ++j) {
        const size_t o = (size_t(b) * k.S + k.newest) * k.r + j;
        nc.push_back(c[o]);
        c[o] = stale;
      }
  }
  CacheWrite cw{};
  cw.pos = &k.newest;
  Params p{};
  p.q = in.q.dev.data();
  p.q_sb = int64_t(k.H) * k.hd;
  p.q_sh = k.hd;
  p.pos = &k.newest;
  p.pad = k.pad.data();
  p.batched = batched == 1 || batched == 2;
  p.rope_absorbed = batched == 2;
  if (k.W) {
    p.rk = rk.data();
    p.rv = rv.data();
    p.r_ss = k.hd;
    p.r_sh = int64_t(k.W) * k.hd;
    p.r_sb = int64_t(k.Hkv) * p.r_sh;
    p.W = k.W;
    p.vec = vec;
    p.keep = k.keep;
    p.ring_chunk = k.ring_chunk;
    p.nring = (k.W + k.ring_chunk - 1) / k.ring_chunk;
  }
  p.r = 1;
  if (k.S) {
    p.c = c.data();
    p.c_ss = k.r;
    p.c_sb = int64_t(k.S) * k.r;
    p.kr = in.kr.data();
    p.kr_ss = int64_t(k.Hkv) * k.rot;
    p.kr_sb = int64_t(k.S) * p.kr_ss;
    p.cos = in.cos.data();
    p.sin = in.sin.data();
    p.cs_s = k.rot / 2;
    p.wk = in.wk.dev.data();
    p.bk = k.bias ? in.bk.dev.data() : nullptr;
    p.window = k.window;
    p.S = k.S;
    p.chunk = mma ? k.mma_chunk : k.chunk;
    p.nchunks = (k.S + p.chunk - 1) / p.chunk;
    p.chunk0 = mma ? p.nchunks : 0;
    p.r = k.r;
  }
  p.hd = k.hd;
  p.rot = k.rot;
  p.g = G;
  p.hkv = k.Hkv;
  p.scale = 1.f / std::sqrt(float(k.hd));
  std::vector<float> ml(size_t(k.B) * k.H * (p.nchunks + p.nring) * 2), acc(size_t(k.B) * k.H * std::max(p.nchunks, 1) * p.r),
      accv(size_t(k.B) * k.H * std::max(p.nring, 1) * k.hd);
  p.ml = ml.data();
  p.acc = acc.data();
  p.accv = accv.data();
  if (fresh && k.W) {
    p.new_k = nk.data();
    p.new_v = nv.data();
    p.nk_sb = int64_t(k.Hkv) * k.hd;
    p.nk_sh = k.hd;
    cw = CacheWrite{rk.data(), rv.data(), p.r_sb, p.r_sh, p.r_ss, k.keep, p.new_k, p.new_v, p.nk_sb, p.nk_sh, nullptr, 0, 0, nullptr, 0, &k.newest};
  }
  if (fresh && k.S) {
    p.new_c = nc.data();
    p.nc_sb = k.r;
    cw.c = c.data();
    cw.c_sb = p.c_sb;
    cw.c_ss = p.c_ss;
    cw.new_c = p.new_c;
    cw.nc_sb = p.nc_sb;
  }
  // As the launcher: qw and β once a step wherever there are latents, for either path.
  std::vector<float> qw(size_t(k.B) * k.H * (p.r + 1));
  if (k.S) {
    p.qw = qw.data();
    p.qbeta = p.qw + size_t(k.B) * k.H * p.r;
    emu::launch(step_qw<T>, dim3(k.B * k.H), dim3(kThreads), 0, p);
  }
  if (mma) {
    emu::launch(latent_mma_kernel<T>(k.r), dim3(p.nchunks, k.B, (k.H + kMmaHeads - 1) / kMmaHeads), dim3(kThreads), mma_smem_bytes(k.r, k.rot), p);
  }
  if (p.nchunks + p.nring - p.chunk0 > 0)
    emu::launch(step_partial<T, G>, dim3(p.nchunks + p.nring - p.chunk0, k.B * k.Hkv), dim3(kThreads),
                smem_floats(G, p.r, k.hd, p.rope_absorbed ? k.rot : 0) * sizeof(float), p);
  if (pc_out) *pc_out = merge_latent_chunks(k, ml, acc, p.nchunks, p.nring);
  std::vector<double> out(size_t(k.B) * k.H * k.hd);
  if (p.rope_absorbed) {
    // The combine kernel applies Wv itself and writes [B, H, hd].
    std::vector<T> o(size_t(k.B) * k.H * k.hd);
    const CombineGrid cg = combine_grid(p.r, k.hd, true);
    emu::launch(step_combine<T>, dim3(k.B * k.H, cg.slabs), dim3(kThreads), combine_smem_bytes(p.nchunks + p.nring, p.r, true), (const float*)p.ml, (const float*)p.acc,
                (const float*)p.accv, (const void*)(k.bias ? in.bv.dev.data() : nullptr), k.B, k.H, G, p.r, k.hd, p.nchunks, p.nring, cg.slab, (T*)nullptr,
                (T*)nullptr, (const void*)(k.S ? in.wv.dev.data() : nullptr), o.data(), cw);
    for (size_t i = 0; i < o.size(); ++i) out[i] = emu_test::from_half(o[i]);
    // A fresh step leaves the caches as a written one: the stale slots overwritten by the new rows.
    if (fresh && !(same_bits(rk, in.rk.dev) && same_bits(rv, in.rv.dev) && same_bits(c, in.c.dev))) {
      std::printf("  FAILED: the fresh step did not write the new token into its cache slots\n");
      std::fill(out.begin(), out.end(), NAN);
    }
    return out;
  }
  std::vector<T> pc(size_t(k.Hkv) * k.B * G * p.r), extra(size_t(k.Hkv) * k.B * G * k.hd);
  const CombineGrid cg = combine_grid(p.r, k.hd, false);
  emu::launch(step_combine<T>, dim3(k.B * k.H, cg.slabs), dim3(kThreads), combine_smem_bytes(p.nchunks + p.nring, p.r, false), (const float*)p.ml, (const float*)p.acc, (const float*)p.accv,
              (const void*)(k.bias ? in.bv.dev.data() : nullptr), k.B, k.H, G, p.r, k.hd, p.nchunks, p.nring, cg.slab, k.S ? pc.data() : (T*)nullptr,
              extra.data(), (const void*)nullptr, (T*)nullptr, cw);
  // The launcher's baddbmm: [Hkv, B·g, hd] = extra + pc · Wvᵀ, in the 16-bit type, then [B, H, hd].
  for (int kv = 0; kv < k.Hkv; ++kv)
    for (int b = 0; b < k.B; ++b)
      for (int hg = 0; hg < G; ++hg)
        for (int d = 0; d < k.hd; ++d) {
          const size_t row = (size_t(kv) * k.B + b) * G + hg;
          double x = emu_test::from_half(extra[row * k.hd + d]);
          for (int j = 0; k.S && j < k.r; ++j) x += emu_test::from_half(pc[row * p.r + j]) * in.wv.ref[(size_t(kv) * k.hd + d) * k.r + j];
          out[(size_t(b) * k.H + kv * G + hg) * k.hd + d] = emu_test::from_half(emu_test::to_half<T>(float(x)));
        }
  // A fresh step leaves the caches as a written one: the stale slots overwritten by the new rows.
  if (fresh && !(same_bits(rk, in.rk.dev) && same_bits(rv, in.rv.dev) && same_bits(c, in.c.dev))) {
    std::printf("  FAILED: the fresh step did not write the new token into its cache slots\n");
    std::fill(out.begin(), out.end(), NAN);
  }
  return out;
}

template <typename T>
std::vector<double> run_g(const Case& k, const Inputs<T>& in, int batched, bool vec, bool fresh, std::vector<double>* pc = nullptr) {
  switch (k.H / k.Hkv) {
    case 1: return run<T, 1>(k, in, batched, vec, fresh, pc);
    case 2: return run<T, 2>(k, in, batched, vec, fresh, pc);
    case 3: return run<T, 3>(k, in, batched, vec, fresh, pc);
    case 4: return run<T, 4>(k, in, batched, vec, fresh, pc);
    default: std::abort();
  }
}

template <typename T>
bool check(const Case& k, const char* dtype, unsigned seed) {
  std::mt19937 rng(seed);
  const Inputs<T> in = make<T>(k, rng);
  const auto want = reference(k, in, 0, 0);
  // A window one slot wider where there are latents, else the newest slot left out.
  const auto planted = k.S ? reference(k, in, 1, 0) : reference(k, in, 0, 1);
  const double bound = std::is_same_v<T, __half> ? 4e-3 : 1.6e-2;
  // The distant part alone, fp32 partials: what is left is P's 16-bit rounding in the mma path (up to
  // 1.2e-3 in bf16, 5e-5 in fp16); qw in 16 bits without its lo part gives 2.9e-3 / 1.6e-4 (fails).
  const double pc_bound = std::is_same_v<T, __half> ? 1e-4 : 2e-3;
  const auto want_pc = k.S ? reference_pc(k, in) : std::vector<double>();
  Case wider = k;  // the planted reference: a window one slot wider
  ++wider.window;
  const auto planted_pc = k.S ? reference_pc(wider, in) : std::vector<double>();
  bool ok = true;
  // Latent loops: 0 one slot per warp, 1 four at a time (kr), 2 four at a time with RoPE absorbed
  // (and Wv applied by the combine kernel).
  // 3: on the tensor cores (step_latent_mma).
  const char* loops[] = {" latents×1", " latents×4", " latents×4 rope-absorbed", " latents mma"};
  for (int batched = k.mma_only ? 3 : 0; batched <= (k.S ? (k.no_mma ? 2 : 3) : 0); ++batched)
    for (int vec = k.mma_only && k.W ? 1 : 0; vec <= (k.W ? 1 : 0); ++vec)
      for (int fresh = 0; fresh <= 1; ++fresh) {
        std::vector<double> pc;
        const auto got = run_g<T>(k, in, batched, vec, fresh, &pc);
        if (k.S && !fresh && vec == (k.W ? 1 : 0) && (batched == 0 || batched == 3)) {
          // The distant part's Σ p·c / L before any 16-bit rounding after the partial kernels: where
          // the mma path's own roundings (qw as hi + lo, P in 16 bits) would show; the one-slot loop
          // (fp32 throughout) for comparison.
          const std::string what = std::string(k.name) + " " + dtype + (batched ? " mma" : " latents×1") + ": distant Σp·c/L";
          ok &= emu_test::verdict(what, emu_test::rel_err(pc, want_pc), emu_test::rel_err(planted_pc, want_pc), pc_bound);
        }
        const std::string what = std::string(k.name) + " " + dtype + (k.S ? loops[batched] : "") + (k.W ? (vec ? " packs" : " scalar") : "") +
                                 (fresh ? " fresh" : "");
        ok &= emu_test::verdict(what, emu_test::rel_err(got, want), emu_test::rel_err(planted, want), bound);
      }
  return ok;
}

bool all_cases() {
  const std::vector<Case> cases = {
      // Vanilla: slot j holds position j; slots past the newest are empty; row 1 left-padded.
      {.name = "vanilla", .B = 2, .H = 4, .Hkv = 4, .hd = 64, .W = 70, .keep = 0, .newest = 65, .pad = {0, 5}},
      // Grouped heads, a wrapped window ring, padding inside the ring.
      {.name = "window ring, 2 heads per kv head", .B = 2, .H = 4, .Hkv = 2, .hd = 32, .W = 16, .keep = 16, .newest = 40, .pad = {0, 30}},
      // Pythia's DAR: biases, a quarter of the dims rotated, the ring of the last w, several chunks.
      {.name = "DAR (Pythia)", .B = 2, .H = 4, .Hkv = 4, .hd = 64, .W = 8, .keep = 8, .S = 75, .r = 32, .rot = 16, .window = 8, .bias = true,
       .newest = 74, .pad = {0, 7}},
      // Llama's DAR: grouped heads (3 per kv head), every dim rotated, no biases, r wider than hd.
      {.name = "DAR (Llama, grouped)", .B = 1, .H = 6, .Hkv = 2, .hd = 32, .W = 4, .keep = 4, .S = 50, .r = 48, .rot = 32, .window = 4,
       .newest = 49, .pad = {0}},
      // Uniform: latents only (window 0), no full-width slots, unrotated keys.
      {.name = "uniform", .B = 2, .H = 2, .Hkv = 2, .hd = 64, .S = 40, .r = 16, .rot = 0, .window = 0, .bias = true, .newest = 37, .pad = {3, 0},
       .mma_chunk = 24},
      // Pythia-70M's shape (8 heads, hd 64, r 128, a quarter rotated, biases): the tensor-core path's
      // 16-head tile half full; spans and chunks not multiples of its 16-slot tiles.
      {.name = "DAR (Pythia-70M)", .B = 2, .H = 8, .Hkv = 8, .hd = 64, .W = 8, .keep = 8, .S = 150, .r = 128, .rot = 16, .window = 8, .bias = true,
       .newest = 149, .pad = {0, 19}, .mma_chunk = 80, .mma_only = true},
      // Grouped heads, 12 over 4 (Llama-like, every dim rotated, no biases).
      {.name = "DAR (12 heads over 4)", .B = 2, .H = 12, .Hkv = 4, .hd = 32, .W = 4, .keep = 4, .S = 90, .r = 64, .rot = 32, .window = 4,
       .newest = 89, .pad = {5, 0}, .mma_chunk = 40, .mma_only = true},
      // 18 heads over 6: two 16-head tiles, the second with two rows.
      {.name = "DAR (18 heads over 6)", .B = 1, .H = 18, .Hkv = 6, .hd = 32, .W = 16, .keep = 16, .S = 70, .r = 32, .rot = 16, .window = 16,
       .bias = true, .newest = 69, .pad = {0}, .mma_chunk = 32, .mma_only = true},
  };
  bool ok = true;
  unsigned seed = 1;
  for (const auto& k : cases) {
    ok &= check<__nv_bfloat16>(k, "bf16", seed++);
  }
  ok &= check<__half>(cases[2], "fp16", seed++);
  ok &= check<__half>(cases[5], "fp16", seed++);
  // After the others, so their seeds (and data) stay as they were.
  const std::vector<Case> many_chunks = {
      // More chunks than the combine kernel has threads (150 of one slot; a thread reduces two), all
      // but the last 21 left of the pad: chunks that saw no slot, the visible ones past thread 127.
      {.name = "vanilla, 150 chunks", .B = 1, .H = 1, .Hkv = 1, .hd = 32, .W = 150, .keep = 0, .newest = 145, .pad = {125}, .ring_chunk = 1},
      // 140 latent chunks of one slot, r 32 (four stripes of chunks in the combine kernel), 7 visible.
      {.name = "DAR, 140 latent chunks", .B = 1, .H = 1, .Hkv = 1, .hd = 32, .W = 8, .keep = 8, .S = 140, .r = 32, .rot = 16, .window = 8,
       .bias = true, .newest = 139, .pad = {125}, .chunk = 1, .mma_chunk = 16},
  };
  for (const auto& k : many_chunks) ok &= check<__nv_bfloat16>(k, "bf16", seed++);
  // step_qw's packs of 8 columns cut short (r 20), and 48 unrotated dims over 32 groups of threads.
  const Case ragged = {.name = "DAR, r 20", .B = 1, .H = 2, .Hkv = 1, .hd = 64, .W = 6, .keep = 6, .S = 14, .r = 20, .rot = 16, .window = 6,
                       .bias = true, .newest = 13, .pad = {0}, .no_mma = true};
  ok &= check<__nv_bfloat16>(ragged, "bf16", seed++);
  return ok;
}

emu_test::Register reg("attend_step: fused decode step vs its definition", all_cases);

}  // namespace
