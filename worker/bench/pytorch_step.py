"""PyTorch + transformers + PEFT's side of the LoRA-step A/B (`make bench-lora-step`).

The job `calibrate --step-breakdown` trains in Headroom's worker: a
SmolLM2-135M-shaped Llama (30 x 576, 9 query / 3 key-value heads, SwiGLU
1536, vocabulary 49152, tied), random weights, fp32, AdamW (lr 1e-3, no
weight decay), gradient clipping at 1.0, micro-batch 4 x 256 tokens; full
fine-tune, LoRA r16 (alpha 32, no dropout) on the seven block linears.
The step is what `transformers.Trainer` runs (forward with the loss,
backward, clip, step, zero_grad) without its bookkeeping; each phase is
timed, the medians printed as the Headroom side prints them.

    python pytorch_step.py --threads 1 --steps 6
"""

import argparse
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_of(case: str) -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        hidden_act="silu",
    )
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).to(torch.float32)
    if case == "lora":
        model = get_peft_model(
            model,
            LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=SEVEN, task_type="CAUSAL_LM"),
        )
    model.train()
    return model


def time_case(case: str, warmup: int, steps: int):
    model = model_of(case)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(7)
    rows = []
    for i in range(warmup + steps):
        # 257 tokens per sample: 256 inputs, each with its next token as target (Headroom's packing).
        ids = torch.randint(0, 49152, (4, 257), generator=generator)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        t0 = time.perf_counter()
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        print(
            f"  {case} step {i + 1}: {1e3 * (t3 - t0):.0f} ms (forward {1e3 * (t1 - t0):.0f}, "
            f"backward {1e3 * (t2 - t1):.0f}, optimizer {1e3 * (t3 - t2):.0f}), loss {loss.item():.4f}",
            flush=True,
        )
        if i >= warmup:
            rows.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", default="full|lora")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"PyTorch {torch.__version__}: SmolLM2-135M shape, fp32, AdamW, micro-batch 4 x 256 tokens, "
        f"{args.steps} timed steps after 2 warm-up; threads: {args.threads}"
    )
    results = {case: time_case(case, 2, args.steps) for case in args.only.split("|")}
    print("\n| case | median step ms | forward (with loss) ms | backward ms | optimizer ms | tokens/s | step / full step |")
    print("|---|---|---|---|---|---|---|")
    full = statistics.median(r[0] for r in results["full"]) if "full" in results else None
    for case, rows in results.items():
        step = statistics.median(r[0] for r in rows)
        phase = [statistics.median(r[k] for r in rows) * 1e3 for k in (1, 2, 3)]
        ratio = f"{step / full:.2f}" if full else "—"
        print(f"| {case} | {step * 1e3:.0f} | {phase[0]:.0f} | {phase[1]:.0f} | {phase[2]:.0f} | {4 * 256 / step:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
