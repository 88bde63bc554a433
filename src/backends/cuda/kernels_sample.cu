// Sampling where the logits are: a block of 1,024 threads per row picks its token by the host's
// rules (core/token_pick.h) with the host's draw, so a seed gives the same tokens as sampling on
// the host (sums formed in another order can move a pick only when the draw falls within
// rounding of a boundary).
//
// Hand-written because no library does this part: the rules fix an order (z descending, id
// ascending) and sums in it, which a rejection sampler (FlashInfer) or a full sort would not
// keep, and a 262k-entry row in one block needs no global sort: top-k and top-p work on the first
// kPickList candidates in that order, selected by a radix descent over the keys and sorted in
// shared memory; temperature and min-p alone walk the row in vocabulary order. A row whose top-k
// or nucleus is longer than the list is sorted whole (cub's radix sort) and walked in order.
#include <climits>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_kernels.h"

namespace mb::cuda {

namespace {

constexpr int kThreads = 1024;
constexpr int kCand = 4096;    // candidates a row's threshold may let into the sort
constexpr int kSample = 4096;  // keys sampled for that threshold

// a[0, n) sorted descending (n a power of two), by the whole block; it ends synchronised.
__device__ void sort_desc(uint64_t* a, int n) {
  for (int size = 2; size <= n; size <<= 1)
    for (int j = size >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int partner = i ^ j;
        if (partner > i) {
          const bool desc = (i & size) == 0;
          const uint64_t x = a[i], y = a[partner];
          if ((x < y) == desc) {
            a[i] = y;
            a[partner] = x;
          }
        }
      }
      __syncthreads();
    }
}

// z's place in ascending order as an unsigned integer (-0 counted as +0, as comparisons do).
__device__ __forceinline__ uint32_t order_key(float z) {
  const uint32_t b = __float_as_uint(z == 0.f ? 0.f : z);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// (key descending, id ascending) as one number to sort descending.
__device__ __forceinline__ uint64_t rank_of(uint32_t key, int32_t id) {
  return (uint64_t(key) << 32) | uint64_t(0xffffffffu - uint32_t(id));
}

struct MaxInt {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};

struct MaxAt {
  float v;
  int32_t id;  // the first (smallest) id of the maximum
};
struct MaxAtOp {
  __device__ MaxAt operator()(const MaxAt& a, const MaxAt& b) const {
    if (a.id < 0) return b;
    if (b.id < 0) return a;
    return (b.v > a.v || (b.v == a.v && b.id < a.id)) ? b : a;
  }
};

__global__ void __launch_bounds__(kThreads) k_sample_rows(const float* x, int64_t V, const PickArgs* picks,
                                                          int32_t* ids) {
  using ReduceMax = cub::BlockReduce<MaxAt, kThreads>;
  using ReduceInt = cub::BlockReduce<int, kThreads>;
  __shared__ union {
    typename ReduceMax::TempStorage max;
    typename ReduceInt::TempStorage reduce_int;
  } tmp;
  __shared__ uint64_t list[kCand];  // candidates, then (sorted) the list
  __shared__ double plist[kPickList];
  __shared__ int hist[256];
  __shared__ MaxAt s_max;
  __shared__ int s_int[4];
  __shared__ double s_mass[kThreads / 32];
  __shared__ int s_last[kThreads / 32], s_gt[kThreads / 32], s_eq[kThreads / 32];

  pdl_begin();
  const int tid = threadIdx.x;
  const PickArgs pk = picks[blockIdx.x];
  const float* row = x + int64_t(blockIdx.x) * V;
  const bool greedy = !(pk.temperature > 0.f);
  const float T = pk.temperature;
  auto z_of = [&](int64_t c) { return greedy ? row[c] : row[c] / T; };

  // The maximum of z (its first id) and whether every logit is finite.
  MaxAt m{0.f, -1};
  int bad = 0;
  for (int64_t c = tid; c < V; c += kThreads) {
    const float v = row[c];
    if (!isfinite(v)) {
      bad = 1;
      continue;
    }
    const float z = z_of(c);
    if (m.id < 0 || z > m.v) m = {z, int32_t(c)};  // a thread's ids ascend: the first stays
  }
  const MaxAt best = ReduceMax(tmp.max).Reduce(m, MaxAtOp());
  __syncthreads();
  const int any_bad = ReduceInt(tmp.reduce_int).Reduce(bad, MaxInt());
  if (tid == 0) {
    s_max = best;
    s_int[0] = any_bad;
  }
  __syncthreads();
  if (s_int[0] || s_max.id < 0) {
    if (tid == 0) ids[blockIdx.x] = -1;
    return;
  }
  if (greedy) {
    if (tid == 0) ids[blockIdx.x] = s_max.id;
    return;
  }
  const float mx = s_max.v;
  auto p_of = [&](int64_t c) { return exp(double(z_of(c) - mx)); };
  const bool top_k = pk.top_k > 0 && pk.top_k < V;
  // Passes that keep vocabulary order give each warp a run of ids [lo, hi), read 32 at a time.
  const int warp = tid / 32, lane = tid % 32, n_warps = kThreads / 32;
  const int64_t seg = ((V + n_warps - 1) / n_warps + 31) / 32 * 32, lo = min(V, warp * seg), hi = min(V, lo + seg);
  const unsigned below = (1u << lane) - 1;  // lanes before this one

  if (!top_k && !(pk.top_p < 1.f)) {
    // Vocabulary order: each warp's survivor mass, a scan over the warps, and the warp whose run
    // holds u * total walks it, 32 at a time.
    const double floor = pk.min_p;
    double mass = 0;
    int last = -1;
    for (int64_t c = lo + lane; c < hi; c += 32) {
      const double p = p_of(c);
      if (p >= floor) mass += p, last = int(c);
    }
    mass = warp_sum(mass);
    last = warp_max(last);
    if (lane == 0) s_mass[warp] = mass, s_last[warp] = last;
    __syncthreads();
    double before = 0, total = 0;
    int survivor = -1;
    for (int w = 0; w < n_warps; ++w) {
      if (w < warp) before += s_mass[w];
      total += s_mass[w];
      survivor = max(survivor, s_last[w]);
    }
    const double r = pk.u * total;
    if (tid == 0) s_int[1] = INT_MIN;
    __syncthreads();
    if (last >= 0 && before <= r && r < before + mass) {
      double acc = before;
      int pick = last;  // rounding can leave the run's sum short of r: then its last survivor
      for (int64_t c0 = lo; c0 < hi; c0 += 32) {
        const int64_t c = c0 + lane;
        double p = c < hi ? p_of(c) : 0.0;
        if (p < floor) p = 0;
        double incl = p;  // the sum up to this lane, in lane order
        for (int o = 1; o < 32; o <<= 1) {
          const double v = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += v;
        }
        const unsigned over = __ballot_sync(0xffffffffu, p > 0 && acc + incl > r);
        if (over) {
          pick = int(c0 + __ffs(over) - 1);
          break;
        }
        acc += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) atomicMax(&s_int[1], -1 - pick);  // the smallest id if two runs claim it
    }
    __syncthreads();
    if (tid == 0) ids[blockIdx.x] = s_int[1] != INT_MIN ? -1 - s_int[1] : survivor;
    return;
  }

  // Descending order. The list: the first L candidates (L = k under top-k, else kPickList).
  if (pk.top_k > kPickList) {  // beyond the list: the host picks
    if (tid == 0) ids[blockIdx.x] = -2;
    return;
  }
  const int L = int(top_k ? pk.top_k : (V < kPickList ? V : kPickList));
  const bool complete = top_k || V <= kPickList;  // the list holds every candidate
  // A threshold key that about 2L + 256 keys reach, from a strided sample of kSample keys sorted:
  // then every key at or above it goes into `list` (at most kCand), sorted, and the list is its
  // first L. When the sample misleads (fewer than L keys reach it, or more than kCand), the L-th
  // key is found exactly by a radix descent instead (counts gathered a warp at a time: keys of
  // one row share their top bits, so plain atomics would queue on a few counters).
  uint32_t thr = 0;  // every key reaches 0
  if (V > kCand) {
    for (int i = tid; i < kSample; i += kThreads)
      list[i] = uint64_t(order_key(z_of(int64_t(i) * V / kSample))) << 32;
    __syncthreads();
    sort_desc(list, kSample);
    const int64_t want = 3 + (int64_t(2) * L + 256) * kSample / V, j = want < kSample - 1 ? want : kSample - 1;
    thr = uint32_t(list[j] >> 32);
    __syncthreads();
  }
  int reach = 0;
  for (int64_t c = tid; c - lane < V; c += kThreads) {
    const bool in = c < V && order_key(z_of(c)) >= thr;
    reach += __popc(__ballot_sync(0xffffffffu, in));
  }
  if (lane == 0) s_gt[warp] = reach;
  __syncthreads();
  int n_reach = 0;
  for (int w = 0; w < n_warps; ++w) n_reach += s_gt[w];
  __syncthreads();
  if (n_reach >= L && n_reach <= kCand) {
    if (tid == 0) s_int[1] = 0;
    __syncthreads();
    for (int64_t c = tid; c - lane < V; c += kThreads) {
      const uint32_t key = c < V ? order_key(z_of(c)) : 0u;
      const bool in = c < V && key >= thr;
      const unsigned b = __ballot_sync(0xffffffffu, in);
      int at = 0;
      if (lane == 0 && b) at = atomicAdd(&s_int[1], __popc(b));
      at = __shfl_sync(0xffffffffu, at, 0);
      if (in) list[at + __popc(b & below)] = rank_of(key, int32_t(c));
    }
    for (int i = n_reach + tid; i < kCand; i += kThreads) list[i] = 0;
    __syncthreads();
    int n_sort = 1;
    while (n_sort < n_reach) n_sort <<= 1;
    sort_desc(list, n_sort);
  } else {
    uint32_t prefix = 0, mask = 0;
    int need = L;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kThreads) hist[i] = 0;
      __syncthreads();
      for (int64_t c = tid; c - lane < V; c += kThreads) {  // whole warps, so the ballot sees every lane
        const uint32_t key = c < V ? order_key(z_of(c)) : 0u;
        const bool counts = c < V && (key & mask) == prefix;
        const unsigned active = __ballot_sync(0xffffffffu, counts);
        if (!counts) continue;
        const int b = int((key >> shift) & 255u);
        const unsigned peers = __match_any_sync(active, b);
        if (lane == __ffs(peers) - 1) atomicAdd(&hist[b], __popc(peers));
      }
      __syncthreads();
      if (tid == 0) {
        int cum = 0, b = 255;
        for (; b > 0 && cum + hist[b] < need; --b) cum += hist[b];
        s_int[2] = b;
        s_int[3] = need - cum;
      }
      __syncthreads();
      prefix |= uint32_t(s_int[2]) << shift;
      mask |= 255u << shift;
      need = s_int[3];
      __syncthreads();
    }
    // The list, unordered: keys above the L-th, then its ties by ascending id (`need` of them):
    // each warp counts both in its run, a scan over the warps, then each writes its own.
    int gt = 0, eq = 0;
    for (int64_t c = lo + lane; c - lane < hi; c += 32) {
      const uint32_t key = c < hi ? order_key(z_of(c)) : 0u;
      gt += __popc(__ballot_sync(0xffffffffu, c < hi && key > prefix));
      eq += __popc(__ballot_sync(0xffffffffu, c < hi && key == prefix));
    }
    if (lane == 0) s_gt[warp] = gt, s_eq[warp] = eq;
    for (int i = tid; i < kCand; i += kThreads) list[i] = 0;
    __syncthreads();
    int gt_at = 0, eq_at = 0, n_gt = 0;
    for (int w = 0; w < n_warps; ++w) {
      if (w < warp) gt_at += s_gt[w], eq_at += s_eq[w];
      n_gt += s_gt[w];
    }
    for (int64_t c = lo + lane; c - lane < hi; c += 32) {
      const uint32_t key = c < hi ? order_key(z_of(c)) : 0u;
      const unsigned bg = __ballot_sync(0xffffffffu, c < hi && key > prefix);
      const unsigned be = __ballot_sync(0xffffffffu, c < hi && key == prefix);
      if (c < hi && key > prefix) list[gt_at + __popc(bg & below)] = rank_of(key, int32_t(c));
      const int tie = eq_at + __popc(be & below);
      if (c < hi && key == prefix && tie < need) list[n_gt + tie] = rank_of(key, int32_t(c));
      gt_at += __popc(bg);
      eq_at += __popc(be);
    }
    __syncthreads();
    int n_sort = 1;  // the list's first power of two at least L (zeros past L sort last)
    while (n_sort < L) n_sort <<= 1;
    sort_desc(list, n_sort);
  }
  for (int i = tid; i < L; i += kThreads) plist[i] = p_of(int64_t(0xffffffffu - uint32_t(list[i])));
  // Without top-k, top-p's target is a share of every candidate's mass.
  double all = 0;
  if (!top_k) {
    double mass = 0;
    for (int64_t c = lo + lane; c < hi; c += 32) mass += p_of(c);
    mass = warp_sum(mass);
    if (lane == 0) s_mass[warp] = mass;
  }
  __syncthreads();
  if (!top_k)
    for (int w = 0; w < n_warps; ++w) all += s_mass[w];
  if (tid != 0) return;
  // The rest in order, as the host does it.
  double sum = 0;
  for (int i = 0; i < L; ++i) sum += plist[i];
  if (!top_k) sum = all;
  int keep = L;
  if (pk.top_p < 1.f) {
    const double target = double(pk.top_p) * sum;
    double acc = 0;
    int i = 0;
    while (i < L && (acc += plist[i]) < target) ++i;
    if (i == L && !complete) {  // the nucleus is longer than the list: the host picks
      ids[blockIdx.x] = -2;
      return;
    }
    keep = min(L, i + 1);
  }
  if (pk.min_p > 0.f)  // p falls along the list: min-p cuts its tail
    while (keep > 1 && plist[keep - 1] < double(pk.min_p)) --keep;
  double total = 0;
  for (int i = 0; i < keep; ++i) total += plist[i];
  double r = pk.u * total;
  int pick = keep - 1;
  for (int i = 0; i < keep; ++i) {
    r -= plist[i];
    if (r < 0) {
      pick = i;
      break;
    }
  }
  ids[blockIdx.x] = int32_t(0xffffffffu - uint32_t(list[pick]));
}

