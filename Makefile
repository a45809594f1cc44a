# Headroom — run `make help` for the targets.
#
# Caches live outside the clone so fresh clones (and CI) reuse them:
#   CARGO_TARGET_DIR  Rust build output   (default ~/.cache/headroom/target)
#   HEADROOM_CACHE    Kubernetes/etcd binaries, control-plane state (~/.cache/headroom)

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

export HEADROOM_CACHE ?= $(HOME)/.cache/headroom
export CARGO_TARGET_DIR ?= $(HEADROOM_CACHE)/target
CARGO ?= cargo
CLUSTER := e2e/cluster
KUBECONFIG_TEST := $(HEADROOM_CACHE)/state/controlplane/kubeconfig
KUBECTL_BIN = $$(source $(CLUSTER)/lib/common.sh && echo "$$HEADROOM_BIN_DIR")/kubectl

##@ General
.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make <target>\n"} /^[a-zA-Z0-9_-]+:.*?##/ { printf "  %-18s %s\n", $$1, $$2 } /^##@/ { printf "\n%s\n", substr($$0, 5) }' $(MAKEFILE_LIST)

##@ Development
.PHONY: build fmt fmt-check lint manifests
build: ## Build every crate and binary.
	$(CARGO) build --workspace --all-targets

fmt: ## Format the Rust code.
	$(CARGO) fmt --all

fmt-check: ## Fail if the Rust code is not formatted.
	$(CARGO) fmt --all -- --check

lint: ## Clippy with warnings as errors.
	$(CARGO) clippy --workspace --all-targets -- -D warnings

manifests: ## Regenerate crds/ (the CRD, the policy with its spec rules) and the chart's copies from the Rust types.
	$(CARGO) run -q -p headroom-operator --bin crdgen > crds/memoryawaretrainingjobs.headroom.dev.yaml
	$(CARGO) run -q -p headroom-operator --bin crdgen -- spec-rules-policy > crds/memoryawaretrainingjobs.headroom.dev-spec-rules.yaml
	cp crds/memoryawaretrainingjobs.headroom.dev.yaml charts/headroom/crds/
	cp crds/memoryawaretrainingjobs.headroom.dev-spec-rules.yaml charts/headroom/files/spec-rules-policy.yaml

##@ Test
.PHONY: test test-unit test-apiserver chart-check bench-planner bench-controller bench-peers calibrate-worker bench-load-peak
test: fmt-check lint test-unit test-apiserver chart-check ## Everything CI runs: format, clippy, unit, property, CLI and real-API-server tests.

# --no-fail-fast: every test binary runs after a failure, so one run shows every failure.
test-unit: ## Unit, property, CRD-drift and plugin tests (no cluster needed).
	$(CARGO) test --workspace --all-targets --no-fail-fast

test-apiserver: controlplane-up ## CRD, samples, invalid-manifest corpus and the controller against a real kube-apiserver.
	# Kueue's CRDs (no Kueue controller on this control plane): the queued-job tests create its objects.
	KUBECONFIG=$(KUBECONFIG_TEST) e2e/kueue/kueue.sh crds
	# --workspace --tests: the same feature resolution as test-unit, so nothing is rebuilt.
	# The two spread measurements of the PyTorch-curve tests are not tests:
	# they print the figures their bounds were derived from (minutes of training).
	KUBECONFIG=$(KUBECONFIG_TEST) $(CARGO) test --workspace --exclude headroom-e2e --tests --no-fail-fast -- --ignored --test-threads=1 --skip headroom_spread --skip headroom_bf16_spread

chart-check: controlplane-up ## helm lint + template of charts/headroom, security checks, server-side dry run.
	KUBECONFIG=$(KUBECONFIG_TEST) e2e/chart-check.sh

bench-planner: ## Criterion benchmark: plan a 70B model over 1,000 nodes of 6 GPU types.
	$(CARGO) bench -p headroom-planner --bench plan_70b

