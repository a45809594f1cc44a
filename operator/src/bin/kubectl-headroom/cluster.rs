//! Which cluster and namespace the plugin plans in, as kubectl chooses them
//! (`--kubeconfig`, `--context`, `-n`), and what it reads there with the
//! rights the user has: a user whose Role is namespaced may not list nodes
//! or pods in every namespace, and is told what the plan could not check.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use headroom_operator::kueue::{QueueOffer, UnreadOffer};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// kubectl's flags for where to act; kubectl hands them to a plugin as given.
#[derive(clap::Args, Debug, Default, Clone, PartialEq, Eq)]
pub struct ClusterFlags {
    /// The namespace of jobs whose manifest names none (default: the
    /// kubeconfig context's, else `default`).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// The kubeconfig context to use (default: its current context).
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// The kubeconfig file (default: $KUBECONFIG, else ~/.kube/config).
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
}

/// Where the plugin plans: the kubeconfig the flags name (none offline) and
/// the namespace of a job whose manifest names none.
pub struct Target {
    kubeconfig: Option<Kubeconfig>,
    context: Option<String>,
    /// `-n`, else the context's namespace, else `default`.
    pub namespace: String,
    /// Set by `-n`: a manifest naming another namespace is an error, as
    /// with `kubectl apply`.
    explicit: bool,
}

/// How long the plugin waits to reach the API server: a CPU job plans
/// without it, so an unreachable cluster must not hold the plan long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

impl Target {
    /// The kubeconfig `--kubeconfig` names (an error when it cannot be read)
    /// or the default one ($KUBECONFIG, ~/.kube/config; none when there is
    /// none: the plugin then plans offline), its `--context` (an error when
    /// it has no such context) and the namespace.
    pub fn from_flags(flags: &ClusterFlags) -> Result<Target> {
        let kubeconfig = match &flags.kubeconfig {
            Some(path) => Some(
                Kubeconfig::read_from(path)
                    .with_context(|| format!("--kubeconfig {}", path.display()))?,
            ),
            None => Kubeconfig::read().ok(),
        };
        Target::with_kubeconfig(flags, kubeconfig)
    }

    /// The target of `flags` in `kubeconfig` (`None`: offline).
    fn with_kubeconfig(flags: &ClusterFlags, kubeconfig: Option<Kubeconfig>) -> Result<Target> {
        let context_namespace = match &kubeconfig {
            Some(config) => context_namespace(config, flags.context.as_deref())?,
            None if flags.context.is_some() => bail!(
                "--context {:?}: no kubeconfig to find it in (set KUBECONFIG or pass --kubeconfig)",
                flags.context.as_deref().unwrap_or_default()
            ),
            None => None,
        };
        Ok(Target {
            kubeconfig,
            context: flags.context.clone(),
            namespace: flags
                .namespace
                .clone()
                .or(context_namespace)
                .unwrap_or_else(|| "default".into()),
            explicit: flags.namespace.is_some(),
        })
    }

    /// The namespace a job is planned in: its manifest's, else this
    /// target's. A manifest naming another namespace than `-n` is refused,
    /// as `kubectl apply -n` refuses it.
    pub fn job_namespace(&self, manifest: Option<&str>) -> Result<String> {
        match manifest {
            Some(ns) if self.explicit && ns != self.namespace => bail!(
                "the manifest's metadata.namespace {ns:?} does not match --namespace {:?}; pass --namespace={ns} or drop one of them",
                self.namespace
            ),
            Some(ns) => Ok(ns.to_string()),
            None => Ok(self.namespace.clone()),
        }
    }

    /// A client for the target's cluster: its kubeconfig's context, else the
    /// pod's service account when the plugin runs in a cluster.
    async fn client(&self) -> Result<kube::Client> {
        let mut config = match &self.kubeconfig {
            Some(kubeconfig) => {
                let options = KubeConfigOptions {
                    context: self.context.clone(),
                    ..Default::default()
                };
                kube::Config::from_custom_kubeconfig(kubeconfig.clone(), &options).await?
            }
            None => kube::Config::incluster()
                .map_err(|_| anyhow!("no kubeconfig ($KUBECONFIG, ~/.kube/config or --kubeconfig) and not in a cluster"))?,
        };
        config.connect_timeout = Some(CONNECT_TIMEOUT);
        Ok(kube::Client::try_from(config)?)
    }

