"""Generate text with a DeepSeek-V3/R1 checkpoint: ``python -m jax_w4a8.generate`` (and ``python -m jax_w4a8``).

    python -m jax_w4a8.generate --checkpoint DIR --prompt "Why is the sky blue?" --max-new-tokens 64 \\
        [--quantize w4a8|fp8|none] [--temperature 0.7] [--top-p 0.9] [--top-k 50] [--seed 0]
    python -m jax_w4a8.generate          # the embedded default: a tiny model with RANDOM weights

``DIR`` is a HF DeepSeek-V3/R1 directory: ``config.json``, ``model.safetensors`` (or shards + index), and
``tokenizer.json`` (read with the ``tokenizers`` library). When ``tokenizer_config.json`` has a
``chat_template`` the prompt is sent as one user message through it (``--no-chat-template`` sends the raw
text); the template is rendered with jinja2 (a dependency), as transformers renders it; where jinja2 is
missing, a built-in fallback knows DeepSeek's format (``BOS <｜User｜>prompt<｜Assistant｜>``, plus ``<think>\\n``
when the template opens a think block) and ChatML, and sends the raw text for any other template (with a note).
Generation stops at the EOS ids of ``generation_config.json`` (else the tokenizer's ``eos_token``, else
``config.json``). ``--check-finite`` ends with an ``error:`` line (exit status 1) on NaN / Inf logits.

``--quantize``: ``w4a8`` (int4 routed experts, FP8 blocks for the other linears), ``fp8`` (FP8 blocks
everywhere) or ``none`` (keep the checkpoint's formats; the default with ``--checkpoint``). Without
``--checkpoint`` the embedded default is used and quantized to W4A8, so the W4A8 and FP8 kernels run.

Prints a progress bar while loading, the new tokens as they come, and a closing line with the prefill and
decode throughput (tokens/s, compilation time excluded and reported separately).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import warnings

DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "deepseek", "assets",
                                  "default")
DEFAULT_PROMPT = "Explain W4A8 quantization in one sentence."
_USER, _ASSISTANT = "<｜User｜>", "<｜Assistant｜>"


def _read_json(path):
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_str(tok):
    """A tokenizer_config special token: a string or ``{"content": ...}`` (None when absent)."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def render_chat_template(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
                         add_generation_prompt: bool = True) -> tuple[str, str]:
    """Renders a HF ``chat_template``. Returns ``(text, how)``; ``how`` is ``"jinja2"``, ``"fallback"`` or
    ``"raw"`` (no known format: the user messages joined, a note for the caller to print)."""
    try:
        import jinja2  # noqa: F401
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        jinja = None
    else:
        # as transformers renders chat templates: {% break %} / {% continue %}, and strftime_now for the date
        jinja = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=["jinja2.ext.loopcontrols"])

    if jinja is not None:
        def raise_exception(msg):
            raise ValueError(f"chat template: {msg}")

        jinja.globals["raise_exception"] = raise_exception
        jinja.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        jinja.filters.setdefault("tojson", lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw))
        text = jinja.from_string(template).render(messages=messages, bos_token=bos_token or "",
                                                  eos_token=eos_token or "",
                                                  add_generation_prompt=add_generation_prompt)
        return text, "jinja2"
    # Fallback without jinja2: DeepSeek's format (V3 / R1) and ChatML; anything else: raw text.
    if _USER in template and _ASSISTANT in template:
        out = bos_token if "bos_token" in template else ""
        for m in messages:
            if m["role"] == "system":
                out += m["content"]
            elif m["role"] == "user":
                out += _USER + m["content"]
            elif m["role"] == "assistant":
                out += _ASSISTANT + m["content"] + (eos_token or "")
        if add_generation_prompt:
            out += _ASSISTANT + ("<think>\n" if "<｜Assistant｜><think>" in template else "")
        return out, "fallback"
    if "<|im_start|>" in template:
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else ""), "fallback"
    return "\n".join(m["content"] for m in messages if m["role"] == "user"), "raw"


