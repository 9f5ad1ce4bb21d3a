"""The next step for group-wise W8A8 at verify sizes, measured: weights packed 16 output channels x 4 inputs
per 64-byte register ([N/16][K/4][16][4]), so one vpdpbusd accumulates 16 channels and the int-to-float work
of a group is shared by 16 channels instead of done once per channel (AVX-512 VNNI only).

    python bench/bench_packed_group.py

Checks that the packed kernel gives bit for bit what quasar's `int8_group_mm` gives (G = 32), then times
all the default model's linears (30 layers, weights streamed from memory) at 1 and 6 rows, interleaved,
against quasar's per-channel int32 products and its current G = 32 kernel. Results: docs/quantization.md.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

from quasar.kernels import native

SOURCE = r"""
// Experiment: group-wise W8A8 (G = 32) with weights packed 16 channels x 4 inputs per 64-byte register
// ([N/16][K/4][16][4]), so vpdpbusd accumulates 16 channels at once and the float work is per 16 channels.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")
namespace {
template <int MB>
void block(const uint8_t* u, const float* xs, const int8_t* wp, const float* wsp, float* out, int64_t m0, int64_t N,
           int64_t K, int64_t nb) {
  const int64_t groups = K / 32;
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 facc[MB];
  for (int i = 0; i < MB; ++i) facc[i] = _mm512_setzero_ps();
  const int8_t* base = wp + nb * 16 * K;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i corr = _mm512_setzero_si512();
    __m512i acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const int64_t k = g * 32 + 4 * j;
      const __m512i wv = _mm512_loadu_si512(base + k * 16);
      _mm_prefetch(reinterpret_cast<const char*>(base + k * 16 + 2048), _MM_HINT_T0);
      corr = _mm512_dpbusd_epi32(corr, c128, wv);
      for (int i = 0; i < MB; ++i) {
        const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(u + (m0 + i) * K + k));
        acc[i] = _mm512_dpbusd_epi32(acc[i], xv, wv);
      }
    }
    const __m512 ws = _mm512_loadu_ps(wsp + (nb * groups + g) * 16);
    for (int i = 0; i < MB; ++i) {
      const __m512 sc = _mm512_mul_ps(ws, _mm512_set1_ps(xs[(m0 + i) * groups + g]));
      facc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], corr)), sc, facc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out + (m0 + i) * N + nb * 16, facc[i]);
}
}  // namespace
#pragma GCC pop_options

// q [M, K] int8, xs [M, K/32], wp packed [N/16][K/4][16][4], wsp [N/16][K/32][16] -> [M, N]
torch::Tensor packed_mm(torch::Tensor q, torch::Tensor xs, torch::Tensor wp, torch::Tensor wsp, int64_t N) {
  const int64_t M = q.size(0), K = q.size(1);
  std::vector<uint8_t> u(M * K);
  const int8_t* qp = q.data_ptr<int8_t>();
  for (int64_t i = 0; i < M * K; ++i) u[i] = static_cast<uint8_t>(qp[i]) ^ 0x80;
  auto y = torch::empty({M, N}, xs.options());
  at::parallel_for(0, N / 16, 1, [&](int64_t a, int64_t b) {
    for (int64_t nb = a; nb < b; ++nb) {
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) block<8>(u.data(), xs.data_ptr<float>(), wp.data_ptr<int8_t>(), wsp.data_ptr<float>(), y.data_ptr<float>(), m, N, K, nb);
      switch (M - m) {
        case 1: block<1>(u.data(), xs.data_ptr<float>(), wp.data_ptr<int8_t>(), wsp.data_ptr<float>(), y.data_ptr<float>(), m, N, K, nb); break;
        case 2: block<2>(u.data(), xs.data_ptr<float>(), wp.data_ptr<int8_t>(), wsp.data_ptr<float>(), y.data_ptr<float>(), m, N, K, nb); break;
        case 6: block<6>(u.data(), xs.data_ptr<float>(), wp.data_ptr<int8_t>(), wsp.data_ptr<float>(), y.data_ptr<float>(), m, N, K, nb); break;
        default: TORCH_CHECK(M - m == 0, "rows 1, 2, 6, 8k only in this experiment");
      }
    }
  });
  return y;
}

"""


def build():
    return load_inline("quasar_packed_experiment", cpp_sources=[SOURCE], functions=["packed_mm"],
                       extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])


def pack(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16][K/4][16][4]."""
    N, K = w.shape
    return w.view(N // 16, 16, K // 4, 4).permute(0, 2, 1, 3).contiguous()


def pack_scales(s: torch.Tensor) -> torch.Tensor:
    """[N, K/32] -> [N/16][K/32][16]."""
    N, G = s.shape
    return s.view(N // 16, 16, G).permute(0, 2, 1).contiguous()


def main() -> None:
    k = native.kernel()
    if k is None or "dpbusd" not in k.int8_paths():
        raise SystemExit("needs quasar's kernels on a CPU with AVX-512 VNNI")
    pk = build()
    torch.manual_seed(0)
    for M in (1, 2, 6, 8):
        N, K = 48, 96
        q = torch.randint(-127, 128, (M, K), dtype=torch.int8)
        w = torch.randint(-128, 128, (N, K), dtype=torch.int8)
        xs, ws = 2.0 ** -torch.randint(0, 3, (M, K // 32)).float(), 2.0 ** -torch.randint(0, 3, (N, K // 32)).float()
        assert torch.equal(k.int8_group_mm(q, xs, w, ws, "dpbusd"), pk.packed_mm(q, xs, pack(w), pack_scales(ws), N))
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30
    W = [torch.randint(-127, 128, (n, kk), dtype=torch.int8) for n, kk in shapes]
    S = [torch.rand(n, kk // 32) for n, kk in shapes]
    WP, SP = [pack(w) for w in W], [pack_scales(s) for s in S]
    print(f"int8 path dpbusd; {torch.get_num_threads()} threads")
    for M in (1, 6):
        qs = {kk: torch.randint(-127, 128, (M, kk), dtype=torch.int8) for kk in (576, 1536)}
        xs = {kk: torch.rand(M, kk // 32) for kk in (576, 1536)}
        calls = {
            "pc int32": lambda qs=qs: [k.int8_mm(qs[w.shape[1]], w, "dpbusd") for w in W],
            "g32 now": lambda qs=qs, xs=xs: [k.int8_group_mm(qs[w.shape[1]], xs[w.shape[1]], w, s, "dpbusd")
                                             for w, s in zip(W, S)],
            "g32 packed": lambda qs=qs, xs=xs: [pk.packed_mm(qs[w.shape[1]], xs[w.shape[1]], wp, sp, w.shape[0])
                                                for w, wp, sp in zip(W, WP, SP)],
        }
        times = {name: [] for name in calls}
        for _ in range(9):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        for name, t in times.items():
            print(f"rows {M}  {name:>11}: {statistics.median(t[2:]) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
