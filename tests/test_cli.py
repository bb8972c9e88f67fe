"""The generate CLI: ``python -m jax_w4a8`` end to end on the embedded default (CPU), options, chat templates."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from jax_w4a8 import generate as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    return env


def test_main_job_on_the_embedded_default():
    """``python -m jax_w4a8`` (what scripts/main.sh runs): random-weight warning, W4A8 model, streamed text, and
    the closing throughput line."""
    r = subprocess.run([sys.executable, "-m", "jax_w4a8", "--max-new-tokens", "12"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    print(out)
    assert "RANDOM weights" in out
    assert "experts W4A8" in out and "linears FP8 blocks" in out
    assert "chat template" in out and "<｜Assistant｜>" in out
    assert ">>> " in out
    m = re.search(r"prefill: (\d+) tokens in [\d.]+ ms \(([\d,]+) tokens/s\) \| decode: (\d+) tokens in [\d.]+ s "
                  r"\(([\d,.]+) tokens/s, [\d.]+ ms/step\)", out)
    assert m, out
    assert int(m.group(1)) > 0 and 0 < int(m.group(3)) <= 11
    assert "loading default" in r.stderr          # the progress bar


def test_help_names_the_options():
    r = subprocess.run([sys.executable, "-m", "jax_w4a8", "--help"], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0
    for opt in ("--checkpoint", "--prompt", "--max-new-tokens", "--quantize", "--temperature", "--top-p",
                "--attention", "--moe-up"):
        assert opt in r.stdout


def test_moe_up_fused_runs_and_needs_a_bf16_model(capsys):
    """--moe-up fused on the embedded default (W4A8 experts; off Hopper the fused op composes the same ops), and
    refused with the reason for a float32 model, before anything runs."""
    assert cli.main(["--max-new-tokens", "3", "--moe-up", "fused"]) == 0
    assert re.search(r"decode: \d+ tokens", capsys.readouterr().out)
    assert cli.main(["--max-new-tokens", "2", "--moe-up", "fused", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "--moe-up" in err and "bf16" in err


def test_one_new_token_closing_line_has_no_nan(capsys):
    """--max-new-tokens 1: the token comes from the prefill logits and no decode step runs; the closing line says
    so instead of "decode: 0 tokens in 0.000 s (0.0 tokens/s, nan ms/step)"."""
    assert cli.main(["--max-new-tokens", "1"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("prefill:"))
    assert "nan" not in line.lower(), line
    assert re.fullmatch(r"prefill: \d+ tokens in [\d.]+ ms \([\d,]+ tokens/s\) \| decode: no steps \(the one new "
                        r"token came from the prefill\) \| stopped at (EOS|max 1 tokens) \| compilation [\d.]+ s "
                        r"\(excluded\)", line), line


def test_checkpoint_dir_without_chat_template_fp8_sampling(tmp_path, capsys):
    """A checkpoint directory given with --checkpoint: no tokenizer_config.json (raw prompt + BOS from the
    tokenizer's post-processor), FP8 quantization on load, sampling, --attention auto (eager without a GPU)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(cli.DEFAULT_CHECKPOINT, ckpt)
    os.remove(ckpt / "tokenizer_config.json")
    rc = cli.main(["--checkpoint", str(ckpt), "--prompt", "Hello", "--quantize", "fp8", "--temperature", "0.8",
                   "--top-p", "0.9", "--max-new-tokens", "5", "--seed", "3", "--check-finite", "--attention", "auto"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "prefill attention auto" in out
    assert "RANDOM" not in out and "chat template" not in out
    assert "experts FP8 blocks" in out
    assert re.search(r"decode: \d+ tokens", out)


def test_missing_tokenizer_is_a_clear_error(capsys):
    rc = cli.main(["--checkpoint", os.path.join(GOLDEN, "yarn_qlora"), "--max-new-tokens", "2"])
    assert rc == 2
    assert "tokenizer.json" in capsys.readouterr().err


def test_missing_config_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "tokenizer.json").write_text("{}")
    rc = cli.main(["--checkpoint", str(tmp_path), "--max-new-tokens", "2"])
    assert rc == 2
    assert "config.json not found" in capsys.readouterr().err


@pytest.mark.parametrize("args, what", [(["--temperature", "-1"], "--temperature"),
                                        (["--temperature", "nan"], "--temperature"),
                                        (["--top-p", "2"], "--top-p"), (["--top-p", "0"], "--top-p"),
                                        (["--top-p", "nan"], "--top-p"), (["--top-k", "0"], "--top-k"),
                                        (["--seed", "99999999999999999999"], "--seed"),
                                        (["--seed", "-1"], "--seed"), (["--seed", str(2**63)], "--seed"),
                                        (["--checkpoint", "/nonexistent/dir"], "no such directory")])
def test_bad_options_fail_before_any_model_loads(args, what, capsys, monkeypatch):
    """Sampling settings and the checkpoint path are argparse errors (exit 2, usage line), raised before the
    model loads: loading is made to fail loudly here, so a late check would show up as that error instead."""
    import jax_w4a8.models.deepseek as ds

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(ds, "load_checkpoint", no_load)
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    assert what in capsys.readouterr().err


DEEPSEEK_V3_TEMPLATE = ("{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
                        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                        "{{'<｜User｜>' + message['content']}}{% endif %}{% endfor %}"
                        "{% if add_generation_prompt %}{{'<｜Assistant｜>'}}{% endif %}")
R1_TEMPLATE = DEEPSEEK_V3_TEMPLATE.replace("{{'<｜Assistant｜>'}}", "{{'<｜Assistant｜><think>\\n'}}")
BOS = "<｜begin▁of▁sentence｜>"


def test_chat_template_fallback_formats(monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)          # force the fallback
    msgs = [{"role": "user", "content": "Hi"}]
    assert cli.render_chat_template(DEEPSEEK_V3_TEMPLATE, msgs, bos_token=BOS) == (
        BOS + "<｜User｜>Hi<｜Assistant｜>", "fallback")
    assert cli.render_chat_template(R1_TEMPLATE, msgs, bos_token=BOS) == (
        BOS + "<｜User｜>Hi<｜Assistant｜><think>\n", "fallback")
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}...{% endfor %}"
    assert cli.render_chat_template(chatml, msgs) == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                                                      "fallback")
    assert cli.render_chat_template("{{ messages }}", msgs) == ("Hi", "raw")