calibrate-worker: ## Planner-vs-measured peak memory of real CPU workers: GPT, Llama, LoRA/QLoRA, 8-bit AdamW, pipelines (release, ~20 min); telemetry overhead.
	$(CARGO) run --release -q -p headroom-worker --bin calibrate

bench-load-peak: ## Load peak per pipeline stage of a 156M-parameter Llama checkpoint (bf16, f32, sharded) against the planner's training peak (release, ~1 min).
	$(CARGO) run --release -q -p headroom-worker --bin load_peak

.PHONY: bench-adamw8bit
bench-adamw8bit: ## 8-bit vs f32 AdamW on the tiny Llama: moment bytes, record bytes, update and step medians (release, ~10 s).
	$(CARGO) run --release -q -p headroom-worker --bin adamw8bit

# PyTorch's side of the loss-curve comparison (tests/recipe_reference.rs), pinned: the torch
# wheel pulls CUDA libraries (~5 GB), so it is cached once and never part of make test or CI.
RECIPE_PINS := torch==2.15.0 transformers==5.23.0 peft==0.21.2 accelerate==1.15.0 safetensors==0.8.0 numpy==2.4.6
RECIPE_VENV ?= $(HEADROOM_CACHE)/tools/recipe-reference-torch2.15.0-transformers5.23.0-peft0.21.2

.PHONY: recipe-reference
recipe-reference: ## PyTorch's loss curves of the recipe reference job (transformers.Trainer + PEFT, fp32 and bf16, CPU) into worker/tests/fixtures/recipe/ (a pinned venv in ~/.cache/headroom/tools; ~4 min after the install; not in CI).
	test -x $(RECIPE_VENV)/bin/python || python3 -m venv $(RECIPE_VENV)
	test -f $(RECIPE_VENV)/.installed || { $(RECIPE_VENV)/bin/pip install --no-cache-dir $(RECIPE_PINS) && touch $(RECIPE_VENV)/.installed; }
	$(RECIPE_VENV)/bin/python worker/tests/fixtures/recipe/generate.py

# The LoRA-step A/B (docs/benchmarks.md, "A LoRA step against PyTorch"): the same job in
# Headroom's trainer and in PyTorch + transformers + PEFT, one thread each, pinned to one
# core; then perf's top symbols of Headroom's full and LoRA steps. Quiet machine wanted.
BENCH_STEP_THREADS ?= 1
BENCH_STEP_STEPS ?= 6
# As in a worker pod: its allocator settings (headroom_api::WORKER_MALLOC_TUNABLES / _ARENAS).
BENCH_STEP_ENV = RAYON_NUM_THREADS=$(BENCH_STEP_THREADS) MALLOC_ARENA_MAX=1 GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=8388608
.PHONY: bench-lora-step
bench-lora-step: ## Median step, its phases and tokens/s of a full, LoRA r16 and QLoRA step of a 135M Llama: Headroom vs PyTorch + PEFT, one thread each (release; ~15 min; not in CI).
	test -x $(RECIPE_VENV)/bin/python || python3 -m venv $(RECIPE_VENV)
	test -f $(RECIPE_VENV)/.installed || { $(RECIPE_VENV)/bin/pip install --no-cache-dir $(RECIPE_PINS) && touch $(RECIPE_VENV)/.installed; }
	$(CARGO) build --release -q -p headroom-worker --bin calibrate
	$(BENCH_STEP_ENV) taskset -c 0 $(CARGO_TARGET_DIR)/release/calibrate --step-breakdown --steps $(BENCH_STEP_STEPS)
	OMP_NUM_THREADS=$(BENCH_STEP_THREADS) taskset -c 0 $(RECIPE_VENV)/bin/python -W ignore worker/bench/pytorch_step.py --threads $(BENCH_STEP_THREADS) --steps $(BENCH_STEP_STEPS)
	@if command -v perf >/dev/null; then for c in full lora; do \
	  $(BENCH_STEP_ENV) perf record -q -F 499 -o $(HEADROOM_CACHE)/bench/lora-step/perf-$$c.data -- \
	    taskset -c 0 $(CARGO_TARGET_DIR)/release/calibrate --step-breakdown --steps 2 --only "$$c\$$" >/dev/null 2>&1 && \
	  echo "top symbols, $$c step:" && perf report -q -i $(HEADROOM_CACHE)/bench/lora-step/perf-$$c.data --no-children --sort symbol --stdio 2>/dev/null | sed -n 1,15p | cut -c1-110; done; fi

