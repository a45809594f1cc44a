//! The near-OOM guard: stop a step before it crosses the memory limit,
//! rather than let the kernel's OOM killer (or the device's allocator) stop
//! the worker.
//!
//! A step grows memory in known places: each block's forward (the
//! activations kept for backward), the loss (the logits), each
//! micro-batch's backward (the gradients) and the optimizer step (its state
//! on the first step, its temporaries). Before each of them the trainer
//! calls [`check`] with the [`Point`] it is at; the guard reads the memory in
//! use and trips when what that part is known to add would leave less than
//! the margin under the limit. What a part adds is learned: the process's
//! high-water mark is reset at each point (`/proc/self/clear_refs`) and read
//! at the next, so each part's own peak over its start is measured on every
//! step, transients included; a part not yet seen is predicted from the
//! plan's memory terms. Steps repeat, so after the first one the
//! prediction is the measurement of the last.
//!
//! A trip unwinds the step with a [`Trip`] as the panic payload (the block
//! loop inside the model has no error path, and a step abandoned anywhere
//! must apply nothing: the model is only taken for the optimizer step,
//! after the last check). The run loop catches it, as it catches an
//! allocator's out-of-memory panic, checkpoints the last completed step,
//! and either steps down in place (runs the worker again in the same pod at
//! half the micro-batch and twice the accumulation: a fresh process, since
//! burn's autodiff graph and the allocator keep what the abandoned step
//! held) or exits with `NearOutOfMemory` (`run.rs`, `after_trip`).
//!
//! On the CPU the line is the container's cgroup limit and the memory in
//! use is the cgroup's charge less the page cache the kernel would reclaim
//! before it kills (clean file pages), read only when the charge alone
//! would trip: the common check reads one small file. With the soft limit
//! of the tests (`HEADROOM_DEVICE_MEMORY_LIMIT_BYTES`) it is the process's
//! resident bytes. On a GPU it is the device allocator's bytes in use
//! against the device's memory less the runtime's fixed overhead.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::tensor::Device;
use headroom_api::MemoryGuardSettings;
use headroom_planner::{MemoryBreakdown, Plan};

use crate::memory_probe::{CgroupFiles, process_memory};

/// The part of a step that is about to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// A block's forward (its index within the stage).
    Forward,
    /// The head and the loss.
    Loss,
    /// A micro-batch's backward (a checkpointed block's recomputation and
    /// backward, by block, with activation checkpointing).
    Backward,
    /// Clipping, the update and the replicas' exchange.
    Optimizer,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Forward => "forward",
            Phase::Loss => "loss",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer step",
        })
    }
}

/// Where in a step: the phase, the micro-batch and the block (0 where a
/// phase has none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Point {
    pub phase: Phase,
    pub micro: u32,
    pub block: u32,
}

/// Why the guard stopped a step.
#[derive(Clone, Debug, PartialEq)]
pub struct Trip {
    pub point: Point,
    /// The step under way (1-based: the one that was not completed).
    pub step: u64,
    /// Memory in use at the point, bytes.
    pub in_use: u64,
    /// What the part about to run was known to add, bytes.
    pub increment: u64,
    /// Whether `increment` was measured on an earlier step (else predicted
    /// from the plan).
    pub measured: bool,
    pub limit: u64,
    pub margin: u64,
}

impl Trip {
    /// The peak the part would have reached, bytes.
    pub fn would_reach(&self) -> u64 {
        self.in_use.saturating_add(self.increment)
    }
}

impl std::fmt::Display for Trip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
        let p = self.point;
        let at = match p.phase {
            Phase::Forward => format!("block {}'s forward of micro-batch {}", p.block, p.micro),
            Phase::Backward => format!("the backward of micro-batch {}", p.micro),
            Phase::Loss => format!("the loss of micro-batch {}", p.micro),
            Phase::Optimizer => "the optimizer step".to_string(),
        };
        write!(
            f,
            "step {} stopped before {at}: {:.1} MiB in use + {:.1} MiB it {} would reach {:.1} MiB, past the limit of {:.1} MiB less the guard's margin of {:.1} MiB",
            self.step,
            mib(self.in_use),
            mib(self.increment),
            if self.measured {
                "added on the last step"
            } else {
                "is planned to add"
            },
            mib(self.would_reach()),
            mib(self.limit),
            mib(self.margin)
        )
    }
}

