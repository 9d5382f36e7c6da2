"""Engine configuration: one frozen, validated dataclass, parsed once at the edge (CLI, config.pbtxt)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from slora.kernels.settings import KernelSettings, settings_from

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. Sizes are bytes; invalid values raise ValueError naming the field.

    The page pool is `pool_bytes` if given, else `pool_fraction` of the device memory left free after the weights
    (CUDA), else 512 MiB (CPU).
    """

    model: str = "default"  # "default" (embedded SmolLM2-135M-Instruct) or a checkpoint directory
    tokenizer: str | None = None  # defaults to the model directory
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | float16 | bfloat16
    load_format: str = "safetensors"  # safetensors | dummy (random weights of the checkpoint's shapes)
    # Tokens per KV page. None (auto): 16, doubled until a page holds the model's widest adapter row (a model whose
    # few KV heads make small pages, Qwen2.5-7B's 4 for an MLP row of 18944, needs 32); a value given is kept.
    page_size: int | None = None
    pool_bytes: int | None = None
    pool_fraction: float | None = None
    # The "what unified paging buys" ablation (S-LoRA's Fig. 5, "no unified memory"): None, the default, is the
    # unified pool, KV blocks and adapter weights taking pages from one free list. A fraction in (0, 1) reserves that
    # share of the pool's pages for adapter weights only and leaves the rest to KV only (memory/page_pool.py): an
    # adapter larger than its region, or a request's KV larger than the rest, is refused.
    adapter_region_fraction: float | None = None
    # Fields whose default is None ("auto") are resolved once at start from the device, the model and the pool, each
    # by a rule of backend/engine/defaults.py, and logged; on CPU they resolve to what they were before "auto".
    max_batch_tokens: int | None = None  # token budget of one step (prefill chunks + decodes); auto: 2048 on CPU
    max_num_seqs: int | None = None  # running requests at most; auto: 256 on CPU, from the pool's tokens on CUDA
    max_model_len: int | None = None  # prompt + output tokens; defaults to the model's context
    max_waiting: int = 4096  # queued requests beyond this are refused (EngineOverloadedError)
    adapter_root: str | None = None  # adapters found by name: <adapter_root>/<name>/adapter_config.json
    adapter_registry: str | None = None  # multi_lora.json: {"name": "path", ...}
    # Host memory for adapters, LRU beyond it; auto: 8 GiB on CPU, on CUDA a share of the machine's available memory.
    host_budget_bytes: int | None = None
    # Load known adapters into host memory at start (as S-LoRA assumes), up to host_budget_bytes; auto: on for CUDA.
    preload_adapters: bool | None = None
    pin_host_adapters: bool = False  # page-lock each adapter in host memory (slow to allocate; see AdapterCache)
    max_lora_rank: int = 256
    prefetch_adapters: int = 8  # adapters of queued requests loaded ahead into free pages
    # While requests decode, admit waiting ones on every Nth step only (1: every step). A step with prompts runs
    # eagerly (no CUDA graph) and costs a fixed host time to launch: fewer, larger such steps cost less, for a
    # first token later by up to N - 1 steps. Adapter prefetch still runs every step. (vLLM's delay factor.)
    # 0 (auto): AUTO_ADMIT_INTERVAL with cuda_graphs, where decode steps are graphs and cheap next to eager ones
    # (the interval that served S-LoRA's S1 trace fastest, perf/RESULTS.md), else 1.
    admit_interval: int = 0
    kernel_backend: str = "auto"  # auto | torch | triton | bmm (S-LoRA's padded-rank baseline)
    # Replay decode steps as captured CUDA graphs (CUDA + triton kernels; cuda_graphs.py), buckets up to
    # max_num_seqs; auto: on where the Triton kernels run on CUDA, without tensor parallelism.
    cuda_graphs: bool | None = None
    # Replay steps with prompts as captured CUDA graphs too (mixed_graphs.py), buckets of tokens up to
    # mixed_cuda_graph_tokens and of sequences up to max_num_seqs, captured at start; needs cuda_graphs. auto: on
    # with cuda_graphs. Larger steps run eagerly: their GPU time hides their launches, and a graph's padding would
    # cost GPU time. auto: defaults.AUTO_MIXED_GRAPH_TOKENS, at most max_batch_tokens.
    mixed_cuda_graphs: bool | None = None
    mixed_cuda_graph_tokens: int | None = None
    # How the Triton kernels run a step (kernel_backend triton, or auto on CUDA; the torch references ignore these).
    # They reach the kernels as one kernels.settings.KernelSettings (kernel_settings()), built where the engine
    # builds its ops. Defaults: the rules that served the H200 benchmarks best (perf/RESULTS.md).
    # A LoRA step whose adapter tokens are at least few_adapters_min_tokens, over at most few_adapters_max
    # adapters, runs on the 16-token tensor-core tiles even when all are decodes: a tile reads its adapter's rows
    # once per 16 tokens, the GEMV kernels once per token. A decode graph of such steps sizes its tile grid for
    # few_adapters_max partial tiles beyond its full ones (executor/static_lora.py). few_adapters_max=0: never.
    few_adapters_min_tokens: int = 32  # adapter tokens in the step at least
    few_adapters_max: int = 8  # adapters in the step at most
    # An eager step's decodes in LoRA launches of their own (GEMV kernels), apart from its prompts (prompt tiles),
    # instead of one launch pair for both on decode-shaped tensor-core tiles, which spend a 16-row tile on each
    # decode. On: the step's LoRA kernels take less GPU time than the second launch pair costs the host, which an
    # eager step's GPU time hides (perf/RESULTS.md).
    lora_split: bool = True
    # The same two launch groups in graphs of steps with prompts, each on a static tile buffer sized for any step of
    # the bucket, and a graph of prompt tiles alone for steps of few adapters (static_lora.mixed_tiling). Off: one
    # launch pair on 16-token tensor-core tiles. Off by default until a served A/B shows the split faster than the
    # pair (perf/RESULTS.md, session 41).
    graph_lora_split: bool = False
    # A step's decodes of many adapters (decode graphs, and an eager step's decodes, launched apart from its
    # prompts as with lora_split) on one fused LoRA kernel per call, shrink and expand together, for adapters of rank
    # up to 16 (kernels/triton/lora_fused.py); steps of few adapters, prompts and larger ranks keep the pair. Off:
    # it only matches the pair on eager decode steps, loses in decode graphs (their rank bound narrows its steps),
    # and gains less than lora_split on steps with prompts (perf/RESULTS.md).
    lora_fused: bool = False
    # Base projections of steps of up to 64 rows (decodes of up to 64 requests) on the Triton GEMM of
    # kernels/triton/gemm.py, which lets the LoRA shrink behind it start early; larger steps stay on cuBLAS.
    triton_gemm: bool = True
    # Programmatic dependent launch of the LoRA kernels (Hopper and later; ignored elsewhere): each kernel starts
    # while the one in front of it ends (kernels/triton/pdl.py). shrink_pdl: the shrink too, behind the Triton GEMM
    # (the expand keeps it behind the shrink); needs lora_pdl.
    lora_pdl: bool = True  # off: no LoRA kernel launched with PDL (to compare, or if a driver mishandles it)
    shrink_pdl: bool = True  # off: the shrink alone launched without it
    # Launch each step before reading the previous step's tokens back, so that the host's work for a step overlaps
    # the GPU's for the one before (backend/engine/inflight.py). None (auto): on for CUDA devices, off on CPU, where the
    # host does the computing itself and outputs would only come a step later.
    overlap_steps: bool | None = None
    # A waiting request whose adapter copy into the pool the copier thread has not issued yet is passed over at
    # admission (it keeps its place at the head of the queue; the requests behind it may go first) while other
    # requests run, instead of the step waiting on the host for that copy. None (auto): on for CUDA devices, where
    # copies run beside the steps and a step that waits for one holds every running request up.
    admit_when_copied: bool | None = None
    warmup: bool | None = None  # synthetic batches at start so kernels compile before requests (warmup.py); auto: CUDA
    seed: int = 0  # for requests that give no seed
    # Which waiting request is admitted next (backend/engine/scheduling_policy.py): fcfs (arrival order), fair
    # (VTC: the tenant served least, by weighted tokens), priority (the request's `priority`, higher first, aged).
    # A request's tenant is its `tenant` argument, else its adapter, else "<base>" (backend/engine/tenants.py).
    # fcfs is the default. Cost does not decide it: without overload, each policy's throughput is within 3% of fcfs's
    # (perf/RESULTS.md). What decides it is that fair isolates tenants only with itl_slo_s, a per-model value. Without
    # itl_slo_s, a flood that fits the batch slows everyone under either policy. So fair is opted into together with
    # itl_slo_s (docs/serving.md).
    scheduling_policy: str = "fcfs"
    tenant_weights_file: str | None = None  # JSON {"tenant": weight > 0}; 1.0 for tenants not in it (fair)
    fair_prompt_cost: float = 1.0  # fair: service counted per prompt token (the paper's w_p) ...
    fair_output_cost: float = 2.0  # ... and per output token (w_q): decoding costs more per token than prefill
    # priority: priority levels a waiting request gains per second, so that low priority never starves: one of
    # priority p waits behind newer arrivals of priority q > p for at most (q - p) / priority_aging_rate seconds.
    priority_aging_rate: float = 1.0
    # First-token SLO in seconds for requests that give none (a request's `ttft_slo_s` replaces it): a waiting
    # request whose first token can no longer come in time is refused (finish_reason "rejected", SloRefusedError,
    # UNAVAILABLE from servers) so that the admitted ones meet it (S-LoRA's early abort; backend/engine/slo.py).
    ttft_slo_s: float | None = None
    # Refuse, before its deadline passes, a request that the measured rates say would miss it (False: only once
    # its deadline has passed).
    early_abort: bool = True
    queue_timeout_s: float | None = None  # refuse a request not admitted this many seconds after it arrived
    # Inter-token latency target in seconds: while steps take longer on average, no more requests are admitted to
    # the batch (the waiting ones queue in the policy's order), so that a flood cannot slow every running request
    # down (backend/engine/batch_limit.py). None: the batch takes requests up to max_num_seqs and the pool's room.
    itl_slo_s: float | None = None
    tenant_stats_top: int = 16  # EngineStats.tenants: this many tenants, those with most requests queued (0: none)
    # Tensor parallelism (backend/parallel/): the base model, each rank's share of the KV cache and of every adapter
    # (S-LoRA's LoRA partition) split over this many devices: GPUs cuda:N .. cuda:N+size-1 from the configured
    # device on (NCCL), or processes on the CPU (gloo). The engine's process is rank 0 and schedules; it starts one
    # worker process for each other rank. 1: none. No CUDA graphs or bmm kernels with it yet.
    tensor_parallel_size: int = 1
    # ---- the disk tier and adapter-aware admission (backend/adapters/read_ahead.py, image_cache.py; scheduler.py)
    # Adapters of the next waiting requests (in the policy's order) read from disk into host memory ahead of their
    # admission, on the store's reader threads; what they hold is bounded by a quarter of host_budget_bytes.
    adapter_read_ahead: int = 32
    # A waiting request the pool has no room for is passed over (keeping its place) until this many requests behind
    # it have been admitted ahead of it, then admission waits at it: requests whose adapters are resident run
    # meanwhile, and none starves. 0: strict order (admission stops at the first request that does not fit).
    # None (auto): 0 on CPU (the order engines always had there), defaults.AUTO_MAX_BYPASS on CUDA.
    max_bypass: int | None = None
    # Converted page images of adapters on local disk (image_cache.py): "auto" (a folder of $SLORA_CACHE on CUDA
    # servers without tensor parallelism, off on CPU), "off", or a directory.
    adapter_image_cache: str = "auto"

    def __post_init__(self) -> None:
        _positive(self, "max_waiting")
        for name in ("page_size", "max_batch_tokens", "max_num_seqs", "host_budget_bytes", "mixed_cuda_graph_tokens"):
            if getattr(self, name) is not None:
                _positive(self, name)
        _check_disk_tier(self)
        _positive(self, "max_lora_rank")
        self.kernel_settings()  # validates the kernel fields, naming the field
        _integer_at_least(self, 0, "0 (auto) or a positive integer", "admit_interval")
        if self.pool_bytes is not None:
            _positive(self, "pool_bytes")
        if self.max_model_len is not None:
            _positive(self, "max_model_len")
        if self.pool_fraction is not None and not 0.0 < self.pool_fraction < 1.0:
            raise ValueError(f"pool_fraction must be in (0, 1), got {self.pool_fraction!r}")
        if self.pool_bytes is not None and self.pool_fraction is not None:
            raise ValueError("give pool_bytes or pool_fraction, not both")
        _check_adapter_region(self)
        if self.prefetch_adapters < 0:
            raise ValueError(f"prefetch_adapters must be >= 0, got {self.prefetch_adapters}")
        _choice(self, "dtype", ("auto", *_DTYPES))
        _choice(self, "load_format", ("safetensors", "dummy"))
        _choice(self, "kernel_backend", ("auto", "torch", "triton", "bmm"))
        _choice(self, "scheduling_policy", ("fcfs", "fair", "priority"))
        _positive_number(self, "fair_prompt_cost", "fair_output_cost", "priority_aging_rate")
        for name in ("ttft_slo_s", "queue_timeout_s", "itl_slo_s"):
            if getattr(self, name) is not None:
                _positive_number(self, name)
        _integer_at_least(self, 0, "an integer >= 0", "tenant_stats_top")
        _check_tensor_parallel(self)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available")
        return device

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    def kernel_settings(self) -> KernelSettings:
        """The kernel fields (few_adapters_* .. shrink_pdl) as the frozen value the kernels take."""
        return settings_from(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        """Build from string or typed values (config.pbtxt parameters, CLI); unknown keys are refused."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"unknown engine option {key!r} (known: {', '.join(sorted(known))})")
            kwargs[key] = _parse(key, value, str(known[key].type))
        return cls(**kwargs)


def _parse(key: str, value: Any, type_name: str) -> Any:
    if not isinstance(value, str):
        return value
    if value == "" or value.lower() == "none":
        if "None" in type_name:
            return None
        raise ValueError(f"{key} needs a value")
    if value.lower() == "auto" and "None" in type_name and not type_name.startswith("str"):
        return None  # an option resolved at start (backend/engine/defaults.py)
    try:
        if type_name.startswith("int"):
            return parse_size(value)
        if type_name.startswith("float"):
            return float(value)
        if type_name.startswith("bool"):
            return {"true": True, "1": True, "false": False, "0": False}[value.lower()]
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{key}: cannot parse {value!r} as {type_name}") from exc
    return value


def parse_size(text: str) -> int:
    """'4096', '512MiB', '8GiB', '2GB' → bytes (or a plain integer)."""
    units = {"kib": 1 << 10, "mib": MiB, "gib": GiB, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(lowered)


AUTO_ADMIT_INTERVAL = 2  # admit_interval=0 with cuda_graphs


def effective_admit_interval(config: EngineConfig) -> int:
    """config.admit_interval, with 0 (auto) resolved: AUTO_ADMIT_INTERVAL with CUDA graphs, 1 without."""
    if config.admit_interval:
        return config.admit_interval
    return AUTO_ADMIT_INTERVAL if config.cuda_graphs else 1


def overlap_enabled(config: EngineConfig, device: torch.device) -> bool:
    """config.overlap_steps, with None (auto) resolved: on for CUDA devices."""
    return config.overlap_steps if config.overlap_steps is not None else device.type == "cuda"


def admit_when_copied(config: EngineConfig, device: torch.device) -> bool:
    """config.admit_when_copied, with None (auto) resolved: on for CUDA devices."""
    return config.admit_when_copied if config.admit_when_copied is not None else device.type == "cuda"


def _positive(config: EngineConfig, *names: str) -> None:
    _integer_at_least(config, 1, "a positive integer", *names)


def _integer_at_least(config: EngineConfig, minimum: int, what: str, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be {what}, got {value!r}")


def _positive_number(config: EngineConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        # `not 0 < value < inf` also refuses NaN
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_tensor_parallel(config: EngineConfig) -> None:
    _positive(config, "tensor_parallel_size")
    if config.tensor_parallel_size > 1 and config.cuda_graphs:
        raise ValueError("tensor_parallel_size > 1 does not run CUDA graphs yet: set cuda_graphs=false")
    if config.mixed_cuda_graphs and config.cuda_graphs is False:
        raise ValueError("mixed_cuda_graphs needs cuda_graphs: set cuda_graphs=true or mixed_cuda_graphs=false")
    if config.tensor_parallel_size > 1 and config.kernel_backend == "bmm":
        raise ValueError("tensor_parallel_size > 1 needs kernel_backend auto, torch or triton, not 'bmm'")


def _check_adapter_region(config: EngineConfig) -> None:
    value = config.adapter_region_fraction
    if value is None:
        return
    # `not 0 < value < 1` also refuses NaN
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"adapter_region_fraction must be None (unified pool) or in (0, 1), got {value!r}")
    if config.tensor_parallel_size > 1:
        # Every rank's pool replays rank 0's allocations (parallel/pool_mirror.py), built without regions.
        raise ValueError("adapter_region_fraction needs tensor_parallel_size 1 (the ablation runs on one device)")


def _check_disk_tier(config: EngineConfig) -> None:
    _integer_at_least(config, 0, "an integer >= 0", "adapter_read_ahead")
    if config.max_bypass is not None:
        _integer_at_least(config, 0, "an integer >= 0", "max_bypass")
    if not isinstance(config.adapter_image_cache, str) or not config.adapter_image_cache.strip():
        raise ValueError(f"adapter_image_cache must be auto, off or a directory, got {config.adapter_image_cache!r}")


def _choice(config: EngineConfig, name: str, choices: tuple[str, ...]) -> None:
    if getattr(config, name) not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(config, name)!r}")
