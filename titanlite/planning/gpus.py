"""GPU kinds for the layout search: memory, matmul and attention throughput, memory and link bandwidth.

Every figure is a published one (`GPU_KINDS` names the source of each); none was measured here. The
step-time model (`titanlite/planning/step_time.py`) reads them as:

    matmul time      FLOPs / (matmul_tflops x training_efficiency)
    attention time   FLOPs / (attention_tflops x training_efficiency)
    elementwise      bytes / (hbm_gbps x HBM_EFFICIENCY)
    collectives      ring bytes / (nvlink_gbps or network_gbps x COLLECTIVE_EFFICIENCY) + latency

`GPU_PEAK_TFLOPS`, the dense bf16 peak by device name, is also the trainer's MFU denominator (`metrics/mfu.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanlite.errors import ConfigError

GPU_PEAK_TFLOPS = {
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "MI325X": 1307.0,
    "MI300X": 1307.0,
}
"""Dense bf16 peak TFLOP/s (no sparsity) per GPU name fragment, most specific first: the first fragment found
in the device name wins, so "GB200" must precede "B200" and the H100 variants the plain "H100" (SXM). Vendor
data sheets."""

COLLECTIVE_EFFICIENCY = 0.8
"""Ring bus bandwidth NCCL reaches over the link rate at large messages: nccl-tests on 8 x A100 NVLink
report 230-250 GB/s of 300, H100 all-gathers about 360 of 450 (nccl-tests reference tables); the same
share is assumed over the network."""
HBM_EFFICIENCY = 0.8
"""Share of the HBM bandwidth that memory-bound elementwise kernels reach (a copy reaches 85-90%)."""
INTRA_NODE_LATENCY_S = 10e-6
"""Fixed cost of one NCCL collective within a node (small-message nccl-tests times, order of magnitude)."""
INTER_NODE_LATENCY_S = 25e-6
"""Fixed cost of one NCCL collective across nodes."""


@dataclass(frozen=True)
class GpuKind:
    name: str
    description: str
    memory_gib: float
    peak_tflops: float
    """Dense bf16 peak: the MFU denominator."""
    matmul_tflops: float
    """Maximum achievable bf16 matmul rate [mamf]."""
    fp32_matmul_tflops: float
    """fp32 matmul peak without tensor cores [peak] (titanlite does not enable TF32): layouts without data
    parallelism compute in fp32."""
    attention_tflops: float
    """Causal flash attention, forward and backward [fa]."""
    hbm_gbps: float
    nvlink_gbps: float
    """Per GPU and direction, within a node [link]."""
    network_gbps: float
    """Per GPU and direction, between nodes [link]."""
    gpus_per_node: int = 8
    training_efficiency: float = 0.0
    """[cal]; 0 = take the calibrated H100 value (`gpu_kind`)."""
    float8_matmul_tflops: float = 0.0
    """Maximum achievable fp8 matmul rate [mamf]; used only to compare with published float8 runs."""
    comm_overlaps_compute: bool = True
    """Collectives run beside compute (GPU copy engines and spare SMs); False where they share the cores
    compute runs on (a CPU with gloo)."""
    intra_latency_s: float = INTRA_NODE_LATENCY_S
    inter_latency_s: float = INTER_NODE_LATENCY_S
    shared_processors: int = 0
    """0: every rank has its own device. Else the ranks of a node share this many processors (CPU cores),
    and the figures above are each rank's while all compute: a rank that waits (pipeline bubble) leaves
    its share to the others."""


H100_TRAINING_EFFICIENCY = 0.694
"""[cal] fitted on TorchTitan's 8-GPU Llama 3.1 8B FSDP + compile row (6,667 tokens/s per GPU)."""
A100_TRAINING_EFFICIENCY = 0.794
"""[cal] fitted on TorchTitan's 64-A100 Llama 3 8B selective-op row (2,973 tokens/s per GPU)."""

