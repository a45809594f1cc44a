//! Peer rendezvous: before the first step, a stage of a multi-stage plan
//! connects to its neighbouring stages and a replica of a data-parallel
//! plan to the other replicas of its stage. Where the peers are comes from
//! the environment (the operator's pod names, looked up through the worker
//! API with a DNS fallback, or fixed addresses for local runs); every link
//! proves the job's peer key ([`crate::link_auth`]).

use std::net::TcpListener;
use std::time::{Duration, Instant};

use headroom_api::{
    PIPELINE_ADDRESSES_ENV, PIPELINE_PODS_ENV, PIPELINE_PORT, REPLICA_ADDRESSES_ENV,
    REPLICA_PODS_ENV, REPLICA_PORT, WORKER_API_ENV,
};
use headroom_planner::Backend;

use crate::assignment::ValidAssignment;
use crate::collective::{Collective, CollectiveError, Ring, RingHello, RingTimeouts, Single};
use crate::env::{COLLECTIVE_ENV, CollectiveChoice, PeerSource, WorkerEnv};
use crate::exit::Exit;
use crate::link_auth::{KeyError, LinkKey};
use crate::pipeline::{Hello, Links, Peers, establish};
use crate::train::Trainer;
use crate::worker_api::WorkerApi;

/// Who connects: the plan and the environment of this worker.
pub(crate) struct Rendezvous<'a> {
    pub plan: &'a ValidAssignment,
    pub env: &'a WorkerEnv,
    /// For the pipeline's and the ring's neighbour lookup; `None`: DNS only.
    pub worker_api: Option<&'a WorkerApi>,
}

/// What the steps exchange through, connected once before training.
pub(crate) struct Connected {
    /// The neighbouring stages (none for a single-stage plan).
    pub links: Links,
    /// The other replicas of the stage ([`Single`] for one replica).
    pub replicas: Box<dyn Collective>,
}

