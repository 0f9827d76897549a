"""GRPO step time and peak memory per group: Kiln's trainer versus TRL and a plain PyTorch loop.

    python bench/bench_grpo.py                 # tiny + wide model, groups of 4 and 16, 2 rounds (~6 min, 2 cores)
    python bench/bench_grpo.py --quick         # tiny model only, 2 timed groups per side, 1 round (~1 min)
    python bench/bench_grpo.py --no-trl        # skip TRL (it needs trl==1.16 in --trl-python)
    python bench/bench_grpo.py --models wide --group-sizes 16 --prompt-tokens 486 --completion-tokens 28 \
        --sides kiln_batched,kiln_off,ref_batched,trl   # long shared prompts (~500 tokens), ~30-token completions

Every side trains the same LoRA policy on the same pre-scored groups, one optimizer step per
group, and runs in its own fresh interpreter so peak RSS is that side's alone:

* ``kiln``        -- ``admit_grpo`` + ``run_grpo`` exactly as ``kiln train grpo`` runs them
  (inline groups, ``token_level`` aggregation, ``prefix_sharing`` auto): the group's prompt
  once, then one suffix forward per completion (policy, and reference with the adapter
  disabled), the receipt's audits, then publication.
* ``kiln_batched`` -- the same with ``micro_batch_size`` = the group size: the prompt once, then
  the group's suffixes right-padded in one policy forward and one reference forward inside a
  single ``disable_adapter()``, the model's logits computed only at the action positions.
* ``kiln_off``    -- ``kiln_batched`` with ``prefix_sharing`` off: every completion runs its whole
  sequence, prompt included (the route before prompts were shared).
* ``ref_batched`` -- a plain PyTorch loop: the group right-padded to ``[B, T]``, one no-grad
  reference forward with the adapter disabled, one policy forward, the loss, backward, step.
* ``ref_loop``    -- the same loss with one forward per completion (Kiln's structure without
  Kiln's bookkeeping), to separate what batching buys from what Kiln adds.
* ``trl``         -- TRL 1.16's ``GRPOTrainer`` (run by ``--trl-python``), driven with the fixed
  completions through its ``rollout_func`` hook: the hook returns the Kiln-tokenized prompt
  and completion ids of the group (no generation happens), a reward function returns the
  pre-scored rewards passed along as an extra field. ``loss_type="dapo"`` (token-level over
  the group), ``scale_rewards="none"``, ``beta`` = the KL coefficient (reference = the PEFT
  model with its adapter disabled), one iteration, fp32, no gradient checkpointing, no
  gradient clipping, AdamW at a constant rate.

The objective on every side (Kiln's ``token`` importance level, ``no_importance_correction``):
per token ``-min(ρA, clip(ρ, 0.8, 1.2)A) + β·k3(logπθ, logπref)`` with ρ = exp(logπθ − sg(logπθ)),
A = r − mean(r) per group (``dr_grpo`` / ``scale_rewards="none"``), summed over the action
tokens of the whole group and divided by their count. k3 because TRL's KL term is k3 (Kiln's
default is k1; the two cost the same elementwise op). β = 0.1, AdamW (β 0.9/0.999, eps 1e-8,
no weight decay, the for-loop implementation) at lr 1e-4, LoRA rank 16 / alpha 32 on
q k v o gate up down, every A initialised as Kiln does (sorted names, uniform ±sqrt(1/in) from
a seeded generator; B = 0) so every side starts from the same weights and their per-step
losses must agree (the parity column).

Inputs: groups of B completions (B = 4 and 16) of 60-66 action tokens each (the assistant
text plus ``<|im_end|>`` and its newline) after a 32-token prompt (template included), so
92-98 tokens a sequence; rewards spread over [0, 1]. Every side gets its token ids and
action masks from ``kiln.data.grpo.read_groups``, so all four see identical inputs. Models:
``tiny`` is ``kiln.model.create_tiny`` (Qwen2, H=64, intermediate 176, 2 layers, 4 heads / 2 KV
heads, V=627: 173 K parameters); ``wide`` is a random Qwen2 config built here with the tiny
tokenizer: hidden 512, intermediate 1,408, 8 layers, 8 heads / 2 KV heads (head dim 64),
V=627, untied head, weights from Kiln's seeded initialiser (std 0.02): 23.2 M parameters.

Time: each side runs ``--warmup`` groups (default 1) then ``--groups`` timed groups; a step is
one group (reference forwards, policy forwards, loss, backward, optimizer step). Kiln: the
interval between consecutive ``progress`` callbacks (the loop has nothing else in it); TRL:
``on_step_begin`` to ``on_step_end``; the reference loops: the loop body. Each side runs
``--rounds`` times (order reversed every other round); the table takes each side's least
disturbed round (lowest median) and prints the range over rounds. Kiln's step is also taken
apart per group by timing wrappers around what ``run_grpo`` calls through module attributes
(``_logprobs`` with and without grad, peft's ``disable_adapter`` enter/exit, ``policy_loss`` +
``kl_estimate``, ``Tensor.backward``, the optimizer's ``step``/``zero_grad``), and the cost of
``policy_loss`` + ``kl_estimate`` per completion is compared with the plain formula.
Memory: after the model is loaded and the groups are tokenized (Kiln: after ``admit_grpo``,
which also hashes the weights), freed heap is handed back (``malloc_trim``), the resident
high-water mark is reset (``/proc/self/clear_refs``) and VmRSS is the side's model-only
baseline; "peak" is VmHWM read at the end of the last timed step (before Kiln publishes) and
"delta" is peak − baseline: LoRA, optimizer state, activations, and the framework's own state.
2 torch threads per side.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import cpu_model, kiln_lora_init, make_wide, memory_status, reset_peak

REPO = Path(__file__).resolve().parent.parent
TRL_PYTHON = "/tmp/trlvenv/bin/python"  # noqa: S108 - the bench venv with trl, not a temp file
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR, BETA, EPS, SEED = 16, 32.0, 1e-4, 0.1, 0.2, 7
THREADS = 2
MIB = 1024 * 1024
SIDES = ("kiln", "kiln_batched", "kiln_off", "ref_batched", "ref_loop", "trl")


# ----------------------------------------------------------------------------- set-up (parent)


def make_groups(
    tokenizer_dir: Path, group_size: int, count: int, *, prompt_tokens: int = 18, completion_tokens: int = 60
) -> list[dict[str, Any]]:
    """``count`` groups of ``group_size`` completions, ``completion_tokens``..+6 action tokens each, distinct prompts
    of about ``prompt_tokens`` + 14 tokens (the chat template's)."""
    from transformers import AutoTokenizer

    from kiln.model._tiny import tiny_corpus

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    words = " ".join(tiny_corpus()).split()

    def text(offset: int, tokens: int) -> str:
        out, i = [], offset
        while len(tok(" ".join(out), add_special_tokens=False)["input_ids"]) < tokens:
            out.append(words[i % len(words)])
            i += 1
        while len(tok(" ".join(out), add_special_tokens=False)["input_ids"]) > tokens:
            out.pop()
        return " ".join(out)

    groups = []
    for g in range(count):
        prompt = f"Question {g}: " + text(11 * g + 5, prompt_tokens)
        completions = [
            # the action span is the text + <|im_end|> + "\n": 60..66 tokens
            {
                "text": text(97 * g + 13 * i, completion_tokens + (i % 5)),
                "reward": round(((i * 7) % group_size) / max(group_size - 1, 1), 6),
            }
            for i in range(group_size)
        ]
        groups.append({"messages": [{"role": "user", "content": prompt}], "completions": completions})
    return groups


# ----------------------------------------------------------------------------- worker helpers


def load_inputs(model_dir: str, groups_file: str) -> tuple[Any, Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.data.grpo import read_groups

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    groups = json.loads(Path(groups_file).read_text())
    ingestion = read_groups(tokenizer=tok, groups=groups)
    return tok, model, ingestion


def peft_wrap(model: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(model, config)
    kiln_lora_init(peft_model, SEED)
    return peft_model


# ----------------------------------------------------------------------------- sides (workers)


def side_kiln(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.trainers.grpo import admit_grpo, run_grpo
    from kiln.training import grpo_objective as obj

    groups = json.loads(Path(args.groups_file).read_text())
    registry = Path(args.work) / "registry"
    registry.mkdir(parents=True, exist_ok=True)
    config = {
        "seed": SEED,
        "optimizer": {"kind": "adam_w"},
        "learning_rate": LR,
        "lora_rank": RANK,
        "lora_alpha": ALPHA,
        "kl_coeff": BETA,
        "kl_estimator": "k3",
        "clip_epsilon": EPS,
        "advantage_mode": "dr_grpo",
        "loss_aggregation": "token_level",
        "is_level": "token",
        "kl_reference_policy": {"kind": "base_per_step"},
    }
    if args.worker in ("kiln_batched", "kiln_off"):  # the whole group in one padded policy and reference forward
        config["micro_batch_size"] = len(groups[0]["completions"])
    if args.worker == "kiln_off":  # every completion runs its whole sequence (the shared prompt too)
        config["prefix_sharing"] = "off"
    name = f"bench-{os.getpid()}"
    job = admit_grpo(adapter_name=name, registry=registry, request={"groups": groups, "config": config},
                     model_path=args.model)  # fmt: skip
    load_peak = memory_status("VmHWM")
    baseline = reset_peak()

    # per-group phase clocks: wrappers around what run_grpo calls by module attribute (a perf_counter pair
    # each, microseconds against steps of tens of milliseconds)
    import torch

    import kiln.trainers._forwards as parts_module
    import kiln.trainers.grpo as trainer_module

    clocks = dict.fromkeys(
        ("reference_forward", "disable_adapter", "policy_forward", "objective", "backward", "optimizer"), 0.0
    )

    def timed(fn: Any, key: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            name = key() if callable(key) else key
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clocks[name] += time.perf_counter() - t0

        return wrapper

    obj.policy_loss = timed(obj.policy_loss, "objective")
    obj.kl_estimate = timed(obj.kl_estimate, "objective")

    def forward_kind() -> str:
        return "policy_forward" if torch.is_grad_enabled() else "reference_forward"

    # one completion's dense forward (the policy's in the trainer, the reference's in the forwards module) and the
    # batched forwards of micro-batches
    trainer_module.logprobs = timed(trainer_module.logprobs, forward_kind)
    parts_module.logprobs = timed(parts_module.logprobs, forward_kind)
    parts_module.group_logprobs = timed(parts_module.group_logprobs, forward_kind)
    parts_module.run_prefix = timed(parts_module.run_prefix, forward_kind)  # a group's shared prompt, once
    torch.Tensor.backward = timed(torch.Tensor.backward, "backward")
    from kiln.training import AdamW, Muon, Sgd

    def build_timed(build: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            optimizer = build(*a, **k)
            optimizer.step = timed(optimizer.step, "optimizer")
            optimizer.zero_grad = timed(optimizer.zero_grad, "optimizer")
            return optimizer

        return wrapper

    for kind in (Muon, AdamW, Sgd):  # the run's optimizer is built by its kind's build()
        kind.build = build_timed(kind.build)
    import peft

    disable = peft.PeftModel.disable_adapter

    @contextlib.contextmanager
    def disable_timed(self: Any) -> Any:  # enter and exit of peft's context, the forward inside excluded
        t0 = time.perf_counter()
        context = disable(self)
        context.__enter__()
        clocks["disable_adapter"] += time.perf_counter() - t0
        try:
            yield
        finally:
            t1 = time.perf_counter()
            context.__exit__(None, None, None)
            clocks["disable_adapter"] += time.perf_counter() - t1

    peft.PeftModel.disable_adapter = disable_timed
    total = len(groups)
    marks: list[float] = []
    losses: list[float] = []
    phases: list[dict[str, float]] = []
    peak = [0]

    def progress(event: dict[str, Any]) -> None:
        marks.append(time.perf_counter())
        phases.append(dict(clocks))
        losses.append(float(event["loss"]))
        if event["step"] == total:
            peak[0] = memory_status("VmHWM")

    start = time.perf_counter()
    result = run_grpo(job, progress=progress)
    if result.status != "success":
        raise RuntimeError(f"kiln run failed: {result.receipt.get('failure')}")
    steps = [marks[0] - start] + [b - a for a, b in itertools.pairwise(marks)]
    per_group = [phases[0]] + [{k: b[k] - a[k] for k in b} for a, b in itertools.pairwise(phases)]
    return {
        "steps": steps,
        "losses": losses,
        "baseline": baseline,
        "peak": peak[0],
        "load_peak": load_peak,
        "phases": per_group,
        "audit_us": objective_cost(job.ingestion.groups[0].completions[0]),
    }


def objective_cost(completion: Any, reps: int = 300) -> dict[str, float]:
    """Microseconds per completion: Kiln's ``policy_loss`` + ``kl_estimate`` (loss terms and their
    audits) against the same per-token loss written plainly, on this completion's shapes, no backward."""
    import torch

    from kiln.training import grpo_objective as obj

    n = len(completion.action_mask)
    generator = torch.Generator().manual_seed(0)
    new = (torch.rand(1, n, generator=generator) * -3).requires_grad_()
    ref = new.detach() + 0.01 * torch.randn(1, n, generator=generator)
    mask = torch.tensor(completion.action_mask, dtype=torch.bool).unsqueeze(0)
    adv = torch.tensor([[0.25]])

    def kiln_terms() -> Any:
        per_token, _ = obj.policy_loss(new, None, adv, mask, is_level="token", clip_low=EPS, clip_high=None)
        kl, _ = obj.kl_estimate(new, ref, mask, "k3")
        return torch.where(mask, per_token + BETA * kl, torch.zeros_like(per_token)).sum()

    def plain_terms() -> Any:
        return (_per_token_loss(new, ref, adv) * mask).sum()

    out = {}
    for name, fn in (("kiln", kiln_terms), ("plain", plain_terms)):
        for _ in range(20):
            fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = (time.perf_counter() - t0) / reps * 1e6
    return out


def _token_logps(model: Any, ids: Any, attention: Any | None = None) -> Any:
    """log π of each next token: ``[..., T-1]``."""
    logits = model(input_ids=ids, attention_mask=attention).logits[..., :-1, :].float()
    return logits.log_softmax(-1).gather(-1, ids[..., 1:].unsqueeze(-1)).squeeze(-1)


def _per_token_loss(logp: Any, ref: Any, adv: Any) -> Any:
    import torch

    ratio = torch.exp(logp - logp.detach())
    policy = -torch.min(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    return policy + BETA * (torch.exp(ref - logp) - (ref - logp) - 1)


def side_reference(args: argparse.Namespace, *, batched: bool) -> dict[str, Any]:
    import torch

    _, model, ingestion = load_inputs(args.model, args.groups_file)
    load_peak = memory_status("VmHWM")
    baseline = reset_peak()
    model = peft_wrap(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False)
    steps, losses = [], []
    peak = 0
    for number, group in enumerate(ingestion.groups, start=1):
        t0 = time.perf_counter()
        rewards = torch.tensor([c.reward for c in group.completions], dtype=torch.float32)
        advantages = rewards - rewards.mean()
        seqs = [torch.tensor(c.input_ids) for c in group.completions]
        masks = [torch.tensor(c.action_mask, dtype=torch.float32) for c in group.completions]
        if batched:
            ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)
            attention = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
            mask = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
            with torch.no_grad(), model.disable_adapter():
                ref = _token_logps(model, ids, attention)
            logp = _token_logps(model, ids, attention)
            per_token = _per_token_loss(logp, ref, advantages.unsqueeze(1))
            loss = (per_token * mask).sum() / mask.sum()
        else:
            with torch.no_grad(), model.disable_adapter():
                refs = [_token_logps(model, s.unsqueeze(0))[0] for s in seqs]
            total = sum(float(m.sum()) for m in masks)
            loss = (
                sum(
                    (_per_token_loss(_token_logps(model, s.unsqueeze(0))[0], r, a) * m).sum()
                    for s, r, a, m in zip(seqs, refs, advantages, masks, strict=True)
                )
                / total
            )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        steps.append(time.perf_counter() - t0)
        if number == len(ingestion.groups):
            peak = memory_status("VmHWM")
    return {"steps": steps, "losses": losses, "baseline": baseline, "peak": peak, "load_peak": load_peak}


def side_trl(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    warnings.simplefilter("ignore")
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok, model, ingestion = load_inputs(args.model, args.groups_file)
    raw = json.loads(Path(args.groups_file).read_text())
    by_prompt = {}
    for body, group in zip(raw, ingestion.groups, strict=True):
        by_prompt[body["messages"][-1]["content"]] = group
        for c in group.completions:  # TRL masks every completion token: that must be exactly Kiln's action mask
            if list(c.action_mask) != [t >= group.prompt_tokens - 1 for t in range(len(c.input_ids) - 1)]:
                raise RuntimeError("the action tokens are not exactly the tokens after the prompt")
    size = len(ingestion.groups[0].completions)
    load_peak = memory_status("VmHWM")
    baseline = reset_peak()

    calls: list[int] = []

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """The group's fixed completions for each prompt; a repeated prompt gets the next completion."""
        calls.append(len(prompts))
        seen: dict[str, int] = {}
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "kiln_reward": []}
        for prompt in prompts:
            key = prompt[-1]["content"]
            group = by_prompt[key]
            indices = range(size) if prompts.count(prompt) == 1 else [seen.get(key, 0)]
            seen[key] = seen.get(key, 0) + 1
            for i in indices:
                c = group.completions[i]
                out["prompt_ids"].append(list(c.input_ids[: group.prompt_tokens]))
                out["completion_ids"].append(list(c.input_ids[group.prompt_tokens :]))
                out["kiln_reward"].append(c.reward)
        out["logprobs"] = None
        return out

    def reward(prompts: Any, completions: Any, kiln_reward: list[float], **_: Any) -> list[float]:
        return list(kiln_reward)

    steps, losses = [], []
    peak = [0]

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            steps.append(time.perf_counter() - self.t0)
            if len(steps) == len(ingestion.groups):
                peak[0] = memory_status("VmHWM")

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    config = GRPOConfig(
        output_dir=str(Path(args.work) / "trl-out"), per_device_train_batch_size=size, num_generations=size,
        gradient_accumulation_steps=1, num_iterations=1, beta=BETA, epsilon=EPS, loss_type="dapo",
        scale_rewards="none", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
        bf16=False, gradient_checkpointing=False, use_cpu=True, logging_steps=1, save_strategy="no", report_to=[],
        num_train_epochs=1, seed=SEED, shuffle_dataset=False, disable_tqdm=True, dataloader_num_workers=0,
        max_completion_length=128, log_completions=False, temperature=1.0,
    )  # fmt: skip
    prompts = [{"prompt": body["messages"]} for body in raw]
    peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=Dataset.from_list(prompts),
                          processing_class=tok, peft_config=peft_config, rollout_func=rollout, callbacks=[Clock()])  # fmt: skip
    kiln_lora_init(trainer.model, SEED)
    import torch

    torch.set_num_threads(THREADS)
    trainer.train()
    return {"steps": steps, "losses": losses, "baseline": baseline, "peak": peak[0], "load_peak": load_peak,
            "rollout_prompts_per_call": calls}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(THREADS)
    if args.worker in ("kiln", "kiln_batched", "kiln_off"):
        out = side_kiln(args)
    elif args.worker == "trl":
        out = side_trl(args)
    else:
        out = side_reference(args, batched=args.worker == "ref_batched")
    out["threads"] = torch.get_num_threads()
    out["versions"] = {"torch": torch.__version__}
    with contextlib.suppress(ImportError):
        import transformers

        out["versions"]["transformers"] = transformers.__version__
    if args.worker == "trl":
        import trl

        out["versions"]["trl"] = trl.__version__
    Path(args.result).write_text(json.dumps(out))


# ----------------------------------------------------------------------------- parent


def run_side(side: str, python: str, model: Path, groups_file: Path, work: Path) -> dict[str, Any]:
    result = work / f"result-{side}-{os.getpid()}-{time.monotonic_ns()}.json"
    cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--model", str(model),
           "--groups-file", str(groups_file), "--work", str(work / side), "--result", str(result)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "KILN_HOME": str(work / "home"), "OMP_NUM_THREADS": str(THREADS),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "generated")])}  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    out = json.loads(result.read_text())
    out["wall_s"] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, 2 timed groups")
    parser.add_argument("--models", default="tiny,wide", help="comma list of tiny, wide")
    parser.add_argument("--group-sizes", default="4,16")
    parser.add_argument("--groups", type=int, default=None, help="timed groups per side (default 8 tiny, 4 wide)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--rounds", type=int, default=None, help="runs of each side, order alternating (default 2, 1 with --quick)"
    )
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--sides", default=None, help="comma list of sides to run (default: all but trl without it)")
    parser.add_argument("--prompt-tokens", type=int, default=18, help="prompt text tokens (the template adds 14)")
    parser.add_argument("--completion-tokens", type=int, default=60, help="action tokens of the shortest completion")
    parser.add_argument("--trl-python", default=TRL_PYTHON)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write every raw result here")
    # worker mode (internal)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--groups-file", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from kiln.model import create_tiny

    args.rounds = args.rounds or (1 if args.quick else 2)
    models = ["tiny"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    sizes = [int(s) for s in args.group_sizes.split(",")]
    trl_ok = not args.no_trl and Path(args.trl_python).exists()
    sides = ["kiln", "kiln_batched", "kiln_off", "ref_batched", "ref_loop"] + (["trl"] if trl_ok else [])
    if args.sides:
        wanted = [side.strip() for side in args.sides.split(",")]
        sides = [side for side in sides if side in wanted]
    work = args.dir or Path(tempfile.mkdtemp(prefix="kiln-bench-grpo-"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cpus ({cpu_model()}), "
          f"torch {torch.__version__}, {THREADS} torch threads per side")  # fmt: skip
    print(f"work dir {work}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if not trl_ok:
        print(f"trl side skipped ({'--no-trl' if args.no_trl else f'{args.trl_python} not found'})")
    tiny = work / "tiny"
    if not tiny.exists():
        create_tiny(tiny, seed=0)
    dirs = {"tiny": tiny}
    if "wide" in models:
        dirs["wide"] = work / "wide"
        if not dirs["wide"].exists():
            make_wide(dirs["wide"], tiny)
    raw: list[dict[str, Any]] = []
    rows = []
    for model in models:
        timed = args.groups or (2 if args.quick else 8 if model == "tiny" else 4)
        for size in sizes:
            groups_file = (
                work / f"groups-{size}-{timed + args.warmup}-{args.prompt_tokens}-{args.completion_tokens}.json"
            )
            made = make_groups(
                tiny,
                size,
                timed + args.warmup,
                prompt_tokens=args.prompt_tokens,
                completion_tokens=args.completion_tokens,
            )
            groups_file.write_text(json.dumps(made))
            results: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
            for round_ in range(args.rounds):
                for side in sides if round_ % 2 == 0 else sides[::-1]:
                    python = args.trl_python if side == "trl" else sys.executable
                    r = run_side(side, python, dirs[model], groups_file, work)
                    r["load"] = os.getloadavg()[0]
                    results[side].append(r)
                    timed_steps = r["steps"][args.warmup :]
                    print(f"  {model:5} B={size:<3} round {round_ + 1} {side:12} median "
                          f"{statistics.median(timed_steps) * 1000:9.1f} ms  peak {r['peak'] / MIB:7.0f} MiB  "
                          f"base {r['baseline'] / MIB:6.0f}  wall {r['wall_s']:6.1f} s  load {r['load']:.2f}",
                          flush=True)  # fmt: skip
                    raw.append({"model": model, "group_size": size, "side": side, "round": round_ + 1, **r})
            rows.append((model, size, timed, results))
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))
    report(rows, args.warmup)
    print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    busiest = max(r["load"] for r in raw)
    if busiest > 2.0:
        print(f"warning: the 1-minute load average reached {busiest:.2f} on {os.cpu_count()} cpus during the run; "
              "with 2 torch threads per side a competing process can stall a step 10-100x (threads wait on each "
              "other at every op), so compare the 'rounds ms' ranges and rerun on a quieter machine")  # fmt: skip


def report(rows: list[tuple[str, int, int, dict[str, list[dict[str, Any]]]]], warmup: int) -> None:
    def med(r: dict[str, Any]) -> float:
        return statistics.median(r["steps"][warmup:]) * 1000

    def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return min(runs, key=med)

    print("\nstep time per group (ms): median of the timed groups in the side's least disturbed round, and the")
    print("range of the per-round medians; memory (MiB): peak RSS during the steps, the model-only baseline, delta")
    print(f"{'model':5} {'B':>3} {'n':>2} {'side':12} {'step ms':>9} {'rounds ms':>17} {'peak':>6} {'base':>5} "
          f"{'delta':>6} {'kiln/side time':>14} {'kiln/side delta':>15} {'max |dloss|':>11}")  # fmt: skip
    for model, size, n, results in rows:
        first = "kiln" if "kiln" in results else next(iter(results))
        kiln = best(results[first])
        kdelta = max(r["peak"] - r["baseline"] for r in results[first]) / MIB
        for side, runs in results.items():
            r = best(runs)
            medians = [med(x) for x in runs]
            delta = max(x["peak"] - x["baseline"] for x in runs) / MIB
            peak = max(x["peak"] for x in runs) / MIB
            dloss = max(abs(a - b) for x in runs for a, b in zip(kiln["losses"], x["losses"], strict=False))
            ratio_t = "" if side == first else f"{med(kiln) / med(r):.2f}x"
            ratio_m = "" if side == first else f"{kdelta / delta:.2f}x" if delta > 0 else "n/a"
            spread = f"{min(medians):.1f}-{max(medians):.1f}"
            print(f"{model:5} {size:>3} {n:>2} {side:12} {med(r):9.1f} {spread:>17} {peak:6.0f} "
                  f"{r['baseline'] / MIB:5.0f} {delta:6.0f} {ratio_t:>14} {ratio_m:>15} "
                  f"{'' if side == first else f'{dloss:.1e}':>11}")  # fmt: skip
    print("\nkiln_batched (micro_batch_size = the group, prefix_sharing auto) against the others: time and")
    print("delta-memory ratios (peak-memory ratios in brackets)")
    for model, size, _n, results in rows:
        if "kiln_batched" not in results:
            continue
        batched = best(results["kiln_batched"])
        bdelta = max(r["peak"] - r["baseline"] for r in results["kiln_batched"]) / MIB
        parts = []
        bpeak = max(r["peak"] for r in results["kiln_batched"])
        for side in ("kiln", "kiln_off", "ref_batched", "trl"):
            if side in results:
                other = best(results[side])
                odelta = max(r["peak"] - r["baseline"] for r in results[side]) / MIB
                opeak = max(r["peak"] for r in results[side])
                mem = f"{bdelta / odelta:.2f}x" if odelta > 0 else "n/a"
                parts.append(f"vs {side} {med(batched) / med(other):.2f}x time, {mem} delta ({bpeak / opeak:.2f}x)")
        print(f"{model:5} {size:>3}  " + "; ".join(parts))
    print("\nwhere Kiln's step goes (its least disturbed round): medians over the timed groups (ms);")
    print("disable = entering and leaving peft's disable_adapter() around each reference forward; other = the rest")
    print(f"{'model':5} {'B':>3} {'side':12} {'step':>8} {'ref fwd':>8} {'disable':>8} {'pol fwd':>8} {'objective':>9} "
          f"{'backward':>8} {'optim':>8} {'other':>8}   objective per completion us: kiln / plain")  # fmt: skip
    for model, size, _n, results in rows:
        for side in ("kiln", "kiln_batched", "kiln_off"):
            if side in results:
                _phases(model, size, side, best(results[side]), med, warmup)


def _phases(model: str, size: int, side: str, kiln: dict[str, Any], med: Any, warmup: int) -> None:
    """One row of the phase table: where a Kiln side's step goes."""
    timed = kiln["phases"][warmup:]
    ph = {k: statistics.median(g[k] for g in timed) * 1000 for k in timed[0]}
    step = med(kiln)
    other = step - sum(ph.values())
    audit = kiln["audit_us"]
    print(f"{model:5} {size:>3} {side:12} {step:8.1f} {ph['reference_forward']:8.1f} {ph['disable_adapter']:8.1f} "
          f"{ph['policy_forward']:8.1f} {ph['objective']:9.1f} {ph['backward']:8.1f} {ph['optimizer']:8.1f} "
          f"{other:8.1f}   {audit['kiln']:.0f} / {audit['plain']:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
