#!/usr/bin/env python3
"""No include runs up a layer: every `#include "..."` of the project's code (src/, include/zest/,
offload/, kernels/, bench/, examples/) names a file of its own part or of a part below it, in the
order docs/ARCHITECTURE.md draws. A part may not include another part of its own layer either
(config and runtime, say, stay independent). A layer (N, M) is step M inside layer N: the
folders of one part (the engine's, the runtime's) in their order, none of them above or below
a part of layer N without steps. The departures still in the code are listed below,
each with the issue that removes it; an include that is neither allowed nor listed fails the test,
and so does a listed departure the code no longer has (the list must shrink with the code).

usage: layers_test.py SOURCE_ROOT"""
import os
import re
import sys

# (part, layer, the paths it owns: a prefix of the file's path from the source root)
PARTS = [
    ("base", 0, ["src/base/", "include/zest/error.hpp", "include/zest/dtype.hpp", "include/zest/base_types.hpp"]),
    ("config", 1, ["src/config/", "include/zest/config.hpp"]),
    # Runtime: the one class that builds the device and the communicator from a Config, so above both.
    ("runtime assembly", 2, ["include/zest/runtime.hpp", "src/runtime/runtime.cpp"]),
    # The runtime's folders (src/runtime/meson.build): its public headers, the host (threads,
    # topology), the devices and streams, the communicators and worlds.
    ("runtime api", (1, 0), ["include/zest/device.hpp", "include/zest/communicator.hpp",
                             "include/zest/topology.hpp", "include/zest/mpi.hpp", "include/zest/nccl.hpp",
                             "include/zest/trace.hpp"]),
    ("runtime host", (1, 1), ["src/runtime/host/"]),
    ("runtime device", (1, 2), ["src/runtime/device/"]),
    ("runtime comm", (1, 3), ["src/runtime/comm/"]),
    ("offload", 2, ["offload/"]),
    ("optim", 2, ["src/optim/", "kernels/"]),
    ("checkpoint", 3, ["src/checkpoint/", "include/zest/checkpoint.hpp"]),
    # The engine's folders, each over those listed before it (src/engine/meson.build): its public
    # headers, the device math, the plan, the optimizer, the collectives, then the orchestration.
    ("engine api", (4, 0), ["include/zest/engine.hpp", "include/zest/estimate.hpp", "include/zest/host_purpose.hpp"]),
    ("engine math", (4, 1), ["src/engine/math/"]),
    ("engine plan", (4, 2), ["src/engine/plan/"]),
    ("engine optimizer", (4, 3), ["src/engine/optimizer/"]),
    ("engine collectives", (4, 4), ["src/engine/collectives/"]),
    ("engine", (4, 5), ["src/engine/"]),
    ("torch", 5, ["src/torch/", "include/zest/torch.hpp"]),
    ("api", 5, ["include/zest/zest.hpp"]),  # the umbrella header: everything below it
    ("python", 6, ["src/python/"]),
    # The programs: the command-line parser under them all; the example trainers, which the
    # memory benchmark trains; the benchmarks; the `zest` command, which runs the benchmarks.
    ("args", 7, ["src/args/"]),
    ("examples", 8, ["examples/"]),
    ("bench", 9, ["bench/"]),
    ("cli", 10, ["src/cli/"]),
]

# Departures from the order that the code still has: (including part, included part, why), each
# with the issue that removes it. None today: runtime and config met in DeviceType and the comm
# timeout's default, which are now the base layer's (zest/base_types.hpp).
KNOWN = {
}
SOURCES = ("src", "include/zest", "offload", "kernels", "bench", "examples")
EXTENSIONS = (".cpp", ".hpp", ".cu", ".cuh", ".h")


def below(theirs, mine):
    """Whether a part of layer `theirs` lies under one of layer `mine` (see the module's text)."""
    t = theirs if isinstance(theirs, tuple) else (theirs,)
    m = mine if isinstance(mine, tuple) else (mine,)
    return t[0] < m[0] or (t[0] == m[0] and len(t) == len(m) == 2 and t[1] < m[1])


def part_of(path):
    for name, layer, prefixes in PARTS:
        if any(path == p or (p.endswith("/") and path.startswith(p)) for p in prefixes):
            return name, layer
    return None


def resolve(root, including, name):
    for base in (os.path.dirname(including), "src", "include", ".", "examples"):
        candidate = os.path.normpath(os.path.join(base, name))
        if os.path.isfile(os.path.join(root, candidate)):
            return candidate
    return None


def main():
    root = sys.argv[1]
    seen, problems = set(), []
    for top in SOURCES:
        for directory, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if not f.endswith(EXTENSIONS):
                    continue
                path = os.path.relpath(os.path.join(directory, f), root)
                mine = part_of(path)
                if mine is None:
                    problems.append(f"{path}: in no part (add it to PARTS)")
                    continue
                for number, line in enumerate(open(os.path.join(root, path), encoding="utf-8"), 1):
                    match = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                    if not match:
                        continue
                    target = resolve(root, path, match.group(1))
                    if target is None:
                        continue  # generated (zest_build_config.h) or a system header in quotes
                    theirs = part_of(target)
                    if theirs is None or theirs[0] == mine[0] or below(theirs[1], mine[1]):
                        continue
                    pair = (mine[0], theirs[0])
                    if KNOWN.get(pair):
                        seen.add(pair)
                        continue
                    problems.append(f"{path}:{number}: {mine[0]} (layer {mine[1]}) includes {target}, "
                                    f"of {theirs[0]} (layer {theirs[1]}): an include up or across a layer")
    for pair, why in KNOWN.items():
        if why and pair not in seen:
            problems.append(f"the departure {pair[0]} -> {pair[1]} is gone from the code: remove it from KNOWN")
    for p in problems:
        print("FAIL: " + p)
    if problems:
        sys.exit(1)
    print(f"layers: every include points down (known departures still present: {len(seen)})")


if __name__ == "__main__":
    main()
