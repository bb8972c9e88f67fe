"""The static tile plan (jax_w4a8.tiling): the choices the module docstring promises."""

import functools
import math

import numpy as np
import pytest

from jax_w4a8 import _ffi, tiling

SMS = 132


def test_decode_tile_covers_routing_spread():
    # 16 rows per expert on average: about 40% of experts get more than 16, so a 16-row tile would
    # read their weights twice; the plan takes 32.
    assert tiling.plan_grouped_gemm(512, 32, 4096, 7168, num_sms=SMS).tile_tokens == 32
    assert tiling.plan_grouped_gemm(256, 32, 4096, 7168, num_sms=SMS).tile_tokens == 16
    # 2 rows per expert: 8-row tiles (the f16 MMA's smallest; half the activation bytes of 16 per weight tile)
    assert tiling.plan_grouped_gemm(64, 32, 4096, 7168, num_sms=SMS).tile_tokens == 8
    assert tiling.plan_grouped_gemm(16384, 32, 4096, 7168, num_sms=SMS).tile_tokens == 128
    # An explicit hint is the expected count; the spread is still covered.
    assert tiling.plan_grouped_gemm(64, 32, 4096, 7168, rows_per_expert=30, num_sms=SMS).tile_tokens == 64
    # The einsum knows its rows exactly: no spread.
    assert tiling.plan_fp8_einsum(8, 1, 7168, 7168, num_sms=SMS).tile_tokens == 8  # the decode kernel
    assert tiling.plan_fp8_einsum(9, 1, 7168, 7168, num_sms=SMS).tile_tokens == 16
    assert tiling.plan_fp8_einsum(16, 1, 7168, 7168, num_sms=SMS).tile_tokens == 16
    assert tiling.plan_fp8_einsum(17, 1, 7168, 7168, num_sms=SMS).tile_tokens == 32


@pytest.mark.parametrize("m", [64, 256, 512, 4096])
def test_tile_holds_most_experts_rows(m):
    # Under uniform multinomial routing, few experts overflow the chosen tile.
    plan = tiling.plan_grouped_gemm(m, 32, 4096, 7168, num_sms=SMS)
    sizes = np.random.default_rng(0).multinomial(m, np.ones(32) / 32, size=200)
    if plan.tile_tokens < max(tiling.GROUPED_TILE_TOKENS):
        assert (sizes > plan.tile_tokens).mean() < 0.05
    else:  # the largest tile, which overflows often here: taken only because the next smaller one would too
        assert plan.tile_tokens == 128
        smaller = max(t for t in tiling.GROUPED_TILE_TOKENS if t < plan.tile_tokens)
        assert (sizes > smaller).mean() >= 0.05


def test_batch_one_decode_splits_k():
    # One token, top-8: about one expert of 32 busy -> 32 units; K is split to fill the GPU.
    plan = tiling.plan_grouped_gemm(1, 32, 4096, 7168, num_sms=SMS)
    assert plan.split_k > 4
    assert plan.scratch_bytes >= SMS * 2 * 2 * plan.tile_tokens * 128 * 4  # two partial tiles per resident block


def test_forced_split_k_for_probes():
    """``split_k`` forces the K split (profile_case.py --split-k): whole tiles drop the stream-K scratch, a
    larger split keeps it; out of [1, K/128] is an error naming the argument."""
    # batch 1 of a gate+up whose N is not a multiple of 256 (so no 256-row blocks): split 2
    auto = tiling.plan_grouped_gemm(8, 256, 3968, 7168, num_sms=SMS)
    whole = tiling.plan_grouped_gemm(8, 256, 3968, 7168, num_sms=SMS, split_k=1)
    four = tiling.plan_grouped_gemm(8, 256, 3968, 7168, num_sms=SMS, split_k=4)
    assert (auto.split_k, whole.split_k, four.split_k) == (2, 1, 4)
    assert whole.scratch_bytes < auto.scratch_bytes == four.scratch_bytes
    assert whole.tile_tokens == auto.tile_tokens == four.tile_tokens == 8
    assert tiling.plan_grouped_gemm(8, 256, 4096, 7168, num_sms=SMS, split_k=2).split_k == 2  # forced over the rule
    for bad in (0, 57, 2.0):
        with pytest.raises(ValueError, match="split_k"):
            tiling.plan_grouped_gemm(8, 256, 3968, 7168, num_sms=SMS, split_k=bad)


def test_whole_units_where_one_wave_of_256_row_blocks_fills_the_gpu():
    # The f16 8- to 32-token tiles of whole units run 256-row blocks, one per SM (hopper_gemm.cu LaunchF16); the
    # plan takes them over split-K where their busy units are one wave filling at least 90% of the SMs.
    plan = tiling.plan_grouped_gemm(8, 256, 4096, 7168, num_sms=SMS)  # batch 1, V3 gate+up: 8 x 16 units
    assert (plan.split_k, plan.tile_tokens, plan.mma) == (1, 8, "f16")
    assert tiling.plan_grouped_gemm(8, 256, 4096, 7168, num_sms=114).split_k == 2  # 126 units: two waves
    assert tiling.plan_grouped_gemm(8, 256, 4096, 7168, num_sms=160).split_k == 2  # 79% of one wave
    assert tiling.plan_grouped_gemm(64, 32, 4096, 7168, num_sms=SMS).split_k == 2  # 443 units, last wave 36% full
    assert tiling.plan_grouped_gemm(1, 32, 4096, 7168, num_sms=SMS).split_k > 1  # 16 units
    assert tiling.plan_grouped_gemm(8, 256, 4096, 7168, num_sms=SMS, mma="e4m3").split_k > 1  # 128-row blocks only


def test_no_split_once_the_gpu_is_full():
    # 256 rows over 32 experts: all 32 busy x 32 feature tiles = 1024 units, ~3.9 waves: no split.
    assert tiling.plan_grouped_gemm(256, 32, 4096, 7168, num_sms=SMS).split_k == 1
    assert tiling.plan_grouped_gemm(256, 32, 7168, 2048, num_sms=SMS).split_k == 1
    assert tiling.plan_grouped_gemm(16384, 32, 4096, 7168, num_sms=SMS).split_k == 1
    # Too few units for the SMs: split, at most the number of K groups.
    plan = tiling.plan_grouped_gemm(2, 32, 512, 1024, num_sms=SMS)
    assert 1 < plan.split_k <= 1024 // 128


