"""qwen4exp: inference engine and OpenAI-compatible server for the Qwen4-Exp architecture."""

__version__ = "0.1.0"  # the one place of the version: pyproject.toml reads it from here

from .engine.request import CompletionOutput, Logprob, RequestOutput, SamplingParams, StructuredOutputsParams
from .entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
