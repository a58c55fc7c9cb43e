"""GPU nodes in the at-scale cost model's terms: what one GPU computes, moves and holds, each figure sourced.

A ``Hardware`` preset is a node of ``gpus_per_node`` GPUs joined by NVLink, with ``nics_per_node`` network
cards to the other nodes. The cost model (``planner.cluster.price``) reads:

- matmuls at an *achievable* rate, not the datasheet peak: a GEMM of shape (m, n, k) runs at
  ``peak * e_max * f(m) f(n) f(k)`` with ``f(d) = d / (d + knee)``, and no faster than HBM moves its operands
  (roofline). ``e_max`` and ``knee`` are the two constants fitted on Megatron-LM's Table 1
  (``bench/estimate.py --calibrate`` refits them); the same fraction of peak is assumed on the other GPUs;
- elementwise work (norms, softmax, dropout, activations) at ``hbm_efficiency`` of the HBM bandwidth;
- collectives on NVLink inside a node and on the node's NICs across nodes (``planner.cluster.comm``), at
  the bus bandwidth NCCL reaches (``bus_efficiency``), with a latency per ring hop;
- ``kernel_seconds``: the GPU's idle gap per kernel launched; ``op_seconds``: the host's time per operator
  dispatched (the local cost model's unit, and the floor of ``planner.cluster.host``), and
  ``family_op_seconds`` that time for each model family's own step where it was measured (a measured preset);
  ``alloc_fraction`` / ``alloc_fixed_bytes``: what the allocator, the CUDA context and NCCL's buffers take
  from ``device_bytes`` (``usable_bytes``);
- ``stack``: the software the node runs (``planner.cluster.stack.Stack``: attention's kernel, fused or eager
  elementwise kernels, what overlaps), ``colab_kit``'s own engine by default. ``attention`` is the stack's
  kernel: ``"flash"``, what the engine's ``F.scaled_dot_product_attention`` runs on these GPUs in fp16/bf16
  (FlashAttention-2), at ``attention_efficiency`` (forward, backward) of the peak, a property of the GPU; or
  ``"unfused"``, Megatron-LM 2021's batched products and softmax through HBM (the Table 1 runs:
  ``planner.published.MEGATRON_2021``). ``with_stack(...)`` / ``with_attention(kernel)`` give the same node
  under another stack, the same object every time.

Worked example: the achievable rate of a 2048 x 2304 x 768 GEMM (18B's attention output under tp=8) on
an A100 in fp16, against its 312 TFLOP/s peak::

    >>> hw = HARDWARE["8xA100-80GB"]
    >>> round(hw.gemm_rate(8 * 2048, 6144, 768, "fp16") / 1e12)   # doctest: +SKIP
    236
    >>> hw.node_nic_bytes_per_s / 1e9                               # 8 HDR NICs of 200 Gb/s
    200.0
    >>> hw.attention, hw.attention_efficiency, hw.with_attention("unfused") is hw.with_attention("unfused")
    ('flash', (0.73, 0.63), True)

fp32: the engine leaves ``torch.backends.cuda.matmul.allow_tf32`` at PyTorch's default (off since 1.12),
so fp32 matmuls are priced at the GPU's plain FP32 rate (19.5 TFLOP/s on an A100), not TF32.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .stack import ATTENTION, Stack, stack as _stack

__all__ = ["ATTENTION", "CALIBRATED", "HARDWARE", "Hardware", "hardware_constants", "preset"]

CALIBRATED = {"e_max": 0.785, "knee": 59.3}
"""The matmul curve's two constants fitted on Megatron-LM's Table 1 (``bench/estimate.py --calibrate``)."""


@dataclass(frozen=True, eq=False)
class Hardware:
    """A node of GPUs in the cost model's terms; ``sources`` says where each figure was read (see the
    module docstring). ``intra`` and ``inter`` are (latency s, bytes/s each way per GPU) on NVLink and on
    this GPU's share of the node's NICs: the form the local cost model's ``hardware_constants`` reads.
    Compared and hashed by identity (``eq=False``): a preset is a key of ``price``'s cache."""

    name: str
    gpus_per_node: int
    flops: dict                  # precision -> dense matmul FLOP/s of one GPU (datasheet peak)
    memory_bytes_per_s: float    # HBM bandwidth of one GPU
    device_bytes: int            # memory of one GPU
    intra: tuple                 # (latency s, bytes/s each way per GPU) inside a node: NVLink
    inter: tuple                 # (latency s, bytes/s per GPU) across nodes: the node's NICs / gpus_per_node
    source: str                  # one line of where the figures come from (dry_run prints it)
    op_seconds: float = 5e-6     # host time per autograd op (the local cost model's unit)
    family_op_seconds: dict = field(default_factory=dict)  # family -> host time an op of its step (measured)
    nics_per_node: int = 8
    nic_bytes_per_s: float = 25e9
    pcie_bytes_per_s: float = 25e9     # host <-> GPU each way, for offload="cpu"
    e_max: float = CALIBRATED["e_max"]  # fraction of the peak the largest GEMMs reach (fitted)
    knee: float = CALIBRATED["knee"]    # GEMM dimension at which that fraction halves (fitted)
    hbm_efficiency: float = 0.8         # fraction of HBM bandwidth elementwise kernels reach
    bus_efficiency: tuple = (0.7, 0.9)  # NCCL bus bandwidth / link bandwidth: (NVLink, network)
    kernel_seconds: float = 3e-6        # idle GPU time per kernel launched
    alloc_fraction: float = 0.05        # of device memory lost to the caching allocator's fragmentation
    alloc_fixed_bytes: int = 3 * 2 ** 30  # CUDA context, cuBLAS workspace, NCCL buffers
    sources: dict = field(default_factory=dict)  # figure -> where it was read
    attention_efficiency: tuple = (0.73, 0.63)  # "flash": fraction of the peak, (forward, backward)
    stack: Stack = Stack()              # the software the node runs (planner.cluster.stack)

    def __post_init__(self):
        if not isinstance(self.stack, Stack):
            raise ValueError(f"Hardware.stack must be a planner.cluster.stack.Stack, got {self.stack!r}")
        if len(self.attention_efficiency) != 2 or not all(0 < e <= 1 for e in self.attention_efficiency):
            raise ValueError(f"Hardware.attention_efficiency is (forward, backward), each a fraction of the peak in "
                             f"(0, 1], got {self.attention_efficiency!r}")

    # ------------------------------------------------------------------ derived
    @property
    def attention(self) -> str:
        """The kernel attention's core is priced as: the stack's ("flash" or "unfused")."""
        return self.stack.attention

    @property
    def node_nic_bytes_per_s(self) -> float:
        """All of a node's NICs together, one way."""
        return self.nics_per_node * self.nic_bytes_per_s

    @property
    def usable_bytes(self) -> int:
        """What the allocator can hand out: the device's memory less the fixed overheads and fragmentation."""
        return int(self.device_bytes * (1 - self.alloc_fraction)) - self.alloc_fixed_bytes

    def peak(self, precision: str) -> float:
        return float(self.flops[precision])

    def achievable(self, precision: str) -> float:
        """The most any GEMM reaches: ``e_max`` of the peak; no estimate beats it."""
        return self.peak(precision) * self.e_max

    def gemm_rate(self, m: float, n: float, k: float, precision: str) -> float:
        """FLOP/s of one (m x k) @ (k x n) product, from the shape curve alone (no memory bound)."""
        c = self.knee
        return self.achievable(precision) * (m / (m + c)) * (n / (n + c)) * (k / (k + c))

    def gemm_seconds(self, m: float, n: float, k: float, precision: str, count: float = 1.0) -> float:
        """Seconds of ``count`` (m x k) @ (k x n) products: the slower of the shape curve and HBM moving the
        two operands and the result once (a roofline; attention's k = head_dim products are memory bound)."""
        if m <= 0 or n <= 0 or k <= 0 or count <= 0:
            return 0.0
        size = 4 if precision == "fp32" else 2
        compute = 2.0 * m * n * k / self.gemm_rate(m, n, k, precision)
        memory = size * (m * k + k * n + m * n) / (self.memory_bytes_per_s * self.hbm_efficiency)
        return count * (max(compute, memory) + self.kernel_seconds)

    def stream_seconds(self, nbytes: float, kernels: float = 0.0) -> float:
        """Seconds of elementwise kernels moving ``nbytes`` through HBM, plus their launch gaps."""
        return nbytes / (self.memory_bytes_per_s * self.hbm_efficiency) + kernels * self.kernel_seconds

    def with_fit(self, e_max: float, knee: float) -> Hardware:
        """This preset with other matmul-curve constants (calibration)."""
        return replace(self, e_max=e_max, knee=knee)

    def with_stack(self, new=None, **changes) -> Hardware:
        """This node under another stack: ``new`` (a ``Stack`` or a name of ``planner.cluster.stack.STACKS``; this
        preset's own when None) with ``changes`` to its fields. Itself where nothing changes, else the same
        variant object on every call (``price`` caches by identity)."""
        target = _stack(new) if new is not None else self.stack
        if changes:
            target = replace(target, **changes)
        if target == self.stack:
            return self
        base = _BASES.get(self, self)
        key = (base, target)
        if key not in _VARIANTS:
            _VARIANTS[key] = base if target == base.stack else replace(base, stack=target)
            _BASES[_VARIANTS[key]] = base
        return _VARIANTS[key]

    def with_attention(self, kernel: str) -> Hardware:
        """This preset with attention priced as ``kernel`` ("flash" or "unfused"): ``with_stack(attention=kernel)``."""
        return self.with_stack(attention=kernel)


