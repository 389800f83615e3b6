"""The machine a plan is made for: one GPU's speed and memory, and the two kinds of links.

Every number the step-time model needs about hardware lives in :class:`Hardware`, so a plan
for another GPU, or for this very CPU, is the same code with other inputs. The defaults
describe a node of 8 H100 SXM GPUs as the book's benchmarks used them; each is quoted from a
public spec sheet or marked as an assumption:

* ``peak_flops = 989e12``: dense BF16 tensor-core FLOP/s of an H100 SXM (NVIDIA's data sheet
  lists 1979 TFLOP/s "with sparsity", twice the dense number). MFU is measured against it.
* ``matmul_efficiency = 0.7``: an assumption. Large bf16 matmuls on an H100 reach roughly
  650-750 TFLOP/s, not the spec peak; a GPU can measure its own with
  ``overlap.measure_matmul_flops(8192, dtype=torch.bfloat16, device="cuda")``.
* ``half_efficiency_tokens = 256``: an assumption. A matmul with few rows (the tokens one GPU
  runs through a layer in one micro-batch, ``mbs * seq / cp``) keeps the GPU busy for too
  short a time to reach its large-size speed; we take efficiency ``tokens / (tokens + 256)``
  of ``matmul_efficiency`` (94% of it at 4096 tokens, 80% at 1024). The book's GPU
  experiment, an mbs sweep of a 1B model on one GPU, is how to calibrate it.
* ``memory_bytes = 80e9``: 80 GB of HBM3 (the book counts GB as 1e9 bytes);
  ``memory_headroom = 0.1`` keeps 10% of it for what the memory model leaves out (the CUDA
  context and kernels, the allocator's fragmentation, logits and temporary buffers): an
  assumption, see chapter 01.
* ``intra_node``: NVLink 4 moves 900 GB/s per GPU counting both directions, 450 GB/s each
  way, which is the bus bandwidth a ring collective can reach inside a node.
* ``inter_node``: one 400 Gb/s InfiniBand NDR port per GPU (a DGX H100 has eight), 50 GB/s.
* The latencies (``alpha``, per ring step) are assumptions of the right order: a few
  microseconds inside a node, about ten between nodes. They matter only for small messages.

Links are :class:`ultrascale.comm.AlphaBeta` (chapter A0's model, bandwidth as nccl-tests'
bus bandwidth); :func:`hardware_from_measurements` turns measurements into a ``Hardware``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..comm.cost_model import AlphaBeta


@dataclass(frozen=True)
class Datasheet:
    """A GPU's headline numbers from its vendor's data sheet: dense BF16 tensor-core FLOP/s (the
    sheets also print a figure "with sparsity", twice this one) and memory bandwidth in bytes/s.
    MFU is measured against the first, a roofline's ceilings are drawn from both."""

    label: str
    bf16_flops: float
    memory_bandwidth: float


# (words the device name must all contain, its data sheet). The first match wins, so a variant
# comes before the plainer name inside it: H100 PCIe before H100, L40S before L4, A100 before A10.
DATASHEETS = (
    (("H200",), Datasheet("H200", 989e12, 4.8e12)),
    (("H100", "PCIe"), Datasheet("H100 PCIe", 756e12, 2.0e12)),
    (("H100", "NVL"), Datasheet("H100 NVL", 835e12, 3.9e12)),
    (("H100",), Datasheet("H100 SXM", 989e12, 3.35e12)),
    (("A100", "80GB"), Datasheet("A100 80GB", 312e12, 2.0e12)),
    (("A100",), Datasheet("A100 40GB", 312e12, 1.555e12)),
    (("L40S",), Datasheet("L40S", 362e12, 864e9)),
    (("L4",), Datasheet("L4", 121e12, 300e9)),
    (("A10",), Datasheet("A10", 125e12, 600e9)),
)


