//! All-reduce bench: the TCP ring ([`headroom_worker::collective::Ring`]) on
//! loopback, d = 2 and 4 replicas, buffers of 4, 64 and 256 MiB of f32.
//!
//! Each replica is its own process by default (the bench re-runs itself with
//! `--child`), as replicas are pods in production: the child binds a
//! loopback port, prints it, reads every replica's address from its stdin,
//! joins the ring and times `all_reduce_sum` on its buffer. `--threads` runs
//! the replicas as threads of this process instead.
//!
//! Per case it prints the median over `--reps` repetitions (default 5,
//! after one warm-up) of the slowest replica's time, and the bus bandwidth
//! 2(d − 1)/d × bytes / time: the bytes each replica sends and receives,
//! so the figure is comparable across d (NCCL's `busbw`). Every repetition
//! starts after a one-value all-reduce as a barrier, and the last result is
//! checked exactly (integer values, d a power of two).
//!
//! On loopback the replicas share the machine's cores: the figures bound
//! the ring's own cost (copies, additions, syscalls), not a network's.
//!
//! `--late-ms N` makes replica 0 reach every timed call N ms after the
//! others (times then include the wait): the peak RSS line then shows how
//! much the others' frames queued in its reader add to its memory.
//!
//! Usage (release build; debug figures are meaningless):
//!   cargo run --release -p headroom-worker --bin allreduce_bench -- [--reps N] [--sizes 4,64,256] [--ranks 2,4] [--threads] [--chunk-mib M] [--late-ms N]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use headroom_api::PEER_KEY_ENV;
use headroom_worker::collective::{Collective, DEFAULT_CHUNK_BYTES, Ring, RingHello, RingTimeouts};
use headroom_worker::link_auth::LinkKey;

const MIB: usize = 1 << 20;

#[derive(Clone, Debug)]
struct Options {
    reps: usize,
    sizes_mib: Vec<usize>,
    ranks: Vec<u32>,
    threads: bool,
    chunk_bytes: Option<usize>,
    /// Replica 0 reaches every timed all-reduce this late (ms): the others'
    /// frames queue up in its reader meanwhile, which the peak RSS shows.
    late_ms: u64,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if args.first().map(String::as_str) == Some("--child") {
        child(&args[1..])
    } else {
        parse(&args).and_then(|o| parent(&o))
    };
    if let Err(e) = result {
        eprintln!("allreduce_bench: {e}");
        std::process::exit(1);
    }
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        reps: 5,
        sizes_mib: vec![4, 64, 256],
        ranks: vec![2, 4],
        threads: false,
        chunk_bytes: None,
        late_ms: 0,
    };
    let list = |v: &str| -> Result<Vec<usize>, String> {
        v.split(',')
            .map(|x| x.trim().parse().map_err(|e| format!("{x}: {e}")))
            .collect()
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--reps" => o.reps = value()?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--sizes" => o.sizes_mib = list(&value()?)?,
            "--ranks" => {
                o.ranks = list(&value()?)?.into_iter().map(|d| d as u32).collect();
            }
            "--threads" => o.threads = true,
            "--chunk-mib" => {
                let mib: f64 = value()?.parse().map_err(|e| format!("--chunk-mib: {e}"))?;
                o.chunk_bytes = Some((mib * MIB as f64) as usize);
            }
            "--late-ms" => o.late_ms = value()?.parse().map_err(|e| format!("--late-ms: {e}"))?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if o.reps == 0 {
        return Err("--reps: at least 1".into());
    }
    if o.ranks.iter().any(|d| !d.is_power_of_two()) {
        return Err("--ranks: powers of two only (the exact check needs them)".into());
    }
    Ok(o)
}

/// One replica's timings (seconds) per buffer size.
type Timings = Vec<Vec<f64>>;

