//! Everything the worker reads from its environment, read once by
//! [`WorkerEnv::from_env`] and checked there: a value that cannot be used is
//! an [`EnvError`] naming the variable, and the worker exits with
//! `INVALID_PLAN` before it trains a step.
//!
//! The variables the operator sets are named in `headroom_api::contract`
//! (the worker API's two are read by [`crate::worker_api::WorkerApi::from_env`]);
//! the ones below are set by hand: two for tests and local runs, one to
//! choose the GPU replicas' collective.

use std::path::PathBuf;
use std::time::Duration;

use headroom_api::{
    CHECKPOINT_DIR_ENV, DEFAULT_CHECKPOINT_DIR, PEER_KEY_ENV, PIPELINE_ADDRESSES_ENV,
    PIPELINE_PODS_ENV, PIPELINE_SERVICE_ENV, PIPELINE_TIMEOUT_ENV, PLAN_FILE_ENV, PLAN_JSON_ENV,
    POD_NAME_ENV, REPLICA_ADDRESSES_ENV, REPLICA_PODS_ENV, TELEMETRY_INTERVAL_ENV,
    TERMINATION_MESSAGE_PATH,
};

use crate::link_auth::LinkKey;
use crate::report::DEFAULT_INTERVAL;

/// Overrides where the termination message goes (tests, local runs).
pub const TERMINATION_MESSAGE_PATH_ENV: &str = "HEADROOM_TERMINATION_MESSAGE_PATH";
/// Optional soft device limit in bytes: when the worker's peak passes it, the
/// worker stops with `DEVICE_OUT_OF_MEMORY` as a GPU worker would. Lets the
/// CPU backend (whose real limit is the kernel's OOM kill) exercise the
/// device-OOM path of the operator; unset in normal runs.
pub const DEVICE_MEMORY_LIMIT_ENV: &str = "HEADROOM_DEVICE_MEMORY_LIMIT_BYTES";
/// Set by the worker itself when its memory guard steps it down in place:
/// it runs itself again (the same pod, a fresh process) as
/// `<micro-batch>x<accumulation>`, the same global batch as the plan's.
pub const STEPPED_DOWN_ENV: &str = "HEADROOM_STEPPED_DOWN";
/// How the data-parallel replicas of a CUDA plan exchange gradients:
/// `auto` (the default: NCCL when the worker was built with CUDA and libnccl
/// loads, else the TCP ring) or `ring` (the TCP ring always). CPU plans use
/// the ring whatever it says. Every replica must make the same choice.
pub const COLLECTIVE_ENV: &str = "HEADROOM_COLLECTIVE";
/// Where a CUDA worker keeps cubecl's autotune results and compiled kernels
/// (default: under the checkpoint directory, one directory per slot:
/// [`crate::gpu_runtime::cache_dir`]). Benchmarks that run many short jobs
/// on one GPU share one.
pub const GPU_CACHE_DIR_ENV: &str = "HEADROOM_GPU_CACHE_DIR";
/// The pod name when `POD_NAME` is not set (a pod's hostname is its name).
pub const HOSTNAME_ENV: &str = "HOSTNAME";
/// How long a worker waits for its peers (neighbouring stages, the other
/// replicas of its stage) when `HEADROOM_PIPELINE_TIMEOUT_SECONDS` is not set.
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(600);

/// Where the assignment document comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanSource {
    /// `HEADROOM_PLAN_FILE`: a JSON file (the operator's mounted ConfigMap).
    File(PathBuf),
    /// `HEADROOM_PLAN`: the JSON itself.
    Json(String),
}

