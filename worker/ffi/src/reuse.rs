//! The worker's global allocator: the system allocator (glibc malloc, with
//! the pods' fixed 4 MiB mmap threshold) plus a cache of freed large blocks
//! that never lets the process hold more than its own peak.
//!
//! Why: under the fixed threshold every block of 4 MiB or more is mmapped
//! fresh and unmapped on free, so the kernel zeroes every large tensor's
//! pages when first touched, every step: a training step allocates its
//! activations, their gradients and its transients in the same sizes as the
//! step before, and paid about a tenth of a LoRA step's time in page faults
//! (docs/benchmarks.md). glibc's own reuse (a higher or dynamic threshold)
//! removes that but lets the heap's holes grow the peak by tens of MiB, run
//! to run, which no plan can follow.
//!
//! The rule: a freed large block is kept, and handed out again to the next
//! request of exactly its size and alignment. Every request of 1 MiB or
//! more that the cache does not serve first reads the process's resident
//! bytes and frees the oldest kept blocks until what it asks for fits under
//! the most the process has been seen to hold, kept blocks not counted
//! (the mark). So the process
//! holds no more than its own peak, which is what the planner predicts and
//! the fixed threshold measured (within the small blocks allocated between
//! two such requests); what the cache holds between steps is memory the
//! next step takes again. Zeroed requests are calloc's, never the cache's,
//! and their blocks are never kept: read before written they are the
//! kernel's zero page, which counts nothing (the cache's blocks count in
//! full). Off by default ([`REUSE_ENV`]). The memory guard counts the kept
//! bytes as its own to give back ([`cached_bytes`]) and gives them back
//! when it abandons a step ([`release_cached`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Set to `1` to turn the reuse on in a worker process; off (`0`, the
/// default) every large block goes back to the system when freed, as under
/// the fixed threshold alone, and the allocator is glibc's with nothing
/// added. Off by default until its peak holds on every job: on a full
/// fine-tune the kept blocks still add about 5 % to the peak
/// (docs/benchmarks.md). Read by [`configure_from_env`].
pub const REUSE_ENV: &str = "HEADROOM_ALLOCATOR_REUSE";

/// Blocks from this size up are cached: glibc mmaps them under the pods'
/// threshold (`headroom_api::WORKER_MALLOC_TUNABLES`); smaller ones live in
/// its heap, which reuses them itself.
pub const LARGE_BLOCK_BYTES: usize = 4 << 20;

/// Requests from this size up check the resident bytes against the mark
/// (an optimizer step's heap blocks are a few MiB each).
const CHECK_BYTES: usize = 1 << 20;

/// At most this many blocks kept (a fixed table: the allocator cannot
/// allocate its own bookkeeping). A step of the largest calibrated jobs
/// frees a few hundred large blocks.
const SLOTS: usize = 2048;
/// At most this many calloc'd large blocks tracked at once; past it a
/// zeroed request is written with zeros instead (resident, so keepable).
const ZEROED_SLOTS: usize = 1024;

static ENABLED: AtomicBool = AtomicBool::new(false);
/// The most resident bytes seen at a check, less the kept ones: the mark.
static HIGH: AtomicUsize = AtomicUsize::new(0);
/// Bytes of the kept blocks (the table's sum, readable without its lock).
static CACHED: AtomicUsize = AtomicUsize::new(0);

#[derive(Clone, Copy)]
struct Kept {
    addr: usize,
    size: usize,
    align: usize,
}

struct Table {
    /// Kept blocks, oldest first.
    kept: [Kept; SLOTS],
    len: usize,
    /// Large blocks handed out fresh from calloc and not freed yet: zero
    /// pages until written, which `mincore` counts resident; never kept.
    zeroed: [usize; ZEROED_SLOTS],
    zeroed_len: usize,
    reused: u64,
    fresh: u64,
}

static TABLE: Mutex<Table> = Mutex::new(Table {
    kept: [Kept {
        addr: 0,
        size: 0,
        align: 0,
    }; SLOTS],
    len: 0,
    zeroed: [0; ZEROED_SLOTS],
    zeroed_len: 0,
    reused: 0,
    fresh: 0,
});

fn table() -> std::sync::MutexGuard<'static, Table> {
    // Nothing panics while holding it; a poisoned lock still holds a
    // consistent table.
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The process's resident bytes (`/proc/self/statm`), read without
/// allocating (the allocator's own path); `None` where there is no procfs.
fn resident_bytes() -> Option<usize> {
    use std::io::Read;
    let mut buf = [0u8; 128];
    let mut file = std::fs::File::open("/proc/self/statm").ok()?;
    let n = file.read(&mut buf).ok()?;
    let mut fields = buf[..n].split(|&b| b == b' ');
    let pages = std::str::from_utf8(fields.nth(1)?)
        .ok()?
        .parse::<usize>()
        .ok()?;
    Some(pages * 4096)
}

