"""HF safetensors checkpoints <-> :class:`DeepseekV3ForCausalLM`: load (with quantize-on-load) and save.

Formats read (SPEC section 6), per tensor, by its stored dtype:

* bf16 / fp16 / fp32 weights;
* DeepSeek-V3/R1 FP8: e4m3 ``X.weight`` + fp32 ``X.weight_scale_inv`` [ceil(N/128), ceil(K/128)]
  (``quantization_config.scale_fmt == "ue8m0"``: the scales are powers of two, DeepSeek-V3.1; scales stored as
  ``F8_E8M0`` codes are read as those powers of two);
* DeepSeek-R1-W4AFP8 routed experts: int8 ``experts.{j}.{gate,up,down}_proj.weight`` [N, K/2] (packed
  int4, low nibble first) + fp32 ``weight_scale_inv`` [N, K/128] + ``experts.{j}.{w1,w3,w2}.input_scale``
  (w1 = gate, w3 = up, w2 = down; amax / 448 per expert); everything else as the FP8 checkpoint;
* routed experts in the hub per-expert layout or transformers-5's fused ``experts.gate_up_proj``
  [E, 2I, D] (gate rows first) / ``experts.down_proj`` [E, D, I] (float only).

The ``num_nextn_predict_layers`` multi-token-prediction layers after the last layer (DeepSeek's layer 61),
``rotary_emb.inv_freq`` buffers and a tied ``lm_head.weight`` equal to the embedding are skipped (a tied config
whose checkpoint head differs loads it untied, with a warning, as transformers does); deeper layers are
unexpected tensors. Every other tensor must be consumed: the headers of all files are checked *before* any data is
read, and a missing, unexpected, mis-shaped or wrongly typed tensor is a ``CheckpointError`` naming the
tensor and the file. A sharded checkpoint's index says which file each tensor is read from (another copy
elsewhere is ignored; a skipped tensor it lists need not exist).

Memory: tensors are read one at a time from the files (``read_tensor``) and converted as soon as all the
pieces of one weight are in (a weight and its ``weight_scale_inv`` may sit in different shards; the
routed experts of a layer are assembled into one host buffer in the *target* format). Peak host memory
is about the model plus one shard. Every array reaches JAX through :func:`place`, which puts it straight
onto ``mesh``'s devices when one is given.

The reader parses the safetensors header itself (8-byte length, JSON header, raw little-endian data) and
reads each tensor with one ``readinto``: ``safetensors.safe_open`` (0.8) cannot materialise ``F8_E4M3``
tensors in its numpy / flax frameworks (``numpy`` has no ``float8_e4m3fn``), and those are the bulk of
an FP8 checkpoint. Files are written with ``safetensors.numpy.save_file``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jax_w4a8 import quant as qlib
from jax_w4a8.expert_parallel import ExpertParallel
from jax_w4a8.models.deepseek import layers, parallel
from jax_w4a8.models.deepseek.config import DeepseekConfig, QuantConfig
from jax_w4a8.models.deepseek.model import DeepseekV3ForCausalLM

__all__ = ["CheckpointError", "SafetensorsFile", "load_checkpoint", "save_checkpoint", "place",
           "resolve_quant_config"]

BLOCK = 128

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_FLOAT = ("F32", "BF16", "F16", "F64")
# FP8 block scales: float, or UE8M0 codes stored as F8_E8M0 (2**(code - 127); 255 is NaN, refused by _check_scales)
_SCALES = _FLOAT + ("F8_E8M0",)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names the tensor and the file."""


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str          # safetensors dtype string, e.g. "BF16", "F8_E4M3"
    shape: tuple
    file: str
    begin: int          # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """Header of one ``.safetensors`` file; :meth:`read_tensor` reads one tensor (a fresh numpy array)."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            # a Git LFS pointer (a clone without `git lfs pull`) reads as a header length of exabytes
            try:
                if n > size - 8:
                    raise ValueError(f"its header length {n} passes the file's {size} bytes")
                header = json.loads(f.read(n))
                if not isinstance(header, dict):
                    raise ValueError("its header is not a JSON object")
            except ValueError as e:     # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise CheckpointError(f"{path} is not a safetensors file ({e}); a Git LFS pointer whose weights "
                                      "were never fetched, or a truncated download?") from None
        self.metadata = header.pop("__metadata__", None)
        self.tensors: dict[str, TensorInfo] = {}
        for name, h in header.items():
            try:
                dt, shape, (b, e) = h["dtype"], tuple(int(v) for v in h["shape"]), map(int, h["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"tensor '{name}' in {path}: its header entry {h!r} lacks a dtype, shape or "
                                      "data_offsets pair") from None
            if dt not in _ST_DTYPES:
                raise CheckpointError(f"tensor '{name}' in {path}: unsupported safetensors dtype {dt}")
            nbytes = math.prod(shape) * _ST_DTYPES[dt].itemsize
            if e - b != nbytes or 8 + n + e > size:
                raise CheckpointError(f"tensor '{name}' in {path}: header offsets {b}..{e} do not match "
                                      f"{dt}{list(shape)} ({nbytes} bytes) or the file size")
            self.tensors[name] = TensorInfo(name, dt, shape, path, 8 + n + b, 8 + n + e)

    def read_tensor(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        out = np.empty(t.shape, _ST_DTYPES[t.dtype])
        with open(self.path, "rb") as f:
            f.seek(t.begin)
            if f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != t.end - t.begin:
                raise CheckpointError(f"tensor '{name}' in {self.path}: file truncated")
        return out


def _open_checkpoint(path: str, cfg: DeepseekConfig) -> list[SafetensorsFile]:
    """The checkpoint's files, each holding the tensors to read from it. With an index, that is the tensors the
    index maps to it: a copy elsewhere is ignored, a tensor the index does not list is an error. Entries for
    tensors that are never loaded (:func:`_never_loaded`) are not checked, and a file that only they name is not
    opened (TensorRT-LLM's W4AFP8 producer indexes layer ``num_hidden_layers`` but does not write it). A model
    without shared experts drops the empty ``shared_experts`` tensors ([0, D]) transformers saves for it."""
    files = _open_files(path, cfg)
    if not cfg.n_shared_experts:
        for sf in files:
            for name in [n for n, t in sf.tensors.items() if ".mlp.shared_experts." in n and 0 in t.shape]:
                del sf.tensors[name]
    return files


def _open_files(path: str, cfg: DeepseekConfig) -> list[SafetensorsFile]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = {n: fn for n, fn in json.load(f)["weight_map"].items() if not _never_loaded(n, cfg)}
        files = {fn: SafetensorsFile(os.path.join(path, fn)) for fn in sorted(set(weight_map.values()))}
        for name, fn in weight_map.items():
            if name not in files[fn].tensors:
                raise CheckpointError(f"tensor '{name}': the index maps it to {files[fn].path}, whose header lacks it")
        for fn, sf in files.items():
            for name in list(sf.tensors):
                if weight_map.get(name) != fn:
                    if name not in weight_map and not _never_loaded(name, cfg):
                        raise CheckpointError(f"tensor '{name}' in {sf.path} is not listed in the index")
                    # never loaded, or another copy (TensorRT-LLM's W4AFP8 producer writes the input scales into
                    # its first shard and into the file its index names): the index names the copy to read
                    del sf.tensors[name]
        return list(files.values())
    if os.path.exists(single):
        return [SafetensorsFile(single)]
    raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")


# ----------------------------------------------------------------------------------------------
# placement and conversions
# ----------------------------------------------------------------------------------------------
def place(array: np.ndarray, name: str, mesh=None) -> jax.Array:
    """Turns one host array into a jax array: on the default device, or with ``mesh`` straight onto the
    devices that own it (routed experts split over ``"expert"``, the rest replicated; see
    :func:`jax_w4a8.models.deepseek.parallel.placement`). ``name`` is the model variable's path."""
    if mesh is None:
        return jax.device_put(array)
    return jax.device_put(array, parallel.placement(mesh, name, np.ndim(array)))


_jit_quantize_w4 = jax.jit(qlib.quantize_w4, static_argnums=1)
_jit_quantize_fp8_blocks = jax.jit(qlib.quantize_fp8_blocks, static_argnums=(1, 2))
_jit_dequantize_w4 = jax.jit(qlib.dequantize_w4, static_argnums=2)
_jit_dequantize_fp8_blocks = jax.jit(qlib.dequantize_fp8_blocks, static_argnums=(2, 3))


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


@dataclasses.dataclass
class _Src:
    """One source weight: ``kind`` "float" | "fp8" | "w4" and its arrays."""
    kind: str
    w: np.ndarray
    s: np.ndarray | None = None


def _to_f32(src: _Src) -> np.ndarray:
    if src.kind == "float":
        return src.w.astype(np.float32)
    if src.kind == "fp8":
        return _np(_jit_dequantize_fp8_blocks(src.w, src.s.astype(np.float32), BLOCK, jnp.float32))
    return _np(_jit_dequantize_w4(src.w, src.s.astype(np.float32), jnp.float32))


def _check_scales(s: np.ndarray, what: str):
    """A checkpoint's dequant scales must be finite and not negative (a NaN, an infinity or a sign would make the
    layer's outputs NaN or flip them, silently)."""
    s = np.asarray(s, np.float32)
    bad = ~np.isfinite(s) | (s < 0)
    if bad.any():
        raise CheckpointError(f"{what}: weight_scale_inv holds {s[bad].flat[0]} at index "
                              f"{tuple(int(i) for i in np.argwhere(bad)[0])} (scales must be finite and >= 0)")


def _convert(src: _Src, target: str, dtype: np.dtype, ue8m0: bool, what: str):
    """Source weight [..., N, K(/2)] -> target format ``"none"`` (dtype), ``"fp8"`` (e4m3, f32 blocks) or
    ``"w4a8"`` (packed int8, f32 group scales). Same-format sources are copied bit-exactly."""
    if src.kind != "float":
        _check_scales(src.s, what)
    if target == "none":
        if src.kind == "float":
            return src.w.astype(dtype), None
        return _to_f32(src).astype(dtype), None
    if target == "fp8":
        if src.kind == "fp8":
            s = src.s.astype(np.float32)
            if ue8m0 and not bool(np.all(_np(qlib.is_ue8m0_exact(s)))):
                raise CheckpointError(f"{what}: weight_scale_inv is not a power of two but the model uses UE8M0 "
                                      "scales (scale_fmt='ue8m0')")
            return src.w, s
        q, s = _jit_quantize_fp8_blocks(_to_f32(src), BLOCK, ue8m0)
        return _np(q), _np(s)
    if src.kind == "w4":
        return src.w, src.s.astype(np.float32)
    q, s = _jit_quantize_w4(_to_f32(src), BLOCK)
    return _np(q), _np(s)


# ----------------------------------------------------------------------------------------------
# targets: what the model needs, which checkpoint tensors feed it
# ----------------------------------------------------------------------------------------------
class _Target:
    """Consumes checkpoint tensors; returns ``{variable path: host array}`` once complete."""

    def __init__(self):
        self.expected: dict[str, tuple[tuple, tuple[str, ...]]] = {}   # name -> (shape(s), allowed dtypes)

    def expect(self, name, shapes, dtypes):
        shapes = shapes if isinstance(shapes, list) else [shapes]
        self.expected[name] = ([tuple(s) for s in shapes], tuple(dtypes))

    def feed(self, name: str, array: np.ndarray) -> dict | None:
        raise NotImplementedError


def _src_kind(info: TensorInfo) -> str:
    return {"F8_E4M3": "fp8", "I8": "w4"}.get(info.dtype, "float")


class _Simple(_Target):
    """A tensor copied into one variable, cast to the variable's dtype (norms, embedding, router)."""

    def __init__(self, name, var_path, shape, dtype):
        super().__init__()
        self.var_path, self.dtype = var_path, np.dtype(dtype)
        self.expect(name, shape, _FLOAT)

    def feed(self, name, array):
        return {self.var_path: array.astype(self.dtype)}


def _linear_sources(prefix: str, module: layers.Linear) -> list[tuple[str, int]]:
    """(checkpoint prefix, rows) of each tensor a Linear holds: its own, or its ``parts`` (HF modules beside
    it: ``...self_attn.qkv_a_proj`` holds ``...self_attn.q_a_proj`` and ``...self_attn.kv_a_proj_with_mqa``)."""
    if module.parts is None:
        return [(prefix, module.out_features)]
    parent = prefix.rsplit(".", 1)[0]
    return [(f"{parent}.{name}", rows) for name, rows in module.parts]


class _LinearTarget(_Target):
    """One Linear: its checkpoint tensor, or each of its ``parts`` converted on its own (so FP8 blocks stay
    the part's) and stacked along N."""

    def __init__(self, prefix, path, module: layers.Linear, infos: dict[str, TensorInfo]):
        super().__init__()
        self.path, self.m = path, module
        self.sources = _linear_sources(prefix, module)
        self.kinds = {}
        k = module.in_features
        for src, n in self.sources:
            w = infos.get(src + ".weight")
            # a missing weight takes its format from its scale, so that the error names the missing weight
            fp8 = w.dtype == "F8_E4M3" if w is not None else (src + ".weight_scale_inv") in infos
            self.kinds[src] = "fp8" if fp8 else "float"
            self.expect(src + ".weight", (n, k), ("F8_E4M3",) if self.kinds[src] == "fp8" else _FLOAT)
            if self.kinds[src] == "fp8":
                self.expect(src + ".weight_scale_inv", (-(-n // BLOCK), -(-k // BLOCK)), _SCALES)
            if module.bias is not None:
                self.expect(src + ".bias", (n,), _FLOAT)
        self.pieces: dict[str, np.ndarray] = {}

    def feed(self, name, array):
        self.pieces[name] = array
        if len(self.pieces) < len(self.expected):
            return None
        m, ws, ss, bs = self.m, [], [], []
        for p, _ in self.sources:
            src = _Src(self.kinds[p], self.pieces[p + ".weight"], self.pieces.get(p + ".weight_scale_inv"))
            w, s = _convert(src, m.quant, m.dtype, m.ue8m0, f"tensor '{p}.weight'")
            ws.append(w), ss.append(s)
            if m.bias is not None:
                bs.append(self.pieces[p + ".bias"].astype(m.dtype))
        out = {self.path + ("weight",): ws[0] if len(ws) == 1 else np.concatenate(ws)}
        if ss[0] is not None:
            out[self.path + ("weight_scale_inv",)] = ss[0] if len(ss) == 1 else np.concatenate(ss)
        if m.bias is not None:
            out[self.path + ("bias",)] = np.concatenate(bs)
        self.pieces.clear()
        return out


_PROJ = ("gate_proj", "up_proj", "down_proj")
_INPUT_SCALE = {"w1": ("gu", 0), "w3": ("gu", 1), "w2": ("dn", None)}


class _ExpertsTarget(_Target):
    """The routed experts of one layer, assembled into host buffers in the target format."""

    def __init__(self, prefix, path, module: layers.Experts, infos: dict[str, TensorInfo]):
        super().__init__()
        self.prefix, self.path, self.m = prefix, path, module
        e, d, i = module.num_experts, module.hidden, module.inter
        self.fused = (prefix + ".gate_up_proj") in infos
        if self.fused:
            self.src = "float"
            self.expect(prefix + ".gate_up_proj", (e, 2 * i, d), _FLOAT)
            self.expect(prefix + ".down_proj", (e, d, i), _FLOAT)
        else:
            # the layer's format from its first expert weight present (a missing one is then named as missing)
            first = next((infos[n] for j in range(e) for proj in _PROJ
                          if (n := f"{prefix}.{j}.{proj}.weight") in infos), None)
            self.src = _src_kind(first) if first is not None else "float"
            dt = {"float": _FLOAT, "fp8": ("F8_E4M3",), "w4": ("I8",)}[self.src]
            for j in range(e):
                for proj in _PROJ:
                    n, k = (d, i) if proj == "down_proj" else (i, d)
                    base = f"{prefix}.{j}.{proj}"
                    self.expect(base + ".weight", (n, k // 2) if self.src == "w4" else (n, k), dt)
                    if self.src == "fp8":
                        self.expect(base + ".weight_scale_inv", (-(-n // BLOCK), -(-k // BLOCK)), _SCALES)
                    elif self.src == "w4":
                        self.expect(base + ".weight_scale_inv", (n, k // BLOCK), _SCALES)
                for w_ in _INPUT_SCALE:      # required when the model keeps them, else consumed if present
                    name = f"{prefix}.{j}.{w_}.input_scale"
                    if module.gate_up_proj_input_scale is not None or (self.src == "w4" and name in infos):
                        self.expect(name, [(), (1,)], _FLOAT)
        self.remaining = len(self.expected)
        self.pieces: dict[str, np.ndarray] = {}
        self.buf: dict[str, np.ndarray] | None = None

    def _alloc(self):
        m = self.m
        e, d, i = m.num_experts, m.hidden, m.inter
        if m.quant == "none":
            shapes = {"gate_up_proj": ((e, 2 * i, d), m.dtype), "down_proj": ((e, d, i), m.dtype)}
        elif m.quant == "fp8":
            nbi, nbd = -(-i // BLOCK), -(-d // BLOCK)
            f8 = np.dtype(ml_dtypes.float8_e4m3fn)
            shapes = {"gate_up_proj": ((e, 2 * i, d), f8), "gate_up_proj_scale_inv": ((e, 2 * nbi, nbd), np.float32),
                      "down_proj": ((e, d, i), f8), "down_proj_scale_inv": ((e, nbd, nbi), np.float32)}
        else:
            shapes = {"gate_up_proj": ((e, 2 * i, d // 2), np.int8),
                      "gate_up_proj_scale_inv": ((e, 2 * i, d // BLOCK), np.float32),
                      "down_proj": ((e, d, i // 2), np.int8), "down_proj_scale_inv": ((e, d, i // BLOCK), np.float32)}
            if m.gate_up_proj_input_scale is not None:
                shapes["gate_up_proj_input_scale"] = ((e, 2), np.float32)
                shapes["down_proj_input_scale"] = ((e,), np.float32)
        self.buf = {k: np.zeros(s, dt) for k, (s, dt) in shapes.items()}

    def _put(self, j, proj, w, s):
        """Writes converted expert j's ``proj`` (w [N, K'], s or None) into the buffers."""
        m, b = self.m, self.buf
        i = m.inter
        if proj == "down_proj":
            b["down_proj"][j] = w
            if s is not None:
                b["down_proj_scale_inv"][j] = s
            return
        half = 0 if proj == "gate_proj" else 1
        b["gate_up_proj"][j, half * i:(half + 1) * i] = w
        if s is not None:
            rows = s.shape[0]   # fp8: ceil(I/128) blocks, w4: I rows
            b["gate_up_proj_scale_inv"][j, half * rows:(half + 1) * rows] = s

    def feed(self, name, array):
        if self.buf is None:
            self._alloc()
        m, p = self.m, self.prefix
        self.remaining -= 1
        if self.fused:   # one expert at a time: a float32 copy of a whole V3 layer's [E, 2I, D] is 30 GB
            i = m.inter
            parts = ((("gate_proj", array[:, :i]), ("up_proj", array[:, i:])) if name.endswith("gate_up_proj")
                     else (("down_proj", array),))
            for proj, part in parts:
                for j in range(m.num_experts):
                    w, s = _convert(_Src("float", part[j]), m.quant, m.dtype, m.ue8m0, f"tensor '{name}' (expert {j})")
                    self._put(j, proj, w, s)
        else:
            rest = name[len(p) + 1:]
            j_str, proj, _ = rest.split(".", 2)
            j = int(j_str)
            if proj in _INPUT_SCALE:
                slot, col = _INPUT_SCALE[proj]
                key = "gate_up_proj_input_scale" if slot == "gu" else "down_proj_input_scale"
                if key in self.buf:
                    if col is None:
                        self.buf[key][j] = float(array.reshape(()))
                    else:
                        self.buf[key][j, col] = float(array.reshape(()))
            else:
                base = f"{p}.{j}.{proj}"
                self.pieces[name] = array
                need = [base + ".weight"] + ([base + ".weight_scale_inv"] if self.src != "float" else [])
                if all(k in self.pieces for k in need):
                    src = _Src(self.src, self.pieces.pop(base + ".weight"),
                               self.pieces.pop(base + ".weight_scale_inv", None))
                    w, s = _convert(src, m.quant, m.dtype, m.ue8m0, f"tensor '{base}.weight'")
                    self._put(j, proj, w, s)
        if self.remaining:
            return None
        for key in ("gate_up_proj_input_scale", "down_proj_input_scale"):
            if key in self.buf and not np.all(np.isfinite(self.buf[key]) & (self.buf[key] > 0)):
                raise CheckpointError(f"{p}.*.input_scale: a W4AFP8 input_scale is not a positive finite number")
        out = {self.path + (k,): v for k, v in self.buf.items()}
        self.buf = None
        return out


def _build_targets(model, infos: dict[str, TensorInfo]) -> tuple[dict[str, _Target], list[_Target]]:
    by_name: dict[str, _Target] = {}
    targets = []
    for path, mod in nnx.iter_modules(model):
        prefix = ".".join(map(str, path))
        if isinstance(mod, layers.Linear):
            t = _LinearTarget(prefix, path, mod, infos)
        elif isinstance(mod, layers.Experts):
            t = _ExpertsTarget(prefix, path, mod, infos)
        elif isinstance(mod, (layers.RMSNorm, layers.Embed)):
            t = _Simple(prefix + ".weight", path + ("weight",), mod.weight.shape, mod.weight.dtype)
        elif isinstance(mod, layers.TopkRouter):
            t = _Simple(prefix + ".weight", path + ("weight",), mod.weight.shape, mod.weight.dtype)
            b = _Simple(prefix + ".e_score_correction_bias", path + ("e_score_correction_bias",),
                        mod.e_score_correction_bias.shape, np.float32)
            targets.append(b)
            by_name.update({k: b for k in b.expected})
        else:
            continue
        targets.append(t)
        by_name.update({k: t for k in t.expected})
    return by_name, targets


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_W = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+\.gate_proj\.weight|gate_up_proj)$")


def _never_loaded(name: str, cfg: DeepseekConfig) -> bool:
    """The multi-token-prediction layers (``num_hidden_layers`` .. ``+ num_nextn_predict_layers - 1``) and rotary
    buffers. Layers past those are not skipped: they are unexpected tensors (a config with fewer layers than its
    checkpoint)."""
    m = _LAYER.match(name)
    mtp = bool(m and cfg.num_hidden_layers <= int(m.group(1)) < cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    return mtp or name.endswith("rotary_emb.inv_freq")


def _skipped(name: str, cfg: DeepseekConfig) -> bool:
    """:func:`_never_loaded` tensors, and a tied ``lm_head.weight`` equal to the embedding, are not loaded."""
    return _never_loaded(name, cfg) or (cfg.tie_word_embeddings and name == "lm_head.weight")


def _untie_a_different_lm_head(cfg: DeepseekConfig, files, infos: dict[str, TensorInfo]) -> DeepseekConfig:
    """``tie_word_embeddings`` with an ``lm_head.weight`` in the checkpoint that differs from the embedding: as
    transformers (which warns it will not tie them), the checkpoint's head is loaded, untied; an equal one is the
    tied embedding. Reads both tensors, only in this case."""
    if not (cfg.tie_word_embeddings and "lm_head.weight" in infos and "model.embed_tokens.weight" in infos):
        return cfg
    read = {sf.path: sf for sf in files}
    head, embed = (read[infos[n].file].read_tensor(n) for n in ("lm_head.weight", "model.embed_tokens.weight"))
    if head.shape == embed.shape and np.array_equal(head.view(np.uint8), embed.view(np.uint8)):
        return cfg
    warnings.warn("load_checkpoint: config.json ties the word embeddings, but the checkpoint's lm_head.weight "
                  "differs from model.embed_tokens.weight: loading it untied, as transformers does (set "
                  "tie_word_embeddings to false in config.json to silence this)", stacklevel=3)
    return dataclasses.replace(cfg, tie_word_embeddings=False)


def resolve_quant_config(cfg: DeepseekConfig, infos: dict[str, TensorInfo], quantize: str | None,
                         quantization_config: dict | None = None, *, act_scale: str = "dynamic",
                         ue8m0: bool | None = None) -> QuantConfig:
    """The model's formats from the checkpoint's and ``quantize`` (rules: :func:`load_checkpoint`).

    Args:
      cfg: architecture. infos: every tensor's header entry (name -> :class:`TensorInfo`); the source
        formats are read from the stored dtypes (F8_E4M3 linears -> FP8 blocks, I8 experts -> W4AFP8).
      quantize: None | "fp8" | "w4a8". quantization_config: the checkpoint's (for ``scale_fmt``).
    Returns:
      :class:`QuantConfig`.
    """
    if quantize not in (None, "fp8", "w4a8"):
        raise ValueError(f"load_checkpoint: quantize must be None, 'fp8' or 'w4a8', got {quantize!r}")
    if act_scale not in ("dynamic", "static"):
        raise ValueError(f"load_checkpoint: act_scale must be 'dynamic' or 'static', got {act_scale!r}")
    live = {n: t for n, t in infos.items() if not _skipped(n, cfg)}
    src_linear = "fp8" if any(t.dtype == "F8_E4M3" and ".mlp.experts." not in n for n, t in live.items()) else "none"
    expert_dtypes = {t.dtype for n, t in live.items() if _EXPERT_W.match(n)}
    src_experts = "w4a8" if "I8" in expert_dtypes else "fp8" if "F8_E4M3" in expert_dtypes else "none"
    block = (quantization_config or {}).get("weight_block_size")
    if "fp8" in (src_linear, src_experts) and block is not None and list(block) != [BLOCK, BLOCK]:
        raise CheckpointError(f"quantization_config.weight_block_size is {block}: only FP8 blocks of "
                              f"[{BLOCK}, {BLOCK}] are supported")
    if ue8m0 is None:   # scales stored as F8_E8M0 are UE8M0 whatever the config says
        ue8m0 = ((quantization_config or {}).get("scale_fmt") == "ue8m0"
                 or any(t.dtype == "F8_E8M0" and n.endswith("scale_inv") for n, t in live.items()))
    if quantize is None:
        linear, experts = src_linear, src_experts
    elif quantize == "fp8":
        if src_experts == "w4a8":
            raise ValueError("load_checkpoint: quantize='fp8' on a W4AFP8 checkpoint would re-quantize int4 "
                             "experts to fp8; load it with quantize=None or 'w4a8'")
        linear, experts = "fp8", "fp8"
    else:
        linear, experts = "fp8", "w4a8"
    if experts == "w4a8" and (cfg.hidden_size % BLOCK or cfg.moe_intermediate_size % BLOCK):
        warnings.warn(f"hidden_size ({cfg.hidden_size}) or moe_intermediate_size ({cfg.moe_intermediate_size}) "
                      "is not a multiple of 128: routed experts stay unquantized (bf16) instead of W4A8",
                      stacklevel=3)
        experts = "none"
    if act_scale == "static" and experts != "w4a8":
        raise ValueError(f"load_checkpoint: act_scale='static' is for W4A8 routed experts (a W4AFP8 checkpoint's "
                         f"input_scale); this model's routed experts are {experts!r}: use 'dynamic'")
    input_scales = experts == "w4a8" and src_experts == "w4a8" and any(n.endswith(".input_scale") for n in live)
    return QuantConfig(linear=linear, experts=experts, ue8m0=bool(ue8m0),
                       act_scale=act_scale if experts == "w4a8" else "dynamic", input_scales=input_scales)


def load_checkpoint(path, quantize: str | None = None, dtype=jnp.bfloat16, *, act_scale: str = "dynamic",
                    ue8m0: bool | None = None, progress: bool = True, mesh=None,
                    dispatch: str = "auto") -> DeepseekV3ForCausalLM:
    """Loads a HF DeepSeek-V3/R1 directory (``config.json`` + ``model.safetensors`` or a sharded index).

    Args:
      path: the checkpoint directory.
      quantize: ``None``: keep the checkpoint's formats (float weights become ``dtype``, FP8 blocks and
        W4AFP8 experts stay as they are). ``"fp8"``: FP8 128x128 blocks for every linear and routed expert
        (float weights are quantized, FP8 ones kept). ``"w4a8"``: routed experts W4 group-128 (float or
        FP8 experts are quantized; W4AFP8 experts kept) and FP8 blocks for the other linears. Embedding,
        lm_head, router and norms are never quantized. W4A8 needs ``hidden_size`` and
        ``moe_intermediate_size`` multiples of 128; otherwise the experts stay in ``dtype`` (a warning).
      dtype: activation dtype and dtype of unquantized weights: bfloat16 or float32.
      act_scale: W4A8 expert activations: ``"dynamic"`` (per token and 128 group) or ``"static"`` (the
        checkpoint's ``input_scale``, max over each layer's experts; W4AFP8 checkpoints only).
      ue8m0: FP8 scales as powers of two; default: ``quantization_config.scale_fmt == "ue8m0"`` or scales stored
        as ``F8_E8M0``.
      progress: show a tqdm progress bar.
      mesh: optional mesh with an ``"expert"`` axis (:func:`jax_w4a8.sharding.make_mesh`): each tensor
        goes straight to the devices that own it (never the whole model on one device) and the MoE
        layers run expert-parallel with ``dispatch`` (:class:`jax_w4a8.expert_parallel.ExpertParallel`).
        ``n_routed_experts`` must divide over the axis (checked before any data is read).
    Returns:
      :class:`DeepseekV3ForCausalLM` (``model.quant`` says the formats it holds).
    Raises:
      CheckpointError naming the tensor and file for missing / unexpected / mis-shaped tensors.
    """
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        raw_cfg = json.load(f)
    cfg = DeepseekConfig.from_dict(raw_cfg)
    if mesh is not None:
        parallel.check_divisible(cfg.n_routed_experts, mesh)
    files = _open_checkpoint(path, cfg)
    infos: dict[str, TensorInfo] = {}
    for sf in files:
        for name, info in sf.tensors.items():
            if name in infos:
                raise CheckpointError(f"tensor '{name}' is stored twice: in {infos[name].file} and {sf.path}")
            infos[name] = info
    cfg = _untie_a_different_lm_head(cfg, files, infos)
    qc = resolve_quant_config(cfg, infos, quantize, raw_cfg.get("quantization_config"), act_scale=act_scale,
                              ue8m0=ue8m0)
    abstract = nnx.eval_shape(lambda: DeepseekV3ForCausalLM(cfg, quant=qc, dtype=dtype, rngs=nnx.Rngs(0)))
    by_name, targets = _build_targets(abstract, infos)

    # Validate every header before reading any data.
    for name, info in infos.items():
        if _skipped(name, cfg):
            continue
        t = by_name.get(name)
        if t is None:
            raise CheckpointError(f"unexpected tensor '{name}' in {info.file} (no such weight in the model)")
        shapes, dtypes = t.expected[name]
        if info.shape not in shapes:
            raise CheckpointError(f"tensor '{name}' in {info.file} has shape {list(info.shape)}, expected "
                                  f"{' or '.join(str(list(s)) for s in shapes)}")
        if info.dtype not in dtypes:
            raise CheckpointError(f"tensor '{name}' in {info.file} has dtype {info.dtype}, expected one of {dtypes}")
    missing = [n for n in by_name if n not in infos]
    if missing:
        where = ", ".join(sorted({os.path.basename(sf.path) for sf in files}))
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor '{missing[0]}'{more}: not in {where} of {path}")

    values: dict[tuple, jax.Array] = {}
    total = sum(len(sf.tensors) for sf in files)
    with tqdm(total=total, desc=f"loading {os.path.basename(path.rstrip('/'))}", unit="tensor",
              disable=not progress) as bar:
        for sf in files:
            for name in sorted(sf.tensors, key=lambda n: sf.tensors[n].begin):    # sequential reads
                bar.update(1)
                if _skipped(name, cfg):
                    continue
                done = by_name[name].feed(name, sf.read_tensor(name))
                if done:
                    for vpath, arr in done.items():
                        values[vpath] = place(arr, ".".join(map(str, vpath)), mesh)

    graphdef, abstract_state = nnx.split(abstract)
    flat = []
    for vpath, var in nnx.to_flat_state(abstract_state):
        if vpath not in values:
            raise CheckpointError(f"{path}: nothing loaded into model variable {'.'.join(map(str, vpath))}")
        arr = values.pop(vpath)
        if tuple(arr.shape) != tuple(var.shape) or arr.dtype != var.dtype:
            raise CheckpointError(f"{'.'.join(map(str, vpath))}: loaded {arr.dtype}{list(arr.shape)}, model "
                                  f"wants {var.dtype}{list(var.shape)}")
        flat.append((vpath, var.replace(arr)))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if mesh is not None:
        parallel.set_expert_parallel(model, ExpertParallel(mesh, dispatch))
    return model


# ----------------------------------------------------------------------------------------------
# saving
# ----------------------------------------------------------------------------------------------
def _iter_tensors(model: DeepseekV3ForCausalLM, expert_layout: str):
    """Yields ``(checkpoint key, host array)`` for every tensor of the HF layout of ``model``."""
    for path, mod in nnx.iter_modules(model):
        p = ".".join(map(str, path))
        if isinstance(mod, layers.Linear):
            w = _np(mod.weight[...])
            s = None if mod.weight_scale_inv is None else _np(mod.weight_scale_inv[...])
            b = None if mod.bias is None else _np(mod.bias[...])
            # a fused Linear: each part under its HF name
            for (src, _), (rows, blocks) in zip(_linear_sources(p, mod), mod.part_slices()):
                yield src + ".weight", w[rows]
                if s is not None:
                    yield src + ".weight_scale_inv", s[blocks]
                if b is not None:
                    yield src + ".bias", b[rows]
        elif isinstance(mod, (layers.RMSNorm, layers.Embed)):
            yield p + ".weight", _np(mod.weight[...])
        elif isinstance(mod, layers.TopkRouter):
            yield p + ".weight", _np(mod.weight[...])
            yield p + ".e_score_correction_bias", _np(mod.e_score_correction_bias[...]).astype(np.float32)
        elif isinstance(mod, layers.Experts):
            yield from _iter_experts(p, mod, expert_layout)


def _iter_experts(p: str, m: layers.Experts, expert_layout: str):
    gu, dn = _np(m.gate_up_proj[...]), _np(m.down_proj[...])
    i = m.inter
    if expert_layout == "fused":
        if m.quant != "none":
            raise ValueError("save_checkpoint: expert_layout='fused' is only defined for unquantized experts")
        yield p + ".gate_up_proj", gu
        yield p + ".down_proj", dn
        return
    gs = None if m.gate_up_proj_scale_inv is None else _np(m.gate_up_proj_scale_inv[...])
    ds = None if m.down_proj_scale_inv is None else _np(m.down_proj_scale_inv[...])
    rows = None if gs is None else gs.shape[1] // 2     # fp8: ceil(I/128) blocks; w4: I rows
    gis = None if m.gate_up_proj_input_scale is None else _np(m.gate_up_proj_input_scale[...])
    dis = None if m.down_proj_input_scale is None else _np(m.down_proj_input_scale[...])
    for j in range(m.num_experts):
        for proj, w, s in (("gate_proj", gu[j, :i], None if gs is None else gs[j, :rows]),
                           ("up_proj", gu[j, i:], None if gs is None else gs[j, rows:]),
                           ("down_proj", dn[j], None if ds is None else ds[j])):
            yield f"{p}.{j}.{proj}.weight", w
            if s is not None:
                yield f"{p}.{j}.{proj}.weight_scale_inv", s
        if gis is not None:
            yield f"{p}.{j}.w1.input_scale", gis[j, 0:1]
            yield f"{p}.{j}.w3.input_scale", gis[j, 1:2]
            yield f"{p}.{j}.w2.input_scale", dis[j:j + 1]


def save_checkpoint(model: DeepseekV3ForCausalLM, path, *, expert_layout: str = "per_expert",
                    max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes ``model`` as a HF directory: ``config.json`` (+ ``quantization_config``) and
    ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards + ``model.safetensors.index.json``
    when larger than ``max_shard_bytes``.

    Weights are written in the formats the model holds (float in its dtype, FP8 blocks, W4AFP8 experts with
    ``input_scale`` when it has them). ``expert_layout``: ``"per_expert"`` (hub / ``save_pretrained``
    layout, any format) or ``"fused"`` (transformers-5 in-memory keys, unquantized experts only).
    """
    from safetensors.numpy import save_file

    if expert_layout not in ("per_expert", "fused"):
        raise ValueError(f"save_checkpoint: expert_layout must be 'per_expert' or 'fused', got {expert_layout!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg_dict = model.cfg.to_dict()
    cfg_dict["torch_dtype"] = cfg_dict["dtype"] = "bfloat16" if model.dtype == jnp.bfloat16 else "float32"
    qc = model.quant.to_hf()
    if qc is not None:
        cfg_dict["quantization_config"] = qc
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    tmp_names = []

    def flush():
        nonlocal size
        name = os.path.join(path, f".shard-{len(tmp_names):05d}.tmp")
        save_file(shards[-1], name, metadata={"format": "pt"})
        tmp_names.append((name, list(shards[-1])))
        shards[-1] = {}
        size = 0

    for key, arr in _iter_tensors(model, expert_layout):
        arr = np.ascontiguousarray(arr)
        if size and size + arr.nbytes > max_shard_bytes:
            flush()
        shards[-1][key] = arr
        size += arr.nbytes
    flush()
    n = len(tmp_names)
    if n == 1:
        os.replace(tmp_names[0][0], os.path.join(path, "model.safetensors"))
        stale = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(stale):
            os.remove(stale)
    else:
        weight_map, total = {}, 0
        for k, (tmp, keys) in enumerate(tmp_names):
            fn = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(path, fn))
            total += os.path.getsize(os.path.join(path, fn))
            weight_map.update({key: fn for key in keys})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)
