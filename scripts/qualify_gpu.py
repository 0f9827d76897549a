"""Qualify Kiln on this machine's CUDA device: one command, a receipt of what held and what did not.

    scripts/qualify-gpu [--device cuda] [--out gpu-qualification.json] [--work DIR] [--trl-python PATH]

Checks, each ``passed``, ``failed`` or ``not_run`` (with why); the qualification passes only when every check
passed -- a check that did not run never counts as a pass, and without a CUDA device nothing runs and the command
exits 1:

* ``sft_exact``, ``grpo_exact``, ``opd_exact``: on the tiny model in bf16 on the device, two fresh runs give
  byte-identical adapters, and a run cancelled part-way and resumed from its checkpoint gives the same adapter bytes
  and loss history as an uninterrupted one;
* ``triton_route``: the Triton fused linear-cross-entropy against the float64 torch reference on the device (fp32
  and bf16: loss and the hidden states' gradient), beside the torch fused route (and Liger's kernel when
  ``liger_kernel`` is installed: a figure, not a condition);
* ``memory_vs_plan``: an SFT step on Qwen2.5-0.5B's exact shape (random weights, bf16, 2,048 tokens): the
  device's peak allocation against the memory planner's estimate (passes when the estimate covers the peak);
* ``throughput_vs_trl``: training tokens per second of that run against TRL's ``SFTTrainer`` at the same setting
  on the same device (needs ``trl`` in ``--trl-python``; not run without it); passes when Kiln is at least as fast.

The receipt (JSON, ``kiln.gpu-qualification.v1``) records the commit, the device, the execution envelope (the
device model, compute capability, SM count, library versions and determinism settings within which the exact-resume
results hold), and each check's outcome and figures. docs/gpu.md says what is qualified and what is not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECEIPT_TYPE = "kiln.gpu-qualification.v1"
CHECKS = ("sft_exact", "grpo_exact", "opd_exact", "triton_route", "memory_vs_plan", "throughput_vs_trl")
ROWS = [
    {"messages": [{"role": "user", "content": f"Question {i}: how do I do thing {i}?"},
                  {"role": "assistant", "content": f"Open the menu and pick option {i}, then confirm."}]}
    for i in range(6)
]  # fmt: skip
PROMPT = [{"role": "user", "content": "Is the sky blue today?"}]
GROUP = {
    "messages": PROMPT,
    "completions": [{"text": t, "reward": r} for t, r in (("yes", 1.0), ("no, it is not", 0.0), ("maybe", 0.3))],
}


class NotRunError(Exception):
    """A check that could not run here (its reason); it does not count as a pass."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="the CUDA device to qualify (cuda or cuda:N)")
    parser.add_argument("--out", type=Path, default=Path("gpu-qualification.json"), help="the receipt to write")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--trl-python", default=sys.executable, help="an interpreter with trl, for the TRL check")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    receipt: dict[str, Any] = {
        "schema_version": 1,
        "receipt_type": RECEIPT_TYPE,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "commit": _commit(),
        "host": platform.node(),
        "device": None,
        "envelope": None,
        "checks": {},
        "passed": False,
    }
    from kiln.errors import KilnError, RequestError
    from kiln.model import apply_determinism, execution_envelope, is_cuda, resolve_device

    try:
        if not is_cuda(args.device):
            raise RequestError(
                f"--device {args.device}: the qualification is of a CUDA device (cuda or cuda:N)",
                code="training_backend_unsupported",
            )
        device = resolve_device(args.device, field="--device", pointer=None)
    except KilnError as exc:
        receipt["error"] = exc.message
        for name in CHECKS:
            receipt["checks"][name] = {"outcome": "not_run", "reason": "no CUDA device to qualify"}
        return _finish(receipt, args.out, started)
    apply_determinism(device)  # before anything initialises CUDA
    import torch

    receipt["device"] = f"{device} ({torch.cuda.get_device_name(torch.device(device).index or 0)})"
    receipt["envelope"] = execution_envelope(device)
    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-qualify-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    shared: dict[str, Any] = {}
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        "sft_exact": lambda: _exact("sft", device, work),
        "grpo_exact": lambda: _exact("grpo", device, work),
        "opd_exact": lambda: _exact("opd", device, work),
        "triton_route": lambda: _triton_route(device),
        "memory_vs_plan": lambda: _memory_vs_plan(device, work, shared),
        "throughput_vs_trl": lambda: _throughput_vs_trl(device, work, shared, args.trl_python),
    }
    for name in CHECKS:
        t0 = time.perf_counter()
        print(f"[{time.perf_counter() - started:6.1f} s] {name} ...", flush=True)
        try:
            figures = runs[name]()
            outcome = {"outcome": "passed" if figures.pop("ok") else "failed", **figures}
        except NotRunError as why:
            outcome = {"outcome": "not_run", "reason": str(why)}
        except Exception as exc:  # noqa: BLE001 -- a check that raises failed; the receipt says how
            outcome = {"outcome": "failed", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        outcome["seconds"] = round(time.perf_counter() - t0, 2)
        receipt["checks"][name] = outcome
        print(f"           {name}: {outcome['outcome']}", flush=True)
    return _finish(receipt, args.out, started)


def _finish(receipt: dict[str, Any], out: Path, started: float) -> int:
    receipt["passed"] = bool(receipt["checks"]) and all(c["outcome"] == "passed" for c in receipt["checks"].values())
    receipt["seconds"] = round(time.perf_counter() - started, 2)
    out.write_text(json.dumps(receipt, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name, check in receipt["checks"].items():
        print(f"{name:20} {check['outcome']:8} {check.get('reason') or check.get('error') or ''}")
    verdict = "qualified" if receipt["passed"] else "NOT qualified"
    where = receipt["device"] or receipt.get("error", "no device")
    print(f"{verdict}: {where}; receipt {out}", file=sys.stderr if not receipt["passed"] else sys.stdout)
    return 0 if receipt["passed"] else 1


def _commit() -> str | None:
    git = shutil.which("git")
    if git is None:
        return None
    try:
        done = subprocess.run(
            [git, "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False, timeout=10
        )
    except OSError:
        return None
    return done.stdout.strip() or None


# ----------------------------------------------------------------------------- exact runs


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _exact(kind: str, device: str, work: Path) -> dict[str, Any]:
    """Two fresh runs and a cancel-then-resume of ``kind`` in bf16 on ``device``: the adapter bytes (and the loss
    histories) must agree exactly."""
    from kiln.model import create_tiny
    from kiln.teachers import TeacherRegistry

    base = work / kind
    models = work / "models"
    student = models / "tiny" if (models / "tiny").exists() else create_tiny(models / "tiny", seed=0)
    teacher = models / "teacher" if (models / "teacher").exists() else create_tiny(models / "teacher", seed=2)
    teachers = base / "teachers"
    if kind == "opd" and not teachers.exists():
        TeacherRegistry(teachers).add({"alias": "tutor", "kind": "local", "model_id": str(teacher)})

    def run(registry: Path, name: str, cancel_at: int | None = None, resume: str | None = None) -> Any:
        event = threading.Event()

        def progress(info: dict[str, Any]) -> None:
            if cancel_at is not None and info.get("step") == cancel_at:
                event.set()

        config: dict[str, Any] = {"seed": 7, "device": device, "precision": "bf16", "checkpoint_interval": 1}
        if resume is not None:
            config["resume_checkpoint"] = resume
        if kind == "sft":
            from kiln.trainers.sft import admit_sft, run_sft

            job = admit_sft(
                adapter_name=name,
                registry=registry,
                config={**config, "epochs": 2, "micro_batch_size": 2},
                examples=ROWS,
                model_path=str(student),
            )
            return run_sft(job, progress=progress, cancel=event)
        if kind == "grpo":
            from kiln.trainers.grpo import admit_grpo, run_grpo

            request = {"groups": [GROUP, GROUP, GROUP], "config": {**config, "kl_estimator": "k3"}}
            job = admit_grpo(adapter_name=name, registry=registry, request=request, model_path=str(student))
            return run_grpo(job, progress=progress, cancel=event)
        from kiln.trainers.opd import admit_opd, run_opd

        prompts = [{"messages": [{"role": "user", "content": f"Tell me about {t}."}]} for t in ("cats", "rain")]
        request = {
            "teacher": "tutor",
            "prompts": prompts,
            "config": {**config, "samples_per_prompt": 2, "max_tokens": 8, "top_k": 16},
        }
        job = admit_opd(
            adapter_name=name, registry=registry, request=request, teachers_root=teachers, model_path=str(student)
        )
        return run_opd(job, progress=progress, cancel=event)

    first = run(base / "a", kind)
    second = run(base / "b", kind)
    cancelled = run(base / "c", kind, cancel_at=2)
    from kiln.checkpoints import list_checkpoints

    checkpoints = list_checkpoints(base / "c", kind)
    if not checkpoints:
        return {"ok": False, "error": "the cancelled run published no checkpoint", "status": cancelled.status}
    resumed = run(base / "c", kind, resume=checkpoints[-1].path.name)
    digests = {
        "first": _digest(first.adapter_dir / "adapter_model.safetensors"),
        "second": _digest(second.adapter_dir / "adapter_model.safetensors"),
        "resumed": _digest(resumed.adapter_dir / "adapter_model.safetensors"),
    }
    same_losses = list(first.losses) == list(resumed.losses) == list(second.losses)
    return {
        "ok": len(set(digests.values())) == 1 and same_losses and first.status == "success",
        "adapter_sha256": digests,
        "losses_identical": same_losses,
        "resumed_from": checkpoints[-1].path.name,
        "steps": len(first.losses),
    }


# ----------------------------------------------------------------------------- the Triton route


def _triton_route(device: str) -> dict[str, Any]:
    import torch

    from kiln import kernels

    route = getattr(kernels, "TRITON_FUSED_LINEAR_CE", None)
    if route is None or kernels.select_loss_route(device, torch.bfloat16) != route:
        raise NotRunError("the Triton route is not selected on this device (is triton installed?)")
    torch.manual_seed(0)
    rows, hidden_size, vocab = 257, 896, 151_936 // 8
    figures: dict[str, Any] = {"shape": [rows, hidden_size, vocab]}
    ok = True
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        hidden = (torch.randn(rows, hidden_size, device=device) * 0.5).to(dtype)
        weight = (torch.randn(vocab, hidden_size, device=device) * 0.05).to(dtype)
        labels = torch.randint(0, vocab, (rows,), device=device)
        labels[::5] = -100
        reference = _reference(hidden, weight, labels)
        found: dict[str, Any] = {}
        for name in (route, kernels.FUSED_CHUNKED_LINEAR_CE):
            h = hidden.detach().clone().requires_grad_(True)
            loss = kernels.sft_loss(name, h, weight, labels)
            loss.backward()
            grad = h.grad.double()
            found[name] = {
                "loss_error": abs(float(loss) - reference[0]) / max(abs(reference[0]), 1.0),
                "grad_error": float((grad - reference[1]).abs().max() / reference[1].abs().max().clamp_min(1e-12)),
            }
        liger = _liger(hidden, weight, labels, reference)
        if liger is not None:
            found["liger"] = liger
        key = str(dtype).removeprefix("torch.")
        figures[key] = found
        ok = ok and found[route]["loss_error"] <= tolerance and found[route]["grad_error"] <= tolerance
    return {"ok": ok, **figures}


def _reference(hidden: Any, weight: Any, labels: Any) -> tuple[float, Any]:
    import torch

    h = hidden.detach().double().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(h @ weight.double().T, labels, ignore_index=-100)
    loss.backward()
    return float(loss), h.grad


def _liger(hidden: Any, weight: Any, labels: Any, reference: tuple[float, Any]) -> dict[str, float] | None:
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    h = hidden.detach().clone().requires_grad_(True)
    loss = liger_fused_linear_cross_entropy(h, weight, labels, ignore_index=-100)
    loss.backward()
    return {
        "loss_error": abs(float(loss) - reference[0]) / max(abs(reference[0]), 1.0),
        "grad_error": float((h.grad.double() - reference[1]).abs().max() / reference[1].abs().max()),
    }


# ----------------------------------------------------------------------------- real size


def _real_size(work: Path, shared: dict[str, Any]) -> tuple[Path, Path]:
    if "model" not in shared:
        sys.path.insert(0, str(ROOT / "bench"))
        from bench_real_size import make_model
        from bench_vs_trl import make_data

        model_dir, data = work / "qwen25-05b", work / "rows-2048.jsonl"
        if not model_dir.exists():
            make_model(model_dir)
        make_data(data, model_dir, 4, 2048)
        shared["model"], shared["data"] = model_dir, data
    return shared["model"], shared["data"]


def _memory_vs_plan(device: str, work: Path, shared: dict[str, Any]) -> dict[str, Any]:
    import torch

    from kiln.trainers.sft import admit_sft, run_sft

    model_dir, data = _real_size(work, shared)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = {
        "seed": 1,
        "device": device,
        "precision": "bf16",
        "gradient_checkpointing": "off",
        "lora_rank": 16,
        "lora_alpha": 32,
        "lora_target_modules": targets,
        "optimizer": {"kind": "adam_w"},
        "learning_rate": 1e-4,
    }
    index = torch.device(device).index or 0
    torch.cuda.reset_peak_memory_stats(index)
    job = admit_sft(
        adapter_name="real-size", registry=work / "real", config=config, dataset_path=data, model_path=str(model_dir)
    )
    plan = job.memory_plan
    result = run_sft(job)
    peak = int(torch.cuda.max_memory_allocated(index))
    receipt = json.loads((result.adapter_dir / "train_receipt.json").read_text(encoding="utf-8"))
    phases = receipt["phase_timings"]
    loop_s = sum(phases[k] for k in ("policy_forward_ms", "backward_ms", "optimizer_ms")) / 1000
    counts = receipt["token_counts"]
    tokens = counts["action_tokens"] + counts["context_tokens"]
    shared["kiln_tokens_per_s"], shared["tokens"] = tokens / loop_s, tokens
    estimate = plan.estimate_bytes if plan is not None else None
    return {
        "ok": estimate is not None and peak <= estimate and result.status == "success",
        "peak_allocated_bytes": peak,
        "planned_bytes": estimate,
        "peak_over_plan": None if not estimate else round(peak / estimate, 3),
        "tokens_per_s": round(tokens / loop_s, 1),
    }


def _throughput_vs_trl(device: str, work: Path, shared: dict[str, Any], trl_python: str) -> dict[str, Any]:
    probe = subprocess.run([trl_python, "-c", "import trl"], capture_output=True, check=False)
    if probe.returncode != 0:
        raise NotRunError(
            f"trl is not importable by {trl_python} (pip install trl==1.16.0 there, or pass --trl-python)"
        )
    if "kiln_tokens_per_s" not in shared:
        raise NotRunError("the memory_vs_plan run, whose throughput this compares, did not complete")
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_vs_trl import TRL_SCRIPT

    model_dir, data = _real_size(work, shared)
    script = TRL_SCRIPT.replace("use_cpu=True", "use_cpu=False")
    if script == TRL_SCRIPT:
        raise NotRunError("bench_vs_trl's TRL script no longer pins use_cpu; this check needs updating")
    targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    index = str(torch_index(device))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": index, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [trl_python, "-c", script, str(model_dir), str(data), str(work / "trl"), targets, "1", "1", "bfloat16", "off"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=600,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("TRL_METRICS ")), None)
    if done.returncode != 0 or line is None:
        return {"ok": False, "error": (done.stderr or done.stdout)[-2000:]}
    metrics = json.loads(line.removeprefix("TRL_METRICS "))
    seconds = float(metrics.get("train_runtime", 0.0))
    if seconds <= 0:
        return {"ok": False, "error": f"TRL reported no train_runtime: {metrics}"}
    # the same rows through the same chat template: the same training tokens, so tokens per second compare
    trl_rate = shared["tokens"] / seconds
    kiln_rate = shared["kiln_tokens_per_s"]
    return {
        "ok": kiln_rate >= trl_rate,
        "kiln_tokens_per_s": round(kiln_rate, 1),
        "trl_tokens_per_s": round(trl_rate, 1),
        "kiln_over_trl": round(kiln_rate / trl_rate, 3),
        "trl_train_runtime_s": seconds,
    }


def torch_index(device: str) -> int:
    import torch

    return torch.device(device).index or 0


if __name__ == "__main__":
    sys.exit(main())
