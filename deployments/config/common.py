"""What every section shares: the strict base model, a port, a role."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Port = Annotated[int, Field(ge=1024, le=65535)]
Role = Literal["prefill", "decode"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
