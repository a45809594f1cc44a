//! The one crate of Headroom that calls C (the workspace forbids `unsafe`
//! everywhere else). Each wrapper is safe to call; each `unsafe` block says
//! why it is sound.

/// Gives the heap's free memory back to the kernel: glibc's
/// `malloc_trim(0)` releases the free pages of every arena, the middle of
/// the heap included (`madvise(MADV_DONTNEED)`), not only its top. The
/// memory guard calls it after abandoning a step, so the memory the
/// step's tensors held stops counting against the container's limit
/// before the step runs again. Returns whether any memory was released;
/// `false` where the C library has no `malloc_trim` (not glibc).
pub fn release_free_heap() -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_heap_memory_goes_back_to_the_kernel() {
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
