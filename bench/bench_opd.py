"""OPD time per candidate and peak memory: Kiln's trainer versus TRL's GKD trainer and a plain PyTorch loop.

    python bench/bench_opd.py                  # tiny + wide model, 3 rounds per side (~4 min on 2 quiet cores)
    python bench/bench_opd.py --quick          # tiny model only, 4 timed candidates, 1 round (~1 min)
    python bench/bench_opd.py --no-trl         # skip TRL (it needs trl==1.16 in --trl-python)
    python bench/bench_opd.py --batch 8        # 8 candidates a step: Kiln micro_batch_size 8 vs TRL batch 8

A candidate is one prompt: the student samples a rollout (KV-cached, temperature 1, no nucleus cut, at most
``--max-new-tokens`` tokens, stopping at an end-of-turn id), the teacher scores prompt + rollout, and one
optimizer step follows. Every side visits the same prompts in the same order (Kiln's seeded epoch order), and
runs in its own fresh interpreter so its peak RSS is its own:

* ``kiln`` -- ``admit_opd`` + ``run_opd`` as the server's training worker runs them, with a ``local`` teacher from a
  ``TeacherRegistry``: rollout from the ``rollout-sampling`` generator, ``LocalScorer`` top-K scores, the
  renormalised top-K reverse KL, mean over action positions, collapse diagnostics, then publication.
* ``ref`` -- the same objective written out as a plain loop: the same rollout generator and sampling rule
  (``softmax(logits / T)``, one ``multinomial`` draw), a no-grad teacher forward with ``log_softmax`` and
  ``topk``, a student forward, the top-K reverse KL, backward, AdamW. It reproduces Kiln's rollouts token for
  token, so its per-candidate losses must equal Kiln's (the parity column): what is left is what Kiln adds.
* ``trl`` -- TRL 1.16's ``GKDTrainer`` (``trl.experimental.gkd``, run by ``--trl-python``) fully on-policy:
  ``lmbda=1.0`` (every step generates from the student), ``beta=1.0`` (its generalized JSD at beta 1 is
  ``F.kl_div(teacher_logp, student_logp, log_target=True)`` = KL(student ‖ teacher), the reverse KL, but over
  the full vocabulary, not the teacher's top K), ``seq_kd=False``, ``temperature=1.0``, the same
  ``max_new_tokens``, one prompt per step (``per_device_train_batch_size=1``, no accumulation), fp32, CPU,
  ``adamw_torch`` at a constant rate, no gradient clipping, a sequential sampler fed the prompts in Kiln's
  order. Its generation stops at the student's ``generation_config.eos_token_id``, which the bench sets to
  Kiln's stop ids; its collator renders each prompt with the chat template and the worker checks the ids equal
  Kiln's student prefix. The dataset rows carry a two-token assistant answer because GKD's collator needs one;
  it is never trained on (on-policy replaces it), but transformers counts its labels as ``num_items_in_batch``
  and GKD divides the summed JSD by that count, not by the rollout's positions (the worker records both).

``--batch B`` (above 1): an optimizer step takes B candidates on both sides -- Kiln ``micro_batch_size`` B (the B
rollouts decoded in one KV-cached batch, scored in one teacher forward, one optimizer step over their mean reverse
KL per action position) and TRL ``per_device_train_batch_size`` B (one batched ``generate``, one teacher and one
student forward). The ``ref`` loop is per candidate and is left out. Warm-up and timed counts round up to whole
steps; the time per candidate is from the end of the warm-up's last step to the end of the last step, divided by
the timed candidates (both sides report when each step ends), and each side's prompts are checked against Kiln's
student prefixes with TRL's left padding removed.

Common settings: LoRA rank 16 / alpha 32 on q k v o gate up down, every side initialised as Kiln does (sorted
names, uniform ±sqrt(1/in) A from a seeded generator, B = 0), AdamW (0.9/0.999, eps 1e-8, no weight decay) at
lr 1e-4, Kiln top_k 32, ``torch.use_deterministic_algorithms(True)`` (Kiln's admission sets it), 2 torch threads.

Models: ``tiny`` student = ``kiln.model.create_tiny(seed=0)`` (Qwen2, H=64, 2 layers, V=627: 173 K parameters),
teacher = ``create_tiny(seed=2)`` (same tokenizer, other weights). ``wide`` = random Qwen2 configs built here with
the tiny tokenizer (hidden 512, intermediate 1,408, 8 layers, 8 heads / 2 KV heads, V=627, untied head: 23.2 M
parameters), student seed 0 and teacher seed 2. Prompts: distinct user questions of 18 corpus words (34-68 tokens with
the template). Random weights give near-uniform next-token distributions, so rollouts mostly run to the limit.

Time per candidate (medians over the timed candidates, after ``--warmup``): ``step`` is the candidate's work
(Kiln: first rollout call to the ``progress`` callback; ref: the loop body; TRL: ``on_step_begin`` to
``on_step_end``); ``cycle`` is from one candidate to the next (Kiln: ``progress`` to ``progress``; TRL:
``on_step_begin`` to the next, so it adds the collator, logging and loss reporting between steps). Phases:
``rollout`` (Kiln: ``kiln.model._sampling.sample``; TRL: ``generate_on_policy_outputs``, i.e.
``model.generate`` and the masks), ``teacher`` (Kiln: ``LocalScorer.score``: forward, ``log_softmax``,
stable top-K; ref: forward, ``log_softmax``, ``topk``; TRL: the teacher's forward only, its log-softmax is in
``loss``), ``student`` (the grad-enabled student forward, timed with forward hooks), ``loss`` (Kiln
``top_k_reverse_kl``; TRL ``generalized_jsd_loss``), ``backward`` (``Tensor.backward``), ``optim`` (Kiln and ref:
step + zero_grad; TRL: ``on_pre_optimizer_step`` to ``on_optimizer_step``), ``other`` = step − the phases.
Kiln's receipt ``phase_timings`` (rollout + student forward in ``policy_forward_ms``, scoring in
``reference_forward_ms``) are printed next to the bench's clocks as a cross-check.

Memory: after both models are loaded (Kiln: after ``admit_opd``, which also hashes the weights and re-probes
the teacher, and after the teacher's ``LocalScorer`` is opened ahead of ``run_opd``, which then gets it from a
patched ``open_scorer``) freed heap is handed back, VmHWM is reset and VmRSS is the baseline; ``peak`` is VmHWM at
the end of the last timed candidate, ``delta`` = peak − baseline (LoRA, optimizer state, activations, KV cache,
framework state). TRL's baseline is higher: it imports ``trl``, ``datasets`` and ``accelerate``.
"""