// A row's order as sortable numbers: (key << idbits) | (2^idbits - 1 - id), sorted descending.
__global__ void k_rank_keys(const float* row, int64_t V, float T, int idbits, uint64_t* keys) {
  pdl_begin();
  const uint64_t mask = (uint64_t(1) << idbits) - 1;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < V; c += int64_t(gridDim.x) * blockDim.x)
    keys[c] = (uint64_t(order_key(row[c] / T)) << idbits) | (mask - uint64_t(c));
}

// The host's rules over a row sorted by k_rank_keys (every logit finite): each thread takes a run
// of the order; runs' sums and a scan find where top-p's and the draw's sums cross, and the
// thread whose run holds a crossing walks it.
// p[i] = exp(z - max z) of the i-th in order, over the whole GPU (the sort's keys buffer).
__global__ void k_sorted_p(const float* row, const uint64_t* sorted, int64_t V, float T, int idbits, double* p) {
  pdl_begin();
  const uint64_t mask = (uint64_t(1) << idbits) - 1;
  const float mx = row[mask - (sorted[0] & mask)] / T;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < V; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = exp(double(row[mask - (sorted[i] & mask)] / T - mx));
}

__global__ void __launch_bounds__(kThreads) k_pick_sorted(const uint64_t* sorted, const double* p, int64_t V,
                                                          int idbits, PickArgs pk, int32_t* id_out) {
  using ScanDouble = cub::BlockScan<double, kThreads>;
  __shared__ typename ScanDouble::TempStorage scan;
  __shared__ int64_t s_cut;
  pdl_begin();
  const uint64_t mask = (uint64_t(1) << idbits) - 1;
  auto id_at = [&](int64_t i) { return int64_t(mask - (sorted[i] & mask)); };
  auto p_at = [&](int64_t i) { return p[i]; };
  const int tid = threadIdx.x;
  const int64_t K = pk.top_k > 0 && pk.top_k < V ? pk.top_k : V;
  // The first index in [0, n) whose running sum (from 0) reaches `target` (strict: exceeds it),
  // or `none`.
  auto crossing = [&](int64_t n, double target, bool strict, int64_t none) {
    const int64_t chunk = (n + kThreads - 1) / kThreads, lo = min(n, tid * chunk), hi = min(n, lo + chunk);
    double mass = 0;
    for (int64_t i = lo; i < hi; ++i) mass += p_at(i);
    double before = 0, all = 0;
    ScanDouble(scan).ExclusiveSum(mass, before, all);
    if (tid == 0) s_cut = none;
    __syncthreads();
    const bool mine = strict ? (before <= target && target < before + mass) : (before < target && target <= before + mass);
    if (mine) {
      double acc = before;
      int64_t at = hi - 1;  // rounding can leave the run's sum short: its last then
      for (int64_t i = lo; i < hi; ++i) {
        acc += p_at(i);
        if (strict ? acc > target : acc >= target) {
          at = i;
          break;
        }
      }
      atomicMin(reinterpret_cast<unsigned long long*>(&s_cut), (unsigned long long)at);
    }
    __syncthreads();
    const int64_t r = s_cut;
    __syncthreads();
    return r;
  };
  // The mass of [0, n).
  auto mass_of = [&](int64_t n) {
    const int64_t chunk = (n + kThreads - 1) / kThreads, lo = min(n, tid * chunk), hi = min(n, lo + chunk);
    double mass = 0;
    for (int64_t i = lo; i < hi; ++i) mass += p_at(i);
    double before = 0, all = 0;
    ScanDouble(scan).ExclusiveSum(mass, before, all);
    __syncthreads();
    return all;
  };
  int64_t keep = K;
  if (pk.top_p < 1.f) {
    const double target = double(pk.top_p) * mass_of(K);
    keep = target <= 0 ? 1 : crossing(K, target, false, K - 1) + 1;
  }
  if (pk.min_p > 0.f) {  // p falls along the order: the first below min_p ends the survivors
    if (tid == 0) s_cut = keep;
    __syncthreads();
    const int64_t chunk = (keep + kThreads - 1) / kThreads, lo = min(keep, tid * chunk), hi = min(keep, lo + chunk);
    for (int64_t i = lo; i < hi; ++i)
      if (p_at(i) < double(pk.min_p)) {
        atomicMin(reinterpret_cast<unsigned long long*>(&s_cut), (unsigned long long)(i > 1 ? i : 1));
        break;
      }
    __syncthreads();
    keep = s_cut;
    __syncthreads();
  }
  const double r = pk.u * mass_of(keep);
  const int64_t at = crossing(keep, r, true, keep - 1);
  if (tid == 0) *id_out = int32_t(id_at(at));
}

}  // namespace

