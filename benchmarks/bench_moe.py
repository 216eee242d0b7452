"""The mixture-of-experts layer's expert compute: grouped GEMM against the per-expert loop, one process.

    python benchmarks/bench_moe.py [--tokens 2048] [--rounds 5]

Times forward + backward of one `MoE` layer of the qwen3_moe debug model's shape (dim 256, 8 experts,
top-2, expert width 128) on random tokens, fp32 and bf16, after a warm-up, as the median of `--rounds`
interleaved rounds; prints a markdown table (ms per layer step and routed tokens/s).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from titanlite.models.common.moe import MoE
from titanlite.models.qwen3_moe import qwen3_moe_configs


def step_ms(moe: MoE, x: torch.Tensor, grad: torch.Tensor) -> float:
    t0 = time.perf_counter()
    moe(x).backward(grad)
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()
    a = qwen3_moe_configs["debugmodel"]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        layers = {
            g: MoE(a.dim, a.moe_ffn_dim, a.num_experts, a.top_k, a.norm_topk_prob, grouped=g) for g in (True, False)
        }
        for m in layers.values():
            for p in m.parameters():
                torch.nn.init.normal_(p, 0, 0.02)
            m.to(dtype)
        x = torch.randn(1, opts.tokens, a.dim, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        times: dict[bool, list[float]] = {True: [], False: []}
        for m in layers.values():
            step_ms(m, x, grad)  # warm-up
        for _ in range(opts.rounds):
            for g, m in layers.items():
                times[g].append(step_ms(m, x, grad))
        for g in (True, False):
            ms = statistics.median(times[g])
            rows.append((str(dtype).removeprefix("torch."), "grouped_mm" if g else "loop", ms, opts.tokens / ms * 1000))
    print(
        f"MoE layer fwd+bwd, {opts.tokens} tokens, dim {a.dim}, {a.num_experts} experts, top-{a.top_k}, "
        f"expert width {a.moe_ffn_dim}, {torch.get_num_threads()} threads"
    )
    print("| dtype | experts | ms / step | tokens/s |\n|---|---|---|---|")
    for dtype, kind, ms, tps in rows:
        print(f"| {dtype} | {kind} | {ms:.1f} | {tps:,.0f} |")


if __name__ == "__main__":
    main()
