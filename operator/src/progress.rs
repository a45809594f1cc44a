//! A job's `status.progress`, from the reports its workers send: the step
//! of the run's total, the last losses, the throughput and the time left.
//! [`crate::worker_reports`] feeds every report it takes to the job's
//! [`ProgressTracker`] and writes [`ProgressTracker::progress`] with the
//! workers' entries; the metrics read it at each scrape.
//!
//! Which worker says it: the step, the losses and the throughput come from
//! one worker of the last pipeline stage (the stage that computes the loss;
//! its data-parallel replicas report the same step and loss, so the first
//! one seen stands for them). Until that stage has reported, the highest
//! stage seen stands in.
//!
//! The time left is the steps left × the seconds per step measured from
//! that worker's reports: step deltas over its own report times, over the
//! last [`WINDOW`] reports that moved the step. Why step deltas rather than
//! the reported tokens per second: they are the wall clock of whole steps,
//! so they include what a step's own timer leaves out (checkpoint saves,
//! pipeline bubbles, waiting for a slow replica, data loading), and they
//! need no count of tokens per step, which the operator would have to
//! re-derive from the plan (global batch, sequence length). Only one pod's
//! own timestamps are compared, so a skewed clock between nodes or the
//! operator does not matter. The first report of an attempt is not
//! measured from: it comes while the model loads or resumes.
//!
//! Across attempts: `step` is the run's step, so a retry that resumes from
//! a checkpoint shows the checkpoint's step once its workers report (the
//! steps after that checkpoint are trained again); until then the last
//! attempt's figures stay, with its number in `attempt`. The pace and the
//! time left are measured again on every attempt: a retry may run a
//! different micro-batch, checkpointing or device, so the last attempt's
//! pace says nothing about it.
//!
//! The counts of steps and tokens trained ([`RunCounts`], the metrics'
//! counters) only grow: each report of the reference worker adds the steps
//! past the highest one counted in its attempt, so the steps a retry trains
//! again are counted again (they were trained twice) and a step going back
//! takes nothing away. An attempt's first report is where its count starts:
//! it comes while the model loads or resumes, and an operator that started
//! mid-attempt does not count what it did not see.

use std::collections::VecDeque;

use headroom_api::{JobProgress, WorkerTelemetry, human_duration, round_significant};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// Reports that moved the step, of the reference worker, the pace is
/// measured over: about 2.5 minutes at the workers' default 10 s interval,
/// so the estimate follows a change of pace within minutes and one late
/// report moves it little.
pub const WINDOW: usize = 16;

/// Significant digits of the losses in `status.progress` (the workers'
/// entries keep them whole).
pub const LOSS_DIGITS: usize = 5;

/// What the operator knows of one job's progress.
#[derive(Clone, Debug, Default)]
pub struct ProgressTracker {
    /// The newest attempt seen (reports of older ones are ignored).
    attempt: u32,
    /// The run's total steps, as the controller last said.
    total_steps: Option<u64>,
    /// The worker whose reports count: (stage, pod name).
    reference: Option<(u32, String)>,
    /// The step of the reference worker's first report this attempt: the
    /// pace is measured from the first report past it.
    baseline_step: Option<u64>,
    /// (step, report time) of the reference worker's reports that moved
    /// the step past the baseline, oldest first.
    samples: VecDeque<(u64, Timestamp)>,
    /// The attempt the shown step is of, and the step.
    shown: Option<(u32, u64)>,
    train_loss: Option<f64>,
    eval_loss: Option<f64>,
    tokens_per_second: Option<f64>,
    /// (attempt, highest step counted in it) of the reference workers.
    counted: Option<(u32, u64)>,
    steps_done: u64,
    /// Steps counted before the tokens per step were known.
    steps_untokened: u64,
    tokens_done: u64,
    tokens_per_step: Option<u64>,
}

/// Steps and tokens a job's workers have trained, all attempts together,
/// as far as the operator has seen: counters, never lower than before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunCounts {
    pub steps: u64,
    /// None until the controller said the job's tokens per step.
    pub tokens: Option<u64>,
}