/// Whether every page of the block is resident (`mincore`): only such a
/// block is kept, so handing it out again adds nothing to what the process
/// holds (a buffer allocated larger than it was written, or read only,
/// would fault its untouched pages in for the next user, unchecked).
fn fully_resident(addr: usize, size: usize) -> bool {
    const PAGE: usize = 4096;
    let mut pages = [0u8; 4096];
    // mincore wants a page-aligned start: glibc's mmapped chunks start 16
    // bytes into their first page; that page counts with the block.
    let start = addr & !(PAGE - 1);
    let end = addr + size;
    let mut at = start;
    while at < end {
        let len = (end - at).min(pages.len() * PAGE);
        // SAFETY: `at..at + len` lies within the block's mapping (plus the
        // start of its first page, which the same mapping holds), and
        // `pages` has room for one byte per page of `len` (len / PAGE
        // rounded up ≤ pages.len()); mincore only writes into `pages`.
        let rc = unsafe { libc::mincore(at as *mut libc::c_void, len, pages.as_mut_ptr()) };
        if rc != 0 || pages[..len.div_ceil(PAGE)].iter().any(|&p| p & 1 == 0) {
            return false;
        }
        at += len;
    }
    true
}

impl Table {
    /// Takes the newest kept block of exactly this layout.
    fn take(&mut self, layout: Layout) -> Option<*mut u8> {
        let i = (0..self.len).rev().find(|&i| {
            self.kept[i].size == layout.size() && self.kept[i].align == layout.align()
        })?;
        let block = self.kept[i];
        self.kept.copy_within(i + 1..self.len, i);
        self.len -= 1;
        CACHED.fetch_sub(block.size, Ordering::Relaxed);
        Some(block.addr as *mut u8)
    }

    /// Before `extra` more bytes: reads the resident bytes, raises the mark
    /// to them less the kept ones, and frees the oldest kept blocks until `extra` more fit
    /// under it. Nothing is kept where the resident bytes cannot be read.
    fn make_room(&mut self, extra: usize) {
        let Some(mut resident) = resident_bytes() else {
            ENABLED.store(false, Ordering::Relaxed);
            self.release_all();
            return;
        };
        // The mark follows what the process needs, not what it keeps: else
        // each step's overshoot (the request in flight, the small blocks
        // since the last check) would raise it, and the kept bytes with it.
        let needed = resident.saturating_sub(CACHED.load(Ordering::Relaxed));
        let high = HIGH.fetch_max(needed, Ordering::Relaxed).max(needed);
        while self.len > 0 && resident + extra > high {
            let block = self.kept[0];
            self.kept.copy_within(1..self.len, 0);
            self.len -= 1;
            CACHED.fetch_sub(block.size, Ordering::Relaxed);
            free_kept(block);
            resident = resident.saturating_sub(block.size);
        }
    }

    /// Marks a calloc'd block (while a slot is free; past that it is kept
    /// like any other when freed).
    fn remember_zeroed(&mut self, addr: usize) {
        if self.zeroed_len < ZEROED_SLOTS {
            self.zeroed[self.zeroed_len] = addr;
            self.zeroed_len += 1;
        }
    }

    /// Forgets a calloc'd block being freed; whether it was one.
    fn was_zeroed(&mut self, addr: usize) -> bool {
        let Some(i) = self.zeroed[..self.zeroed_len]
            .iter()
            .position(|&a| a == addr)
        else {
            return false;
        };
        self.zeroed_len -= 1;
        self.zeroed[i] = self.zeroed[self.zeroed_len];
        true
    }

    fn release_all(&mut self) -> usize {
        let mut bytes = 0;
        for block in &self.kept[..self.len] {
            bytes += block.size;
            free_kept(*block);
        }
        self.len = 0;
        CACHED.fetch_sub(bytes, Ordering::Relaxed);
        bytes
    }
}

/// Frees a kept block to the system allocator.
fn free_kept(block: Kept) {
    // SAFETY: a kept block was returned by `System` with exactly this size
    // and alignment (the layout it was handed out and freed with; `Layout`
    // was valid then), and it is no longer in the table nor handed out, so
    // nothing else refers to it.
    unsafe {
        System.dealloc(
            block.addr as *mut u8,
            Layout::from_size_align_unchecked(block.size, block.align),
        )
    }
}

/// A request the cache does not serve: from [`CHECK_BYTES`] up, the mark
/// follows what the process holds, and room is made under it first.
fn checked(size: usize) {
    if size >= CHECK_BYTES && ENABLED.load(Ordering::Relaxed) {
        table().make_room(size);
    }
}

/// The system allocator with a cache of freed large blocks bounded by the
/// process's own peak (module docs). Installed by the worker crate as its
/// `#[global_allocator]`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReusingAllocator;

impl ReusingAllocator {
    /// A kept block of `layout`, or a fresh one from `fresh` after making
    /// room for it under the mark.
    fn large(&self, layout: Layout, fresh: impl FnOnce() -> *mut u8) -> *mut u8 {
        let mut t = table();
        if let Some(p) = t.take(layout) {
            t.reused += 1;
            return p;
        }
        t.make_room(layout.size());
        let p = fresh();
        if !p.is_null() {
            t.fresh += 1;
        }
        p
    }
}