class TextStream:
    """``stream`` callback of :func:`generate` for row 0: decodes the tokens so far and writes the new text
    (holding back an incomplete UTF-8 character) to ``out``."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, tokens, active):
        if not active[0]:
            return
        self.ids.append(int(tokens[0]))
        self._emit(final=False)

    def _emit(self, final: bool):
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return
        if len(text) > self.printed:
            self.out.write(text[self.printed:])
            self.out.flush()
        self.printed = max(self.printed, len(text))

    def close(self):
        self._emit(final=True)
        self.out.write("\n")
        self.out.flush()


def _eos_ids(ckpt: str, tokenizer, tok_cfg: dict, cfg):
    gen_cfg = _read_json(os.path.join(ckpt, "generation_config.json"))
    eos = gen_cfg.get("eos_token_id")
    if eos is None:
        name = _token_str(tok_cfg.get("eos_token"))
        eos = tokenizer.token_to_id(name) if name else None
    if eos is None:
        eos = cfg.eos_token_id
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)


def _describe(model) -> str:
    c, q = model.cfg, model.quant
    experts = {"none": str(model.dtype), "fp8": "FP8 blocks", "w4a8": "W4A8 (int4, group 128)"}[q.experts]
    linear = {"none": str(model.dtype), "fp8": "FP8 blocks"}[q.linear]
    import jax.numpy as jnp
    from flax import nnx

    # parameters, not stored values: a packed int4 byte holds two; scales are not parameters
    n = sum(v[...].size * (2 if v[...].dtype == jnp.int8 else 1) for path, v in nnx.to_flat_state(nnx.state(model))
            if not str(path[-1]).endswith(("_scale_inv", "input_scale")))
    return (f"{c.num_hidden_layers} layers ({max(c.num_hidden_layers - c.first_k_dense_replace, 0)} MoE), "
            f"hidden {c.hidden_size}, {c.num_attention_heads} heads, {c.n_routed_experts} experts (top-"
            f"{c.num_experts_per_tok}), vocab {c.vocab_size}, {n / 1e6:.1f}M parameters; experts {experts}, "
            f"linears {linear}, activations {model.dtype}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_w4a8.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", metavar="DIR", help="HF DeepSeek-V3/R1 directory (default: the embedded "
                   "random model)")
    p.add_argument("--prompt", default=None, help=f"the prompt text (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--quantize", choices=["w4a8", "fp8", "none"], default=None,
                   help="weight formats in memory (default: none = the checkpoint's; w4a8 for the embedded "
                        "default)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="activation dtype")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument("--check-finite", action="store_true", help="stop with an error on NaN/Inf logits")
    p.add_argument("--attention", choices=["eager", "cudnn", "auto"], default=None,
                   help="prefill attention: auto (the default: cudnn where possible, else eager), eager (float32 "
                        "scores in memory, transformers' numerics) or cudnn (cuDNN's fused flash attention, bf16 "
                        "on a GPU)")
    p.add_argument("--moe-up", choices=["unfused", "fused", "auto"], default=None,
                   help="how W4A8 routed experts form the down projection's input (bf16 models): "
                        "unfused (gate+up GEMM to bf16, then SiLU-mul and quantizer), fused (one Hopper kernel) "
                        "or auto (the default: fused where it measured faster, jax_w4a8.tiling.moe_up_fuses)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    # the sampling settings are checked here, before any model loads (generate() checks them again)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_p is not None and not (0 < args.top_p <= 1):  # NaN fails the comparison too
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 1:
        p.error(f"--top-k must be >= 1, got {args.top_k}")
    if not 0 <= args.seed < 2**63:       # generate()'s range (generate.SEED_LIMIT; jax is not imported yet)
        p.error(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint}: no such directory")

    import jax
    import jax.numpy as jnp
    from tokenizers import Tokenizer

    from jax_w4a8.models.deepseek import load_checkpoint
    from jax_w4a8.models.deepseek.generate import NonFiniteLogitsError, generate

    embedded = args.checkpoint is None
    ckpt = DEFAULT_CHECKPOINT if embedded else args.checkpoint
    quantize = args.quantize or ("w4a8" if embedded else "none")
    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.platform} ({dev.device_kind})")
    if embedded:
        print("No --checkpoint given: using the embedded default, a tiny DeepSeek-V3-architecture model with "
              "RANDOM weights and a toy tokenizer. Its output is meaningless; it shows the pipeline "
              "(tokenizer, W4A8 experts, MLA latent cache, streaming) end to end.")
    for name, what in (("tokenizer.json", "a tokenizers tokenizer.json"), ("config.json", "the model's config.json")):
        if not os.path.exists(os.path.join(ckpt, name)):
            print(f"error: {os.path.join(ckpt, name)} not found (the checkpoint directory needs {what})",
                  file=sys.stderr)
            return 2
    tok_path = os.path.join(ckpt, "tokenizer.json")
    tokenizer = Tokenizer.from_file(tok_path)
    tok_cfg = _read_json(os.path.join(ckpt, "tokenizer_config.json"))
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):   # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if template and not args.no_chat_template:
        text, how = render_chat_template(template, [{"role": "user", "content": prompt}],
                                         bos_token=_token_str(tok_cfg.get("bos_token")) or "",
                                         eos_token=_token_str(tok_cfg.get("eos_token")) or "")
        if how == "raw":
            print("note: jinja2 is not installed and the chat template is not DeepSeek's or ChatML: sending the "
                  "raw prompt (pip install jinja2 to render it)")
            ids = tokenizer.encode(text).ids
        else:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            print(f"chat template ({how}): {text!r}")
    else:
        ids = tokenizer.encode(prompt).ids
    if not ids:
        print("error: the prompt encodes to no tokens", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = load_checkpoint(ckpt, quantize=None if quantize == "none" else quantize,
                                dtype=jnp.dtype(args.dtype), progress=True)
    for flag, value, choose in (("--attention", args.attention, model.set_attention),
                                ("--moe-up", args.moe_up, model.set_moe_up)):
        if value is not None:
            try:
                choose(value)
            except ValueError as e:
                print(f"error: {flag}: {e}", file=sys.stderr)
                return 2
    print(f"loaded {ckpt} in {time.perf_counter() - t0:.1f} s: {_describe(model)}; "
          f"prefill attention {model.model.layers[0].self_attn.attention}")
    eos = _eos_ids(ckpt, tokenizer, tok_cfg, model.cfg)
    bad = [i for i in ids if i >= model.cfg.vocab_size]
    if bad:
        print(f"error: the tokenizer produced id {bad[0]} >= the model's vocab_size {model.cfg.vocab_size}",
              file=sys.stderr)
        return 2
    if args.temperature == 0:   # greedy takes the most likely token: the filters change nothing
        how = "greedy" + ("; --top-k / --top-p ignored (they filter sampling: pass --temperature)"
                          if args.top_k is not None or args.top_p is not None else "")
    else:
        how = (f"temperature {args.temperature}" + (f", top-k {args.top_k}" if args.top_k is not None else "")
               + (f", top-p {args.top_p}" if args.top_p is not None else ""))
    print(f"prompt: {len(ids)} tokens; generating up to {args.max_new_tokens} ({how})")
    print("-" * 72)
    stream = TextStream(tokenizer)
    sys.stdout.write(prompt)
    sys.stdout.write("\n>>> ")
    sys.stdout.flush()
    try:
        tokens, st = generate(model, [ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, eos_token_id=eos, seed=args.seed, stream=stream,
                              check_finite=args.check_finite, return_stats=True)
    except NonFiniteLogitsError as e:   # --check-finite: the tokens so far are printed; the reason, not a traceback
        stream.close()
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    stream.close()
    print("-" * 72)
    stop = "EOS" if tokens[0] and tokens[0][-1] in eos else f"max {args.max_new_tokens} tokens"
    if st.decode_steps:
        decode = (f"decode: {st.decode_tokens} tokens in {st.decode_s:.3f} s ({st.decode_tokens_per_s:,.1f} "
                  f"tokens/s, {st.decode_step_s * 1e3:.2f} ms/step)")
    else:                   # the only new token came from the prefill logits: no rate to report
        decode = "decode: no steps (the one new token came from the prefill)"
    print(f"prefill: {st.prompt_tokens} tokens in {st.prefill_s * 1e3:.1f} ms ({st.prefill_tokens_per_s:,.0f} "
          f"tokens/s) | {decode} | stopped at {stop} | compilation {st.compile_s:.1f} s (excluded)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