GPU_KINDS: dict[str, GpuKind] = {
    "h100": GpuKind(
        "h100",
        "H100 SXM 80GB, 700 W",
        79.1,
        GPU_PEAK_TFLOPS["H100"],
        794.5,
        67.0,
        330.0,
        3350,
        450,
        50,
        training_efficiency=H100_TRAINING_EFFICIENCY,
        float8_matmul_tflops=1402.6,
    ),
    "h100-96gb-500w": GpuKind(
        "h100-96gb-500w",
        "TorchTitan's benchmark H100 (Grand Teton): 96 GB HBM2e, 500 W; its matmul rate lies between SXM and NVL "
        "(the benchmark's note): H100 SXM's x 0.92 (the NVL/SXM peak midpoint)",
        95.0,
        GPU_PEAK_TFLOPS["H100"],
        794.5 * 0.92,
        67.0 * 0.92,
        330.0 * 0.92,
        2400,
        450,
        50,
        training_efficiency=H100_TRAINING_EFFICIENCY,
        float8_matmul_tflops=1402.6 * 0.92,
    ),
    "h200": GpuKind(
        "h200",
        "H200 SXM 141GB",
        139.8,
        GPU_PEAK_TFLOPS["H200"],
        794.5,
        67.0,
        330.0,
        4800,
        450,
        50,
        float8_matmul_tflops=1453.4,
    ),
    "a100": GpuKind(
        "a100",
        "A100 SXM 80GB",
        79.1,
        GPU_PEAK_TFLOPS["A100"],
        271.2,
        19.5,
        190.0,
        2039,
        300,
        25,
        training_efficiency=A100_TRAINING_EFFICIENCY,
    ),
    "b200": GpuKind(
        "b200",
        "B200 SXM 180GB",
        178.4,
        GPU_PEAK_TFLOPS["B200"],
        1745.0,
        80.0,
        330.0 * 1745.0 / 794.5,
        8000,
        900,
        50,
        float8_matmul_tflops=3432.5,
    ),
}
"""One kind per `config.GpuName` (the `layout_search.gpu` choices). Sources of the fields:

  [peak]  NVIDIA data sheets, dense bf16 (`GPU_PEAK_TFLOPS`, the trainer's MFU denominator); fp32
          without tensor cores: A100 19.5, H100/H200 SXM 67, B200 80 TFLOP/s.
  [mamf]  Maximum achievable matmul FLOPS, bf16 and fp8, best shape, mean of 100 runs: S. Bekman,
          "Machine Learning Engineering", compute/accelerator/README.md (github.com/stas00/ml-engineering):
          A100 SXM 271.2, H100 SXM 794.5 ("H200 is the same"), B200 1745.0; fp8 H100 1402.6, H200 1453.4,
          B200 3432.5 TFLOP/s.
  [fa]    FlashAttention-2 (torch's flash SDPA kernel) at head dim 128, seq 8k: about 370 TFLOP/s forward
          without the causal mask on H100 SXM (FlashAttention-3 paper, Shah et al. 2024, fig. "Attention
          forward speed, head dim 128"), lower causal and backward: 330 is used for forward + backward;
          about 190 on A100 (FlashAttention-2 paper, Dao 2023). B200: H100's scaled by the MAMF ratio.
  [hbm]   NVIDIA data sheets: A100 80GB 2,039 GB/s, H100 SXM 3,350, H200 4,800, B200 8,000; TorchTitan's
          benchmark H100s (96 GB HBM2e) 2,400 (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md).
  [link]  NVLink per GPU and direction: A100 (NVLink 3) 300 GB/s, H100/H200 (NVLink 4) 450, B200 (NVLink 5)
          900 (NVIDIA data sheets, half the bidirectional figure). Network per GPU: DGX A100 one 200 Gb/s
          HDR NIC per GPU (25 GB/s); DGX H100/H200/B200 one 400 Gb/s NIC per GPU (50 GB/s); TorchTitan's
          benchmark hosts 400 Gb/s RDMA per GPU.
  [mem]   Total memory as torch reports it (`total_memory`), rounded: 80 GB parts 79.1 GiB, H200 141 GB
          139.8 GiB, B200 180 GB 178.4 GiB, TorchTitan's 96 GB H100 95.0 GiB (approximate).
  [cal]   `training_efficiency`: the share of the matmul/attention rates a whole training step reaches
          (shapes, launch gaps, clocks under sustained load), fitted to published TorchTitan runs by
          `titanlite/tools/calibration.py` (docs/layout_search.md); kinds without such runs take H100's.
"""


def gpu_kind(name: str) -> GpuKind:
    """The table's kind `name`, its calibration filled in; an unknown name is one config error line."""
    if name not in GPU_KINDS:
        raise ConfigError(f"config key 'layout_search.gpu' = {name!r}: expected one of {', '.join(GPU_KINDS)}")
    kind = GPU_KINDS[name]
    if not kind.training_efficiency:
        kind = dataclasses.replace(kind, training_efficiency=H100_TRAINING_EFFICIENCY)
    return kind