fn parent(o: &Options) -> Result<(), String> {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let chunk = o.chunk_bytes.unwrap_or(DEFAULT_CHUNK_BYTES);
    println!(
        "ring all-reduce on loopback: {} per replica, {cores} cores, {:.2} MiB chunks, median of {} reps (slowest replica each)",
        if o.threads { "a thread" } else { "a process" },
        chunk as f64 / MIB as f64,
        o.reps
    );
    println!(
        "{:>2} {:>9} {:>12} {:>12} {:>12} {:>14}",
        "d", "MiB", "median ms", "min ms", "max ms", "busbw GB/s"
    );
    for &d in &o.ranks {
        let (per_rank, peak) = if o.threads {
            (threads(d, o)?, None)
        } else {
            processes(d, o)?
        };
        for (i, &mib) in o.sizes_mib.iter().enumerate() {
            let mut slowest: Vec<f64> = (0..o.reps)
                .map(|rep| per_rank.iter().map(|t| t[i][rep]).fold(0.0, f64::max))
                .collect();
            slowest.sort_by(f64::total_cmp);
            let median = slowest[slowest.len() / 2];
            let bytes = (mib * MIB) as f64;
            let busbw = 2.0 * f64::from(d - 1) / f64::from(d) * bytes / median / 1e9;
            println!(
                "{d:>2} {mib:>9} {:>12.1} {:>12.1} {:>12.1} {busbw:>14.2}",
                median * 1e3,
                slowest[0] * 1e3,
                slowest[slowest.len() - 1] * 1e3
            );
        }
        if let Some(peak) = peak {
            let largest = o.sizes_mib.iter().max().copied().unwrap_or(0) * MIB;
            println!(
                "   (d = {d}: the largest peak RSS of a replica was {:.0} MiB, {:.0} MiB above its largest buffer)",
                peak as f64 / MIB as f64,
                (peak as f64 - largest as f64) / MIB as f64
            );
        }
    }
    Ok(())
}

fn threads(d: u32, o: &Options) -> Result<Vec<Timings>, String> {
    let rings = Ring::loopback(d, RingTimeouts::default()).map_err(|e| e.to_string())?;
    let running: Vec<_> = rings
        .into_iter()
        .map(|ring| {
            let o = o.clone();
            std::thread::spawn(move || measure(ring, &o))
        })
        .collect();
    running
        .into_iter()
        .map(|h| h.join().map_err(|_| "a replica panicked".to_string())?)
        .collect()
}

/// Every replica's timings, and the largest peak RSS (bytes) among them.
fn processes(d: u32, o: &Options) -> Result<(Vec<Timings>, Option<u64>), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let sizes = o
        .sizes_mib
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    // The replicas prove this run's key to each other, as a job's do.
    let key = LinkKey::random().map_err(|e| e.to_string())?.to_hex();
    let mut children = Vec::new();
    for r in 0..d {
        let mut cmd = Command::new(&exe);
        cmd.args(["--child", &r.to_string(), &d.to_string(), &sizes])
            .arg(o.reps.to_string())
            .arg(o.chunk_bytes.unwrap_or(0).to_string())
            .arg(o.late_ms.to_string())
            .env(PEER_KEY_ENV, &key)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        children.push(
            cmd.spawn()
                .map_err(|e| format!("starting replica {r}: {e}"))?,
        );
    }
    let mut outputs = Vec::new();
    let mut addresses = Vec::new();
    for (r, child) in children.iter_mut().enumerate() {
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let first = lines
            .next()
            .ok_or(format!("replica {r} exited before binding"))?
            .map_err(|e| e.to_string())?;
        addresses.push(
            first
                .strip_prefix("listening ")
                .ok_or(format!("replica {r} said {first:?}"))?
                .to_string(),
        );
        outputs.push(lines);
    }
    let line = addresses.join(",") + "\n";
    for child in &mut children {
        let mut stdin = child.stdin.take().ok_or("no stdin")?;
        stdin
            .write_all(line.as_bytes())
            .map_err(|e| e.to_string())?;
    }
    let mut per_rank = Vec::new();
    let mut peaks = Vec::new();
    for (r, lines) in outputs.into_iter().enumerate() {
        let mut timings = Vec::new();
        for line in lines {
            let line = line.map_err(|e| e.to_string())?;
            if let Some(peak) = line.strip_prefix("peak ") {
                peaks.push(peak.parse::<u64>().map_err(|e| format!("{peak}: {e}"))?);
            } else if let Some(times) = line.strip_prefix("times ") {
                timings.push(
                    times
                        .split(' ')
                        .map(|t| t.parse::<f64>().map_err(|e| format!("{t}: {e}")))
                        .collect::<Result<Vec<_>, _>>()?,
                );
            }
        }
        if timings.len() != o.sizes_mib.len() {
            return Err(format!(
                "replica {r} reported {} of {} sizes",
                timings.len(),
                o.sizes_mib.len()
            ));
        }
        per_rank.push(timings);
    }
    for (r, mut child) in children.into_iter().enumerate() {
        let status = child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("replica {r}: {status}"));
        }
    }
    Ok((per_rank, peaks.into_iter().max()))
}