def test_chat_template_jinja_agrees_with_fallback(monkeypatch):
    pytest.importorskip("jinja2")
    import json

    with open(os.path.join(cli.DEFAULT_CHECKPOINT, "tokenizer_config.json"), encoding="utf-8") as f:
        template = json.load(f)["chat_template"]
    msgs = [{"role": "user", "content": "Hi there"}]
    got, how = cli.render_chat_template(template, msgs, bos_token=BOS, eos_token="<｜end▁of▁sentence｜>")
    assert how == "jinja2"
    monkeypatch.setitem(sys.modules, "jinja2", None)
    assert cli.render_chat_template(template, msgs, bos_token=BOS)[0] == got


def test_chat_template_loop_controls_and_date_as_transformers():
    """Templates may use ``{% break %}`` / ``{% continue %}`` and ``strftime_now`` (transformers' chat-template
    environment has both; without them jinja2 refused the template)."""
    pytest.importorskip("jinja2")
    import datetime

    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}{{ m['content'] }}"
                "{% if m['content'] == 'stop' %}{% break %}{% endif %}|{% endfor %}{{ strftime_now('%Y') }}")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "user", "content": "stop"}, {"role": "user", "content": "b"}]
    year = datetime.datetime.now().strftime("%Y")
    assert cli.render_chat_template(template, msgs) == (f"a|stop{year}", "jinja2")