    /// What the plan reads from the cluster: nodes, and (with `gpu`) the
    /// pods that may hold GPUs, in every namespace when the user may list
    /// them there, else in `namespaces` (the jobs'). What could not be read
    /// is in [`ClusterState::unread`]; only no cluster at all is an error.
    pub fn state(&self, gpu: bool, namespaces: &[String]) -> Result<ClusterState> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async {
            let client = self.client().await?;
            let mut state = ClusterState::default();
            match Api::<Node>::all(client.clone())
                .list(&ListParams::default())
                .await
            {
                Ok(list) => state.nodes = Some(list.items),
                Err(e) if is_forbidden(&e) => {
                    state.unread.push(format!("you may not list nodes ({})", reason(&e)));
                }
                Err(e) => return Err(anyhow!(reason(&e))).context("listing nodes"),
            }
            // Pods matter for GPUs only, and only with nodes to plan on.
            if !gpu || state.nodes.is_none() {
                return Ok(state);
            }
            let live = ListParams::default().fields("status.phase!=Succeeded,status.phase!=Failed");
            match Api::<Pod>::all(client.clone()).list(&live).await {
                Ok(list) => state.pods = list.items,
                Err(e) if is_forbidden(&e) => {
                    let mut seen = Vec::new();
                    for ns in namespaces {
                        match Api::<Pod>::namespaced(client.clone(), ns).list(&live).await {
                            Ok(list) => {
                                state.pods.extend(list.items);
                                seen.push(ns.as_str());
                            }
                            Err(e) if is_forbidden(&e) => {}
                            Err(e) => {
                                return Err(anyhow!(reason(&e)))
                                    .with_context(|| format!("listing pods in namespace {ns}"));
                            }
                        }
                    }
                    let outside = match seen.as_slice() {
                        [] => "any pod".to_string(),
                        seen => format!("pods outside {}", seen.join(", ")),
                    };
                    state.unread.push(format!(
                        "you may not list pods in every namespace ({}): GPUs held by {outside} are counted as free",
                        reason(&e)
                    ));
                }
                Err(e) => return Err(anyhow!(reason(&e))).context("listing pods"),
            }
            Ok(state)
        })
    }
}

impl Target {
    /// The offers of the Kueue queues `queues` (namespace, LocalQueue)
    /// name, each as the operator reads it (crate::kueue), with whether
    /// the user's rights kept it; only no cluster at all is an error.
    pub fn queue_offers(
        &self,
        queues: &[(String, String)],
    ) -> Result<Vec<std::result::Result<QueueOffer, UnreadOffer>>> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async {
            let client = self.client().await?;
            let mut offers = Vec::with_capacity(queues.len());
            for (namespace, local) in queues {
                offers.push(QueueOffer::read_as_allowed(&client, namespace, local).await);
            }
            Ok(offers)
        })
    }
}

/// What the plugin read from the cluster.
#[derive(Default)]
pub struct ClusterState {
    /// `None`: the user may not list nodes.
    pub nodes: Option<Vec<Node>>,
    /// Non-terminal pods: every namespace's, or the jobs' namespaces' only.
    pub pods: Vec<Pod>,
    /// What the user's rights kept from the plan, said to them as a note.
    pub unread: Vec<String>,
}

/// The namespace of `context` (the current one when `None`) in `config`.
fn context_namespace(config: &Kubeconfig, context: Option<&str>) -> Result<Option<String>> {
    let Some(name) = context.or(config.current_context.as_deref()) else {
        return Ok(None);
    };
    let Some(named) = config.contexts.iter().find(|c| c.name == name) else {
        if context.is_none() {
            // A current-context that names nothing: kubectl plans as `default`.
            return Ok(None);
        }
        let known: Vec<&str> = config.contexts.iter().map(|c| c.name.as_str()).collect();
        bail!(
            "--context {name:?}: the kubeconfig has no such context (it has: {})",
            known.join(", ")
        );
    };
    Ok(named
        .context
        .as_ref()
        .and_then(|c| c.namespace.clone())
        .filter(|ns| !ns.is_empty()))
}

