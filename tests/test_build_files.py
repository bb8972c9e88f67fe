"""BUILD.bazel (which cannot run here) must name exactly the sources that CMake compiles."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cmake_sources():
    text = (ROOT / "CMakeLists.txt").read_text()
    files = set()
    for body in re.findall(r"set\(JAX_W4A8_\w+\s+([^)]*)\)", text):
        files.update(tok for tok in body.split() if tok.startswith("ffi/"))
    files.update(re.findall(r"\b(ffi/[\w/]+\.(?:cc|cu|h|cuh))\b", text))
    return files


def bazel_sources():
    return set(re.findall(r'"(ffi/[^"]+)"', (ROOT / "BUILD.bazel").read_text()))


def test_bazel_names_every_cmake_source():
    cm, bz = cmake_sources(), bazel_sources()
    assert cm, "no sources parsed from CMakeLists.txt"
    assert cm == bz, f"only in CMake: {sorted(cm - bz)}; only in Bazel: {sorted(bz - cm)}"


def test_every_ffi_file_is_built():
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "ffi").rglob("*") if p.is_file()}
    assert on_disk == cmake_sources(), f"not in CMakeLists.txt: {sorted(on_disk - cmake_sources())}"