/// What the guard reads: memory in use against the limit, and the
/// process's high-water mark to learn each part's own peak.
pub trait Meter: Send {
    /// Bytes in use, as the limit counts them (cheap: read at every point).
    fn in_use(&mut self) -> Option<u64>;
    /// Of [`Meter::in_use`], bytes the kernel would free before it kills,
    /// or the worker's allocator frees before it takes fresh memory (the
    /// freed large blocks it keeps: `headroom_ffi::cached_bytes`). Read
    /// only near the line.
    fn reclaimable(&mut self) -> u64 {
        0
    }
    /// The highest bytes in use since the last [`Meter::mark`], and the
    /// bytes in use at that mark, in the meter's own units (`None`: no
    /// high-water mark; the next point's reading stands in for it).
    fn high_since_mark(&mut self) -> Option<(u64, u64)> {
        None
    }
    /// Starts a new high-water interval.
    fn mark(&mut self) {}
}

/// A CPU worker's memory: its cgroup's charge against `memory.max`, and
/// the process's resident high-water mark, reset at every point.
#[derive(Debug)]
pub struct CgroupMeter {
    current: PathBuf,
    stat: PathBuf,
    version: u8,
    high_water: HighWater,
}

impl CgroupMeter {
    /// The cgroup's meter and its limit (`None`: no limit, nothing to guard).
    pub fn new(files: &CgroupFiles) -> Option<(CgroupMeter, u64)> {
        let dir = files.current.parent()?;
        let limit = read_limit(dir, files.version)?;
        Some((
            CgroupMeter {
                current: files.current.clone(),
                stat: dir.join("memory.stat"),
                version: files.version,
                high_water: HighWater::default(),
            },
            limit,
        ))
    }
}

/// `memory.max` (v2) or `memory.limit_in_bytes` (v1) under `dir`; `None`
/// for no limit (`max`, or v1's page-rounded largest value).
fn read_limit(dir: &Path, version: u8) -> Option<u64> {
    let file = if version == 2 {
        "memory.max"
    } else {
        "memory.limit_in_bytes"
    };
    let text = std::fs::read_to_string(dir.join(file)).ok()?;
    let limit: u64 = text.trim().parse().ok()?;
    // v1 says "no limit" with the largest page-aligned i64.
    (limit < (1 << 62)).then_some(limit)
}

/// The page cache `memory.stat` text counts that the kernel reclaims
/// before an OOM kill: clean file pages (dirty ones and those being
/// written back are written out first; shared memory is not file cache).
pub fn reclaimable_from_stat(text: &str, version: u8) -> u64 {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == name).then(|| v.trim().parse::<u64>().ok())?
            })
            .unwrap_or(0)
    };
    let (inactive, active, dirty, writeback) = if version == 2 {
        (
            field("inactive_file"),
            field("active_file"),
            field("file_dirty"),
            field("file_writeback"),
        )
    } else {
        (
            field("total_inactive_file"),
            field("total_active_file"),
            field("total_dirty"),
            field("total_writeback"),
        )
    };
    (inactive + active).saturating_sub(dirty + writeback)
}

