"""kvindex.http.bodies: each body's fields refused one at a time, with the field, message,
status and reason label the HTTP API has always answered (no server: the checks are pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvindex.http import bodies as B
from kvindex.http.errors import ApiError


def refusal(fn: Any, *args: Any) -> tuple[str, str | None, int, str]:
    with pytest.raises(ApiError) as info:
        fn(*args)
    err = json.loads(info.value.text or "")
    assert set(err) == {"error", "field"} and "\n" not in err["error"]
    return err["error"], err["field"], info.value.status_code, info.value.reason_label


REGISTER = {"instance_id": 7, "model_name": "m", "endpoint": "tcp://127.0.0.1:5557", "block_size": 16}


def test_a_valid_register_body_and_its_defaults() -> None:
    body = B.parse(REGISTER, B.RegisterBody)
    assert (B.instance_id(body.instance_id), body.model_name, body.block_size, body.dp_rank) == ("7", "m", 16, 0)
    assert body.routing_group is None and body.replay_endpoint is None
    assert B.instance_id(B.parse({**REGISTER, "instance_id": "w-1"}, B.RegisterBody).instance_id) == "w-1"


@pytest.mark.parametrize(("change", "expected"), [
    ({"instance_id": None}, ("instance_id must be a non-negative integer or a non-empty string", "instance_id", 400, "missing_field")),
    ({"instance_id": -1}, ("instance_id must be a non-negative integer or a non-empty string", "instance_id", 400, "bad_field")),
    ({"instance_id": True}, ("instance_id must be a non-negative integer or a non-empty string", "instance_id", 400, "bad_field")),
    ({"model_name": None}, ("model_name is required", "model_name", 400, "missing_field")),
    ({"model_name": ""}, ("model_name must be a non-empty string", "model_name", 400, "bad_field")),
    ({"endpoint": 5}, ("endpoint must be a non-empty string", "endpoint", 400, "bad_field")),
    ({"block_size": 0}, ("block_size must be an integer from 1 to 65536", "block_size", 400, "bad_field")),
    ({"block_size": 16.0}, ("block_size must be an integer from 1 to 65536", "block_size", 400, "bad_field")),
    ({"block_size": 2**64}, ("block_size must be an integer from 1 to 65536", "block_size", 400, "bad_field")),
    ({"block_size": 65537}, ("block_size must be an integer from 1 to 65536", "block_size", 400, "bad_field")),
    ({"instance_id": 2**64}, ("instance_id must be a non-negative integer or a non-empty string", "instance_id", 400, "bad_field")),
    ({"dp_rank": 2**64}, ("dp_rank must be an integer from 0 to 65535", "dp_rank", 400, "bad_field")),
    ({"dp_rank": None}, ("dp_rank is required", "dp_rank", 400, "missing_field")),
    ({"dp_rank": -1}, ("dp_rank must be an integer from 0 to 65535", "dp_rank", 400, "bad_field")),
    ({"routing_group": ""}, ("routing_group must be a non-empty string", "routing_group", 400, "bad_field")),
])
def test_register_refusals_name_the_field(change: dict[str, Any], expected: tuple[str, str, int, str]) -> None:
    body = {k: v for k, v in {**REGISTER, **change}.items() if v is not None or k == "dp_rank"}
    assert refusal(B.parse, body, B.RegisterBody) == expected


def test_score_body_pods_and_limits() -> None:
    assert B.parse({"model": "m", "pods": ["a/b"]}, B.ScoreBody).pods == ["a/b"]
    assert refusal(B.parse, {"model": "m", "pods": ["a", ""]}, B.ScoreBody) == (
        "pods must be an array of pod ids (strings)", "pods", 400, "bad_field")
    assert refusal(B.pods_limit, ["p"] * 3, 2) == ("pods has 3 entries; the limit is 2", "pods", 413, "too_large")
    assert refusal(B.parse, {"token_ids": [1]}, B.ScoreBody) == ("model is required", "model", 400, "missing_field")


def test_query_by_hash_hashes() -> None:
    body = B.parse({"model_name": "m", "block_hashes": [1, -1]}, B.QueryByHashBody)
    assert list(B.block_hashes(body, 8)) == [1, (1 << 64) - 1]
    salted = B.parse({"model_name": "m", "block_hashes": [1], "cache_salt": "s"}, B.QueryByHashBody)
    assert refusal(B.block_hashes, salted, 8)[1:] == ("cache_salt", 400, "bad_request")
    assert refusal(B.block_hashes, B.parse({"model_name": "m", "block_hashes": [True]}, B.QueryByHashBody), 8) == (
        "block_hashes must be an array of 64-bit integers", "block_hashes", 400, "bad_field")
    assert refusal(B.block_hashes, body, 1)[1:] == ("block_hashes", 413, "too_large")


def test_decisions_refusals_keep_their_bad_request_label() -> None:
    assert refusal(B.decision_list, {"request": {"model": "m"}}) == (
        "pod is required: the id of the pod that served the request", "pod", 400, "bad_request")
    assert refusal(B.decision_list, {"pod": "p", "request": []}) == (
        "request is required: the OpenAI body the router sent", "request", 400, "bad_request")
    assert refusal(B.decision_list, {"pod": "p", "request": {}}) == ("request.model is required", "request.model", 400, "bad_request")
    assert refusal(B.decision_list, {"pod": "p", "request": {"model": "m"}, "cached_tokens": -1}) == (
        "cached_tokens must be a non-negative integer", "cached_tokens", 400, "bad_request")
    assert refusal(B.decision_list, {"decisions": [{"pod": "p", "request": {"model": "m"}}, 3]}) == (
        "a decision must be a JSON object", "decision", 400, "bad_request")
    assert refusal(B.decision_list, {"decisions": []})[1] == "decisions"
    items, batch = B.decision_list({"pod": "p", "request": {"model": "m", "prompt": "x"}, "token_ids": [1, 2]})
    assert not batch and items[0].has_token_ids and items[0].token_ids == [1, 2] and items[0].model == "m"


def test_drift_window() -> None:
    assert B.window_seconds(None) is None and B.window_seconds("2.5") == 2.5
    assert refusal(B.window_seconds, "x")[1] == "window"
    assert refusal(B.window_seconds, "-1")[0] == "window must be a positive number of seconds"