.PHONY: bench-first-fit
bench-first-fit: ## 24+ CPU jobs of varied shapes and limits (half planned above 95 % of their budget) run by the operator on the local cluster: first-attempt success, attempts, measured peak / budget (root; ~30 min; not in CI).
	e2e/bench-first-fit.sh $(BENCH_FIRST_FIT_FLAGS)

bench-controller: controlplane-up ## 500 jobs through the operator on the local API server: latencies and peak RSS.
	$(CARGO) build --release -q -p headroom-operator --bins
	KUBECONFIG=$(KUBECONFIG_TEST) $(CARGO_TARGET_DIR)/release/bench-controller --jobs 500 --failures 100

.PHONY: bench-object
bench-object: controlplane-up ## kube-apiserver CPU per create / status write / telemetry write and stored size of one job object, before vs lean with the rules in the CRD vs lean as shipped (rules in their ValidatingAdmissionPolicy) vs Kubeflow's PyTorchJob, with CPU profiles (~6 min; not in CI).
	$(CARGO) build --release -q -p headroom-operator --bin bench-object
	mkdir -p $(HEADROOM_CACHE)/bench-object
	KUBECONFIG=$(KUBECONFIG_TEST) $(CARGO_TARGET_DIR)/release/bench-object $(BENCH_OBJECT_FLAGS) \
	  --pytorchjob-crd "$$(go mod download -json github.com/kubeflow/training-operator@v1.9.3 | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p')/manifests/base/crds/kubeflow.org_pytorchjobs.yaml" \
	  --profile-dir $(HEADROOM_CACHE)/bench-object

bench-peers: k8s-binaries ## Headroom vs Kubeflow training-operator v1.9.3 (built from its Go module, tuned: 16 threads, QPS raised) on the local API server, one neutral harness, 3 interleaved rounds of 500 jobs (~10 min; not in CI).
	e2e/peers/bench-peers.sh $(BENCH_PEERS_FLAGS)

##@ Local control plane (real etcd + kube-apiserver on loopback)
.PHONY: k8s-binaries controlplane-up controlplane-down
k8s-binaries: ## Build kube-apiserver, kubectl and etcd from their Go modules (cached).
	$(CLUSTER)/build-binaries.sh

controlplane-up: k8s-binaries ## Start etcd + kube-apiserver (idempotent); KUBECONFIG in ~/.cache/headroom.
	$(CLUSTER)/controlplane.sh up

controlplane-down: ## Stop the control plane.
	$(CLUSTER)/controlplane.sh down

.PHONY: kueue
kueue: ## Kueue built from its Go module and installed with its Helm chart on the cluster in KUBECONFIG (the local single-node one by default; make e2e does this).
	KUBECONFIG=$${KUBECONFIG:-$(HEADROOM_CACHE)/state/cluster/kubeconfig} e2e/kueue/kueue.sh install

