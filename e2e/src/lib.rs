//! The test kit of the workspace, and the library of the end-to-end suite.
//!
//! * [`namespace`]: [`TestNs`], a fresh namespace per test on the cluster in
//!   `KUBECONFIG`, for the e2e suite ([`E2E`]: Headroom installed by the Helm
//!   chart, real pods) and the API-server tests of the operator and the worker
//!   ([`API_SERVER`]: the loopback control plane of `make test-apiserver`);
//!   waits that fail with a dump of the namespace; cleanup.
//! * [`wait`]: the polling loop behind every wait, and the conditions waited for.
//! * [`crd`]: installing the CRD on a bare control plane; server-side dry runs.
//! * [`corpus`]: the invalid-manifest corpus and the loop that checks each is
//!   rejected with the message its `# expect:` line names.
//! * [`fixtures`]: the samples, GPU job manifests, pod statuses as a kubelet
//!   writes them, fake GPU nodes.
//! * [`cluster`]: the e2e cluster's kubectl and the installed operator.
//! * [`hub`]: a local stand-in for the Hugging Face hub (the initializer's
//!   tests on loopback, the e2e suite's initializer pods over the node's address).
//! * [`kueue`]: a test's Kueue queue (flavor, ClusterQueue, LocalQueue), priorities, workloads.
//! * [`checkpoint`]: random Llama checkpoints of any size in Hugging Face's layout.
//! * [`payload`]: claims with the sample text and checkpoints, read back by helper pods.
//!
//! It depends on the API types only, never on the operator or the worker, so
//! both can use it for their tests.

pub mod checkpoint;
pub mod cluster;
pub mod corpus;
pub mod crd;
pub mod fixtures;
pub mod gfd;
pub mod hub;
pub mod kueue;
pub mod namespace;
pub mod payload;
pub mod wait;

pub use cluster::{kubectl, operator_deployment, operator_namespace, operator_selector};
pub use namespace::{API_SERVER, E2E, Suite, TestNs};
pub use wait::{attempts, ended, phase, pod_phase, pod_ready, telemetry_step};