def datasheet(device_name: str) -> Datasheet | None:
    """The data sheet of the GPU called ``device_name`` (``torch.cuda.get_device_name()``), or
    None for one not in ``DATASHEETS``: add a line there for it."""
    return next((sheet for words, sheet in DATASHEETS if all(w in device_name for w in words)), None)


H100_PEAK_FLOPS = datasheet("H100").bf16_flops  # dense BF16, H100 SXM data sheet
H100_MEMORY_BYTES = 80e9  # 80 GB HBM3
NVLINK4_BW = 450e9  # 900 GB/s bidirectional per GPU, per direction
INFINIBAND_NDR_BW = 50e9  # 400 Gb/s per GPU


@dataclass(frozen=True)
class Hardware:
    """One kind of GPU, ``gpus_per_node`` of them per node, and the links between them."""

    name: str = "8x H100 SXM per node"
    gpus_per_node: int = 8
    peak_flops: float = H100_PEAK_FLOPS
    matmul_efficiency: float = 0.7
    half_efficiency_tokens: float = 256.0
    memory_bytes: float = H100_MEMORY_BYTES
    memory_headroom: float = 0.1
    intra_node: AlphaBeta = field(default_factory=lambda: AlphaBeta(3e-6, NVLINK4_BW))
    inter_node: AlphaBeta = field(default_factory=lambda: AlphaBeta(10e-6, INFINIBAND_NDR_BW))
    bytes_per_element: int = 2  # bf16 activations, gradients and weights on the wire
    overlap: bool = True  # GPUs: collectives run beside the kernels (appendix A3); a CPU's
    # gloo collectives take the very cores that compute: nothing hides

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"matmul_efficiency is a fraction of the peak in (0, 1], got {self.matmul_efficiency}")
        if not 0 <= self.memory_headroom < 1:
            raise ValueError(f"memory_headroom is a fraction in [0, 1), got {self.memory_headroom}")
        if self.peak_flops <= 0 or self.memory_bytes <= 0:
            raise ValueError("peak_flops and memory_bytes must be positive")

    def achieved_flops(self, tokens: float) -> float:
        """FLOP/s a GPU really does in matmuls over ``tokens`` rows (one micro-batch's share)."""
        return self.peak_flops * self.matmul_efficiency * tokens / (tokens + self.half_efficiency_tokens)

    @property
    def usable_memory(self) -> float:
        """Bytes the memory model's four consumers may use on one GPU."""
        return self.memory_bytes * (1 - self.memory_headroom)

    def link(self, stride: int, size: int) -> AlphaBeta:
        """The link a group of ``size`` ranks ``stride`` apart runs over.

        Ranks are numbered node by node, so a group stays inside one node when it spans no
        more than ``gpus_per_node`` consecutive ranks. A ring is as fast as its slowest
        link: one hop between nodes makes the whole group inter-node.
        """
        return self.intra_node if stride * size <= self.gpus_per_node else self.inter_node

    def with_memory(self, memory_bytes: float) -> "Hardware":
        return replace(self, memory_bytes=memory_bytes)


H100 = Hardware()


def hardware_from_measurements(
    *,
    peak_flops: float,
    link: AlphaBeta,
    memory_bytes: float,
    gpus_per_node: int,
    name: str = "calibrated",
    matmul_efficiency: float = 1.0,
    bytes_per_element: int = 4,
    half_efficiency_tokens: float = 0.0,
    overlap: bool = False,
) -> Hardware:
    """A ``Hardware`` from measured numbers: one machine whose ranks all share one kind of link
    (``gpus_per_node`` = the ranks on it), e.g. this CPU with gloo over loopback in fp32."""
    return Hardware(
        name=name,
        gpus_per_node=gpus_per_node,
        peak_flops=peak_flops,
        matmul_efficiency=matmul_efficiency,
        half_efficiency_tokens=half_efficiency_tokens,
        memory_bytes=memory_bytes,
        memory_headroom=0.0,
        intra_node=link,
        inter_node=link,
        bytes_per_element=bytes_per_element,
        overlap=overlap,
    )
