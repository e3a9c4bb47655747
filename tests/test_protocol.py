"""OpenAI protocol models: request validation messages, and responses that the OpenAI SDK's own types accept."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from nibble.server.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    ToolCall,
    UsageInfo,
    error_response,
    format_validation_error,
)

USER = [{"role": "user", "content": "hi"}]


def _error(cls: type, **fields: Any) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        cls(**fields)
    return format_validation_error(info.value)


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"top_k": -2}, "top_k", "greater than or equal to -1"),
        ({"min_p": 1.01}, "min_p", "less than or equal to 1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ({"presence_penalty": -2.5}, "presence_penalty", "greater than or equal to -2"),
        ({"frequency_penalty": 3}, "frequency_penalty", "less than or equal to 2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"n": 0}, "n", "must be between 1 and 64, got 0"),
        ({"n": 65}, "n", "must be between 1 and 64, got 65"),
        ({"best_of": 3}, "best_of", "best_of=1"),
        ({"stop": ["ok", ""]}, "stop", "must not be empty"),
        ({"stop": 5}, "stop", "a string or a list of strings"),
        ({"prompt": []}, "prompt", "must not be an empty list"),
        ({"prompt": {"text": "x"}}, "prompt", "a list of token ids"),
        ({"prompt": [[1], []]}, "prompt", "must not be empty"),
        ({"prompt": [1, -5]}, "prompt", "non-negative"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias", "keys must be token ids, got 'five'"),
        ({"logit_bias": {"5": -101}}, "logit_bias", "values must be in [-100, 100], got -101.0 for token 5"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "non-negative"),
        ({"stop_token_ids": list(range(5000))}, "stop_token_ids", "at most 1024"),
    ],
)
def test_completion_request_errors(fields: dict[str, Any], param: str, fragment: str) -> None:
    message, got_param = _error(CompletionRequest, **{"prompt": "hi", **fields})
    assert got_param == param
    assert message.startswith(f"{param}: ") and fragment in message


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": ["hi"]}, "messages[0]", "valid dictionary"),
        ({"tool_choice": "always"}, "tool_choice", "'required' or a named function"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice", "a named tool choice is"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "'json_schema' or 'structural_tag', got 'yaml'"),
        ({"structured_outputs": {"whitespace_pattern": "x"}}, "structured_outputs", "not supported"),
        ({"top_logprobs": 5}, "top_logprobs", "requires logprobs=true"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools'"),
    ],
)
def test_chat_request_errors(fields: dict[str, Any], param: str, fragment: str) -> None:
    message, got_param = _error(ChatCompletionRequest, **{"messages": USER, **fields})
    assert got_param == param
    assert fragment in message


def test_missing_field_and_several_errors() -> None:
    message, param = _error(CompletionRequest, temperature=-1)
    assert param == "temperature"
    assert "prompt: field required" in message and "temperature:" in message


def test_requests_accept_openai_and_vllm_fields() -> None:
    req = CompletionRequest(
        model="m", prompt=[[1, 2], [3]], stop="END", stream=True, stream_options={"include_usage": True},
        top_k=-1, min_p=0.05, repetition_penalty=1.1, ignore_eos=True, stop_token_ids=[7],
        skip_special_tokens=False, include_stop_str_in_output=True, min_tokens=2, seed=1, logprobs=0,
        unknown_client_field={"anything": 1},
    )  # fmt: skip
    assert req.prompts == [[1, 2], [3]] and req.stop_list == ["END"] and req.include_usage
    assert CompletionRequest(prompt="x").prompts == ["x"]
    assert CompletionRequest(prompt=[5, 6]).prompts == [[5, 6]]
    assert CompletionRequest(prompt=["a", "b"], top_k=0).prompts == ["a", "b"]
    chat = ChatCompletionRequest(
        messages=[*USER, {"role": "assistant", "content": None, "tool_calls": []}],
        max_tokens=10, tool_choice="none", tools=[{"type": "function", "function": {"name": "f"}}],
        chat_template_kwargs={"enable_thinking": False}, response_format={"type": "text"},
        logprobs=True, top_logprobs=3, parallel_tool_calls=True, temperature=0,
    )  # fmt: skip
    assert chat.max_new_tokens == 10 and not chat.enable_thinking and chat.tools_for_template is None
    assert ChatCompletionRequest(messages=USER, max_tokens=5, max_completion_tokens=7).max_new_tokens == 7
    assert ChatCompletionRequest(messages=USER).enable_thinking
    assert not ChatCompletionRequest(messages=USER).include_usage


def test_responses_parse_with_openai_types() -> None:
    usage = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    chat = ChatCompletionResponse(
        model="demo",
        usage=usage,
        choices=[
            ChatCompletionResponseChoice(
                index=0,
                message=ChatMessage(
                    content=None,
                    reasoning_content="thought",
                    tool_calls=[ToolCall(id="call_1", function=FunctionCall(name="f", arguments='{"a": 1}'))],
                ),
                finish_reason="tool_calls",
                logprobs=ChatCompletionLogProbs(
                    content=[ChatCompletionLogProbsContent(token="a", logprob=-0.1, bytes=[97], top_logprobs=[])]
                ),
            )
        ],
    )
    parsed = ChatCompletion.model_validate_json(chat.model_dump_json())
    assert parsed.choices[0].message.tool_calls[0].function.arguments == '{"a": 1}'
    assert parsed.id.startswith("chatcmpl-") and parsed.usage.total_tokens == 5

    delta = DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments="{"))])
    chunk = ChatCompletionStreamResponse(
        id=chat.id, model="demo", choices=[ChatCompletionResponseStreamChoice(index=0, delta=delta)]
    )
    parsed_chunk = ChatCompletionChunk.model_validate_json(chunk.model_dump_json(exclude_none=True))
    assert parsed_chunk.choices[0].delta.tool_calls[0].function.arguments == "{"
    usage_chunk = ChatCompletionStreamResponse(id=chat.id, model="demo", usage=usage)
    assert ChatCompletionChunk.model_validate_json(usage_chunk.model_dump_json()).usage.completion_tokens == 2

    completion = CompletionResponse(
        model="demo",
        usage=usage,
        choices=[
            CompletionResponseChoice(
                index=0,
                text="hello",
                finish_reason="stop",
                stop_reason="END",
                logprobs=CompletionLogProbs(
                    text_offset=[0], token_logprobs=[-0.5], tokens=["hello"], top_logprobs=[{"hello": -0.5}]
                ),
            )
        ],
    )
    assert Completion.model_validate_json(completion.model_dump_json()).choices[0].text == "hello"
    # The SDK builds streamed completions without validation (mid-stream finish_reason is null); the last
    # chunk of a choice also passes its strict type.
    last = CompletionResponseStreamChoice(index=0, text="he", finish_reason="length")
    stream = CompletionStreamResponse(id=completion.id, model="demo", choices=[last])
    assert Completion.model_validate_json(stream.model_dump_json()).choices[0].text == "he"

    models = ModelList(data=[ModelCard(id="demo", root="demo", max_model_len=4096)])
    assert Model.model_validate(models.model_dump()["data"][0]).id == "demo"


def test_error_response_shape() -> None:
    err = error_response("temperature: bad", param="temperature")
    assert err.model_dump() == {
        "error": {"message": "temperature: bad", "type": "invalid_request_error", "param": "temperature", "code": 400}
    }
    assert ErrorResponse.model_validate(err.model_dump()) == err


def test_sampling_params_bounds_stop_token_ids_with_a_short_message() -> None:
    """The offline API (no HTTP layer) refuses an oversized stop_token_ids list too, naming the field and the
    count, without echoing the whole list back."""
    from nibble.engine.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams, SamplingParamsError

    SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))).validate()
    with pytest.raises(SamplingParamsError, match=r"^stop_token_ids .*at most 1024.*got 5000$") as info:
        SamplingParams(stop_token_ids=list(range(5000))).validate()
    assert len(str(info.value)) < 200