impl Meter for CgroupMeter {
    fn in_use(&mut self) -> Option<u64> {
        std::fs::read_to_string(&self.current)
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn reclaimable(&mut self) -> u64 {
        std::fs::read_to_string(&self.stat)
            .map(|t| reclaimable_from_stat(&t, self.version))
            .unwrap_or(0)
            + headroom_ffi::cached_bytes()
    }

    fn high_since_mark(&mut self) -> Option<(u64, u64)> {
        self.high_water.since_mark()
    }

    fn mark(&mut self) {
        self.high_water.mark();
    }
}

/// The process's resident high-water mark, reset at each mark, so that
/// what it reads at the next is the part's own peak.
#[derive(Debug)]
struct HighWater {
    /// Resident bytes at the last mark (`None` before the first, or when
    /// the mark cannot be reset).
    rss_at_mark: Option<u64>,
    /// Resident bytes [`HighWater::since_mark`] read, for the mark that
    /// follows it (nothing runs between the two).
    rss_now: Option<u64>,
    can_reset: bool,
}

impl Default for HighWater {
    fn default() -> Self {
        HighWater {
            rss_at_mark: None,
            rss_now: None,
            can_reset: true,
        }
    }
}

impl HighWater {
    /// The peak since the last mark and the resident bytes at it.
    fn since_mark(&mut self) -> Option<(u64, u64)> {
        let at_mark = self.rss_at_mark?;
        let (rss, hwm) = process_memory();
        self.rss_now = rss;
        Some((hwm?, at_mark))
    }

    fn mark(&mut self) {
        // "5" resets the process's peak resident size to its current one
        // (proc(5), clear_refs): the next VmHWM is this part's own peak.
        if !self.can_reset || std::fs::write("/proc/self/clear_refs", "5").is_err() {
            self.can_reset = false;
            self.rss_at_mark = None;
            return;
        }
        self.rss_at_mark = self.rss_now.take().or_else(|| process_memory().0);
    }
}

/// A GPU worker's memory: the device allocator's bytes in use (cubecl's
/// pools), against the plan's budget. No high-water mark: a part's peak is
/// the next point's reading.
#[derive(Debug)]
pub struct DeviceMeter {
    device: Device,
}

impl DeviceMeter {
    pub fn new(device: Device) -> Self {
        DeviceMeter { device }
    }
}

impl Meter for DeviceMeter {
    fn in_use(&mut self) -> Option<u64> {
        self.device.memory_pool_usage().map(|p| p.bytes_in_use)
    }
}

/// What each part of a step is planned to add, from the stage's memory
/// terms, for the parts no step has measured yet.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Planned {
    /// One block's forward of one micro-batch.
    pub block_forward: u64,
    /// The logits and their gradient.
    pub loss: u64,
    /// A micro-batch's backward: the gradients (and the accumulation
    /// buffer); a check adds a block's activations and the logits for the
    /// gradients flowing back through them.
    pub backward: u64,
    /// The optimizer step: its state (first step of a process) and temporaries.
    pub optimizer: u64,
}

impl Planned {
    /// From a stage's predicted memory: the activations spread over its
    /// blocks and the micro-batches it holds at once.
    pub fn from_stage(m: &MemoryBreakdown, blocks: u32, in_flight: u32) -> Self {
        let per = u64::from(blocks.max(1)) * u64::from(in_flight.max(1));
        Planned {
            block_forward: m.activations / per,
            loss: m.logits,
            backward: m.gradients,
            optimizer: m.optimizer_state + m.optimizer_step,
        }
    }

    /// The terms that grow with the micro-batch, scaled by `num / den`
    /// (after a step down in place).
    pub fn scaled(self, num: u32, den: u32) -> Self {
        let s = |b: u64| b * u64::from(num) / u64::from(den.max(1));
        Planned {
            block_forward: s(self.block_forward),
            loss: s(self.loss),
            ..self
        }
    }

    fn at(&self, point: Point, first_update: bool) -> u64 {
        match point.phase {
            Phase::Forward => self.block_forward,
            Phase::Loss => self.loss,
            // The gradients, and while they flow back through the blocks
            // about one block's activations and the logits' gradient.
            Phase::Backward => self.backward + self.block_forward + self.loss,
            // After the first update the state exists: only temporaries.
            Phase::Optimizer if first_update => self.optimizer,
            Phase::Optimizer => 0,
        }
    }
}

/// The guard of one worker's training thread.
pub struct MemoryGuard {
    meter: Box<dyn Meter>,
    limit: u64,
    margin: u64,
    planned: Planned,
    /// What each point's part added on the last step it ran.
    learned: HashMap<Point, u64>,
    /// The point whose part is running, and the bytes in use at it.
    open: Option<(Point, u64)>,
    /// The step under way (1-based).
    step: u64,
    /// Whether an update has run in this process (the optimizer's state exists).
    updated: bool,
    /// Checks made and the time they took (the guard's cost).
    pub checks: u64,
    pub time: Duration,
}