impl Rendezvous<'_> {
    /// The neighbouring stages and the other replicas of the stage,
    /// connected: none of either for one stage of one replica.
    pub fn connect(&self, trainer: &Trainer) -> Result<Connected, Exit> {
        let mut connected = Connected {
            links: Links::default(),
            replicas: Box::new(Single),
        };
        // Resumed from the last step's checkpoint (a peer that was stopped
        // after the others had finished, and was started again): there is
        // nothing left to exchange, and the peers may be gone, so connect to
        // none of them and go straight to the output.
        if trainer.finished() {
            return Ok(connected);
        }
        if trainer.config.stages <= 1 && trainer.config.replicas <= 1 {
            return Ok(connected);
        }
        let key = self.peer_key()?;
        if trainer.config.stages > 1 {
            connected.links = self.connect_stages(trainer, &key)?;
        }
        if trainer.config.replicas > 1 {
            connected.replicas = self.connect_replicas(trainer, &key)?;
        }
        Ok(connected)
    }

    /// The job's peer key, which both ends of every pipeline and replica
    /// link prove to each other ([`crate::link_auth`]): without it anyone
    /// who knows the job's names could call a worker first and be taken
    /// for its neighbour. `HEADROOM_PEER_KEY` first, else the worker API.
    fn peer_key(&self) -> Result<LinkKey, Exit> {
        LinkKey::obtain(
            self.env.peer_key.as_ref(),
            self.worker_api,
            self.env.peer_timeout,
        )
        .map_err(|e| match e {
            KeyError::Missing => Exit::invalid_plan(e.to_string()),
            KeyError::Api(_) | KeyError::Malformed(_) | KeyError::Random(_) => {
                Exit::failed(e.to_string())
            }
        })
    }

    /// The links to the previous and the next stage.
    fn connect_stages(&self, trainer: &Trainer, key: &LinkKey) -> Result<Links, Exit> {
        let stages = trainer.config.stages;
        let (peers, listener) = self.pipeline_setup(stages)?;
        let a = self.plan.assignment();
        let me = Hello {
            job: a.job.clone(),
            namespace: a.namespace.clone(),
            attempt: a.attempt,
            stage: a.stage,
            stages,
            resume_step: trainer.step,
        };
        tracing::info!(stage = me.stage, stages, layers = ?trainer.config.layout.layers, "pipeline: connecting to the neighbouring stages");
        let timeout = self.env.peer_timeout;
        establish(&me, key, listener, &peers, timeout, timeout).map_err(|e| Exit::pipeline(&e))
    }

    /// The collective of the stage's replicas: their TCP ring, or what
    /// [`replica_collective`] forms over it.
    fn connect_replicas(
        &self,
        trainer: &Trainer,
        key: &LinkKey,
    ) -> Result<Box<dyn Collective>, Exit> {
        let replicas = trainer.config.replicas;
        let (addresses, listener) = self.ring_setup(replicas)?;
        let a = self.plan.assignment();
        let me = RingHello {
            job: a.job.clone(),
            namespace: a.namespace.clone(),
            attempt: a.attempt,
            stage: a.stage,
            replica: a.replica,
            replicas,
            resume_step: trainer.step,
        };
        tracing::info!(
            stage = me.stage,
            replica = me.replica,
            replicas,
            "replica ring: connecting to the other replicas of the stage"
        );
        let timeouts = RingTimeouts {
            rendezvous: self.env.peer_timeout,
            io: self.env.peer_timeout,
        };
        // Chunks of an eighth of a bucket: the ring's chunks in flight
        // are what the planner counts beside the bucket
        // (`sharding::collective_buffer_bytes`).
        let bucket = trainer.config.backend.profile().collective_bucket_bytes;
        let chunk = headroom_planner::sharding::ring_chunk_bytes(bucket);
        let collective = Ring::establish(&me, key, &addresses, listener, timeouts)
            .and_then(|mut ring| {
                ring.set_chunk_bytes(usize::try_from(chunk).unwrap_or(usize::MAX));
                let collective =
                    replica_collective(ring, trainer.config.backend, self.env.collective)?;
                trainer.check_replicas(collective.as_ref())?;
                Ok(collective)
            })
            .map_err(|e| Exit::replicas(&e))?;
        let shards = trainer.shards(replicas);
        tracing::info!(
            owned = shards.owned(me.replica).len(),
            tensors = shards.tensors.len(),
            loads = ?shards.loads(),
            "replica ring: connected; optimizer state sharded (elements per replica)"
        );
        Ok(collective)
    }

    /// How this stage reaches the others and the socket its predecessor
    /// calls (a multi-stage plan only).
    fn pipeline_setup(&self, stages: u32) -> Result<(Peers, Option<TcpListener>), Exit> {
        let a = self.plan.assignment();
        let (peers, port) = match &self.env.pipeline_peers {
            Some(PeerSource::Addresses(addresses)) => {
                let own = addresses.get(a.stage as usize).cloned().unwrap_or_default();
                let port = own
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok())
                    .ok_or_else(|| {
                        Exit::invalid_plan(format!(
                            "{PIPELINE_ADDRESSES_ENV}: stage {} needs a host:port entry, got {own:?}",
                            a.stage
                        ))
                    })?;
                (Peers::Static(addresses.clone()), port)
            }
            Some(PeerSource::Pods { pods, service }) => (
                Peers::Pods {
                    pods: pods.clone(),
                    dns: (0..pods.len() as u32)
                        .map(|k| format!("{}.{service}", host_name(k, a.replica, a.plan.replicas)))
                        .collect(),
                    port: PIPELINE_PORT,
                    api: self.worker_api.cloned(),
                },
                PIPELINE_PORT,
            ),
            None => {
                return Err(Exit::invalid_plan(format!(
                    "a {stages}-stage plan needs {PIPELINE_PODS_ENV} (set by the operator) or {PIPELINE_ADDRESSES_ENV}"
                )));
            }
        };
        let listener = if a.stage > 0 {
            Some(TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
                Exit::failed(format!("pipeline: cannot listen on port {port}: {e}"))
            })?)
        } else {
            None
        };
        Ok((peers, listener))
    }

    /// This replica's ring: one `host:port` per replica (the next one's
    /// resolved; the others are never called) and its listening socket, on
    /// which the previous replica calls.
    fn ring_setup(&self, replicas: u32) -> Result<(Vec<String>, TcpListener), Exit> {
        let a = self.plan.assignment();
        let next = (a.replica + 1) % replicas;
        let count = |n: usize, variable: &str| {
            if n == replicas as usize {
                Ok(())
            } else {
                Err(Exit::invalid_plan(format!(
                    "{variable}: {n} entries for a plan with {replicas} replicas"
                )))
            }
        };
        match &self.env.replica_peers {
            Some(PeerSource::Addresses(addresses)) => {
                count(addresses.len(), REPLICA_ADDRESSES_ENV)?;
                let own = &addresses[a.replica as usize];
                let port = own
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok())
                    .ok_or_else(|| {
                        Exit::invalid_plan(format!(
                            "{REPLICA_ADDRESSES_ENV}: replica {} needs a host:port entry, got {own:?}",
                            a.replica
                        ))
                    })?;
                Ok((addresses.clone(), self.replica_listener(port)?))
            }
            Some(PeerSource::Pods { pods, service }) => {
                count(pods.len(), REPLICA_PODS_ENV)?;
                // Listen first: the previous replica may be calling already.
                let listener = self.replica_listener(REPLICA_PORT)?;
                let dns = (!service.is_empty())
                    .then(|| format!("{}.{service}", host_name(a.stage, next, replicas)));
                let pod = &pods[next as usize];
                let address = self.replica_address(pod, dns, REPLICA_PORT, next)?;
                let mut addresses: Vec<String> =
                    pods.iter().map(|p| format!("{p}:{REPLICA_PORT}")).collect();
                addresses[next as usize] = address;
                Ok((addresses, listener))
            }
            None => Err(Exit::invalid_plan(format!(
                "a plan with {replicas} replicas needs {REPLICA_PODS_ENV} (set by the operator) or {REPLICA_ADDRESSES_ENV}"
            ))),
        }
    }

    /// The socket the previous replica of the ring calls.
    fn replica_listener(&self, port: u16) -> Result<TcpListener, Exit> {
        TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
            Exit::failed(format!(
                "data-parallel replicas: cannot listen on port {port}: {e}"
            ))
        })
    }

    /// Replica `replica`'s `ip:port`: its pod's IP from the worker API,
    /// asking until it has one or the peer timeout passes; `dns:port` when
    /// the worker API cannot be asked (there is none, or the call failed).
    fn replica_address(
        &self,
        pod: &str,
        dns: Option<String>,
        port: u16,
        replica: u32,
    ) -> Result<String, Exit> {
        let until = Instant::now() + self.env.peer_timeout;
        let mut pause = Duration::from_millis(250);
        loop {
            let asked = match self.worker_api {
                Some(api) => api.pod_ip(pod).map_err(|e| e.to_string()),
                None => Err(format!("no worker API ({WORKER_API_ENV} not set)")),
            };
            let last = match asked {
                Ok(Some(ip)) if ip.contains(':') => return Ok(format!("[{ip}]:{port}")),
                Ok(Some(ip)) => return Ok(format!("{ip}:{port}")),
                Ok(None) => "it has no IP yet".to_string(),
                Err(e) => match &dns {
                    Some(dns) => {
                        tracing::warn!(
                            pod,
                            "replica ring: cannot ask the worker API for the pod's IP ({e}); calling {dns}"
                        );
                        return Ok(format!("{dns}:{port}"));
                    }
                    None => e.to_string(),
                },
            };
            if Instant::now() >= until {
                return Err(Exit::replicas(&CollectiveError::PeerLost {
                    rank: replica,
                    detail: format!("pod {pod} not found in {:?}: {last}", self.env.peer_timeout),
                }));
            }
            std::thread::sleep(pause.min(until.saturating_duration_since(Instant::now())));
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }
}

