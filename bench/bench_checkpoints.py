"""Checkpoint publication cost and the flat metadata-only status read.

    python bench/bench_checkpoints.py [--dir DIR] [--reps 15] [--reps-1gb 9] [--skip-1gb] [--keep]

Two targets of spec/30, measured side by side in one process:

1. Publication versus a raw write. ``publish_checkpoint`` (hidden staging directory,
   ``.incomplete`` sentinel, write + fsync of every file, SHA-256 of every file, strict
   manifest render, write + fsync of the manifest, sentinel removal, rename, fsync of the
   parent) against writing the same four files (identical bytes, manifest included) into
   a plain directory with one fsync per file. Repetitions are interleaved (raw, publish,
   raw, publish, ...) after one untimed warm-up pair; medians and their ratio are
   reported, with the three publish phases from ``PublishedCheckpoint.timings``. Target:
   publish <= 2x raw, fsync included.
2. The status read. ``inspect_checkpoint`` (metadata only) on checkpoints whose tensor
   files total ~1 MiB and ~1 GiB, interleaved; ``load_checkpoint`` (every byte hashed)
   for contrast. Target: inspect flat, 1 GiB <= 1.2x 1 MiB.

The checkpoints are real: the tiny model is created under the work directory and trained
for one SFT epoch with a checkpoint every step, and the newest checkpoint's manifest and
loop state (which publication validates against the manifest's progress) are reused. Only
the two tensor files are replaced, by safetensors files of random float32 tensors of the
wanted size (adapter one third, optimizer two thirds, like AdamW's two slots). The
tensors are serialised before timing: in both routes the bytes are ready in memory, so
``capture`` (which on a shared device copies tensors to the host) is ~0 here and the
serialisation time is reported separately. Numbers go to bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _machine import cpu_model, filesystem_of
from safetensors.torch import save as save_safetensors

from kiln.checkpoints import inspect_checkpoint, load_checkpoint, publish_checkpoint

ROOT = Path(__file__).resolve().parent.parent
DATASET = ROOT / "examples" / "sft_corrections.jsonl"
ADAPTER = "bench"
MIB = 1024 * 1024
SIZES = {"1 MiB": MIB, "64 MiB": 64 * MIB, "1 GiB": 1024 * MIB}
LARGE = "1 GiB"


def load() -> str:
    """The 1/5/15-minute load averages (the machine may be shared: read the ratios)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def real_checkpoint(work: Path) -> tuple[dict, bytes, float]:
    """Train the tiny model one epoch (checkpoint every step); the newest checkpoint's manifest and loop state."""
    os.environ["KILN_HOME"] = str(work / "kiln-home")
    from kiln.model import create_tiny
    from kiln.trainers.sft import admit_sft, run_sft

    start = time.perf_counter()
    model = create_tiny(work / "models" / "kiln-tiny", seed=0)
    job = admit_sft(
        adapter_name=ADAPTER,
        registry=work / "trained",
        config={"epochs": 1, "seed": 7, "checkpoint_interval": 1, "optimizer": {"kind": "adam_w"}},
        dataset_path=DATASET,
        model_path=str(model),
    )
    result = run_sft(job)
    if result.status != "success" or not result.checkpoints:
        raise SystemExit(f"training the tiny model did not publish a checkpoint (status {result.status})")
    elapsed = time.perf_counter() - start
    newest = result.checkpoints[-1]
    manifest = json.loads((newest / "checkpoint_manifest.json").read_text(encoding="utf-8"))
    manifest.pop("files")
    loop_file = manifest["state_files"]["loss_history"]
    return manifest, (newest / loop_file).read_bytes(), elapsed