impl std::fmt::Debug for MemoryGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryGuard")
            .field("limit", &self.limit)
            .field("margin", &self.margin)
            .field("planned", &self.planned)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

impl MemoryGuard {
    pub fn new(meter: Box<dyn Meter>, limit: u64, margin_percent: u32, planned: Planned) -> Self {
        MemoryGuard {
            meter,
            limit,
            margin: limit / 100 * u64::from(margin_percent),
            planned,
            learned: HashMap::new(),
            open: None,
            step: 1,
            updated: false,
            checks: 0,
            time: Duration::ZERO,
        }
    }

    /// This worker's guard, when its plan has one and its memory has a
    /// limit to guard: `soft_limit` (`HEADROOM_DEVICE_MEMORY_LIMIT_BYTES`,
    /// against the process's resident bytes on the CPU) when set, else on
    /// the CPU the container's cgroup limit, on a GPU the device's memory
    /// less the runtime's fixed overhead.
    pub fn for_worker(
        settings: Option<MemoryGuardSettings>,
        plan: &Plan,
        stage: u32,
        device: &Device,
        cgroup: Option<&CgroupFiles>,
        soft_limit: Option<u64>,
    ) -> Option<MemoryGuard> {
        let settings = settings?;
        let s = plan.stages.get(stage as usize)?;
        let planned = Planned::from_stage(
            &s.memory,
            s.layer_end - s.layer_start,
            s.in_flight_micro_batches,
        );
        let on_cpu = plan.backend == headroom_planner::Backend::Flex;
        let (meter, limit): (Box<dyn Meter>, u64) = match (on_cpu, soft_limit) {
            (true, Some(limit)) => (Box::new(ProcessMeter::default()), limit),
            (true, None) => {
                let (meter, limit) = cgroup.and_then(CgroupMeter::new)?;
                (Box::new(meter), limit)
            }
            (false, limit) => (
                Box::new(DeviceMeter::new(device.clone())),
                limit.unwrap_or(
                    plan.device_memory_bytes
                        .saturating_sub(s.memory.fixed_overhead),
                ),
            ),
        };
        Some(MemoryGuard::new(
            meter,
            limit,
            settings.margin_percent,
            planned,
        ))
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Before the part at `point`: trips when what it is known to add would
    /// leave less than the margin under the limit.
    pub fn check(&mut self, point: Point) -> Result<(), Trip> {
        let began = Instant::now();
        let result = self.check_inner(point);
        self.checks += 1;
        self.time += began.elapsed();
        result
    }

    fn check_inner(&mut self, point: Point) -> Result<(), Trip> {
        let Some(in_use) = self.meter.in_use() else {
            return Ok(());
        };
        self.close(in_use);
        let (increment, measured) = match self.learned.get(&point) {
            Some(&b) => (b, true),
            None => (self.planned.at(point, !self.updated), false),
        };
        let line = self.limit.saturating_sub(self.margin);
        if in_use.saturating_add(increment) > line {
            // Near the line: the page cache the kernel would drop first
            // does not count.
            let in_use = in_use.saturating_sub(self.meter.reclaimable());
            if in_use.saturating_add(increment) > line {
                self.open = None;
                return Err(Trip {
                    point,
                    step: self.step,
                    in_use,
                    increment,
                    measured,
                    limit: self.limit,
                    margin: self.margin,
                });
            }
        }
        self.meter.mark();
        self.open = Some((point, in_use));
        Ok(())
    }

    /// Ends the running part: what it added is the high-water mark over
    /// its start (or, without one, the growth to `in_use` now).
    fn close(&mut self, in_use: u64) {
        let Some((point, at_start)) = self.open.take() else {
            return;
        };
        let added = match self.meter.high_since_mark() {
            Some((high, at_mark)) => high.saturating_sub(at_mark),
            None => in_use.saturating_sub(at_start),
        };
        self.learned.insert(point, added);
    }

    /// The step completed: the optimizer's part is closed and the next step begins.
    pub fn step_done(&mut self, completed: u64) {
        if let Some(in_use) = self.meter.in_use() {
            self.close(in_use);
        }
        self.updated = true;
        self.step = completed + 1;
    }

    /// The step was abandoned (a trip): nothing of it is learned, and the
    /// memory the unwinding freed goes back to the kernel (the allocator
    /// would keep it for reuse, and the kernel counts what it keeps), so
    /// the checkpoint written next has room.
    pub fn step_abandoned(&mut self) {
        self.open = None;
        headroom_ffi::release_free_heap();
    }

    /// The worker runs `micro_batch` samples at a time where the plan said
    /// `planned` (the guard stepped it down): the plan's terms that grow
    /// with the micro-batch scale with it.
    pub fn micro_batch_is(&mut self, micro_batch: u32, planned: u32) {
        self.planned = self.planned.scaled(micro_batch, planned);
    }
}

/// Without a cgroup: the process's resident bytes (a soft limit's test runs).
#[derive(Debug, Default)]
pub struct ProcessMeter {
    high_water: HighWater,
}

impl Meter for ProcessMeter {
    fn in_use(&mut self) -> Option<u64> {
        process_memory().0
    }
    fn reclaimable(&mut self) -> u64 {
        headroom_ffi::cached_bytes()
    }
    fn high_since_mark(&mut self) -> Option<(u64, u64)> {
        self.high_water.since_mark()
    }
    fn mark(&mut self) {
        self.high_water.mark();
    }
}

thread_local! {
    /// The training thread's guard: the model's block loop reaches it
    /// without a parameter through every forward.
    static GUARD: RefCell<Option<MemoryGuard>> = const { RefCell::new(None) };
    /// The micro-batch under way (the trainer sets it; the blocks don't know it).
    static MICRO: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Makes `guard` this thread's (`None`: off); returns the one it replaces.
pub fn install(guard: Option<MemoryGuard>) -> Option<MemoryGuard> {
    install_quiet_panic_hook();
    GUARD.with_borrow_mut(|g| std::mem::replace(g, guard))
}

/// Runs `f` on this thread's guard, if there is one.
pub fn with<R>(f: impl FnOnce(&mut MemoryGuard) -> R) -> Option<R> {
    GUARD.with_borrow_mut(|g| g.as_mut().map(f))
}

/// The "micro-batch" of an evaluation's points: its forward is not a step's.
pub const EVALUATION: u32 = u32::MAX;

/// Says which micro-batch the next points belong to.
pub fn micro(m: u32) {
    MICRO.set(m);
}

/// Before a part of the step: unwinds the step with a [`Trip`] when the
/// guard says it would cross the line. A no-op without a guard.
pub fn check(phase: Phase, block: u32) {
    let point = Point {
        phase,
        micro: MICRO.get(),
        block,
    };
    if let Some(Err(trip)) = with(|g| g.check(point)) {
        std::panic::panic_any(trip);
    }
}

/// The default panic hook prints every panic; a trip is the guard's
/// control flow, reported by the run loop, so it is not printed.
fn install_quiet_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<Trip>().is_none() {
                default(info);
            }
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Memory in use the test sets, with a high-water mark it can raise.
    #[derive(Clone, Default)]
    struct Scripted(Arc<Mutex<(u64, u64, u64)>>); // (in use, high since mark, reclaimable)

    impl Scripted {
        fn set(&self, in_use: u64, high: u64) {
            let mut s = self.0.lock().expect("meter state");
            s.0 = in_use;
            s.1 = s.1.max(high);
        }
        fn reclaimable(&self, bytes: u64) {
            self.0.lock().expect("meter state").2 = bytes;
        }
    }

    struct ScriptedMeter {
        state: Scripted,
        at_mark: u64,
    }

    impl Meter for ScriptedMeter {
        fn in_use(&mut self) -> Option<u64> {
            Some(self.state.0.lock().expect("meter state").0)
        }
        fn reclaimable(&mut self) -> u64 {
            self.state.0.lock().expect("meter state").2
        }
        fn high_since_mark(&mut self) -> Option<(u64, u64)> {
            Some((self.state.0.lock().expect("meter state").1, self.at_mark))
        }
        fn mark(&mut self) {
            let mut s = self.state.0.lock().expect("meter state");
            s.1 = s.0;
            self.at_mark = s.0;
        }
    }

    const MIB: u64 = 1 << 20;

    fn guard(planned: Planned) -> (MemoryGuard, Scripted) {
        let state = Scripted::default();
        let meter = ScriptedMeter {
            state: state.clone(),
            at_mark: 0,
        };
        // 100 MiB limit, 3 % margin: the line is at 97 MiB.
        (
            MemoryGuard::new(Box::new(meter), 100 * MIB, 3, planned),
            state,
        )
    }

    fn at(phase: Phase, block: u32) -> Point {
        Point {
            phase,
            micro: 0,
            block,
        }
    }

    #[test]
    fn a_part_is_predicted_from_the_plan_until_measured() {
        let planned = Planned {
            block_forward: 10 * MIB,
            ..Planned::default()
        };
        let (mut g, mem) = guard(planned);
        mem.set(80 * MIB, 0);
        // 80 + 10 planned ≤ 97.
        g.check(at(Phase::Forward, 0)).expect("under the line");
        mem.set(86 * MIB, 0);
        g.check(at(Phase::Forward, 1)).expect("86 + 10 ≤ 97");
        mem.set(88 * MIB, 0);
        let trip = g.check(at(Phase::Forward, 2)).expect_err("88 + 10 > 97");
        assert_eq!(
            (trip.in_use, trip.increment, trip.measured, trip.step),
            (88 * MIB, 10 * MIB, false, 1)
        );
        assert_eq!((trip.would_reach(), trip.margin), (98 * MIB, 3 * MIB));
        assert!(
            trip.to_string().starts_with(
                "step 1 stopped before block 2's forward of micro-batch 0: 88.0 MiB in use + 10.0 MiB it is planned to add would reach 98.0 MiB"
            ),
            "{trip}"
        );
    }

    #[test]
    fn a_measured_part_is_predicted_by_its_peak_on_the_last_step() {
        // The plan says the backward adds nothing: only measuring can stop it.
        let (mut g, mem) = guard(Planned::default());
        mem.set(50 * MIB, 0);
        g.check(at(Phase::Backward, 0)).expect("nothing planned");
        // The backward peaks 30 MiB over its start, then frees most of it.
        mem.set(80 * MIB, 80 * MIB);
        mem.set(55 * MIB, 0);
        g.check(at(Phase::Optimizer, 0)).expect("nothing planned");
        g.step_done(1);
        // Step 2 starts its backward 10 MiB higher: 60 + 30 ≤ 97.
        mem.set(60 * MIB, 0);
        g.check(at(Phase::Backward, 0)).expect("60 + 30 ≤ 97");
        mem.set(90 * MIB, 90 * MIB);
        mem.set(70 * MIB, 0);
        g.check(at(Phase::Optimizer, 0))
            .expect("the optimizer adds nothing measured");
        g.step_done(2);
        mem.set(70 * MIB, 0);
        let trip = g
            .check(at(Phase::Backward, 0))
            .expect_err("70 + 30 measured > 97");
        assert_eq!(
            (trip.increment, trip.measured, trip.step),
            (30 * MIB, true, 3)
        );
        assert!(trip.to_string().contains("it added on the last step"));
    }

    #[test]
    fn page_cache_the_kernel_would_reclaim_does_not_count() {
        let planned = Planned {
            loss: 10 * MIB,
            ..Planned::default()
        };
        let (mut g, mem) = guard(planned);
        mem.set(95 * MIB, 0);
        mem.reclaimable(20 * MIB);
        g.check(at(Phase::Loss, 0))
            .expect("95 − 20 reclaimable + 10 ≤ 97");
        g.step_abandoned();
        mem.reclaimable(5 * MIB);
        let trip = g.check(at(Phase::Loss, 0)).expect_err("95 − 5 + 10 > 97");
        assert_eq!(trip.in_use, 90 * MIB);
    }

    #[test]
    fn the_optimizer_state_is_planned_on_the_first_update_only() {
        let planned = Planned {
            optimizer: 40 * MIB,
            ..Planned::default()
        };
        let (mut g, mem) = guard(planned);
        mem.set(60 * MIB, 0);
        assert!(g.check(at(Phase::Optimizer, 0)).is_err(), "60 + 40 > 97");
        g.step_abandoned();
        // A process that resumed past its first update in this run has it.
        g.step_done(1);
        g.learned.clear();
        g.check(at(Phase::Optimizer, 0))
            .expect("the state exists: nothing planned");
    }

    #[test]
    fn a_stepped_down_micro_batch_halves_the_planned_activations() {
        let planned = Planned {
            block_forward: 40 * MIB,
            loss: 20 * MIB,
            backward: 8 * MIB,
            optimizer: 4 * MIB,
        };
        let (mut g, mem) = guard(planned);
        mem.set(10 * MIB, 0);
        g.check(at(Phase::Forward, 0)).expect("10 + 40");
        mem.set(60 * MIB, 60 * MIB);
        assert!(
            g.check(at(Phase::Forward, 1)).is_err(),
            "60 + 40 planned > 97"
        );
        g.step_abandoned();
        g.micro_batch_is(8, 16);
        assert_eq!(
            g.planned,
            Planned {
                block_forward: 20 * MIB,
                loss: 10 * MIB,
                backward: 8 * MIB,
                optimizer: 4 * MIB
            }
        );
        g.check(at(Phase::Forward, 1)).expect("60 + 20 ≤ 97");
    }

    #[test]
    fn reclaimable_page_cache_from_memory_stat() {
        let v2 = "anon 1000\nfile 900\nactive_file 300\ninactive_file 500\nfile_dirty 50\nfile_writeback 10\nshmem 100\n";
        assert_eq!(reclaimable_from_stat(v2, 2), 740);
        let v1 = "cache 9\ntotal_inactive_file 400\ntotal_active_file 100\ntotal_dirty 20\ntotal_writeback 0\n";
        assert_eq!(reclaimable_from_stat(v1, 1), 480);
        assert_eq!(reclaimable_from_stat("", 2), 0);
    }

    #[test]
    fn a_trip_unwinds_with_its_payload_and_no_guard_is_a_no_op() {
        check(Phase::Forward, 0);
        let (mut g, mem) = guard(Planned {
            block_forward: 50 * MIB,
            ..Planned::default()
        });
        mem.set(60 * MIB, 0);
        g.step = 4;
        assert!(install(Some(g)).is_none());
        micro(3);
        let caught = std::panic::catch_unwind(|| check(Phase::Forward, 7)).expect_err("trips");
        let trip = caught.downcast_ref::<Trip>().expect("a Trip payload");
        assert_eq!(
            (trip.point, trip.step),
            (
                Point {
                    phase: Phase::Forward,
                    micro: 3,
                    block: 7
                },
                4
            )
        );
        assert!(install(None).is_some());
        micro(0);
    }

    #[test]
    fn the_process_high_water_mark_can_be_reset_here() {
        // What the CPU meter relies on: writing 5 to clear_refs lowers VmHWM
        // to VmRSS (Linux ≥ 4.0), for an unprivileged process too. Other
        // tests allocate on other threads meanwhile: one clean try of a few
        // is the proof.
        let reset_lowers_the_mark = (0..5).any(|_| {
            let big = vec![1u8; 64 << 20];
            std::hint::black_box(&big);
            drop(big);
            let (rss, hwm) = crate::memory_probe::process_memory();
            let raised = hwm.expect("VmHWM") >= rss.expect("VmRSS") + (32 << 20);
            std::fs::write("/proc/self/clear_refs", "5").expect("reset");
            let (rss, hwm) = crate::memory_probe::process_memory();
            raised && hwm.expect("VmHWM") < rss.expect("VmRSS") + (16 << 20)
        });
        assert!(reset_lowers_the_mark);
    }
}
