"""Rebuilds the embedded default checkpoint of ``python -m jax_w4a8`` (this folder).

    PYTHONPATH=. python jax_w4a8/models/deepseek/assets/make_default.py

Writes, next to this file, into ``default/``:

* ``tokenizer.json``: a byte-level BPE trained (``tokenizers``) on the short text below, with DeepSeek's
  special tokens ``<｜begin▁of▁sentence｜>`` (0, BOS), ``<｜end▁of▁sentence｜>`` (1, EOS), ``<｜User｜>`` and
  ``<｜Assistant｜>``; the post-processor prepends BOS.
* ``tokenizer_config.json``: BOS / EOS names and a DeepSeek-V3-style ``chat_template``.
* ``config.json`` + ``model.safetensors``: a 2-layer DeepSeek-V3 model with **random** weights (bf16) whose
  widths are multiples of 128 where the W4A8 / FP8 ops need it (hidden 256, MoE intermediate 128,
  kv_lora_rank 128, qk_nope 128, v_head 128, qk_rope 64), 2 heads, 8 routed experts (top-2 of 2 groups),
  1 shared expert, the first layer dense, YaRN RoPE as in V3. The vocabulary is the tokenizer's.
* ``generation_config.json``: BOS / EOS ids.

Deterministic: the same versions give the same files.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "default")

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")

CORPUS = """\
jax_w4a8 runs DeepSeek-style mixture-of-experts models in JAX with int4 weights and fp8 activations.
The experts of a DeepSeek-V3 layer are multiplied by a grouped GEMM: rows are sorted by expert, each
expert owns a contiguous run of rows, and the kernel reads packed int4 weights with one scale per group of
128 input channels. Activations are quantized to fp8 e4m3 per token and per group of 128 channels.
The attention is multi-head latent attention. Each token is compressed into a latent vector of 512 values
and a shared rotary key of 64 values; the cache keeps only those 576 numbers per token and per layer.
During decoding the query is absorbed into the latent space, attention runs over the cached latents, and
the value projection is applied afterwards. Prefill uses the expanded form and writes the latents.
The router scores every expert with a sigmoid, adds a correction bias to choose, keeps the best groups,
and takes the top eight experts of the remaining groups. The weights of the chosen experts come from the
unbiased scores, normalized and multiplied by the routed scaling factor. A shared expert is always added.
RMSNorm computes its statistics in float32, casts back to the input dtype, and then multiplies by the
weight. Rotary embeddings use YaRN: low frequencies are interpolated, high frequencies are kept.
Sampling is greedy when the temperature is zero. Otherwise the logits are divided by the temperature,
filtered by top-k and top-p, and a token is drawn with a key derived from the seed and the step.
Hello! How are you today? I am a small random model, so my answers will not make any sense.
What is the capital of France? Paris is the capital of France. What is two plus two? Two plus two is four.
Please explain quantization in one sentence. Quantization stores numbers with fewer bits and a scale.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Write a short poem about the sea. The sea is wide and grey and deep; it sings the sailors all to sleep.
Tell me a story. Once upon a time there was a tiny model that lived inside a Python package.
It had two layers, eight experts and a vocabulary learned from a few paragraphs of text.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 7168 0.5 1e-6 3.14159.
Code: def main(argv=None) -> int: return 0   import jax.numpy as jnp   x = jnp.zeros((4, 128))
"""


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, min_frequency=2, special_tokens=[BOS, EOS, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 0)])
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    return tok


def main() -> int:
    sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..", "..", "..")))
    import jax.numpy as jnp
    from flax import nnx

    from jax_w4a8.models.deepseek import DeepseekConfig, DeepseekV3ForCausalLM, save_checkpoint

    os.makedirs(OUT, exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.get_vocab_size()
    tok.save(os.path.join(OUT, "tokenizer.json"))
    with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                   "pad_token": EOS, "add_bos_token": True, "add_eos_token": False,
                   "model_max_length": 1024, "chat_template": CHAT_TEMPLATE}, f, indent=2, ensure_ascii=False)
    with open(os.path.join(OUT, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, f, indent=2)

    cfg = DeepseekConfig.from_dict({
        "vocab_size": vocab, "hidden_size": 256, "intermediate_size": 384, "moe_intermediate_size": 128,
        "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    })
    model = DeepseekV3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(20261130))
    save_checkpoint(model, OUT)
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"wrote {OUT}: vocab {vocab}, {total / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