/// How a stage of a multi-stage plan finds the others, and how a replica
/// finds the other replicas of its stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerSource {
    /// `HEADROOM_PIPELINE_ADDRESSES` (`HEADROOM_REPLICA_ADDRESSES`): one
    /// `host:port` per stage (replica), no cluster needed (local runs and
    /// tests); takes precedence over the pods.
    Addresses(Vec<String>),
    /// `HEADROOM_PIPELINE_PODS` (`HEADROOM_REPLICA_PODS`), set by the
    /// operator: the pod names, looked up through the worker API, and the headless
    /// Service (`HEADROOM_PIPELINE_SERVICE`, empty when not set) for the DNS
    /// fallback.
    Pods { pods: Vec<String>, service: String },
}

/// `HEADROOM_COLLECTIVE`: what the replicas of a CUDA plan talk through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CollectiveChoice {
    /// NCCL when the binary has CUDA and libnccl loads, else the TCP ring.
    #[default]
    Auto,
    /// The TCP ring, even where NCCL would do.
    Ring,
}

/// The worker's environment, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerEnv {
    /// `HEADROOM_TERMINATION_MESSAGE_PATH`, else `/dev/termination-log`.
    pub termination_message_path: PathBuf,
    pub plan: PlanSource,
    /// `HEADROOM_CHECKPOINT_DIR`, else the contract's default.
    pub checkpoint_dir: PathBuf,
    /// `HEADROOM_GPU_CACHE_DIR`, when set.
    pub gpu_cache_dir: Option<PathBuf>,
    /// `POD_NAME`, else `HOSTNAME`.
    pub pod_name: Option<String>,
    /// `HEADROOM_TELEMETRY_INTERVAL_SECONDS`: the least time between status writes.
    pub telemetry_interval: Duration,
    /// `HEADROOM_DEVICE_MEMORY_LIMIT_BYTES`.
    pub device_memory_limit: Option<u64>,
    /// `HEADROOM_STEPPED_DOWN`: the micro-batch and accumulation the
    /// guard stepped this worker down to (it set them before running
    /// itself again).
    pub stepped_down: Option<headroom_api::SteppedDown>,
    /// `HEADROOM_PIPELINE_TIMEOUT_SECONDS` (named for the pipeline, it bounds
    /// every peer link, replicas' included): how long to wait for the peers
    /// to come up, and then for any frame.
    pub peer_timeout: Duration,
    /// `None` when neither pipeline variable is set (a single-stage plan needs none).
    pub pipeline_peers: Option<PeerSource>,
    /// The replicas of this worker's stage, rank order; `None` when neither
    /// replica variable is set (a plan without replicas needs none).
    pub replica_peers: Option<PeerSource>,
    /// `HEADROOM_COLLECTIVE` (`auto` when not set).
    pub collective: CollectiveChoice,
    /// `HEADROOM_PEER_KEY`: the job's peer key where there is no worker API
    /// to ask (local runs, tests); `None` when not set.
    pub peer_key: Option<LinkKey>,
}

/// A variable the worker cannot use.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("no plan: set {PLAN_FILE_ENV} (a JSON file) or {PLAN_JSON_ENV} (the JSON itself)")]
    NoPlan,
    #[error("{variable} must be {expected}, not {value:?}")]
    Invalid {
        variable: &'static str,
        expected: &'static str,
        value: String,
    },
    /// A secret that cannot be used: unlike [`EnvError::Invalid`], the
    /// message does not repeat the value.
    #[error("{variable}: {reason} (the value is a secret and not shown)")]
    InvalidSecret {
        variable: &'static str,
        reason: &'static str,
    },
}

/// The environment is unusable; the termination message saying so still
/// goes where the environment asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{error}")]
pub struct InvalidEnv {
    pub termination_message_path: PathBuf,
    pub error: EnvError,
}

impl WorkerEnv {
    /// Reads the process environment (a variable that is not UTF-8 counts as unset).
    pub fn from_env() -> Result<Self, InvalidEnv> {
        Self::from_lookup(|key| std::env::var(key).ok())
    }

