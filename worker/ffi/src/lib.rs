//! The one crate of Headroom that calls C (the workspace forbids `unsafe`
//! everywhere else): glibc's malloc, under the worker's global allocator
//! ([`ReusingAllocator`]) and its heap trim; and gemm's accumulating
//! product ([`add_product_f32`]), whose API takes raw pointers. Each wrapper is safe to call;
//! each `unsafe` block says why it is sound.

mod product;
mod reuse;
pub use product::{Strided, add_product_f32};
pub use reuse::{
    LARGE_BLOCK_BYTES, REUSE_ENV, ReusingAllocator, cached_bytes, configure_from_env,
    release_cached, resident_and_mark, reuse_counts, set_reuse,
};

/// Gives the heap's free memory back to the kernel: glibc's
/// `malloc_trim(0)` releases the free pages of every arena, the middle of
/// the heap included (`madvise(MADV_DONTNEED)`), not only its top. The
/// memory guard calls it after abandoning a step, so the memory the
/// step's tensors held stops counting against the container's limit
/// before the step runs again. Returns whether any memory was released;
/// `false` where the C library has no `malloc_trim` (not glibc).
pub fn release_free_heap() -> bool {
    // The large blocks the worker's allocator keeps first (they are not
    // glibc's free memory until given back).
    release_cached();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes a byte count by value and touches only
        // the allocator's own free lists, under the allocator's locks, as
        // any malloc or free does; it is thread-safe and has no
        // precondition on the caller (glibc malloc_trim(3)).
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

// The tests run under the allocator the worker installs.
#[cfg(test)]
#[global_allocator]
static ALLOCATOR: ReusingAllocator = ReusingAllocator;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// The allocator's cache is the process's: one test at a time touches it.
    static SERIAL: Mutex<()> = Mutex::new(());

    #[test]
    fn freed_large_blocks_are_reused_without_holding_more_than_the_peak() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        const MIB: u64 = 1 << 20;
        // What the process holds stays under the mark, but for the last
        // request (the mark is read before it) and the test's own small
        // blocks.
        let holds = || {
            let (resident, mark) = resident_and_mark();
            let resident = resident.expect("procfs");
            assert!(
                resident <= mark + 10 * MIB,
                "{resident} resident > {mark} + 10 MiB"
            );
        };
        set_reuse(true);
        reuse::reset_mark();
        // Three 8 MiB blocks alive at once, written: the mark rises by 24 MiB.
        let mut blocks: Vec<Vec<u8>> = (0..3).map(|i| vec![i as u8 + 1; 8 << 20]).collect();
        let next = vec![9u8; 8 << 20]; // the mark read before it counts the three
        drop(next);
        blocks.clear();
        assert_eq!(cached_bytes(), 32 * MIB);
        holds();

        // The same size again: a kept block (the newest, `next`'s).
        let (reused, _) = reuse_counts();
        let mut again = Vec::<u8>::with_capacity(8 << 20);
        again.resize(8 << 20, 3);
        assert_eq!(reuse_counts().0, reused + 1);
        assert_eq!(cached_bytes(), 24 * MIB);
        holds();
        // Zeroed requests never are (calloc's pages are not resident until
        // written, a kept block is), and make room like any other: 8 alive,
        // 24 kept and 8 more over a mark of about 24 leave one kept.
        let zeros = vec![0u8; 8 << 20];
        assert_eq!(reuse_counts().0, reused + 1, "not from the cache");
        assert!(cached_bytes() <= 8 * MIB, "{} kept", cached_bytes());
        holds();
        let kept = cached_bytes();
        drop(zeros); // never written: its pages are not all resident, so not kept
        assert_eq!(cached_bytes(), kept);

        // Another size, larger than the room under the mark: fresh, after
        // giving kept blocks back until it fits (8 alive + 24 kept + 20
        // fresh over the mark of about 24 + 8: two or more given back).
        let mut other = vec![7u8; 20 << 20];
        other[(20 << 20) - 1] = 8;
        assert!(cached_bytes() <= 8 * MIB, "{} kept", cached_bytes());
        holds();
        drop((again, other));

        // Small blocks are never kept, and from 1 MiB up they make room too.
        let small: Vec<Vec<u8>> = (0..24).map(|_| vec![1u8; 2 << 20]).collect();
        holds();
        assert!(cached_bytes() <= 28 * MIB, "{} kept", cached_bytes());
        drop(small);

        // A grown large block keeps the books.
        let mut v = vec![1u8; 5 << 20];
        v.resize(9 << 20, 2);
        assert_eq!(v[(9 << 20) - 1], 2);
        holds();
        drop(v);

        let kept = cached_bytes();
        assert_eq!(release_cached(), kept);
        assert_eq!(cached_bytes(), 0);

        // Off: nothing kept.
        set_reuse(false);
        drop(vec![1u8; 8 << 20]);
        assert_eq!(cached_bytes(), 0);
    }

    #[test]
    fn freed_heap_memory_goes_back_to_the_kernel() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        // Many small blocks (under the mmap threshold: on the heap), every
        // other one freed: holes in the middle of the heap that only a
        // trim of the whole heap gives back.
        let rss = || {
            std::fs::read_to_string("/proc/self/statm")
                .ok()
                .and_then(|t| t.split_whitespace().nth(1)?.parse::<u64>().ok())
                .map(|pages| pages * 4096)
                .expect("statm")
        };
        let mut blocks: Vec<Vec<u8>> = (0..4096).map(|i| vec![i as u8; 64 << 10]).collect();
        let full = rss();
        for b in blocks.iter_mut().step_by(2) {
            *b = Vec::new();
        }
        let holes = rss();
        assert!(release_free_heap() || cfg!(not(target_env = "gnu")));
        let trimmed = rss();
        std::hint::black_box(&blocks);
        eprintln!("resident: {full} B full, {holes} B with holes, {trimmed} B trimmed");
        if cfg!(target_env = "gnu") {
            // Half of 256 MiB freed in holes: most of it back.
            assert!(trimmed + (96 << 20) < holes, "{holes} → {trimmed}");
        }
    }
}