def test_greedy_says_top_k_and_top_p_are_ignored(capsys):
    """At temperature 0 (greedy) the filters change nothing: the CLI says so instead of listing them as in use."""
    assert cli.main(["--max-new-tokens", "1", "--top-k", "5", "--top-p", "0.5"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("prompt:"))
    assert "(greedy; --top-k / --top-p ignored" in line and "top-k 5" not in line, line


def test_non_finite_logits_end_with_an_error_line(tmp_path, capsys):
    """--check-finite on a checkpoint whose final norm is NaN: exit status 1 and an ``error:`` line naming the
    step, not a traceback."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(cli.DEFAULT_CHECKPOINT, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.norm.weight"] = np.full_like(tensors["model.norm.weight"], np.nan)
    save_file(tensors, str(ckpt / "model.safetensors"))
    rc = cli.main(["--checkpoint", str(ckpt), "--max-new-tokens", "3", "--check-finite"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "error: generate: non-finite logits at step 0" in err and "Traceback" not in err, err


def test_text_stream_holds_back_partial_utf8():
    class ByteTok:          # decodes ids as bytes, like a byte-level BPE with one byte per token
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    class Out:
        def __init__(self):
            self.parts = []

        def write(self, s):
            self.parts.append(s)

        def flush(self):
            pass

    out = Out()
    s = cli.TextStream(ByteTok(), out)
    for b in "aé€".encode():
        s([b], [True])
    s([0x41], [False])                 # an inactive row is ignored
    s.close()
    assert "".join(out.parts) == "aé€\n"
    assert all("\ufffd" not in p for p in out.parts)


def test_bench_generate_tiny_runs(tmp_path, monkeypatch):
    """benchmarks/bench_generate.py --tiny (the H200 benchmark's CPU smoke test): both CPU variants measured; the
    decode trace runs too (a CPU backend records no device kernels: an empty breakdown)."""
    import json

    bench = _load_bench("bench_generate")
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # --trace-steps adds a flag: undone after
    assert bench.main(["--tiny", "--layers", "1", "--prefill", "16", "--batches", "2", "--trace-steps", "1",
                       "--trace-prefill", "--attention", "auto", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "generate.json").read_text())
    assert payload["args"]["attention"] == "auto"
    got = {(r["model"], r["phase"]): r for r in payload["rows"]}
    assert set(got) == {("w4a8", "prefill"), ("w4a8", "decode"), ("bf16_ragged_dot", "prefill"),
                        ("bf16_ragged_dot", "decode")}
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in got.values()), payload["rows"]
    assert payload["summary"] and "w4a8 / best bf16" in payload["summary"][0]
    assert got[("w4a8", "decode")]["trace"] == {"busy_us": 0.0, "span_us": 0.0, "kernels": []}
    assert got[("w4a8", "prefill")]["trace"] == {"busy_us": 0.0, "span_us": 0.0, "kernels": []}
    assert "--xla_enable_command_buffers_during_profiling=true" in os.environ["XLA_FLAGS"]


def test_bench_generate_moe_up_runs_each_setting_on_the_same_weights(tmp_path):
    """bench_generate.py --moe-up unfused fused: one w4a8 model, a row per setting; float32 activation scales
    unless --ue8m0 (the fused kernel forms both kinds)."""
    import json

    bench = _load_bench("bench_generate")
    assert bench.main(["--tiny", "--layers", "1", "--variants", "w4a8", "--moe-up", "unfused", "fused",
                       "--prefill", "16", "--batches", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate.json").read_text())["rows"]
    assert sorted((r["model"], r["phase"]) for r in rows) == [
        ("w4a8-fused-up", "decode"), ("w4a8-fused-up", "prefill"), ("w4a8-unfused-up", "decode"),
        ("w4a8-unfused-up", "prefill")]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows


def _load_bench(name):
    """The script benchmarks/NAME.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _one_call_timing(monkeypatch, C):
    """The benchmarks' timing helpers (module _common as ``C``) for CPU tests: each measurement one real call of
    its function (100 us reported), fixed copy bandwidth (1 TB/s) and harness floor."""
    import jax

    def one_call(fn, arg_sets, **_):
        jax.block_until_ready(fn(*arg_sets[0]))
        return 1e-4

    monkeypatch.setattr(C, "bench", one_call)
    monkeypatch.setattr(C, "copy_bandwidth", lambda: (1e12, {"xla": 1e12}))
    monkeypatch.setattr(C, "harness_floor", lambda: 2e-6)


def test_bench_generate_expert_parallel_makes_sharded_weights(tmp_path):
    """--expert-parallel N: weights are made straight into their shardings and the model runs EP."""
    import json

    import jax.numpy as jnp

    from jax_w4a8 import sharding
    from jax_w4a8.models.deepseek import QuantConfig

    bench = _load_bench("bench_generate")
    cfg = bench.v3_config(1, 0, tiny=True)
    mesh = sharding.make_mesh(4)
    model = bench.random_model(cfg, QuantConfig.w4a8(), jnp.float32, mesh)
    experts = model.model.layers[0].mlp.experts
    for v in (experts.gate_up_proj, experts.down_proj):
        arr = v[...]
        assert arr.sharding.spec[0] == sharding.EXPERT_AXIS and len(arr.sharding.device_set) == 4
        assert arr.addressable_shards[0].data.shape[0] == cfg.n_routed_experts // 4
    assert model.model.layers[0].mlp.expert_parallel.size == 4
    emb = model.model.embed_tokens.weight[...]
    assert len(emb.sharding.device_set) == 4 and emb.sharding.is_fully_replicated
    del model

    assert bench.main(["--tiny", "--layers", "1", "--prefill", "16", "--batches", "2", "--variants", "w4a8",
                       "--expert-parallel", "4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate.json").read_text())["rows"]
    assert {(r["model"], r["phase"]) for r in rows} == {("w4a8@ep4", "prefill"), ("w4a8@ep4", "decode")}
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows


def test_bench_grouped_gemm_keeps_rows_of_a_run_stopped_early(tmp_path, monkeypatch):
    """benchmarks/bench_grouped_gemm.py rewrites its JSON after every row ("complete": false until the last), so a
    run killed by a device call's time limit keeps its measured rows, and --report says it stopped early. Small
    shapes on the CPU handler; the timing loop is one real call per measurement."""
    import argparse
    import json

    bench = _load_bench("bench_grouped_gemm")
    C = bench.C
    _one_call_timing(monkeypatch, C)
    monkeypatch.setattr(bench, "SHAPES", {"down": (256, 256)})
    monkeypatch.setattr(C, "RESULTS", tmp_path / "RESULTS.md")
    monkeypatch.setattr(C, "HERE", tmp_path)
    args = argparse.Namespace(ms=[16, 40], quick=False, no_torch=True, x_scales="ue8m0", peers="none", tiles=[])
    out = tmp_path / "grouped_gemm.json"
    seen = []

    def on_row(partial):
        seen.append((len(partial["rows"]), partial["complete"]))
        C.save_json(out, partial)

    final = bench.run(args, on_row=on_row)
    assert seen == [(1, False), (2, False)]
    assert final["complete"] is True and [r["M"] for r in final["rows"]] == [16, 40]
    assert all(r["rel_err_vs_simple"] < 1e-2 and r["ours_us"] == 100.0 for r in final["rows"]), final["rows"]
    stopped = json.loads(out.read_text())  # what a run killed after its second row leaves
    assert not (tmp_path / "grouped_gemm.json.tmp").exists()  # written aside, then renamed over the file
    assert stopped["complete"] is False and len(stopped["rows"]) == 2 and stopped["build"]
    stopped["rows"] = stopped["rows"][:1]
    bench.report(stopped, None)
    section = (tmp_path / "RESULTS.md").read_text()
    assert "(stopped early: 1 rows measured)" in section and "| down | 16 | uniform |" in section, section
    bench.report(dict(stopped, complete=True), None)
    assert "stopped early" not in (tmp_path / "RESULTS.md").read_text()


def test_bench_reports_of_an_h100_run_keep_the_h200_tables(tmp_path, monkeypatch):
    """The targets are the H200's: a report of a run on an H100 goes to its own RESULTS.md section (and the grouped
    GEMM's plot to grouped_gemm_h100.png), never over the H200's table; the grouped GEMM's folded-layout time
    gets its column (us and TFLOP/s over the same routed rows)."""
    gg = _load_bench("bench_grouped_gemm")
    ein = _load_bench("bench_fp8_einsum")
    C = gg.C
    assert ein.C is C
    monkeypatch.setattr(C, "RESULTS", tmp_path / "RESULTS.md")
    monkeypatch.setattr(C, "HERE", tmp_path)
    monkeypatch.setattr(gg, "save_plot", lambda payload, path: path.write_text("png"))
    row = {"shape": "gate_up", "M": 4096, "routing": "uniform", "plan": "t128/s1", "ours_us": 500.0, "TFLOPs": 480.0,
           "weight_GBps": 900.0, "frac_copy_bw": 0.3, "rel_err_vs_simple": 1e-4, "folded_us": 400.0,
           "folded_bitwise_equal": True}
    base = {"rows": [row], "copy_bw": 3.0e12, "date": "2026-12-07", "jax": "0", "complete": True}
    gg.report(dict(base, device="NVIDIA H200"), None)
    gg.report(dict(base, device="NVIDIA H100 80GB HBM3", copy_bw=3.03e12), None)
    text = (tmp_path / "RESULTS.md").read_text()
    h200, h100 = text.split("## W4A8 grouped GEMM (one EP8 shard of DeepSeek-R1)\n")[1].split(
        "## W4A8 grouped GEMM (one EP8 shard of DeepSeek-R1) on an H100\n")
    assert "on NVIDIA H200 " in h200 and "H100" not in h200 and "![grouped GEMM](grouped_gemm.png)" in h200
    assert "on NVIDIA H100 80GB HBM3 " in h100 and "![grouped GEMM](grouped_gemm_h100.png)" in h100
    assert "this H100 run has about 3.03 TB/s" in h100
    assert "| 400.0 (600) |" in h100  # 480 TFLOP/s at 500 us -> 600 at 400 us
    assert (tmp_path / "grouped_gemm.png").exists() and (tmp_path / "grouped_gemm_h100.png").exists()
    assert "folded layout 400.0 us 600 TFLOP/s" in gg.fmt_row(row)
    gg.report(dict(base, device="NVIDIA H100 80GB HBM3", rows=[dict(row, folded_bitwise_equal=False)]), None)
    assert "NOT bit for bit" in (tmp_path / "RESULTS.md").read_text()
    # other cards get sections of their own too; a GH200 is not the targets' H200
    assert C.results_section("X", {"device": "NVIDIA B200"}) == "X on NVIDIA B200"
    assert C.results_section("X", {"device": "NVIDIA GH200 480GB"}) == "X on NVIDIA GH200 480GB"
    assert C.results_section("X", {"device": "NVIDIA H200 NVL"}) == "X" == C.results_section("X", {})
    assert C.results_suffix({"device": "NVIDIA B200"}) == "_nvidia_b200"
    # the einsum's likewise
    erow = {"case": "square", "eq": "md,nd->mn", "M": 4096, "N": 7168, "K": 7168, "plan": "cutlass", "ours_us": 350.0,
            "TFLOPs": 1200.0, "weight_GBps": 140.0, "frac_copy_bw": 0.05}
    ein.report({"rows": [erow], "copy_bw": 4.3e12, "device": "NVIDIA H200", "complete": True})
    ein.report({"rows": [dict(erow, ours_us=360.0)], "copy_bw": 3.03e12, "device": "NVIDIA H100 80GB HBM3",
                "complete": True})
    text = (tmp_path / "RESULTS.md").read_text()
    head = "## FP8 block-scaled einsum (DeepSeek-V3 linears, per-head products)"
    assert f"{head}\n" in text and f"{head} on an H100\n" in text
    assert "| 350.0 |" in text.split(f"{head}\n")[1].split("\n## ")[0]
    assert "| 360.0 |" in text.split(f"{head} on an H100\n")[1]


def test_bench_grouped_gemm_trace_kernels_reports_each_kernel_family_per_call(tmp_path, monkeypatch):
    """--trace-kernels traces a row's timing loop once and records each kernel family's time per call, the busy time and
    the span (what fmt_row prints after the row). On the CPU backend the profiler records no device kernels: the
    row says so with an empty list, and a recorded trace (two calls of two kernels, one family per kernel) is
    divided by the loop's calls."""
    import argparse

    bench = _load_bench("bench_grouped_gemm")
    C = bench.C
    _one_call_timing(monkeypatch, C)
    monkeypatch.setattr(bench, "SHAPES", {"down": (256, 256)})
    args = argparse.Namespace(ms=[16], quick=False, no_torch=True, x_scales="ue8m0", peers="none", tiles=[],
                              trace_kernels=True)
    (row,) = bench.run(args)["rows"]
    assert row["trace_kernels"] == [] and row["trace_busy_us"] == 0.0
    assert "kernels per call" not in bench.fmt_row(row)
    assert set(bench.kernel_times(row)) == {"decode8", "decode16"}  # the other kernels' timings: not the trace's
    stream = (1, 7)
    trace = [(stream, "void (anonymous namespace)::PrepareFoldHeldKernel<16>(const void*)", 0.0, 30.0),
             (stream, "void (anonymous namespace)::HopperGemmKernel<128, true>(KernelArgs)", 31.0, 400.0),
             (stream, "void (anonymous namespace)::PrepareFoldHeldKernel<16>(const void*)", 500.0, 34.0),
             (stream, "void (anonymous namespace)::HopperGemmKernel<128, true>(KernelArgs)", 535.0, 410.0)]
    monkeypatch.setattr(C, "trace_kernels", lambda thunk: trace)
    monkeypatch.setattr(C, "_device_loop", lambda fn, sets, n, min_s, max_n: ((lambda: 0.0), 2))
    (row,) = bench.run(args)["rows"]
    assert [(k["family"], k["count"], k["us"]) for k in row["trace_kernels"]] == [
        ("HopperGemmKernel", 1.0, 405.0), ("PrepareFoldHeldKernel", 1.0, 32.0)]
    assert row["trace_busy_us"] == pytest.approx(437.0) and row["trace_span_us"] == pytest.approx(472.5)
    assert set(bench.kernel_times(row)) == {"decode8", "decode16"}
    line = bench.fmt_row(row)
    assert line.endswith(" | kernels per call: HopperGemmKernel 405.0 us, PrepareFoldHeldKernel 32.0 us "
                         "(busy 437.0 of 472.5 us)"), line
    assert "busy kernel" not in line and "span kernel" not in line


def test_bench_fp8_einsum_keeps_rows_of_a_run_stopped_early(tmp_path, monkeypatch):
    """benchmarks/bench_fp8_einsum.py, likewise: a row handed on after each measurement, "complete" only at the end,
    and --report's note for a run stopped early. One small linear on the CPU handler, plus the quantizer's row."""
    import argparse

    bench = _load_bench("bench_fp8_einsum")
    C = bench.C
    _one_call_timing(monkeypatch, C)
    monkeypatch.setattr(bench, "LINEARS", {"q_a": (256, 384)})
    monkeypatch.setattr(bench, "MS_QUICK", [1, 16])
    monkeypatch.setattr(bench, "PER_HEAD", {})
    monkeypatch.setattr(bench, "ROTATE_BYTES", 0)  # two weight sets, one quantizer input: quick on the CPU
    monkeypatch.setattr(C, "RESULTS", tmp_path / "RESULTS.md")
    seen = []
    final = bench.run(argparse.Namespace(quick=True, peers="none"),
                      on_row=lambda p: seen.append((len(p["rows"]), p["complete"])))
    assert seen == [(1, False), (2, False), (3, False)]
    assert final["complete"] is True
    assert [(r["case"], r["M"]) for r in final["rows"]] == [("q_a", 1), ("q_a", 16), ("quantizer", 16384)]
    assert all(r["rel_err_vs_simple"] < 1e-2 for r in final["rows"]), final["rows"]
    bench.report(dict(final, rows=final["rows"][:2], complete=False))
    assert "(stopped early: 2 rows measured)" in (tmp_path / "RESULTS.md").read_text()
    # with peers: XLA fp8's ratio is to ours timed beside it in interleaved rounds (real loops here), the other
    # peers' to ours of the row
    monkeypatch.setattr(bench, "MS_QUICK", [16])
    row = bench.run(argparse.Namespace(quick=True, peers="all"))["rows"][0]
    assert row["ours_us"] == 100.0 and row["ours_us_beside_xla_fp8"] > 0 and row["xla_fp8_per_tensor_us"] > 0
    assert row["x_xla_fp8_per_tensor"] == pytest.approx(row["xla_fp8_per_tensor_us"] / row["ours_us_beside_xla_fp8"])
    assert row["x_xla_bf16"] == pytest.approx(row["xla_bf16_us"] / 100.0)
    interleaved = "XLA fp8's over ours timed in interleaved rounds"
    assert interleaved not in (tmp_path / "RESULTS.md").read_text()  # the --peers none report above
    bench.report(dict(final, rows=[row]))
    assert interleaved in (tmp_path / "RESULTS.md").read_text()


def test_bench_grouped_gemm_counts_the_int4_bytes_of_experts_with_rows(tmp_path, monkeypatch):
    """The grouped GEMM's weight GB/s and fraction of copy bandwidth count the int4 bytes (N*K/2 per expert,
    scales excluded) of the experts that receive rows: an expert without rows has no weights to read (the kernels
    map rows to experts), and at 64 rows over 32 experts multinomial routing leaves about 5 of them empty.
    TFLOP/s: 2*M*N*K over the routed rows; the plot's read floor likewise."""
    import argparse

    import numpy as np

    bench = _load_bench("bench_grouped_gemm")
    C = bench.C
    _one_call_timing(monkeypatch, C)  # 100 us per call, copy bandwidth 1 TB/s
    n, k = 256, 256
    monkeypatch.setattr(bench, "SHAPES", {"down": (n, k)})
    busy = 8  # experts 0..7 take all rows, the other 24 none
    monkeypatch.setattr(bench, "sizes_for", lambda m, routing, rng: np.array(
        [m // busy] * busy + [0] * (bench.E - busy), np.int32))
    args = argparse.Namespace(ms=[16], quick=False, no_torch=True, x_scales="ue8m0", peers="none", tiles=[])
    payload = bench.run(args)
    (r,) = payload["rows"]
    assert r["weight_GBps"] == pytest.approx(busy * n * k / 2 / 1e-4 / 1e9)
    assert r["frac_copy_bw"] == pytest.approx(busy * n * k / 2 / 1e-4 / 1e12)
    assert r["TFLOPs"] == pytest.approx(2 * 16 * n * k / 1e-4 / 1e12)
    assert r["experts_with_rows"] == busy
    assert bench.read_floor_us(r, payload["copy_bw"]) == pytest.approx(busy * n * k / 2 / 1e12 * 1e6)
    # rows of an older JSON (no experts_with_rows): every expert, as they were computed
    assert bench.read_floor_us({"N": n, "K": k}, 1e12) == pytest.approx(bench.E * n * k / 2 / 1e12 * 1e6)


def test_bench_grouped_gemm_times_folded_activations_where_the_plan_folds(tmp_path, monkeypatch):
    """Rows whose plan runs the folding kernel (prefill: 4096 rows over 32 experts) also time the call on activations
    folded beforehand (x_layout="folded"); decode rows do not. CPU handler, small shapes."""
    import argparse

    bench = _load_bench("bench_grouped_gemm")
    C = bench.C
    _one_call_timing(monkeypatch, C)
    monkeypatch.setattr(bench, "SHAPES", {"down": (256, 256)})
    args = argparse.Namespace(ms=[16, 4096], quick=False, no_torch=True, x_scales="ue8m0", peers="none", tiles=[])
    small, *big = bench.run(args)["rows"]  # M = 4096: uniform and skewed routing
    assert "folded_us" not in small and [r["M"] for r in big] == [4096, 4096]
    assert all(r["folded_us"] == 100.0 and isinstance(r["folded_bitwise_equal"], bool) for r in big), big
    args = argparse.Namespace(**dict(vars(args), ms=[4096], x_scales="f32"))  # float32 group scales: no fold
    assert not any("folded_us" in r for r in bench.run(args)["rows"])


def test_bench_fp8_einsum_xla_fp8_peer_writes_bf16_like_ours(monkeypatch):
    """The per-tensor XLA fp8 peer does the work ours does: e4m3 x e4m3 -> bf16 [M, N] with its scale applied. A
    bf16 product times a float32 scalar promotes to float32, i.e. a second pass writing twice the output bytes,
    which slowed the peer (and flattered the ratio to it)."""
    import argparse

    import jax
    import jax.numpy as jnp

    bench = _load_bench("bench_fp8_einsum")
    C = bench.C
    _one_call_timing(monkeypatch, C)
    monkeypatch.setattr(bench, "LINEARS", {"q_a": (256, 384)})
    monkeypatch.setattr(bench, "MS_QUICK", [16])
    monkeypatch.setattr(bench, "PER_HEAD", {})
    seen = {}

    def alternating(fns, **_):
        for name, (fn, sets) in fns.items():
            seen[name] = jax.eval_shape(fn, *sets[0])
        return {name: 1e-4 for name in fns}

    monkeypatch.setattr(C, "bench_alternating", alternating)
    bench.run(argparse.Namespace(quick=True, peers="all"))
    assert seen["ours"].shape == seen["xla_fp8"].shape == (16, 256)
    assert seen["ours"].dtype == seen["xla_fp8"].dtype == jnp.bfloat16


def test_bench_fp8_einsum_rotates_weights_past_the_l2(monkeypatch):
    """Every timed call of a case rotates through weight sets of at least ROTATE_BYTES together (BENCHMARKS.md:
    rotating inputs larger than L2): two sets of a small linear (kv_a: 2 x 4 MB) or one per-head weight (8 MB for
    the MLA absorb products, 64 MB for V4's wo_a) stayed in the H200's 50-60 MB L2 and flattered their GB/s."""
    import argparse

    bench = _load_bench("bench_fp8_einsum")
    C = bench.C
    _one_call_timing(monkeypatch, C)
    monkeypatch.setattr(bench, "LINEARS", {"q_a": (256, 384)})
    monkeypatch.setattr(bench, "MS_QUICK", [1])
    monkeypatch.setattr(bench, "PER_HEAD", {"tiny": (2, 128, 256)})  # H, R, D
    monkeypatch.setattr(bench, "ROTATE_BYTES", 1 << 20, raising=False)
    timed = []

    def record(fn, arg_sets, **_):
        distinct = {id(a): a.nbytes for s in arg_sets for a in s}
        timed.append(sum(distinct.values()))
        return 1e-4

    monkeypatch.setattr(C, "bench", record)
    monkeypatch.setattr(C, "bench_alternating", lambda fns, **kw: {n: record(f, s) for n, (f, s) in fns.items()})
    rows = bench.run(argparse.Namespace(quick=True, peers="all"))["rows"]
    assert [r["case"] for r in rows][:2] == ["q_a", "tiny"]
    assert timed and min(timed) >= 1 << 20, timed


def test_top_k_beyond_int32_is_no_filter(capsys):
    """--top-k larger than the vocabulary keeps every token, as in transformers, however large: 2**40 crashed with
    an OverflowError (int32) after the model loaded. The text equals that of --top-k = the vocabulary size (every
    token kept; the same compiled steps)."""
    args = ["--max-new-tokens", "3", "--temperature", "1", "--seed", "7", "--no-chat-template", "--top-k"]

    def text(k):
        assert cli.main(args + [str(k)]) == 0
        out = capsys.readouterr().out
        vocab = int(re.search(r"vocab (\d+)", out).group(1))
        return out[out.index(">>> "):].splitlines()[0], vocab

    got, vocab = text(2**40)
    assert text(vocab) == (got, vocab)
