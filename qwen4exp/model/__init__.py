from .metadata import StepMetadata
from .model import Qwen4ExpForCausalLM
from .state import AttentionCache, GDNState, ModelCache, allocate_cache

__all__ = ["Qwen4ExpForCausalLM", "StepMetadata", "ModelCache", "AttentionCache", "GDNState", "allocate_cache"]
