//! Plan a ~70e9-parameter transformer over 1,000 nodes of 6 GPU types.
//! Target: median under 1 ms. Run: `make bench-planner`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use headroom_planner::{Inventory, plan};

#[path = "../tests/common.rs"]
mod common;

fn bench(c: &mut Criterion) {
    let nodes = common::six_type_cluster(1000);
    let job = common::gpu_job(common::model_70b(), 1024, 64);
    let inventory = Inventory::from_nodes(&nodes);
    let planned = plan(&job, &inventory).expect("70B plan");
    eprintln!(
        "plan: {} × {} ({}), micro-batch {} × {}",
        planned.workers,
        planned.device,
        planned.fit,
        planned.settings.micro_batch,
        planned.settings.gradient_accumulation
    );

    c.bench_function("inventory_1000_nodes_plus_plan_70b", |b| {
        b.iter(|| {
            let inventory = Inventory::from_nodes(black_box(&nodes));
            plan(black_box(&job), &inventory)
        })
    });
    c.bench_function("plan_70b_6_types", |b| {
        b.iter(|| plan(black_box(&job), black_box(&inventory)))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
