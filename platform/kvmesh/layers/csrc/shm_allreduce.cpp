// A shared-memory all-reduce between the tensor-parallel ranks of one machine: the CPU
// counterpart of NCCL's intra-node path, as vLLM's CPU backend has one. A 16 KiB gloo
// all-reduce over loopback costs ~0.9 ms (two socket round trips and thread hand-offs);
// here a rank copies its part into shared memory, raises a counter, waits for its peers'
// counters and sums the parts: microseconds for a decode step's 16 KiB.
//
// The segment (a uint8 tensor mapping one shared file; layers/shm_allreduce.py makes it):
//   Header (64 bytes) | Control[world] (64 bytes each) | data: 2 phases x world slots x slot_bytes
// Control[r].seq counts rank r's all-reduce chunks. Chunk s of rank r: copy into slot
// (s % 2, r), store seq = s (release), wait until every rank's seq >= s (acquire), then sum
// the world slots of phase s % 2 in rank order into the tensor. Every rank adds the same
// numbers in the same order, so all ranks get the same bits. Two phases let a rank write
// chunk s + 1 while a slower peer still reads chunk s: a rank reaches chunk s + 2 (phase s's
// slots again) only after every peer raised its seq to s + 1, i.e. finished reading chunk s.
// Tensors larger than a slot go chunk by chunk. An all-gather (the vocab-parallel logits)
// is the same exchange, each rank then copying every slot out instead of summing them.
//
// A wait spins briefly, then yields with the GIL released (gil.h). It fails, rather than
// hangs, when a peer's process is gone (its pid, from Control[r].pid, missing or a zombie in
// /proc: checked every 10 ms) or after `timeout_s`, as gloo's collective timeout.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <sched.h>
#include <torch/library.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gil.h"

namespace {

constexpr uint64_t kMagic = 0x316d68736b766d6bULL;  // "kmvkshm1"
constexpr int64_t kLine = 64;

struct Header {
  uint64_t magic;
  int64_t world;
  int64_t slot_bytes;
  char pad[kLine - 24];
};

struct alignas(kLine) Control {
  std::atomic<int64_t> seq;
  int64_t pid;
  char pad[kLine - 16];
};

static_assert(sizeof(Header) == kLine && sizeof(Control) == kLine, "shm layout: one cache line each");

int64_t segment_bytes(int64_t world, int64_t slot_bytes) { return kLine + kLine * world + 2 * world * slot_bytes; }

struct Segment {
  Header* header;
  Control* control;
  char* data;
  int64_t world, slot_bytes;

  char* slot(int64_t phase, int64_t rank) const { return data + (phase * world + rank) * slot_bytes; }
};

Segment view(const at::Tensor& seg) {
  TORCH_CHECK(seg.device().is_cpu() && seg.scalar_type() == at::kByte && seg.is_contiguous() && seg.numel() >= kLine,
              "shm all-reduce: the segment must be a contiguous uint8 CPU tensor");
  auto* base = static_cast<char*>(seg.data_ptr());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % kLine == 0, "shm all-reduce: the segment must be 64-byte aligned");
  auto* h = reinterpret_cast<Header*>(base);
  TORCH_CHECK(h->magic == kMagic && h->world >= 1 && h->slot_bytes > 0 && h->slot_bytes % kLine == 0 &&
                  seg.numel() >= segment_bytes(h->world, h->slot_bytes),
              "shm all-reduce: the segment is not initialized (or too small for its header)");
  return {h, reinterpret_cast<Control*>(base + kLine), base + kLine + kLine * h->world, h->world, h->slot_bytes};
}