@pytest.mark.parametrize("m, split", [(64, True), (72, True), (80, False), (256, False)])
def test_stream_k_when_experts_are_expected_empty(m, split):
    # 64 rows over 32 experts: ~27 busy, which ones only the device knows: stream-K for deep tiles (gate+up,
    # 56 K groups; H200: 7-15% faster). From ~2.3 rows per expert nearly all are busy: whole units.
    for n, k in ((4096, 7168), (4096, 4096)):
        plan = tiling.plan_grouped_gemm(m, 32, n, k, num_sms=SMS)
        assert (plan.split_k > 1) == split, (m, n, k, plan)
        if split:  # the scales, the piece counters and two partial tiles per resident block
            assert plan.scratch_bytes >= (k // 128) * m * 4 + SMS * 2 * 2 * plan.tile_tokens * 128 * 4
    # Shallow tiles (down, 16 K groups) keep whole units: a split tile's fix-up costs more than the ragged
    # last wave (H200: 8-14% faster whole at 16 - 64 rows); where units do not fill the GPU they still split.
    assert tiling.plan_grouped_gemm(m, 32, 7168, 2048, num_sms=SMS).split_k == 1
    assert tiling.plan_grouped_gemm(1, 32, 7168, 2048, num_sms=SMS).split_k > 1
    # A hint of rows per expert plans E * hint rows routed uniformly over the M rows' buffer: the hint M / E is
    # no hint; M / E rows each in a buffer of 8 M rows (expert parallelism over 8 devices) plan as M rows do.
    for n, k in ((4096, 7168), (7168, 2048)):
        plan = tiling.plan_grouped_gemm(m, 32, n, k, num_sms=SMS)
        assert tiling.plan_grouped_gemm(m, 32, n, k, rows_per_expert=m / 32, num_sms=SMS) == plan
        hinted = tiling.plan_grouped_gemm(8 * m, 32, n, k, rows_per_expert=m / 32, num_sms=SMS)
        assert (hinted.tile_tokens, hinted.split_k, hinted.mma) == (plan.tile_tokens, plan.split_k, plan.mma), hinted
    # From a few rows per expert every expert is busy: no stream-K.
    assert tiling.plan_grouped_gemm(m, 32, 4096, 7168, rows_per_expert=8, num_sms=SMS).split_k == 1
    # A prefill under expert parallelism (8 devices): 4096 tokens x top-8 give each device a buffer of 32768 rows,
    # 128 expected per local expert: the 128-token kernel (folding), not CUTLASS's (from 576 rows per expert).
    prefill = tiling.plan_grouped_gemm(32768, 32, 4096, 7168, rows_per_expert=128, cutlass=True, num_sms=SMS)
    assert prefill.kernel == "native" and tiling.folds_activations(prefill), prefill
    assert tiling.plan_grouped_gemm(32768, 32, 4096, 7168, cutlass=True, num_sms=SMS).kernel == "cutlass"


def test_split_never_exceeds_groups():
    for k in (128, 256, 512):
        plan = tiling.plan_fp8_einsum(1, 1, 576, k, tile_tokens=16, num_sms=SMS)
        assert 1 <= plan.split_k <= k // 128


def test_busy_experts_matches_simulation():
    sizes = np.random.default_rng(1).multinomial(64, np.ones(32) / 32, size=2000)
    assert math.isclose(tiling._busy_experts(64, 32), (sizes > 0).sum(1).mean(), rel_tol=0.02)


def test_fused_plan_f16_holds_the_f16_activations():
    e4 = tiling.plan_moe_up(256, 32, 2048, 7168, num_sms=SMS, mma="e4m3")
    f16 = tiling.plan_moe_up(256, 32, 2048, 7168, num_sms=SMS)  # the default up to 64 rows per expert
    assert (e4.mma, f16.mma, f16.tile_tokens) == ("e4m3", "f16", 16)
    assert tiling.plan_moe_up(64, 32, 2048, 7168, num_sms=SMS).tile_tokens == 8
    assert f16.scratch_bytes == e4.scratch_bytes + 2 * 256 * 7168  # [M, K] f16 after the scales
    # 64-token tiles (the fused kernel's largest) take f16 up to 64 rows per expert (where measured), e4m3 above
    mid = tiling.plan_moe_up(2048, 32, 2048, 7168, num_sms=SMS)
    assert (mid.tile_tokens, mid.mma) == (64, "f16")
    assert tiling.plan_moe_up(2048, 32, 2048, 7168, num_sms=SMS, mma="e4m3").mma == "e4m3"
    big = tiling.plan_moe_up(4096, 32, 2048, 7168, num_sms=SMS)
    assert (big.tile_tokens, big.mma) == (64, "e4m3")
    assert tiling.plan_moe_up(4096, 32, 2048, 7168, num_sms=SMS, mma="f16").mma == "f16"


def test_moe_up_fuses_from_one_row_per_expert_where_the_unfused_gemm_splits_k_or_widens_its_tile():
    """A model's moe_up="auto" at DeepSeek-V3 widths (256 experts, I = 2048, K = 7168, 132 SMs): unfused below one
    expected row per expert (batch 2 to 31 of top-8 decode, K split), where the plain gate+up GEMM runs whole 8-token
    units (its wide kernel: batch 1 and 74 to 128), and above 64 expected rows per expert; fused where that GEMM
    splits K from one row per expert on (batch 32 to 73) or takes tiles above 8 (batch 129 to 2048)."""
    def fuses(rows):
        return tiling.moe_up_fuses(rows, 256, 2048, 7168, num_sms=SMS)

    def plain(rows):
        return tiling.plan_grouped_gemm(rows, 256, 4096, 7168, num_sms=SMS)

    for batch in (1, 96, 128):
        assert (plain(8 * batch).split_k, plain(8 * batch).tile_tokens) == (1, 8) and not fuses(8 * batch)
    for batch in (2, 8, 16, 31):
        assert plain(8 * batch).split_k > 1 and not fuses(8 * batch)
    for batch in (32, 48, 64):
        assert plain(8 * batch).split_k > 1 and fuses(8 * batch)
    for batch in (192, 256, 1024):
        assert plain(8 * batch).tile_tokens > 8 and fuses(8 * batch)
    assert fuses(256) and not fuses(255) and tiling.moe_up_fuses(8, 8, 2048, 7168, num_sms=SMS) == (
        tiling.plan_grouped_gemm(8, 8, 4096, 7168, num_sms=SMS).split_k > 1)
    assert tiling.plan_moe_up(8 * 2048, 256, 2048, 7168, num_sms=SMS).kernel == "fused" and fuses(8 * 2048)
    assert tiling.plan_moe_up(8 * 2049, 256, 2048, 7168, num_sms=SMS).kernel == "unfused" and not fuses(8 * 2049)
    with pytest.raises(ValueError, match="argument 'e'"):
        tiling.moe_up_fuses(16, 0, 2048, 7168)
    # a padded buffer (expert parallelism: 4 devices' room on each) decides as its expected rows
    for batch in (1, 16, 32, 64, 128, 256):
        for n in (2, 4):
            assert tiling.moe_up_fuses(8 * batch, 256 // n, 2048, 7168, expected_rows=8 * batch // n,
                                       num_sms=SMS) == tiling.moe_up_fuses(8 * batch // n, 256 // n, 2048, 7168,
                                                                           num_sms=SMS)
    # batch 256 on 4 devices: 8192 rows of room over 64 experts is 128 per expert (unfused); 32 expected (fused)
    assert not tiling.moe_up_fuses(8 * 256 * 4, 64, 2048, 7168, num_sms=SMS)
    assert tiling.moe_up_fuses(8 * 256 * 4, 64, 2048, 7168, expected_rows=8 * 256, num_sms=SMS)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="argument 'expected_rows'"):
            tiling.moe_up_fuses(16, 4, 2048, 7168, expected_rows=bad)