##@ Try it
.PHONY: plan-samples demo e2e e2e-kind release-bins
plan-samples: ## Print Headroom's plan for every sample job (offline).
	set -e; for f in samples/cpu-*.yaml; do \
	  case $$f in *finetune*) model="--model-dir worker/tests/fixtures/llama/tiny-llama";; *) model="";; esac; \
	  $(CARGO) run -q -p headroom-operator --bin kubectl-headroom -- plan -f $$f $$model; done
	$(CARGO) run -q -p headroom-operator --bin kubectl-headroom -- plan -f samples/gpu-gpt2-medium.yaml --nodes samples/nodes-gfd.yaml
	$(CARGO) run -q -p headroom-operator --bin kubectl-headroom -- plan -f samples/gpu-finetune-llama-3.2-1b.yaml --nodes samples/nodes-gfd.yaml --model-dir samples/models/llama-3.2-1b
	$(CARGO) run -q -p headroom-operator --bin kubectl-headroom -- plan -f samples/gpu-finetune-llama-2-7b.yaml --nodes samples/nodes-gfd.yaml --model-dir samples/models/llama-2-7b
	$(CARGO) run -q -p headroom-operator --bin kubectl-headroom -- plan -f samples/gpu-lora-llama-2-7b.yaml --nodes samples/nodes-gfd.yaml --model-dir samples/models/llama-2-7b
	$(CARGO) run -q -p headroom-operator --bin kubectl-headroom -- plan -f samples/gpu-qlora-phi-4-mini.yaml --nodes samples/nodes-gfd.yaml --model-dir samples/models/phi-4-mini-instruct
	$(CARGO) run -q -p headroom-operator --bin kubectl-headroom -- plan -f samples/gpu-qlora-qwen3-8b.yaml --nodes samples/nodes-gfd.yaml --model-dir samples/models/qwen3-8b
	$(CARGO) run -q -p headroom-operator --bin kubectl-headroom -- plan -f samples/gpu-lora-gemma-3-1b.yaml --nodes samples/nodes-gfd.yaml --model-dir samples/models/gemma-3-1b

demo: ## On the local single-node cluster: a job is OOM-killed on attempt 1 and succeeds on attempt 2 (needs root).
	e2e/demo.sh

e2e: ## The end-to-end suite on real pods (local single-node cluster unless KUBECONFIG is set, stopped again if it started it; root).
	e2e/e2e.sh

# E2E_KIND_TESTS: cargo test name filters (any matches); empty runs the whole suite.
E2E_KIND_TESTS ?=
e2e-kind: ## The same suite on a 3-node kind cluster, plus the several-node scenarios: Docker and kind, or (root, no daemon) both from local parts (e2e/kind/README.md); Helm, suite, cluster deleted. E2E_KIND_TESTS="f1 f2" runs a subset.
	e2e/kind.sh $(E2E_KIND_TESTS)

# The release binaries the images carry, exactly as e2e/install.sh and
# e2e/kind.sh build them (the same packages, so the same feature resolution
# and the same artifacts): CI starts this in the background while the tests run.
release-bins: ## The release operator, kubectl plugin and worker that make e2e, e2e-kind and demo package.
	$(CARGO) build --release -q -p headroom-operator --bin headroom-operator --bin kubectl-headroom -p headroom-worker --bin headroom-worker

.PHONY: kind-base-image
kind-base-image: ## kind's base image built here (debootstrap, Debian's containerd/runc/CNI, kind's files), under a private dockerd, then checked as a node (root; e2e/kind/README.md).
	e2e/kind/dockerd.sh up
	export $$(e2e/kind/dockerd.sh env) && image=$$(e2e/kind/base-image.sh) && e2e/kind/check-base-image.sh $$image

##@ Local single-node cluster (real pods: containerd + kubelet; run as root)
.PHONY: cluster-up cluster-down cluster-status cluster-test worker-cuda worker-cuda-check worker-wgpu-check worker-wgpu-test worker-wgpu-f16-test wgpu-check cuda-runtime image-cuda gpu-bundle gpu-check images
KUBECONFIG_CLUSTER := $(HEADROOM_CACHE)/state/cluster/kubeconfig
IMAGE_TAG ?= dev

cluster-up: ## Start the single-node cluster (installs apt packages, builds missing binaries; idempotent).
	$(CLUSTER)/cluster.sh up
	@$(CLUSTER)/cluster.sh env

cluster-down: ## Stop the cluster: pods through the CRI, then every component by PID (state kept).
	$(CLUSTER)/cluster.sh down

cluster-status: ## Exit 0 only if every component is ready and the node is Ready.
	$(CLUSTER)/cluster.sh status

cluster-test: cluster-up ## On the real node: OOM kill (137), Succeeded, API via the kubernetes Service, PVC.
	$(CLUSTER)/node-test.sh

