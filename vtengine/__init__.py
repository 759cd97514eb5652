"""vtengine: a Triton LLM inference engine for Llama-family and Qwen3 dense models."""
__version__ = "0.1.0"

from vtengine import _interpret  # noqa: F401,E402  (before anything imports triton)


def __getattr__(name):
    # the offline API, imported lazily so `import vtengine.levers` stays light
    if name in ("LLM", "SamplingParams"):
        from vtengine.engine import llm, sampling_params
        return {"LLM": getattr(llm, "LLM", None), "SamplingParams": sampling_params.SamplingParams}[name]
    raise AttributeError(name)
