"""A small byte-level BPE tokenizer with Qwen's special tokens and chat template, built offline."""

from __future__ import annotations

import json
import os

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# a vision-language checkpoint's too: an image is <|vision_start|><|image_pad|>...<|vision_end|>
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# one token each, as in Qwen3's vocabulary; not special, so detokenized text keeps them for the reasoning and
# tool-call parsers
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen3's prompt format: tools listed in the system turn with the instruction to answer in <tool_call> JSON, an
# assistant's calls written that way, consecutive tool results as <tool_response>s of one user turn, the reasoning
# of the answers after the last user query in <think>, and `enable_thinking=False` closing the reasoning at once
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- set offset = 0 %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- set offset = 1 %}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided '"
    "'with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    "'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    "'<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[offset:] %}"
    "{%- set i = loop.index0 + offset %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if i > ns.last_query and reasoning %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if i == 0 or messages[i - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[i + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, there was a small engine that could serve large models on a single machine.
Engineers measure throughput in tokens per second and latency in milliseconds; they report medians.
The capital of France is Paris. The capital of Japan is Tokyo. Water boils at 100 degrees Celsius.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))
import torch
x = torch.randn(4, 8)
y = x @ x.t()
{"model": "qwen4exp", "prompt": "Hello, world!", "max_tokens": 16, "temperature": 0.0}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 65536 3.14159 2.71828 -1 +1 1e-6
Punctuation: , . ; : ! ? ' " ( ) [ ] { } < > / \\ | @ # $ % ^ & * - _ = + ~ `
Café, naïve, résumé, façade, jalapeño, Zürich, São Paulo, Kraków.
Привет, как дела? Γειά σου κόσμε. 你好，世界。日本語のテキスト。한국어 문장입니다. مرحبا بالعالم.
Emoji: 😀 🚀 🎉 👍 ❤️ 🐍 — en dash – and ellipsis … «quotes» „more quotes“.
User: What is the weather like today?
Assistant: I cannot check live weather, but I can explain how forecasts are made.
Hyper-connections mix several residual streams; gated delta networks keep a recurrent state per head.
Sparse attention selects the most relevant blocks of the context and always keeps the most recent tokens.
"""


def build_tokenizer(out_dir: str, vocab_size: int = 1024, model_max_length: int = 262144,
                    vision: bool = False) -> dict[str, int]:
    """Train a byte-level BPE on the built-in corpus; write tokenizer.json and tokenizer_config.json. The
    vocabulary, special and added tokens included, holds at most `vocab_size` tokens. Returns the special token
    ids (the VISION_TOKENS' too with `vision`)."""
    special = SPECIAL_TOKENS + (VISION_TOKENS if vision else [])
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special) - len(ADDED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.add_tokens(ADDED_TOKENS)  # before the special tokens: a full vocabulary keeps their ids at its end
    tok.add_special_tokens(special)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in special}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1, ensure_ascii=False)
    return ids
