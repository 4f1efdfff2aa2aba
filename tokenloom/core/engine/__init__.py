"""The engine, split the way vLLM v1 splits its own:

- :mod:`~tokenloom.core.engine.llm_engine`: :class:`LLMEngine`, the step loop (admission,
  schedule -> execute -> apply tokens, aborts);
- :mod:`~tokenloom.core.engine.input_processor`: prompts tokenized and checked, a request's
  sequences built;
- :mod:`~tokenloom.core.engine.output_processor`: request state, logprobs, text and stops,
  the outputs callers receive;
- :mod:`~tokenloom.core.engine.async_llm`: :class:`AsyncLLM`, the server's front: the engine
  thread and per-request streams, driven by the typed commands of
  :mod:`~tokenloom.core.engine.commands`;
- :mod:`~tokenloom.core.engine.protocol`: :class:`EngineClient`, what the server needs of an
  engine, and :func:`build_engine_client`, which builds one (or ``-dp`` replicas).
"""

from tokenloom.core.engine.async_llm import AsyncLLM
from tokenloom.core.engine.engine_setup import choose_platform
from tokenloom.core.engine.engine_stats import EngineStats
from tokenloom.core.engine.input_processor import InputProcessor, PreparedPrompt
from tokenloom.core.engine.llm_engine import LLMEngine
from tokenloom.core.engine.output_processor import OutputProcessor, RequestState
from tokenloom.core.engine.protocol import EngineClient, build_engine_client

__all__ = [
    "AsyncLLM",
    "EngineClient",
    "EngineStats",
    "InputProcessor",
    "LLMEngine",
    "OutputProcessor",
    "PreparedPrompt",
    "RequestState",
    "build_engine_client",
    "choose_platform",
]
