"""``kiln train``: SFT, GRPO and OPD jobs on a server, job status and cancellation; ``kiln train sft|grpo|opd
--local`` and ``kiln models create-tiny`` run in-process (they import torch, on use).

Without ``--local`` a training command builds the request from the file and the flags (the same
flags build the same ``SftConfig`` as ``--local``, in ``kiln.cli._requests``), submits it with the
generated SDK and prints the job id and effective seed; ``--wait`` then follows the job with a
progress bar until it ends. The parsers are here; the local runs are in ``kiln.cli._local`` and the HTTP commands in
``kiln.cli._jobs``, neither of which imports this module.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from kiln.cli._client import DEFAULT_URL, add_client_options
from kiln.cli._jobs import cmd_train_cancel, cmd_train_status, submit
from kiln.cli._local import cmd_train_local, rank_flags_problem

OPTIMIZERS = ("muon", "adam_w", "sgd")


def add_train_parser(sub: Any) -> None:
    train = sub.add_parser(
        "train",
        help="train an adapter on a server (or in-process with --local); follow and cancel jobs",
        description="Submit SFT, GRPO and OPD jobs to a running `kiln serve` (--url, default $KILN_URL, else "
        f"{DEFAULT_URL}), list them and cancel them. `kiln train sft --local` trains in this process instead.",
    )
    kinds = train.add_subparsers(dest="train_kind", metavar="KIND")
    p = kinds.add_parser(
        "sft",
        help="supervised fine-tuning on a file of conversations",
        description="Train a LoRA adapter on conversations ({'messages': [...]} per JSONL line, or a JSON array). "
        "By default the job is submitted to the server: a .jsonl file is sent as its absolute dataset_path (the "
        "server reads it, so it must see the same file system), any other file as inline examples. "
        "With --local the job runs in this process and writes the adapter, its train receipt and its manifest "
        "into the adapter registry.",
    )
    p.add_argument(
        "-f", "--file", required=True, help="a .jsonl file (sent as dataset_path) or a JSON array of examples"
    )
    p.add_argument("--adapter", required=True, help="output adapter name (path-safe)")
    p.add_argument("--local", action="store_true", help="run in-process instead of submitting to a server")
    p.add_argument("--adapter-dir", help="--local: adapter registry directory (default: $KILN_HOME/adapters)")
    p.add_argument(
        "--model", help="--local: base model directory (default: KILN_MODEL_PATH, else the built-in tiny model)"
    )
    p.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    p.add_argument("--seed", help="effective seed (default: a fresh random 64-bit seed, printed)")
    p.add_argument("--lr", type=float, help="learning rate (default: muon 1e-3, adam_w/sgd 1e-4)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="muon", help="the optimizer of the LoRA parameters")
    p.add_argument("--lora-rank", type=int, default=16, metavar="R", help="LoRA rank r")
    p.add_argument(
        "--lora-alpha", type=float, default=32.0, metavar="A", help="LoRA alpha (alpha / rank above 2 is refused)"
    )
    _add_schedule(p)
    _add_target_modules(p)
    _add_memory_options(p)
    _add_micro_batch(p, "conversations per forward pass, right-padded (default 1: each alone, unpadded)")
    _add_accumulation(
        p, "micro-batches per optimizer step (default 1); a step's loss is the mean over all its supervised tokens"
    )
    p.add_argument(
        "--group-by-length",
        action="store_true",
        help="order each window of 50 steps' conversations longest first, so micro-batches pad little",
    )
    p.add_argument(
        "--invalid-row-policy",
        choices=("fail", "skip"),
        default="fail",
        help="a row that is not a valid conversation: refuse the job naming it (fail), or drop it (skip)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        metavar="N",
        help="longest row in tokens (default: the model's context length)",
    )
    p.add_argument(
        "--overlong-row-policy",
        choices=("fail", "skip", "truncate"),
        help="a row over --max-seq-len: refuse the job (fail, the default), drop the row (skip), or keep its last "
        "tokens (truncate)",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        metavar="N",
        help="publish an exact-resume checkpoint every N optimizer steps (default: training.checkpoint_interval "
        "of kiln.toml or KILN_TRAINING_CHECKPOINT_INTERVAL -- the server's, without --local -- else none; "
        "Ctrl-C under --local always publishes one at the next step)",
    )
    p.add_argument(
        "--resume-checkpoint",
        metavar="BASENAME",
        help="continue an interrupted run from this checkpoint (basename in the adapter registry, or an "
        "absolute path directly inside it); every other option must match the original run",
    )
    _add_ranks(
        p,
        "taking its share of every optimizer step's micro-batches; a step is micro-batch x accumulation x world size "
        "conversations",
    )
    _add_job_options(
        p,
        json_help="print the result as JSON: the server's TrainingResponse (the final "
        "TrainingJobDetail with --wait), or the local result with --local; no progress bar",
    )
    # what a data file is for this kind (kiln.cli._requests.build_request): a .json object gives its conversations
    p.set_defaults(
        func=cmd_train_sft, inline_key="examples", whole_request=False, file_config={}, request_type="SftRequest"
    )

    p = kinds.add_parser(
        "grpo",
        help="GRPO on a file of scored groups, or online: Kiln samples and scores each step's groups itself",
        description="Submit a GRPO job: a .jsonl file is sent as its absolute dataset_path (the streamed route), "
        "a .json file as the request object itself (or, for a bare array, as its groups). With --tasks instead "
        "of --file the run is online: every step samples --group-size completions of the next tasks from the "
        "current policy, scores them with --scorer and trains on them. --adapter becomes config.output_name; the "
        "other flags override the file's config.",
    )
    _add_kind_options(p, file_required=False)
    p.add_argument(
        "--tasks",
        metavar="FILE",
        help="online GRPO: a JSONL file of tasks ({messages} or {prompt}, an id, the fields the scorer reads)",
    )
    p.add_argument(
        "--scorer",
        help="online: builtin:exact|regex|json; with --local also a Python module:function (TRL's reward-function "
        "call), an executable or an http(s) URL",
    )
    p.add_argument("--group-size", type=int, metavar="G", help="online: completions per task visit (default 8)")
    p.add_argument("--passes", type=int, metavar="N", help="online: visits of every task (default 1)")
    p.add_argument(
        "--request-template",
        metavar="FILE",
        help="online: a JSON file of sampling settings (temperature, top_p, top_k, min_p, repetition_penalty, "
        "min_tokens, max_tokens) and messages put before every task's",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the streamed file end to end without training (needs a .jsonl dataset_path)",
    )
    _add_micro_batch(p, "completions of a group per forward pass, right-padded (default 1: one dense forward each)")
    _add_accumulation(
        p,
        "groups per optimizer step (per_sample: completions of a group; default 1); the loss is the step's token mean",
    )
    _add_prefix_sharing(p, "a group's shared prompt", "completion", "grpo")
    _add_ranks(
        p,
        "taking a contiguous block of the completions of every group of a step (per_sample: the step's completions "
        "dealt in turn); a step is what one process takes",
    )
    p.set_defaults(
        func=cmd_train_grpo, inline_key="groups", whole_request=True, file_config={}, request_type="GrpoRequest"
    )

    p = kinds.add_parser(
        "opd",
        help="on-policy distillation from a registered teacher",
        description="Submit an OPD job: a .json file holding the request object or a bare array of prompts "
        "(sent as {'prompts': [...], 'teacher': ALIAS}); a .jsonl file is sent as its absolute dataset_path. "
        "--adapter becomes config.output_name; the other flags override the file's config. With --local it runs "
        "in-process against the local teacher registry (kiln teachers add); checkpoint_interval defaults to 25.",
    )
    _add_kind_options(p)
    p.add_argument(
        "--teacher", required=True, metavar="ALIAS", help="alias of a registered teacher (kiln teachers list)"
    )
    p.add_argument("--epochs", type=int, help="passes over the prompt x sample candidates")
    _add_micro_batch(p, "candidates rolled out and scored together (default 1: one at a time)")
    _add_accumulation(
        p,
        "micro-batches of candidates per optimizer step (default 1); the loss is the step's mean over action positions",
    )
    _add_prefix_sharing(p, "the tokens a micro-batch's rollouts share", "rollout", "opd")
    _add_ranks(
        p,
        "decoding every rollout of a step (one generator), then scoring and training the step's micro-batches dealt "
        "in turn; a step is what one process takes",
    )
    # a .jsonl file is a pre-scored teacher file: off_policy unless the file's config or the flags say otherwise
    p.set_defaults(
        func=cmd_train_opd,
        inline_key="prompts",
        whole_request=True,
        file_config={"training_mode": "off_policy"},
        request_type="OpdRequest",
    )

    p = kinds.add_parser(
        "status",
        help="all jobs as a table, or one job in detail",
        description="Without --job-id: every job (id, type, state, progress, loss, adapter). With --job-id: its "
        "state, progress, loss, seed, error and the checkpoint a failed run resumes from.",
    )
    p.add_argument("--job-id", metavar="ID", help="show this job in detail")
    add_client_options(p, json_help="print the server's TrainingStatus list (TrainingJobDetail with --job-id)")
    p.set_defaults(func=cmd_train_status)

    p = kinds.add_parser(
        "cancel",
        help="cancel a queued job, or ask a running one to stop at its next step",
        description="A queued job is removed at once; a running job finishes its step, publishes a checkpoint "
        "and ends failed with reason cancelled (resume it with --resume-checkpoint).",
    )
    p.add_argument("--job-id", required=True, metavar="ID", help="the job to cancel")
    add_client_options(p, json_help="print the server's CancelTrainingJobResponse")
    p.set_defaults(func=cmd_train_cancel)


def _add_job_options(p: argparse.ArgumentParser, *, json_help: str) -> None:
    """What every submission shares: activation, following the job, and the client options."""
    p.add_argument(
        "--no-auto-load",
        action="store_true",
        help="do not make the adapter active on the server when the job succeeds (config.auto_load false)",
    )
    p.add_argument(
        "--wait", action="store_true", help="follow the job until it ends; exit 0 if it completed, 1 if it failed"
    )
    add_client_options(p, json_help=json_help)


def _module_names(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated module names, got {value!r}")
    return names


def _add_schedule(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lr-scheduler",
        choices=("constant", "linear", "cosine"),
        help="learning-rate schedule after the warmup (default constant)",
    )
    warmup = p.add_mutually_exclusive_group()
    warmup.add_argument("--warmup-steps", type=int, metavar="N", help="linear warmup over the first N optimizer steps")
    warmup.add_argument("--warmup-ratio", type=float, metavar="R", help="warmup over this fraction of the run's steps")
    p.add_argument(
        "--min-lr-ratio", type=float, metavar="R", help="linear/cosine: end at R x the base rate (default 0)"
    )


def device_setting(value: str) -> str:
    """An argparse type: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (checked before torch is imported; whether this
    machine has the device is admission's question)."""
    if not DEVICE_SETTING.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device; use auto, cpu, cuda or cuda:N")
    return value


DEVICE_SETTING = re.compile(r"auto|cpu|cuda(:(0|[1-9][0-9]{0,3}))?")
DEVICE_HELP = (
    "where to compute: cpu, cuda (the current CUDA device), cuda:N, or auto (the first CUDA device when there is one, "
    "else the CPU)"
)


def _add_memory_options(p: argparse.ArgumentParser) -> None:
    """Where the job computes, how the frozen base is held and what the backward pass keeps (docs/training.md,
    "Precision and memory"; docs/gpu.md)."""
    p.add_argument(
        "--device", type=device_setting, metavar="DEVICE", help=f"{DEVICE_HELP} (default: training.device, else auto)"
    )
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16", "auto"),
        help="the frozen base weights in float32 or bfloat16 (LoRA, gradients and optimizer stay float32); auto: "
        "the checkpoint's own dtype (default: training.precision, else auto)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        choices=("off", "on", "auto"),
        help="recompute each decoder layer in the backward pass instead of keeping its activations; auto: on only "
        "when the run would not fit otherwise (default: training.gradient_checkpointing, else auto)",
    )
    p.add_argument(
        "--quantization",
        choices=("none", "nf4"),
        help="nf4: load the frozen base in 4-bit NormalFloat (QLoRA; needs bitsandbytes>=0.47) (default: "
        "training.quantization, else none)",
    )


