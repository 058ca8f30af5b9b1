from __future__ import annotations

import pytest

from controllers.profile import EngineProfile, PrefillTable


def test_table_interpolation_and_below_first_point() -> None:
    t = PrefillTable(prompt_tokens=[100, 200], seconds=[1.0, 3.0])
    assert t.seconds_for(150) == pytest.approx(2.0)
    assert t.seconds_for(50) == pytest.approx(0.5)
    assert t.seconds_for(0) == 0.0
    assert t.seconds_for(300) == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("tokens", "seconds", "msg"),
    [
        ([100, 100], [1.0, 2.0], "strictly increasing"),
        ([100, 200], [2.0, 1.0], "non-decreasing"),
        ([100, 200, 300], [1.0, 2.0], "same length"),
    ],
)
def test_table_errors_name_the_field(tokens: list[int], seconds: list[float], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        PrefillTable(prompt_tokens=tokens, seconds=seconds)


def test_profile_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    prof = EngineProfile.model_validate(
        {
            "hardware": "h",
            "model": "m",
            "block_size": 16,
            "token_budget": 2048,
            "prefill": {"prompt_tokens": [1, 2], "seconds": [0.1, 0.2]},
            "step_cost": {"fixed_s": 0.0, "per_token_s": 0.0, "attn_per_ctx_token_s": 0.0},
            "decode": {"l_min_s": 0.01, "b0": 4, "alpha_s": 0.001},
        }
    )
    path = tmp_path / "p.json"
    prof.dump(path)
    assert EngineProfile.load(path) == prof
    assert prof.decode.step_latency_s(4) == 0.01
    assert prof.decode.step_latency_s(6) == pytest.approx(0.012)
    with pytest.raises(ValueError, match="block_size"):
        EngineProfile.model_validate({**prof.model_dump(), "block_size": 0})
