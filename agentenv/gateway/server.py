"""The gateway: an OpenAI-compatible HTTP server inside the rollout process, beside the
reactor, on Starlette and uvicorn, listening on loopback only.

    POST /v1/chat/completions   messages, tools, tool_choice, stream (SSE), logprobs,
                                top_logprobs, temperature, top_p, seed, stop, max_tokens /
                                max_completion_tokens; n > 1 refused
    POST /v1/responses          the Responses API: instructions, input (a string, or message,
                                function_call and function_call_output items), function tools,
                                tool_choice, stream (SSE events), temperature, top_p,
                                max_output_tokens, include=["message.output_text.logprobs"],
                                top_logprobs; stateless: previous_response_id, conversation,
                                store=true, background, prompt and built-in tools refused
    GET  /v1/models             the one model

Both APIs take one path: a Responses request's items become the chat messages that the same
conversation sent to Chat Completions would be (``agentenv.gateway.items``), and the program's
session serves them as it serves a chat request, so extending a sequence, roles, the journal
and a resume's replay hold alike; only the answer's shape differs (``.responses``). The gateway
keeps no responses: a program's only state is its token sequences, which a stored response
would duplicate and a resume would have to rebuild, so a request carries its whole conversation.

Each agent program has a random key (``Authorization: Bearer <key>``, ``<key>:<role>`` for a
role's own sequences, see :func:`role_client`); the key routes the request to the program's
:class:`~agentenv.gateway.session.ProgramSession`. A missing or foreign key gets 401, a key
whose program has ended 410, an oversized or malformed body 400, always with OpenAI's error
object. The server runs on the event loop of the reactor (uvicorn's asyncio server is started
and stopped here, without uvicorn's signal handling or main loop).
"""

from __future__ import annotations

import json
import socket
from collections import OrderedDict
from typing import Any, Callable

import anyio

from ..errors import EngineError
from .messages import MessageError
from .requests import ChatRequest, RequestError, ResponsesRequest, parse_chat, parse_responses
from .responses import completion_body, error_body, logprobs_body, response_body, response_events, stream_events
from .session import Answer, ProgramSession, ReplayMismatch, SessionEnded

#: The largest request body taken (bytes).
MAX_BODY = 8 << 20
#: Ended programs' keys remembered for their 410 (older ones get 401).
ENDED_KEYS = 100_000


def _not_json(name: str) -> Any:
    """``json.loads`` takes ``NaN`` and ``Infinity``, which JSON does not: a number a client
    could only have meant as an error (a NaN temperature) is refused, not sampled with."""
    raise ValueError(f"{name} is not a JSON value")


def role_client(client: Any, role: str) -> Any:
    """``client`` (the ``openai`` client an agent got) for the sequences of ``role`` (a
    sub-agent, a critic): the same program, its requests kept apart and labelled ``role``."""
    if not role or ":" in role:
        raise ValueError(f"a role is a non-empty name without ':', got {role!r}")
    return client.with_options(api_key=f"{str(client.api_key).split(':', 1)[0]}:{role}")


async def start_gateway(tokenizer: Any) -> "Gateway":
    """A started gateway serving the model ``tokenizer`` belongs to (named after its folder)."""
    from pathlib import Path

    name = Path(str(getattr(tokenizer, "name_or_path", "") or "agentenv")).name or "agentenv"
    gateway = Gateway(name, tokenizer=tokenizer)
    await gateway.start()
    return gateway


