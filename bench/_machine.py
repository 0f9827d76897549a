"""Machine facts, /proc readings and helpers shared by the benchmarks (Linux; imported as a sibling
module): ``reset_peak`` (trim the heap, reset VmHWM) and ``kiln_lora_init`` (Kiln's seeded LoRA
initialisation written out, so reference and TRL sides start from the same weights)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import os
import platform
import signal
import subprocess
from pathlib import Path
from typing import Any


def filesystem_of(path: Path) -> str:
    """``fstype on device`` of the mount holding ``path`` (from /proc/mounts), or ``unknown``."""
    best, found = "", "unknown"
    target = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, found = mount, f"{fstype} on {device}"
    except OSError:
        pass
    return found


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def memory_status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def reset_peak() -> int:
    """Hand freed heap back, reset VmHWM, return VmRSS (the baseline)."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return memory_status("VmRSS")


def kiln_lora_init(peft_model: Any, seed: int) -> None:
    """The same initial LoRA tensors as ``kiln.training.attach_lora`` (written out, not imported)."""
    import torch

    params = {
        n: p
        for n, p in sorted(peft_model.named_parameters())
        if (".lora_A." in n or ".lora_B." in n) and p.requires_grad
    }
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in params.items():
            if ".lora_A." in name:
                bound = math.sqrt(1.0 / param.shape[1])
                param.copy_(torch.rand(param.shape, generator=generator, dtype=torch.float32) * (2 * bound) - bound)
            else:
                param.zero_()


def make_wide(path: Path, tokenizer_dir: Path, seed: int = 0) -> None:
    """The benches' wider random Qwen2 (hidden 512, 8 layers, 23.2 M parameters) on the tiny tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from kiln.model._tiny import _init_weights, tiny_config

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    fields = tiny_config(len(tok)).to_dict()
    for key in ("layer_types", "architectures", "transformers_version", "model_type"):
        fields.pop(key, None)
    fields.update(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64)  # fmt: skip
    config = Qwen2Config(**fields)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config)
    _init_weights(model, seed)
    model.generation_config.do_sample = False
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """Stop a server the bench started: SIGTERM, 90 s to finish, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