from __future__ import annotations

import argparse
import json
import math
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
RANK, ALPHA, LR, SEED, TOP_K, TEMPERATURE = 16, 32.0, 1e-4, 7, 32, 1.0
MIB = 1024 * 1024
SIDES = ("kiln", "ref", "trl", "probe")
PROBE_V, PROBE_PROMPT = 151_936, 35  # Qwen2's vocabulary; a 35-token prompt as in the runs
PHASES = ("rollout", "teacher", "student", "loss", "backward", "optim")
TEACHER = "teacher"


# ----------------------------------------------------------------------------- set-up (parent)


def make_prompts(count: int) -> list[dict[str, Any]]:
    """``count`` distinct one-turn prompts of 18 corpus words each."""
    from kiln.model._tiny import tiny_corpus

    words = " ".join(tiny_corpus()).split()
    return [
        {"messages": [{"role": "user", "content": f"Question {i}: " + " ".join(words[(37 * i + j) % len(words)]
                                                                              for j in range(18))}]}
        for i in range(count)
    ]  # fmt: skip


# ----------------------------------------------------------------------------- worker helpers


class Clocks:
    """Per-candidate phase accumulators: ``add(phase, seconds)``; ``close(...)`` seals one candidate."""

    def __init__(self) -> None:
        self.current = dict.fromkeys(PHASES, 0.0)
        self.records: list[dict[str, Any]] = []

    def add(self, phase: str, seconds: float) -> None:
        self.current[phase] += seconds

    def timed(self, fn: Any, phase: str) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(phase, time.perf_counter() - t0)

        return wrapper

    def hook_forward(self, module: Any, phase: str, *, grad_only: bool) -> None:
        """Time every forward of ``module`` (only grad-enabled ones when ``grad_only``) into ``phase``."""
        import torch

        starts: list[float] = []

        def pre(*_: Any) -> None:
            starts.append(time.perf_counter())

        def post(*_: Any) -> None:
            t0 = starts.pop()
            if not grad_only or torch.is_grad_enabled():
                self.add(phase, time.perf_counter() - t0)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def close(self, *, step: float, cycle: float | None, tokens: int, loss: float | None = None) -> None:
        self.records.append({**self.current, "step": step, "cycle": cycle, "tokens": tokens, "value": loss})
        self.current = dict.fromkeys(PHASES, 0.0)


def patch_backward(clocks: Clocks) -> None:
    import torch

    torch.Tensor.backward = clocks.timed(torch.Tensor.backward, "backward")