/// What the replicas of a stage exchange through, once their TCP ring is up:
/// the ring itself on the CPU; on CUDA, NCCL formed over the ring unless
/// `HEADROOM_COLLECTIVE=ring` says otherwise or libnccl cannot be loaded
/// (then the ring, slower, with a warning). Every replica decides alike
/// (same binary, image and environment); one that does not finds out at the
/// first exchange (the ring's frames and NCCL's id do not match).
fn replica_collective(
    ring: Ring,
    backend: Backend,
    choice: CollectiveChoice,
) -> Result<Box<dyn Collective>, CollectiveError> {
    #[cfg(feature = "cuda")]
    if backend == Backend::Cuda {
        use crate::collective::nccl::{Nccl, available};
        match choice {
            CollectiveChoice::Ring => tracing::info!(
                "replica ring: {COLLECTIVE_ENV}=ring, the replicas exchange over TCP"
            ),
            CollectiveChoice::Auto => match available() {
                Ok(version) => {
                    tracing::info!(
                        nccl = version,
                        "replica ring: forming the NCCL communicator"
                    );
                    // Device 0: the one `training_device` trains on.
                    return Ok(Box::new(Nccl::over(ring, 0)?));
                }
                Err(missing) => tracing::warn!(
                    "replica ring: no NCCL ({missing}); the replicas exchange over TCP through \
                     host memory instead, slower ({COLLECTIVE_ENV}=ring chooses this quietly)"
                ),
            },
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (backend, choice, COLLECTIVE_ENV);
    Ok(Box::new(ring))
}

/// A worker's hostname under the job's headless Service, as the operator
/// sets it: `s<k>`, or `s<k>-r<r>` in a plan with replicas.
fn host_name(stage: u32, replica: u32, replicas: u32) -> String {
    if replicas > 1 {
        format!("s{stage}-r{replica}")
    } else {
        format!("s{stage}")
    }
}
