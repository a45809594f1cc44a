//! The MemoryAwareTrainingJob controller.
//!
//! * [`watch`] — the watches and caches; starts reconciling once they are complete
//! * [`reconcile`] — one reconcile: dereference ([`observe`]) → decide → apply
//! * [`decide`] — the pure decision (what the status says, what to create or
//!   stop), by concern: the running attempt's verdict, the retry, the
//!   initializer, a refusal
//! * [`lifecycle`] — phases, condition/event reasons and the one function that moves a job
//! * [`classify`] — what a worker pod's state says about its attempt (pure)
//! * [`pods`] — pure builders of what the operator creates for a job: the
//!   worker and initializer pods, the checkpoint claim, the headless Service
//! * [`apply`] — every write to the API server, each failing with its step
//! * [`config`] — operator-wide settings (flags / Helm values)
//!
//! Imports run one way, from [`watch`] down to [`lifecycle`], [`classify`]
//! and [`config`]; this file holds what they all share (the context, the
//! errors) and imports none of them but [`config`].

pub mod apply;
pub mod classify;
pub mod config;
pub mod decide;
pub mod lifecycle;
pub mod model_cache;
pub mod observe;
pub mod pods;
pub mod reconcile;
pub mod watch;

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_api::MemoryAwareTrainingJob;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use kube::core::PartialObjectMeta;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};

pub use config::{
    CheckpointAccess, ChildConfig, ControllerConfig, DEFAULT_PLANNING_BUDGET, ModelCacheConfig,
    WorkerImages,
};

use crate::metrics::Metrics;
use crate::worker_reports::WorkerReports;

/// Reconcile failures, each naming the step that failed and on what object.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("job has no namespace")]
    NoNamespace,
    #[error("writing the status of job {job}: {source}")]
    ApplyStatus {
        job: String,
        #[source]
        source: kube::Error,
    },
    #[error("applying {kind} {name}: {source}")]
    ApplyChild {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("building {kind} {name}: {source}")]
    BuildChild {
        kind: String,
        name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "checkpoint claim {claim} holds the checkpoints of an earlier job named {job} (uid {holder}), kept after it ended; delete the claim (kubectl delete pvc {claim}) or give this job another name"
    )]
    ClaimTaken {
        claim: String,
        job: String,
        holder: String,
    },
    #[error("keeping checkpoint claim {claim} after the job: {source}")]
    KeepClaim {
        claim: String,
        #[source]
        source: kube::Error,
    },
    #[error("deleting worker pod {pod}: {source}")]
    DeleteWorker {
        pod: String,
        #[source]
        source: kube::Error,
    },
    #[error("deleting job {job}, finished longer than its ttlSecondsAfterFinished ago: {source}")]
    DeleteJob {
        job: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the workers' last telemetry into job {job}: {source}")]
    FlushTelemetry {
        job: String,
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// The step that failed: the `step` label of `headroom_reconcile_errors_total`.
    pub fn step(&self) -> &'static str {
        match self {
            Error::NoNamespace => "read_job",
            Error::ApplyStatus { .. } => "apply_status",
            Error::ApplyChild { .. } | Error::ClaimTaken { .. } => "apply_child",
            Error::KeepClaim { .. } => "keep_claim",
            Error::BuildChild { .. } => "build_child",
            Error::DeleteWorker { .. } => "delete_worker",
            Error::DeleteJob { .. } => "delete_job",
            Error::FlushTelemetry { .. } => "flush_telemetry",
        }
    }

    /// What went wrong, coarsely: the `error` label of the same metric.
    pub fn kind(&self) -> &'static str {
        match self.api_error() {
            Some(e) if e.code == 409 => "conflict",
            Some(e) if matches!(e.code, 400 | 403 | 422) => "refused",
            Some(_) => "api",
            None => match self {
                Error::NoNamespace => "no_namespace",
                Error::ClaimTaken { .. } => "claim_taken",
                Error::BuildChild { .. } => "serialize",
                _ => "transport",
            },
        }
    }

    /// A stale read lost a race with a newer write (retry soon).
    pub fn is_conflict(&self) -> bool {
        self.api_error().is_some_and(|e| e.code == 409)
    }

    /// The API server answered a write with a refusal it would give again,
    /// so the write certainly did not land and the next decision cannot
    /// make it either: a 4xx other than a conflict (409) or throttling
    /// (429). A conflict says only that the object changed since it was
    /// read (for a job, most often the telemetry flusher's write): the
    /// decision was made from a stale view, and the next one, on the newer
    /// version, makes the write again. After a server error or no answer it
    /// is unknown whether the write landed.
    pub fn refused_for_good(&self) -> bool {
        self.api_error()
            .is_some_and(|e| (400..500).contains(&e.code) && !matches!(e.code, 409 | 429))
    }

    /// The API server refused to create one of an attempt's children (any
    /// status code): what to tell the user, and whether it can heal by itself.
    pub fn launch_refusal(&self) -> Option<LaunchRefusal> {
        if let Error::ClaimTaken { claim, .. } = self {
            // Heals when the user deletes the old claim.
            return Some(LaunchRefusal {
                object: format!("PersistentVolumeClaim {claim}"),
                code: 409,
                message: self.to_string(),
                heals: true,
            });
        }
        let Error::ApplyChild {
            kind,
            name,
            source: kube::Error::Api(e),
        } = self
        else {
            return None;
        };
        Some(LaunchRefusal {
            object: format!("{kind} {name}"),
            code: e.code,
            message: e.message.clone(),
            heals: LaunchRefusal::heals(e.code),
        })
    }

    fn api_error(&self) -> Option<&kube::core::Status> {
        match self {
            Error::ApplyStatus { source, .. }
            | Error::ApplyChild { source, .. }
            | Error::KeepClaim { source, .. }
            | Error::DeleteWorker { source, .. }
            | Error::DeleteJob { source, .. }
            | Error::FlushTelemetry { source, .. } => match source {
                kube::Error::Api(e) => Some(e),
                _ => None,
            },
            Error::NoNamespace | Error::BuildChild { .. } | Error::ClaimTaken { .. } => None,
        }
    }
}