_VARIANTS: dict = {}  # (preset, stack) -> the preset under that stack (with_stack)
_BASES: dict = {}  # a variant -> the preset it was made from


_A100 = "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"
_NCCL = ("nccl-tests: 8x A100 SXM4 80GB all_reduce busbw about 200 GB/s of NVLink's 300 (NVIDIA/nccl-tests#149); "
         "3 nodes of 8 A100 with 4 HDR NICs each reach 85-96 GB/s busbw of the node's 100 (NVIDIA/nccl-tests#119)")
_LAT = ("assumption after NCCL's tuning model (src/graph/tuning.cc): a few microseconds per NVLink ring hop, "
        "about ten per network hop with the Simple protocol")
_FIT = "fitted on Megatron-LM Table 1 (bench/estimate.py --calibrate); the same fraction assumed on other GPUs"
_COMMON = {"e_max, knee": _FIT, "bus_efficiency": _NCCL, "latency": _LAT,
           "hbm_efficiency": "assumption: STREAM-like kernels reach about 80% of HBM bandwidth",
           "kernel_seconds": "assumption: a few microseconds of idle GPU between dependent kernels",
           "op_seconds": ("assumption: eager PyTorch's host time per operator dispatched (Python, the dispatcher, "
                          "autograd, the launch), about 5 us on a server CPU; bench/gpu_curves.py's launch sweep "
                          "measures it on a GPU's host"),
           "alloc_fixed_bytes": "assumption: CUDA context, cuBLAS workspace and NCCL buffers about 3 GiB",
           "alloc_fraction": "assumption: caching-allocator fragmentation about 5%",
           "attention": ("flash: the engine's attention is torch's F.scaled_dot_product_attention, whose flash backend "
                         "is FlashAttention-2 (PyTorch 2.2 release notes) and is what it runs on A100/H100-class GPUs "
                         "in fp16/bf16 (cuDNN attention opt-in since 2.5.1, pytorch/pytorch#138649); fp32 runs the "
                         "memory-efficient kernel, priced at the fp32 peak times the same fractions (assumption)")}