def test_fused_plan_caps_tile_and_never_splits():
    plan = tiling.plan_moe_up(16384, 32, 2048, 7168, num_sms=SMS)
    assert plan.tile_tokens == 64 and plan.split_k == 1
    with pytest.raises(ValueError, match="tile_tokens"):
        tiling.plan_moe_up(64, 32, 2048, 7168, tile_tokens=128)


def test_mma_format_follows_the_tile():
    # f16 operands at 8- to 64-row tiles (64 also up to 64 expected rows per expert, where the tile rule would
    # take 128), e4m3 at 128; an explicit choice is kept or refused.
    assert tiling.plan_grouped_gemm(64, 32, 4096, 7168, num_sms=SMS).mma == "f16"
    assert tiling.plan_grouped_gemm(512, 32, 4096, 7168, num_sms=SMS).mma == "f16"
    for m in (1024, 2048):
        p = tiling.plan_grouped_gemm(m, 32, 4096, 7168, num_sms=SMS, cutlass=False)
        assert (p.tile_tokens, p.mma) == (64, "f16"), m
    for m in (2080, 4096):  # 65 and 128 rows per expert
        p = tiling.plan_grouped_gemm(m, 32, 4096, 7168, num_sms=SMS, cutlass=False)
        assert (p.tile_tokens, p.mma) == (128, "e4m3"), m
    # e4m3 asked for: the tile rule alone (128 at 64 rows per expert); f16 asked for: as the default
    assert tiling.plan_grouped_gemm(2048, 32, 4096, 7168, num_sms=SMS, mma="e4m3").tile_tokens == 128
    assert tiling.plan_grouped_gemm(2048, 32, 4096, 7168, num_sms=SMS, mma="f16").tile_tokens == 64
    assert tiling.plan_grouped_gemm(16384, 32, 4096, 7168, num_sms=SMS, cutlass=False).mma == "e4m3"
    assert tiling.plan_grouped_gemm(64, 32, 4096, 7168, num_sms=SMS, mma="e4m3").mma == "e4m3"
    assert tiling.plan_grouped_gemm(512, 32, 4096, 7168, num_sms=SMS, mma="e4m3").mma == "e4m3"
    # f16 runs every grouped tile up to 128 tokens when asked for (not the plain kernel's tile 0)
    f16 = tiling.plan_grouped_gemm(16384, 32, 4096, 7168, num_sms=SMS, mma="f16")
    assert (f16.tile_tokens, f16.mma, f16.kernel) == (128, "f16", "native")
    with pytest.raises(ValueError, match="'mma'"):
        tiling.plan_grouped_gemm(64, 32, 4096, 7168, num_sms=SMS, tile_tokens=0, mma="f16")
    assert tiling.plan_grouped_gemm(64, 32, 4096, 7168, tile_tokens=0, num_sms=SMS).mma == "e4m3"


def test_block_scaled_einsum_takes_192_token_tiles_where_they_pad_little():
    # 192-token tiles (three consumer warpgroups) from 2048 rows, unless they pad M by > 10% more
    # (this library's kernels; the CUTLASS kernel, when built, is the default there: see below).
    plan = lambda m, **kw: tiling.plan_fp8_einsum(m, 1, 7168, 7168, num_sms=SMS, kernel="native", **kw)
    assert plan(4096, block_scaled=True).tile_tokens == 192
    assert plan(16384, block_scaled=True).tile_tokens == 192
    assert plan(512, block_scaled=True).tile_tokens == 128  # below 2048 rows 192 was not measured to pay
    assert plan(1536, block_scaled=True).tile_tokens == 128
    assert plan(2048, block_scaled=True).tile_tokens == 192  # 2112 vs 2048 padded rows
    assert plan(4096).tile_tokens == 128  # per-row weight scales: up to 128
    assert plan(64, block_scaled=True).tile_tokens == 64
    assert plan(4096, block_scaled=True, tile_tokens=128).tile_tokens == 128
    with pytest.raises(ValueError, match="tile_tokens"):
        plan(4096, tile_tokens=192)
    with pytest.raises(ValueError, match="tile_tokens"):
        tiling.plan_grouped_gemm(4096, 32, 4096, 7168, tile_tokens=192)