/// The API server said no to one of an attempt's children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchRefusal {
    /// `Pod tiny-a1-s0`, `Role tiny-worker`, …
    pub object: String,
    /// The HTTP status code.
    pub code: u16,
    pub message: String,
    /// Whether asking again later can succeed without anyone changing anything.
    pub heals: bool,
}

impl LaunchRefusal {
    /// Which refusals can pass. The children are a pure function of the spec
    /// and the plan, so an object the server judged malformed or invalid (400,
    /// 422, and the other 4xx) is refused again, identically, for ever: those
    /// end the job with the server's reason. A policy decision (403: a quota,
    /// Pod Security, a LimitRange, a missing PriorityClass, RBAC) changes when
    /// pods end or an admin acts, conflicts (409) and throttling (429) pass,
    /// and so do server-side errors (5xx, e.g. a webhook that is down): those
    /// are reported and asked again.
    pub fn heals(code: u16) -> bool {
        matches!(code, 403 | 409 | 429) || code >= 500
    }
}

/// Shared state of every reconcile.
pub struct Context {
    pub client: Client,
    pub pods: Store<Pod>,
    pub nodes: Store<Node>,
    /// Every pod in the cluster that holds GPUs, Headroom's or not, trimmed
    /// to its node and device requests: the inventory's in-use counts.
    pub device_pods: Store<Pod>,
    /// Every claim in scope, metadata only: a launch checks its job's
    /// checkpoint claim here rather than with a request.
    pub claims: Store<PartialObjectMeta<PersistentVolumeClaim>>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub config: ControllerConfig,
    /// The workers' latest telemetry, held by the worker API: written
    /// before a pod's end is acted on, forgotten when a job ends.
    pub reports: Arc<WorkerReports>,
    /// Attempts whose pods were just created but may not be in the pod cache
    /// yet (job uid, attempt) → when. Without it, the reconcile triggered by
    /// our own status write would create the same children a second time.
    launched: Mutex<HashMap<(String, u32), Instant>>,
    /// This operator's last status write per job uid: the job as the API
    /// server returned it, and the versions it supersedes. A reconcile woken
    /// by another watch (a new pod's) can run before the job cache shows
    /// that write; deciding on the older job would re-apply a status guarded
    /// by a stale resourceVersion, be refused (409) and wait out a requeue.
    written: OwnWrites,
    /// Kueue queues read recently, shared by every job of a queue.
    pub queue_offers: crate::kueue::OfferCache,
}

