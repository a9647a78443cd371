"""Model clients: the ``LlmClient`` protocol and its implementations."""

from runtime.llm.base import LlmClient, LlmError, LlmRequest, LlmResponse

__all__ = ["LlmClient", "LlmError", "LlmRequest", "LlmResponse"]
