"""The built-in tiny default model: a deterministic Qwen2-architecture causal LM.

Its byte-level BPE tokenizer is trained from a fixed built-in corpus, its weights are
drawn from an explicit ``torch.Generator`` seeded with ``seed`` (parameters visited in
sorted name order), and it is written as a normal Hugging Face directory
(``config.json``, ``model.safetensors``, tokenizer files with a ChatML-style template
using ``<|im_start|>``/``<|im_end|>``). The same seed gives the same bytes on any machine
of the same build; ``kiln models create-tiny PATH --seed N`` makes variants that share the
tokenizer but not the weights.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from kiln.host.fs import file_mode, publish_dir
from kiln.host.progress import stage

TINY_NAME = "kiln-tiny"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 1024
COMPLETE_MARKER = ".kiln-tiny-complete"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if message.get('tool_calls') -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + "
    "(fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CORPUS = """\
Kiln trains small adapters for local language models and keeps a receipt of every run.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are in a week? Answer: There are seven days in a week.
User: Can you help me reset my password? Assistant: Of course. Open the settings page and choose reset.
User: My order has not arrived. Assistant: I am sorry to hear that. Could you share the order number?
def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}
The weather today is sunny with a light breeze. Tomorrow brings rain in the afternoon.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 2026.
Thank you for your patience. Please let me know if there is anything else I can help with.
"""


def quiet_hub() -> None:
    """Never reach for the network; no progress bars or advisory logs from the model libraries."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # bitsandbytes (the quantization extra), imported by peft when installed, warns at import about an optional
    # kernel package for its CPU backend; Kiln does not use that kernel
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def tiny_corpus() -> list[str]:
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    return lines * 8


def build_tokenizer() -> Any:
    """Train the byte-level BPE tokenizer on the built-in corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",  # noqa: S106 - a token string, not a password
        pad_token="<|endoftext|>",  # noqa: S106 - a token string, not a password
        bos_token=None,
        unk_token=None,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        torch_dtype="float32",
    )


def _init_weights(model: Any, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * 0.02)


def create_tiny(path: str | os.PathLike[str], *, seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny model directory at ``path`` (``kiln.host.fs.publish_dir``: staged, synced, then renamed into place;
    ``FileExistsError`` when ``path`` exists, unless ``overwrite``)."""
    target = Path(path)
    if target.exists() and not overwrite:  # refused before torch and transformers are imported
        raise FileExistsError(f"{target} already exists; choose another path or remove it first")
    stage("importing torch and transformers")
    import torch
    from transformers import Qwen2ForCausalLM

    quiet_hub()
    target.parent.mkdir(parents=True, exist_ok=True)
    with publish_dir(target, overwrite=overwrite) as staging:  # an existing target is replaced only once complete
        stage("training the tiny model's tokenizer on its built-in corpus")
        tokenizer = build_tokenizer()
        config = tiny_config(len(tokenizer))
        stage(f"drawing its weights (seed {seed}) and writing them to {target}")
        with torch.device("cpu"):
            model = Qwen2ForCausalLM(config)
        _init_weights(model, seed)
        model.generation_config.do_sample = False
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / COMPLETE_MARKER).write_text(f"seed={seed}\n", encoding="utf-8")
        for written in staging.iterdir():  # safetensors writes 0600: give every file the mode open() would
            os.chmod(written, file_mode())
    return target


def ensure_default_tiny(models_root: Path) -> Path:
    """The default tiny model under ``models_root``, materialised on first use."""
    target = models_root / TINY_NAME
    if (target / COMPLETE_MARKER).is_file():
        return target
    stage(f"building the built-in tiny model under {target} (first use only)")
    try:
        return create_tiny(target, seed=0)
    except FileExistsError:
        if (target / COMPLETE_MARKER).is_file():  # another process won the race
            return target
        raise