// SAFETY: every block handed out comes from `System` with the layout asked
// for (a kept block is handed out only for a request of exactly its size and
// alignment, and was allocated by `System` with them), so it is valid,
// aligned and exclusively the caller's; a freed block is either kept (not
// handed out again until taken from the table, under its lock) or given back
// to `System` with the layout it was allocated with. The bookkeeping
// allocates nothing (atomics, a fixed table behind a futex-based mutex, and
// a read of /proc/self/statm into a stack buffer).
unsafe impl GlobalAlloc for ReusingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE_BLOCK_BYTES && ENABLED.load(Ordering::Relaxed) {
            // SAFETY: the caller's contract (a non-zero-sized, valid layout) passed on.
            return self.large(layout, || unsafe { System.alloc(layout) });
        }
        checked(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE_BLOCK_BYTES && ENABLED.load(Ordering::Relaxed) {
            // Never from the cache: a calloc'd block is the kernel's zero
            // pages until written, and many are only read (burn-flex's
            // `empty` makes each matmul output as zeros it copies from: the
            // logits' 108 MiB at a step's peak), where a kept block would be
            // resident in full. Remembered, so that freed it is not kept
            // (`mincore` counts a read zero page resident).
            let mut t = table();
            if t.zeroed_len < ZEROED_SLOTS {
                t.make_room(layout.size());
                // SAFETY: the caller's contract passed on.
                let p = unsafe { System.alloc_zeroed(layout) };
                if !p.is_null() {
                    t.remember_zeroed(p as usize);
                }
                return p;
            }
            drop(t);
            // SAFETY: the caller's contract passed on.
            let p = self.large(layout, || unsafe { System.alloc(layout) });
            if !p.is_null() {
                // SAFETY: `p` is a block of `layout.size()` bytes, now the caller's.
                unsafe { p.write_bytes(0, layout.size()) };
            }
            return p;
        }
        checked(layout.size());
        // SAFETY: the caller's contract passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() >= LARGE_BLOCK_BYTES && ENABLED.load(Ordering::Relaxed) {
            let mut t = table();
            if !t.was_zeroed(ptr as usize)
                && t.len < SLOTS
                && fully_resident(ptr as usize, layout.size())
            {
                let len = t.len;
                t.kept[len] = Kept {
                    addr: ptr as usize,
                    size: layout.size(),
                    align: layout.align(),
                };
                t.len += 1;
                CACHED.fetch_add(layout.size(), Ordering::Relaxed);
                return;
            }
        }
        // SAFETY: the caller's contract: `ptr` came from this allocator, so
        // from `System` with `layout` (module rule), and is not kept.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // A block moved or resized by glibc (mremap for an mmapped one); it
        // keeps the new size's layout, with which it will be freed (or kept).
        if new_size > layout.size() {
            checked(new_size - layout.size());
        }
        // A calloc'd block stays marked as one where it moves.
        let zeroed = layout.size() >= LARGE_BLOCK_BYTES
            && ENABLED.load(Ordering::Relaxed)
            && table().was_zeroed(ptr as usize);
        // SAFETY: the caller's contract passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if zeroed {
            table().remember_zeroed(if p.is_null() { ptr } else { p } as usize);
        }
        p
    }
}

/// Bytes of freed large blocks the allocator keeps for reuse: resident, but
/// the process's own to give back ([`release_cached`]).
pub fn cached_bytes() -> u64 {
    CACHED.load(Ordering::Relaxed) as u64
}

/// Gives every kept block back to the system (the kernel, for mmapped
/// ones); returns their bytes.
pub fn release_cached() -> u64 {
    table().release_all() as u64
}

/// The resident bytes now (`None` without procfs) and the mark: the most
/// seen at a check.
pub fn resident_and_mark() -> (Option<u64>, u64) {
    (
        resident_bytes().map(|b| b as u64),
        HIGH.load(Ordering::Relaxed) as u64,
    )
}

/// Lowers the mark to the resident bytes now, giving kept blocks back (a
/// test starts from a known mark).
#[cfg(test)]
pub(crate) fn reset_mark() {
    release_cached();
    HIGH.store(resident_bytes().unwrap_or(0), Ordering::Relaxed);
}

/// Large blocks handed out so far: (taken from the cache, fresh from the
/// system).
pub fn reuse_counts() -> (u64, u64) {
    let t = table();
    (t.reused, t.fresh)
}

/// Turns the reuse on or off from here on (off gives the kept blocks back).
pub fn set_reuse(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
    if !on {
        release_cached();
    }
}

/// Reads [`REUSE_ENV`]: `1` turns the reuse on, `0` or unset leaves it off.
/// Called once at a process's start; returns whether reuse is on, or the
/// value that is neither.
pub fn configure_from_env() -> Result<bool, String> {
    let on = match std::env::var(REUSE_ENV).as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("0") => false,
        Ok("1") => true,
        Ok(other) => {
            return Err(format!(
                "{REUSE_ENV}={other:?}: use 1 (on) or 0 (off, the default)"
            ));
        }
        Err(e) => return Err(format!("{REUSE_ENV}: {e}")),
    };
    set_reuse(on);
    Ok(on)
}
