"""The locally built model: deterministic per seed, loadable by transformers, has a chat template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from engines.model_builder import PRESETS, build_model, model_preset


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_unknown_preset_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model preset 'huge'.*test, bench"):
        build_model(tmp_path, preset="huge")


def test_bench_preset_meets_the_issue_shape() -> None:
    assert PRESETS["bench"].max_position_embeddings >= 32768
    assert PRESETS["bench"].hidden_size > PRESETS["test"].hidden_size


@pytest.mark.slow
def test_same_seed_same_bytes_other_seed_other_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    again = build_model(tmp_path / "again", preset="test", seed=0)
    other = build_model(tmp_path / "other", preset="test", seed=1)
    assert _digest(again) == _digest(tiny_model_dir)
    d_other = _digest(other)
    assert d_other["model.safetensors"] != _digest(tiny_model_dir)["model.safetensors"]
    assert d_other["tokenizer.json"] == _digest(tiny_model_dir)["tokenizer.json"]
    assert model_preset(tiny_model_dir) == "test"
    assert json.loads((tiny_model_dir / "config.json").read_text())["pdserve_seed"] == 0


@pytest.mark.slow
def test_tokenizer_round_trips_and_renders_chat(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Prefix caching turns repeated prompts into cheap requests. Ünïcode 42!"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert max(ids) < json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s><|user|>\nhi</s>\n<|assistant|>\n"


@pytest.mark.slow
def test_the_chat_template_lays_tools_out_as_vllms_hermes_parser_reads_them(
    tiny_model_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": call}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    # the tools in the system turn, after its own text (one system turn, not two)
    assert text.startswith("<s><|system|>\nBe brief.\n\n") and text.count("<|system|>") == 1
    assert json.dumps(tools[0]) in text
    # the call as the hermes parser finds it, and the result as a tool turn
    turn = '<|assistant|>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert turn + "</tool_call></s>\n<|tool|>\nsunny</s>\n<|assistant|>\n" in text
    # arguments already a JSON string (as OpenAI sends them) are written as they are
    msgs[2]["tool_calls"] = [{"function": {**call, "arguments": '{"city": "Rome"}'}}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in text
    thinking = tok.apply_chat_template(
        msgs[1:2], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert thinking.endswith("<|assistant|>\n<think>\n")
    # the markup tags are one token each, kept when decoding
    markup = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
    ids = tok.encode("".join(markup), add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == markup
    assert tok.decode(ids, skip_special_tokens=True) == "".join(markup)


def test_a_model_an_older_builder_wrote_is_rebuilt_as_its_card_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engines.model_builder as mb
    from deployments.app import ensure_model
    from deployments.config import AppConfig

    built: list[tuple[str, str, int]] = []

    def fake_build(out: Path, preset: str = "test", seed: int = 0) -> Path:
        built.append((str(out), preset, seed))
        (Path(out) / "config.json").write_text("{}")
        card = {"preset": preset, "seed": seed, "builder": mb.BUILDER_VERSION}
        (Path(out) / mb.MODEL_CARD).write_text(json.dumps(card))
        return Path(out)

    monkeypatch.setattr(mb, "build_model", fake_build)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / mb.MODEL_CARD).write_text(json.dumps({"preset": "bench", "seed": 3}))  # builder 1
    assert mb.is_stale(folder)
    cfg = AppConfig.model_validate({"model": {"path": str(folder)}})
    ensure_model(cfg)
    assert built == [(str(folder), "bench", 3)] and not mb.is_stale(folder)
    ensure_model(cfg)  # current: left alone
    assert len(built) == 1
    # a stale folder the config does not let pdserve build (an image's) is left as it is
    (folder / mb.MODEL_CARD).write_text(json.dumps({"preset": "test", "seed": 0}))
    ensure_model(AppConfig.model_validate({"model": {"path": str(folder), "build_preset": None}}))
    assert len(built) == 1
    # a model not built here is never stale
    (folder / mb.MODEL_CARD).unlink()
    assert not mb.is_stale(folder)