def _add_prefix_sharing(p: argparse.ArgumentParser, what: str, unit: str, block: str) -> None:
    p.add_argument(
        "--prefix-sharing",
        choices=["auto", "off"],
        help=f"run {what} once (auto, the default, where the model is proven to allow it) or every {unit} in full "
        f"(off); the receipt's {block}.prefix_sharing says what ran",
    )


def _add_micro_batch(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--micro-batch-size", type=int, metavar="N", help=what)


def _add_accumulation(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--gradient-accumulation-steps", type=int, metavar="N", help=what)


def _add_target_modules(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora-target-modules",
        type=_module_names,
        metavar="NAMES",
        help="comma-separated leaf names of the decoder-layer modules to adapt, e.g. q_proj,v_proj or c_attn "
        "(default: every linear projection of the decoder layers)",
    )


def _add_ranks(p: argparse.ArgumentParser, share: str) -> None:
    """The data-parallel options of a kind that trains over several ranks; ``share``: what each rank takes."""
    ranks = p.add_argument_group(
        "data parallelism (--local)",
        f"train over several ranks with torchrun: each rank a process (gloo on CPU, NCCL on CUDA) {share}; rank 0 "
        "publishes. A checkpoint resumes only at the world size it was written at.",
    )
    ranks.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="ranks on this machine (default 1)")
    ranks.add_argument("--nnodes", type=int, default=1, metavar="N", help="machines in the run (default 1)")
    ranks.add_argument("--node-rank", type=int, default=0, metavar="R", help="this machine's index, 0..nnodes-1")
    ranks.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="where the nodes meet (c10d rendezvous; needed with --nnodes > 1)"
    )
    ranks.add_argument("--rdzv-id", metavar="ID", help="the run's rendezvous id, the same on every node")


