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