LLVM_SHIM_HOME ?= /opt/headroom/llvm-shim

# CUDA 12.8 driver-API bindings (cudarc's default without nvcc is 13, which needs an R580+ driver).
CUDARC_CUDA_VERSION ?= 12080
CUDA_DIR := $(CARGO_TARGET_DIR)/cuda
CUDA_RUNTIME := $(HEADROOM_CACHE)/cuda-runtime/cuda-12.8
GPU_BUNDLE := gpu-bundle

worker-cuda: ## The CUDA worker and calibrate binaries, offline, in ~/.cache/headroom/target/cuda/: Debian's LLVM 22 stands in for the LLVM 23 bundle cubecl downloads (docs/gpu.md; release, ~15 min on 2 cores).
	HEADROOM_LLVM_SHIM_HOME=$(LLVM_SHIM_HOME) bash worker/cuda/install-build-deps.sh
	XDG_DATA_HOME=$(LLVM_SHIM_HOME) CUDARC_CUDA_VERSION=$(CUDARC_CUDA_VERSION) \
	  $(CARGO) build --release -p headroom-worker --features cuda --bin headroom-worker --bin calibrate
	# Their own directory: the CPU build writes release/headroom-worker and release/calibrate too.
	# Debug info stripped (line tables of a statically linked LLVM: ~600 MB); symbols kept for backtraces.
	mkdir -p $(CUDA_DIR)
	for b in headroom-worker calibrate; do \
	  objcopy --strip-debug $(CARGO_TARGET_DIR)/release/$$b $(CUDA_DIR)/$$b.tmp && mv -f $(CUDA_DIR)/$$b.tmp $(CUDA_DIR)/$$b; done
	ls -la $(CUDA_DIR)
	# They start: the worker refuses to run without a plan (exit 78); without a GPU, calibrate --backend cuda says so (exit 2).
	rc=0; $(CUDA_DIR)/headroom-worker 2>/dev/null || rc=$$?; test $$rc = 78 || { echo "CUDA worker without a plan exited $$rc, expected 78" >&2; exit 1; }
	if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then rc=0; out=$$($(CUDA_DIR)/calibrate --backend cuda 2>&1) || rc=$$?; \
	  test $$rc = 2 && grep -q "NVML did not start" <<<"$$out" || { echo "calibrate --backend cuda without a GPU: exit $$rc: $$out" >&2; exit 1; }; fi

# What CI builds of the GPU path: the type and borrow check plus clippy of the
# worker with the cuda feature (about 4 min cold), not the 25-minute release
# link of make worker-cuda, whose binary nothing here can run (no GPU).
worker-cuda-check: ## Clippy (check, no codegen) of the worker, its tests and tools with the cuda feature, offline (what CI builds of the GPU path).
	HEADROOM_LLVM_SHIM_HOME=$(LLVM_SHIM_HOME) bash worker/cuda/install-build-deps.sh
	XDG_DATA_HOME=$(LLVM_SHIM_HOME) CUDARC_CUDA_VERSION=$(CUDARC_CUDA_VERSION) \
	  $(CARGO) clippy -p headroom-worker --features cuda --all-targets -- -D warnings

# The GPU path run without a GPU: burn's wgpu backend (the same cubecl
# runtime as CUDA: fusion, autotune, the memory pools, the lean ops' Cube
# code) on Mesa's lavapipe, a Vulkan device on the CPU (docs/gpu.md). Its own
# target directory: the wgpu feature changes burn's features, and sharing
# the CPU build's directory would rebuild burn for both. A debug build:
# 6 min cold on 2 quiet cores, where optimized dependencies took 40 min
# (and halved a warm row's time: 23 s against 46 s); a release build ~25 min.
WGPU_DIR := $(CARGO_TARGET_DIR)/wgpu
# Only lavapipe's driver is loaded: the same device on every machine. Mesa 25
# names its ICD lvp_icd.json, older Mesa lvp_icd.<arch>.json; the shell picks
# when the recipe runs, after install-lavapipe.sh (make expands a recipe first).
# Mesa's shader cache beside the project's other caches: lavapipe compiles a
# kernel with LLVM in seconds to minutes, and a kernel it has compiled before
# loads from there in milliseconds.
WGPU_ENV := VK_ICD_FILENAMES="$$(ls /usr/share/vulkan/icd.d/lvp_icd.json /usr/share/vulkan/icd.d/lvp_icd.$$(uname -m).json 2>/dev/null | head -n 1)" \
	MESA_SHADER_CACHE_DIR=$(HEADROOM_CACHE)/mesa-shader-cache

