"""``kvserve info``: what this machine is and what kvserve chooses on it.

torch version, device, the CPU features found, threads, what ``--dtype auto`` picks, whether
the C++ kernels loaded and which ISA they run, the matmul path each weight format of a model
takes, and the memory bandwidth measured in about a second.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from kvserve.kernels.build import ISA_NAMES, cache_dir, kernels_enabled, load_kernels
from kvserve.platform import (
    auto_dtype,
    default_device,
    detect_cpu_features,
    kernel_isa,
    measure_memory_bandwidth,
)


@dataclass(slots=True)
class InfoReport:
    torch_version: str
    device: str
    cpu: str
    cpu_features: list[str]
    cpu_features_capped_to: str | None
    threads: int
    auto_dtype: str
    kernels_loaded: bool
    kernels_dir: str
    kernel_isa: str  # the ISA kvserve's kernels run with on this CPU
    memory_bandwidth_gb_s: float
    model: str | None = None
    weights: str | None = None  # resident bytes and formats of the model
    weight_paths: dict[str, str] = field(default_factory=dict)  # format -> matmul path
    kv_cache: str | None = None  # the model's cache per token (MLA: beside its MHA equivalent)

    def as_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [
            f"torch          {self.torch_version}",
            f"device         {self.device}",
            f"cpu            {self.cpu}",
            f"cpu features   {' '.join(self.cpu_features) or '(none of interest)'}"
            + (
                f" (capped to {self.cpu_features_capped_to})" if self.cpu_features_capped_to else ""
            ),
            f"threads        {self.threads}",
            f"dtype auto     {self.auto_dtype}",
            f"C++ kernels    {'loaded' if self.kernels_loaded else 'NOT loaded (PyTorch reference)'}"
            f" [{self.kernels_dir}]",
            f"kernel ISA     {self.kernel_isa}",
            f"memory read    {self.memory_bandwidth_gb_s:.1f} GB/s (measured now)",
        ]
        if self.model is not None:
            out.append(f"model          {self.model}")
            out.append(f"weights        {self.weights}")
            for fmt, path in sorted(self.weight_paths.items()):
                out.append(f"  {fmt:<12} {path}")
            if self.kv_cache is not None:
                out.append(f"kv cache       {self.kv_cache}")
        return out


def collect_info(session=None, device: str | None = None) -> InfoReport:
    """The report; ``session`` (a loaded ModelSession) adds its weights' formats and paths."""
    features = detect_cpu_features()
    device = device or default_device()
    loaded = load_kernels() if torch.device(device).type == "cpu" else False
    isa = kernel_isa(features)
    report = InfoReport(
        torch_version=torch.__version__,
        device=device,
        cpu=features.name,
        cpu_features=features.names(),
        cpu_features_capped_to=features.capped_to,
        threads=torch.get_num_threads(),
        auto_dtype=str(auto_dtype(device, features)).removeprefix("torch."),
        kernels_loaded=loaded,
        kernels_dir=str(cache_dir()) if kernels_enabled() else "disabled by KVSERVE_KERNELS=0",
        kernel_isa=ISA_NAMES[isa] if loaded else "-",
        memory_bandwidth_gb_s=measure_memory_bandwidth(1.0),
    )
    if session is not None and session.weights is not None:
        report.model = str(session.path)
        report.weights = session.weights.summary()
        report.weight_paths = dict(session.weights.paths)
        report.kv_cache = describe_kv_cache(session.model.kv_cache_spec())
    return report


def describe_kv_cache(spec) -> str:
    """e.g. "61 x mla (...): 70,272 B/token, as MHA 4,997,120 B/token (1.4%)"."""
    text = f"{spec.describe()}: {spec.bytes_per_token:,} B/token"
    mha = spec.mha_equivalent_bytes_per_token
    if mha != spec.bytes_per_token:
        text += f", as MHA {mha:,} B/token ({spec.bytes_per_token / mha:.1%})"
    return text
