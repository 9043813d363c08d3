"""The vocabulary of request bodies: the field types every body Struct is declared with, and the
``Body`` base the checks in ``kvindex.http.bodies`` read (the rules live there, not here).

Kept apart so that a dialect's module (``kvindex.http.mooncake``) can declare its Structs without
importing the body reader and everything it needs.

Invariant: the lengths are ``kvindex.limits``'; the ranges are the engines' own (``kvindex.events``).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from kvindex.events import MAX_BLOCK_SIZE, MAX_DP_RANK
from kvindex.limits import (
    MAX_ENDPOINT_CHARS,
    MAX_ID_CHARS,
    MAX_MODEL_CHARS,
    MAX_SALT_CHARS,
)

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]  # a pod, instance, group, LoRA
Model = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MODEL_CHARS)]
Salt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SALT_CHARS)]
Endpoint = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ENDPOINT_CHARS)]
Count = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # (Dynamo's instance ids are i64 lease ids)
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]  # ranges of the engines' own (kvindex.events)
DpRank = Annotated[int, msgspec.Meta(ge=0, le=MAX_DP_RANK)]
RANK_ERROR = f"dp_rank must be an integer from 0 to {MAX_DP_RANK}"  # both dialects' refusal of a DpRank
Pods = list[Id]
# names a dialect may send empty for "not set" (Mooncake): the same lengths, no minimum
BlankId = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
BlankSalt = Annotated[str, msgspec.Meta(max_length=MAX_SALT_CHARS)]
BlankEndpoint = Annotated[str, msgspec.Meta(max_length=MAX_ENDPOINT_CHARS)]


class Body(msgspec.Struct, frozen=True):
    """A request body's checked fields. ``bad``: the refusal per field, when not the default
    ``"<field> must be a non-empty string"``; ``missing``: when not ``"<field> is required"``."""

    bad: ClassVar[dict[str, str]] = {}
    missing: ClassVar[dict[str, str]] = {}
    reasons: ClassVar[tuple[str, str]] = ("missing_field", "bad_field")  # the metric's labels