worker-wgpu-check: ## Clippy of the worker, its tests and tools with the wgpu feature (in ~/.cache/headroom/target/wgpu).
	$(CARGO) clippy -p headroom-worker --features wgpu --all-targets --target-dir $(WGPU_DIR) -- -D warnings

worker-wgpu-test: ## The lean ops (f32), LoRA/QLoRA/checkpointed training steps and cubecl's pools on lavapipe (Vulkan on the CPU) against flex (installs mesa-vulkan-drivers; build in ~/.cache/headroom/target/wgpu).
	bash worker/wgpu/install-lavapipe.sh
	# One test at a time: they share the device, and the pool readings must
	# see only their own tensors. The lean-ops check last, in a process of its
	# own: it compiles the most kernels, so a run cut short by CI's deadline
	# has run the training rows first.
	$(WGPU_ENV) $(CARGO) test -p headroom-worker --features wgpu --target-dir $(WGPU_DIR) --test wgpu -- --test-threads=1 --nocapture --skip lean_ops_
	$(WGPU_ENV) $(CARGO) test -p headroom-worker --features wgpu --target-dir $(WGPU_DIR) --test wgpu -- --test-threads=1 --nocapture lean_ops_

# f16 apart: lavapipe compiled single f16 fused-matmul kernels in 4 to 13
# minutes each: 36 min cold (docs/gpu.md). CI runs it after the f32 rows,
# in the time left before its deadline.
worker-wgpu-f16-test: ## The lean ops in f16 on lavapipe against flex in f32 (36 min cold on lavapipe, its kernels compiled by LLVM).
	bash worker/wgpu/install-lavapipe.sh
	$(WGPU_ENV) $(CARGO) test -p headroom-worker --features wgpu --target-dir $(WGPU_DIR) --test wgpu_f16 -- --test-threads=1 --nocapture

# gpu-check's rows that need no CUDA (a smoke run with the worker's probe and
# cubecl's pools, the lean ops in f32 and f16), on any Vulkan device:
# lavapipe by default, a GPU's Vulkan driver with HEADROOM_WGPU_DEVICE=default
# (and WGPU_ENV= to load every driver). Built beside the tests.
WGPU_CHECK_ARGS ?= --quick
wgpu-check: ## calibrate --backend wgpu: a smoke run and the lean ops (f32, f16) on a Vulkan device, lavapipe unless HEADROOM_WGPU_DEVICE=default (exits 2 without one).
	bash worker/wgpu/install-lavapipe.sh
	$(CARGO) build -p headroom-worker --features wgpu --target-dir $(WGPU_DIR) --bin calibrate
	$(WGPU_ENV) $(WGPU_DIR)/debug/calibrate --backend wgpu $(WGPU_CHECK_ARGS)

cuda-runtime: ## libdevice and NCCL (and NVIDIA's licenses) from the pinned nvidia-cuda-nvcc-cu12 and nvidia-nccl-cu12 wheels on PyPI, CUDA_PATH-shaped, in ~/.cache/headroom/cuda-runtime.
	HEADROOM_CACHE=$(HEADROOM_CACHE) bash worker/cuda/fetch-runtime.sh