def load_pair(student_dir: str, teacher_dir: str) -> tuple[Any, Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(student_dir, local_files_only=True)
    models = []
    for path in (student_dir, teacher_dir):
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        models.append(model)
    return tok, models[0], models[1]


def visiting_order(n: int) -> list[int]:
    from kiln.documents.epoch_order import epoch_order

    return epoch_order(SEED, 0, n)


# ----------------------------------------------------------------------------- sides (workers)


def side_kiln(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import kiln.model
    import kiln.model._sampling as sampling
    import kiln.teachers
    import kiln.trainers._kit as kit  # the policy's LoRA and optimizer are built here
    import kiln.trainers.opd as trainer
    import kiln.training.opd_objective as objective
    from kiln.teachers import LocalScorer

    prompts = json.loads(Path(args.prompts_file).read_text())
    registry = Path(args.work) / "adapters"
    registry.mkdir(parents=True, exist_ok=True)
    config = {
        "seed": SEED,
        "samples_per_prompt": 1,
        "max_tokens": args.max_new_tokens,
        "top_k": TOP_K,
        "temperature": TEMPERATURE,
        "top_p": 1.0,
        "learning_rate": LR,
        "optimizer": {"kind": "adam_w"},
        "lora_rank": RANK,
        "lora_alpha": ALPHA,
        "checkpoint_interval": None,  # no server interval: no checkpoints during the run
        "micro_batch_size": args.batch,  # an optimizer step of that many candidates, rolled out together
    }
    job = trainer.admit_opd(adapter_name=f"bench-{os.getpid()}", registry=registry, teachers_root=Path(args.teachers),
                            request={"teacher": TEACHER, "prompts": prompts, "config": config},
                            model_path=args.model)  # fmt: skip
    if job.config.top_k != TOP_K:
        raise RuntimeError(f"the teacher clamps top_k to {job.config.top_k}")
    scorer = LocalScorer(job.teacher, registry_dir=registry)  # the teacher, loaded before the baseline
    load_peak = memory_status("VmHWM")
    baseline = reset_peak()

    clocks = Clocks()
    scorer.score = clocks.timed(scorer.score, "teacher")
    kiln.teachers.open_scorer = lambda pinned, registry_dir: scorer
    mark = {"start": None, "last": None}

    def marked(original: Any) -> Any:  # a rollout: its start marks the candidate's step, its time is "rollout"
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            mark["start"] = t0
            try:
                return original(*a, **k)
            finally:
                clocks.add("rollout", time.perf_counter() - t0)

        return wrapper

    sampling.sample = marked(sampling.sample)
    if args.batch > 1:  # a batch of one goes through sample, already timed
        kiln.model.sample_batch = marked(kiln.model.sample_batch)
    original_attach = kit.attach_lora

    def attach_lora(*a: Any, **k: Any) -> Any:
        model = original_attach(*a, **k)
        clocks.hook_forward(model, "student", grad_only=True)
        return model

    kit.attach_lora = attach_lora
    trainer.top_k_reverse_kl = clocks.timed(objective.top_k_reverse_kl, "loss")  # the name the trainer calls
    from kiln.training import AdamW, Muon, Sgd

    def build_timed(build: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            optimizer = build(*a, **k)
            optimizer.step = clocks.timed(optimizer.step, "optim")
            optimizer.zero_grad = clocks.timed(optimizer.zero_grad, "optim")
            return optimizer

        return wrapper

    for kind in (Muon, AdamW, Sgd):  # the run's optimizer is built by its kind's build()
        kind.build = build_timed(kind.build)
    patch_backward(clocks)
    peak = [0]
    ends: list[tuple[int, float]] = []  # (candidates done, when): the batch report's clock

    def progress(info: dict[str, Any]) -> None:
        now = time.perf_counter()
        ends.append((info["step"], now))
        cycle = None if mark["last"] is None else now - mark["last"]
        clocks.close(step=now - mark["start"], cycle=cycle, tokens=info["tokens"] - prefix_len[info["step"] - 1],
                     loss=info["loss"])  # fmt: skip
        mark["last"] = now
        if info["step"] == info["total"]:
            peak[0] = memory_status("VmHWM")

    order = visiting_order(len(job.candidates))
    prefix_len = [len(job.source.items[job.candidates[i][0]].student_prefix) for i in order]
    torch.set_num_threads(args.threads)
    result = trainer.run_opd(job, progress=progress)
    if result.status != "success":
        raise RuntimeError(f"run_opd failed: {result.receipt.get('failure_message')}")
    return {
        "records": clocks.records,
        "baseline": baseline,
        "peak": peak[0],
        "load_peak": load_peak,
        "receipt_phase_timings": result.receipt["phase_timings"],
        "ends": ends,
        "prompt_ids": [list(job.source.items[job.candidates[i][0]].student_prefix) for i in order],
    }


def side_ref(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model

    from kiln.data.opd import read_prompts
    from kiln.model._sampling import special_tokens, stop_token_ids
    from kiln.trainers.opd import ROLLOUT_SEED_SALT

    tok, model, teacher = load_pair(args.model, args.teacher)
    prompts = json.loads(Path(args.prompts_file).read_text())
    items = read_prompts(tok, prompts).items
    stops = stop_token_ids(model, tok, special_tokens(tok))
    load_peak = memory_status("VmHWM")
    baseline = reset_peak()
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, config)
    kiln_lora_init(model, SEED)
    params = [p for _, p in sorted(model.named_parameters()) if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False)
    generator = torch.Generator().manual_seed((SEED ^ ROLLOUT_SEED_SALT) % 2**64)
    clocks = Clocks()
    patch_backward(clocks)
    order = visiting_order(len(items))
    peak, last = 0, None
    for number, index in enumerate(order, start=1):
        t0 = time.perf_counter()
        prefix = list(items[index].student_prefix)
        model.eval()
        action: list[int] = []
        cache, step = None, torch.tensor([prefix])
        with torch.no_grad():
            for _ in range(args.max_new_tokens):
                out = model(input_ids=step, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                probs = torch.softmax(out.logits[0, -1].float() / TEMPERATURE, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
                action.append(token)
                if token in stops:
                    break
                step = torch.tensor([[token]])
        del cache, out
        t1 = time.perf_counter()
        ids = torch.tensor([prefix + action])
        start = len(prefix) - 1
        with torch.no_grad():
            rows = torch.log_softmax(teacher(input_ids=ids).logits[0].float(), dim=-1)[start : start + len(action)]
            teacher_lp, teacher_ids = torch.topk(rows, TOP_K, dim=-1)
        t2 = time.perf_counter()
        model.train()
        logits = model(input_ids=ids).logits[0]
        t3 = time.perf_counter()
        picked = logits[start : start + len(action)].float().gather(-1, teacher_ids)
        log_p = picked - torch.logsumexp(picked, dim=-1, keepdim=True)
        log_q = teacher_lp - torch.logsumexp(teacher_lp, dim=-1, keepdim=True)
        loss = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
        t4 = time.perf_counter()
        loss.backward()
        t5 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t6 = time.perf_counter()
        for phase, seconds in zip(("rollout", "teacher", "student", "loss", "optim"),
                                  (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5), strict=True):  # fmt: skip
            clocks.add(phase, seconds)
        clocks.close(step=t6 - t0, cycle=None if last is None else t6 - last, tokens=len(action),
                     loss=float(loss.detach()))  # fmt: skip
        last = t6
        if number == len(order):
            peak = memory_status("VmHWM")
    return {"records": clocks.records, "baseline": baseline, "peak": peak, "load_peak": load_peak}


def side_trl(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    warnings.simplefilter("ignore")
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from kiln.data.opd import read_prompts
    from kiln.model._sampling import special_tokens, stop_token_ids

    tok, model, teacher = load_pair(args.model, args.teacher)
    prompts = json.loads(Path(args.prompts_file).read_text())
    order = visiting_order(len(prompts))
    expected = [list(read_prompts(tok, prompts).items[i].student_prefix) for i in order]
    model.generation_config.eos_token_id = sorted(stop_token_ids(model, tok, special_tokens(tok)))
    # GKD's collator needs an assistant turn to split off; on-policy steps replace it with the rollout
    rows = [{"messages": [*prompts[i]["messages"], {"role": "assistant", "content": "ok"}]} for i in order]
    dataset = Dataset.from_list(rows)
    load_peak = memory_status("VmHWM")
    baseline = reset_peak()

    clocks = Clocks()
    patch_backward(clocks)
    peak = [0]
    marks: dict[str, Any] = {"begin": None, "optim": None}
    ends: list[tuple[int, float]] = []
    extra: list[dict[str, Any]] = []
    mismatched: list[int] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            now = time.perf_counter()
            if clocks.records and marks["begin"] is not None:
                clocks.records[-1]["cycle"] = now - marks["begin"]
            marks["begin"] = now

        def on_pre_optimizer_step(self, a, state, control, **kw):
            marks["optim"] = time.perf_counter()

        def on_optimizer_step(self, a, state, control, **kw):
            clocks.add("optim", time.perf_counter() - marks["optim"])

        def on_step_end(self, a, state, control, **kw):
            info = extra[-1]
            clocks.close(step=time.perf_counter() - marks["begin"], cycle=None, tokens=info["tokens"],
                         loss=info["loss_per_position"])  # fmt: skip
            ends.append((len(clocks.records) * args.batch, time.perf_counter()))
            if len(clocks.records) * args.batch >= len(order):
                peak[0] = memory_status("VmHWM")

    config = GKDConfig(
        output_dir=str(Path(args.work) / "trl-out"), per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        lmbda=1.0, beta=1.0, seq_kd=False, temperature=TEMPERATURE, max_new_tokens=args.max_new_tokens,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, bf16=False, fp16=False,
        gradient_checkpointing=False, use_cpu=True, logging_steps=1, save_strategy="no", report_to=[],
        num_train_epochs=1, seed=SEED, disable_tqdm=True, dataloader_num_workers=0,
        train_sampling_strategy="sequential",
    )  # fmt: skip
    peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none", target_modules=TARGETS,
                             task_type="CAUSAL_LM")  # fmt: skip
    gkd = GKDTrainer(model=model, teacher_model=teacher, args=config, train_dataset=dataset, processing_class=tok,
                     peft_config=peft_config, callbacks=[Clock()])  # fmt: skip
    kiln_lora_init(gkd.model, SEED)

    generate = gkd.generate_on_policy_outputs

    def generate_on_policy_outputs(m: Any, inputs: Any, generation_config: Any) -> Any:
        first = len(clocks.records) * args.batch
        for row, ids in enumerate(inputs["prompts"].tolist()):  # left-padded when a batch holds several
            while len(ids) > len(expected[first + row]) and ids[0] == tok.pad_token_id:
                ids = ids[1:]
            if ids != expected[first + row]:
                mismatched.append(first + row)
        t0 = time.perf_counter()
        out = generate(m, inputs, generation_config)
        clocks.add("rollout", time.perf_counter() - t0)
        return out

    gkd.generate_on_policy_outputs = generate_on_policy_outputs
    compute_loss = gkd.compute_loss

    def timed_compute_loss(m: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        tokens = int((inputs["labels"][:, 1:] != -100).sum())
        out = compute_loss(m, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        loss = float((out[0] if return_outputs else out).detach())
        items = None if num_items_in_batch is None else float(num_items_in_batch)
        extra.append({"tokens": tokens, "num_items_in_batch": items, "loss": loss,
                      "loss_per_position": loss * (items or tokens) / max(tokens, 1)})  # fmt: skip
        return out

    gkd.compute_loss = timed_compute_loss
    gkd.generalized_jsd_loss = clocks.timed(gkd.generalized_jsd_loss, "loss")
    clocks.hook_forward(gkd.teacher_model, "teacher", grad_only=False)
    clocks.hook_forward(gkd.model, "student", grad_only=True)
    torch.set_num_threads(args.threads)
    gkd.train()
    if mismatched:
        raise RuntimeError(f"TRL's prompt ids differ from Kiln's student prefix at candidates {mismatched}")
    return {"records": clocks.records, "baseline": baseline, "peak": peak[0], "load_peak": load_peak,
            "trl_loss_normaliser": extra, "trl_eos_token_id": gkd.generation_config.eos_token_id,
            "ends": ends}  # fmt: skip


def side_probe(args: argparse.Namespace) -> dict[str, Any]:
    """Scoring and loss alone at Qwen2's vocabulary (the runs have V=627): ``[T, V]`` random logits stand in for
    the model's, A = ``--max-new-tokens`` action positions after a 35-token prompt; median of 5 after one warm-up."""
    import torch
    from torch.nn import functional

    from kiln.teachers._scoring import stable_top_k
    from kiln.training.opd_objective import top_k_reverse_kl

    actions = args.max_new_tokens
    length, start = PROBE_PROMPT + actions, PROBE_PROMPT - 1
    generator = torch.Generator().manual_seed(0)
    teacher_logits = torch.randn(length, PROBE_V, generator=generator)
    student_base = torch.randn(length, PROBE_V, generator=generator)
    labels = torch.full((1, length - 1), -100)
    labels[0, start : start + actions] = 1

    def kiln_scoring() -> Any:  # LocalScorer: log_softmax of every row (log_probabilities), stable_top_k of A rows
        rows = torch.log_softmax(teacher_logits, dim=-1)[: length - 1]
        return stable_top_k(rows[start:], TOP_K)

    def plain_scoring() -> Any:  # the ref loop: log_softmax of the A rows, topk
        values, ids = torch.topk(torch.log_softmax(teacher_logits[start : start + actions], dim=-1), TOP_K, dim=-1)
        return ids, values

    ids, values = kiln_scoring()

    def kiln_loss() -> None:  # top_k_reverse_kl on the A rows, backward into the [T, V] logits
        student = student_base.clone().requires_grad_()
        top_k_reverse_kl(student[start : start + actions], ids, values)[0].backward()

    def trl_loss() -> None:  # GKD's generalized_jsd_loss at beta=1, written out: full vocabulary, every shifted row
        student = student_base.clone().requires_grad_()
        s_logp = functional.log_softmax(student[:-1].unsqueeze(0), dim=-1)
        t_logp = functional.log_softmax(teacher_logits[:-1].unsqueeze(0), dim=-1)
        jsd = functional.kl_div(t_logp, s_logp, reduction="none", log_target=True)
        mask = labels != -100
        (jsd[mask].sum() / mask.sum()).backward()

    out = {"V": PROBE_V, "T": length, "A": actions}
    for name, fn in (("kiln_scoring", kiln_scoring), ("plain_scoring", plain_scoring), ("kiln_loss", kiln_loss),
                     ("trl_loss", trl_loss)):  # fmt: skip
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1000
    return out


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    out = {"kiln": side_kiln, "ref": side_ref, "trl": side_trl, "probe": side_probe}[args.worker](args)
    out["threads"] = torch.get_num_threads()
    out["versions"] = {"torch": torch.__version__}
    import peft
    import transformers

    out["versions"].update(transformers=transformers.__version__, peft=peft.__version__)
    if args.worker == "trl":
        import trl

        out["versions"]["trl"] = trl.__version__
    Path(args.result).write_text(json.dumps(out))


# ----------------------------------------------------------------------------- parent


def run_side(side: str, python: str, pair: dict[str, Path], prompts_file: Path, work: Path,
             args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    result = work / f"result-{side}-{os.getpid()}-{time.monotonic_ns()}.json"
    cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--model", str(pair["student"]),
           "--teacher", str(pair["teacher"]), "--teachers", str(pair["teachers"]), "--prompts-file",
           str(prompts_file), "--work", str(work / f"{side}-{time.monotonic_ns()}"), "--result", str(result),
           "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
           "--batch", str(args.batch)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "KILN_HOME": str(work / "home"), "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "generated")])}  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    out = json.loads(result.read_text())
    out["wall_s"] = time.perf_counter() - start
    return out


def make_pairs(models: list[str], work: Path) -> dict[str, dict[str, Path]]:
    from kiln.model import create_tiny
    from kiln.teachers import TeacherRegistry

    pairs: dict[str, dict[str, Path]] = {}
    for model in models:
        student, teacher = work / f"{model}-student", work / f"{model}-teacher"
        if model == "tiny":
            for path, seed in ((student, 0), (teacher, 2)):
                if not path.exists():
                    create_tiny(path, seed=seed)
        else:
            tokenizer = pairs.get("tiny", {}).get("student") or work / "tiny-student"
            if not tokenizer.exists():
                create_tiny(tokenizer, seed=0)
            for path, seed in ((student, 0), (teacher, 2)):
                if not path.exists():
                    make_wide(path, tokenizer, seed)
        teachers = work / f"{model}-teachers"
        if not (teachers / f"{TEACHER}.json").exists():
            TeacherRegistry(teachers).add({"alias": TEACHER, "kind": "local", "model_id": str(teacher)})
        pairs[model] = {"student": student, "teacher": teacher, "teachers": teachers}
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, 4 timed candidates, one round")
    parser.add_argument("--models", default="tiny,wide", help="comma list of tiny, wide")
    parser.add_argument("--candidates", type=int, default=None, help="timed candidates (default 24 tiny, 10 wide)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up candidates (default 4 tiny, 2 wide)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--rounds", type=int, default=None, help="runs of each side, order alternating (default 3, 1 with --quick)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side")
    parser.add_argument("--batch", type=int, default=1,
                        help="candidates per optimizer step (Kiln micro_batch_size, TRL per_device_train_batch_size); "
                             "above 1: kiln and trl only, time per candidate from the step ends")  # fmt: skip
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--no-probe", action="store_true", help="skip the scoring/loss probe at V=151,936")
    parser.add_argument("--trl-python", default=TRL_PYTHON)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (models are reused from it)")
    parser.add_argument("--json", type=Path, default=None, help="also write every raw result here")
    # worker mode (internal)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    for name in ("--model", "--teacher", "--teachers", "--prompts-file", "--work", "--result"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    args.rounds = args.rounds or (1 if args.quick else 3)
    models = ["tiny"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    trl_ok = not args.no_trl and Path(args.trl_python).exists()
    sides = ["kiln"] + (["ref"] if args.batch == 1 else []) + (["trl"] if trl_ok else [])
    work = args.dir or Path(tempfile.mkdtemp(prefix="kiln-bench-opd-"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cpus ({cpu_model()}), "
          f"torch {torch.__version__}, {args.threads} torch threads per side")  # fmt: skip
    print(f"work dir {work}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if not trl_ok:
        print(f"trl side skipped ({'--no-trl' if args.no_trl else f'{args.trl_python} not found'})")
    pairs = make_pairs(models, work)
    raw: list[dict[str, Any]] = []
    rows = []
    for model in models:
        timed = args.candidates or (4 if args.quick else 24 if model == "tiny" else 10)
        warmup = args.warmup if args.warmup is not None else (4 if model == "tiny" else 2)
        warmup, timed = _whole(warmup, args.batch), _whole(timed, args.batch)  # whole steps of candidates
        prompts_file = work / f"prompts-{timed + warmup}.json"
        prompts_file.write_text(json.dumps(make_prompts(timed + warmup)))
        results: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for round_ in range(args.rounds):
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                python = args.trl_python if side == "trl" else sys.executable
                r = run_side(side, python, pairs[model], prompts_file, work, args)
                r["load"] = os.getloadavg()[0]
                r["warmup"] = warmup
                results[side].append(r)
                if args.batch > 1:
                    print(f"  {model:5} round {round_ + 1} {side:5} per candidate {per_candidate(r):8.1f} ms  "
                          f"peak {r['peak'] / MIB:6.0f} MiB  wall {r['wall_s']:5.1f} s  load {r['load']:.2f}", flush=True)  # fmt: skip
                    raw.append({"model": model, "side": side, "round": round_ + 1, **r})
                    continue
                print(f"  {model:5} round {round_ + 1} {side:5} step median {med(r, 'step'):8.1f} ms  "
                      f"peak {r['peak'] / MIB:6.0f} MiB  base {r['baseline'] / MIB:5.0f}  wall {r['wall_s']:5.1f} s  "
                      f"load {r['load']:.2f}", flush=True)  # fmt: skip
                raw.append({"model": model, "side": side, "round": round_ + 1, **r})
        rows.append((model, timed, warmup, results))
    if args.batch > 1:
        batch_report(rows, args.batch)
        args.no_probe = True
        if args.json:
            args.json.write_text(json.dumps(raw, indent=1))
    probe = None
    if not args.no_probe:
        probe = run_side("probe", sys.executable, pairs[models[0]], prompts_file, work, args)
        raw.append({"side": "probe", "load": os.getloadavg()[0], **probe})
    if args.json and args.batch == 1:
        args.json.write_text(json.dumps(raw, indent=1))
    if args.batch == 1:
        report(rows)
    if probe is not None:
        print(
            f"\nscoring and loss alone at V={probe['V']:,} (T={probe['T']}, A={probe['A']}, K={TOP_K}; random logits, "
            "median of 5, ms)"
        )
        print(
            f"  teacher scoring after the forward: kiln (log_softmax of every row + stable_top_k) "
            f"{probe['kiln_scoring']:.1f}, plain (log_softmax of A rows + topk) {probe['plain_scoring']:.1f}"
        )
        print(f"  loss forward + backward into [T, V] logits: kiln top-K reverse KL {probe['kiln_loss']:.1f}, "
              f"TRL GKD full-vocabulary reverse KL (beta=1) {probe['trl_loss']:.1f}")  # fmt: skip
    print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    busiest = max(r["load"] for r in raw)
    if busiest > 2.0:
        print(f"warning: the 1-minute load average reached {busiest:.2f} on {os.cpu_count()} cpus during the run; "
              "compare the 'rounds' ranges and rerun on a quieter machine")  # fmt: skip


def _whole(count: int, batch: int) -> int:
    """``count`` rounded up to whole steps of ``batch`` candidates."""
    return -(-count // batch) * batch


def per_candidate(r: dict[str, Any]) -> float:
    """Milliseconds per timed candidate: from the step that ends the warm-up to the last step's end."""
    at = dict(r["ends"])  # candidates done -> when (Kiln reports every candidate, TRL every step)
    last = max(at)
    return (at[last] - at[r["warmup"]]) / (last - r["warmup"]) * 1000 if r["warmup"] else math.nan


def batch_report(rows: list[tuple[str, int, int, dict[str, list[dict[str, Any]]]]], batch: int) -> None:
    print(f"\nbatch {batch}: ms per candidate over the timed steps, each side's fastest round; rounds = the range; "
          "peak and delta in MiB from that round")  # fmt: skip
    for model, n, _warmup, results in rows:
        kiln = min(results["kiln"], key=per_candidate)
        for side, runs in results.items():
            r = min(runs, key=per_candidate)
            values = [per_candidate(x) for x in runs]
            delta, kdelta = (r["peak"] - r["baseline"]) / MIB, (kiln["peak"] - kiln["baseline"]) / MIB
            ratio = (
                ""
                if side == "kiln"
                else f"kiln/{side} time {per_candidate(kiln) / per_candidate(r):.2f}x, delta {kdelta / delta:.2f}x"
            )
            print(f"{model:5} n={n:<3} {side:5} {per_candidate(r):8.1f} ms  rounds {min(values):.1f}-{max(values):.1f}  "
                  f"peak {r['peak'] / MIB:5.0f}  delta {delta:5.0f}  {ratio}")  # fmt: skip


def timed_records(r: dict[str, Any]) -> list[dict[str, Any]]:
    return r["records"][r["warmup"] :]


def med(r: dict[str, Any], key: str) -> float:
    values = [x[key] for x in timed_records(r) if x[key] is not None]
    return statistics.median(values) * (1000 if key in (*PHASES, "step", "cycle") else 1) if values else math.nan


def report(rows: list[tuple[str, int, int, dict[str, list[dict[str, Any]]]]]) -> None:
    def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return min(runs, key=lambda r: med(r, "step"))

    print("\nper candidate, medians over the timed candidates of each side's least disturbed round (ms); rounds = "
          "the range of the per-round step medians; memory (MiB) from that round; tokens = mean rollout length")  # fmt: skip
    head = (f"{'model':5} {'n':>3} {'side':5} {'step':>8} {'rounds':>15} {'cycle':>8} {'rollout':>8} {'ms/tok':>6} "
            f"{'teacher':>8} {'student':>8} {'loss':>6} {'backward':>8} {'optim':>6} {'other':>6} {'tokens':>6} "
            f"{'peak':>5} {'base':>5} {'delta':>5} {'kiln/side':>9} {'kiln/side':>9} {'max|dloss|':>10}")  # fmt: skip
    print(head)
    print(" " * (len(head) - 30) + "time     delta")
    for model, n, _warmup, results in rows:
        kiln = best(results["kiln"])
        kiln_losses = [x["value"] for x in kiln["records"]]
        for side, runs in results.items():
            r = best(runs)
            recs = timed_records(r)
            other = statistics.median(x["step"] - sum(x[p] for p in PHASES) for x in recs) * 1000
            tokens = statistics.mean(x["tokens"] for x in recs)
            per_token = statistics.median(x["rollout"] / max(x["tokens"], 1) for x in recs) * 1000
            medians = [med(x, "step") for x in runs]
            delta = (r["peak"] - r["baseline"]) / MIB
            kdelta = (kiln["peak"] - kiln["baseline"]) / MIB
            ratio_t = "" if side == "kiln" else f"{med(kiln, 'step') / med(r, 'step'):.2f}x"
            ratio_m = "" if side == "kiln" else f"{kdelta / delta:.2f}x" if delta > 0 else "n/a"
            dloss = ""
            if side == "ref":
                dloss = f"{max(abs(a - x['value']) for run in runs for a, x in zip(kiln_losses, run['records'], strict=True)):.1e}"  # fmt: skip
            print(f"{model:5} {n:>3} {side:5} {med(r, 'step'):8.1f} {f'{min(medians):.1f}-{max(medians):.1f}':>15} "
                  f"{med(r, 'cycle'):8.1f} {med(r, 'rollout'):8.1f} {per_token:6.2f} {med(r, 'teacher'):8.1f} "
                  f"{med(r, 'student'):8.1f} {med(r, 'loss'):6.2f} {med(r, 'backward'):8.1f} {med(r, 'optim'):6.2f} "
                  f"{other:6.1f} {tokens:6.1f} {r['peak'] / MIB:5.0f} {r['baseline'] / MIB:5.0f} {delta:5.0f} "
                  f"{ratio_t:>9} {ratio_m:>9} {dloss:>10}")  # fmt: skip
    print("\ncross-checks (each side's least disturbed round)")
    for model, _n, _warmup, results in rows:
        kiln = best(results["kiln"])
        timings = kiln["receipt_phase_timings"]
        clocks = {p: sum(x[p] for x in kiln["records"]) * 1000 for p in PHASES}
        print(f"{model:5} kiln receipt phase_timings, all candidates (ms): policy_forward {timings['policy_forward_ms']:.0f}"
              f" (bench: rollout + student {clocks['rollout'] + clocks['student']:.0f}), reference_forward "
              f"{timings['reference_forward_ms']:.0f} (teacher {clocks['teacher']:.0f}), backward "
              f"{timings['backward_ms']:.0f} ({clocks['backward']:.0f}), optimizer {timings['optimizer_ms']:.0f} "
              f"({clocks['optim']:.0f})")  # fmt: skip
        if "trl" in results:
            trl = best(results["trl"])
            norm = trl["trl_loss_normaliser"][trl["warmup"] :]
            items = sorted({x["num_items_in_batch"] for x in norm})
            print(f"{model:5} trl: GKD divided the summed JSD by num_items_in_batch = {items} (the placeholder "
                  f"answer's labels) while rollouts had {min(x['tokens'] for x in norm)}-"
                  f"{max(x['tokens'] for x in norm)} scored positions; its loss is the full-vocabulary reverse KL; "
                  f"generation stops at ids {trl['trl_eos_token_id']}")  # fmt: skip


if __name__ == "__main__":
    main()