    /// Reads the environment through `env` (tests pass a map).
    pub fn from_lookup(env: impl Fn(&str) -> Option<String>) -> Result<Self, InvalidEnv> {
        let termination_message_path = env(TERMINATION_MESSAGE_PATH_ENV)
            .map_or_else(|| PathBuf::from(TERMINATION_MESSAGE_PATH), PathBuf::from);
        Self::parse(&env, termination_message_path.clone()).map_err(|error| InvalidEnv {
            termination_message_path,
            error,
        })
    }

    fn parse(
        env: &impl Fn(&str) -> Option<String>,
        termination_message_path: PathBuf,
    ) -> Result<Self, EnvError> {
        let plan = match (env(PLAN_FILE_ENV), env(PLAN_JSON_ENV)) {
            (Some(path), _) => PlanSource::File(PathBuf::from(path)),
            (None, Some(json)) => PlanSource::Json(json),
            (None, None) => return Err(EnvError::NoPlan),
        };
        let invalid =
            |variable: &'static str, expected: &'static str, value: String| EnvError::Invalid {
                variable,
                expected,
                value,
            };
        let device_memory_limit = env(DEVICE_MEMORY_LIMIT_ENV)
            .map(|v| {
                v.trim()
                    .parse::<u64>()
                    .map_err(|_| invalid(DEVICE_MEMORY_LIMIT_ENV, "a whole number of bytes", v))
            })
            .transpose()?;
        let stepped_down = env(STEPPED_DOWN_ENV)
            .map(|v| {
                let parsed = v.trim().split_once('x').and_then(|(m, a)| {
                    Some(headroom_api::SteppedDown {
                        micro_batch: m.parse().ok().filter(|&m| m > 0)?,
                        gradient_accumulation: a.parse().ok().filter(|&a| a > 0)?,
                    })
                });
                parsed.ok_or_else(|| {
                    invalid(
                        STEPPED_DOWN_ENV,
                        "<micro-batch>x<accumulation>, both ≥ 1",
                        v,
                    )
                })
            })
            .transpose()?;
        let telemetry_interval = match env(TELEMETRY_INTERVAL_ENV) {
            None => DEFAULT_INTERVAL,
            Some(v) => match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s >= 0.0 => Duration::from_secs_f64(s),
                _ => {
                    return Err(invalid(
                        TELEMETRY_INTERVAL_ENV,
                        "a number of seconds ≥ 0",
                        v,
                    ));
                }
            },
        };
        let peer_timeout = match env(PIPELINE_TIMEOUT_ENV) {
            None => DEFAULT_PEER_TIMEOUT,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(s) if s > 0 => Duration::from_secs(s),
                _ => {
                    return Err(invalid(
                        PIPELINE_TIMEOUT_ENV,
                        "a whole number of seconds ≥ 1",
                        v,
                    ));
                }
            },
        };
        let collective = match env(COLLECTIVE_ENV) {
            None => CollectiveChoice::Auto,
            Some(v) => match v.trim() {
                "auto" | "" => CollectiveChoice::Auto,
                "ring" => CollectiveChoice::Ring,
                _ => return Err(invalid(COLLECTIVE_ENV, "auto or ring", v)),
            },
        };
        let pipeline_peers = match (env(PIPELINE_ADDRESSES_ENV), env(PIPELINE_PODS_ENV)) {
            (Some(addresses), _) => Some(PeerSource::Addresses(list(&addresses))),
            (None, Some(pods)) => Some(PeerSource::Pods {
                pods: list(&pods),
                service: env(PIPELINE_SERVICE_ENV).unwrap_or_default(),
            }),
            (None, None) => None,
        };
        let replica_peers = match (env(REPLICA_ADDRESSES_ENV), env(REPLICA_PODS_ENV)) {
            (Some(addresses), _) => Some(PeerSource::Addresses(list(&addresses))),
            (None, Some(pods)) => Some(PeerSource::Pods {
                pods: list(&pods),
                service: env(PIPELINE_SERVICE_ENV).unwrap_or_default(),
            }),
            (None, None) => None,
        };
        let peer_key = env(PEER_KEY_ENV)
            .filter(|v| !v.trim().is_empty())
            .map(|v| {
                LinkKey::from_hex(&v).map_err(|reason| EnvError::InvalidSecret {
                    variable: PEER_KEY_ENV,
                    reason,
                })
            })
            .transpose()?;
        Ok(WorkerEnv {
            termination_message_path,
            plan,
            checkpoint_dir: env(CHECKPOINT_DIR_ENV)
                .map_or_else(|| PathBuf::from(DEFAULT_CHECKPOINT_DIR), PathBuf::from),
            gpu_cache_dir: env(GPU_CACHE_DIR_ENV)
                .filter(|v| !v.trim().is_empty())
                .map(PathBuf::from),
            pod_name: env(POD_NAME_ENV).or_else(|| env(HOSTNAME_ENV)),
            telemetry_interval,
            device_memory_limit,
            stepped_down,
            peer_timeout,
            pipeline_peers,
            replica_peers,
            collective,
            peer_key,
        })
    }
}

