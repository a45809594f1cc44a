//! Numbers that depend on a seed alone, the same on every machine, rank
//! and retry: splitmix64 (Steele, Lea and Flood 2014) and standard
//! normals drawn from it.

/// The next value of a splitmix64 generator whose state is `state`.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` standard-normal values (Box-Muller on splitmix64 uniforms in (0, 1)).
pub fn standard_normal(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    let mut uniform = || ((splitmix64(&mut state) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    (0..n)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}
