//! `headroom-worker`: trains one stage of a Headroom plan (or, with
//! `HEADROOM_INITIALIZE`, fetches and checks a job's checkpoint and data). Everything it
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
        // Colour only for a person at a terminal: the kubelet's logs and the
        // termination-message fallback would keep the escape codes verbatim.
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        )
        .init();
    if let Err(e) = headroom_ffi::configure_from_env() {
        tracing::error!("{e}");
        std::process::exit(headroom_api::WorkerOutcome::InvalidPlan.exit_code());
    }
    // `HEADROOM_INITIALIZE` makes this process the job's initializer, not a trainer.
    if let Some(env) = headroom_worker::initialize::InitializerEnv::from_env() {
        let code = match headroom_worker::initialize::run(&env) {
            Ok(_) => headroom_api::WorkerOutcome::Succeeded.exit_code(),
            Err(exit) => exit.code(),
        };
        std::process::exit(code);
    }
    let exit = headroom_worker::run::run(headroom_worker::WorkerEnv::from_env());
    std::process::exit(exit.code());
}
