"""Compiled FFI handlers (built by CMake from ffi/): _ffi_cpu always, _ffi_cuda when nvcc exists."""
