#!/usr/bin/env python3
"""zest checkpoint consolidate, checked by a safetensors reader written here from the format's
rules alone (struct and json, no zest code):

1. zest-train (2 ranks, stage 3) saves a checkpoint; consolidated in f32, every tensor holds the
   values this script reassembles itself from the manifest's ranges and the rank files, under the
   manifest's names and shapes; in bf16, each of those rounded to nearest even.
2. A synthetic checkpoint of 235 MB of weights consolidates with the process's peak RSS a few MiB
   above an idle zest's: the file is streamed, not assembled in memory.

usage: checkpoint_consolidate_test.py ZEST ZEST_TRAIN MAKE_TEST_CHECKPOINT MPIRUN SOURCE_DIR
"""
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

ZEST, TRAIN, MAKE_CHECKPOINT, MPIRUN, SOURCE = sys.argv[1:6]
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
MIB = 1 << 20


class Bad(Exception):
    pass


def check(condition, what):
    if not condition:
        raise Bad(what)


def read_safetensors(path):
    """(metadata, {name: (dtype, shape, begin, end)}, data start), after checking every rule."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        check(size >= 8, f"{path}: {size} bytes, shorter than the header length")
        (n,) = struct.unpack("<Q", f.read(8))
        check(0 < n <= size - 8, f"{path}: header length {n} for a file of {size} bytes")
        check(n % 8 == 0, f"{path}: header length {n} is not a multiple of 8")
        text = f.read(n).decode("utf-8")
    check(text.startswith("{") and text.rstrip(" ").endswith("}"), f"{path}: header is not one object padded with spaces")

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        check(len(keys) == len(set(keys)), f"{path}: duplicate keys in the header")
        return dict(pairs)

    header = json.loads(text, object_pairs_hook=no_duplicates)
    metadata = header.pop("__metadata__", None)
    check(isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values()),
          f"{path}: __metadata__ must map strings to strings: {metadata}")
    check(metadata.get("format") == "pt", f"{path}: metadata format {metadata.get('format')}")
    tensors = {}
    for name, entry in header.items():
        check(set(entry) == {"dtype", "shape", "data_offsets"}, f"{path}: {name}: keys {sorted(entry)}")
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        check(dtype in DTYPE_BYTES, f"{path}: {name}: dtype {dtype}")
        check(all(isinstance(d, int) and d >= 0 for d in shape), f"{path}: {name}: shape {shape}")
        numel = 1
        for d in shape:
            numel *= d
        check(end - begin == numel * DTYPE_BYTES[dtype], f"{path}: {name}: {end - begin} bytes for {shape} {dtype}")
        tensors[name] = (dtype, shape, begin, end)
    # The data is covered exactly: no gap, no overlap, nothing past the last tensor.
    at = 0
    for name, (_, _, begin, end) in sorted(tensors.items(), key=lambda item: item[1][2]):
        check(begin == at, f"{path}: {name} starts at {begin}, the previous tensor ends at {at}")
        at = end
    check(8 + n + at == size, f"{path}: {size} bytes, the header accounts for {8 + n + at}")
    return metadata, tensors, 8 + n


def bf16_bits(f32_bits):
    """Round to nearest even (no NaNs here)."""
    return (f32_bits + 0x7FFF + ((f32_bits >> 16) & 1)) >> 16


def read_manifest(directory):
    """The manifest's tensors [(name, shape)] and each tensor's fp32 bytes, reassembled from the
    ranks' master files and their ranges."""
    with open(os.path.join(directory, "manifest")) as f:
        lines = f.read().split("\n")
    tensors, values, rank, at, ranges = [], [], -1, 0, []
    for line in lines:
        words = line.split(" ")
        if words[0] == "tensor":
            dims = int(words[3])
            tensors.append((" ".join(words[4 + dims:]), [int(d) for d in words[4:4 + dims]]))
            values.append(bytearray(int(words[2]) * 4))
        elif words[0] == "rank":
            rank, at, ranges = rank + 1, 0, []
        elif words[0] == "range":
            ranges.append(tuple(int(w) for w in words[1:4]))
        elif words[0] == "file" and words[1].endswith(".master.bin"):
            check(words[1] == f"rank{rank}.master.bin", f"manifest: file {words[1]} for rank {rank}")
            with open(os.path.join(directory, words[1]), "rb") as f:
                data = f.read()
            for tensor, lo, hi in ranges:
                values[tensor][lo * 4:hi * 4] = data[at:at + (hi - lo) * 4]
                at += (hi - lo) * 4
            check(at == len(data), f"{words[1]}: {len(data)} bytes, its ranges hold {at}")
    return tensors, values


def zest(*args):
    result = subprocess.run([ZEST, *args], capture_output=True, text=True)
    check(result.returncode == 0, f"zest {' '.join(args)}: exit {result.returncode}: {result.stderr}")
    return result.stdout


