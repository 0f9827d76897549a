"""The invariant forward's cost: lone decoding and a training step, against the model's own forward, side by side.

    python bench/bench_invariant.py [--models tiny,wide] [--repeats 5] [--tokens 64] [--batch 8] [--length 128]
                                    [--threads T]

Two comparisons per model, each repeat running both sides in turn (medians reported, and their ratio):

(a) lone decoding: one sequence (a 31-token prompt) greedily decoded ``--tokens`` tokens. ``before``: the model's own
    forward with its own KV cache, one token a step, the first maximum of the last position's logits (what decoding
    a sequence alone ran before the invariant forward). ``after``: ``kiln.model.decode`` -- one row of the one
    batched decoder on the invariant forward, and the portable draw -- with the weights packed as the server packs
    its CPU serving copy (``Decoder.pack``). Both must produce the same tokens (the forward's numerics differ only
    in rounding; a greedy tie broken otherwise would show here).
(b) a training step: ``--batch`` sequences of ``--length`` tokens with LoRA attached (rank 16, every projection),
    the log-probabilities of their last quarter of positions, a loss, and its backward. ``plain``: the model's own
    right-padded forward, its head on the wanted rows (``kiln.trainers._forwards.selected_logits``) and torch's
    ``log_softmax``; ``invariant``: the invariant forward (``invariant_selected``) and its ``log_softmax``.

Models: ``tiny`` (the built-in tiny model) and ``wide`` (the benches' 23.2 M-parameter model, ``_machine.make_wide``).
``--smoke`` runs the smallest size (tiny, 2 tokens, batch 2 of 16, one repeat): the suite runs it. Results:
bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _machine import cpu_model, make_wide


def load(name: str, work: Path) -> Any:
    from kiln.model import ensure_default_tiny, load_base_model

    tiny = ensure_default_tiny(work / "models")
    if name == "tiny":
        return load_base_model(tiny).model.eval()
    path = work / "wide"
    if not path.exists():
        make_wide(path, tiny)
    return load_base_model(path).model.eval()


def lone_before(model: Any, prompt: list[int], tokens: int) -> list[int]:
    import torch

    out, cache, ids = [], None, torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(tokens):
            result = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = result.past_key_values
            token = int(torch.argmax(result.logits[0, -1].float()))
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def lone_after(model: Any, prompt: list[int], tokens: int) -> list[int]:
    from kiln.model import Sampling, decode

    (decoded,) = decode(
        model, [prompt], max_new=[tokens], sampling=Sampling(), seed=0, sequences=[0], stop_ids=frozenset()
    )
    return decoded.ids


def training_step(model: Any, sequences: list[list[int]], wanted: list[list[bool]], invariant: bool) -> float:
    import torch

    from kiln.kernels import invariant as inv
    from kiln.trainers._forwards import invariant_decoder, invariant_selected, selected_logits
    from kiln.training import model_head

    if invariant:
        found = invariant_selected(invariant_decoder(model), sequences, wanted)
        logp = inv.log_softmax(found.rows)
    else:
        head = getattr(model, "_bench_head", None)
        if head is None:
            head = model._bench_head = model_head(model.get_base_model())
        found = selected_logits(model, head, sequences, wanted)
        logp = torch.log_softmax(found.rows, dim=-1)
    loss = -logp.gather(1, found.targets.unsqueeze(1)).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def side_by_side(
    label: str, first: Callable[[], Any], second: Callable[[], Any], repeats: int, same: Callable[[Any, Any], str]
) -> tuple[float, float]:
    """Both sides once each per repeat, in turn (after one warm-up each); the medians of their seconds. ``same``
    says, per repeat, how their results compare."""
    first(), second()
    seconds: tuple[list[float], list[float]] = ([], [])
    for repeat in range(repeats):
        results = []
        for side, run in enumerate((first, second)):
            started = time.perf_counter()
            results.append(run())
            seconds[side].append(time.perf_counter() - started)
        print(f"{label} repeat {repeat}: {seconds[0][-1]:.3f} s, {seconds[1][-1]:.3f} s ({same(*results)})", flush=True)
    return statistics.median(seconds[0]), statistics.median(seconds[1])


def bench_model(name: str, work: Path, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    import torch

    from kiln.model import decoder_for
    from kiln.training import attach_lora

    model = load(name, work)
    vocab = model.config.vocab_size
    decoder_for(model).pack()  # as the server's CPU serving copy (the training step's peft model is another object)
    prompt = [(7 * i + 3) % (vocab - 10) + 10 for i in range(31)]
    out = {
        "lone": side_by_side(
            f"{name} lone decoding (before, after)",
            lambda: lone_before(model, prompt, args.tokens),
            lambda: lone_after(model, prompt, args.tokens),
            args.repeats,
            lambda a, b: f"same tokens: {'yes' if a == b else 'NO'}",
        )
    }
    peft = attach_lora(model, rank=16, alpha=32.0, seed=0)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(10, vocab, (args.length,), generator=generator).tolist() for _ in range(args.batch)]
    tail = args.length // 4
    wanted = [[p >= args.length - 1 - tail for p in range(args.length - 1)] for _ in sequences]
    peft.train()
    out["train"] = side_by_side(
        f"{name} training step (plain, invariant)",
        lambda: training_step(peft, sequences, wanted, False),
        lambda: training_step(peft, sequences, wanted, True),
        args.repeats,
        lambda a, b: f"loss {a:.6f} vs {b:.6f}",
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,wide")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the suite's)")
    args = parser.parse_args()
    if args.smoke:
        args.models, args.repeats, args.tokens, args.batch, args.length = "tiny", 1, 2, 2, 16
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {cpu_model()}, {torch.get_num_threads()} "
        f"threads, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-invariant-") as tmp:
        os.environ["KILN_HOME"] = str(Path(tmp) / "home")
        for name in args.models.split(","):
            results[name] = bench_model(name, Path(tmp), args)
    print(f"\nmedians of {args.repeats} repeats")
    print(f"{'model':6} {'case':42} {'before':>10} {'after':>10} {'ratio':>7}")
    for name, found in results.items():
        before, after = found["lone"]
        print(f"{name:6} {f'lone decoding, {args.tokens} tokens (own forward -> invariant)':42} "
              f"{before:9.3f}s {after:9.3f}s {after / before:6.2f}x")  # fmt: skip
        plain, inv = found["train"]
        print(f"{name:6} {f'training step, {args.batch} x {args.length} (plain -> invariant)':42} "
              f"{plain:9.3f}s {inv:9.3f}s {inv / plain:6.2f}x")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
