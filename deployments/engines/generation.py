"""Text generation with a transformers causal LM, streamed piece by piece.

``generate`` runs on the replica's inference thread; each newly decoded piece of text is
handed to a callback as soon as it is final (transformers' ``TextStreamer`` word-boundary
logic), so the replica can stream it and can stop generation when the client goes away.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, TextStreamer

from deployments.engines.decode_batch import DenseDecodeBatch
from deployments.engines.hf import HFEngine, HFFrontEnd, padded
from deployments.engines.runners import GenerationRunner, batch_params
from deployments.engines.stepping import DecodeStepper, SequenceStart, SequenceUpdate, StopStrings
from serve_app.config import AppArgs, config_error
from serve_app.memory.cost_model import TransformerShape
from serve_app.request import GenerationOutput, GenerationParams

logger = logging.getLogger(__name__)


def stop_token_ids(configured: int | Sequence[int] | None,
                   tokenizer_eos: int | None) -> tuple[int, ...]:
    """The token ids that end a completion: ``configured`` (``generation_config.json``'s
    ``eos_token_id``, one id or several, e.g. Llama-3.1-Instruct's ``<|end_of_text|>``,
    ``<|eom_id|>``, ``<|eot_id|>``: what ``model.generate`` stops on), else the tokenizer's
    EOS, else none."""
    if configured is None:
        configured = tokenizer_eos
    if configured is None:
        return ()
    if isinstance(configured, int):
        return (configured,)
    return tuple(dict.fromkeys(int(i) for i in configured))


def pad_token_id(tokenizer_pad: int | None, tokenizer_eos: int | None,
                 stop_ids: Sequence[int], model: str = "") -> int:
    """The id left padding is filled with: the tokenizer's pad token, else (Llama, Mistral
    and GPT-2 tokenizers ship none) its EOS, else the first of ``stop_ids``, else 0 (logged).
    Any id will do: padded positions are masked out of attention and position ids."""
    for candidate in (tokenizer_pad, tokenizer_eos, *stop_ids[:1]):
        if candidate is not None:
            return int(candidate)
    logger.warning("%s: the tokenizer has neither a pad nor an EOS token; padding batches "
                   "with id 0 (masked out)", model or "the model")
    return 0


class _Streamer(TextStreamer):
    """Feeds finalised text through the stop-string filter to ``on_text``; flips ``stopped``
    when the client is gone or a stop string appeared."""

    def __init__(self, tokenizer, stop: StopStrings, on_text: Callable[[str], bool] | None):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self._filter, self._on_text = stop, on_text
        self.cancelled = False

    @property
    def stopped(self) -> bool:
        return self.cancelled or self._filter.hit

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        out = self._filter.feed(text, final=stream_end)
        if out and self._on_text is not None and not self._on_text(out):
            self.cancelled = True


class _StopWhen(StoppingCriteria):
    def __init__(self, streamer: _Streamer) -> None:
        self._streamer = streamer

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> bool:
        return self._streamer.stopped


class GenerationEngine(DecodeStepper, GenerationRunner, HFEngine):
    """A loaded causal LM and its tokenizer (arguments: :class:`HFEngine`), serving
    ``generate`` requests. ``generate_ids`` and ``profile_run`` must be called from one
    thread."""

    kinds = ("generate",)
    auto_class = AutoModelForCausalLM

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stop_ids = stop_token_ids(self.model.generation_config.eos_token_id,
                                       self.tokenizer.eos_token_id)
        self.pad_id = pad_token_id(self.tokenizer.pad_token_id, self.tokenizer.eos_token_id,
                                    self.stop_ids, str(self.path))
        self._running = DenseDecodeBatch(self)

    @classmethod
    def model_shape(cls, config: dict[str, Any], dtype_bytes: int) -> TransformerShape:
        """As :meth:`HFEngine.model_shape`, a decoder even when ``config.json`` names no
        architecture."""
        return TransformerShape.from_hf_config(
            {**config, "architectures": config.get("architectures") or ["CausalLM"]},
            dtype_bytes)

    @classmethod
    def check_args(cls, args: AppArgs) -> None:
        if not args.model.path:
            raise config_error("model.path", "the generate engine needs a causal LM "
                               "directory: the packaged model is an embedding model; set "
                               "model.path to a causal LM directory")
        template = args.model.chat_template
        if template and not Path(template).expanduser().is_file():
            raise config_error("model.chat_template", f"{template} is not a readable file")
        super().check_args(args)

    @classmethod
    def front_end(cls, args: AppArgs) -> HFFrontEnd:
        """:meth:`HFEngine.front_end`, with ``model.chat_template`` when one is set."""
        front = super().front_end(args)
        if args.model.chat_template:
            front.chat_template = Path(args.model.chat_template).expanduser().read_text()
        return front

    def profile_run(self, batch: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """Generate exactly ``new_tokens`` (>= 1) after ``batch`` prompts of ``prompt_tokens``."""
        filler = (self.pad_id + 1) % self.model.get_input_embeddings().num_embeddings
        ids = torch.full((batch, prompt_tokens), filler, device=self.device)
        self._generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                       max_new_tokens=max(1, new_tokens), min_new_tokens=max(1, new_tokens),
                       do_sample=False)

    def generate_ids(self, ids: Sequence[int], params: GenerationParams,
                     on_text: Callable[[str], bool] | None = None) -> GenerationOutput:
        """Complete the prompt ``ids``; see
        :meth:`deployments.engines.base.GenerationRunner.generate_ids`.

        ``finish_reason``: ``stop`` (a stop string or one of :func:`stop_token_ids`),
        ``length`` (``max_tokens`` reached) or ``cancelled`` (``on_text`` returned ``False``).
        Greedy, it generates exactly what ``model.generate(input_ids)`` does.
        """
        prompt_tokens = len(ids)
        stop = StopStrings(params.stop)
        streamer = _Streamer(self.tokenizer, stop, on_text)
        sampling = {"do_sample": False}
        if params.temperature > 0:
            sampling = {"do_sample": True, "temperature": params.temperature,
                        "top_p": params.top_p}
            if params.seed is not None:
                torch.manual_seed(params.seed)  # one inference thread: the global RNG is ours
        inputs = padded([ids], self.pad_id)
        output = self._generate(**{k: v.to(self.device) for k, v in inputs.items()},
                                max_new_tokens=params.max_tokens, streamer=streamer,
                                stopping_criteria=[_StopWhen(streamer)], **sampling)
        new_ids = output[0, prompt_tokens:]
        completion_tokens = int(new_ids.shape[0])
        ended_by_eos = completion_tokens > 0 and int(new_ids[-1]) in self.stop_ids
        if streamer.cancelled:
            reason = "cancelled"
        elif stop.hit or ended_by_eos:
            reason = "stop"
        else:
            reason = "length"
        return GenerationOutput(stop.text, reason, prompt_tokens, completion_tokens)

    def generate_batch_ids(self, ids: Sequence[Sequence[int]],
                           params: Sequence[GenerationParams]) -> list[GenerationOutput]:
        """Complete several prompts in one left-padded batch (see
        :meth:`deployments.engines.base.GenerationRunner.generate_batch_ids`), generating up
        to the largest ``max_tokens``. A row ends at its first stop id (``stop``, any of
        :func:`stop_token_ids`) or after its own ``max_tokens`` (``length``); rows that end
        early are padded by ``generate`` until the longest is done. Prompts are left-padded
        with :func:`pad_token_id` and masked out; ``generate`` counts each row's position ids
        from its first unmasked token (transformers 5: for every model whose ``forward``
        takes ``position_ids``), so greedy rows get their lone completion, text included
        (:meth:`_streamed_text`).

        Measured on the 2-core dev machine (4-layer 256-wide random Llama, 8 prompts x 32
        greedy tokens, 1 torch thread): 0.70 s one at a time, 0.16 s as one batch, the same
        tokens for all 8.

        Raises:
            ValueError: as :func:`deployments.engines.base.batch_params`.
        """
        shared = batch_params(params)
        inputs = padded(ids, self.pad_id, side="left")
        sampling: dict = {"do_sample": False}
        if shared.temperature > 0:
            sampling = {"do_sample": True, "temperature": shared.temperature,
                        "top_p": shared.top_p}
        output = self._generate(**{k: v.to(self.device) for k, v in inputs.items()},
                                max_new_tokens=shared.max_tokens, **sampling)
        padded_prompt = int(inputs["input_ids"].shape[1])
        results = []
        for row, prompt, own in zip(output[:, padded_prompt:].tolist(), ids, params,
                                    strict=True):
            row = row[:own.max_tokens]
            end = next((i for i, token in enumerate(row) if token in self.stop_ids), None)
            ended = end is not None
            new_ids = row[:end + 1] if ended else row
            text = self._streamed_text(new_ids)
            results.append(GenerationOutput(text, "stop" if ended else "length",
                                            len(prompt), len(new_ids)))
        return results

    # --- continuous batching (deployments.engines.stepping) ----------------------------

    @property
    def decode_steps(self) -> bool:
        """Whether sequences can join and leave the running batch between decode steps:
        not for models with sliding-window attention layers (Mistral's ``sliding_window``,
        Gemma 2/3's ``layer_types``), whose cache layers keep only the window and cannot be
        re-padded; their completions run as whole passes."""
        config = self.model.config.get_text_config()
        sliding = getattr(config, "sliding_window", None) is not None and getattr(
            config, "use_sliding_window", True) is not False
        return not sliding and "sliding_attention" not in (
            getattr(config, "layer_types", None) or ())

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's KV cache over all layers (``config.json``'s shape, the loaded dtype)."""
        return self.shape.kv_cache_bytes(1, 1)

    def decode_step(self, joining: Sequence[SequenceStart],
                    leaving: Sequence[int]) -> dict[int, SequenceUpdate]:
        """One continuous-batching step (:class:`deployments.engines.stepping.DecodeStepper`,
        :class:`deployments.engines.decode_batch.DenseDecodeBatch`). Measured on the 2-core
        dev machine: ``python -m benchmarks.generation``."""
        return self._running.step(joining, leaving)

    def kv_tokens_held(self) -> int:
        return self._running.kv_tokens_held()

    def kv_tokens_for(self, rows: Sequence[tuple[int, int]]) -> int:
        return self._running.kv_tokens_for(rows)

    def text_streamer(self, stop: StopStrings, sink: Callable[[str], object]) -> _Streamer:
        """The lone path's token -> text decoder for one completion's new tokens: ``put``
        each token, ``end`` when it ends; ``sink`` gets the text ``stop`` releases."""
        streamer = _Streamer(self.tokenizer, stop, lambda text: sink(text) or True)
        streamer.next_tokens_are_prompt = False
        return streamer

    def _streamed_text(self, new_ids: Sequence[int]) -> str:
        """The text :meth:`generate_ids` gives for completion ``new_ids``: decoded piece by
        piece as its streamer decodes them. One ``decode`` of all ids can differ where the
        ids are bytes that are not UTF-8: a byte-fallback decoder turns every byte of an
        invalid run into U+FFFD, including a valid byte the streamer had already emitted."""
        stop = StopStrings(())
        streamer = self.text_streamer(stop, lambda text: None)
        for token in new_ids:
            streamer.put(torch.tensor([token]))
        streamer.end()
        return stop.text

    @torch.inference_mode()
    def _generate(self, **kwargs) -> torch.Tensor:
        if self.stop_ids:
            kwargs["eos_token_id"] = list(self.stop_ids)
        return self.model.generate(pad_token_id=self.pad_id, **kwargs)