impl ProgressTracker {
    /// Takes one report the operator holds (the latest of its worker).
    pub fn observe(&mut self, report: &WorkerTelemetry) {
        // Attempt 0 is the initializer: it trains nothing.
        if report.attempt == 0 || report.attempt < self.attempt {
            return;
        }
        self.start_attempt(report.attempt);
        let replaces = match &self.reference {
            None => true,
            Some((stage, _)) => report.stage > *stage,
        };
        if replaces {
            self.reference = Some((report.stage, report.name.clone()));
            self.baseline_step = None;
            self.samples.clear();
        }
        if self.reference.as_ref().map(|r| r.1.as_str()) != Some(report.name.as_str()) {
            return;
        }
        self.shown = Some((report.attempt, report.step));
        self.count(report.attempt, report.step);
        if let Some(loss) = report.loss {
            self.train_loss = Some(loss);
        }
        if let Some(loss) = report.eval_loss {
            self.eval_loss = Some(loss);
        }
        if let Some(t) = report.tokens_per_second {
            self.tokens_per_second = Some(t);
        }
        self.sample(report.step, report.updated_at.0);
    }

    /// Counts the steps `step` is past the highest one counted in `attempt`.
    fn count(&mut self, attempt: u32, step: u64) {
        let done = match self.counted {
            Some((a, high)) if a == attempt => step.saturating_sub(high),
            // The attempt's first report: its count starts here.
            _ => 0,
        };
        let high = match self.counted {
            Some((a, high)) if a == attempt => high.max(step),
            _ => step,
        };
        self.counted = Some((attempt, high));
        self.steps_done += done;
        match self.tokens_per_step {
            Some(tokens) => self.tokens_done += done.saturating_mul(tokens),
            None => self.steps_untokened += done,
        }
    }

    /// The job's tokens per optimizer step
    /// ([`headroom_api::MemoryAwareTrainingJob::tokens_per_step`]); steps
    /// counted before it was known are counted at it.
    pub fn set_tokens_per_step(&mut self, tokens: u64) {
        self.tokens_per_step = Some(tokens);
        self.tokens_done += std::mem::take(&mut self.steps_untokened).saturating_mul(tokens);
    }

    /// The steps and tokens trained so far.
    pub fn counts(&self) -> RunCounts {
        RunCounts {
            steps: self.steps_done,
            tokens: self.tokens_per_step.map(|_| self.tokens_done),
        }
    }

    fn sample(&mut self, step: u64, at: Timestamp) {
        let Some(baseline) = self.baseline_step else {
            self.baseline_step = Some(step);
            return;
        };
        match self.samples.back() {
            // The step went back within one pod's attempt: start again.
            Some(&(last, _)) if step < last => {
                self.samples.clear();
                self.baseline_step = Some(step);
            }
            Some(&(last, _)) if step == last => {}
            _ if step > baseline => {
                self.samples.push_back((step, at));
                if self.samples.len() > WINDOW {
                    self.samples.pop_front();
                }
            }
            _ => {}
        }
    }

    /// The job's attempt is now `attempt`: the pace is measured again.
    pub fn start_attempt(&mut self, attempt: u32) {
        if attempt > self.attempt {
            self.attempt = attempt;
            self.reference = None;
            self.baseline_step = None;
            self.samples.clear();
            self.tokens_per_second = None;
        }
    }

    /// The run's total steps ([`headroom_api::MemoryAwareTrainingJob::total_steps`]).
    pub fn set_total_steps(&mut self, total: u64) {
        self.total_steps = Some(total);
    }

    /// Wall-clock seconds per step over the window; None until two
    /// reports past the attempt's first moved the step.
    pub fn seconds_per_step(&self) -> Option<f64> {
        let (&(first_step, first_at), &(last_step, last_at)) =
            (self.samples.front()?, self.samples.back()?);
        let steps = last_step.checked_sub(first_step).filter(|s| *s > 0)?;
        let seconds = last_at.duration_since(first_at).as_secs_f64();
        (seconds > 0.0).then(|| seconds / steps as f64)
    }