class Gateway:
    """The server and its programs' keys. ``await start()`` once (on the event loop that runs
    the programs), :meth:`open` / :meth:`close` a program's session, ``await aclose()``."""

    def __init__(self, model_name: str, *, tokenizer: Any, host: str = "127.0.0.1", max_body: int = MAX_BODY) -> None:
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError(f"the gateway listens on loopback only, not {host!r}")
        self.model_name, self.tokenizer, self.host, self.max_body = model_name, tokenizer, host, max_body
        self.sessions: dict[str, ProgramSession] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.requests = self.refused = 0
        self._server: Any = None
        self._http: Any = None
        self.port = 0

    @property
    def url(self) -> str:
        """The base URL an agent's client is given (``.../v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    def client(self, key: str, timeout: float) -> Any:
        """An ``openai.AsyncOpenAI`` for the program with ``key``: the gateway's URL, no
        retries, over one HTTP connection pool that every program's client shares (an SDK
        client's own pool costs an SSL context each, ~0.1 s of CPU); closed with the gateway."""
        import openai

        if self._http is None:
            self._http = openai.DefaultAsyncHttpxClient(timeout=timeout)
        return openai.AsyncOpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=timeout,
                                  http_client=self._http)

    def open(self, session: ProgramSession) -> None:
        self.sessions[session.key] = session

    def close(self, session: ProgramSession) -> None:
        session.end()
        if self.sessions.pop(session.key, None) is not None:
            self.ended[session.key] = None
            while len(self.ended) > ENDED_KEYS:
                self.ended.popitem(last=False)

    async def start(self) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"]),
                                Route("/v1/responses", self._responses, methods=["POST"]),
                                Route("/v1/models", self._models, methods=["GET"])],
                        exception_handlers={404: self._unknown_url, 405: self._unknown_url})
        config = uvicorn.Config(app, host=self.host, port=0, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        config.load()
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on connections of a socket made with
        # it, and without it each reply (headers, then body) waits ~40 ms on Nagle and the
        # client's delayed ACK
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        self._server, self._sock = server, sock

    async def aclose(self) -> None:
        for key in list(self.sessions):
            self.close(self.sessions[key])
        http, self._http = self._http, None
        if http is not None:
            await http.aclose()
        server, self._server = self._server, None
        if server is not None:
            await server.shutdown(sockets=[self._sock])
            self._sock.close()

    # -- HTTP ------------------------------------------------------------------------------------
    def _error(self, status: int, message: str, **kw: Any) -> Any:
        from starlette.responses import JSONResponse

        self.refused += 1
        kind = {401: "authentication_error", 410: "invalid_request_error", 503: "server_error"}.get(
            status, "invalid_request_error")
        return JSONResponse(error_body(message, kind=kind, **kw), status_code=status)

    async def _unknown_url(self, request: Any, exc: Any) -> Any:
        """Another path or method: OpenAI's error object (an SDK reads its message), not text."""
        return self._error(exc.status_code, f"{request.method} {request.url.path} is not served: the gateway serves "
                           "POST /v1/chat/completions, POST /v1/responses and GET /v1/models", code="unknown_url")

    def _session(self, request: Any) -> tuple[ProgramSession | None, str, Any]:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        secret, _, role = key.partition(":")
        session = self.sessions.get(secret)
        if session is not None:
            return session, role or "main", None
        if secret in self.ended:
            return None, "", self._error(410, "this key's agent program has ended; its requests are no longer "
                                         "served", code="program_ended")
        return None, "", self._error(401, "missing or unknown API key: each agent program is given its own key "
                                     "(OPENAI_API_KEY / the client passed to agent())", code="invalid_api_key")

    async def _models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        session, _, refused = self._session(request)
        if session is None:
            return refused
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "agentenv"}]})

    async def _body(self, request: Any) -> Any:
        """The decoded JSON body. It is read in chunks and refused once past ``max_body``, so a
        body without a Content-Length (chunked) is never held whole when it is too large."""
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > self.max_body):
            raise RequestError(f"the request body is over {self.max_body} bytes", code="body_too_large")
        from starlette.requests import ClientDisconnect

        chunks, total = [], 0
        try:
            async for chunk in request.stream():
                total += len(chunk)
                if total > self.max_body:
                    raise RequestError(f"the request body is over {self.max_body} bytes", code="body_too_large")
                chunks.append(chunk)
        except ClientDisconnect:  # the agent went away mid-request (cancelled, past its deadline)
            raise RequestError("the client disconnected before the body arrived", code="client_disconnected") from None
        raw = b"".join(chunks)
        try:
            body = json.loads(raw, parse_constant=_not_json)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        if b"\\ud" in raw or b"\\uD" in raw:  # an escape in \uD800-\uDFFF: is each one half of a pair?
            try:
                json.dumps(body, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError("the request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                                   "without its pair): text must be valid Unicode", code="invalid_unicode") from None
        return body

    async def _serve(self, request: Any, parse: Callable[[Any], Any]) -> Any:
        """Both endpoints' path: the key's session, the body parsed by ``parse`` (a
        :class:`ChatRequest`, or a :class:`ResponsesRequest` served as its ``chat``), the
        session's answer; ``(session, request, answer)``, or the error response."""
        self.requests += 1
        session, role, refused = self._session(request)
        if session is None:
            return refused
        try:
            req = parse(await self._body(request))
            answer = await self._complete(request, session, req.chat if isinstance(req, ResponsesRequest) else req,
                                          role)
            if answer is None:
                return self._error(400, "the client disconnected before the answer", code="client_disconnected")
        except RequestError as exc:
            return self._error(400, str(exc), param=exc.param, code=exc.code)
        except MessageError as exc:  # well-formed, but the model's chat template cannot render it
            return self._error(400, str(exc), param="messages", code="invalid_messages")
        except RecursionError:  # decoding, comparing or hashing a body nested deeper than the stack goes
            return self._error(400, "the request body is nested too deeply", code="invalid_json")
        except SessionEnded:
            return self._error(410, "this key's agent program has ended", code="program_ended")
        except ReplayMismatch as exc:
            return self._error(409, f"{exc}: the agent program starts again", code="replay_mismatch")
        except EngineError as exc:
            return self._error(503, f"the engine failed: {exc}", code="engine_error")
        return session, req, answer

    @staticmethod
    async def _complete(request: Any, session: ProgramSession, req: ChatRequest, role: str) -> Answer | None:
        """The session's answer, or None when the client went away first (an agent that gave
        up on the call: cancelled, past its own timeout). The call is then cancelled, its
        engine request with it, and nothing of it is recorded: the agent never saw that turn,
        so no sequence holds it, and the agent's retry is sampled as the turn it sees."""
        call = anyio.CancelScope()
        outcome: Answer | Exception | None = None

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass  # the body was read whole: nothing else comes before the disconnect
            call.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            with call:
                try:
                    outcome = await session.complete(req, role)
                except Exception as exc:  # noqa: BLE001 - raised below, outside the task group
                    outcome = exc
            tg.cancel_scope.cancel()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _logprobs(self, req: ChatRequest, answer: Answer) -> dict[str, Any] | None:
        gen = answer.gen
        return logprobs_body(self.tokenizer, gen.token_ids, gen.logprobs, req.top_logprobs) if req.logprobs else None

    async def _chat(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        served = await self._serve(request, parse_chat)
        if not isinstance(served, tuple):
            return served
        session, req, answer = served
        gen, lp = answer.gen, self._logprobs(req, answer)
        cid = f"chatcmpl-{session.program}-{answer.index}"
        if req.stream:
            usage = answer.usage() if req.include_usage else None
            return StreamingResponse(stream_events(cid, self.model_name, answer.reply, gen.finish_reason, usage, lp),
                                     media_type="text/event-stream")
        return JSONResponse(completion_body(cid, self.model_name, answer.reply, gen.finish_reason, answer.usage(), lp))

    async def _responses(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        served = await self._serve(request, parse_responses)
        if not isinstance(served, tuple):
            return served
        session, req, answer = served
        lp = self._logprobs(req.chat, answer)
        body = response_body(f"resp_{session.program}_{answer.index}", self.model_name, req, answer.reply,
                             answer.gen.finish_reason, answer.usage(), answer.gen.cached_tokens,
                             lp["content"] if lp else None)
        if req.chat.stream:
            return StreamingResponse(response_events(body), media_type="text/event-stream")
        return JSONResponse(body)