/// A comma-separated list, entries trimmed, empty ones dropped.
fn list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_with<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(key, _)| *key == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn defaults_for_everything_but_the_plan() {
        let env = WorkerEnv::from_lookup(env_with(&[(PLAN_JSON_ENV, "{}"), (HOSTNAME_ENV, "h")]))
            .expect("valid");
        assert_eq!(
            env,
            WorkerEnv {
                termination_message_path: PathBuf::from(TERMINATION_MESSAGE_PATH),
                plan: PlanSource::Json("{}".into()),
                checkpoint_dir: PathBuf::from(DEFAULT_CHECKPOINT_DIR),
                gpu_cache_dir: None,
                pod_name: Some("h".into()),
                telemetry_interval: DEFAULT_INTERVAL,
                device_memory_limit: None,
                stepped_down: None,
                peer_timeout: DEFAULT_PEER_TIMEOUT,
                pipeline_peers: None,
                replica_peers: None,
                collective: CollectiveChoice::Auto,
                peer_key: None,
            }
        );
    }

    #[test]
    fn every_variable_is_read() {
        let env = WorkerEnv::from_lookup(env_with(&[
            (PLAN_FILE_ENV, "/plan/plan.json"),
            (PLAN_JSON_ENV, "ignored: the file wins"),
            (TERMINATION_MESSAGE_PATH_ENV, "/tmp/t"),
            (CHECKPOINT_DIR_ENV, "/ckpt"),
            (GPU_CACHE_DIR_ENV, "/cache/gpu"),
            (POD_NAME_ENV, "job-a1-s0"),
            (HOSTNAME_ENV, "ignored"),
            (TELEMETRY_INTERVAL_ENV, " 0.5 "),
            (DEVICE_MEMORY_LIMIT_ENV, "1048576"),
            (PIPELINE_TIMEOUT_ENV, "60"),
            (PIPELINE_PODS_ENV, "p0, p1,,"),
            (PIPELINE_SERVICE_ENV, "job-a1"),
            (REPLICA_PODS_ENV, "p0,p0-r1"),
            (COLLECTIVE_ENV, " ring "),
            (PEER_KEY_ENV, &"ab".repeat(32)),
        ]))
        .expect("valid");
        assert_eq!(env.peer_key, Some(LinkKey::from_bytes([0xab; 32])));
        assert_eq!(env.plan, PlanSource::File("/plan/plan.json".into()));
        assert_eq!(env.collective, CollectiveChoice::Ring);
        assert_eq!(env.termination_message_path, PathBuf::from("/tmp/t"));
        assert_eq!(env.checkpoint_dir, PathBuf::from("/ckpt"));
        assert_eq!(env.gpu_cache_dir, Some(PathBuf::from("/cache/gpu")));
        assert_eq!(env.pod_name.as_deref(), Some("job-a1-s0"));
        assert_eq!(env.telemetry_interval, Duration::from_millis(500));
        assert_eq!(env.device_memory_limit, Some(1 << 20));
        assert_eq!(env.peer_timeout, Duration::from_secs(60));
        assert_eq!(
            env.pipeline_peers,
            Some(PeerSource::Pods {
                pods: vec!["p0".into(), "p1".into()],
                service: "job-a1".into()
            })
        );
        assert_eq!(
            env.replica_peers,
            Some(PeerSource::Pods {
                pods: vec!["p0".into(), "p0-r1".into()],
                service: "job-a1".into()
            })
        );
        // Explicit addresses win over the operator's pods (local runs, tests).
        let local = WorkerEnv::from_lookup(env_with(&[
            (PLAN_JSON_ENV, "{}"),
            (PIPELINE_PODS_ENV, "p0,p1"),
            (PIPELINE_ADDRESSES_ENV, "127.0.0.1:1, 127.0.0.1:2"),
            (REPLICA_PODS_ENV, "p0,p0-r1"),
            (REPLICA_ADDRESSES_ENV, "127.0.0.1:3,127.0.0.1:4"),
        ]))
        .expect("valid");
        assert_eq!(
            local.replica_peers,
            Some(PeerSource::Addresses(vec![
                "127.0.0.1:3".into(),
                "127.0.0.1:4".into()
            ]))
        );
        assert_eq!(
            local.pipeline_peers,
            Some(PeerSource::Addresses(vec![
                "127.0.0.1:1".into(),
                "127.0.0.1:2".into()
            ]))
        );
    }

    #[test]
    fn an_unusable_variable_is_named_and_the_termination_path_kept() {
        let missing = WorkerEnv::from_lookup(env_with(&[(TERMINATION_MESSAGE_PATH_ENV, "/t")]))
            .expect_err("no plan");
        assert_eq!(missing.error, EnvError::NoPlan);
        assert!(missing.to_string().contains(PLAN_FILE_ENV), "{missing}");
        assert_eq!(missing.termination_message_path, PathBuf::from("/t"));
        for (variable, value) in [
            (DEVICE_MEMORY_LIMIT_ENV, "1GiB"),
            (TELEMETRY_INTERVAL_ENV, "-1"),
            (TELEMETRY_INTERVAL_ENV, "NaN"),
            (PIPELINE_TIMEOUT_ENV, "0"),
            (PIPELINE_TIMEOUT_ENV, "1.5"),
            (COLLECTIVE_ENV, "nccl"),
        ] {
            let err = WorkerEnv::from_lookup(env_with(&[(PLAN_JSON_ENV, "{}"), (variable, value)]))
                .expect_err("invalid");
            assert!(
                matches!(&err.error, EnvError::Invalid { variable: v, value: got, .. } if *v == variable && got == value),
                "{err:?}"
            );
            assert!(err.to_string().starts_with(variable), "{err}");
            assert_eq!(
                err.termination_message_path,
                PathBuf::from(TERMINATION_MESSAGE_PATH)
            );
        }
    }

    #[test]
    fn link_auth_a_bad_peer_key_is_named_but_not_shown() {
        let almost = format!("{}zz", "ab".repeat(31));
        for value in ["abc123", almost.as_str(), &"ab".repeat(33)] {
            let err =
                WorkerEnv::from_lookup(env_with(&[(PLAN_JSON_ENV, "{}"), (PEER_KEY_ENV, value)]))
                    .expect_err("not 64 hex digits");
            let text = err.to_string();
            assert!(text.starts_with(PEER_KEY_ENV), "{text}");
            assert!(text.contains("64 hex digits"), "{text}");
            assert!(!text.contains("abab"), "the secret is not repeated: {text}");
        }
        // Blank counts as unset.
        let env = WorkerEnv::from_lookup(env_with(&[(PLAN_JSON_ENV, "{}"), (PEER_KEY_ENV, " ")]))
            .expect("valid");
        assert_eq!(env.peer_key, None);
        assert_eq!(format!("{env:?}").matches("LinkKey").count(), 0);
    }
}