image-cuda: cuda-runtime ## localhost/headroom-worker-cuda:$(IMAGE_TAG) without Docker, from make worker-cuda's binary (the driver comes from the node).
	@test -x $(CUDA_DIR)/headroom-worker || { echo "no $(CUDA_DIR)/headroom-worker: run make worker-cuda first" >&2; exit 1; }
	# NCCL under the name cudarc opens (libnccl.so), on LD_LIBRARY_PATH.
	IMAGE_TAG=$(IMAGE_TAG) IMAGE_ENV="CUDA_PATH=/usr/local/cuda NVIDIA_DRIVER_CAPABILITIES=compute,utility LD_LIBRARY_PATH=/usr/local/cuda/lib64" \
	  e2e/images/build.sh headroom-worker-cuda $(CUDA_DIR)/headroom-worker \
	  $(CUDA_RUNTIME)/nvvm/libdevice/libdevice.10.bc:/usr/local/cuda/nvvm/libdevice/libdevice.10.bc \
	  $(CUDA_RUNTIME)/LICENSE:/usr/local/cuda/LICENSE.nvidia \
	  $(CUDA_RUNTIME)/lib64/libnccl.so.2:/usr/local/cuda/lib64/libnccl.so \
	  $(CUDA_RUNTIME)/LICENSE.nccl:/usr/local/cuda/LICENSE.nccl
	bash worker/cuda/check-image.sh $(HEADROOM_CACHE)/images/headroom-worker-cuda_$(IMAGE_TAG).oci.tar $(CUDA_RUNTIME)/nvvm/libdevice/libdevice.10.bc $(CUDA_RUNTIME)/lib64/libnccl.so.2

gpu-bundle: cuda-runtime ## gpu-bundle/: make worker-cuda's calibrate (xz) and libdevice, < 64 MiB, for make gpu-check on a GPU machine without network or toolchain.
	@test -x $(CUDA_DIR)/calibrate || { echo "no $(CUDA_DIR)/calibrate: run make worker-cuda first" >&2; exit 1; }
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)/cuda/nvvm/libdevice
	strip -o $(GPU_BUNDLE)/calibrate $(CUDA_DIR)/calibrate
	xz -6 -T2 $(GPU_BUNDLE)/calibrate
	cp $(CUDA_RUNTIME)/nvvm/libdevice/libdevice.10.bc $(GPU_BUNDLE)/cuda/nvvm/libdevice/
	cp $(CUDA_RUNTIME)/LICENSE $(GPU_BUNDLE)/cuda/LICENSE
	# The libraries it links besides glibc, for a GPU machine that lacks them (used only then).
	mkdir -p $(GPU_BUNDLE)/lib && ldd $(CUDA_DIR)/calibrate | awk '$$3 ~ /^\// {print $$3}' \
	  | grep -E '/lib(z|zstd|stdc\+\+|gcc_s)\.so' | xargs -r cp -L -t $(GPU_BUNDLE)/lib
	cd $(GPU_BUNDLE) && sha256sum calibrate.xz cuda/nvvm/libdevice/libdevice.10.bc lib/* > SHA256SUMS
	@size=$$(du -sb $(GPU_BUNDLE) | cut -f1); echo "gpu-bundle: $$size bytes"; \
	  test $$size -le $$((64 * 1024 * 1024)) || { echo "gpu-bundle is over 64 MiB" >&2; exit 1; }

gpu-check: ## On a machine with an NVIDIA GPU: bf16 smoke run, CUDA calibration grid, tokens/s, telemetry overhead (worker/cuda/gpu-check.sh; exits 2 without a GPU).
	bash worker/cuda/gpu-check.sh $(GPU_CHECK_ARGS)

images: ## Build localhost/headroom-{operator,worker}:$(IMAGE_TAG) without Docker; import into the cluster if up.
	$(CARGO) build --release -p headroom-operator --bin headroom-operator
	$(CARGO) build --release -p headroom-worker --bin headroom-worker
	IMAGE_TAG=$(IMAGE_TAG) e2e/images/build.sh headroom-operator $(CARGO_TARGET_DIR)/release/headroom-operator
	IMAGE_TAG=$(IMAGE_TAG) e2e/images/build.sh headroom-worker $(CARGO_TARGET_DIR)/release/headroom-worker