/// This operator's status writes the job cache may not show yet, per job
/// uid (read your own writes; see [`Context::written`]).
#[derive(Default)]
struct OwnWrites(Mutex<HashMap<String, OwnWrite>>);

impl OwnWrites {
    /// `cached`, or this operator's own newer write of it while `cached` is
    /// one of the versions that write superseded.
    fn newest<'a>(&self, cached: &'a MemoryAwareTrainingJob) -> Cow<'a, MemoryAwareTrainingJob> {
        let (Some(uid), Some(version)) = (cached.uid(), cached.resource_version()) else {
            return Cow::Borrowed(cached);
        };
        let Ok(mut written) = self.0.lock() else {
            return Cow::Borrowed(cached);
        };
        match written.get(&uid) {
            Some(own)
                if own.superseded.contains(&version) && own.at.elapsed() < LAUNCH_EXPECTATION =>
            {
                Cow::Owned((*own.job).clone())
            }
            Some(_) => {
                // The cache has it (or something newer): forget ours.
                written.remove(&uid);
                Cow::Borrowed(cached)
            }
            None => Cow::Borrowed(cached),
        }
    }

    /// Remembers a status write that turned `before` into `after`.
    fn wrote(&self, before: &MemoryAwareTrainingJob, after: &MemoryAwareTrainingJob) {
        let (Some(uid), Some(from)) = (after.uid(), before.resource_version()) else {
            return;
        };
        let Ok(mut written) = self.0.lock() else {
            return;
        };
        written.retain(|_, own| own.at.elapsed() < LAUNCH_EXPECTATION);
        let mut superseded = match written.remove(&uid) {
            // A second write in the same reconcile, or on top of our last one.
            Some(own)
                if own.job.resource_version().as_ref() == Some(&from)
                    || own.superseded.contains(&from) =>
            {
                let mut older = own.superseded;
                older.extend(own.job.resource_version());
                older
            }
            _ => Vec::new(),
        };
        if !superseded.contains(&from) {
            superseded.push(from);
        }
        written.insert(
            uid,
            OwnWrite {
                job: Arc::new(after.clone()),
                superseded,
                at: Instant::now(),
            },
        );
    }
}

struct OwnWrite {
    job: Arc<MemoryAwareTrainingJob>,
    /// resourceVersions older than `job`'s that came from this operator's
    /// reads or writes: the cache showing one of them is behind.
    superseded: Vec<String>,
    at: Instant,
}

/// How long a fresh launch is trusted to show up in the pod cache (and a
/// status write in the job cache).
const LAUNCH_EXPECTATION: Duration = Duration::from_secs(10);

impl Context {
    #[allow(clippy::too_many_arguments)] // one per cache and handle every reconcile shares
    pub fn new(
        client: Client,
        pods: Store<Pod>,
        nodes: Store<Node>,
        device_pods: Store<Pod>,
        claims: Store<PartialObjectMeta<PersistentVolumeClaim>>,
        recorder: Recorder,
        metrics: Arc<Metrics>,
        config: ControllerConfig,
        reports: Arc<WorkerReports>,
    ) -> Self {
        Context {
            client,
            pods,
            nodes,
            device_pods,
            claims,
            recorder,
            metrics,
            config,
            reports,
            launched: Mutex::default(),
            written: OwnWrites::default(),
            queue_offers: crate::kueue::OfferCache::default(),
        }
    }

