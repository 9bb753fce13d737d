// SPDX-License-Identifier: Apache-2.0
// Rows read and written by GPU threads in pinned host memory allocated four ways (cudaMallocHost;
// memfd + mmap + cudaHostRegister, as wm's host tables; anonymous memory with transparent huge
// pages + cudaHostRegister; driver VMM host memory, cuMemCreate HOST_NUMA, 2 MiB granularity):
// 1M rows of 512 or 1536 bytes, random or sorted order, over 16 GiB. Does the page size of host
// memory limit scattered row access (bench/NOTES.md: it does not)? Prints ms, GB/s, ns per row.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>
#define CK(x)                                                      \
  do {                                                             \
    auto e_ = (x);                                                 \
    if (e_ != 0) {                                                 \
      std::printf("FAIL %s: %d line %d\n", #x, int(e_), __LINE__); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)

__global__ void touch(uint4* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = make_uint4(i, i, i, i);
}
// one warp per row of `vecs` uint4; read (host -> dev) or write (dev -> host)
__global__ void rows_kernel(uint4* host, uint4* dev, const size_t* idx, size_t n, int vecs,
                            bool write) {
  size_t lane = threadIdx.x % 32, w = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) / 32,
         nw = size_t(gridDim.x) * blockDim.x / 32;
  for (size_t r = w; r < n; r += nw) {
    uint4* h = host + idx[r] * vecs;
    uint4* d = dev + r * vecs;
    for (int v = lane; v < vecs; v += 32) {
      if (write)
        h[v] = d[v];
      else
        d[v] = h[v];
    }
  }
}

int main() {
  {
    std::ifstream a("/sys/kernel/mm/transparent_hugepage/enabled"),
        b("/sys/kernel/mm/transparent_hugepage/shmem_enabled"), c("/proc/sys/vm/nr_hugepages");
    std::string x, y, z;
    std::getline(a, x);
    std::getline(b, y);
    std::getline(c, z);
    std::printf("THP enabled: %s | shmem: %s | nr_hugepages %s\n", x.c_str(), y.c_str(), z.c_str());
  }
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  CK(cuInit(0));
  size_t const S = size_t(16) << 30;
  size_t const n = 1 << 20;
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint4* dev;
  CK(cudaMalloc(&dev, n * 2048));
  size_t* didx;
  CK(cudaMalloc(&didx, n * sizeof(size_t)));
  std::mt19937_64 rng{42};
  auto run = [&](const char* how, void* hostp) {
    CK(cudaDeviceSynchronize());
    touch<<<sms * 8, 256>>>((uint4*)hostp, S / 16);
    CK(cudaDeviceSynchronize());
    for (int rowb : {512, 1536}) {
      int vecs    = rowb / 16;
      size_t rows = S / rowb;
      for (int sorted = 0; sorted < 2; ++sorted) {
        std::vector<size_t> idx(n);
        for (auto& i : idx) i = rng() % rows;
        if (sorted) std::sort(idx.begin(), idx.end());
        CK(cudaMemcpy(didx, idx.data(), n * sizeof(size_t), cudaMemcpyHostToDevice));
        for (int write = 0; write < 2; ++write) {
          cudaEvent_t a, b;
          cudaEventCreate(&a);
          cudaEventCreate(&b);
          float best = 1e9;
          for (int rep = 0; rep < 3; ++rep) {
            cudaEventRecord(a);
            rows_kernel<<<sms * 8, 256>>>((uint4*)hostp, dev, didx, n, vecs, write);
            cudaEventRecord(b);
            CK(cudaEventSynchronize(b));
            float ms;
            cudaEventElapsedTime(&ms, a, b);
            best = std::min(best, ms);
          }
          std::printf("%-34s row %4d B %-6s %-5s: %8.3f ms, %6.1f GB/s, %6.1f ns/row\n", how, rowb,
                      sorted ? "sorted" : "random", write ? "write" : "read", best,
                      n * double(rowb) / best / 1e6, best * 1e6 / n);
        }
      }
    }
  };
  // 1. cudaMallocHost
  {
    void* p;
    CK(cudaMallocHost(&p, S));
    run("cudaMallocHost", p);
    CK(cudaFreeHost(p));
  }
  // 2. memfd + mmap + cudaHostRegister (wm's host tables today)
  {
    int fd = memfd_create("x", MFD_CLOEXEC);
    CK(ftruncate(fd, S));
    void* p = mmap(nullptr, S, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CK(cudaHostRegister(p, S, cudaHostRegisterMapped | cudaHostRegisterPortable));
    void* d;
    CK(cudaHostGetDevicePointer(&d, p, 0));
    run("memfd+mmap+cudaHostRegister", d);
    CK(cudaHostUnregister(p));
    munmap(p, S);
    close(fd);
  }
  // 3. anonymous 2 MiB-aligned + MADV_HUGEPAGE + cudaHostRegister
  {
    size_t const al = size_t(2) << 20;
    void* raw = mmap(nullptr, S + al, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char* p   = (char*)(((uintptr_t)raw + al - 1) & ~(al - 1));
    int m     = madvise(p, S, MADV_HUGEPAGE);
    for (size_t i = 0; i < S; i += 4096) p[i] = 0;
    {
      std::ifstream f("/proc/self/smaps_rollup");
      std::string l;
      while (std::getline(f, l))
        if (l.find("AnonHugePages") != std::string::npos)
          std::printf("  madvise %d, %s\n", m, l.c_str());
    }
    CK(cudaHostRegister(p, S, cudaHostRegisterMapped));
    void* d;
    CK(cudaHostGetDevicePointer(&d, p, 0));
    run("anon+MADV_HUGEPAGE+cudaHostRegister", d);
    CK(cudaHostUnregister(p));
    munmap(raw, S + al);
  }
  // 4. driver VMM host memory (cuMemCreate HOST_NUMA)
  {
    CUmemAllocationProp prop{};
    prop.type          = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    prop.location.id   = 0;
    size_t g = 0, gr = 0;
    CK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CK(cuMemGetAllocationGranularity(&gr, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    std::printf("  VMM host granularity min %zu recommended %zu\n", g, gr);
    CUmemGenericAllocationHandle h;
    CUresult r = cuMemCreate(&h, S, &prop, 0);
    if (r != CUDA_SUCCESS) {
      std::printf("  cuMemCreate HOST_NUMA failed: %d\n", int(r));
    } else {
      CUdeviceptr ptr;
      CK(cuMemAddressReserve(&ptr, S, gr, 0, 0));
      CK(cuMemMap(ptr, S, 0, h, 0));
      CUmemAccessDesc d{};
      d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      d.location.id   = 0;
      d.flags         = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      CK(cuMemSetAccess(ptr, S, &d, 1));
      run("cuMemCreate HOST_NUMA (VMM)", (void*)ptr);
      CK(cuMemUnmap(ptr, S));
      CK(cuMemAddressFree(ptr, S));
      CK(cuMemRelease(h));
    }
  }
  std::printf("done\n");
}
