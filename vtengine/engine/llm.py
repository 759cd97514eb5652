"""The offline API, mirroring vLLM: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

from itertools import count

from vtengine.config import EngineConfig
from vtengine.engine.llm_engine import LLMEngine
from vtengine.engine.outputs import RequestOutput
from vtengine.engine.sampling_params import RequestError, SamplingParams


class LLM:
    def __init__(self, model: str = "tiny", quant: str = "bf16", backend: str | None = None,
                 levers: dict | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, quant=quant, backend=backend, levers=dict(levers or {}),
                                             **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Prompts: a string, a list of token ids, or a list of either. Returns one RequestOutput per prompt, in
        order, each with ``.outputs[0].token_ids`` and ``.outputs[0].text``."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise RequestError("no prompts given")
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        eng = self.engine
        order = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"offline-{next(self._ids)}"
                eng.add_request(rid, prompt, p)
                order.append(rid)
        except RequestError:
            for rid in order:
                eng.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(order):
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        results = []
        for rid, prompt in zip(order, prompts):
            out = done[rid]
            out.prompt = prompt if isinstance(prompt, str) else None
            out.outputs[0].text = self.tokenizer.decode(out.outputs[0].token_ids)
            results.append(out)
        return results
