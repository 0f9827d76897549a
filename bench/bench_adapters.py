"""Adapter restore cost versus the shell's copy-and-hash.

    python bench/bench_adapters.py [--dir DIR] [--reps 9] [--reps-1gb 7] [--skip-1gb] [--keep]

``restore_adapter`` (strict manifest load, one streamed pass per file that copies and hashes,
fsync per file, digest comparison, layout checks, receipt validation, rename, fsync of the
registry) against the same bytes handled by coreutils in subprocesses:

* ``cp+sha256sum``: ``cp`` of the three files into a fresh directory, then ``sha256sum`` of
  the copies (no fsync: the copies may still be dirty in the page cache);
* ``cp+sha256sum+sync``: the same, then ``sync`` of the copied files (fsync each, what
  restore does for durability).

The adapter is synthetic but valid: ``adapter_model.safetensors`` holds random float32 LoRA
A/B pairs of the wanted total size (``safetensors.torch.save``), beside a PEFT-style
``adapter_config.json`` and an ``adapter_manifest.json`` built from the schema's receipt-less
``AdapterManifest`` example with the real digests (checked with ``contracts.problems``).
The source stays in the page cache (warm reads); every route writes a fresh destination
that is deleted after timing. Repetitions are interleaved (shell, shell+sync, restore, ...)
after one untimed warm-up round; medians and the ratio restore / shell are reported.
Target: restore <= 1.3x ``cp+sha256sum`` at ~1 GiB. Numbers go to bench/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from _machine import cpu_model, filesystem_of
from safetensors.torch import save as save_safetensors

from kiln import contracts
from kiln.adapters import restore_adapter, verify_adapter

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "schemas" / "kiln-artifacts-v1.schema.json"
MIB = 1024 * 1024
SIZES = {"16 MiB": 16 * MIB, "1 GiB": 1024 * MIB}
LARGE = "1 GiB"
NAME = "bench-adapter"
FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_manifest.json")
ROUTES = ("cp+sha256sum", "cp+sha256sum+sync", "restore", "verify")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"{name} is not on PATH; the baseline needs coreutils")
    return path


CP, SHA256SUM, SYNC = _tool("cp"), _tool("sha256sum"), _tool("sync")


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(8 * MIB):
            h.update(block)
    return "sha256:" + h.hexdigest()


def make_adapter(directory: Path, total: int, seed: int) -> Path:
    """A valid adapter directory of ~``total`` bytes of weights; returns its manifest path."""
    directory.mkdir(parents=True)
    rank, hidden = 16, 4096
    per_pair = 2 * rank * hidden * 4
    layers = max(1, total // per_pair)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(hidden, rank, generator=gen)
    (directory / "adapter_model.safetensors").write_bytes(save_safetensors(tensors))
    del tensors
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "bench",
        "r": rank,
        "lora_alpha": 32,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj"],
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    example = json.loads(SCHEMA.read_text())["x-kiln-examples"]["AdapterManifest"][1]
    manifest = {
        **example,
        "adapter_name": NAME,
        "parent_adapter": None,
        "safetensors_hash": _sha(directory / "adapter_model.safetensors"),
        "config_hash": _sha(directory / "adapter_config.json"),
    }
    problems = contracts.problems("AdapterManifest", manifest)
    if problems:
        raise SystemExit(f"the bench manifest is invalid: {problems}")
    path = directory / "adapter_manifest.json"
    path.write_bytes(contracts.render("AdapterManifest", manifest))
    return path


def shell(source: Path, dest: Path, *, sync: bool) -> float:
    copies = [str(dest / f) for f in FILES]
    start = time.perf_counter()
    dest.mkdir()
    subprocess.run([CP, *(str(source / f) for f in FILES), str(dest)], check=True)
    subprocess.run([SHA256SUM, *copies], check=True, stdout=subprocess.DEVNULL)
    if sync:
        subprocess.run([SYNC, *copies, str(dest)], check=True)
    return time.perf_counter() - start


def restore(manifest: Path, registry: Path) -> float:
    start = time.perf_counter()
    restore_adapter(manifest, registry)
    return time.perf_counter() - start


def verify(directory: Path) -> float:
    start = time.perf_counter()
    receipt = verify_adapter(str(directory), directory.parent)
    elapsed = time.perf_counter() - start
    if receipt["status"] != "ok":
        raise SystemExit(f"the bench adapter does not verify: {receipt['checks'][-1]}")
    return elapsed


def one(route: str, manifest: Path, scratch: Path) -> float:
    dest = scratch / "dest"
    try:
        if route == "verify":
            return verify(manifest.parent)
        if route == "restore":
            scratch.joinpath("registry").mkdir()
            return restore(manifest, scratch / "registry")
        return shell(manifest.parent, dest, sync=route.endswith("sync"))
    finally:
        shutil.rmtree(dest, ignore_errors=True)
        shutil.rmtree(scratch / "registry", ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--reps-1gb", type=int, default=7)
    parser.add_argument("--skip-1gb", action="store_true")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-adapters-", dir=args.dir))
    free = shutil.disk_usage(work).free
    sizes = dict(SIZES)
    if args.skip_1gb or free < 4 * 1024 * MIB:
        if not args.skip_1gb:
            print(f"only {free / MIB:,.0f} MiB free in {work}: skipping {LARGE} (needs 4 GiB)")
        sizes.pop(LARGE)
    try:
        run(work, sizes, args, free)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def run(work: Path, sizes: dict[str, int], args: argparse.Namespace, free: int) -> None:
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"work dir {work} ({filesystem_of(work)}, {free / 2**30:,.0f} GiB free); load {os.getloadavg()[0]:.2f}")
    print()
    print("restore vs cp + sha256sum, same files, warm source; medians of interleaved rounds (ms)")
    header = (
        f"{'weights':8} {'bytes':>14} "
        + " ".join(f"{r:>18}" for r in ROUTES)
        + f" {'n':>3} {'ratio':>6} {'ratio+sync':>10} {'verify':>7}"
    )
    print(header)
    ratios = {}
    verify_ratios = {}
    for seed, (label, total) in enumerate(sizes.items()):
        manifest = make_adapter(work / f"src-{seed}" / NAME, total, seed)
        size = sum((manifest.parent / f).stat().st_size for f in FILES)
        scratch = work / f"scratch-{seed}"
        scratch.mkdir()
        reps = args.reps_1gb if label == LARGE else args.reps
        times: dict[str, list[float]] = {r: [] for r in ROUTES}
        for r in ROUTES:  # warm-up round, untimed
            one(r, manifest, scratch)
        for i in range(reps):
            order = ROUTES if i % 2 == 0 else tuple(reversed(ROUTES))
            for r in order:
                times[r].append(one(r, manifest, scratch))
        med = {r: statistics.median(t) * 1e3 for r, t in times.items()}
        ratio = med["restore"] / med["cp+sha256sum"]
        ratio_sync = med["restore"] / med["cp+sha256sum+sync"]
        ratios[label] = ratio
        verify_ratios[label] = med["verify"] / med["cp+sha256sum"]
        cells = " ".join(f"{med[r]:>18.1f}" for r in ROUTES)
        print(
            f"{label:8} {size:>14,} {cells} {reps:>3} {ratio:>5.2f}x {ratio_sync:>9.2f}x {verify_ratios[label]:>6.2f}x"
        )
        shutil.rmtree(manifest.parent.parent)
    print()
    print(
        "ratio: restore / cp+sha256sum; ratio+sync: restore / cp+sha256sum+sync (the shell also fsyncs, as restore "
        "does); verify: verify / cp+sha256sum (verify copies nothing: it hashes every file and reads every tensor)"
    )
    print("small sizes are dominated by the shell route's three process starts")
    for label, ratio in ratios.items():
        if label == LARGE:
            print(
                f"target restore <= 1.3x cp+sha256sum at {label}: {ratio:.2f}x ({'met' if ratio <= 1.3 else 'NOT met'})"
            )
            v = verify_ratios[label]
            print(f"target verify <= 1.3x cp+sha256sum at {label}: {v:.2f}x ({'met' if v <= 1.3 else 'NOT met'})")


if __name__ == "__main__":
    main()