def test_block_scaled_bf16_einsum_plans_cutlass_from_its_row_threshold():
    plan = lambda m, **kw: tiling.plan_fp8_einsum(m, kw.pop("h", 1), kw.pop("n", 7168), 7168, num_sms=SMS, **kw)
    t = tiling.CUTLASS_MIN_TOKENS
    p = plan(4096, block_scaled=True, cutlass=True)
    assert (p.kernel, p.tile_tokens, p.split_k) == ("cutlass", 128, 1)
    # scratch: float32 activation scales [H, G, ceil4(M)], then float32 weight scales [H, ceil(N/128), G]
    assert p.scratch_bytes == 56 * 4096 * 4 + -(-(56 * 56 * 4) // 256) * 256
    assert plan(t - 1, h=3, n=1536, block_scaled=True, cutlass=True).kernel == "native"  # 36 tiles
    q = plan(t + 1, h=3, n=1536, block_scaled=True, cutlass=True)  # 3 heads x 2 x 12 tiles
    assert q.kernel == "cutlass" and q.units == 3 * -(-(t + 1) // 128) * 12
    assert q.scratch_bytes == -(-(3 * 56 * (-(-(t + 1) // 4) * 4) * 4) // 256) * 256 + -(-(3 * 12 * 56 * 4) // 256) * 256
    # Too few tiles for the machine (it has no split-K): kv_a (5 tile columns) up to 768 rows stays native.
    assert plan(768, n=576, block_scaled=True, cutlass=True).kernel == "native"
    assert plan(1024, n=576, block_scaled=True, cutlass=True).kernel == "cutlass"
    # From 64 rows: only with a full wave of tiles (128) and K >= 512 (V4 wo_a, MLA absorb_o; not absorb_q).
    assert tiling.plan_fp8_einsum(64, 16, 1024, 4096, block_scaled=True, cutlass=True).kernel == "cutlass"
    assert tiling.plan_fp8_einsum(64, 128, 128, 512, block_scaled=True, cutlass=True).kernel == "cutlass"
    assert tiling.plan_fp8_einsum(64, 128, 512, 128, block_scaled=True, cutlass=True).kernel == "native"
    assert tiling.plan_fp8_einsum(64, 1, 7168, 16384, block_scaled=True, cutlass=True).kernel == "native"
    assert tiling.plan_fp8_einsum(63, 16, 1024, 4096, block_scaled=True, cutlass=True).kernel == "native"
    # Not taken (native plan instead): per-row weight scales, float32 output, N not a multiple of 8, not built.
    assert plan(4096, cutlass=True).kernel == "native"
    assert plan(4096, block_scaled=True, cutlass=True, out_bf16=False).kernel == "native"
    assert plan(4096, n=7164, block_scaled=True, cutlass=True).kernel == "native"
    assert plan(4096, block_scaled=True, cutlass=False).kernel == "native"
    assert plan(4096, block_scaled=True, cutlass=True, tile_tokens=192).kernel == "native"
    # Forced: refused with the argument's name and the reason.
    assert plan(1, block_scaled=True, cutlass=True, kernel="cutlass").kernel == "cutlass"
    for kw, why in ((dict(), "recipe"), (dict(block_scaled=True, out_bf16=False), "bfloat16"),
                    (dict(block_scaled=True, n=7164), "multiple of 8")):
        with pytest.raises(ValueError, match=f"'kernel'='cutlass'.*{why}"):
            plan(4096, cutlass=True, kernel="cutlass", **kw)
    with pytest.raises(ValueError, match="without CUTLASS"):
        plan(4096, block_scaled=True, cutlass=False, kernel="cutlass")
    with pytest.raises(ValueError, match="'tile_tokens'"):
        plan(4096, block_scaled=True, cutlass=True, kernel="cutlass", tile_tokens=128)
    # 32-bit problem sizes: past them the plan keeps the native kernels; forced, a named error.
    huge = dict(block_scaled=True, cutlass=True, num_sms=SMS)
    assert tiling.plan_fp8_einsum(2**25, 1, 128, 128 * 64, **huge).kernel == "native"
    with pytest.raises(ValueError, match="32-bit"):
        tiling.plan_fp8_einsum(2**25, 1, 128, 128 * 64, kernel="cutlass", **huge)
    with pytest.raises(ValueError, match="'kernel'"):
        plan(4096, block_scaled=True, kernel="cudnn")
    # cuBLASLt's block-scaled GEMM: opt-in only (never the plan's own choice), one head, M % 4, N % 16.
    assert plan(4096, block_scaled=True, cutlass=True, cublas=True).kernel == "cutlass"
    assert plan(4096, block_scaled=True, cublas=True, kernel="cublas").kernel == "cublas"
    for kw, why in ((dict(), "recipe"), (dict(out_bf16=False), "bfloat16"), (dict(n=7160), "multiple of 16"),
                    (dict(m=4098), "multiple of 4"), (dict(cublas=False), "not available")):
        kw = dict(dict(m=4096, block_scaled=True, cublas=True), **kw) if kw else dict(m=4096, cublas=True)
        with pytest.raises(ValueError, match=f"'kernel'='cublas'.*{why}"):
            plan(kernel="cublas", **kw)
    with pytest.raises(ValueError, match="one head"):
        tiling.plan_fp8_einsum(4096, 2, 7168, 7168, block_scaled=True, kernel="cublas", cublas=True)


def test_stream_k_scratch_holds_partial_tiles_for_blocks_with_work():
    # Two partial tiles per block that can get an iteration: 64 x 576 x 1024 has 5 units x 8 K groups =
    # 40 iterations, fewer than the 132 blocks, so 40 blocks' slots; a bigger problem gets all 132.
    small = tiling.plan_fp8_einsum(64, 1, 576, 1024, block_scaled=True, num_sms=SMS)
    assert small.split_k > 1 and small.tile_tokens == 64
    counters = -(-(5 * 12 * 4) // 256) * 256
    scales = -(-(8 * 64 * 4) // 256) * 256
    assert small.scratch_bytes == scales + counters + 40 * 2 * 64 * 128 * 4
    big = tiling.plan_fp8_einsum(64, 1, 7168, 7168, block_scaled=True, num_sms=SMS)
    assert big.split_k > 1
    assert big.scratch_bytes >= SMS * 2 * 64 * 128 * 4


def test_einsum_cuts_a_tile_into_at_most_eight_pieces():
    # kv_a at one token: 5 tiles x 56 K groups would spread over all 264 blocks (53 pieces per tile);
    # the plan holds slots for 40 blocks (the kernel's grid), 8 pieces per tile.
    plan = tiling.plan_fp8_einsum(1, 1, 576, 7168, block_scaled=True, tile_tokens=16, num_sms=SMS)
    assert plan.tile_tokens == 16 and plan.split_k == 8
    counters = -(-(5 * 12 * 4) // 256) * 256
    scales = -(-(56 * 4 * 4) // 256) * 256
    assert plan.scratch_bytes == scales + counters + 40 * 2 * 16 * 128 * 4
    # Enough tiles for the blocks: the cap does not bind (56 tiles, about 5 pieces each).
    assert tiling.plan_fp8_einsum(1, 1, 7168, 7168, block_scaled=True, tile_tokens=16, num_sms=SMS).split_k == 5


def test_no_stream_k_past_32_bit_dealing():
    # The kernel deals stream-K iterations in 32-bit arithmetic: units x K groups x blocks < 2^32, else
    # whole units. One 128 x 128 tile: split while the K groups allow it, not past 2^32 / 264 of them.
    assert tiling.plan_fp8_einsum(1, 1, 128, 128 * 2**14, tile_tokens=16, num_sms=SMS).split_k > 1
    groups = 2**24
    assert groups * SMS * 2 >= 1 << 32
    assert tiling.plan_fp8_einsum(1, 1, 128, 128 * groups, tile_tokens=16, num_sms=SMS).split_k == 1


def test_einsum_decode_kernel_plan():
    # Up to 8 tokens the einsum takes the one-launch decode kernel: no split-K, no scratch.
    for m, h, n in ((1, 1, 576), (8, 128, 512), (3, 16, 1024)):
        plan = tiling.plan_fp8_einsum(m, h, n, 7168, block_scaled=True, num_sms=SMS)
        assert (plan.tile_tokens, plan.split_k, plan.scratch_bytes) == (8, 1, 0)
        assert plan.units == h * -(-n // 16)
    # Forced, it takes up to 32 tokens; more is refused naming the argument.
    assert tiling.plan_fp8_einsum(32, 1, 576, 7168, tile_tokens=8).tile_tokens == 8
    with pytest.raises(ValueError, match="'tile_tokens'=8"):
        tiling.plan_fp8_einsum(33, 1, 576, 7168, tile_tokens=8)
    # The grouped GEMM's 8-token tile is its f16-MMA kernel (not the einsum's decode kernel): e4m3 is refused.
    assert tiling.plan_grouped_gemm(64, 32, 4096, 7168, tile_tokens=8).mma == "f16"
    with pytest.raises(ValueError, match="'tile_tokens'=8"):
        tiling.plan_grouped_gemm(64, 32, 4096, 7168, tile_tokens=8, mma="e4m3")
    assert tiling.plan_moe_up(64, 32, 2048, 7168, tile_tokens=8).mma == "f16"
    with pytest.raises(ValueError, match="'tile_tokens'=8"):
        tiling.plan_moe_up(64, 32, 2048, 7168, tile_tokens=8, mma="e4m3")


def test_moe_up_plan_fuses_up_to_its_row_threshold():
    plan = functools.partial(tiling.plan_moe_up, num_sms=SMS)
    # the fused kernel up to 64 expected rows per expert (measured 1.02x the unfused sequence at 32 / 64), the
    # composed ops above (128 rows per expert: 0.65x), unless its tile or MMA is asked for, or fused=True
    assert plan(2048, 32, 2048, 7168).kernel == "fused"
    assert plan(2049, 32, 2048, 7168).kernel == "unfused"
    assert plan(4096, 32, 2048, 7168).kernel == "unfused"
    assert plan(64, 32, 2048, 7168, rows_per_expert=100).kernel == "unfused"  # the hint decides, not M / E
    assert plan(4096, 32, 2048, 7168, tile_tokens=64).kernel == "fused"
    assert plan(4096, 32, 2048, 7168, mma="e4m3").kernel == "fused"
    assert plan(4096, 32, 2048, 7168, fused=True).kernel == "fused"
    assert plan(64, 32, 2048, 7168, fused=False).kernel == "unfused"
    with pytest.raises(ValueError, match="'fused'"):
        plan(64, 32, 2048, 7168, fused=1.0)
    with pytest.raises(ValueError, match="'tile_tokens' and 'mma'"):
        plan(64, 32, 2048, 7168, mma="f16", fused=False)


def test_grouped_gemm_plans_cutlass_from_its_row_threshold():
    plan = functools.partial(tiling.plan_grouped_gemm, num_sms=SMS, cutlass=True)
    # gate+up (K 7168) and down (K 2048): from 576 expected rows per expert (H200 sweep, tiling docstring)
    assert plan(18432, 32, 4096, 7168).kernel == "cutlass"
    assert plan(18431, 32, 4096, 7168).kernel == "native"
    assert plan(18432, 32, 7168, 2048).kernel == "cutlass"
    assert plan(18431, 32, 7168, 2048).kernel == "native"
    assert plan(16384, 32, 4096, 7168).kernel == "native"  # 512 rows per expert: this library's kernel is faster
    assert plan(64, 32, 4096, 7168, rows_per_expert=600).kernel == "cutlass"  # the hint decides, not M / E
    p = plan(32768, 32, 4096, 7168)
    assert (p.tile_tokens, p.split_k, p.experts_per_chunk) == (128, 1, 32)  # 32 x 29.4 MB of e4m3 fit in 1 GiB
    assert p.scratch_bytes == tiling.grouped_cutlass_scratch(32768, 32, 4096, 7168, 32)
    # 256 experts of gate+up: chunks of 36 experts (1 GiB / 29.4 MB)
    assert plan(8 * 32768, 256, 4096, 7168).experts_per_chunk == 36
    # a chunk's experts sit on the conversion grid's y axis: at most 65535 per chunk
    assert plan(70000 * 640, 70000, 8, 128).experts_per_chunk == 65535
    # the scratch: e4m3 weights, float32 weight and activation scales, 256 B per expert, 1 MiB of workspace
    g = 7168 // 128
    assert tiling.grouped_cutlass_scratch(32768, 32, 4096, 7168, 32) == (
        32 * 4096 * 7168 + 32 * 4096 * g * 4 + 32768 * g * 4 + 32 * 256 + (1 << 20))
    # what it cannot run stays native by default and is a named error when forced
    for kw, why in ((dict(out_bf16=False), "bfloat16"), (dict(cutlass=False), "without CUTLASS")):
        args = dict(num_sms=SMS, cutlass=True) | kw
        assert tiling.plan_grouped_gemm(32768, 32, 4096, 7168, **args).kernel == "native"
        with pytest.raises(ValueError, match=f"'kernel'='cutlass'.*{why}"):
            tiling.plan_grouped_gemm(32768, 32, 4096, 7168, kernel="cutlass", **args)
    assert plan(32768, 32, 4092, 7168).kernel == "native"  # N not a multiple of 8
    # forcing this library's kernels keeps them
    assert plan(32768, 32, 4096, 7168, kernel="native").kernel == "native"
    assert plan(32768, 32, 4096, 7168, tile_tokens=64).kernel == "native"
    assert plan(1, 32, 4096, 7168, kernel="cutlass").kernel == "cutlass"
    with pytest.raises(ValueError, match="'kernel'"):
        plan(32768, 32, 4096, 7168, kernel="cublas")
    with pytest.raises(ValueError, match="'tile_tokens'"):
        plan(32768, 32, 4096, 7168, kernel="cutlass", tile_tokens=128)


def _cuda_module():
    try:
        import jax_w4a8._lib._ffi_cuda as mod  # noqa: PLC0415 - loads without a GPU (no CUDA call at import)
    except ImportError:
        pytest.skip("the CUDA handlers are not built")
    return mod


def _shapes(rng, count):
    for _ in range(count):
        m = int(np.exp(rng.uniform(0, np.log(40000))))
        k = 128 * int(rng.integers(1, 130))
        n = int(rng.choice([8, 120, 128, 576, 1536, 2048, 4096, 7168])) + int(rng.choice([0, 0, 8, 13]))
        yield m, n, k


def test_plans_hold_the_scratch_the_cuda_handlers_check():
    # The planner mirrors the scratch sizes of ffi/cuda (the handlers refuse a smaller scratch output): compare
    # every plan family with the C++ functions the handlers check, through the built CUDA module.
    mod = _cuda_module()
    rng = np.random.default_rng(7)
    for m, n, k in _shapes(rng, 1500):
        e = int(rng.choice([1, 8, 32, 256]))
        choices = [{}, {"tile_tokens": int(rng.choice([8, 16, 32]))}, {"tile_tokens": int(rng.choice([64, 128]))},
                   {"mma": "e4m3"}, {"mma": "f16", "tile_tokens": int(rng.choice([64, 128]))}]
        for kw in choices:
            for cutlass in (False, True):
                try:
                    p = tiling.plan_grouped_gemm(m, e, n, k, num_sms=SMS, cutlass=cutlass, **kw)
                except ValueError:
                    continue
                need = mod.w4a8_grouped_gemm_scratch(m, e, n, k, p.tile_tokens, p.split_k, p.mma == "f16",
                                                     p.kernel == "cutlass", p.experts_per_chunk, False)
                # exactly the need, but under stream-K: partial-sum slots for every resident block, where the
                # handler asks for one block's (the kernel's grid is cut to the slots there are)
                assert p.scratch_bytes == need if p.split_k == 1 else p.scratch_bytes >= need, (m, e, n, k, kw, p, need)
        # x_layout="folded": the 128-token e4m3 plan without the folded copy
        p = tiling.plan_grouped_gemm(m, e, n, k, num_sms=SMS, tile_tokens=128, mma="e4m3", kernel="native",
                                     x_folded=True)
        need = mod.w4a8_grouped_gemm_scratch(m, e, n, k, 128, p.split_k, False, False, 0, True)
        assert p.scratch_bytes == need if p.split_k == 1 else p.scratch_bytes >= need, (m, e, n, k, p, need)
        assert tiling.folds_activations(p)
        inter = 128 * int(rng.integers(1, 40))
        for tile in (None, 8, 16, 32, 64):
            for mma in (None, "e4m3", "f16"):
                try:
                    p = tiling.plan_moe_up(m, e, inter, k, tile_tokens=tile, mma=mma, num_sms=SMS)
                except ValueError:
                    continue
                assert p.scratch_bytes == mod.w4a8_moe_up_scratch(m, inter, k, p.mma == "f16"), (m, inter, k, p)
        h = int(rng.choice([1, 16, 128]))
        mh = max(1, m // h)
        for block_scaled in (False, True):
            for cutlass in (False, True):
                p = tiling.plan_fp8_einsum(mh, h, n, k, block_scaled=block_scaled, num_sms=SMS, cutlass=cutlass)
                need = mod.fp8_einsum_scratch(mh, h, n, k, p.tile_tokens, p.split_k, p.kernel == "cutlass", True, False)
                assert p.scratch_bytes == need if p.split_k == 1 else p.scratch_bytes >= need, (mh, h, n, k, p, need)
        mc, nc = 4 * max(1, m // 4), 16 * max(1, n // 16)  # the cuBLASLt path's shapes (one head)
        p = tiling.plan_fp8_einsum(mc, 1, nc, k, block_scaled=True, kernel="cublas", cublas=True)
        assert p.kernel == "cublas"
        assert p.scratch_bytes == mod.fp8_einsum_scratch(mc, 1, nc, k, 128, 1, False, True, True), (mc, nc, k, p)


# The fp8 einsum decode kernel's launches for DeepSeek-V3's one-token linears on 132 SMs, the linears' grids as ncu
# saw them on the H200 (grid x block threads of `profile_case.py CASE`, forty-second session, benchmarks/NOTEBOOK.md;
# q_b1's two-warp blocks on the H100 in the forty-third; absorb_q1: one wave of four-warp blocks, 4 per SM):
# (M, H, N, K) -> (warps, cluster, blocks, whole_tiles, staged)
DECODE_LAUNCHES = {
    "qkv_a1": ((1, 1, 2112, 7168), (4, 2, 264, False, False)),  # 528 blocks before the 8-warps-per-SM rule
    "q_a1": ((1, 1, 1536, 7168), (4, 4, 384, False, False)),  # 768 two-warp blocks before it
    "kv_a1": ((1, 1, 576, 7168), (4, 8, 288, False, False)),
    "q_b1": ((1, 1, 24576, 1536), (2, 1, 1536, False, False)),  # four-warp blocks before the forty-third session
    "shared_up1": ((1, 1, 4096, 7168), (4, 2, 512, False, False)),
    "shared_down1": ((1, 1, 7168, 2048), (4, 1, 448, False, False)),
    "o_proj1": ((1, 1, 7168, 16384), (4, 1, 448, False, True)),
    "absorb_q1": ((1, 128, 512, 128), (4, 1, 528, True, False)),  # 4096 tiles of one K group: one wave walks them
}


@pytest.mark.parametrize("case", sorted(DECODE_LAUNCHES))
def test_einsum_decode_launches_of_deepseek_linears(case):
    (m, h, n, k), (warps, cluster, blocks, whole_tiles, staged) = DECODE_LAUNCHES[case]
    got = _cuda_module().fp8_decode_launch(m, h, n, k // 128, SMS)
    assert got == {"warps": warps, "cluster": cluster, "blocks": blocks, "whole_tiles": whole_tiles,
                   "staged": staged}, case


def test_einsum_decode_launches_cover_the_work():
    """Any shape: split K launches tiles x cluster blocks whose warps each get at least one K group (cluster a power
    of two up to 8); whole tiles launch at most one wave; the staged kernel only at one token tile with 8 K groups
    per warp; two-warp blocks only at one token tile."""
    mod = _cuda_module()
    rng = np.random.default_rng()
    for _ in range(3000):
        m, h = int(rng.integers(1, 33)), int(rng.choice([1, 1, 2, 16, 128]))
        n, groups = int(rng.integers(1, 40000)), int(rng.integers(1, 300))
        sms = int(rng.choice([1, 78, 114, 132]))
        p = mod.fp8_decode_launch(m, h, n, groups, sms)
        tiles = h * -(-n // 16)
        where = (m, h, n, groups, sms, p)
        assert p["warps"] in ((1, 2, 3, 4) if not p["whole_tiles"] else (4,)), where
        if p["whole_tiles"]:
            assert p["cluster"] == 1 and 1 <= p["blocks"] <= sms * (4 if m <= 8 else 2), where
            assert groups < 4 and not p["staged"], where
            continue
        assert p["cluster"] in (1, 2, 4, 8) and p["blocks"] == tiles * p["cluster"], where
        assert p["warps"] == min(4, groups) or (p["warps"] == 2 and m <= 8), where
        assert p["cluster"] == 1 or p["cluster"] * p["warps"] <= groups, where
        assert not p["staged"] or (m <= 8 and groups >= 8 * p["cluster"] * p["warps"]), where


@pytest.mark.parametrize("unit_rows", tiling.DECODE_UNIT_ROWS)
def test_decode_kernel_unit_bound_holds_any_routing(unit_rows):
    """The grouped decode kernel's grid provides for decode_unit_bound(M, E, R) units of at most R rows of one
    expert: no clamped group_sizes of M rows over E experts makes more (random and adversarial ones), and the
    worst case reaches it (one row on each of min(E, M) - 1 experts, the rest on one more: the most units M rows can make)."""
    rng = np.random.default_rng()

    def units(sizes, m):
        end, total = 0, 0
        for s in sizes:
            new = min(end + min(max(s, 0), m), m)
            total += -(-(new - end) // unit_rows)
            end = new
        return total

    for m, e in [(1, 1), (8, 256), (64, 32), (5, 32), (300, 6), (1000, 4096), (4096, 256), (512, 32)]:
        bound = tiling.decode_unit_bound(m, e, unit_rows)
        busy = min(e, m)
        worst = [1] * busy + [0] * (e - busy)
        worst[busy - 1] += m - busy
        assert units(worst, m) <= bound
        for _ in range(50):
            sizes = rng.multinomial(m, rng.dirichlet(np.full(e, 0.3))).tolist()
            assert units(sizes, m) <= bound, (m, e, sizes)
        assert units([2**31 - 1] * e, m) <= bound
        assert bound - units(worst, m) <= 1, (m, e, bound)  # the worst routing reaches the bound, or one less
    assert tiling.decode_unit_bound(0, 4, unit_rows) == 1
    with pytest.raises(ValueError, match="argument 'unit_rows'"):
        tiling.decode_unit_bound(8, 4, 32)


def test_decode_unit_bound_values():
    """Exact values at the shapes that matter: batch-1 top-8 (8 rows on 8 of 256 experts) needs 8 units of
    either size; the benchmark's 256 / 512 rows over 32 experts."""
    assert [tiling.decode_unit_bound(8, 256, r) for r in (8, 16)] == [8, 8]
    assert [tiling.decode_unit_bound(256, 32, r) for r in (8, 16)] == [60, 46]  # ceil((256 + 7 * 32) / 8), ...
    assert [tiling.decode_unit_bound(512, 32, r) for r in (8, 16)] == [92, 62]


def test_decode_kernel_plan_and_its_checks():
    p = tiling.plan_grouped_gemm(8, 256, 4096, 7168, kernel="decode")
    assert (p.kernel, p.tile_tokens, p.mma, p.split_k, p.scratch_bytes) == ("decode", 8, "f16", 1, 0)
    assert p.units == 8 * 256
    assert p == tiling.plan_grouped_gemm(8, 256, 4096, 7168, kernel="decode", tile_tokens=8, mma="f16")
    # 16-row units where an expert's expected rows plus two standard deviations pass 8
    assert tiling.plan_grouped_gemm(64, 32, 4096, 7168, kernel="decode").tile_tokens == 8  # 2 rows per expert
    assert tiling.plan_grouped_gemm(4, 1, 4096, 7168, kernel="decode").tile_tokens == 8  # 4 + 2 * 2 = 8
    for m in (160, 256, 512):  # 5, 8, 16 rows per expert
        p = tiling.plan_grouped_gemm(m, 32, 4096, 7168, kernel="decode")
        assert (p.tile_tokens, p.units) == (16, tiling.decode_unit_bound(m, 32, 16) * 256), (m, p)
    assert tiling.plan_grouped_gemm(512, 32, 4096, 7168, kernel="decode", rows_per_expert=1).tile_tokens == 8
    assert tiling.plan_grouped_gemm(8, 256, 4096, 7168, kernel="decode", tile_tokens=16).tile_tokens == 16
    for bad in (dict(tile_tokens=32), dict(tile_tokens=0), dict(mma="e4m3"), dict(split_k=2)):
        with pytest.raises(ValueError, match="kernel='decode'"):
            tiling.plan_grouped_gemm(8, 256, 4096, 7168, kernel="decode", **bad)
    with pytest.raises(ValueError, match="argument 'kernel'='decode' provides for at most 65535 units of 8 rows"):
        tiling.plan_grouped_gemm(1 << 19, 256, 128, 128, kernel="decode", tile_tokens=8)
    assert tiling.plan_grouped_gemm(1 << 19, 256, 128, 128, kernel="decode").tile_tokens == 16  # fits in 16-row units
    with pytest.raises(ValueError, match="argument 'kernel'='decode' provides for at most 65535 units of 16 rows"):
        tiling.plan_grouped_gemm(1 << 20, 256, 128, 128, kernel="decode")
    with pytest.raises(ValueError, match="argument 'kernel'"):
        tiling.plan_grouped_gemm(8, 256, 4096, 7168, kernel="fast")


def test_planners_check_their_sizes():
    """Shapes and the rows hint are checked by name (they were ZeroDivisionError, 'math domain error' or a float
    plan before); M and H may be 0."""
    for call, name in ((lambda: tiling.plan_grouped_gemm(16, 0, 16, 256), "e"),
                       (lambda: tiling.plan_grouped_gemm(-1, 4, 16, 256), "m"),
                       (lambda: tiling.plan_grouped_gemm(16.5, 4, 16, 256), "m"),
                       (lambda: tiling.plan_grouped_gemm(16, 4, 16, 100), "k"),
                       (lambda: tiling.plan_grouped_gemm(16, 4, 16, 0), "k"),
                       (lambda: tiling.plan_moe_up(16, 0, 128, 256), "e"),
                       (lambda: tiling.plan_fp8_einsum(16, 1, 0, 256), "n"),
                       (lambda: tiling.plan_fp8_einsum(16, 1, 64, 200), "k"),
                       (lambda: tiling.plan_grouped_gemm(16, 4, 16, 256, rows_per_expert=-1), "rows_per_expert"),
                       (lambda: tiling.plan_grouped_gemm(16, 4, 16, 256, rows_per_expert=float("nan")),
                        "rows_per_expert"),
                       (lambda: tiling.plan_moe_up(16, 4, 128, 256, rows_per_expert=float("inf")), "rows_per_expert")):
        with pytest.raises(ValueError, match=f"argument '{name}'"):
            call()
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="argument 'num_sms'"):
            tiling.plan_grouped_gemm(16, 4, 16, 256, num_sms=bad)
    assert tiling.plan_grouped_gemm(0, 4, 16, 256).tile_tokens in tiling.GROUPED_TILE_TOKENS
    assert tiling.plan_fp8_einsum(0, 0, 64, 256).scratch_bytes >= 0
    assert tiling.plan_grouped_gemm(16, 4, 16, 256, rows_per_expert=np.float32(4.0)).tile_tokens == 8


def test_integer_options_are_checked_by_type():
    """tile_tokens, split_k and num_sms: None or an int (NumPy integers too). A float tile once passed the
    membership test (16.0 == 16) and made scratch_bytes a float, which failed inside JAX without naming it; a
    split_k on the tile-0 / CUTLASS paths was never checked; num_sms=0 passed there."""
    for fn, shape in ((tiling.plan_grouped_gemm, (64, 32, 4096, 7168)), (tiling.plan_moe_up, (64, 32, 2048, 7168)),
                      (tiling.plan_fp8_einsum, (64, 1, 4096, 7168))):
        for bad in (16.0, True, "16", -1):
            with pytest.raises(ValueError, match="argument 'tile_tokens' must be None or an int"):
                fn(*shape, tile_tokens=bad)
        for bad in (0, 132.0, False):
            with pytest.raises(ValueError, match="argument 'num_sms' must be None or an int >= 1"):
                fn(*shape, tile_tokens=0 if fn is not tiling.plan_moe_up else None, num_sms=bad)
        assert fn(*shape, tile_tokens=np.int64(16)) == fn(*shape, tile_tokens=16)
    for bad in (-5, 0, "x", 2.0):
        with pytest.raises(ValueError, match="argument 'split_k' must be None or an int >= 1"):
            tiling.plan_grouped_gemm(64, 32, 4096, 7168, tile_tokens=0, split_k=bad)
    forced = tiling.plan_grouped_gemm(64, 32, 4096, 7168, tile_tokens=16, split_k=np.int64(2))
    assert forced.split_k == 2 and isinstance(forced.scratch_bytes, int)


def test_einsum_without_heads_plans_without_dividing_by_zero():
    """An einsum of zero heads (the handler returns at once) has no work: it once raised ZeroDivisionError in the
    ragged-wave test, for every impl (the plan is made before dispatch); now a plan without split or scratch."""
    for m, tile in ((9, None), (0, 16), (4096, 64)):
        plan = tiling.plan_fp8_einsum(m, 0, 4096, 7168, tile_tokens=tile, cutlass=False)
        assert plan.split_k == 1 and plan.scratch_bytes == 0


def test_folded_plans_run_the_folding_kernel():
    p = tiling.plan_grouped_gemm(64, 8, 256, 512, tile_tokens=128, mma="e4m3", x_folded=True)
    assert tiling.folds_activations(p)
    standard = tiling.plan_grouped_gemm(64, 8, 256, 512, tile_tokens=128, mma="e4m3")
    assert standard.scratch_bytes - p.scratch_bytes >= 64 * 512  # no folded copy of the activations
    with pytest.raises(ValueError, match="x_folded"):
        tiling.plan_grouped_gemm(64, 8, 256, 512, x_folded=True)  # the plan's own tile (not 128 here)


def test_grouped_gemm_layout_is_folded_where_the_plan_folds():
    """Users pick the quantizer's layout for a grouped GEMM's static shapes: folded where the plan runs the
    128-token e4m3 kernel (prefill), standard at decode sizes; a hint plans the expected rows, not the buffer."""
    assert tiling.grouped_gemm_layout(16384, 32, 4096, 7168) == "folded"
    assert tiling.grouped_gemm_layout(4096, 32, 7168, 2048) == "folded"
    assert tiling.grouped_gemm_layout(64, 32, 4096, 7168) == "standard"
    assert tiling.grouped_gemm_layout(512, 32, 4096, 7168) == "standard"
    assert tiling.grouped_gemm_layout(8 * 512, 32, 4096, 7168, rows_per_expert=2) == "standard"
    assert tiling.grouped_gemm_layout(8 * 4096, 32, 4096, 7168, rows_per_expert=128) == "folded"
    # From 576 rows per expert bf16 output takes CUTLASS's kernel where built with it; float32 output (which it does
    # not write) keeps the folding one
    assert tiling.grouped_gemm_layout(32768, 32, 4096, 7168, out_bf16=False) == "folded"
    assert tiling.grouped_gemm_layout(32768, 32, 4096, 7168) == ("standard" if _ffi.built_with_cutlass() else "folded")
    with pytest.raises(ValueError, match="'m'"):
        tiling.grouped_gemm_layout(-1, 32, 4096, 7168)
    with pytest.raises(ValueError, match="'rows_per_expert'"):
        tiling.grouped_gemm_layout(64, 32, 4096, 7168, rows_per_expert=float("nan"))