_FA2_A100 = (0.73, 0.63, "FlashAttention-2 (Dao 2023, arXiv 2307.08691, Sec. 1 and 4.1, A100 80GB SXM4): up to 73% "
             "of the peak forward (230 TFLOP/s), up to 63% backward (head dim 128, long sequences)")
_FA2_H100 = (0.34, 0.34, "FlashAttention-2 on H100 SXM5 (Dao 2023, Sec. 4.1, Fig. 7): up to 335 TFLOP/s forward + "
             "backward, 34% of 989; FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608, Sec. 1): FlashAttention-2 "
             "reaches 35% of H100's peak (FlashAttention-3 75% forward, not what torch's SDPA runs)")


def _node(name: str, flops: dict, hbm: float, mem: int, nvlink: float, nics: int, nic: float, pcie: float,
          sources: dict, source: str, flash: tuple = _FA2_A100) -> Hardware:
    """A preset from datasheet figures: ``nvlink`` bytes/s each way per GPU, ``nic`` bytes/s per NIC;
    ``flash``: (forward, backward) efficiency of FlashAttention-2 on the GPU and its source."""
    per_gpu = nics * nic / 8
    return Hardware(name, 8, flops, hbm, mem, (3e-6, nvlink), (10e-6, per_gpu), source, nics_per_node=nics,
                    nic_bytes_per_s=nic, pcie_bytes_per_s=pcie,
                    sources={**sources, **_COMMON, "attention_efficiency": flash[2]},
                    attention_efficiency=flash[:2])


