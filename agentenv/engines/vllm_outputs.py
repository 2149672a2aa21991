"""One vLLM request's way in and out: its prompt and sampling parameters, and the one loop
that reads its outputs into a :class:`~agentenv.engines.base.Generation`.

A plain request and a turn of a streaming-input request (``vllm_streams``) are read by the
same :func:`read_outputs`: the sampled tokens with one logprob each, and the weight version of
each token. Where the engine core labels tokens with versions (vLLM's ``weight_versions``
spans on the final output) the labels say which weights sampled each token; otherwise each
delta is stamped with the engine's version current on its arrival. A trained LoRA adapter is
fixed for a request's life (*pinned*): all its tokens carry the version it was admitted at.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from ..errors import EngineError
from .base import Generation, SamplingParams


def sampling_params(params: SamplingParams, max_tokens: int, output_kind: Any) -> Any:
    """vLLM's ``SamplingParams`` for ``params``: one logprob (the sampled token's) per token,
    no detokenizing, and a stop only at the ids ``params`` names."""
    from vllm import SamplingParams as VSP

    return VSP(
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        logprobs=0,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,  # the contract: a request stops only at the stop ids it names
        detokenize=False,
        skip_special_tokens=False,
        output_kind=output_kind,
    )


def token_prompt(ids: list[int], salt: str) -> Any:
    """A prompt of token ids in the form vLLM's engine takes as it is (``tokens_input``, where
    vLLM has it). ``AsyncLLM`` sends a plain ``TokensPrompt`` through its renderer on a thread
    pool first, a thread hop per request for nothing: token ids need no rendering, and the
    prompt's length is checked either way. Earlier vLLMs get the ``TokensPrompt``."""
    return _prompt_form()(ids, salt)


@functools.cache
def _prompt_form() -> Any:
    """The prompt constructor this vLLM has, looked up once (``token_prompt`` is per request)."""
    try:
        from vllm.inputs.engine import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        return lambda ids, salt: TokensPrompt(prompt_token_ids=ids, cache_salt=salt)
    return lambda ids, salt: tokens_input(ids, cache_salt=salt)


@dataclass(slots=True)
class Outputs:
    """What :func:`read_outputs` read: the last output, and the tokens, logprobs and weight
    versions of everything sampled."""

    last: Any
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]

    @property
    def finish_reason(self) -> str | None:
        return self.last.outputs[0].finish_reason

    def generation(self, params: SamplingParams, prompt_tokens: int, cached: int, version: int,
                   start: float) -> Generation:
        """The :class:`Generation` (``version``: the one the request was admitted at;
        ``start``: when it was submitted, on ``time.perf_counter``'s clock)."""
        tokens, versions = self.tokens, self.versions
        reason = {"stop": "stop", "length": "length"}.get(self.finish_reason or "", "abort")
        stop_tok = tokens[-1] if reason == "stop" and tokens and tokens[-1] in params.stop_token_ids else None
        return Generation(
            token_ids=tokens,
            logprobs=self.logprobs,
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            weight_version=version,
            stop_token_id=stop_tok,
            latency_s=time.perf_counter() - start,
            token_versions=versions if any(v != version for v in versions) else None,
        )


async def read_outputs(outputs: AsyncIterator[Any], *, version: int, pinned: bool, labels: bool,
                       current: Callable[[], int], sampled: int = 0, turn: bool = False) -> Outputs:
    """Read a request's outputs until it finishes: the one stream loop.

    ``version``: the weight version the request was admitted at; ``pinned``: it runs a trained
    adapter (every token carries ``version``); ``labels``: the engine core labels tokens with
    versions, else each delta is stamped with ``current()`` on arrival. ``turn``: the outputs
    are a streaming-input request's, which stays open after a turn: reading stops at the
    turn's finished output, and the turn must have one (``sampled``: the tokens its
    earlier turns sampled, where the version labels of this turn start). A plain request's
    outputs are read to their end (an aborted request may end with no finished output)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    last = None
    async for out in outputs:
        last = out
        n = _take(out, tokens, logprobs)
        if not labels:  # deltas: stamped with the version current on arrival
            versions += [version if pinned else current()] * n
        if turn and out.outputs[0].finish_reason is not None:
            break  # the stream's iterator stays open for its next turn
    if turn and (last is None or last.outputs[0].finish_reason is None):
        raise EngineError("vLLM ended the streaming-input request before the turn did")
    if last is None or not last.outputs:
        raise EngineError("vLLM returned no output")
    if labels:
        # The engine core's labels say which weights sampled each token (an update may have
        # come while the request ran); they index all the stream's sampled tokens so far.
        spans = getattr(last.outputs[0], "weight_versions", None)
        versions = ([version] * len(tokens) if pinned
                    else span_versions(spans, sampled + len(tokens), version)[sampled:])
    return Outputs(last, tokens, logprobs, versions)


def _take(out: Any, tokens: list[int], logprobs: list[float]) -> int:
    """Append one output's new tokens and their sampled logprobs; return how many came."""
    c = out.outputs[0]
    new = list(c.token_ids)
    if c.logprobs is None or len(c.logprobs) != len(new):
        raise EngineError("vLLM returned tokens without one logprob each")
    tokens += new
    logprobs += [float(lp[t].logprob) for lp, t in zip(c.logprobs, new)]
    return len(new)


def span_versions(spans: Any, n: int, admitted: int) -> list[int]:
    """Per-token weight versions from vLLM's ``weight_versions`` spans (labels are our version
    numbers as strings); tokens no span covers carry the version the request was admitted at."""
    out = [admitted] * n
    for span in spans or ():
        try:
            v = int(span.version)
        except (TypeError, ValueError):
            continue  # a label we did not set ("default"): the admission version
        out[span.start:span.end] = [v] * (min(span.end, n) - span.start)
    return out
