// Work handed out by claiming: parallel_claim(n, chunk, worker) runs worker(claim) once on each
// of the pool's threads, and claim(begin, end) gives the calling thread its next chunk of
// [0, n). Each thread starts with a contiguous share, as a static split would give it, and walks
// it front to back (so a streaming kernel's prefetch past a chunk lands in its own next chunk);
// a thread whose share is done takes chunks from the back of another's.
//
// Why not a static split (at::parallel_for's): on a host whose cores are shared (the HTTP loop,
// a benchmark's client, other processes), a thread that loses its core for a scheduler slice
// holds its whole share back while the other waits at the join. Here the running thread takes
// the rest. Which thread computes a chunk changes no value: a chunk's arithmetic is the same
// wherever it runs.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

class Claims {
public:
    Claims(int64_t n, int64_t chunk, int64_t ways)
        : chunk_(std::max<int64_t>(1, chunk)), ways_(ways),
          ranges_(new Share[static_cast<size_t>(ways)]) {
        TORCH_CHECK(n >= 0 && n < (int64_t{1} << 31), "claims: range too large");
        for (int64_t i = 0; i < ways; ++i)
            ranges_[i].range.store(pack(n * i / ways, n * (i + 1) / ways));
    }

    // Thread `self`'s next chunk [begin, end): the front of its own share, else the back of
    // another's; false when every share is done.
    bool take(int64_t self, int64_t& begin, int64_t& end) {
        if (cut(self, true, begin, end)) return true;
        for (int64_t k = 1; k < ways_; ++k)
            if (cut((self + k) % ways_, false, begin, end)) return true;
        return false;
    }

private:
    static uint64_t pack(int64_t b, int64_t e) {
        return (static_cast<uint64_t>(b) << 32) | static_cast<uint64_t>(e);
    }

    bool cut(int64_t r, bool front, int64_t& begin, int64_t& end) {
        std::atomic<uint64_t>& share = ranges_[r].range;
        uint64_t w = share.load(std::memory_order_relaxed);
        for (;;) {
            const int64_t b = static_cast<int64_t>(w >> 32);
            const int64_t e = static_cast<int64_t>(w & 0xffffffffu);
            if (b >= e) return false;
            const int64_t mid = front ? std::min(e, b + chunk_) : std::max(b, e - chunk_);
            const uint64_t rest = front ? pack(mid, e) : pack(b, mid);
            if (share.compare_exchange_weak(w, rest, std::memory_order_relaxed)) {
                begin = front ? b : mid;
                end = front ? mid : e;
                return true;
            }
        }
    }

    // A share per cache line: one thread's claims do not evict the line another's read.
    struct alignas(64) Share {
        std::atomic<uint64_t> range{0};
    };

    const int64_t chunk_, ways_;
    std::unique_ptr<Share[]> ranges_;
};

// One thread's handle: claim(begin, end) -> its next chunk, false when none is left.
struct Claim {
    Claims& claims;
    int64_t self;
    bool operator()(int64_t& begin, int64_t& end) { return claims.take(self, begin, end); }
};

// One chunk or one thread: the calling thread does it all, opening no parallel region.
template <typename Worker>
void parallel_claim(int64_t n, int64_t chunk, const Worker& worker) {
    if (n <= 0) return;
    const int64_t chunks = (n + std::max<int64_t>(1, chunk) - 1) / std::max<int64_t>(1, chunk);
    const int64_t ways = at::in_parallel_region()
                             ? 1
                             : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunks));
    Claims claims(n, chunk, ways);
    if (ways == 1) {
        Claim claim{claims, 0};
        worker(claim);
        return;
    }
    at::parallel_for(0, ways, 1, [&](int64_t begin, int64_t end) {
        for (int64_t self = begin; self < end; ++self) {
            Claim claim{claims, self};
            worker(claim);
        }
    });
}
