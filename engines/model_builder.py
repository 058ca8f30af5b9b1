"""Build a Llama with random weights and a locally trained tokenizer (no hub access).

``build_model(out_dir, preset, seed)`` writes a Hugging Face model folder that vLLM loads
with ``HF_HUB_OFFLINE=1``: ``config.json``, ``generation_config.json``, ``model.safetensors``
and a ``PreTrainedTokenizerFast`` (byte-level BPE trained with ``tokenizers`` on
:data:`engines.corpus.CORPUS`) with a chat template, so ``/v1/chat/completions`` works.

Presets:

- ``test``: tiny (2 layers, hidden 256) so vLLM starts in seconds; every cost is so small that
  patience sits on Fairway's 1 s floor, a miss costs ~2x a hit and TWP never narrows.
- ``bench``: sized so the papers' effects exist on a 2-core CPU: a 1,000-token prefill takes
  hundreds of milliseconds, decode step time rises with batch size, and
  ``max_position_embeddings`` is 32,768.

The same ``(preset, seed)`` gives byte-identical weights and tokenizer files. The preset name
is written into ``config.json`` (``pdserve_preset``) and ``pdserve_model.json``, so profiles
and benchmarks can say which preset they ran on; the model card also records
:data:`BUILDER_VERSION`, so a folder an older builder wrote (another chat template, other
tokens) is known as stale (:func:`is_stale`) and rebuilt on deploy.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

Preset = Literal["test", "bench"]

#: The chat template, in the layout vLLM's ``hermes`` tool parser reads (as Hermes- and
#: Qwen-style templates render it): a request's tools are listed in the system turn (after the
#: system message's own text, or in a system turn of their own), an assistant's tool calls are
#: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` after its text, a tool's result
#: is a ``tool`` turn. ``enable_thinking`` (a ``chat_template_kwargs`` entry; vLLM sets it from
#: ``reasoning_effort``) opens the answer with ``<think>``, as reasoning models' templates do.
#: The instructions name the tags without writing them: a ``<tool_call>`` in the prompt reads
#: as the end of reasoning to vLLM's ``qwen3`` reasoning parser (which knows ChatML's turns,
#: not these). A conversation without tools renders as before
#: (``<s><|user|>\nhi</s>\n<|assistant|>\n``).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(skip=-1) %}"
    "{% if tools %}"
    "{{ '<|system|>\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ (messages[0]['content'] or '') + '\\n\\n' }}{% set ns.skip = 0 %}"
    "{% endif %}"
    "{{ 'You may call one or more functions. They are listed in <tools></tools>:\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ (tool | tojson) + '\\n' }}{% endfor %}"
    "{{ '</tools>\\nTo call a function, answer with a JSON object of its name and arguments, '"
    ' + \'{"name": <name>, "arguments": <arguments>}, between tool_call tags.\''
    " + eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}{% if loop.index0 != ns.skip %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) }}"
    "{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]

#: Markup tokens added after training, not special (so decoding keeps them, as in Qwen's and
#: Hermes' tokenizers): the tool-call tags, and the thinking tags vLLM's ``deepseek_r1`` and
#: ``qwen3`` reasoning parsers look up in the vocabulary. Appended after the trained vocabulary,
#: so no trained token's id moves, and within the embedding's padding (see ``build_model``).
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

#: What ``build_model`` writes for a ``(preset, seed)``, versioned: bumped whenever the files
#: change for the same preset and seed (the chat template, the tokenizer's tokens). The model
#: card records it; :func:`is_stale` tells a folder an older builder wrote, which
#: ``deployments.app.ensure_model`` rebuilds. 1: no record (before tools); 2: the hermes tool
#: layout in the chat template and :data:`MARKUP_TOKENS`.
BUILDER_VERSION = 2


@dataclass(frozen=True)
class PresetSpec:
    """Shape of one preset (names as in ``transformers.LlamaConfig``)."""

    vocab_target: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


PRESETS: dict[str, PresetSpec] = {
    "test": PresetSpec(
        vocab_target=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
    ),
    "bench": PresetSpec(
        vocab_target=4096,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=32768,
    ),
}

MODEL_CARD = "pdserve_model.json"


def preset_names() -> list[str]:
    return list(PRESETS)


def train_tokenizer(vocab_target: int) -> object:
    """A ``PreTrainedTokenizerFast`` (byte-level BPE) trained on the shipped corpus.

    Byte-level, so any text tokenizes (no unknown tokens). The vocabulary may stay below
    ``vocab_target`` when the corpus has fewer distinct merges; the model's embedding is sized
    from the trained vocabulary.
    """
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    from engines.corpus import CORPUS

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.splitlines()
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1_000_000,
    )
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(out_dir: str | Path, preset: str = "test", seed: int = 0) -> Path:
    """Write a random-weight Llama of ``preset`` and its tokenizer to ``out_dir``; return it.

    Deterministic for ``(preset, seed)``. ``out_dir`` is created if missing; existing model
    files in it are overwritten. An unknown preset is a ``ValueError`` naming the known ones.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known: {', '.join(PRESETS)}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(spec.vocab_target)
    vocab = len(tokenizer)  # type: ignore[arg-type]
    vocab_padded = ((vocab + 63) // 64) * 64
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>")}  # type: ignore[attr-defined]

    config = LlamaConfig(
        vocab_size=vocab_padded,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    config.pdserve_preset = preset
    config.pdserve_seed = seed

    gen = torch.Generator().manual_seed(seed)
    saved_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Re-draw every parameter from our own generator so the weights do not depend on
    # transformers' init order or the global RNG.
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    torch.random.set_rng_state(saved_rng)
    model = model.bfloat16()
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"]
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]
    card = {
        "preset": preset,
        "seed": seed,
        "builder": BUILDER_VERSION,
        "vocab_size": vocab,
        "params": int(sum(p.numel() for p in model.parameters())),
        **asdict(spec),
    }
    (out / MODEL_CARD).write_text(json.dumps(card, indent=2) + "\n")
    return out


def model_card(model_dir: str | Path) -> dict[str, Any] | None:
    """The model card a folder was built with (``None`` for a model not built here)."""
    card = Path(model_dir) / MODEL_CARD
    if not card.exists():
        return None
    out: dict[str, Any] = json.loads(card.read_text())
    return out


def is_stale(model_dir: str | Path) -> bool:
    """Whether the folder was built here by an older builder (:data:`BUILDER_VERSION`): the
    same preset and seed would now give other files. A model not built here never is."""
    card = model_card(model_dir)
    return card is not None and int(card.get("builder", 1)) < BUILDER_VERSION


def model_preset(model_dir: str | Path) -> str:
    """The preset a folder was built with (``"unknown"`` for a model not built here)."""
    card = model_card(model_dir)
    return "unknown" if card is None else str(card.get("preset", "unknown"))