// Whether process `pid` has exited (gone from /proc, or a zombie its parent has not reaped).
bool process_gone(int64_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces
  return close == nullptr || close[1] == '\0' || close[2] == 'Z' || close[2] == 'X';
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Until rank `peer` has raised its counter to `target`.
void wait_for(const Segment& s, int64_t peer, int64_t target, double timeout_s) {
  const std::atomic<int64_t>& seq = s.control[peer].seq;
  for (int i = 0; i < 20000; ++i) {  // a peer a few microseconds behind: no syscall
    if (seq.load(std::memory_order_acquire) >= target) return;
    cpu_relax();
  }
  kvmesh_cpu::GilRelease released;
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto checked = start;
  while (seq.load(std::memory_order_acquire) < target) {
    sched_yield();
    const auto now = clock::now();
    if (now - checked < std::chrono::milliseconds(10)) continue;
    checked = now;
    const int64_t pid = s.control[peer].pid;
    TORCH_CHECK(pid <= 0 || !process_gone(pid), "shm all-reduce: tensor-parallel rank ", peer, " (pid ", pid,
                ") exited in the middle of a collective");  // (pid 0: not attached yet)
    TORCH_CHECK(std::chrono::duration<double>(now - start).count() < timeout_s, "shm all-reduce: rank ", peer,
                " did not join the collective within ", timeout_s, " s");
  }
}

// dst[i] = sum over ranks r (in order) of slot(phase, r)[i], for n elements.
template <typename T>
void sum_slots(const Segment& s, int64_t phase, int64_t n, T* dst) {
  at::parallel_for(0, n, 16384, [&](int64_t b, int64_t e) {
    if constexpr (std::is_same_v<T, float>) {
      const float* first = reinterpret_cast<const float*>(s.slot(phase, 0));
      for (int64_t i = b; i < e; ++i) dst[i] = first[i];
      for (int64_t r = 1; r < s.world; ++r) {
        const float* part = reinterpret_cast<const float*>(s.slot(phase, r));
        for (int64_t i = b; i < e; ++i) dst[i] += part[i];
      }
    } else {  // bfloat16: summed in float32, rounded once
      for (int64_t i = b; i < e; ++i) {
        float acc = static_cast<float>(reinterpret_cast<const T*>(s.slot(phase, 0))[i]);
        for (int64_t r = 1; r < s.world; ++r) acc += static_cast<float>(reinterpret_cast<const T*>(s.slot(phase, r))[i]);
        dst[i] = static_cast<T>(acc);
      }
    }
  });
}

}  // namespace

namespace kvmesh_cpu {

void shm_all_reduce_init(const at::Tensor& seg, int64_t world, int64_t slot_bytes) {
  TORCH_CHECK(world >= 1 && slot_bytes > 0 && slot_bytes % kLine == 0,
              "shm all-reduce: world >= 1 and slot_bytes a positive multiple of 64");
  TORCH_CHECK(seg.scalar_type() == at::kByte && seg.is_contiguous() && seg.numel() >= segment_bytes(world, slot_bytes),
              "shm all-reduce: the segment needs ", segment_bytes(world, slot_bytes), " bytes");
  auto* base = static_cast<char*>(seg.data_ptr());
  std::memset(base, 0, kLine + kLine * world);
  auto* h = reinterpret_cast<Header*>(base);
  h->world = world;
  h->slot_bytes = slot_bytes;
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;  // last: a peer that sees it sees the rest
}

bool shm_all_reduce_attach(const at::Tensor& seg, int64_t rank, int64_t world) {
  if (seg.scalar_type() != at::kByte || !seg.is_contiguous() || seg.numel() < kLine) return false;
  const auto* h = static_cast<const Header*>(seg.data_ptr());
  std::atomic_thread_fence(std::memory_order_acquire);
  if (h->magic != kMagic || h->world != world || rank < 0 || rank >= world ||
      seg.numel() < segment_bytes(world, h->slot_bytes))
    return false;
  Segment s = view(seg);
  s.control[rank].pid = static_cast<int64_t>(getpid());
  return true;
}

// Whether every rank has attached and this process sees each one's pid alive: ranks in
// other pid namespaces (containers sharing a /dev/shm) could not tell a dead peer from a
// live one, so they must keep gloo.
bool shm_all_reduce_peers_visible(const at::Tensor& seg) {
  const Segment s = view(seg);
  for (int64_t r = 0; r < s.world; ++r) {
    const int64_t pid = s.control[r].pid;
    if (pid <= 0 || process_gone(pid)) return false;
  }
  return true;
}

}  // namespace kvmesh_cpu

