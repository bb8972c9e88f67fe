"""Expert parallelism: the sharded model equals the single-device one (CPU: 8 virtual devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_w4a8 import sharding
from jax_w4a8.expert_parallel import ExpertParallel
from jax_w4a8.models.deepseek import DeepseekConfig, jit_forward, load_checkpoint, shard_model
from test_deepseek_model import TINY128, random_weights, write_checkpoint

CFG = dict(TINY128, num_hidden_layers=2, n_routed_experts=8)  # W4A8-ready dims, one dense + one MoE layer
IDS = np.random.default_rng(7).integers(0, CFG["vocab_size"], (2, 9)).astype(np.int32)  # 18 tokens


def _checkpoint(tmp_path_factory, name, skew=False):
    cfg = DeepseekConfig.from_dict(CFG)
    w = random_weights(cfg, np.random.default_rng(1234))
    if skew:  # experts 0 and 1 (the first device's at n = 4) take almost every slot
        b = w["model.layers.1.mlp.gate.e_score_correction_bias"]
        b[:2] += 5.0
    path = str(tmp_path_factory.mktemp(name) / "ckpt")
    write_checkpoint(path, CFG, w)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "ep")


@pytest.fixture(scope="module")
def skewed_ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "ep_skew", skew=True)


def _logits(model, ids=IDS):
    return np.asarray(jit_forward(model)(jnp.asarray(ids)).astype(jnp.float32))


def _single(path, dtype, devices):
    with jax.default_device(devices[0]):
        return _logits(load_checkpoint(path, quantize="w4a8", dtype=dtype, progress=False))


def _check_sharded(path, n, dispatch, devices, dtype=jnp.float32, ids=IDS, tol=2e-6):
    ref = _single(path, dtype, devices) if ids is IDS else None
    mesh = sharding.make_mesh(n, devices)
    model = load_checkpoint(path, quantize="w4a8", dtype=dtype, progress=False, mesh=mesh, dispatch=dispatch)
    w = model.model.layers[1].mlp.experts.gate_up_proj[...]
    assert w.sharding.spec == P(sharding.EXPERT_AXIS, None, None)
    assert {s.data.shape[0] for s in w.addressable_shards} == {CFG["n_routed_experts"] // n}
    attn = model.model.layers[1].self_attn.qkv_a_proj.weight[...]
    assert attn.sharding.is_fully_replicated
    hlo = jax.jit(lambda t: model(t)).lower(jnp.asarray(ids)).as_text()
    if n > 1:  # the experts really run in a shard_map with this dispatch's collectives
        want = "stablehlo.all_reduce" if dispatch == "gather" else "stablehlo.all_to_all"
        assert dispatch == "auto" or want in hlo, f"no {want} in the lowered model"
    out = _logits(model, ids)
    if ref is None:
        with jax.default_device(devices[0]):
            ref = _logits(load_checkpoint(path, quantize="w4a8", dtype=dtype, progress=False), ids)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= tol, f"n={n} {dispatch}: max error {err:.2e} relative to the largest logit"
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))
    return err


@pytest.mark.parametrize("dispatch", ["gather", "all_to_all"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_sharded_equals_single_device(ckpt, n, dispatch):
    """Same math on 1..8 devices: float32 logits equal up to summation order of the expert combine."""
    _check_sharded(ckpt, n, dispatch, jax.devices("cpu"))


@pytest.mark.parametrize("dispatch", ["gather", "all_to_all"])
def test_skewed_routing(skewed_ckpt, dispatch):
    """One device receives almost every slot: no token is dropped, results unchanged."""
    _check_sharded(skewed_ckpt, 4, dispatch, jax.devices("cpu"))


def test_fewer_tokens_than_devices(ckpt):
    """Two tokens over eight devices: six devices hold only padding in the all-to-all dispatch."""
    _check_sharded(ckpt, 8, "all_to_all", jax.devices("cpu"), ids=IDS[:1, :2])


def test_bf16_sharded_close(ckpt):
    """bf16: expert outputs are rounded per row as on one device; only the fp32 combine order differs."""
    _check_sharded(ckpt, 4, "auto", jax.devices("cpu"), dtype=jnp.bfloat16, tol=2e-2)


def test_w4a8_tokens_travel_as_fp8(ckpt):
    """W4A8 experts with dynamic scales take their tokens quantized before dispatch: the all-to-all moves
    e4m3 codes (as bytes) and float32 scales out, not bf16 rows; the logits are the single-device ones."""
    import re
    devices = jax.devices("cpu")
    mesh = sharding.make_mesh(2, devices)
    model = load_checkpoint(ckpt, quantize="w4a8", dtype=jnp.bfloat16, progress=False, mesh=mesh,
                            dispatch="all_to_all")
    hlo = jax.jit(lambda t: model(t)).lower(jnp.asarray(IDS)).as_text()
    moved = re.findall(r"stablehlo\.all_to_all.*?-> tensor<([^>]*)>", hlo)
    # out: codes as bytes and their scales; back: the experts' bf16 results (the only bf16 rows that move)
    assert sum(t.endswith("x256xui8") for t in moved) == 1 and sum(t.endswith("x2xf32") for t in moved) == 1
    assert sum(t.endswith("xbf16") for t in moved) == 1, moved
    _check_sharded(ckpt, 2, "all_to_all", devices, dtype=jnp.bfloat16, tol=2e-2)


@pytest.mark.parametrize("dispatch", ["gather", "all_to_all"])
def test_ue8m0_prefill_tokens_travel_folded(ckpt, dispatch, rng):
    """UE8M0 W4A8 experts under EP take their tokens in the folded layout where each device's gate+up product
    plans the folding kernel for the rows its experts expect (301 tokens x top-2 over 4 devices: about 75 rows
    for each of 2 local experts, as one device with all 8 experts plans them): fp8 codes and one float32
    multiplier per token travel (the multipliers padded to whole chunks), both grouped GEMMs take [rows]
    multipliers, and the logits are the single-device ones. 161 tokens, whose buffer (322 rows for 2 experts)
    would fold but whose experts expect 40 rows each, stay in the standard layout, as on one device."""
    import re
    devices = jax.devices("cpu")
    ids = rng.integers(0, CFG["vocab_size"], (1, 301)).astype(np.int32)
    mesh = sharding.make_mesh(4, devices)
    model = load_checkpoint(ckpt, quantize="w4a8", dtype=jnp.float32, ue8m0=True, progress=False, mesh=mesh,
                            dispatch=dispatch)

    def scales_of_gemms(t):
        hlo = jax.jit(lambda v: model(v)).lower(jnp.asarray(t)).as_text()
        gemms = re.findall(r"custom_call @jax_w4a8_w4a8_grouped_gemm.*?: \(tensor<[^>]*>, tensor<([^>]*)>", hlo)
        return gemms, re.findall(r"stablehlo\.all_to_all.*?-> tensor<([^>]*)>", hlo)

    rows = 301 * 2 if dispatch == "gather" else 4 * 76 * 2
    gemms, moved = scales_of_gemms(ids)
    assert gemms == [f"{rows}xf32"] * 2, gemms     # gate+up and down: folded, [rows] token multipliers
    if dispatch == "all_to_all":
        assert "4x152xf32" in moved and "4x152x256xui8" in moved, moved  # 76 tokens' 152 slots per chunk
    small = 161 * 2 if dispatch == "gather" else 4 * 41 * 2
    # standard: [rows, K / 128]
    assert scales_of_gemms(ids[:, :161])[0] == [f"{small}x2xf32", f"{small}x1xf32"]
    with jax.default_device(devices[0]):
        single = load_checkpoint(ckpt, quantize="w4a8", dtype=jnp.float32, ue8m0=True, progress=False)
        experts = single.model.layers[1].mlp.experts
        assert experts.input_layout(301 * 2) == "folded" and experts.input_layout(161 * 2) == "standard"
        ref = _logits(single, ids)
    out = _logits(model, ids)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= 2e-6, err
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("dispatch", ["gather", "all_to_all"])
def test_zero_tokens(dispatch):
    from jax_w4a8.expert_parallel import moe_apply_ep
    mesh = sharding.make_mesh(2, jax.devices("cpu"))
    out = moe_apply_ep(jnp.zeros((0, 16)), jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2)), jnp.zeros((4, 1)),
                       lambda p, x, gs: x, 4, ExpertParallel(mesh, dispatch))
    assert out.shape == (0, 16)
    # tokens routed to no expert (K = 0): zeros, as moe_apply gives (the collectives would reject the empty slots)
    x = jnp.ones((5, 16))
    out = moe_apply_ep(x, jnp.zeros((5, 0), jnp.int32), jnp.zeros((5, 0)), jnp.zeros((4, 1)),
                       lambda p, x, gs: x, 4, ExpertParallel(mesh, dispatch))
    np.testing.assert_array_equal(np.asarray(out), np.zeros((5, 16), np.float32))


@pytest.mark.parametrize("dispatch", ["gather", "all_to_all"])
def test_ids_outside_the_experts_are_ignored_and_bad_arguments_named(dispatch):
    """As moe_apply: ids outside [0, E) add nothing (the all_to_all exchange once sent a -1 to device 0's experts:
    3.8 off on its token), and misshapen arguments raise naming themselves (they were clamped or broadcast)."""
    from jax_w4a8 import moe
    from jax_w4a8.expert_parallel import moe_apply_ep
    rng = np.random.default_rng()
    mesh = sharding.make_mesh(2, jax.devices("cpu"))
    e, n_tok, k, d = 4, 5, 2, 8
    x = jnp.asarray(rng.standard_normal((n_tok, d)), jnp.float32)
    ids = rng.integers(0, e, (n_tok, k)).astype(np.int32)
    ids[0, 0], ids[3, 1] = -1, e  # one id below, one past the experts
    w = jnp.asarray(rng.uniform(0.1, 1.0, (n_tok, k)), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (e, 1)), jnp.float32)
    fn = lambda p, xs, gs: xs * jnp.repeat(p[:, 0], gs, total_repeat_length=xs.shape[0])[:, None]  # noqa: E731
    got = moe_apply_ep(x, jnp.asarray(ids), w, scale, fn, e, ExpertParallel(mesh, dispatch))
    want = moe.moe_apply(x, jnp.asarray(ids), w, lambda xs, gs: fn(scale, xs, gs), e)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    ep = ExpertParallel(mesh, dispatch)
    with pytest.raises(ValueError, match="'x' must have one row per token"):
        moe_apply_ep(x[:3], jnp.asarray(ids), w, scale, fn, e, ep)
    with pytest.raises(ValueError, match="'topk_weights' must have the shape"):
        moe_apply_ep(x, jnp.asarray(ids), w[:, :1], scale, fn, e, ep)
    with pytest.raises(TypeError, match="'topk_ids' must be an integer array"):
        moe_apply_ep(x, jnp.asarray(ids, jnp.float32), w, scale, fn, e, ep)
    with pytest.raises(ValueError, match="'num_experts'"):
        moe_apply_ep(x, jnp.asarray(ids), w, scale, fn, 3, ep)


@pytest.mark.parametrize("n, tokens, skew", [(2, 37, False), (4, 61, True), (8, 5, False), (8, 200, True)])
def test_dense_exchange_moves_rows_in_place(n, tokens, skew, rng):
    """The dense exchange builds each device's chunks with one gather and takes the received chunks as the buffer
    (fixed layout: no scatter, no offsets exchanged), and un-sorts the results with one gather: bit for bit the
    generic exchange's results (XLA:CPU runs "ragged" as that: dense chunks scattered at exchanged offsets), for
    fp8 codes with 1-D multipliers (the folded layout), padding tokens, skewed routing and ids outside [0, E). The
    experts' buffer has zeros past its real rows (which the dense path's gathers no longer read from memory)."""
    import re
    from jax_w4a8 import moe
    from jax_w4a8.expert_parallel import moe_apply_ep
    mesh = sharding.make_mesh(n, jax.devices("cpu"))
    e, k, d = 16, 3, 128
    x8 = jnp.asarray(rng.standard_normal((tokens, d)), jnp.float8_e4m3fn)
    xm = jnp.asarray(rng.uniform(0.5, 2.0, tokens), jnp.float32)
    p = rng.dirichlet(np.full(e, 0.2 if skew else 50.0))
    ids = np.stack([rng.choice(e, k, replace=False, p=p) for _ in range(tokens)]).astype(np.int32)
    ids[0, 0] = -1
    w = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, k)), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (e, 1)), jnp.float32)

    def fn(prm, xs, gs, check_padding=True):  # each row: its codes times its multiplier and its expert's scale
        codes, mult = xs
        per_row = jnp.repeat(prm[:, 0], gs, total_repeat_length=codes.shape[0]) * mult
        padding = jnp.arange(codes.shape[0]) >= jnp.sum(gs)
        # EP's buffer has zeros past its real rows (sum(gs)), codes and multipliers: anything else there (say, the
        # row the dense path's gathers read in their place) shifts every result (moe_apply's rows past sum(gs) are
        # its ignored slots: anything)
        leak = jnp.sum(jnp.where(padding[:, None], jnp.abs(codes.astype(jnp.float32)), 0.0))
        leak += jnp.sum(jnp.where(padding, jnp.abs(mult), 0.0))
        return jnp.where(padding[:, None], 1e3, codes.astype(jnp.float32) * per_row[:, None]
                         + (leak if check_padding else 0.0))

    def run(exchange):
        f = jax.jit(lambda a, b, c, s: moe_apply_ep(a, b, c, s, fn, e, ExpertParallel(mesh, "all_to_all",
                                                                                   exchange=exchange)))
        return f, np.asarray(f((x8, xm), jnp.asarray(ids), w, scale))

    f, dense = run("dense")
    _, generic = run("ragged")
    np.testing.assert_array_equal(dense, generic)
    want = moe.moe_apply((x8, xm), jnp.asarray(ids), w, lambda xs, gs: fn(scale, xs, gs, check_padding=False), e)
    np.testing.assert_allclose(dense, np.asarray(want), rtol=1e-6, atol=1e-6)
    hlo = f.lower((x8, xm), jnp.asarray(ids), w, scale).as_text()
    # no scatter of row data (the sorts' int32 inverse permutations are scatters)
    scattered = [re.search(r"-> tensor<([^>]*)>", hlo[i:]).group(1) for i in
                 (m.start() for m in re.finditer(r"stablehlo\.scatter", hlo))]
    assert scattered and all(t.endswith("xi32") and t.count("x") == 1 for t in scattered), scattered
    # sizes, codes, multipliers and expert ids out; results back
    assert len(re.findall(r"stablehlo\.all_to_all", hlo)) == 5, re.findall(r"stablehlo\.all_to_all.*", hlo)


@pytest.mark.parametrize("n, tokens, top_k", [(2, 17, 3), (4, 5, 2), (4, 301, 1)])
def test_buffer_rows_is_what_each_device_experts_receive(n, tokens, top_k):
    """expert_parallel.buffer_rows against the rows each device's experts_fn is handed (recorded while tracing),
    under both dispatches; an unknown dispatch is named."""
    from jax_w4a8.expert_parallel import buffer_rows, moe_apply_ep
    mesh = sharding.make_mesh(n, jax.devices("cpu"))
    e = 2 * n
    ids = jnp.asarray(np.arange(tokens * top_k).reshape(tokens, top_k) % e, jnp.int32)
    seen = []

    def fn(prm, x, gs):
        seen.append(x.shape[0])
        return x
    for dispatch in ("gather", "all_to_all"):
        seen.clear()
        moe_apply_ep(jnp.ones((tokens, 8)), ids, jnp.ones((tokens, top_k)), jnp.zeros((e, 1)), fn, e,
                     ExpertParallel(mesh, dispatch))
        assert seen == [buffer_rows(tokens, top_k, n, dispatch)], (dispatch, seen)
    with pytest.raises(ValueError, match="'dispatch'"):
        buffer_rows(tokens, top_k, n, "auto")


def test_auto_dispatch_by_tokens():
    mesh = sharding.make_mesh(2, jax.devices("cpu"))
    ep = ExpertParallel(mesh, "auto", gather_max_tokens=16)
    assert ep.strategy(16) == "gather" and ep.strategy(17) == "all_to_all"
    assert ep.buffer_rows(16, 8) == 16 * 8 and ep.buffer_rows(17, 8) == 2 * 9 * 8  # all slots; 2 chunks of 9 tokens
    with pytest.raises(ValueError, match="'dispatch'"):
        ExpertParallel(mesh, "ring")
    with pytest.raises(ValueError, match="'exchange'"):
        ExpertParallel(mesh, exchange="ring")


def test_indivisible_experts_fail_at_load(ckpt):
    mesh = sharding.make_mesh(3, jax.devices("cpu"))
    with pytest.raises(ValueError, match="n_routed_experts=8 does not divide"):
        load_checkpoint(ckpt, quantize="w4a8", progress=False, mesh=mesh)


def test_shard_model_in_place(ckpt):
    devices = jax.devices("cpu")
    with jax.default_device(devices[0]):
        model = load_checkpoint(ckpt, quantize="w4a8", dtype=jnp.float32, progress=False)
        ref = _logits(model)
    shard_model(model, sharding.make_mesh(4, devices), dispatch="all_to_all", exchange="dense")
    np.testing.assert_allclose(_logits(model), ref, rtol=0, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("dispatch", ["gather", "all_to_all"])
def test_auto_moe_up_decides_for_the_rows_each_device_expects(ckpt, dispatch, monkeypatch):
    """Each device's buffer has room for all 18 x 2 routed rows, but its 8 / n experts expect 36 / n of them:
    ``moe_up="auto"`` decides for those (each expert's expected rows as on one device), not for the buffer."""
    from jax_w4a8 import tiling  # noqa: PLC0415
    real, seen = tiling.moe_up_fuses, []

    def spy(m, e, inter, k, **kw):
        seen.append((m, e, kw.get("expected_rows")))
        return real(m, e, inter, k, **kw)

    monkeypatch.setattr(tiling, "moe_up_fuses", spy)
    devices = jax.devices("cpu")
    for n in (1, 4):
        seen.clear()
        model = load_checkpoint(ckpt, quantize="w4a8", dtype=jnp.bfloat16, progress=False,
                                mesh=sharding.make_mesh(n, devices) if n > 1 else None, dispatch=dispatch)
        jax.clear_caches()  # the model's inner jit would otherwise reuse an earlier case's trace
        jax.jit(lambda t: model(t)).lower(jnp.asarray(IDS))
        rows = IDS.size * 2  # top-2
        room = rows if dispatch == "gather" else n * -(-IDS.size // n) * 2  # all_to_all: n chunks of whole tokens
        want = (rows, 8, None) if n == 1 else (room, 8 // n, rows // n)
        assert seen == [want], (n, seen)


@pytest.mark.parametrize("dispatch", ["gather", "all_to_all"])
def test_grouped_gemms_plan_for_the_rows_each_device_expects(ckpt, dispatch, monkeypatch):
    """Each device's W4A8 GEMMs (and a fused up-projection) plan their tiles for the 36 / n rows its experts
    expect (``rows_per_expert``), not for the buffer's room (a buffer of 36 rows at n = 4 would plan 18 rows for
    each of its 2 experts, and a prefill's buffer CUTLASS's kernel where 128 rows per expert take the
    folding one: tests/test_tiling.py); one device plans from its rows (no hint)."""
    from jax_w4a8 import tiling  # noqa: PLC0415
    seen = []
    for name in ("plan_grouped_gemm", "plan_moe_up"):
        real = getattr(tiling, name)

        def spy(m, e, n, k, _real=real, **kw):
            seen.append((m, e, kw.get("rows_per_expert")))
            return _real(m, e, n, k, **kw)

        monkeypatch.setattr(tiling, name, spy)
    devices = jax.devices("cpu")
    for n in (1, 4):
        seen.clear()
        model = load_checkpoint(ckpt, quantize="w4a8", dtype=jnp.bfloat16, progress=False,
                                mesh=sharding.make_mesh(n, devices) if n > 1 else None, dispatch=dispatch)
        jax.clear_caches()
        jax.jit(lambda t: model(t)).lower(jnp.asarray(IDS))
        experts = CFG["n_routed_experts"] // n
        room = IDS.size * 2 if dispatch == "gather" or n == 1 else n * -(-IDS.size // n) * 2
        want = None if n == 1 else -(-IDS.size * 2 // n) / experts
        # the ops' plans (moe_up="auto" plans the expected rows themselves: tiling.moe_up_fuses)
        routed = [hint for m, e, hint in seen if (m, e) == (room, experts)]
        assert len(routed) >= 2 and all(h == want for h in routed), (n, seen)


@pytest.mark.gpu
@pytest.mark.parametrize("dispatch", ["gather", "all_to_all"])
def test_two_gpus_equal_one(ckpt, dispatch):
    """Through the CUDA kernels and NCCL (default: dense all-to-all exchange) on two GPUs."""
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    # The tensor cores accumulate with reduced precision; both runs use the same kernels per row.
    _check_sharded(ckpt, 2, dispatch, gpus, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["dense", "ragged"])
def test_two_gpus_ue8m0_prefill_folded(ckpt, exchange, rng):
    """UE8M0 tokens in the folded layout (codes and float32 token multipliers through NCCL, the folding kernel on
    each device's padded buffer; tests/test_expert_parallel.py::test_ue8m0_prefill_tokens_travel_folded checks the
    layout on CPU devices) equal one GPU's, whose 8 experts fold the same rows."""
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    ids = rng.integers(0, CFG["vocab_size"], (1, 301)).astype(np.int32)
    with jax.default_device(gpus[0]):
        model = load_checkpoint(ckpt, quantize="w4a8", dtype=jnp.float32, ue8m0=True, progress=False)
        assert model.model.layers[1].mlp.experts.input_layout(ids.size * 2) == "folded"
        ref = _logits(model, ids)
    shard_model(model, sharding.make_mesh(2, gpus), dispatch="all_to_all", exchange=exchange)
    out = _logits(model, ids)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.gpu
def test_two_gpus_ragged_exchange(ckpt):
    """The ragged all-to-all exchange (GPUs only) through NCCL on two GPUs."""
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    with jax.default_device(gpus[0]):
        model = load_checkpoint(ckpt, quantize="w4a8", dtype=jnp.float32, progress=False)
        ref = _logits(model)
    shard_model(model, sharding.make_mesh(2, gpus), dispatch="all_to_all", exchange="ragged")
    out = _logits(model)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))
