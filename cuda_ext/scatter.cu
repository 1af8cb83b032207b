// Page scatter for FlatCake restores (paper section 3.4 / 4).
//
// A restore reads one layer's requested pages as a single contiguous extent into a staging
// window; this kernel then copies page i of that extent to its own destination:
//
//     dst_base + page_index[i] * index_stride_bytes
//
// Layer-first and page-first paged pools are both "base of this layer + slot * slot stride";
// a generic caller (vLLM's own cache shapes) passes byte offsets with a stride of 1.
//
// Plain C ABI, no torch headers: the library builds in seconds with nvcc alone and the
// Python side calls it through ctypes. Every entry point returns a cudaError_t as int.

#include <cuda_runtime.h>

#include <cstdint>

namespace {

// Bump when an exported signature changes; the loader refuses a library of another version.
constexpr int kAbiVersion = 1;

constexpr int64_t kVecBytes = 16;  // one uint4
constexpr int kUnroll = 4;         // loads in flight per thread before the first store
constexpr int kMinThreads = 32;
constexpr int kMaxThreads = 256;
constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridY = 65535;

__device__ __forceinline__ bool both_aligned(const void* a, const void* b) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b);
  return (bits & (kVecBytes - 1)) == 0;
}

__device__ __forceinline__ void copy_bytes(const uint8_t* __restrict__ src,
                                           uint8_t* __restrict__ dst, int64_t begin,
                                           int64_t end) {
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    dst[i] = src[i];
  }
}

// Caller guarantees src + begin and dst + begin are 16-byte aligned. All loads of a round
// are issued before its stores so each thread keeps kUnroll requests in flight.
__device__ __forceinline__ void copy_vectors(const uint8_t* __restrict__ src,
                                             uint8_t* __restrict__ dst, int64_t begin,
                                             int64_t end) {
  const uint4* __restrict__ src_vec = reinterpret_cast<const uint4*>(src + begin);
  uint4* __restrict__ dst_vec = reinterpret_cast<uint4*>(dst + begin);
  const int64_t vec_count = (end - begin) / kVecBytes;
  const int64_t round_stride = static_cast<int64_t>(blockDim.x) * kUnroll;
  for (int64_t round = threadIdx.x; round < vec_count; round += round_stride) {
    uint4 held[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = round + static_cast<int64_t>(u) * blockDim.x;
      // Staging is dead after the scatter: stream it past L2 rather than evict pool lines.
      if (k < vec_count) held[u] = __ldcs(src_vec + k);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = round + static_cast<int64_t>(u) * blockDim.x;
      if (k < vec_count) dst_vec[k] = held[u];
    }
  }
  copy_bytes(src, dst, begin + vec_count * kVecBytes, end);
}

// grid.x: one block row per page (x allows 2^31-1, enough for 1-token pages);
// grid.y: chunks of a page, strided when a page has more than 65535 chunks.
__global__ void __launch_bounds__(kMaxThreads)
    scatter_pages_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst_base,
                         const int64_t* __restrict__ page_index, int64_t page_bytes,
                         int64_t index_stride_bytes, int64_t index_limit, int64_t chunk_bytes) {
  const int64_t page = blockIdx.x;
  const int64_t index = page_index[page];
  // The host validates indices; this guard only keeps a bad one from writing outside the pool.
  if (index < 0 || index >= index_limit) return;
  const uint8_t* src_page = src + page * page_bytes;
  uint8_t* dst_page = dst_base + index * index_stride_bytes;
  // Decided per page (uniform across the block): with odd page sizes some pages align.
  const bool vectorised = both_aligned(src_page, dst_page);
  const int64_t chunk_stride = static_cast<int64_t>(gridDim.y) * chunk_bytes;
  for (int64_t begin = blockIdx.y * chunk_bytes; begin < page_bytes; begin += chunk_stride) {
    const int64_t end = begin + chunk_bytes < page_bytes ? begin + chunk_bytes : page_bytes;
    if (vectorised) {
      copy_vectors(src_page, dst_page, begin, end);
    } else {
      copy_bytes(src_page, dst_page, begin, end);
    }
  }
}

