"""The `tiny` preset: a random-weight target and draft model pair and a byte tokenizer.

Built from configs in well under a second with no download, so tests and quick trials run
anywhere. The pair is shaped like the real one (same family, same tokenizer, the draft smaller):

- tokenizer: byte-level, one token per UTF-8 byte (ids 0..255) plus `<|endoftext|>` (256),
  a real `PreTrainedTokenizerFast`, so Hugging Face `generate` and `save_pretrained` work on it,
  with a minimal ChatML chat template (`CHAT_TEMPLATE`; its markers are plain bytes here);
- target: a 4-layer Qwen2; draft: the target's embeddings, first 2 layers and head.

The target's last two layers get smaller weights than its first two, so the draft (which lacks
them) agrees with the target's greedy choice roughly three times in four: both acceptance and
rejection paths are exercised. Weights come from an explicit seeded generator: the same seed
always gives the same models.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

END_OF_TEXT = "<|endoftext|>"
NUM_BYTES = 256
END_OF_TEXT_ID = NUM_BYTES
VOCAB_SIZE = NUM_BYTES + 1
TARGET_LAYERS = 4
DRAFT_LAYERS = 2
DEFAULT_SEED = 0
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + call['function']['name'] + "
    "'\\\", \\\"arguments\\\": ' + (call['function']['arguments'] | tojson) + '}\\n"
    "</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
r"""ChatML, as Qwen2.5's instruct models use it, without their default system message: each
message is `<|im_start|>{role}\n{content}<|im_end|>\n`, then `<|im_start|>assistant\n`. With
`tools`, Qwen2.5's tool prompt opens a system message (the tools as JSON, in `<tools>`, and the
Hermes call syntax: `cluster.api.tool_format_hermes`); an assistant's `tool_calls` are written
as `<tool_call>` JSON and `tool` results as `<tool_response>` in a user message, as Qwen2.5's
template writes them. A conversation of plain messages without tools renders as before."""

# Standard deviations of the random weights, chosen by measuring greedy agreement of the pair
# (about 0.76 over a few code and prose prompts) and a peaked target distribution (mean top
# probability about 0.6) so that sampling tests see both frequent and rare tokens.
_EMBEDDING_STD = 0.6
_SHARED_LAYER_STD = 0.08
_TARGET_ONLY_LAYER_STD = 0.05


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: every byte maps to one printable unicode character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(NUM_BYTES):
        if b not in mapping:
            mapping[b] = chr(NUM_BYTES + shift)
            shift += 1
    return mapping


def build_tokenizer(words: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A byte tokenizer: token id == byte value, plus the end-of-text token; ChatML template.
    `words` take the ids after it, in order (decoded as they are written; never produced by
    encoding, which has no merges)."""
    alphabet = _byte_to_unicode()
    vocab = {char: byte for byte, char in alphabet.items()}
    vocab[END_OF_TEXT] = END_OF_TEXT_ID
    for token_id, word in enumerate(words, start=END_OF_TEXT_ID + 1):
        vocab["".join(alphabet[b] for b in word.encode())] = token_id
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([END_OF_TEXT])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _config(num_layers: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=END_OF_TEXT_ID,
        pad_token_id=END_OF_TEXT_ID,
    )


def _fill_weights(model: Qwen2ForCausalLM, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            elif "bias" in name:
                param.zero_()
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * _EMBEDDING_STD)
            else:
                layer = int(name.split(".")[2])
                std = _SHARED_LAYER_STD if layer < DRAFT_LAYERS else _TARGET_ONLY_LAYER_STD
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def _finish(model: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    model.generation_config.eos_token_id = END_OF_TEXT_ID
    model.generation_config.pad_token_id = END_OF_TEXT_ID
    return model.eval()


def build_target(seed: int = DEFAULT_SEED) -> Qwen2ForCausalLM:
    """The tiny target model, fp32, on the CPU."""
    model = Qwen2ForCausalLM(_config(TARGET_LAYERS))
    _fill_weights(model, torch.Generator().manual_seed(seed))
    return _finish(model)


def build_draft(seed: int = DEFAULT_SEED) -> Qwen2ForCausalLM:
    """The tiny draft model: the target of the same seed cut to its first layers."""
    target_state = build_target(seed).state_dict()
    model = Qwen2ForCausalLM(_config(DRAFT_LAYERS))
    state = {
        key: value
        for key, value in target_state.items()
        if not key.startswith("model.layers.") or int(key.split(".")[2]) < DRAFT_LAYERS
    }
    model.load_state_dict(state, strict=True)
    return _finish(model)
