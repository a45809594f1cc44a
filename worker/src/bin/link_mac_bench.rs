//! Link frame MAC bench: how fast this CPU tags a link frame
//! ([`headroom_worker::link_mac::FrameMac`], ChaCha20-Poly1305's tag over
//! the payload), beside the other MACs already linked into the worker that
//! could do the same job: ring's AES-256-GCM tag (GMAC, the same
//! construction), ring's HMAC-SHA-256 and RustCrypto's HMAC-SHA-256; and a
//! copy of the payload, as the cost of one pass over it.
//!
//! Per payload size it prints the median over `--samples` samples (each at
//! least 50 ms of back-to-back tags) in MB/s (10^6 bytes per second).
//!
//! Usage (release build; debug figures are meaningless):
//!   cargo run --release -p headroom-worker --bin link_mac_bench -- [--samples N] [--sizes-kib 64,1024,16384]

use std::hint::black_box;
use std::time::{Duration, Instant};

use headroom_worker::link_mac::FrameMac;
use hmac::{Hmac, Mac};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use sha2::Sha256;

/// A 32-byte header, as a ring frame has.
const HEAD: [u8; 32] = [7; 32];
const KEY: [u8; 32] = [9; 32];
const MIN_SAMPLE: Duration = Duration::from_millis(50);

fn main() {
    let mut samples = 9usize;
    let mut sizes_kib = vec![64usize, 1024, 16384];
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_default();
        match flag.as_str() {
            "--samples" => samples = value.parse().expect("--samples N"),
            "--sizes-kib" => {
                sizes_kib = value
                    .split(',')
                    .map(|s| s.parse().expect("--sizes-kib 64,1024"))
                    .collect()
            }
            other => panic!("unknown flag {other}: --samples N, --sizes-kib 64,1024,16384"),
        }
    }
    println!("MB/s, median of {samples} samples (each at least {MIN_SAMPLE:?})");
    println!(
        "{:>10} {:>14} {:>14} {:>14} {:>14} {:>14}",
        "payload", "link Poly1305", "AES-GCM", "HMAC (ring)", "HMAC (sha2)", "copy"
    );
    for kib in sizes_kib {
        let payload: Vec<u8> = (0..kib * 1024).map(|i| (i * 31 % 251) as u8).collect();
        let mut link = FrameMac::new(&KEY);
        let poly = median(samples, payload.len(), || {
            black_box(link.tag(&HEAD, &payload).expect("tag"));
        });
        let aes = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &KEY).expect("key"));
        let mut sequence = 0u64;
        let gmac = median(samples, payload.len(), || {
            let mut nonce = [0u8; NONCE_LEN];
            nonce[4..].copy_from_slice(&sequence.to_be_bytes());
            sequence += 1;
            let mut head = HEAD;
            let tag = aes
                .seal_in_place_separate_tag(
                    Nonce::assume_unique_for_key(nonce),
                    Aad::from(&payload[..]),
                    &mut head,
                )
                .expect("tag");
            let _ = black_box(tag);
        });
        let ring_key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &KEY);
        let ring_hmac = median(samples, payload.len(), || {
            let mut context = ring::hmac::Context::with_key(&ring_key);
            context.update(&HEAD);
            context.update(&payload);
            let _ = black_box(context.sign());
        });
        let sha2_hmac = median(samples, payload.len(), || {
            let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&KEY).expect("key");
            mac.update(&HEAD);
            mac.update(&payload);
            black_box(mac.finalize());
        });
        let mut copy = vec![0u8; payload.len()];
        let copied = median(samples, payload.len(), || {
            copy.copy_from_slice(black_box(&payload));
            black_box(&copy);
        });
        println!(
            "{:>7} KiB {poly:>14.0} {gmac:>14.0} {ring_hmac:>14.0} {sha2_hmac:>14.0} {copied:>14.0}",
            kib
        );
    }
}

/// The median rate of `run` over `samples` samples, MB/s of `bytes` each call.
fn median(samples: usize, bytes: usize, mut run: impl FnMut()) -> f64 {
    run(); // warm-up
    let mut rates: Vec<f64> = (0..samples.max(1))
        .map(|_| {
            let started = Instant::now();
            let mut calls = 0u64;
            while started.elapsed() < MIN_SAMPLE {
                run();
                calls += 1;
            }
            (calls as f64 * bytes as f64) / started.elapsed().as_secs_f64() / 1e6
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}
