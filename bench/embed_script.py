"""Writes a C++ header holding a text file as `inline constexpr char NAME[]` (a raw string).

Usage: embed_script.py INPUT OUTPUT NAME. bench/meson.build compiles bench/adam_peers.py into zest
this way, so `zest bench adam --peers` needs no path to the source tree.
"""
import sys

source, header, name = sys.argv[1:]
text = open(source, encoding="utf-8").read()
if ")zest_py" in text:
    sys.exit(f"{source} holds )zest_py, the raw string's delimiter")
with open(header, "w", encoding="utf-8") as out:
    out.write(f"// Generated from {source} by bench/embed_script.py.\n#pragma once\n")
    out.write(f'inline constexpr char {name}[] = R"zest_py({text})zest_py";\n')
