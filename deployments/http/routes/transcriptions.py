"""``POST /v1/audio/transcriptions`` (OpenAI-compatible; a multipart form: ``file``,
``model``, ``language``, ``prompt``, ``temperature``, ``response_format``), answered as
OpenAI answers: ``json`` -> ``{"text"}``, ``text`` -> the text as ``text/plain``,
``verbose_json`` -> ``{"task", "language", "duration", "text", "segments"}``
(https://platform.openai.com/docs/api-reference/audio/createTranscription)."""

# No `from __future__ import annotations` here: FastAPI reads the route signatures at run time.
import hashlib
import json
import math
from functools import partial
from typing import Annotated, Any

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, PrivateAttr

from deployments.http.openapi import INFERENCE_ERRORS, INFERENCE_PARAMETERS, responses
from deployments.http.routes.base import Prepared, Route, from_client
from serve_app.client_wait import prefers_async
from serve_app.errors import InvalidRequestError
from serve_app.kinds import KINDS
from serve_app.request import TranscriptionOutput
from serve_app.schemas import InferenceResult

RESPONSE_FORMATS = ("json", "text", "verbose_json")
WINDOW_S = 30  # Whisper's window (Radford et al. 2022, sec. 2.2): a segment's seek
AUDIO = "The audio file: WAV, FLAC, MP3, OGG, ... (at most `limits.max_audio_bytes`, and " \
    "`limits.max_audio_s` long)."
LANGUAGE = "ISO-639-1 code of the spoken language (e.g. `en`); absent: detected."
FORMATS = "`json` (default), `text` or `verbose_json`."


class TranscriptionForm(BaseModel):
    """A transcription request's form fields, and its file's SHA-256 (what an
    ``Idempotency-Key`` is checked against); the file's bytes and name ride along
    unserialised (no name: a body that came without an upload, a job's)."""

    model: str | None = None
    language: str | None = None
    prompt: str = ""
    temperature: float = 0.0
    response_format: str = "json"
    file_sha256: str
    _data: bytes = PrivateAttr(default=b"")
    _filename: str | None = PrivateAttr(default=None)


class DurationUsage(BaseModel):
    """OpenAI's usage of audio models billed by duration (whole seconds)."""

    type: str = "duration"
    seconds: int


class TranscriptionResponse(BaseModel):
    """``response_format: json``."""

    text: str
    usage: DurationUsage


class TranscriptionSegmentBody(BaseModel):
    """One segment: ``seek`` its window's start in 10 ms frames, ``start``/``end`` in
    seconds, ``tokens`` Whisper's ids (timestamps included)."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float


class VerboseTranscriptionResponse(BaseModel):
    """``response_format: verbose_json``; ``duration`` in seconds, segments with their start
    and end in seconds."""

    task: str
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegmentBody]
    usage: DurationUsage


class TranscriptionsRoute(Route):
    """Speech to text of one audio file (kind ``transcribe``)."""

    kind = KINDS["transcribe"]
    path = "/v1/audio/transcriptions"
    body_model = TranscriptionForm

    def install(self, app: FastAPI) -> None:
        declared = responses(TranscriptionResponse | VerboseTranscriptionResponse,
                             *INFERENCE_ERRORS, inference=True)
        declared.pop(202)  # an upload is not run as a durable job
        declared[200]["content"] = {"text/plain": {"schema": {"type": "string"}}}
        declared[200]["description"] = ("`json`: {text}; `verbose_json`: {task, language, "
                                        "duration, text, segments}; `text`: the text")
        app.post(self.path, response_model=None, responses=declared,
                 openapi_extra={"parameters": INFERENCE_PARAMETERS})(self.transcriptions)

    async def transcriptions(
            self, request: Request, file: Annotated[UploadFile, File(description=AUDIO)],
            model: Annotated[str | None, Form()] = None,
            language: Annotated[str | None, Form(description=LANGUAGE)] = None,
            prompt: Annotated[str, Form()] = "", temperature: Annotated[float, Form()] = 0.0,
            response_format: Annotated[str, Form(description=FORMATS)] = "json") -> Response:
        """``POST /v1/audio/transcriptions`` (OpenAI-compatible, multipart form)."""
        data = await file.read()
        form = TranscriptionForm(model=model, language=language, prompt=prompt,
                                 temperature=temperature, response_format=response_format,
                                 file_sha256=hashlib.sha256(data).hexdigest())
        form._data, form._filename = data, file.filename or ""
        return await self.dispatch(form, request)

    async def handle(self, body: TranscriptionForm, request: Request) -> Response:
        """As :meth:`Route.handle`, without jobs; a ``text`` reply as ``text/plain``."""
        if prefers_async(request.headers) and self.context.jobs is not None:
            raise InvalidRequestError("Prefer: respond-async is not supported for audio "
                                      "uploads (run them as requests)", code="prefer")
        response = await self.context.guard.run(request, body,
                                                lambda: self.respond(body, request))
        if body.response_format != "text" or response.status_code != 200:
            return response
        headers = {k: v for k, v in response.headers.items()
                   if k.lower() not in ("content-length", "content-type")}
        return PlainTextResponse(json.loads(response.body)["text"], headers=headers)

    async def respond(self, body: TranscriptionForm, request: Request) -> JSONResponse:
        prepared = await self.prepare(body, "")
        result = await self.context.client.infer(from_client(prepared.request, request))
        return JSONResponse(prepared.render(result), headers=result.admitted.headers())

    async def prepare(self, body: TranscriptionForm, request_id: str) -> Prepared:
        self.context.check_model(body.model)
        if body._filename is None:  # a body stored without its file (a job)
            raise InvalidRequestError("no audio: transcriptions do not run as durable jobs; "
                                      "send the file to /v1/audio/transcriptions as the "
                                      "multipart field `file`", code="file")
        if not body._data:
            raise InvalidRequestError(f"the uploaded file {body._filename!r} is empty "
                                      "(0 bytes)", code="file")
        if body.response_format not in RESPONSE_FORMATS:
            raise InvalidRequestError(f"response_format={body.response_format!r}: one of "
                                      f"{list(RESPONSE_FORMATS)}", code="response_format")
        if not 0.0 <= body.temperature <= 1.0:
            raise InvalidRequestError(f"temperature={body.temperature}: between 0 and 1",
                                      code="temperature")
        inference = await self.context.factory.build_transcription(
            self.kind, body._data, body.prompt, body.language, body.temperature,
            body.response_format,
            name=f"the uploaded file {body._filename!r} ({len(body._data)} bytes)")
        return Prepared(inference, partial(_render, body))


def _render(body: TranscriptionForm, result: InferenceResult) -> dict[str, Any]:
    """The JSON body of ``json`` / ``text`` (``{"text", "usage"}``; ``text`` is sent as its
    text alone) or ``verbose_json``."""
    output: TranscriptionOutput = result.output
    usage = {"type": "duration", "seconds": math.ceil(output.duration_s)}
    if body.response_format != "verbose_json":
        return {"text": output.text, "usage": usage}
    segments = [{"id": i, "seek": int(s.start_s // WINDOW_S * WINDOW_S * 100),
                 "start": round(s.start_s, 2), "end": round(s.end_s, 2), "text": s.text,
                 "tokens": list(s.tokens), "temperature": body.temperature}
                for i, s in enumerate(output.segments)]
    return {"task": "transcribe", "language": output.language,
            "duration": round(output.duration_s, 3), "text": output.text,
            "segments": segments, "usage": usage}