fn is_forbidden(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.is_forbidden())
}

/// The API server's message of a refusal; for any other error, the error
/// and its causes (a refused connection says so only in its source).
fn reason(e: &kube::Error) -> String {
    if let kube::Error::Api(status) = e {
        return status.message.clone();
    }
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text = format!("{text}: {cause}");
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBECONFIG: &str = "apiVersion: v1
kind: Config
current-context: tenant
clusters:
- name: c
  cluster: {server: 'https://127.0.0.1:6443'}
users:
- name: u
  user: {token: t}
contexts:
- name: tenant
  context: {cluster: c, user: u, namespace: tenant}
- name: bare
  context: {cluster: c, user: u}
";

    fn kubeconfig() -> Kubeconfig {
        Kubeconfig::from_yaml(KUBECONFIG).expect("kubeconfig")
    }

    fn target(flags: ClusterFlags, kubeconfig: Option<Kubeconfig>) -> Target {
        Target::with_kubeconfig(&flags, kubeconfig).expect("a target")
    }

    #[test]
    fn the_current_contexts_namespace_is_the_default() {
        let t = target(ClusterFlags::default(), Some(kubeconfig()));
        assert_eq!(t.namespace, "tenant");
        assert_eq!(t.job_namespace(None).expect("a namespace"), "tenant");
        // The manifest's own namespace wins over the context's.
        assert_eq!(
            t.job_namespace(Some("team")).expect("the manifest's"),
            "team"
        );
    }

    #[test]
    fn a_context_without_a_namespace_or_no_kubeconfig_means_default() {
        let bare = ClusterFlags {
            context: Some("bare".into()),
            ..Default::default()
        };
        assert_eq!(target(bare, Some(kubeconfig())).namespace, "default");
        assert_eq!(target(ClusterFlags::default(), None).namespace, "default");
    }

    #[test]
    fn dash_n_wins_and_a_manifest_naming_another_namespace_is_refused() {
        let flags = ClusterFlags {
            namespace: Some("ml".into()),
            ..Default::default()
        };
        let t = target(flags, Some(kubeconfig()));
        assert_eq!(t.job_namespace(None).expect("a namespace"), "ml");
        assert_eq!(t.job_namespace(Some("ml")).expect("the same"), "ml");
        let e = t
            .job_namespace(Some("team"))
            .expect_err("refused")
            .to_string();
        assert!(
            e.contains("\"team\" does not match --namespace \"ml\"")
                && e.contains("--namespace=team"),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_context_is_named_with_the_ones_there_are() {
        let e = context_namespace(&kubeconfig(), Some("prod"))
            .expect_err("refused")
            .to_string();
        assert!(e.contains("\"prod\"") && e.contains("tenant, bare"), "{e}");
        let flags = ClusterFlags {
            context: Some("prod".into()),
            kubeconfig: Some("/nonexistent/kubeconfig".into()),
            ..Default::default()
        };
        let e = Target::from_flags(&flags)
            .err()
            .expect("unreadable")
            .to_string();
        assert!(e.contains("--kubeconfig /nonexistent/kubeconfig"), "{e}");
    }

    #[test]
    fn kubectls_flags_parse_before_and_after_the_subcommand() {
        use clap::Parser;
        for args in [
            &[
                "kubectl-headroom",
                "-n",
                "ml",
                "--context",
                "bare",
                "plan",
                "-f",
                "-",
            ][..],
            &[
                "kubectl-headroom",
                "plan",
                "-f",
                "-",
                "--namespace=ml",
                "--context=bare",
            ][..],
        ] {
            let cli = crate::Cli::try_parse_from(args).expect("parses");
            assert_eq!(cli.cluster.namespace.as_deref(), Some("ml"), "{args:?}");
            assert_eq!(cli.cluster.context.as_deref(), Some("bare"), "{args:?}");
        }
        let cli = crate::Cli::try_parse_from([
            "kubectl-headroom",
            "plan",
            "-f",
            "job.yaml",
            "--kubeconfig",
            "/tmp/k",
        ])
        .expect("parses");
        assert_eq!(cli.cluster.kubeconfig, Some(PathBuf::from("/tmp/k")));
    }
}