_A100_FLOPS = {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12}
_H100_FLOPS = {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12}
_A100_SRC = {"flops": f"{_A100}: FP32 19.5 TFLOP/s (no TF32), BF16/FP16 tensor cores 312 TFLOP/s dense",
             "memory_bytes_per_s": f"{_A100}: HBM2e 2,039 GB/s", "device_bytes": f"{_A100}: 80 GB",
             "nvlink": f"{_A100}: third-generation NVLink 600 GB/s both ways (300 each way) through NVSwitch",
             "nics": "NVIDIA DGX A100 user guide: 8 ConnectX-6 HDR InfiniBand 200 Gb/s for compute traffic",
             "pcie": "PCIe Gen4 x16: 32 GB/s each way, about 25 achieved"}
_H100_SRC = {"flops": f"{_H100}: FP32 67 TFLOP/s (no TF32), BF16/FP16 tensor cores 989 TFLOP/s dense (1,979 sparse)",
             "memory_bytes_per_s": f"{_H100}: HBM3 3.35 TB/s", "device_bytes": f"{_H100}: 80 GB",
             "nvlink": f"{_H100}: fourth-generation NVLink 900 GB/s both ways (450 each way)",
             "nics": "NVIDIA DGX H100 user guide: 8 ConnectX-7 NDR InfiniBand 400 Gb/s, one per GPU",
             "pcie": "PCIe Gen5 x16: 64 GB/s each way, about 50 achieved"}