def tensor_files(total: int, seed: int) -> tuple[dict[str, tuple[str, bytes]], float]:
    """adapter.safetensors (1/3) and optimizer.safetensors (2/3) of random float32; and the serialise time in ms."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, total // 3 // 4)
    lora = torch.randn(n, generator=gen)
    slots = {"lora.exp_avg": torch.randn(n, generator=gen), "lora.exp_avg_sq": torch.randn(n, generator=gen).abs()}
    start = time.perf_counter()
    adapter = save_safetensors({"lora.weight": lora})
    optimizer = save_safetensors(slots)
    serialise_ms = (time.perf_counter() - start) * 1000
    files = {
        "adapter.safetensors": ("adapter-parameters", adapter),
        "optimizer.safetensors": ("optimizer-state", optimizer),
    }
    return files, serialise_ms


def raw_write(directory: Path, blobs: dict[str, bytes]) -> float:
    """Write each blob to a plain directory, one fsync per file; milliseconds."""
    start = time.perf_counter()
    directory.mkdir()
    for name, data in blobs.items():
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    return (time.perf_counter() - start) * 1000


def publish(registry: Path, manifest: dict, files: dict[str, tuple[str, bytes]]):
    """One ``publish_checkpoint`` call; (wall ms, the PublishedCheckpoint)."""
    start = time.perf_counter()
    published = publish_checkpoint(registry, lambda: files, lambda snapshot: (dict(manifest), snapshot))
    return (time.perf_counter() - start) * 1000, published


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--dir", type=Path, default=None, help="work directory (default: a new one under the system temp)"
    )
    parser.add_argument("--reps", type=int, default=15, help="timed raw/publish pairs for 1 MiB and 64 MiB")
    parser.add_argument("--reps-1gb", type=int, default=9, help="timed raw/publish pairs for 1 GiB")
    parser.add_argument("--inspect-reps", type=int, default=200)
    parser.add_argument("--load-reps", type=int, default=5)
    parser.add_argument("--skip-1gb", action="store_true", help="leave out the 1 GiB payload")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()

    base = args.dir if args.dir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-checkpoints-", dir=base))
    sizes = dict(SIZES)
    free = shutil.disk_usage(work).free
    if args.skip_1gb:
        sizes.pop(LARGE)
    elif free < 4 * SIZES[LARGE]:  # the kept checkpoint, one raw copy, one staging copy, and slack
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
    print(
        f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cpus ({cpu_model()}), "
        f"torch {torch.__version__}"
    )
    print(f"work dir {work} ({filesystem_of(work)}, {free / 2**30:,.0f} GiB free); load average {load()}")
    manifest, loop_bytes, trained_s = real_checkpoint(work)
    loop_file = manifest["state_files"]["loss_history"]
    print(
        f"template: real SFT checkpoint of the tiny model, step {manifest['progress']['global_step']} "
        f"(trained in {trained_s:.1f} s); loop state {len(loop_bytes):,} B"
    )

    # ------------------------------------------------------------------ publication vs raw
    print()
    print("publication vs raw write, same bytes, fsync per file; medians of interleaved pairs (ms)")
    header = (
        f"{'payload':8} {'files B':>14} {'n':>3} {'raw':>9} {'publish':>9} {'ratio':>6} "
        f"{'capture':>8} {'encode':>8} {'write':>9} {'serialise*':>10} {'min ratio':>9}"
    )
    print(header)
    kept: dict[str, Path] = {}
    ratios: dict[str, float] = {}
    for index, (label, size) in enumerate(sizes.items()):
        files, serialise_ms = tensor_files(size, seed=index)
        files = {**files, loop_file: ("loss-history", loop_bytes)}
        reps = args.reps_1gb if label == LARGE else args.reps
        raw_times, pub_times, phases = [], [], []
        # untimed warm-up pair; the published manifest is the fourth file the raw route writes
        _, published = publish(work / f"warmup-{index}", manifest, files)
        blobs = {name: data for name, (_, data) in files.items()}
        blobs["checkpoint_manifest.json"] = (published.path / "checkpoint_manifest.json").read_bytes()
        shutil.rmtree(work / f"warmup-{index}")
        raw_write(work / f"warmup-raw-{index}", blobs)
        shutil.rmtree(work / f"warmup-raw-{index}")
        for rep in range(reps):
            plain, registry = work / f"raw-{index}-{rep}", work / f"registry-{index}-{rep}"
            raw_times.append(raw_write(plain, blobs))
            shutil.rmtree(plain)
            pub_ms, published = publish(registry, manifest, files)
            pub_times.append(pub_ms)
            phases.append(published.timings)
            if rep == reps - 1:
                kept[label] = published.path
            else:
                shutil.rmtree(registry)
        raw = statistics.median(raw_times)
        pub = statistics.median(pub_times)
        ratios[label] = pub / raw
        total = sum(len(b) for b in blobs.values())
        print(
            f"{label:8} {total:>14,} {reps:>3} {raw:>9.1f} {pub:>9.1f} {pub / raw:>5.2f}x "
            f"{statistics.median(t.capture_ms for t in phases):>8.2f} "
            f"{statistics.median(t.encode_ms for t in phases):>8.1f} "
            f"{statistics.median(t.write_ms for t in phases):>9.1f} {serialise_ms:>10.1f} "
            f"{min(pub_times) / min(raw_times):>8.2f}x"
        )
        del files, blobs
    print("* safetensors serialisation of the two tensor files, timed once; outside both routes")
    print("min ratio: fastest publish / fastest raw (less sensitive to other load on a shared disk)")

    # ------------------------------------------------------------------ status read
    print()
    print("status read of the kept checkpoints, warm page cache; medians (ms)")
    print(f"{'payload':8} {'inspect':>9} {'n':>5} {'load (full hash)':>17} {'n':>3}")
    inspect_times: dict[str, list[float]] = {label: [] for label in kept}
    load_times: dict[str, list[float]] = {label: [] for label in kept}
    for path in kept.values():  # warm-up
        inspect_checkpoint(path)
    for _ in range(args.inspect_reps):
        for label, path in kept.items():
            start = time.perf_counter()
            inspect_checkpoint(path)
            inspect_times[label].append((time.perf_counter() - start) * 1000)
    for _ in range(args.load_reps):
        for label, path in kept.items():
            start = time.perf_counter()
            loaded = load_checkpoint(path)
            load_times[label].append((time.perf_counter() - start) * 1000)
            del loaded
    inspect_median = {label: statistics.median(v) for label, v in inspect_times.items()}
    for label in kept:
        print(
            f"{label:8} {inspect_median[label]:>9.3f} {args.inspect_reps:>5} "
            f"{statistics.median(load_times[label]):>17.1f} {args.load_reps:>3}"
        )

    # ------------------------------------------------------------------ targets
    print()
    print(f"load average at the end {load()}")
    for label, ratio in ratios.items():
        print(f"target publish <= 2x raw at {label}: {ratio:.2f}x ({'met' if ratio <= 2 else 'NOT met'})")
    small, large = next(iter(kept)), list(kept)[-1]
    flat = inspect_median[large] / inspect_median[small]
    print(
        f"target inspect {large} <= 1.2x inspect {small}: {flat:.2f}x ({'met' if flat <= 1.2 else 'NOT met'})"
        + ("" if large == LARGE else f" -- {LARGE} was not run")
    )


if __name__ == "__main__":
    main()