int sample_id_bits(int64_t V) {
  int b = 1;
  while ((int64_t(1) << b) < V) ++b;
  return b;
}

size_t sample_sort_temp_bytes(int64_t V) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortKeysDescending(nullptr, bytes, static_cast<const uint64_t*>(nullptr),
                                           static_cast<uint64_t*>(nullptr), V, 0, 32 + sample_id_bits(V));
  return bytes;
}

void sample_row_sorted(const float* row, int64_t V, const PickArgs& pick, uint64_t* keys, uint64_t* sorted,
                       void* temp, size_t temp_bytes, int32_t* id, cudaStream_t st) {
  const int idbits = sample_id_bits(V);
  launch_kernel(k_rank_keys, blocks_for(V, 256), 256, 0, st, row, V, pick.temperature, idbits, keys);
  check_launch("sample_rows (sort keys)");
  check_call(cub::DeviceRadixSort::SortKeysDescending(temp, temp_bytes, keys, sorted, V, 0, 32 + idbits, st),
             "sample_rows (sort)");
  double* p = reinterpret_cast<double*>(keys);  // the keys are spent once sorted
  launch_kernel(k_sorted_p, blocks_for(V, 256), 256, 0, st, row, sorted, V, pick.temperature, idbits, p);
  check_launch("sample_rows (sorted p)");
  launch_kernel(k_pick_sorted, 1, kThreads, 0, st, sorted, p, V, idbits, pick, id);
  check_launch("sample_rows (sorted)");
}

void sample_rows(const float* x, int64_t rows, int64_t V, const PickArgs* picks, int32_t* ids, cudaStream_t st) {
  if (rows == 0) return;
  launch_kernel(k_sample_rows, unsigned(rows), kThreads, 0, st, x, V, picks, ids);
  check_launch("sample_rows");
}

}  // namespace mb::cuda
