//! `headroom-worker`: trains one stage of a Headroom plan. Everything it
//! reads comes from the environment the operator sets up (see
//! `headroom_api::contract`), read once into a `WorkerEnv`; its exit code and termination message are the
//! contract's. The logic lives in the library (`headroom_worker::run`).

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let exit = headroom_worker::run::run(headroom_worker::WorkerEnv::from_env());
    std::process::exit(exit.code());
}
