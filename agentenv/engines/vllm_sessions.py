"""The former name of :mod:`agentenv.engines.vllm_streams` (deprecated: a "session" in
agentenv is a sandbox session; these are vLLM's streaming-input requests). It re-exports
that module's names, ``session_limit`` being ``stream_limit``."""

from __future__ import annotations

import warnings

from .vllm_streams import InputStream, InputStreams, feed, stream_limit

warnings.warn("agentenv.engines.vllm_sessions is now agentenv.engines.vllm_streams", DeprecationWarning, stacklevel=2)

session_limit = stream_limit

__all__ = ["InputStream", "InputStreams", "feed", "session_limit", "stream_limit"]
