"""What a request has produced, as the engine reports it: the text kept per request (incremental
detokenization, stop strings) and the `RequestOutput` of a step, with the deltas since the last one."""

from __future__ import annotations

from dataclasses import dataclass

from nibble.engine.detokenizer import IncrementalDetokenizer, StopChecker
from nibble.engine.request import CompletionOutput, Request, RequestOutput, TokenLogprobs


@dataclass
class TextState:
    """A request's text so far; sent_tokens / sent_text: how much of it earlier outputs carried; prompt: the
    prompt text, when the request came as text."""

    detok: IncrementalDetokenizer | None
    stop: StopChecker
    text: str = ""
    sent_tokens: int = 0
    sent_text: int = 0
    prompt: str | None = None

    def feed(self, token: int, check_stop: bool) -> bool:
        """Detokenize one new token (a no-op without a tokenizer); True when a stop string ended the text
        (looked for only when check_stop: not before min_tokens)."""
        if self.detok is None:
            return False
        piece = self.detok.step([token])
        stopped = False
        if check_stop:
            piece, stopped = self.stop.process(piece)
        self.text += piece
        return stopped

    def finish(self) -> None:
        """The request ended: add the text the detokenizer and the stop checker held back."""
        if self.detok is not None and not self.stop.stopped:
            piece, _ = self.stop.process(self.detok.flush())
            self.text += piece + self.stop.flush()


def store_prompt_logprobs(req: Request, first: int, entries: list[TokenLogprobs]) -> None:
    """Put a step's prompt log-probabilities (for positions first, first + 1, ...) into the request's list
    (entry p: prompt token p's; a request recomputed after preemption writes the same values again)."""
    end = first + len(entries)
    if len(req.prompt_logprobs) < end:
        req.prompt_logprobs.extend([None] * (end - len(req.prompt_logprobs)))
    req.prompt_logprobs[first:end] = entries


def request_output(req: Request, state: TextState) -> RequestOutput:
    """The request's output now, its delta_* fields holding what is new since the last one."""
    delta_ids = req.output_token_ids[state.sent_tokens:]
    delta_lp = req.output_logprobs[state.sent_tokens:] if req.sampling_params.logprobs is not None else []
    delta_text = state.text[state.sent_text:]
    state.sent_tokens = len(req.output_token_ids)
    state.sent_text = len(state.text)
    # Finished outputs get their own lists; intermediate ones share the request's growing lists, so a
    # step costs O(new tokens), not O(all tokens) (streaming consumers read the delta_* fields).
    finished = req.finished
    token_ids = list(req.output_token_ids) if finished else req.output_token_ids
    logprobs = req.output_logprobs if req.sampling_params.logprobs is not None else None
    out = CompletionOutput(
        index=0, text=state.text, token_ids=token_ids,
        logprobs=(list(logprobs) if finished else logprobs) if logprobs is not None else None,
        finish_reason=req.finish_reason, stop_reason=req.stop_reason, delta_text=delta_text,
        delta_token_ids=delta_ids, delta_logprobs=delta_lp)
    metrics = {"arrival_time": req.arrival_time}
    if req.first_token_time is not None:
        metrics["first_token_time"] = req.first_token_time
    prompt_lp = None
    if req.sampling_params.prompt_logprobs is not None:
        prompt_lp = list(req.prompt_logprobs) + [None] * (req.num_prompt_tokens - len(req.prompt_logprobs))
    return RequestOutput(req.request_id, req.prompt_token_ids, [out], finished, error=req.error,
                         prompt=state.prompt, metrics=metrics, num_cached_tokens=req.num_cached_tokens,
                         prompt_logprobs=prompt_lp)
