#!/usr/bin/env python3
"""The house style's line-length rule (.clang-format's ColumnLimit): no line of the project's C++ and
CUDA sources is longer than 120 characters. Prints each one that is, and fails.

    line_length_test.py SOURCE_ROOT
"""
import pathlib
import sys

LIMIT = 120
FOLDERS = ["src", "include", "kernels", "offload", "tests", "bench", "examples", "python"]
SUFFIXES = {".cpp", ".hpp", ".cu", ".cuh", ".h", ".cc"}


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    long_lines, files = [], 0
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file():
                continue
            files += 1
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if len(line) > LIMIT:
                    long_lines.append(f"{path.relative_to(root)}:{number}: {len(line)} characters")
    if files == 0:
        print(f"no C++ sources under {root}: give the source root")
        return 1
    if long_lines:
        print(f"{len(long_lines)} lines longer than {LIMIT} characters (clang-format --lines=N:N FILE wraps one):")
        print("\n".join(long_lines))
        return 1
    print(f"{files} files, every line within {LIMIT} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
