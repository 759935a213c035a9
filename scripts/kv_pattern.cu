// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 -std=c++17 scripts/kv_pattern.cu -o /tmp/kvpat && /tmp/kvpat
// Read-bandwidth of the x64 decode attention's K/V access pattern (docs/perf/cuda.md, session 9):
// the same 168 MB (64 sequences x 641 positions x 8 KV heads x 128 halves, K and V) read as
//  A: attn_batch's blocks (token, KV head, split of 3), plain 16-byte loads, paged rows,
//  B: the same bytes as contiguous ranges, plain loads,
//  C: attn_batch's blocks and copy pipeline (cp.async, 2 stages of 64 rows, 70 KB of shared
//     memory, 128 threads: 3 blocks per SM) without the math,
//  D: as C with the tile wait and barrier only (the loop shape of the kernel), 4 stages of 32 rows,
//  E: blocks of (token, split) reading whole position rows (all 8 heads, 2 KB), plain loads;
//  C3 / C4: C with 3 stages (2 blocks per SM) / 2 stages of 32 rows (6 blocks per SM).
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>
#include <cuda_runtime.h>
typedef unsigned short u16;
typedef unsigned int u32;
#define NSEQ 64
#define LEN 641
#define NKV 8
#define HD 128
#define BT 16
#define NSPLIT 3
#define MAXB 48
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp16(void* s, const void* g, int n) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(s)), "l"(g), "r"(n));
}
__device__ __forceinline__ int slice(int len) { int per = (len + NSPLIT - 1) / NSPLIT; return (per + 63) / 64 * 64; }
__global__ void pat_a(const uint4* kc, const uint4* vc, const int* btab, u32* out) {
  int t = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z;
  int sl = slice(LEN), p0 = s * sl, p1 = min(LEN, p0 + sl);
  const int* bl = btab + t * MAXB;
  u32 acc = 0;
  // 16 chunks of 16 bytes per 256-byte piece: thread tid reads chunk tid%16 of rows tid/16 + 8j
#pragma unroll 4
  for (int p = p0 + threadIdx.x / 16; p < p1; p += 8) {
    long long row = (long long)bl[p / BT] * BT + p % BT;
    long long off = (row * NKV + kvh) * (HD / 8) + threadIdx.x % 16;
    uint4 a = kc[off], b = vc[off];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}
__global__ void pat_b(const uint4* kc, const uint4* vc, long long per_block, u32* out) {
  long long b = blockIdx.x + (long long)gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const uint4* k = kc + b * per_block;
  const uint4* v = vc + b * per_block;
  u32 acc = 0;
  for (long long i = threadIdx.x; i < per_block; i += blockDim.x) {
    uint4 a = k[i], c = v[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ c.x ^ c.y ^ c.z ^ c.w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}
template <int ROWS, int STAGES>
__global__ void pat_c(const u16* kc, const u16* vc, const int* btab, u32* out) {
  extern __shared__ __align__(16) u16 sh[];
  constexpr int KS = HD + 8, TILE = ROWS * KS;
  u16* Ks = sh; u16* Vs = sh + STAGES * TILE;
  int t = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z, tid = threadIdx.x;
  int sl = slice(LEN), p0 = s * sl, p1 = min(LEN, p0 + sl);
  const int* bl = btab + t * MAXB;
  int ntiles = (p1 - p0 + ROWS - 1) / ROWS;
  auto issue = [&](int tile, int stage) {
    int base = p0 + tile * ROWS;
    for (int j = 0; j < ROWS / 8; j++) {
      int pr = tid / 16 + 8 * j, ch = tid % 16, p = base + pr;
      bool ok = p < p1;
      long long row = ok ? (long long)bl[p / BT] * BT + p % BT : 0;
      long long off = (row * NKV + kvh) * HD + ch * 8;
      cp16(Ks + stage * TILE + pr * KS + ch * 8, kc + off, ok ? 16 : 0);
      cp16(Vs + stage * TILE + pr * KS + ch * 8, vc + off, ok ? 16 : 0);
    }
    asm volatile("cp.async.commit_group;");
  };
  for (int i = 0; i < STAGES - 1 && i < ntiles; i++) issue(i, i);
  u32 acc = 0;
  for (int tile = 0; tile < ntiles; tile++) {
    if (tile + STAGES - 1 < ntiles) issue(tile + STAGES - 1, (tile + STAGES - 1) % STAGES);
    else asm volatile("cp.async.commit_group;");
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1));
    __syncthreads();
    int stage = tile % STAGES;
    acc ^= *(const u32*)(Ks + stage * TILE + (tid % ROWS) * KS) ^ *(const u32*)(Vs + stage * TILE + (tid % ROWS) * KS + 8);
    __syncthreads();
  }
  if (acc == 0x12345678u) out[0] = acc;
}
__global__ void pat_e(const uint4* kc, const uint4* vc, const int* btab, u32* out) {
  int t = blockIdx.x, s = blockIdx.z;
  int sl = slice(LEN), p0 = s * sl, p1 = min(LEN, p0 + sl);
  const int* bl = btab + t * MAXB;
  u32 acc = 0;
  constexpr int CH = NKV * HD / 8;  // 128 chunks of 16 bytes per position row
  for (int i = threadIdx.x; i < (p1 - p0) * CH; i += blockDim.x) {
    int p = p0 + i / CH, c = i % CH;
    long long row = (long long)bl[p / BT] * BT + p % BT;
    uint4 a = kc[row * CH + c], b = vc[row * CH + c];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}
int main() {
  size_t rows = (size_t)NSEQ * MAXB * BT;
  size_t bytes = rows * NKV * HD * 2;
  u16 *kc, *vc; int* btab; u32* out;
  cudaMalloc(&kc, bytes); cudaMalloc(&vc, bytes); cudaMalloc(&out, 4);
  cudaMemset(kc, 1, bytes); cudaMemset(vc, 2, bytes);
  std::vector<int> bt(NSEQ * MAXB);
  for (int i = 0; i < NSEQ * MAXB; i++) bt[i] = i;
  std::mt19937 g(7); std::shuffle(bt.begin(), bt.end(), g);
  cudaMalloc(&btab, bt.size() * 4); cudaMemcpy(btab, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice);
  double moved = (double)NSEQ * LEN * NKV * HD * 2 * 2;  // K and V
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  auto timeit = [&](const char* name, auto launch, double mb) {
    for (int i = 0; i < 3; i++) launch();
    cudaEventRecord(e0);
    for (int i = 0; i < 20; i++) launch();
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    printf("%-70s %7.1f us  %.2f TB/s  (%s)\n", name, ms * 1e3 / 20, mb / (ms * 1e-3 / 20) / 1e12, cudaGetErrorString(cudaGetLastError()));
  };
  dim3 ga(NSEQ, NKV, NSPLIT);
  timeit("A: attn_batch blocks, plain 16-B loads, paged 256-B pieces", [&] { pat_a<<<ga, 128>>>((uint4*)kc, (uint4*)vc, btab, out); }, moved);
  long long per = (long long)(moved / 2 / 16) / (NSEQ * NKV * NSPLIT);
  timeit("B: same grid, contiguous ranges, plain loads", [&] { pat_b<<<ga, 128>>>((uint4*)kc, (uint4*)vc, per, out); }, (double)per * 16 * 2 * NSEQ * NKV * NSPLIT);
  int sm2 = 2 * 2 * 64 * (HD + 8) * 2;
  cudaFuncSetAttribute(pat_c<64, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm2);
  timeit("C: attn_batch blocks + cp.async pipeline (2 stages x 64 rows, 70 KB), no math", [&] { pat_c<64, 2><<<ga, 128, sm2>>>(kc, vc, btab, out); }, moved);
  int sm4 = 4 * 2 * 32 * (HD + 8) * 2;
  cudaFuncSetAttribute(pat_c<32, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm4);
  timeit("D: attn_batch blocks + cp.async pipeline (4 stages x 32 rows, 70 KB), no math", [&] { pat_c<32, 4><<<ga, 128, sm4>>>(kc, vc, btab, out); }, moved);
  int sm3 = 3 * 2 * 64 * (HD + 8) * 2;
  cudaFuncSetAttribute(pat_c<64, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm3);
  timeit("C3: 3 stages x 64 rows (104 KB, 2 blocks/SM), no math", [&] { pat_c<64, 3><<<ga, 128, sm3>>>(kc, vc, btab, out); }, moved);
  int smh = 2 * 2 * 64 * (HD + 8) * 2 / 2;
  cudaFuncSetAttribute(pat_c<32, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smh);
  timeit("C4: 2 stages x 32 rows (35 KB, 6 blocks/SM), no math", [&] { pat_c<32, 2><<<ga, 128, smh>>>(kc, vc, btab, out); }, moved);
  dim3 ge(NSEQ, 1, NSPLIT);
  timeit("E: blocks (token, split) reading whole 2-KB rows, plain loads", [&] { pat_e<<<ge, 256>>>((uint4*)kc, (uint4*)vc, btab, out); }, moved);
  timeit("E1024: as E with 1024 threads per block", [&] { pat_e<<<ge, 1024>>>((uint4*)kc, (uint4*)vc, btab, out); }, moved);
  return 0;
}