def trained_checkpoint(work):
    config = os.path.join(work, "train.yaml")
    with open(os.path.join(SOURCE, "configs", "train-tiny.yaml")) as f:
        text = re.sub(r"(?m)^stage: .*$", "stage: 3", f.read())
    with open(config, "w") as f:
        f.write(text)
    ckpt = os.path.join(work, "trained")
    result = subprocess.run([MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", "2", TRAIN, "--config", config,
                             "--steps", "3", "--save", ckpt], capture_output=True, text=True)
    check(result.returncode == 0, f"zest-train: exit {result.returncode}: {result.stdout}{result.stderr}")
    return ckpt


def test_trained(work):
    ckpt = trained_checkpoint(work)
    tensors, values = read_manifest(ckpt)
    check(len(tensors) > 2, f"zest-train saved {len(tensors)} tensors")
    outputs = {}
    for dtype in ("f32", "bf16"):
        out = os.path.join(work, f"trained.{dtype}.safetensors")
        printed = zest("checkpoint", "consolidate", ckpt, out, "--dtype", dtype)
        check(f"wrote {len(tensors)} tensors" in printed and out in printed, f"consolidate printed: {printed}")
        metadata, entries, start = read_safetensors(out)
        check(metadata.get("zest_steps") == "3" and metadata.get("zest_world_size") == "2"
              and metadata.get("zest_stage") == "3", f"{out}: metadata {metadata}")
        check(list(entries) == [name for name, _ in tensors], f"{out}: tensors {list(entries)}, manifest {tensors}")
        with open(out, "rb") as f:
            data = f.read()[start:]
        outputs[dtype] = (entries, data)
    entries, data = outputs["f32"]
    half_entries, half_data = outputs["bf16"]
    for (name, shape), want in zip(tensors, values):
        dtype, got_shape, begin, end = entries[name]
        check(dtype == "F32" and got_shape == shape, f"{name}: {dtype} {got_shape}, manifest {shape}")
        check(data[begin:end] == want, f"{name}: the f32 bytes differ from the rank files'")
        dtype, got_shape, begin, end = half_entries[name]
        check(dtype == "BF16" and got_shape == shape, f"{name}: {dtype} {got_shape} in bf16")
        count = len(want) // 4
        rounded = struct.pack(f"<{count}H", *(bf16_bits(b) for b in struct.unpack(f"<{count}I", want)))
        check(half_data[begin:end] == rounded, f"{name}: the bf16 bytes are not the f32 values rounded to nearest even")
    print(f"trained checkpoint: {len(tensors)} tensors, f32 exact and bf16 rounded to nearest even")


def peak_rss_mib(args):
    """Runs zest with `args`; returns its peak resident set in MiB (its own, not other children's)."""
    with tempfile.TemporaryFile() as stderr:
        child = subprocess.Popen([ZEST, *args], stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        check(child.returncode == 0, f"zest {' '.join(args)}: exit {child.returncode}: {stderr.read().decode()}")
    return usage.ru_maxrss / 1024  # KiB on Linux


def synthetic_value(t, j):
    """tests/checkpoint/synthetic_checkpoint.hpp's value(t, j)."""
    return ((j * 7 + t * 13) % 2001) * 0.125 - 125.0


def test_bounded_memory(work):
    shapes = [(4096, 3584)] * 4  # 58.7M values: 235 MB of fp32 weights
    ckpt = os.path.join(work, "big")
    specs = [f"{rows}x{cols}:layers.{i}.weight" for i, (rows, cols) in enumerate(shapes)]
    subprocess.run([MAKE_CHECKPOINT, ckpt, "2", str(4 * MIB), *specs], check=True)
    weights_mib = sum(r * c for r, c in shapes) * 4 / MIB
    out = os.path.join(work, "big.safetensors")
    idle = peak_rss_mib(["checkpoint", "inspect", ckpt, "--no-verify"])
    peak = peak_rss_mib(["checkpoint", "consolidate", ckpt, out, "--dtype", "bf16"])
    check(peak < idle + 64, f"consolidating {weights_mib:.0f} MiB of weights peaked at {peak:.0f} MiB resident, "
                            f"an idle zest at {idle:.0f} MiB: it is not streaming")
    _, entries, start = read_safetensors(out)
    with open(out, "rb") as f:
        for t, (rows, cols) in enumerate(shapes):
            dtype, shape, begin, end = entries[f"layers.{t}.weight"]
            check(dtype == "BF16" and shape == [rows, cols], f"layers.{t}.weight: {dtype} {shape}")
            numel = rows * cols
            for first in (0, numel // 2 - 1000, numel - 1000):  # a few thousand values per tensor
                f.seek(start + begin + first * 2)
                got = struct.unpack("<1000H", f.read(2000))
                want = [bf16_bits(struct.unpack("<I", struct.pack("<f", synthetic_value(t, j)))[0])
                        for j in range(first, first + 1000)]
                check(list(got) == want, f"layers.{t}.weight: values {first}.. differ")
    print(f"{weights_mib:.0f} MiB of weights: consolidated at {peak:.0f} MiB peak resident (idle zest {idle:.0f} MiB)")


def main():
    with tempfile.TemporaryDirectory(prefix="zest-consolidate-test-") as work:
        try:
            test_trained(work)
            test_bounded_memory(work)
        except Bad as e:
            print(f"FAIL: {e}", file=sys.stderr)
            return 1
    print("checkpoint consolidate: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