    /// The job to decide on: `cached`, or this operator's own newer status
    /// write while the cache has not caught up with it.
    fn newest<'a>(&self, cached: &'a MemoryAwareTrainingJob) -> Cow<'a, MemoryAwareTrainingJob> {
        self.written.newest(cached)
    }

    /// Remembers a status write that turned `before` into `after`.
    fn wrote(&self, before: &MemoryAwareTrainingJob, after: &MemoryAwareTrainingJob) {
        self.written.wrote(before, after);
    }

    /// Whether this attempt's children were created moments ago.
    fn launched_recently(&self, key: &(String, u32)) -> bool {
        self.launched
            .lock()
            .ok()
            .and_then(|m| m.get(key).copied())
            .is_some_and(|at| at.elapsed() < LAUNCH_EXPECTATION)
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(version: &str) -> MemoryAwareTrainingJob {
        let mut job: MemoryAwareTrainingJob =
            serde_yaml::from_str(include_str!("../../../samples/cpu-tiny.yaml")).expect("sample");
        job.metadata.uid = Some("uid-1".into());
        job.metadata.resource_version = Some(version.into());
        job
    }

    #[test]
    fn a_cache_behind_our_own_write_reads_the_write_until_it_catches_up() {
        let writes = OwnWrites::default();
        let v1 = job("1");
        assert!(
            matches!(writes.newest(&v1), Cow::Borrowed(_)),
            "nothing written yet"
        );
        // Status write 1 → 2, then the telemetry prune 2 → 3, in one reconcile.
        writes.wrote(&v1, &job("2"));
        writes.wrote(&job("2"), &job("3"));
        for behind in ["1", "2"] {
            let cached = job(behind);
            let seen = writes.newest(&cached);
            assert_eq!(
                seen.resource_version().as_deref(),
                Some("3"),
                "cache at {behind}"
            );
        }
        // The cache shows our write (or anything newer): it wins, ours is forgotten.
        let caught_up = job("3");
        assert!(matches!(writes.newest(&caught_up), Cow::Borrowed(_)));
        assert!(
            matches!(writes.newest(&job("1")), Cow::Borrowed(_)),
            "forgotten"
        );
    }

    /// A status write that failed so, as `write_status_and_launch` sees it.
    fn status_write_failed(source: kube::Error) -> Error {
        Error::ApplyStatus {
            job: "oom-then-fit".into(),
            source,
        }
    }

    fn answered(code: u16) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("refused", "")
                .with_code(code)
                .boxed(),
        )
    }

    /// The pods launched together with a status write are deleted again
    /// only when the API server refused the write for good. After a
    /// conflict (a telemetry write between the read and the write),
    /// throttling, a server error or no answer, they stay: the next
    /// decision, on a fresh read, records the attempt on them
    /// (`Builder::start`), and a pod deleted under it would end that
    /// attempt as disrupted before it ran.
    #[test]
    fn only_a_status_write_refused_for_good_undoes_its_launch() {
        for code in [409, 429, 500, 503, 504] {
            assert!(
                !status_write_failed(answered(code)).refused_for_good(),
                "{code}: the launch stays"
            );
        }
        let no_answer = kube::Error::Service(std::io::Error::other("connection reset").into());
        assert!(!status_write_failed(no_answer).refused_for_good());
        for code in [400, 403, 404, 422] {
            assert!(
                status_write_failed(answered(code)).refused_for_good(),
                "{code}: the launch is undone"
            );
        }
    }

    #[test]
    fn a_write_on_a_version_from_elsewhere_supersedes_only_that_version() {
        let writes = OwnWrites::default();
        writes.wrote(&job("1"), &job("2"));
        // A worker's telemetry made 5; the operator wrote 5 → 6.
        writes.wrote(&job("5"), &job("6"));
        assert_eq!(
            writes.newest(&job("5")).resource_version().as_deref(),
            Some("6")
        );
        assert!(matches!(writes.newest(&job("1")), Cow::Borrowed(_)));
    }
}
