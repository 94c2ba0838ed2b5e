"""Hardware profiles: the handful of rates and sizes the cost model prices a step with.

A profile is either measured on this machine (`mtjax probe`, source "measured") or
built in. Built-in GPU profiles carry the vendor's datasheet figures for the
accelerator and its host link (source "vendor"); their host RAM, memory bandwidth and
disk figures describe a typical server of that class and are assumptions, said so in
`notes`. Built-in profiles of rented-class machines also carry a typical hourly price and
the rated endurance of a typical drive of their disk's size (`TYPICAL_PRICE`,
`TYPICAL_ENDURANCE`), which `mtjax plan` labels as typical wherever it prints them.
Profiles are JSON files with the same field names as `HardwareProfile`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mtjax import jsonfile, textfile, writable
from mtjax.errors import MtjaxError

GB = 10**9
GiB = 2**30


class HardwareError(MtjaxError, ValueError):
    """A hardware profile that cannot be found or read."""


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    name: str
    source: str  # "vendor" (datasheet), "dev-machine" (measured once on the project's 2-core VM), "measured" (mtjax probe)
    device: str  # what runs the blocks, in words
    device_memory_bytes: int  # usable accelerator memory; host RAM when the device is the CPU
    matmul_flops_fp32: float  # FLOP/s of a large fp32 matmul (peak for vendor, achieved for measured)
    matmul_flops_bf16: float  # same in bf16 with fp32 accumulation
    compute_efficiency: float  # fraction of matmul_flops a transformer block's fwd/bwd reaches
    h2d_bytes_per_s: float | None  # host->device link; None: the device is the host (no copy)
    d2h_bytes_per_s: float | None  # device->host link; None as above
    host_memory_bytes_per_s: float  # bytes moved (read + written) per second by the CPU cores
    host_ram_bytes: int  # installed host RAM
    disk_read_bytes_per_s: float  # cold sequential read of the store's disk
    disk_write_bytes_per_s: float  # sequential write, synced
    disk_bytes: int  # disk size available to the store
    device_is_host: bool = False  # device compute, optimizer and I/O share the same cores
    runtime_bytes: int = 2 * GiB  # host RAM of Python, the JAX runtime and compiled programs
    part_overhead_s: float = 0.0  # fixed host time per part streamed (dispatch, Python), measured
    price_per_hour: float | None = None  # USD per hour of the machine; None: unknown
    drive_endurance_bytes: int | None = None  # bytes the store's drive is rated to write (TBW); None: unknown
    devices: int = 1  # accelerators of this host (what stream.devices "all" plans for)
    interconnect_bytes_per_s: float | None = None  # device<->device, per direction; None: through the host link
    network_bytes_per_s: float = 12.5 * GB  # between hosts, per direction (multi-process runs); assumed 100 Gb/s Ethernet
    notes: str = ""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None and v < 0:
                raise HardwareError(f"hardware profile {self.name!r}: {f.name} must not be negative")
        if not 0 < self.compute_efficiency <= 1:
            raise HardwareError(f"hardware profile {self.name!r}: compute_efficiency must be in (0, 1]")

    def matmul_flops(self, dtype: str) -> float:
        """Achievable FLOP/s of block compute in `dtype` (fp16 priced as bf16)."""
        peak = self.matmul_flops_fp32 if dtype == "float32" else self.matmul_flops_bf16
        return peak * self.compute_efficiency

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        writable.write_text(path, self.to_json())  # whole or not at all: never half a profile, nor a stray temporary
        return path


# Vendor profiles assume a block's fwd/bwd reaches half of dense bf16 peak: large-hidden
# transformer layers typically reach 40-60% on Hopper/Ampere; streaming stalls are priced
# separately by the cost model.
_VENDOR_EFFICIENCY = 0.5
_SERVER_NOTE = ("accelerator and link: vendor datasheet; host RAM, memory bandwidth and "
                "disk: assumed typical server, replace with `mtjax probe` on the real machine")
# What the built-in prices and drive endurances are: round figures, not quotes.
TYPICAL_PRICE = "typical on-demand price of one such GPU with its share of the server, 2026"
TYPICAL_ENDURANCE = "typical datacenter NVMe: one drive write per day for five years"
TB = 10**12


def _endurance(drive_bytes: int) -> int:
    """Rated bytes written of a drive of this size at one drive write per day for five years."""
    return drive_bytes * 365 * 5

BUILTIN: dict[str, HardwareProfile] = {
    p.name: p
    for p in [
        HardwareProfile(
            name="a100-80gb-pcie4", source="vendor", device="NVIDIA A100 80GB PCIe, PCIe 4.0 x16",
            device_memory_bytes=80 * GiB, matmul_flops_fp32=19.5e12, matmul_flops_bf16=312e12,
            compute_efficiency=_VENDOR_EFFICIENCY, h2d_bytes_per_s=32 * GB, d2h_bytes_per_s=32 * GB,
            host_memory_bytes_per_s=200 * GB, host_ram_bytes=1024 * GiB,
            disk_read_bytes_per_s=7 * GB, disk_write_bytes_per_s=5 * GB, disk_bytes=8 * TB,
            price_per_hour=1.5, drive_endurance_bytes=_endurance(8 * TB),
            notes="PCIe 4.0 x16: 32 GB/s per direction; " + _SERVER_NOTE,
        ),
        HardwareProfile(
            name="h100-pcie5", source="vendor", device="NVIDIA H100 PCIe 80GB, PCIe 5.0 x16",
            device_memory_bytes=80 * GiB, matmul_flops_fp32=51e12, matmul_flops_bf16=756e12,
            compute_efficiency=_VENDOR_EFFICIENCY, h2d_bytes_per_s=64 * GB, d2h_bytes_per_s=64 * GB,
            host_memory_bytes_per_s=300 * GB, host_ram_bytes=1536 * GiB,
            disk_read_bytes_per_s=14 * GB, disk_write_bytes_per_s=10 * GB, disk_bytes=8 * TB,
            price_per_hour=2.5, drive_endurance_bytes=_endurance(8 * TB),
            notes="PCIe 5.0 x16: 64 GB/s per direction; " + _SERVER_NOTE,
        ),
        HardwareProfile(
            name="h200", source="vendor", device="NVIDIA H200 SXM 141GB, PCIe 5.0 x16 to the host",
            device_memory_bytes=139 * GiB, matmul_flops_fp32=67e12, matmul_flops_bf16=989e12,
            compute_efficiency=_VENDOR_EFFICIENCY, h2d_bytes_per_s=64 * GB, d2h_bytes_per_s=64 * GB,
            host_memory_bytes_per_s=300 * GB, host_ram_bytes=2048 * GiB,
            disk_read_bytes_per_s=14 * GB, disk_write_bytes_per_s=10 * GB, disk_bytes=8 * TB,
            price_per_hour=3.5, drive_endurance_bytes=_endurance(8 * TB), interconnect_bytes_per_s=450 * GB,
            notes=("139 GiB of HBM visible to JAX; PCIe 5.0 x16: 64 GB/s per direction; NVLink 4 between "
                   "GPUs of one server: 450 GB/s per direction; " + _SERVER_NOTE),
        ),
        HardwareProfile(
            name="h200-lent", source="vendor", device="NVIDIA H200 SXM 141GB on the project's lent machine",
            device_memory_bytes=139 * GiB, matmul_flops_fp32=67e12, matmul_flops_bf16=989e12,
            compute_efficiency=_VENDOR_EFFICIENCY, h2d_bytes_per_s=64 * GB, d2h_bytes_per_s=64 * GB,
            host_memory_bytes_per_s=150 * GB, host_ram_bytes=128 * GiB,
            disk_read_bytes_per_s=3 * GB, disk_write_bytes_per_s=2 * GB, disk_bytes=64 * GiB,
            notes=("host RAM (128 GiB), disk (64 GiB) and 16 cores as lent; host memory and disk "
                   "bandwidths assumed, replace with `mtjax probe` on that machine"),
        ),
        HardwareProfile(
            name="gh200", source="vendor", device="NVIDIA GH200 Grace Hopper 96GB, NVLink-C2C",
            device_memory_bytes=96 * GiB, matmul_flops_fp32=67e12, matmul_flops_bf16=989e12,
            compute_efficiency=_VENDOR_EFFICIENCY, h2d_bytes_per_s=450 * GB, d2h_bytes_per_s=450 * GB,
            host_memory_bytes_per_s=500 * GB, host_ram_bytes=480 * 10**9,
            disk_read_bytes_per_s=7 * GB, disk_write_bytes_per_s=5 * GB, disk_bytes=4 * TB,
            price_per_hour=3.0, drive_endurance_bytes=_endurance(4 * TB),
            notes=("NVLink-C2C 900 GB/s total (450 per direction), Grace LPDDR5X 480 GB at up to "
                   "~500 GB/s: vendor; disk assumed"),
        ),
        HardwareProfile(
            name="cpu-2core", source="dev-machine", device="2-core x86 CPU (JAX CPU backend)",
            device_memory_bytes=24 * GiB, matmul_flops_fp32=190e9, matmul_flops_bf16=190e9,
            # a 12.85M-param Llama block fwd+bwd at seq 512 ran in 317 ms there: ~0.7 of the matmul peak.
            compute_efficiency=0.7, h2d_bytes_per_s=None, d2h_bytes_per_s=None,
            host_memory_bytes_per_s=2 * 13 * GiB, host_ram_bytes=24 * GiB,
            disk_read_bytes_per_s=1.5 * GB, disk_write_bytes_per_s=1.5 * GB, disk_bytes=79 * GiB,
            device_is_host=True,
            notes=("the project's 2-core development VM: copy 13 GiB/s (26 GiB/s moved), tensorstore "
                   "cold read 1.5 GB/s, synced write 1.5-2 GB/s; device_put of staged buffers aliases"),
        ),
    ]
}


def is_builtin(profile: HardwareProfile) -> bool:
    """Whether `profile` is a built-in one as shipped (its price and endurance are typical figures)."""
    return BUILTIN.get(profile.name) == profile


def choices() -> str:
    """The built-in profiles in one phrase, for help texts."""
    return ", ".join(f"{name} ({p.device})" for name, p in BUILTIN.items())


def load(name_or_path: str | Path) -> HardwareProfile:
    """A built-in profile by name, or a JSON profile written by `mtjax probe`."""
    key = str(name_or_path)
    if key in BUILTIN:
        return BUILTIN[key]
    path = Path(key)
    if not path.exists():
        raise HardwareError(
            f"no hardware profile {key!r}: use one of {', '.join(BUILTIN)} or a JSON file from `mtjax probe --out`"
        )
    try:
        fields = jsonfile.loads(textfile.read(path), str(path))
    except json.JSONDecodeError as e:
        raise HardwareError(f"{path} is not valid JSON ({e}); re-run `mtjax probe --out {path}`") from None
    known = {f.name for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(fields) - known)
    missing = sorted(f.name for f in dataclasses.fields(HardwareProfile)
                     if f.default is dataclasses.MISSING and f.name not in fields)
    if unknown or missing:
        what = f"unknown keys {unknown}" if unknown else f"missing keys {missing}"
        raise HardwareError(f"{path} is not a hardware profile ({what}); re-run `mtjax probe --out {path}`")
    return HardwareProfile(**fields)
