"""Offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)` and `.chat(messages)`."""

from __future__ import annotations

import itertools
import time
from dataclasses import fields

from ..config import EngineConfig
from ..engine.engine import LLMEngine
from ..engine.request import RequestOutput, SamplingParams
from .protocol import ChatCompletionTool, ChatMessage, image_urls


class LLM:
    """`LLM(model, **engine_options)`: every EngineConfig field is a keyword (`dtype`, `device`, `max_model_len`,
    ...). `weights` (an iterator of (name, tensor)), `tokenizer`, `model_config` and `image_processor` (a
    transformers image processor) hand the engine a model held in memory instead of reading it from `model`.

    A prompt with images is vLLM's `{"prompt": text, "multi_modal_data": {"image": image or [images]}}` (an image:
    a PIL image, bytes, a path or a URL), the text holding one `<|vision_start|><|image_pad|><|vision_end|>` per
    image."""

    def __init__(self, model: str | None = None, *, weights=None, tokenizer=None, model_config=None,
                 image_processor=None, **kwargs):
        unknown = sorted(set(kwargs) - {f.name for f in fields(EngineConfig)})
        if unknown:
            names = ", ".join(repr(n) for n in unknown)
            raise TypeError(f"LLM() got unexpected keyword argument{'s' * (len(unknown) > 1)} {names}")
        self.llm_engine = LLMEngine(model, EngineConfig(**kwargs), weights=weights, tokenizer=tokenizer,
                                    model_config=model_config, image_processor=image_processor)
        self._ids = itertools.count()

    def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache's pages and checkpoints; False while requests run."""
        return self.llm_engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the generation config's defaults
        (`generation_config`, `override_generation_config`) over SamplingParams'."""
        return SamplingParams(**self.llm_engine.generation_defaults)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params: must be one SamplingParams or one per prompt")
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                rid = str(next(self._ids))
                self.llm_engine.add_request(rid, prompt, params)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        finally:  # after an error, nothing of this call may stay scheduled (a later call would hit it again)
            for rid in ids:
                self.llm_engine.abort_request(rid)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             chat_template: str | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """`messages` is one conversation (list of {"role", "content", ...}) or a list of conversations, rendered
        as the server renders them: a content may be a list of text parts ({"type": "text", "text": ...}, joined by
        newlines) and, for a model with a vision tower, image parts ({"type": "image_url", "image_url": {"url": ...}}),
        an assistant's `tool_calls`, a tool's `tool_call_id`, `reasoning`. `tools` ({"type": "function",
        "function": {name, description, parameters}}) go to the template; `chat_template` replaces the tokenizer's.
        The outputs are the model's raw text, calls included (as vLLM's LLM.chat)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        tools = [ChatCompletionTool.model_validate(t).for_template() for t in tools] if tools else None
        mm = self.llm_engine.mm_processor
        prompts = []
        for conv in conversations:
            messages = [ChatMessage.model_validate(m) for m in conv]
            ids = tok.apply_chat_template(
                [m.for_template(mm is not None) for m in messages], tools=tools, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
                **(chat_template_kwargs or {}))
            images = image_urls(messages) if mm is not None else []
            if images:
                ids, state = mm.prepare(ids, [url for url, _ in images], "messages", [f for _, f in images])
                prompts.append({"prompt_token_ids": ids, "multi_modal_state": state})
            else:
                prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True,
                       postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        t0 = time.perf_counter()
        n_in = n_out = 0
        wanted = set(ids)
        while engine.has_unfinished_requests() and len(done) < len(ids):
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    n_in += len(out.prompt_token_ids)
                    n_out += sum(len(o.token_ids) for o in out.outputs)
                    if bar is not None:
                        elapsed = time.perf_counter() - t0
                        bar.postfix = (f"est. speed input: {n_in / elapsed:.2f} toks/s, "
                                       f"output: {n_out / elapsed:.2f} toks/s")
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]