/// `--child RANK D SIZES REPS CHUNK_BYTES LATE_MS`: one replica in its own process.
fn child(args: &[String]) -> Result<(), String> {
    let [rank, d, sizes, reps, chunk, late] = args else {
        return Err(format!("--child takes 6 arguments, got {args:?}"));
    };
    let num = |s: &str| s.parse::<usize>().map_err(|e| format!("{s}: {e}"));
    let chunk_bytes = num(chunk)?;
    let o = Options {
        reps: num(reps)?,
        sizes_mib: sizes.split(',').map(num).collect::<Result<_, _>>()?,
        ranks: vec![],
        threads: false,
        chunk_bytes: (chunk_bytes > 0).then_some(chunk_bytes),
        late_ms: num(late)? as u64,
    };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    println!("listening {address}");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    let addresses: Vec<String> = line.trim().split(',').map(str::to_string).collect();
    let hello = RingHello {
        job: "allreduce-bench".into(),
        namespace: "local".into(),
        attempt: 0,
        stage: 0,
        replica: num(rank)? as u32,
        replicas: num(d)? as u32,
        resume_step: 0,
    };
    let key = std::env::var(PEER_KEY_ENV)
        .map_err(|_| format!("{PEER_KEY_ENV} not set"))
        .and_then(|hex| LinkKey::from_hex(&hex).map_err(|e| format!("{PEER_KEY_ENV}: {e}")))?;
    let ring = Ring::establish(&hello, &key, &addresses, listener, RingTimeouts::default())
        .map_err(|e| e.to_string())?;
    for times in measure(ring, &o)? {
        let times: Vec<String> = times.iter().map(f64::to_string).collect();
        println!("times {}", times.join(" "));
    }
    println!("peak {}", peak_rss_bytes()?);
    Ok(())
}

/// The process's peak resident set (VmHWM), bytes.
fn peak_rss_bytes() -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| "no VmHWM in /proc/self/status".to_string())
}

/// Times `o.reps` all-reduces per size on one replica.
fn measure(mut ring: Ring, o: &Options) -> Result<Timings, String> {
    if let Some(bytes) = o.chunk_bytes {
        ring.set_chunk_bytes(bytes);
    }
    let d = ring.size() as f32;
    let mut barrier = [0f32];
    let mut all = Vec::new();
    for &mib in &o.sizes_mib {
        let mut data = vec![(ring.rank() + 1) as f32; mib * MIB / 4];
        // Warm-up: faults the buffer in and fills the chunk pools.
        ring.all_reduce_sum(&mut data).map_err(|e| e.to_string())?;
        let mut want = d * (d + 1.0) / 2.0;
        let mut times = Vec::with_capacity(o.reps);
        for _ in 0..o.reps {
            ring.all_reduce_sum(&mut barrier)
                .map_err(|e| e.to_string())?;
            if ring.rank() == 0 && o.late_ms > 0 {
                std::thread::sleep(Duration::from_millis(o.late_ms));
            }
            let start = Instant::now();
            ring.all_reduce_sum(&mut data).map_err(|e| e.to_string())?;
            times.push(start.elapsed().as_secs_f64());
            want *= d;
        }
        if let Some(i) = data.iter().position(|&v| v != want) {
            return Err(format!(
                "replica {}: element {i} is {}, expected {want}",
                ring.rank(),
                data[i]
            ));
        }
        all.push(times);
    }
    Ok(all)
}