struct LaunchShape {
  int threads;
  int64_t chunk_bytes;
  int64_t chunks;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Small pages get small blocks so few threads idle; large pages get 256 threads x 64 bytes.
LaunchShape launch_shape(int64_t page_bytes) {
  int64_t threads = ceil_div(ceil_div(page_bytes, kVecBytes), kMinThreads) * kMinThreads;
  if (threads > kMaxThreads) threads = kMaxThreads;
  if (threads < kMinThreads) threads = kMinThreads;
  const int64_t chunk_bytes = threads * kVecBytes * kUnroll;
  int64_t chunks = ceil_div(page_bytes, chunk_bytes);
  if (chunks > kMaxGridY) chunks = kMaxGridY;
  return LaunchShape{static_cast<int>(threads), chunk_bytes, chunks};
}

bool arguments_valid(const void* src, const void* dst_base, const int64_t* page_index,
                     int64_t num_pages, int64_t page_bytes, int64_t index_stride_bytes,
                     int64_t index_limit) {
  if (num_pages < 0 || num_pages > kMaxGridX) return false;
  if (page_bytes < 0 || index_stride_bytes < 0 || index_limit < 0) return false;
  return src != nullptr && dst_base != nullptr && page_index != nullptr;
}

}  // namespace

// Built with -fvisibility=hidden and --exclude-libs,ALL: only these names leave the library,
// so torch's own libcudart can never interpose on the static runtime linked in here.
#define FLATCAKE_API __attribute__((visibility("default")))

extern "C" {

FLATCAKE_API int flatcake_scatter_abi_version(void) { return kAbiVersion; }

FLATCAKE_API const char* flatcake_scatter_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// cudaSuccess when the installed driver can run this library's runtime. Creates no context.
FLATCAKE_API int flatcake_scatter_driver_status(void) {
  int driver_version = 0;
  const cudaError_t err = cudaDriverGetVersion(&driver_version);
  if (err != cudaSuccess) return err;
  if (driver_version == 0) return cudaErrorNoDevice;
  // Minor-version compatibility: a 13.x runtime runs on any 13.y driver.
  if (driver_version / 1000 < CUDART_VERSION / 1000) return cudaErrorInsufficientDriver;
  return cudaSuccess;
}

// Copies page i (page_bytes bytes at src + i * page_bytes) to
// dst_base + page_index[i] * index_stride_bytes for i < num_pages, on `stream` of `device`.
// page_index is a device array of int64; entries outside [0, index_limit) are skipped.
// Asynchronous: returns once launched; the launch error (if any) is the return value.
FLATCAKE_API int flatcake_scatter_pages(const void* src, void* dst_base,
                                        const int64_t* page_index, int64_t num_pages,
                                        int64_t page_bytes, int64_t index_stride_bytes,
                                        int64_t index_limit, int device, uintptr_t stream) {
  if (num_pages == 0 || page_bytes == 0) return cudaSuccess;
  if (!arguments_valid(src, dst_base, page_index, num_pages, page_bytes, index_stride_bytes,
                       index_limit)) {
    return cudaErrorInvalidValue;
  }
  int previous_device = -1;
  cudaError_t err = cudaGetDevice(&previous_device);
  if (err != cudaSuccess) return err;
  // The stream belongs to `device`; launch there and leave the caller's device as it was.
  if (previous_device != device && (err = cudaSetDevice(device)) != cudaSuccess) return err;
  const LaunchShape shape = launch_shape(page_bytes);
  const dim3 grid(static_cast<unsigned>(num_pages), static_cast<unsigned>(shape.chunks));
  scatter_pages_kernel<<<grid, shape.threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst_base), page_index, page_bytes,
      index_stride_bytes, index_limit, shape.chunk_bytes);
  err = cudaGetLastError();
  if (previous_device != device) {
    const cudaError_t restore = cudaSetDevice(previous_device);
    if (err == cudaSuccess) err = restore;
  }
  return err;
}

}  // extern "C"