    /// `status.progress` at `now`; None until a worker of an attempt has reported.
    pub fn progress(&self, now: Timestamp) -> Option<JobProgress> {
        let (attempt, step) = self.shown?;
        let mut p = JobProgress {
            attempt,
            step,
            total_steps: self.total_steps,
            step_of_total: JobProgress::step_of_total(step, self.total_steps),
            train_loss: self.train_loss.map(|l| round_significant(l, LOSS_DIGITS)),
            eval_loss: self.eval_loss.map(|l| round_significant(l, LOSS_DIGITS)),
            tokens_per_second: self.tokens_per_second,
            seconds_per_step: None,
            eta_seconds: None,
            eta: None,
            estimated_completion_time: None,
            updated_at: Time(now),
        };
        // The pace of an attempt whose figures are not shown yet says nothing.
        // Rounded up: 0s only once the last step is done.
        let pace = self.seconds_per_step().filter(|_| attempt == self.attempt);
        let left = self.total_steps.map(|total| total.saturating_sub(step));
        let eta = match (left, pace) {
            (Some(0), _) => Some(0),
            (Some(left), Some(pace)) => {
                Some((left as f64 * pace).ceil().min(u64::MAX as f64) as u64)
            }
            _ => None,
        };
        p.seconds_per_step = pace;
        if let Some(eta) = eta {
            p.eta_seconds = Some(eta);
            p.eta = Some(human_duration(eta));
            p.estimated_completion_time = i64::try_from(eta)
                .ok()
                .and_then(|s| now.checked_add(SignedDuration::from_secs(s)).ok())
                .map(Time);
        }
        Some(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_api::MemorySample;

    const T0: i64 = 1_800_000_000;

    /// A report of `pod` (stage `stage`, attempt `attempt`) at second `at`.
    fn report(pod: &str, attempt: u32, stage: u32, step: u64, at: i64) -> WorkerTelemetry {
        WorkerTelemetry {
            name: pod.into(),
            attempt,
            stage,
            layer_start: 0,
            layer_end: 2,
            step,
            loss: None,
            eval_loss: None,
            tokens_per_second: None,
            memory: MemorySample::default(),
            download: None,
            stepped_down: None,
            updated_at: Time(Timestamp::from_second(T0 + at).expect("time")),
        }
    }

    fn with_loss(mut r: WorkerTelemetry, loss: f64) -> WorkerTelemetry {
        r.loss = Some(loss);
        r.tokens_per_second = Some(2048.0);
        r
    }

    fn now(at: i64) -> Timestamp {
        Timestamp::from_second(T0 + at).expect("time")
    }

    #[test]
    fn nothing_is_shown_before_a_worker_of_an_attempt_reports() {
        let mut t = ProgressTracker::default();
        t.set_total_steps(500);
        assert_eq!(t.progress(now(0)), None);
        // The initializer's reports (attempt 0) are not training.
        t.observe(&report("j-init-1", 0, 0, 0, 0));
        assert_eq!(t.progress(now(0)), None);
    }

    #[test]
    fn the_eta_is_the_steps_left_at_the_measured_pace() {
        let mut t = ProgressTracker::default();
        t.set_total_steps(500);
        // The first report comes while the model loads: not measured from.
        t.observe(&report("j-a1-s0", 1, 0, 0, 0));
        let p = t.progress(now(0)).expect("shown");
        assert_eq!((p.step, p.step_of_total.as_str()), (0, "0/500"));
        assert_eq!(
            (p.eta, p.seconds_per_step),
            (None, None),
            "not measured yet"
        );
        // 60 s of loading, then 2 s a step, a report every 10 s.
        t.observe(&with_loss(report("j-a1-s0", 1, 0, 5, 70), 3.0));
        let p = t.progress(now(70)).expect("shown");
        assert_eq!(p.eta, None, "one point is no pace");
        assert_eq!(p.train_loss, Some(3.0));
        for (step, at) in [(10, 80), (15, 90), (20, 100)] {
            t.observe(&with_loss(report("j-a1-s0", 1, 0, step, at), 2.5));
        }
        let p = t.progress(now(100)).expect("shown");
        assert_eq!(p.seconds_per_step, Some(2.0), "30 s over 15 steps");
        assert_eq!(p.eta_seconds, Some(480 * 2));
        assert_eq!(p.eta.as_deref(), Some("16m00s"));
        assert_eq!(
            p.estimated_completion_time,
            Some(Time(now(100 + 960))),
            "from when it was computed"
        );
        assert_eq!(p.tokens_per_second, Some(2048.0));
        // A report that did not move the step changes nothing of the pace.
        t.observe(&report("j-a1-s0", 1, 0, 20, 105));
        assert_eq!(t.seconds_per_step(), Some(2.0));
        // The last step: nothing left.
        t.observe(&report("j-a1-s0", 1, 0, 500, 1060));
        let p = t.progress(now(1060)).expect("shown");
        assert_eq!((p.eta_seconds, p.eta.as_deref()), (Some(0), Some("0s")));
        assert_eq!(p.step_of_total, "500/500");
    }

    #[test]
    fn the_pace_follows_the_last_reports_only() {
        let mut t = ProgressTracker::default();
        t.set_total_steps(10_000);
        t.observe(&report("w", 1, 0, 0, 0));
        // 1 s a step for a long while, then 3 s a step.
        let mut at = 0;
        for step in (10..=300).step_by(10) {
            at += 10;
            t.observe(&report("w", 1, 0, step, at));
        }
        assert_eq!(t.seconds_per_step(), Some(1.0));
        for step in (310..=300 + 10 * WINDOW as u64).step_by(10) {
            at += 30;
            t.observe(&report("w", 1, 0, step, at));
        }
        assert_eq!(t.seconds_per_step(), Some(3.0), "only the slower window");
    }

    #[test]
    fn the_last_stage_reports_the_loss_and_stands_for_the_job() {
        let mut t = ProgressTracker::default();
        t.set_total_steps(100);
        // Stage 0 reports first (no loss): it stands in.
        t.observe(&report("j-a1-s0", 1, 0, 3, 0));
        let p = t.progress(now(0)).expect("shown");
        assert_eq!((p.step, p.train_loss), (3, None));
        // The last stage appears: its step, loss and eval loss count; stage 0's no longer.
        let mut last = with_loss(report("j-a1-s1", 1, 1, 2, 1), 4.123_456_7);
        last.eval_loss = Some(4.5);
        t.observe(&last);
        t.observe(&report("j-a1-s0", 1, 0, 9, 2));
        let p = t.progress(now(2)).expect("shown");
        assert_eq!(p.step, 2, "the last stage's step");
        assert_eq!(p.train_loss, Some(4.1235), "5 significant digits");
        assert_eq!(p.eval_loss, Some(4.5));
        // A report without a loss (or an eval loss) keeps the last one.
        t.observe(&report("j-a1-s1", 1, 1, 3, 3));
        let p = t.progress(now(3)).expect("shown");
        assert_eq!(
            (p.step, p.train_loss, p.eval_loss),
            (3, Some(4.1235), Some(4.5))
        );
        // Stage 0's clock never entered the pace: measured from stage 1's reports only.
        for (step, at) in [(4, 13), (5, 23)] {
            t.observe(&report("j-a1-s1", 1, 1, step, at));
        }
        assert_eq!(t.seconds_per_step(), Some(10.0));
    }

    #[test]
    fn replicas_of_the_last_stage_count_once() {
        let mut t = ProgressTracker::default();
        t.set_total_steps(100);
        t.observe(&report("j-a1-s1-r0", 1, 1, 0, 0));
        t.observe(&report("j-a1-s1-r1", 1, 1, 0, 0));
        for (step, at) in [(10, 10), (20, 20), (30, 30)] {
            t.observe(&with_loss(report("j-a1-s1-r0", 1, 1, step, at), 2.0));
            // The other replica's report, a second late on its own clock.
            t.observe(&with_loss(report("j-a1-s1-r1", 1, 1, step, at + 1), 2.0));
        }
        let p = t.progress(now(30)).expect("shown");
        assert_eq!(p.step, 30);
        assert_eq!(p.seconds_per_step, Some(1.0), "one replica's clock");
        assert_eq!(p.tokens_per_second, Some(2048.0), "the run's, not summed");
    }

    /// Attempt 1 reaches step 120 and is OOM-killed; attempt 2 resumes from
    /// the checkpoint at step 100 at another pace.
    #[test]
    fn a_retry_resuming_from_a_checkpoint_shows_the_checkpoints_step_and_measures_again() {
        let mut t = ProgressTracker::default();
        t.set_total_steps(500);
        t.observe(&report("j-a1-s0", 1, 0, 0, 0));
        for (step, at) in [(100, 100), (120, 120)] {
            t.observe(&with_loss(report("j-a1-s0", 1, 0, step, at), 2.0));
        }
        assert_eq!(t.progress(now(120)).expect("shown").eta_seconds, Some(380));
        // The controller starts attempt 2: attempt 1's figures stay, its pace goes.
        t.start_attempt(2);
        let p = t.progress(now(130)).expect("shown");
        assert_eq!((p.attempt, p.step, p.train_loss), (1, 120, Some(2.0)));
        assert_eq!((p.eta, p.tokens_per_second), (None, None));
        // A late report of attempt 1 changes nothing.
        t.observe(&with_loss(report("j-a1-s0", 1, 0, 121, 125), 9.0));
        assert_eq!(t.progress(now(130)).expect("shown").step, 120);
        // Attempt 2's worker resumes at the checkpoint's step.
        t.observe(&report("j-a2-s0", 2, 0, 100, 200));
        let p = t.progress(now(200)).expect("shown");
        assert_eq!(
            (p.attempt, p.step, p.step_of_total.as_str()),
            (2, 100, "100/500")
        );
        assert_eq!(
            p.train_loss,
            Some(2.0),
            "the last loss until attempt 2's first step"
        );
        assert_eq!(p.eta, None, "attempt 2's pace is not measured yet");
        // Measured from past the resumed step: 3 s a step.
        for (step, at) in [(110, 260), (120, 290)] {
            t.observe(&with_loss(report("j-a2-s0", 2, 0, step, at), 1.9));
        }
        let p = t.progress(now(290)).expect("shown");
        assert_eq!(p.seconds_per_step, Some(3.0));
        assert_eq!(p.eta_seconds, Some(380 * 3));
        assert_eq!(p.train_loss, Some(1.9));
    }

    #[test]
    fn without_a_total_the_step_shows_alone_and_no_eta() {
        let mut t = ProgressTracker::default();
        t.observe(&report("w", 1, 0, 0, 0));
        t.observe(&report("w", 1, 0, 10, 10));
        t.observe(&report("w", 1, 0, 20, 20));
        let p = t.progress(now(20)).expect("shown");
        assert_eq!((p.step_of_total.as_str(), p.total_steps), ("20", None));
        assert_eq!((p.seconds_per_step, p.eta), (Some(1.0), None));
        t.set_total_steps(40);
        assert_eq!(
            t.progress(now(20)).expect("shown").eta.as_deref(),
            Some("20s")
        );
    }

    /// The counters only grow: a retry resumed at an earlier checkpoint
    /// counts the steps it trains again, a step going back takes nothing
    /// away, a lagging later stage taking over as reference adds nothing,
    /// and steps counted before the tokens per step were known get them.
    #[test]
    fn counts_of_steps_and_tokens_only_grow_across_attempts() {
        let mut t = ProgressTracker::default();
        let steps = |t: &ProgressTracker| t.counts().steps;
        t.observe(&report("j-a1-s0", 1, 0, 0, 0));
        t.observe(&report("j-a1-s0", 1, 0, 30, 30));
        assert_eq!(
            t.counts(),
            RunCounts {
                steps: 30,
                tokens: None
            }
        );
        t.set_tokens_per_step(1000);
        assert_eq!(t.counts().tokens, Some(30_000));
        // Stage 1 appears behind stage 0 and becomes the reference.
        t.observe(&report("j-a1-s1", 1, 1, 28, 31));
        assert_eq!(steps(&t), 30);
        t.observe(&report("j-a1-s1", 1, 1, 40, 41));
        assert_eq!(steps(&t), 40);
        // A late or reset report of the attempt takes nothing away.
        t.observe(&report("j-a1-s1", 1, 1, 35, 42));
        assert_eq!(steps(&t), 40);
        // Attempt 2 resumes at the checkpoint of step 20: its first report
        // starts its count; the steps it trains again count again.
        t.observe(&report("j-a2-s0", 2, 0, 20, 100));
        assert_eq!(steps(&t), 40);
        t.observe(&report("j-a2-s0", 2, 0, 45, 130));
        assert_eq!(
            t.counts(),
            RunCounts {
                steps: 65,
                tokens: Some(65_000)
            }
        );
        // A report of the superseded attempt counts nothing.
        t.observe(&report("j-a1-s1", 1, 1, 90, 131));
        assert_eq!(steps(&t), 65);
    }
}
