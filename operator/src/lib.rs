//! Headroom's operator crate: the controller, the CRD generator, the
//! `kubectl headroom` plugin and the controller benchmark. Pure pieces live in `headroom-planner`
//! and the resource types in `headroom-api`.

pub mod controller;
pub mod crd;
pub mod inventory;
pub mod kueue;
pub mod leader;
pub mod listener;
pub mod metrics;
pub mod metrics_access;
pub mod plan_text;
pub mod progress;
pub mod token_cache;
pub mod watched_pods;
pub mod worker_api;
pub mod worker_reports;