def _add_kind_options(p: argparse.ArgumentParser, *, file_required: bool = True) -> None:
    """The options of ``kiln train grpo`` and ``kiln train opd`` (defaults are the server's)."""
    p.add_argument(
        "-f", "--file", required=file_required, help="a .jsonl file (sent as dataset_path) or a .json request"
    )
    p.add_argument("--adapter", required=True, help="output adapter name (path-safe): config.output_name")
    p.add_argument("--local", action="store_true", help="run in-process instead of on a server")
    p.add_argument("--model", help="--local: local Hugging Face model directory (default: the built-in tiny model)")
    p.add_argument("--adapter-dir", help="--local: adapter registry directory (default: $KILN_HOME/adapters)")
    p.add_argument("--seed", help="effective seed (default: a fresh random 64-bit seed, printed)")
    p.add_argument("--lr", type=float, help="learning rate (default: the optimizer's)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, help="the optimizer of the LoRA parameters (default: muon)")
    p.add_argument("--lora-rank", type=int, metavar="R", help="LoRA rank r (default: 16)")
    p.add_argument(
        "--lora-alpha", type=float, metavar="A", help="LoRA alpha (default: 32; alpha / rank above 2 is refused)"
    )
    _add_schedule(p)
    _add_target_modules(p)
    _add_memory_options(p)
    p.add_argument("--checkpoint-interval", type=int, metavar="N", help="publish a checkpoint every N steps")
    p.add_argument("--resume-checkpoint", metavar="BASENAME", help="continue from this checkpoint")
    _add_job_options(p, json_help="print the server's TrainingResponse (the final TrainingJobDetail with --wait)")


def add_models_parser(sub: Any) -> None:
    models = sub.add_parser("models", help="built-in models")
    verbs = models.add_subparsers(dest="models_verb", metavar="VERB")
    p = verbs.add_parser("create-tiny", help="write a tiny model (same tokenizer as the default, weights from --seed)")
    p.add_argument("path", help="directory to create (must not exist)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (0 is the built-in default)")
    p.set_defaults(func=cmd_create_tiny)


def cmd_train_sft(args: argparse.Namespace) -> int:
    if not args.local and rank_flags_problem(args) is not None:
        print(f"error: {rank_flags_problem(args)}", file=sys.stderr)
        return 2
    return cmd_train_local(args, "sft") if args.local else submit(args, "sft")


def cmd_train_grpo(args: argparse.Namespace) -> int:
    online = [flag for flag, value in (("--scorer", args.scorer), ("--group-size", args.group_size),
              ("--passes", args.passes), ("--request-template", args.request_template)) if value is not None]  # fmt: skip
    if (args.file is None) == (args.tasks is None):
        print("error: give a data file (-f/--file) or online tasks (--tasks), one of the two", file=sys.stderr)
        return 2
    if args.tasks is None and online:
        print(f"error: {', '.join(online)} go with --tasks (online GRPO)", file=sys.stderr)
        return 2
    if args.tasks is not None and args.scorer is None:
        print(
            "error: --tasks needs --scorer (builtin:exact, builtin:regex or builtin:json for a start)", file=sys.stderr
        )
        return 2
    if args.tasks is not None:
        args.file = args.tasks  # the file the command reads; build_request makes the online request of it
    return cmd_train_local(args, "grpo") if args.local else submit(args, "grpo")


def cmd_train_opd(args: argparse.Namespace) -> int:
    return cmd_train_local(args, "opd") if args.local else submit(args, "opd")


def cmd_create_tiny(args: argparse.Namespace) -> int:
    from kiln.model import create_tiny

    try:
        path = create_tiny(args.path, seed=args.seed)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"✓ tiny model (seed {args.seed}) written to {path}")
    return 0
