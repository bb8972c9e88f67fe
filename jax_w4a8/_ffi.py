"""Loads the compiled FFI handlers once and registers them with XLA, per platform.

Two extension modules are built from ``ffi/``: ``jax_w4a8._lib._ffi_cpu`` (always) and
``jax_w4a8._lib._ffi_cuda`` (when nvcc was found at build time). Each exposes ``registrations()``,
a dict of target name -> handler capsule. A module that is missing or fails to load leaves its
platform on the reference path, and :func:`ffi_available` says why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import pathlib

import jax

__all__ = ["FfiAvailability", "ffi_available", "built_with_cutlass", "cublaslt", "build_info", "source_fingerprint",
           "export_disabled_checks", "TARGETS"]

# Target names, one per op; the same name is registered for every platform that has a handler.
TARGETS = {
    "w4a8_grouped_gemm": "jax_w4a8_w4a8_grouped_gemm",
    "fp8_einsum": "jax_w4a8_fp8_einsum",
    "ue8m0_pack": "jax_w4a8_ue8m0_pack",
    "quantize_fp8_groups": "jax_w4a8_quantize_fp8_groups",
    "w4a8_moe_up": "jax_w4a8_w4a8_moe_up",  # CUDA only
}

_MODULES = {"cpu": ("_ffi_cpu", "cpu"), "cuda": ("_ffi_cuda", "CUDA")}
_DISABLE_ENV = "JAX_W4A8_DISABLE_FFI"  # comma-separated platforms to keep on the reference path


@dataclasses.dataclass(frozen=True)
class FfiAvailability:
    """Truthy when the platform's handlers are registered; ``reason`` says why not otherwise."""

    platform: str
    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


def _load(platform: str) -> FfiAvailability:
    module_name, xla_platform = _MODULES[platform]
    disabled = {p.strip().lower() for p in os.environ.get(_DISABLE_ENV, "").split(",") if p.strip()}
    if platform in disabled:
        return FfiAvailability(platform, False, f"disabled by {_DISABLE_ENV}={os.environ[_DISABLE_ENV]}")
    try:
        module = importlib.import_module(f"jax_w4a8._lib.{module_name}")
    except ImportError as exc:
        hint = " (the package was built without nvcc)" if platform == "cuda" else ""
        return FfiAvailability(platform, False, f"cannot import jax_w4a8._lib.{module_name}{hint}: {exc}")
    try:
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=xla_platform, api_version=1)
    except Exception as exc:  # noqa: BLE001 - report any registration failure as unavailability
        return FfiAvailability(platform, False, f"registering {module_name} failed: {exc}")
    return FfiAvailability(platform, True)


_STATUS = {platform: _load(platform) for platform in _MODULES}


def ffi_available(platform: str = "cuda") -> FfiAvailability:
    """Whether the FFI handlers of ``platform`` ("cpu" or "cuda"/"gpu") are built and registered.

    Returns a truthy/falsy :class:`FfiAvailability`; when falsy, ``.reason`` says why.
    """
    key = {"gpu": "cuda"}.get(platform.lower(), platform.lower())
    if key not in _STATUS:
        return FfiAvailability(platform, False, f"no FFI handlers exist for platform {platform!r}")
    return _STATUS[key]


def built_with_cutlass() -> bool:
    """Whether the CUDA handlers were built with CUTLASS (the prefill kernels: the fp8 einsum's for recipe
    (1, 128, 128) and the W4A8 grouped GEMM's); False when the CUDA module is missing or disabled."""
    if not _STATUS["cuda"]:
        return False
    module = importlib.import_module(f"jax_w4a8._lib.{_MODULES['cuda'][0]}")
    return bool(getattr(module, "built_with_cutlass", lambda: False)())


_CUBLASLT = None  # (version, why), once asked


