"""The memory planner: will a training run fit, decided before its weights load.

``plan_memory`` estimates a run's peak memory from what is known before loading -- the model's config and the
safetensors headers (parameter count and shapes), the run's settings (precision, quantization, activation
checkpointing, LoRA rank and targets, optimizer, micro-batch) and the longest sequence a forward will see -- and
holds it to a budget: ``training.memory_limit_bytes`` when configured, else the host's available memory
(``MemAvailable``), else none. The components:

* weights: every stored parameter in the dtype it trains in (2 bytes under bf16, 4 under fp32); under NF4 the
  decoder layers' linear weights take half a byte per parameter plus one float32 scale per 64;
* LoRA: rank x (in + out) float32 values per adapted projection, twice (parameter and gradient); optimizer: the
  float32 slots of each LoRA parameter (AdamW 2, Muon 1, SGD 0);
* activations of one micro-batch of the longest sequence, per token and layer: the tensors autograd keeps for the
  backward pass (``ACTIVATION_WIDTHS``: so many hidden-width, intermediate-width and key/value-width tensors, in the
  activation dtype, plus float32 copies of LoRA inputs under bf16). With checkpointing, each layer keeps only its
  input, and one layer's activations exist again while it is recomputed;
* the loss route's working set: the float32 logits it holds at once (SFT's fused route: the supervised rows times
  one vocabulary chunk; GRPO and OPD: the scored positions times the vocabulary), their softmax and gradient;
* the process's fixed cost (``RUNTIME_BYTES``: Python, torch, transformers, the tokenizer).

The estimate is the larger of that sum and the loading peak: while weights stored in another dtype (or quantized)
load, the mapped files and the converted weights are both resident.

``MemoryPlan.check()`` refuses a run that does not fit with ``memory_budget_exceeded``, naming the estimate, the
budget and the settings that would fit (activation checkpointing, bf16, NF4, a shorter sequence, a smaller
micro-batch), each with its own estimate. ``gradient_checkpointing: auto`` resolves to ``on`` exactly when the run
does not fit with it ``off``. The coefficients were measured on Qwen2-shaped models (bench/README.md, "Memory
planner"); the receipt records the estimate beside the measured peak.

Beside a server (``ServingCopy``): the server's serving copy of the base model may share the job's device. The rule
that releases it for the job (``training.serving_copy``) lives here, with what the planner counts of it:
``serving_copy_bytes_during`` is what the copy holds on the job's device while the job trains, and
``budget_beside_serving_copy`` moves the budget by what the budget's own source could not see -- a measured figure
(the device's free memory, the host's ``MemAvailable``) already excludes a copy resident as it is read, so it gains
the bytes of a copy about to be released and changes for nothing else; a configured limit cannot see the copy, so on
the copy's CUDA device it loses what the copy keeps there (on the CPU a limit bounds the run's own process).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from kiln.documents.jsonio import JsonObject
from kiln.errors import CapacityError
from kiln.model import is_cuda

__all__ = [
    "ACTIVATION_WIDTHS",
    "RUNTIME_BYTES",
    "MemoryBudget",
    "MemoryPlan",
    "MemorySettings",
    "ModelShape",
    "ServingCopy",
    "budget_beside_serving_copy",
    "memory_budget",
    "plan_memory",
    "serving_copy_bytes_during",
    "serving_copy_released",
]

GIB = 2**30
RUNTIME_BYTES = 480 * 2**20  # Python + torch + transformers + peft + a tokenizer, resident before any weight
# tensors autograd keeps per token and decoder layer, in units of the hidden width, the MLP's intermediate width and
# the key/value width (measured: bench/bench_real_size.py --calibrate)
ACTIVATION_WIDTHS = {"hidden": 8.0, "intermediate": 3.5, "kv": 4.0}
NF4_BLOCK = 64
OPTIMIZER_SLOTS = {"adam_w": 2, "muon": 1, "sgd": 0}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
ROUTERS = frozenset({"gate", "router"})


@dataclass(frozen=True)
class MemorySettings:
    """What a job gets when its config leaves a memory setting out (the server's ``training.*``, ``kiln.toml``), and
    the configured budget."""

    precision: str = "auto"
    gradient_checkpointing: str = "auto"
    quantization: str = "none"
    memory_limit_bytes: int | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N (kiln.model.resolve_device)
    serving_copy: ServingCopy | None = None  # a server's serving copy beside the job, which its budget counts

    @classmethod
    def of(cls, training: Any) -> MemorySettings:
        """From the ``[training]`` section of resolved settings (``kiln.host.config.TrainingSettings``)."""
        return cls(
            precision=str(training.precision),
            gradient_checkpointing=str(training.gradient_checkpointing),
            quantization=str(training.quantization),
            memory_limit_bytes=training.memory_limit_bytes,
            device=str(training.device),
        )


@dataclass(frozen=True)
class MemoryBudget:
    bytes: int | None
    source: str  # configured_limit | host_available_memory | device_memory | unknown
    # a server job's: what the planner counted of the server's serving copy on the job's device (None: no server)
    serving_copy_bytes: int | None = None
    moved_by: int = 0  # what ``budget_beside_serving_copy`` added to the source's figure (negative: took off)

    def describe(self) -> str:
        where = {
            "configured_limit": "training.memory_limit_bytes",
            "host_available_memory": "the host's available memory",
            "device_memory": "the device's memory",
            "unknown": "unknown",
        }[self.source]
        if self.moved_by > 0:
            where += f", with the {_gib(self.moved_by)} the server's serving copy frees when it is released for the job"
        elif self.moved_by < 0:
            where += f", less the {_gib(-self.moved_by)} the server's serving copy keeps on this device"
        return f"{_gib(self.bytes or 0)} ({where})"


@dataclass(frozen=True)
class ServingCopy:
    """The server's serving copy of the base model, as the planner of a job beside it sees it."""

    device: str  # where it lives when resident: cpu | cuda:N
    bytes: int  # what its parameters and buffers hold there
    policy: str  # training.serving_copy: keep | release | auto
    resident: bool  # on its device as the job is planned (False: released for the job)

    def released_for(self, job_device: str) -> bool:
        return serving_copy_released(self.policy, serving_device=self.device, job_device=job_device)

    def budget(self, budget: MemoryBudget, job_device: str) -> MemoryBudget:
        """``budget`` (read for a job on ``job_device``) moved by what its source could not see of this copy."""
        return budget_beside_serving_copy(
            budget,
            during=serving_copy_bytes_during(
                self.bytes, serving_device=self.device, job_device=job_device, policy=self.policy
            ),
            now=self.bytes if self.resident and self.device == job_device else 0,
            job_device=job_device,
        )


def serving_copy_released(policy: str, *, serving_device: str, job_device: str) -> bool:
    """Whether the serving copy is released while a job on ``job_device`` trains: ``keep`` never, ``release``
    always, ``auto`` exactly when the job trains on the CUDA device the copy is on."""
    if policy == "keep":
        return False
    if policy == "release":
        return True
    if policy != "auto":
        raise ValueError(f"serving_copy {policy!r} is not one of keep, release, auto")
    return is_cuda(job_device) and job_device == serving_device


def serving_copy_bytes_during(serving_bytes: int, *, serving_device: str, job_device: str, policy: str) -> int:
    """The bytes the planner must treat as taken on ``job_device`` by the serving copy while the job trains: all of
    them when the copy stays on that device (the host's memory, for a CPU job beside a CPU copy), none when it is
    released for the job or lives on another device."""
    if serving_copy_released(policy, serving_device=serving_device, job_device=job_device):
        return 0
    return serving_bytes if serving_device == job_device else 0


def budget_beside_serving_copy(budget: MemoryBudget, *, during: int, now: int, job_device: str) -> MemoryBudget:
    """``budget`` moved by what its source could not see of the serving copy. ``during``: what the copy holds on
    the job's device while the job trains (``serving_copy_bytes_during``); ``now``: what it holds there as the
    budget is read. A measured figure (``device_memory``, ``host_available_memory``) already excludes ``now``, so it
    moves by ``now - during``; a configured limit sees nothing, so on a CUDA device it loses ``during`` (on the CPU the
    limit bounds the run's own process, which the copy is not part of); no budget stays none."""
    if budget.bytes is None:
        moved = 0
    elif budget.source in ("device_memory", "host_available_memory"):
        moved = now - during
    elif budget.source == "configured_limit" and is_cuda(job_device):
        moved = -during
    else:
        moved = 0
    size = None if budget.bytes is None else max(0, budget.bytes + moved)
    return replace(budget, bytes=size, serving_copy_bytes=during, moved_by=moved)


def memory_budget(limit: int | None, *, device_free: int | None = None) -> MemoryBudget:
    """The configured limit, else a device run's free device memory now (``device_free``: what every resident copy
    leaves), else the host's available memory now (``MemAvailable``), else no budget."""
    if limit is not None:
        return MemoryBudget(limit, "configured_limit")
    if device_free is not None:
        return MemoryBudget(device_free, "device_memory")
    available = host_available_memory()
    return MemoryBudget(available, "host_available_memory" if available is not None else "unknown")


def host_available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where the system does not say)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class ModelShape:
    """What the planner knows of a model before loading it."""

    layers: int
    hidden: int
    intermediate: int
    kv_width: int
    vocab: int
    parameters: int  # every stored parameter
    stored_bytes: int  # the weight files' tensor bytes
    linear_parameters: int  # the decoder layers' 2-D projection weights (what NF4 quantizes)
    projections: dict[str, tuple[int, int]]  # leaf name -> (sum over layers of in + out, count)

    @classmethod
    def of(cls, config: Any, weights: Any) -> ModelShape:
        """From a transformers config and a ``kiln.model.WeightsInfo`` (the safetensors headers)."""
        text = getattr(config, "text_config", None) or config
        hidden = int(_first(text, ("hidden_size", "n_embd", "d_model"), 0))
        layers = int(_first(text, ("num_hidden_layers", "n_layer", "num_layers"), 0))
        intermediate = int(_first(text, ("intermediate_size", "n_inner", "ffn_dim"), 0) or 4 * hidden)
        heads = int(_first(text, ("num_attention_heads", "n_head"), 1) or 1)
        kv_heads = int(_first(text, ("num_key_value_heads",), heads) or heads)
        head_dim = int(_first(text, ("head_dim",), 0) or hidden // max(1, heads))
        projections: dict[str, tuple[int, int]] = {}
        linear = 0
        for name, shape in weights.shapes.items():
            parts = name.split(".")
            if len(shape) != 2 or parts[-1] != "weight" or not any(p.isdigit() for p in parts[:-2]):
                continue
            leaf = parts[-2]
            linear += shape[0] * shape[1]
            total, count = projections.get(leaf, (0, 0))
            projections[leaf] = (total + shape[0] + shape[1], count + 1)
        return cls(
            layers=layers,
            hidden=hidden,
            intermediate=intermediate,
            kv_width=kv_heads * head_dim,
            vocab=int(_first(text, ("vocab_size",), 0)),
            parameters=int(weights.parameters),
            stored_bytes=int(weights.stored_bytes),
            linear_parameters=linear,
            projections=projections,
        )


def _first(config: Any, names: tuple[str, ...], default: Any) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


@dataclass(frozen=True)
class PlanInputs:
    """A run's settings, as the planner sees them."""

    precision: str  # fp32 | bf16
    quantization: str  # none | nf4
    gradient_checkpointing: str  # on | off
    lora_rank: int
    targets: tuple[str, ...] | None  # None: every projection but the routers
    optimizer_kind: str
    micro_batch_size: int
    tokens: int  # the longest sequence a forward sees
    loss_logits: int  # float32 logits the loss route holds at once (rows x vocabulary columns)


def estimate(shape: ModelShape, run: PlanInputs) -> dict[str, int]:
    """The peak memory of ``run`` on ``shape`` by component, in bytes."""
    width = DTYPE_BYTES[run.precision]
    if run.quantization == "nf4":
        rest = shape.parameters - shape.linear_parameters
        weights = shape.linear_parameters // 2 + shape.linear_parameters // NF4_BLOCK * 4 + rest * width
    else:
        weights = shape.parameters * width
    chosen = [leaf for leaf in shape.projections if leaf not in ROUTERS] if run.targets is None else run.targets
    lora_values = sum(run.lora_rank * shape.projections.get(leaf, (0, 0))[0] for leaf in chosen)
    adapted = sum(shape.projections.get(leaf, (0, 0))[1] for leaf in chosen) / max(1, shape.layers)
    tokens = run.tokens * run.micro_batch_size
    per_layer = (
        width
        * (
            ACTIVATION_WIDTHS["hidden"] * shape.hidden
            + ACTIVATION_WIDTHS["intermediate"] * shape.intermediate
            + ACTIVATION_WIDTHS["kv"] * shape.kv_width
        )
        + 4 * run.lora_rank * adapted
    )
    if run.precision != "fp32":  # peft runs LoRA in float32: its inputs are kept as float32 copies
        per_layer += 4 * (3 * shape.hidden + shape.intermediate)
    if run.gradient_checkpointing == "on":
        activations = tokens * (shape.layers * shape.hidden * width + per_layer)
    else:
        activations = tokens * shape.layers * per_layer
    activations += tokens * shape.hidden * 4 * 4  # embeddings, final norm, the hidden states the head reads
    loss = run.loss_logits * 4 * 3  # logits, their softmax and gradient, float32
    return {
        "weights_bytes": int(weights),
        "lora_bytes": int(lora_values * 4 * 2),
        "optimizer_bytes": int(lora_values * 4 * OPTIMIZER_SLOTS.get(run.optimizer_kind, 2)),
        "activations_bytes": int(activations),
        "loss_bytes": int(loss),
        "runtime_bytes": RUNTIME_BYTES,
    }


@dataclass(frozen=True)
class MemoryPlan:
    """A run's estimate held to its budget."""

    shape: ModelShape
    run: PlanInputs
    components: dict[str, int]
    budget: MemoryBudget
    seq_len_field: str | None  # the config member that bounds the sequence (SFT: max_seq_len), if any
    processes: int = 1  # processes on this machine that each hold all of it (data-parallel ranks)

    @property
    def loading_peak_bytes(self) -> int:
        """The peak while the weights load: the runtime and the weights, plus the mapped weight files when the
        weights are converted on the way in (another dtype, or NF4)."""
        c = self.components
        stored = 4 * self.shape.parameters if self.run.precision == "fp32" else 2 * self.shape.parameters
        converted = self.run.quantization != "none" or self.shape.stored_bytes != stored
        return c["runtime_bytes"] + c["weights_bytes"] + (self.shape.stored_bytes if converted else 0)

    @property
    def estimate_bytes(self) -> int:
        """The larger of the training peak (every component) and the loading peak, for every process."""
        return max(sum(self.components.values()), self.loading_peak_bytes) * self.processes

    @property
    def fits(self) -> bool:
        return self.budget.bytes is None or self.estimate_bytes <= self.budget.bytes

    def variant(self, **changes: Any) -> MemoryPlan:
        run = replace(self.run, **changes)
        return replace(self, run=run, components=estimate(self.shape, run))

    def record(self) -> JsonObject:
        """The receipt's ``runtime.memory_plan``."""
        return {
            "estimate_bytes": self.estimate_bytes,
            "loading_peak_bytes": self.loading_peak_bytes,
            "processes": self.processes,
            "budget_bytes": self.budget.bytes,
            "budget_source": self.budget.source,
            **(
                {} if self.budget.serving_copy_bytes is None else {"serving_copy_bytes": self.budget.serving_copy_bytes}
            ),
            "components": dict(self.components),
            "longest_sequence_tokens": self.run.tokens,
            "micro_batch_size": self.run.micro_batch_size,
            "precision": self.run.precision,
            "gradient_checkpointing": self.run.gradient_checkpointing,
            "quantization": self.run.quantization,
        }

    def fitting_settings(self) -> list[str]:
        """The changes that would make this run fit, each with its estimate (cheapest in quality first)."""
        out = []
        candidates: list[tuple[str, dict[str, Any]]] = []
        if self.run.gradient_checkpointing == "off":
            candidates.append(("gradient_checkpointing on", {"gradient_checkpointing": "on"}))
        if self.run.precision == "fp32":
            candidates.append(("precision bf16", {"precision": "bf16"}))
            if self.run.gradient_checkpointing == "off":
                candidates.append(
                    (
                        "gradient_checkpointing on with precision bf16",
                        {"gradient_checkpointing": "on", "precision": "bf16"},
                    )
                )
        if self.run.quantization == "none":
            candidates.append(
                (
                    "quantization nf4 with gradient_checkpointing on",
                    {"quantization": "nf4", "gradient_checkpointing": "on"},
                )
            )
        if self.run.micro_batch_size > 1:
            candidates.append(("micro_batch_size 1", {"micro_batch_size": 1}))
        for label, changes in candidates:
            plan = self.variant(**changes)
            if plan.fits:
                out.append(f"{label} (about {_gib(plan.estimate_bytes)})")
        tokens = self._longest_fitting()
        if tokens is not None and tokens < self.run.tokens:
            bound = self.seq_len_field or "shorter sequences"
            out.append(f"{bound} {tokens}" if self.seq_len_field else f"sequences of at most {tokens} tokens")
        return out

    def _longest_fitting(self) -> int | None:
        low, high = 0, self.run.tokens
        if self.variant(tokens=1).fits is False:
            return None
        while low < high:
            middle = (low + high + 1) // 2
            if self.variant(tokens=middle).fits:
                low = middle
            else:
                high = middle - 1
        return low or None

    def check(self) -> None:
        """Refuse the run with ``memory_budget_exceeded`` when it does not fit its budget."""
        if self.fits:
            return
        parts = ", ".join(f"{k.removesuffix('_bytes')} {_gib(v)}" for k, v in self.components.items() if v)
        if self.processes > 1:
            parts += f"; each of {self.processes} processes"
        fitting = self.fitting_settings()
        settings = (
            f"precision {self.run.precision}, gradient_checkpointing {self.run.gradient_checkpointing}, quantization "
            f"{self.run.quantization}, micro_batch_size {self.run.micro_batch_size}, longest sequence "
            f"{self.run.tokens} tokens"
        )
        raise CapacityError(
            f"this run needs about {_gib(self.estimate_bytes)} ({parts}) with {settings}; the budget is "
            f"{self.budget.describe()}"
            + (f". It would fit with: {'; '.join(fitting)}" if fitting else ". No single setting makes it fit"),
            code="memory_budget_exceeded",
            hint="change the settings named above (config fields or --gradient-checkpointing, --precision, "
            "--quantization, --max-seq-len, --micro-batch-size), or raise training.memory_limit_bytes"
            if fitting
            else "use a smaller model, shorter rows, or a machine with more memory",
        )


def plan_memory(
    shape: ModelShape,
    *,
    precision: str,
    quantization: str,
    gradient_checkpointing: str,
    lora_rank: int,
    targets: tuple[str, ...] | None,
    optimizer_kind: str,
    micro_batch_size: int,
    tokens: int,
    loss_logits: int,
    budget: MemoryBudget,
    seq_len_field: str | None = None,
    processes: int = 1,
) -> MemoryPlan:
    """The plan of a run; ``gradient_checkpointing`` ``auto`` resolves to ``on`` exactly when ``off`` does not fit."""
    run = PlanInputs(
        precision=precision,
        quantization=quantization,
        gradient_checkpointing="off" if gradient_checkpointing == "auto" else gradient_checkpointing,
        lora_rank=lora_rank,
        targets=targets,
        optimizer_kind=optimizer_kind,
        micro_batch_size=micro_batch_size,
        tokens=max(1, tokens),
        loss_logits=max(1, loss_logits),
    )
    plan = MemoryPlan(shape, run, estimate(shape, run), budget, seq_len_field, max(1, processes))
    if gradient_checkpointing == "auto" and not plan.fits:
        plan = plan.variant(gradient_checkpointing="on")
    return plan


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB" if value >= GIB / 10 else f"{math.ceil(value / 2**20)} MiB"