HARDWARE = {h.name: h for h in (
    _node("8xA100-80GB", _A100_FLOPS, 2.039e12, 80 * 10 ** 9, 300e9, 8, 25e9, 25e9, _A100_SRC,
          "DGX A100 80GB: NVIDIA A100 SXM4 80GB (FP32 19.5 TFLOP/s without TF32, BF16/FP16 tensor cores 312 TFLOP/s "
          "dense, HBM2e 2,039 GB/s, NVLink 600 GB/s both ways), 8 ConnectX-6 HDR 200 Gb/s NICs per node; approximate "
          "datasheet figures, the matmul curve fitted on Megatron-LM Table 1"),
    _node("8xH100-SXM", _H100_FLOPS, 3.35e12, 80 * 10 ** 9, 450e9, 8, 50e9, 50e9, _H100_SRC,
          "DGX H100: NVIDIA H100 SXM5 80GB (FP32 67 TFLOP/s, BF16/FP16 tensor cores 989 TFLOP/s dense, HBM3 3.35 TB/s, "
          "NVLink 900 GB/s both ways), 8 ConnectX-7 NDR 400 Gb/s NICs per node; approximate datasheet figures, the "
          "matmul curve's fraction of peak assumed as fitted on the A100", _FA2_H100),
    _node("8xH100-96GB-500W", _H100_FLOPS, 2.4e12, 96 * 10 ** 9, 450e9, 8, 50e9, 50e9,
          {**_H100_SRC, "device_bytes": "H100 with 96 GB of HBM2e (as the issue's cluster)",
           "memory_bytes_per_s": "assumption: HBM2e at about 2.4 TB/s (no datasheet figure found for this part)",
           "flops": f"{_H100}: 989 TFLOP/s BF16 dense at 700 W; assumption: the same peak at a 500 W cap "
                    "(clocks under the cap not modelled)",
           "nics": "400 Gb/s per GPU, 8 per node (as the issue's cluster)"},
          "H100 HBM2e 96GB at 500 W: H100 compute (989 TFLOP/s BF16 dense), 96 GB HBM2e at about 2.4 TB/s "
          "(assumed), NVLink 900 GB/s both ways, one 400 Gb/s NIC per GPU; approximate datasheet figures", _FA2_H100),
    _node("8xH200-SXM", _H100_FLOPS, 4.8e12, 141 * 10 ** 9, 450e9, 8, 50e9, 50e9,
          {**_H100_SRC, "memory_bytes_per_s": "NVIDIA H200 Tensor Core GPU datasheet: HBM3e 4.8 TB/s",
           "device_bytes": "NVIDIA H200 datasheet: 141 GB", "flops": "NVIDIA H200 datasheet: H100's tensor cores, "
           "989 TFLOP/s BF16 dense", "nics": "NVIDIA HGX H200 reference: 8 ConnectX-7 NDR 400 Gb/s, one per GPU"},
          "HGX H200: NVIDIA H200 SXM 141GB (H100's compute, HBM3e 4.8 TB/s, NVLink 900 GB/s both ways), 8 NDR 400 Gb/s "
          "NICs per node; approximate datasheet figures", _FA2_H100),
    _node("8xH800-SXM", _H100_FLOPS, 3.35e12, 80 * 10 ** 9, 200e9, 8, 50e9, 50e9,
          {**_H100_SRC, "nvlink": "NVIDIA H800 SXM5 (export variant of H100): NVLink 400 GB/s both ways (200 each "
                                  "way)", "nics": "DeepSeek-V3 technical report (arXiv 2412.19437): 8 GPUs per node, "
                                                  "400 Gb/s InfiniBand NIC per GPU",
           "flops": "NVIDIA H800 SXM5: H100 SXM5's tensor cores, 989 TFLOP/s BF16 dense"},
          "H800 SXM: H100 SXM5's compute and HBM3 3.35 TB/s with NVLink cut to 400 GB/s both ways, 8 NDR 400 Gb/s "
          "NICs per node; approximate datasheet figures", _FA2_H100))}
"""Node presets by name. ``8xA100-80GB``, ``8xH100-SXM``, ``8xH200-SXM`` keep their earlier names."""


def preset(name_or_hw) -> Hardware:
    """A preset by name, or the ``Hardware`` given; a ``KeyError`` naming the presets otherwise."""
    if isinstance(name_or_hw, Hardware):
        return name_or_hw
    if name_or_hw not in HARDWARE:
        raise KeyError(f"unknown hardware {name_or_hw!r}: choose from {', '.join(HARDWARE)}")
    return HARDWARE[name_or_hw]


_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "sendrecv")


def hardware_constants(name: str, precision: str = "fp32", link: str = "intra") -> dict:
    """A preset as the local cost model's constants (``planner.local.constants``' keys), every collective over
    ``link`` ("intra": NVLink, "inter": InfiniBand), one GPU per rank; ``ck.plan(...,
    constants=hardware_constants("8xH100-SXM"))`` takes them."""
    hw = HARDWARE[name]
    alpha, beta = hw.intra if link == "intra" else hw.inter
    return {"ranks": 0, "cores": 1 << 30, "matmul": {"flops_per_s": hw.flops[precision]},
            "dispatch": {"op_seconds": hw.op_seconds}, "memory": {"bytes_per_s": hw.memory_bytes_per_s},
            "comm": {"2": {op: {"alpha": alpha, "beta": beta} for op in _OPS}}, "source": hw.source}