def _cublaslt_candidates() -> list:
    """Where the nvidia-cublas wheel (a dependency of JAX's CUDA plugin) keeps cuBLASLt, for a process in which
    nothing loaded it yet."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    found = []
    for root in roots:
        for rel in ("cu13/lib/libcublasLt.so.13", "cublas/lib/libcublasLt.so.12"):
            path = os.path.join(root, rel)
            if os.path.exists(path):
                found.append(path)
    return found


def cublaslt() -> tuple[int, str]:
    """cuBLASLt for the fp8 einsum's ``kernel="cublas"`` path: ``(version, "")`` (e.g. 130002 for 13.0.2) once
    loaded, else ``(0, why not)`` (the CUDA module missing or built without cuBLASLt's header, no library found,
    or one older than 12.9, which has no block-scaled FP8 GEMM). Loads it on the first call: the copy in the
    process (JAX's CUDA plugin loads it), the loader's search, then the nvidia-cublas wheel's."""
    global _CUBLASLT
    if _CUBLASLT is not None:
        return _CUBLASLT
    if not _STATUS["cuda"]:
        _CUBLASLT = (0, f"the CUDA handlers are not available: {_STATUS['cuda'].reason}")
        return _CUBLASLT
    module = importlib.import_module(f"jax_w4a8._lib.{_MODULES['cuda'][0]}")
    if not getattr(module, "built_with_cublaslt", lambda: False)():
        _CUBLASLT = (0, "the library was built without cuBLASLt's header (pip install nvidia-cublas, then rebuild)")
        return _CUBLASLT
    version, why = module.load_cublaslt("")
    for path in ([] if version else _cublaslt_candidates()):
        version, why = module.load_cublaslt(path)
        if version:
            break
    _CUBLASLT = (int(version), "" if version else why)
    return _CUBLASLT


_SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh")


def source_fingerprint(ffi_dir) -> str:
    """The fingerprint CMake compiles into the modules, computed from an ``ffi/`` folder on disk.

    SHA-256 of what ``sha256sum`` prints for the C++ / CUDA sources under it (``*.h``, ``*.cc``, ``*.cu``,
    ``*.cuh``; existing regular files or links to them), paths relative to its parent (``ffi/...``) in byte
    order: ``cd ROOT && find -L ffi -type f -name '*.h' ... | LC_ALL=C sort | xargs sha256sum | sha256sum``.
    """
    root = pathlib.Path(ffi_dir)
    files = {f"{root.name}/{p.relative_to(root).as_posix()}": p for p in root.rglob("*")
             if p.suffix in _SOURCE_SUFFIXES and p.is_file()}
    lines = [f"{hashlib.sha256(files[rel].read_bytes()).hexdigest()}  {rel}\n" for rel in sorted(files)]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def build_info() -> dict:
    """What this installation runs: the package version and, per platform module, whether it loaded and
    which ``ffi/`` sources it was built from.

    Returns ``{"version", "cutlass", "cpu": {...}, "cuda": {...}, "checkout": {...} or None}``; each platform
    entry has ``available``, ``reason`` and ``source_sha256`` (None where the module did not load, "unknown"
    for a build without the fingerprint, such as Bazel's). In a source checkout (``ffi/`` next to the package)
    ``checkout`` holds that folder's fingerprint and ``stale``: the platforms whose loaded module was built
    from other sources (rebuild: rerun ``./scripts/test.sh`` or ``./scripts/main.sh``; a hand build: ``cmake --build
    build && cmake --install build``). Benchmarks and bug reports
    should quote it, so that results name the kernels they ran.
    """
    from jax_w4a8 import __version__

    info = {"version": __version__, "cutlass": built_with_cutlass()}
    for platform, (module_name, _) in _MODULES.items():
        status = _STATUS[platform]
        sha = None
        if status:
            module = importlib.import_module(f"jax_w4a8._lib.{module_name}")
            sha = getattr(module, "source_sha256", lambda: "unknown")()
        info[platform] = {"available": status.available, "reason": status.reason, "source_sha256": sha}
    ffi_dir = pathlib.Path(__file__).resolve().parent.parent / "ffi"
    info["checkout"] = None
    if ffi_dir.is_dir():
        here = source_fingerprint(ffi_dir)
        stale = [p for p in _MODULES if info[p]["source_sha256"] not in (None, "unknown", here)]
        info["checkout"] = {"ffi_dir": str(ffi_dir), "source_sha256": here, "stale": stale}
    return info


def export_disabled_checks() -> list:
    """The ``disabled_checks`` that ``jax.export.export`` needs to serialize this library's calls.

    Our targets carry no cross-version compatibility guarantee (unlike XLA's built-in ones), so
    exporting them is an explicit opt-in: ``jax.export.export(f, disabled_checks=export_disabled_checks())``.
    """
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in TARGETS.values()]