namespace {

// The exchange both collectives are made of: `x`'s elements chunk by chunk, each chunk
// copied into this rank's slot, published, and once every peer published the same chunk,
// `consume(phase, offset, n)` reads the world's slots.
template <typename Consume>
void exchange(const Segment& s, int64_t rank, const at::Tensor& x, double timeout_s, Consume consume) {
  TORCH_CHECK(rank >= 0 && rank < s.world, "shm all-reduce: rank ", rank, " outside world ", s.world);
  const int64_t es = x.element_size(), total = x.numel(), chunk = s.slot_bytes / es;
  const char* base = static_cast<const char*>(x.data_ptr());
  std::atomic<int64_t>& mine = s.control[rank].seq;
  for (int64_t off = 0; off < total; off += chunk) {
    const int64_t n = std::min(chunk, total - off);
    const int64_t seq = mine.load(std::memory_order_relaxed) + 1, phase = seq & 1;
    std::memcpy(s.slot(phase, rank), base + off * es, n * es);
    mine.store(seq, std::memory_order_release);
    for (int64_t r = 0; r < s.world; ++r)
      if (r != rank) wait_for(s, r, seq, timeout_s);
    consume(phase, off, n);
  }
}

}  // namespace

namespace kvmesh_cpu {

at::Tensor& shm_all_reduce_(at::Tensor& x, const at::Tensor& seg, int64_t rank, double timeout_s) {
  const Segment s = view(seg);
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "shm all-reduce: a contiguous float32 or bfloat16 CPU tensor");
  const bool fp32 = x.scalar_type() == at::kFloat;
  void* data = x.data_ptr();
  exchange(s, rank, x, timeout_s, [&](int64_t phase, int64_t off, int64_t n) {
    if (fp32)
      sum_slots(s, phase, n, static_cast<float*>(data) + off);
    else
      sum_slots(s, phase, n, static_cast<c10::BFloat16*>(data) + off);
  });
  return x;
}

// (world, *x.shape): every rank's x, in rank order, on every rank.
at::Tensor shm_all_gather(const at::Tensor& x_in, const at::Tensor& seg, int64_t rank, double timeout_s) {
  const Segment s = view(seg);
  TORCH_CHECK(x_in.device().is_cpu(), "shm all-gather: a CPU tensor");
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape{s.world};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  at::Tensor out = at::empty(shape, x.options());
  const int64_t es = x.element_size(), total = x.numel();
  auto* dst = static_cast<char*>(out.data_ptr());
  exchange(s, rank, x, timeout_s, [&](int64_t phase, int64_t off, int64_t n) {
    for (int64_t r = 0; r < s.world; ++r) std::memcpy(dst + (r * total + off) * es, s.slot(phase, r), n * es);
  });
  return out;
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("shm_all_reduce_init(Tensor segment, int world, int slot_bytes) -> ()");
  m.def("shm_all_reduce_attach(Tensor segment, int rank, int world) -> bool");
  m.def("shm_all_reduce_peers_visible(Tensor segment) -> bool");
  m.def("shm_all_gather(Tensor x, Tensor segment, int rank, float timeout_s) -> Tensor");
  m.def("shm_all_reduce_(Tensor(a!) x, Tensor segment, int rank, float timeout_s) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("shm_all_reduce_init", &kvmesh_cpu::shm_all_reduce_init);
  m.impl("shm_all_reduce_attach", &kvmesh_cpu::shm_all_reduce_attach);
  m.impl("shm_all_reduce_peers_visible", &kvmesh_cpu::shm_all_reduce_peers_visible);
  m.impl("shm_all_gather", &kvmesh_cpu::shm_all_gather);
  m.impl("shm_all_reduce_", &kvmesh_cpu::shm_all_reduce_);
}
